"""EcsHook against the local ECS endpoint through the official SDK (no mocks)."""
from __future__ import annotations

import json
import logging

import pytest

from gpuboot.ecs import EcsError, EcsHook, RetryPolicy
from tests.simcloud.conformance.ecs_harness import ACCESS_KEY_ID, ACCESS_KEY_SECRET, REGION, ecs_server, wait_until  # noqa: F401

FAST = RetryPolicy(attempts=10, base_seconds=0.01, cap_seconds=0.05, max_total_seconds=10)


@pytest.fixture
def hook(ecs_server, monkeypatch):
    conn = {"conn_type": "alibaba_cloud", "login": ACCESS_KEY_ID, "password": ACCESS_KEY_SECRET,
            "extra": {"region_id": REGION, "endpoint": ecs_server.endpoint, "protocol": "http"}}
    monkeypatch.setenv("AIRFLOW_CONN_ECS_TEST", json.dumps(conn))
    return EcsHook("ecs_test", retry=FAST)


def test_describe_instances_all_and_by_id_in_api_form(hook):
    everything = hook.describe_instances()
    assert {i["InstanceId"] for i in everything} >= {"i-gpu-a", "i-gpu-r1", "i-cpu-1"}
    some = hook.describe_instances(["i-gpu-a", "i-gpu-r1"])
    assert {i["InstanceId"]: i["Status"] for i in some} == {"i-gpu-a": "Stopped", "i-gpu-r1": "Running"}
    assert some[0]["InstanceType"] and "ZoneId" in some[0]


def test_describe_instances_pages_and_batches_past_100_ids(hook, ecs_server):
    from simcloud.ecs_model import Instance
    from tests.simcloud.conformance.ecs_harness import CPU_TYPE

    def add_many():
        for n in range(230):
            ecs_server.cloud.add_instance(Instance(
                instance_id=f"i-bulk-{n:03d}", instance_name=f"bulk-{n}", hostname=f"bulk-{n}",
                instance_type=CPU_TYPE, zone_id="cn-hangzhou-h", region_id=REGION, status="Running",
                stopped_mode="Not-applicable", tags={}, private_ip=f"10.1.{n // 250}.{n % 250}", start_time=None))
    ecs_server.on_loop(add_many)
    ids = [f"i-bulk-{n:03d}" for n in range(230)]
    assert sorted(i["InstanceId"] for i in hook.describe_instances(ids)) == ids
    assert len(hook.describe_instances()) == 236


def test_describe_instance_types_keyed_by_id(hook):
    types = hook.describe_instance_types(["ecs.gn6i-c4g1.xlarge", "ecs.g7.xlarge"])
    assert set(types) == {"ecs.gn6i-c4g1.xlarge", "ecs.g7.xlarge"}
    assert types["ecs.gn6i-c4g1.xlarge"]["GPUAmount"] == 1


def test_start_is_idempotent_and_stop_uses_economical_mode(hook, ecs_server):
    first = hook.start_instances(["i-gpu-a", "i-gpu-r1"])
    assert first["i-gpu-a"].outcome == "done" and first["i-gpu-r1"].outcome == "already"
    again = hook.start_instances(["i-gpu-a"])          # Starting or Running by now: not an error
    assert again["i-gpu-a"].outcome == "already"
    wait_until(lambda: ecs_server.status("i-gpu-a") == "Running", timeout=5)
    stopped = hook.stop_instances(["i-gpu-a"])
    assert stopped["i-gpu-a"].ok
    wait_until(lambda: ecs_server.status("i-gpu-a") == "Stopped", timeout=5)
    assert hook.describe_instances(["i-gpu-a"])[0]["StoppedMode"] == "StopCharging"


def test_start_of_a_stopping_instance_is_reported_for_a_later_start(hook, ecs_server):
    hook.stop_instances(["i-gpu-r1"])
    assert hook.start_instances(["i-gpu-r1"])["i-gpu-r1"].outcome == "stopping"
    assert hook.wait_for_status(["i-gpu-r1"], {"Stopped"}, timeout=5, poll=0.05)["i-gpu-r1"] == "Stopped"
    assert hook.start_instances(["i-gpu-r1"])["i-gpu-r1"].outcome == "done"


def test_unknown_instance_is_a_permanent_failure(hook):
    outcome = hook.start_instances(["i-nope"])["i-nope"]
    assert outcome.outcome == "failed" and outcome.error.kind == "permanent"


def test_throttling_is_retried_with_backoff_and_logged_without_the_secret(hook, ecs_server, caplog):
    ecs_server.faults.update({"ecs_throttle_rate": 0.5})
    caplog.set_level(logging.WARNING, logger="gpuboot.ecs")
    for _ in range(5):
        assert len(hook.describe_instances(["i-gpu-a", "i-gpu-b"])) == 2
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert retries, "a 50% throttle rate over 5+ calls should have caused at least one retry"
    assert all("Throttling" in r.getMessage() for r in retries)
    assert ACCESS_KEY_SECRET not in caplog.text


def test_retries_are_bounded(hook, ecs_server):
    ecs_server.faults.update({"ecs_unavailable_rate": 1.0})
    with pytest.raises(EcsError) as err:
        hook.describe_instances(["i-gpu-a"])
    assert err.value.kind == "transient" and err.value.code == "ServiceUnavailable"
    assert ACCESS_KEY_SECRET not in str(err.value)


def test_no_stock_is_classified_as_capacity(hook, ecs_server):
    ecs_server.faults.update({"no_stock": ["ecs.gn6i-c4g1.xlarge"]})
    outcomes = hook.start_instances(["i-gpu-a", "i-gpu-c"])
    assert outcomes["i-gpu-a"].outcome == "failed"
    assert outcomes["i-gpu-a"].error.kind == "capacity"
    assert outcomes["i-gpu-a"].error.code == "OperationDenied.NoStock"
    assert outcomes["i-gpu-c"].outcome == "done"       # the other type is unaffected


def test_wrong_secret_is_a_permanent_error_that_does_not_echo_it(ecs_server, monkeypatch):
    conn = {"conn_type": "alibaba_cloud", "login": ACCESS_KEY_ID, "password": "not-the-secret-xyz",
            "extra": {"region_id": REGION, "endpoint": ecs_server.endpoint, "protocol": "http"}}
    monkeypatch.setenv("AIRFLOW_CONN_ECS_BAD", json.dumps(conn))
    with pytest.raises(EcsError) as err:
        EcsHook("ecs_bad", retry=FAST).describe_instances()
    assert err.value.kind == "permanent" and "Signature" in err.value.code
    assert "not-the-secret-xyz" not in str(err.value)


def test_missing_region_names_the_field(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_ECS_NOREGION", json.dumps({"conn_type": "alibaba_cloud", "login": "a",
                                                                 "password": "b"}))
    with pytest.raises(ValueError, match="region_id"):
        EcsHook("ecs_noregion").describe_instances()
