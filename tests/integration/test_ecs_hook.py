"""EcsHook against the local ECS endpoint through the official SDK (no mocks)."""
from __future__ import annotations

import json
import logging

import pytest

from gpuboot.hooks.ecs import EcsError, EcsHook, RetryPolicy
from tests.conformance.ecs_harness import ACCESS_KEY_ID, ACCESS_KEY_SECRET, REGION, ecs_server, wait_until  # noqa: F401

FAST = RetryPolicy(attempts=10, base_seconds=0.01, cap_seconds=0.05, max_total_seconds=10)


@pytest.fixture
def hook(ecs_server, monkeypatch):
    conn = {"conn_type": "gpuboot_ecs", "login": ACCESS_KEY_ID, "password": ACCESS_KEY_SECRET,
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
    from simcloud.ecs.model import Instance
    from tests.conformance.ecs_harness import CPU_TYPE

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


def test_describe_price_is_the_hourly_trade_price_and_an_unpriced_type_is_a_permanent_error(hook):
    assert hook.describe_price("ecs.gn6i-c4g1.xlarge", "cn-hangzhou-h") == 1.2
    assert hook.describe_price("ecs.g7.xlarge", None) == 0.2
    with pytest.raises(EcsError) as unpriced:
        hook.describe_price("ecs.gn7i-c32g1.8xlarge", None)          # the harness gives it no price
    assert (unpriced.value.kind, unpriced.value.code) == ("permanent", "PriceNotFound")
    with pytest.raises(EcsError) as unknown:
        hook.describe_price("ecs.nope.large", None)
    assert unknown.value.code == "InvalidInstanceType.ValueNotSupported" and ACCESS_KEY_SECRET not in str(unknown.value)


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
    caplog.set_level(logging.WARNING, logger="gpuboot.hooks.ecs")
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
    conn = {"conn_type": "gpuboot_ecs", "login": ACCESS_KEY_ID, "password": "not-the-secret-xyz",
            "extra": {"region_id": REGION, "endpoint": ecs_server.endpoint, "protocol": "http"}}
    monkeypatch.setenv("AIRFLOW_CONN_ECS_BAD", json.dumps(conn))
    with pytest.raises(EcsError) as err:
        EcsHook("ecs_bad", retry=FAST).describe_instances()
    assert err.value.kind == "permanent" and "Signature" in err.value.code
    assert "not-the-secret-xyz" not in str(err.value)


def test_missing_region_names_the_field(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_ECS_NOREGION", json.dumps({"conn_type": "gpuboot_ecs", "login": "a",
                                                                 "password": "b"}))
    with pytest.raises(ValueError, match="region_id"):
        EcsHook("ecs_noregion").describe_instances()


# -- credential modes (issue 15): every mode the local cloud can serve, none leaking the secret --

def _conn(ecs_server, conn_type: str = "gpuboot_ecs", **fields) -> str:
    extra = {"region_id": REGION, "endpoint": ecs_server.endpoint, "protocol": "http", **fields.pop("extra", {})}
    return json.dumps({"conn_type": conn_type, **fields, "extra": extra})


@pytest.mark.parametrize("extra", [
    {"access_key_id": ACCESS_KEY_ID, "access_key_secret": ACCESS_KEY_SECRET},
    # as older forms store extra fields, with the region under the alibaba provider's `region` name
    {"extra__alibaba_cloud__access_key_id": ACCESS_KEY_ID, "extra__alibaba_cloud__access_key_secret": ACCESS_KEY_SECRET,
     "region_id": None, "region": REGION},
], ids=["alibaba-provider-extras", "prefixed-extras"])
def test_static_keys_from_the_alibaba_providers_extra_fields(ecs_server, monkeypatch, caplog, capfd, extra):
    """A connection made with the form of apache-airflow-providers-alibaba (its type `alibaba_cloud`, the keys
    in extra fields) serves gpuboot as it is, with a warning to give gpuboot its own type (issue 35 #8)."""
    monkeypatch.setenv("AIRFLOW_CONN_ECS_EXTRAS", _conn(ecs_server, "alibaba_cloud", extra=extra))
    caplog.set_level(logging.DEBUG)
    hook = EcsHook("ecs_extras", retry=FAST)
    instances = hook.describe_instances(["i-gpu-a"])
    logged = caplog.text + capfd.readouterr().out
    assert "has type alibaba_cloud, which apache-airflow-providers-alibaba registers too" in logged
    assert "change its type to gpuboot_ecs" in logged and "cannot read its login/password" not in logged
    assert instances[0]["Status"] == "Stopped"
    assert hook.start_instances(["i-gpu-a"])["i-gpu-a"].outcome == "done"
    # what a task would push to XCom, and every log line, are free of the secret
    assert ACCESS_KEY_SECRET not in json.dumps(instances) + caplog.text


