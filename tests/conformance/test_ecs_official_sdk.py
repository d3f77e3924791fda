"""simcloud's ECS endpoint driven by the official SDK `alibabacloud-ecs20140526` (ACS3-HMAC-SHA256)."""
from __future__ import annotations

import asyncio
import json

import pytest
from alibabacloud_ecs20140526 import models as ecs
from alibabacloud_ecs20140526.client import Client
from alibabacloud_tea_openapi import models as open_api_models
from alibabacloud_tea_openapi.exceptions import AlibabaCloudException
from darabonba.runtime import RuntimeOptions

from tests.conformance.ecs_harness import ACCESS_KEY_ID, ACCESS_KEY_SECRET, REGION, ecs_server, wait_until  # noqa: F401


def client_for(server, *, key_id=ACCESS_KEY_ID, secret=ACCESS_KEY_SECRET, signature_algorithm=None) -> Client:
    config = open_api_models.Config(access_key_id=key_id, access_key_secret=secret, endpoint=server.endpoint,
                                    protocol="http", region_id=REGION)
    if signature_algorithm:
        config.signature_algorithm = signature_algorithm
    return Client(config)


@pytest.fixture
def client(ecs_server):
    return client_for(ecs_server)


def api_error(call) -> AlibabaCloudException:
    with pytest.raises(AlibabaCloudException) as caught:
        call()
    return caught.value


def describe(client, **kwargs) -> list:
    body = client.describe_instances(ecs.DescribeInstancesRequest(region_id=REGION, **kwargs)).body
    return body.instances.instance


def status_of(client, instance_id: str) -> str:
    (instance,) = describe(client, instance_ids=json.dumps([instance_id]))
    return instance.status


# ------------------------------------------------------------------ lifecycle