def test_login_password_win_and_a_wrong_extra_secret_is_not_echoed(ecs_server, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_ECS_BOTH", _conn(ecs_server, login=ACCESS_KEY_ID, password=ACCESS_KEY_SECRET,
                                                      extra={"access_key_secret": "stale-secret-abc"}))
    assert EcsHook("ecs_both", retry=FAST).statuses(["i-gpu-a"]) == {"i-gpu-a": "Stopped"}
    monkeypatch.setenv("AIRFLOW_CONN_ECS_WRONG", _conn(ecs_server, extra={
        "access_key_id": ACCESS_KEY_ID, "access_key_secret": "wrong-extra-secret-xyz"}))
    with pytest.raises(EcsError) as err:
        EcsHook("ecs_wrong", retry=FAST).statuses(["i-gpu-a"])
    assert err.value.kind == "permanent" and "Signature" in err.value.code
    assert "wrong-extra-secret-xyz" not in str(err.value)


@pytest.mark.parametrize("fields, match", [
    ({"extra": {"credential_mode": "sso"}}, "credential_mode must be one of static, default_chain"),
    ({"login": ACCESS_KEY_ID, "password": ACCESS_KEY_SECRET, "extra": {"credential_mode": "default_chain"}},
     "leave login/password"),
    ({"login": ACCESS_KEY_ID}, r"missing password \(AccessKey secret\) or extra.access_key_secret"),
])
def test_credential_settings_errors_name_fields_not_values(ecs_server, monkeypatch, fields, match):
    monkeypatch.setenv("AIRFLOW_CONN_ECS_CFG", _conn(ecs_server, **fields))
    with pytest.raises(ValueError, match=match) as err:
        EcsHook("ecs_cfg", retry=FAST).get_conn()
    assert ACCESS_KEY_SECRET not in str(err.value)


# alibabacloud_credentials reads its environment variables when first imported: each case of the
# default chain runs in a fresh process, as an Airflow worker starts with its environment. Importing
# Airflow costs seconds, so one helper process imports it (and the hook, which loads the
# Alibaba Cloud libraries only when it connects) and forks a child per case; the child sets the
# case's environment, imports the libraries for the first time and calls ECS.
CHAIN_HOST = """
import json, logging, os, sys
from gpuboot.hooks.ecs import EcsError, EcsHook, RetryPolicy
assert not [m for m in sys.modules if m.startswith(("alibabacloud", "Tea", "darabonba"))], "imported too early"
for line in sys.stdin:
    case = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.environ.update(case["env"])
        out = os.open(case["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, force=True)
        try:
            hook = EcsHook("ecs_chain", retry=RetryPolicy(attempts=3, base_seconds=0.01, cap_seconds=0.02))
            result = {"ok": hook.statuses(["i-gpu-a", "i-gpu-r1"])}
        except EcsError as e:
            result = {"error": [e.kind, e.code, str(e)]}
        with open(case["result"], "w") as fh:
            json.dump(result, fh)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(status, flush=True)
"""


@pytest.fixture(scope="module")
def chain_host():
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALIBABA_CLOUD_")}
    env.update({"PYTHONPATH": f"{repo / 'plugins'}{os.pathsep}{repo}",
                # no instance metadata service or CLI profile here: the chain must stop at what is given
                "ALIBABA_CLOUD_ECS_METADATA_DISABLED": "true", "ALIBABA_CLOUD_CLI_PROFILE_DISABLED": "true"})
    host = subprocess.Popen([sys.executable, "-c", CHAIN_HOST], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    yield host
    host.stdin.close()
    host.wait(timeout=30)


def _run_chain(chain_host, ecs_server, tmp_path, env: dict[str, str]) -> tuple[dict, str]:
    """(the hook's result or error, everything the case wrote to stdout and stderr)."""
    env = {"HOME": str(tmp_path), "AIRFLOW_CONN_ECS_CHAIN": _conn(ecs_server, extra={"credential_mode": "default_chain"}),
           **env}
    case = {"env": env, "output": str(tmp_path / "output.txt"), "result": str(tmp_path / "result.json")}
    chain_host.stdin.write(json.dumps(case) + "\n")
    chain_host.stdin.flush()
    status = chain_host.stdout.readline().strip()
    output = (tmp_path / "output.txt").read_text()
    assert status == "0", f"the case's process ended with status {status!r}:\n{output[-3000:]}"
    return json.loads((tmp_path / "result.json").read_text()), output


def test_default_chain_takes_the_environment_credentials(chain_host, ecs_server, tmp_path):
    result, output = _run_chain(chain_host, ecs_server, tmp_path, {"ALIBABA_CLOUD_ACCESS_KEY_ID": ACCESS_KEY_ID,
                                                       "ALIBABA_CLOUD_ACCESS_KEY_SECRET": ACCESS_KEY_SECRET})
    assert result == {"ok": {"i-gpu-a": "Stopped", "i-gpu-r1": "Running"}}
    assert ACCESS_KEY_SECRET not in output


def test_default_chain_with_a_wrong_environment_secret_is_refused_without_echoing_it(chain_host, ecs_server, tmp_path):
    result, output = _run_chain(chain_host, ecs_server, tmp_path, {"ALIBABA_CLOUD_ACCESS_KEY_ID": ACCESS_KEY_ID,
                                                       "ALIBABA_CLOUD_ACCESS_KEY_SECRET": "env-wrong-secret-123"})
    kind, code, _ = result["error"]
    assert kind == "permanent" and "Signature" in code
    assert "env-wrong-secret-123" not in output


def test_default_chain_without_any_credentials_fails_at_once(chain_host, ecs_server, tmp_path):
    """Nothing in the chain: a permanent error naming the chain, before any ECS call or retry."""
    result, output = _run_chain(chain_host, ecs_server, tmp_path, {})
    kind, code, message = result["error"]
    assert (kind, code) == ("permanent", "InvalidCredentials")
    assert "default credentials chain" in message and "EnvironmentVariableCredentialsProvider" in message
    assert "retrying" not in output


def test_chain_errors_are_redacted_of_secret_values():
    """An STS answer quoted in a chain error (the library does so when a field is missing) keeps
    the key id but loses the secret and the token, as do the chain's secret environment values."""
    from gpuboot.hooks.ecs import _redact

    quoted = ('CredentialException: error retrieving credentials from oidc_role_arn result: {"Credentials": '
              '{"AccessKeyId": "STS.abc", "AccessKeySecret": "tmp-secret-1", "SecurityToken": "tok/en+2=="}}')
    redacted = _redact(quoted + " env-secret-3", ["env-secret-3", None])
    assert "STS.abc" in redacted
    assert not any(s in redacted for s in ("tmp-secret-1", "tok/en+2==", "env-secret-3"))


def test_default_chain_with_rrsa_whose_sts_is_unreachable_keeps_the_oidc_token_out(chain_host, ecs_server, tmp_path):
    """RRSA's variables (ACK's pod identity webhook sets them) with an STS that cannot be reached
    (the local cloud has no STS; a proxy on a closed port refuses the https call): a permanent
    error naming the provider, and the OIDC token, which the library puts in the STS URL it logs
    (through its own stderr handler, with a traceback) and raises, in neither the error nor the output."""
    import socket

    token = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6YWlyZmxvdzp3b3JrZXIifQ.c2lnbmF0dXJl"
    (tmp_path / "token").write_text(token)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    result, output = _run_chain(chain_host, ecs_server, tmp_path, {
        "ALIBABA_CLOUD_OIDC_TOKEN_FILE": str(tmp_path / "token"),
        "ALIBABA_CLOUD_ROLE_ARN": "acs:ram::1234567890:role/gpuboot-ecs",
        "ALIBABA_CLOUD_OIDC_PROVIDER_ARN": "acs:ram::1234567890:oidc-provider/ack-rrsa-c0ffee",
        "HTTPS_PROXY": f"http://127.0.0.1:{closed_port}", "https_proxy": f"http://127.0.0.1:{closed_port}",
        "NO_PROXY": "", "no_proxy": ""})
    kind, code, message = result["error"]
    assert (kind, code) == ("permanent", "InvalidCredentials")
    assert "OIDCRoleArnCredentialsProvider" in message and "OIDCToken=***" in message
    assert "AssumeRoleWithOIDC" in output, "the STS exchange was not even attempted"
    assert token not in output and token[:40] not in output