def test_full_power_cycle_observed_through_describe_instances(ecs_server, client):
    resp = client.start_instances(ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-a"]))
    (item,) = resp.body.instance_responses.instance_response
    assert (item.instance_id, item.code, item.previous_status, item.current_status) == \
        ("i-gpu-a", "200", "Stopped", "Starting")
    assert resp.body.request_id
    assert status_of(client, "i-gpu-a") == "Starting"
    wait_until(lambda: status_of(client, "i-gpu-a") == "Running")
    (running,) = describe(client, instance_ids='["i-gpu-a"]')
    assert running.stopped_mode == "Not-applicable" and running.start_time

    client.stop_instances(ecs.StopInstancesRequest(region_id=REGION, instance_id=["i-gpu-a"],
                                                   stopped_mode="StopCharging", force_stop=True))
    assert status_of(client, "i-gpu-a") == "Stopping"
    wait_until(lambda: status_of(client, "i-gpu-a") == "Stopped")
    (stopped,) = describe(client, instance_ids='["i-gpu-a"]')
    assert stopped.stopped_mode == "StopCharging"
    assert [t for t in ecs_server.transitions if t[0] == "i-gpu-a"] == [
        ("i-gpu-a", "Stopped", "Starting"), ("i-gpu-a", "Starting", "Running"),
        ("i-gpu-a", "Running", "Stopping"), ("i-gpu-a", "Stopping", "Stopped")]


def test_single_instance_actions_and_keep_charging_default(ecs_server, client):
    client.start_instance(ecs.StartInstanceRequest(instance_id="i-gpu-b"))
    wait_until(lambda: ecs_server.status("i-gpu-b") == "Running")
    client.stop_instance(ecs.StopInstanceRequest(instance_id="i-gpu-b"))
    wait_until(lambda: ecs_server.status("i-gpu-b") == "Stopped")
    assert describe(client, instance_ids='["i-gpu-b"]')[0].stopped_mode == "KeepCharging"


def test_start_of_running_or_starting_instance_is_incorrect_status(ecs_server, client):
    err = api_error(lambda: client.start_instances(ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-r1"])))
    assert (err.code, err.status_code) == ("IncorrectInstanceStatus", 403)
    assert err.request_id and err.request_id != "None"
    client.start_instance(ecs.StartInstanceRequest(instance_id="i-gpu-a"))
    err = api_error(lambda: client.start_instance(ecs.StartInstanceRequest(instance_id="i-gpu-a")))
    assert err.code == "IncorrectInstanceStatus"
    err = api_error(lambda: client.stop_instance(ecs.StopInstanceRequest(instance_id="i-gpu-b")))
    assert err.code == "IncorrectInstanceStatus"


def test_all_together_is_all_or_nothing(ecs_server, client):
    err = api_error(lambda: client.start_instances(
        ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-a", "i-gpu-r1"])))
    assert err.code == "IncorrectInstanceStatus"
    assert ecs_server.status("i-gpu-a") == "Stopped"


def test_success_first_reports_each_instance(ecs_server, client):
    ecs_server.faults.no_stock = ["ecs.gn7i-c32g1.8xlarge"]
    resp = client.start_instances(ecs.StartInstancesRequest(
        region_id=REGION, instance_id=["i-gpu-a", "i-gpu-r1", "i-gpu-c", "i-nope"], batch_optimization="SuccessFirst"))
    by_id = {r.instance_id: r for r in resp.body.instance_responses.instance_response}
    assert (by_id["i-gpu-a"].code, by_id["i-gpu-a"].current_status) == ("200", "Starting")
    assert (by_id["i-gpu-r1"].code, by_id["i-gpu-r1"].previous_status, by_id["i-gpu-r1"].current_status) == \
        ("IncorrectInstanceStatus", "Running", "Running")
    assert by_id["i-gpu-c"].code == "OperationDenied.NoStock"
    assert by_id["i-nope"].code == "InvalidInstanceId.NotFound"
    assert ecs_server.status("i-gpu-c") == "Stopped"


def test_dry_run(ecs_server, client):
    err = api_error(lambda: client.start_instances(
        ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-a"], dry_run=True)))
    assert (err.code, err.status_code) == ("DRYRUN.SUCCESS", 400)
    err = api_error(lambda: client.start_instances(
        ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-r1"], dry_run=True)))
    assert err.code == "IncorrectInstanceStatus"   # a dry run that would fail says why
    assert ecs_server.status("i-gpu-a") == "Stopped"


def test_unknown_instance_is_not_found(client):
    err = api_error(lambda: client.start_instances(ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-nope"])))
    assert (err.code, err.status_code) == ("InvalidInstanceId.NotFound", 404)
    assert "i-nope" in err.message


@pytest.mark.parametrize("entry", ["ecs.gn6i-c4g1.xlarge", "ecs.gn6i-c4g1.xlarge@cn-hangzhou-h"])
def test_no_stock_by_type_and_by_type_at_zone(ecs_server, client, entry):
    ecs_server.faults.no_stock = [entry]
    err = api_error(lambda: client.start_instances(ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-a"])))
    assert (err.code, err.status_code) == ("OperationDenied.NoStock", 403)
    assert "sold out" in err.message
    assert ecs_server.status("i-gpu-a") == "Stopped"
    # i-gpu-b is the same type in zone i: refused for the bare type, fine for type@zone-h
    if "@" in entry:
        client.start_instances(ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-b"]))
        assert ecs_server.status("i-gpu-b") == "Starting"
    else:
        err = api_error(lambda: client.start_instance(ecs.StartInstanceRequest(instance_id="i-gpu-b")))
        assert err.code == "OperationDenied.NoStock"


# ------------------------------------------------------------------ describe

def test_describe_instances_fields(client):
    (inst,) = describe(client, instance_ids='["i-gpu-c"]')
    assert inst.instance_id == "i-gpu-c"
    assert (inst.instance_type, inst.instance_type_family) == ("ecs.gn7i-c32g1.8xlarge", "ecs.gn7i")
    assert (inst.cpu, inst.memory, inst.gpuamount, inst.gpuspec) == (32, 188 * 1024, 1, "NVIDIA A10")
    assert (inst.zone_id, inst.region_id, inst.status, inst.stopped_mode) == \
        ("cn-hangzhou-h", REGION, "Stopped", "KeepCharging")
    assert inst.host_name == "node-gpu-c" and inst.instance_name == "node-gpu-c"
    assert inst.creation_time
    assert {(t.tag_key, t.tag_value) for t in inst.tags.tag} == {("pool", "gpu"), ("team", "ml")}
    assert inst.vpc_attributes.private_ip_address.ip_address == ["10.0.0.3"]


def test_describe_instances_filters(client):
    ids = lambda **kw: sorted(i.instance_id for i in describe(client, page_size=100, **kw))  # noqa: E731
    assert ids(status="Stopped") == ["i-gpu-a", "i-gpu-b", "i-gpu-c"]
    assert ids(instance_type="ecs.gn6i-c4g1.xlarge") == ["i-gpu-a", "i-gpu-b", "i-gpu-r1"]
    assert ids(zone_id="cn-hangzhou-i") == ["i-gpu-b", "i-gpu-r2"]
    assert ids(instance_ids='["i-gpu-a","i-cpu-1","i-absent"]') == ["i-cpu-1", "i-gpu-a"]
    assert ids(tag=[ecs.DescribeInstancesRequestTag(key="pool", value="cpu")]) == ["i-cpu-1"]
    assert ids(tag=[ecs.DescribeInstancesRequestTag(key="team")]) == \
        ["i-cpu-1", "i-gpu-a", "i-gpu-b", "i-gpu-c", "i-gpu-r1", "i-gpu-r2"]


def test_describe_instances_token_paging(client):
    seen, token, pages = [], None, 0
    while True:
        body = client.describe_instances(
            ecs.DescribeInstancesRequest(region_id=REGION, max_results=4, next_token=token)).body
        pages += 1
        assert body.total_count == 6
        seen += [i.instance_id for i in body.instances.instance]
        token = body.next_token
        if not token:
            break
    assert pages == 2
    assert len(seen) == len(set(seen)) == 6


def test_describe_instances_page_number_paging(client):
    first = client.describe_instances(ecs.DescribeInstancesRequest(region_id=REGION, page_size=5)).body
    second = client.describe_instances(ecs.DescribeInstancesRequest(region_id=REGION, page_size=5, page_number=2)).body
    assert (first.total_count, first.page_number, first.page_size) == (6, 1, 5)
    assert len(first.instances.instance) == 5 and len(second.instances.instance) == 1


def test_describe_instance_status(client):
    body = client.describe_instance_status(ecs.DescribeInstanceStatusRequest(region_id=REGION, page_size=50)).body
    statuses = {s.instance_id: s.status for s in body.instance_statuses.instance_status}
    assert body.total_count == 6
    assert statuses["i-gpu-a"] == "Stopped" and statuses["i-gpu-r1"] == "Running"
    only = client.describe_instance_status(
        ecs.DescribeInstanceStatusRequest(region_id=REGION, instance_id=["i-gpu-b"])).body
    assert [(s.instance_id, s.status) for s in only.instance_statuses.instance_status] == [("i-gpu-b", "Stopped")]


def test_describe_instance_types(client):
    body = client.describe_instance_types(ecs.DescribeInstanceTypesRequest()).body
    types = {t.instance_type_id: t for t in body.instance_types.instance_type}
    assert set(types) == {"ecs.gn6i-c4g1.xlarge", "ecs.gn7i-c32g1.8xlarge", "ecs.g7.xlarge"}
    t4 = types["ecs.gn6i-c4g1.xlarge"]
    assert (t4.cpu_core_count, t4.memory_size, t4.gpuamount, t4.gpuspec, t4.instance_type_family) == \
        (4, 15.0, 1, "NVIDIA T4", "ecs.gn6i")
    assert types["ecs.g7.xlarge"].gpuamount == 0
    one = client.describe_instance_types(ecs.DescribeInstanceTypesRequest(instance_types=["ecs.g7.xlarge"])).body
    assert [t.instance_type_id for t in one.instance_types.instance_type] == ["ecs.g7.xlarge"]
    first = client.describe_instance_types(ecs.DescribeInstanceTypesRequest(max_results=2)).body
    rest = client.describe_instance_types(ecs.DescribeInstanceTypesRequest(max_results=2, next_token=first.next_token)).body
    assert len(first.instance_types.instance_type) == 2 and first.next_token
    assert len(rest.instance_types.instance_type) == 1 and not rest.next_token


# ------------------------------------------------------------------ errors, auth and faults

def test_bad_parameters_are_named(client):
    err = api_error(lambda: client.describe_instances(ecs.DescribeInstancesRequest(region_id=REGION, instance_ids="i-1")))
    assert (err.code, err.status_code) == ("InvalidParameter", 400) and "InstanceIds" in err.message
    err = api_error(lambda: client.describe_instances(ecs.DescribeInstancesRequest()))
    assert err.code == "MissingParameter" and "RegionId" in err.message
    err = api_error(lambda: client.stop_instances(
        ecs.StopInstancesRequest(region_id=REGION, instance_id=["i-gpu-r1"], stopped_mode="Hibernate")))
    assert err.code == "InvalidParameter" and "StoppedMode" in err.message
    err = api_error(lambda: client.describe_instances(
        ecs.DescribeInstancesRequest(region_id=REGION, max_results=2, next_token="garbage!")))
    assert err.code == "InvalidParameter" and "NextToken" in err.message


def test_unknown_action_is_not_found(ecs_server, client):
    err = api_error(lambda: client.call_api(
        open_api_models.Params(action="RunInstances", version="2014-05-26", protocol="HTTP", pathname="/",
                               method="POST", auth_type="AK", style="RPC", req_body_type="formData", body_type="json"),
        open_api_models.OpenApiRequest(query={"RegionId": REGION}), RuntimeOptions()))
    assert (err.code, err.status_code) == ("InvalidAction.NotFound", 404)


def test_wrong_secret_is_signature_mismatch(ecs_server):
    bad = client_for(ecs_server, secret="not-the-secret")
    err = api_error(lambda: describe(bad))
    assert (err.code, err.status_code) == ("SignatureDoesNotMatch", 400)
    assert "not-the-secret" not in err.message and ACCESS_KEY_SECRET not in err.message
    assert err.data["HostId"] and err.data["Recommend"] and err.data["RequestId"] == err.request_id


def test_unknown_access_key(ecs_server):
    err = api_error(lambda: describe(client_for(ecs_server, key_id="LTAI-unknown")))
    assert (err.code, err.status_code) == ("InvalidAccessKeyId.NotFound", 404)


def test_v1_signature_mode_of_the_official_sdk(ecs_server):
    v1 = client_for(ecs_server, signature_algorithm="v2")
    assert len(describe(v1, page_size=100)) == 6
    err = api_error(lambda: describe(client_for(ecs_server, secret="wrong", signature_algorithm="v2")))
    assert err.code == "SignatureDoesNotMatch"


@pytest.mark.parametrize("knob,code,status", [
    ("ecs_throttle_rate", "Throttling.User", 400),
    ("ecs_internal_error_rate", "InternalError", 500),
    ("ecs_unavailable_rate", "ServiceUnavailable", 503),
])
def test_injected_api_faults(ecs_server, client, knob, code, status):
    setattr(ecs_server.faults, knob, 1.0)
    err = api_error(lambda: client.start_instances(ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-a"])))
    assert (err.code, err.status_code) == (code, status)
    assert ecs_server.status("i-gpu-a") == "Stopped"   # a refused call changes nothing
    setattr(ecs_server.faults, knob, 0.0)
    assert describe(client, instance_ids='["i-gpu-a"]')


def test_async_client(ecs_server, client):
    async def scenario():
        await client.start_instances_async(ecs.StartInstancesRequest(region_id=REGION, instance_id=["i-gpu-b"]))
        body = (await client.describe_instances_async(
            ecs.DescribeInstancesRequest(region_id=REGION, instance_ids='["i-gpu-b"]'))).body
        return body.instances.instance[0].status

    assert asyncio.run(scenario()) in ("Starting", "Running")
