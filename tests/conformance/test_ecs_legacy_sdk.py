"""simcloud's ECS endpoint driven by the legacy SDK `aliyun-python-sdk-ecs` (V1 HMAC-SHA1 query signatures)."""
from __future__ import annotations

import json

import pytest
import requests
from aliyunsdkcore.acs_exception.exceptions import ServerException
from aliyunsdkcore.auth.composer import rpc_signature_composer
from aliyunsdkcore.client import AcsClient
from aliyunsdkecs.request.v20140526.DescribeInstancesRequest import DescribeInstancesRequest
from aliyunsdkecs.request.v20140526.DescribeInstanceStatusRequest import DescribeInstanceStatusRequest
from aliyunsdkecs.request.v20140526.DescribeInstanceTypesRequest import DescribeInstanceTypesRequest
from aliyunsdkecs.request.v20140526.StartInstancesRequest import StartInstancesRequest
from aliyunsdkecs.request.v20140526.StopInstancesRequest import StopInstancesRequest

from tests.conformance.ecs_harness import ACCESS_KEY_ID, ACCESS_KEY_SECRET, REGION, ecs_server, wait_until  # noqa: F401


def legacy_client(server, *, key_id=ACCESS_KEY_ID, secret=ACCESS_KEY_SECRET) -> AcsClient:
    # auto_retry off: the SDK would otherwise retry the injected faults with backoff
    return AcsClient(key_id, secret, REGION, auto_retry=False, port=server.port)


def call(server, request, **client_kwargs) -> dict:
    """Point the request at the local endpoint over plain HTTP and return the decoded JSON body."""
    request.set_endpoint("127.0.0.1")
    request.set_protocol_type("http")
    return json.loads(legacy_client(server, **client_kwargs).do_action_with_exception(request))


def server_error(server, request, **client_kwargs) -> ServerException:
    with pytest.raises(ServerException) as caught:
        call(server, request, **client_kwargs)
    return caught.value


def describe(server, **filters) -> list[dict]:
    request = DescribeInstancesRequest()
    request.set_PageSize(100)
    for name, value in filters.items():
        getattr(request, f"set_{name}")(value)
    return call(server, request)["Instances"]["Instance"]


def status_of(server, instance_id: str) -> str:
    (instance,) = describe(server, InstanceIds=json.dumps([instance_id]))
    return instance["Status"]


def start(*ids, **options) -> StartInstancesRequest:
    request = StartInstancesRequest()
    request.set_InstanceIds(list(ids))
    for name, value in options.items():
        getattr(request, f"set_{name}")(value)
    return request


def test_power_cycle(ecs_server):
    body = call(ecs_server, start("i-gpu-b"))
    assert body["RequestId"]
    assert body["InstanceResponses"]["InstanceResponse"][0]["CurrentStatus"] == "Starting"
    wait_until(lambda: status_of(ecs_server, "i-gpu-b") == "Running")
    stop = StopInstancesRequest()
    stop.set_InstanceIds(["i-gpu-b"])
    stop.set_StoppedMode("StopCharging")
    stop.set_ForceStop(False)
    call(ecs_server, stop)
    assert status_of(ecs_server, "i-gpu-b") == "Stopping"
    wait_until(lambda: status_of(ecs_server, "i-gpu-b") == "Stopped")
    (instance,) = describe(ecs_server, InstanceIds='["i-gpu-b"]')
    assert instance["StoppedMode"] == "StopCharging"


def test_describe_instances_shape_and_filters(ecs_server):
    (inst,) = describe(ecs_server, InstanceIds='["i-gpu-a"]')
    assert {k: inst[k] for k in ("InstanceId", "Status", "InstanceType", "Cpu", "Memory", "GPUAmount", "GPUSpec",
                                 "ZoneId", "RegionId", "StoppedMode", "HostName")} == {
        "InstanceId": "i-gpu-a", "Status": "Stopped", "InstanceType": "ecs.gn6i-c4g1.xlarge", "Cpu": 4,
        "Memory": 15360, "GPUAmount": 1, "GPUSpec": "NVIDIA T4", "ZoneId": "cn-hangzhou-h", "RegionId": REGION,
        "StoppedMode": "StopCharging", "HostName": "node-gpu-a"}
    assert inst["VpcAttributes"]["PrivateIpAddress"]["IpAddress"] == ["10.0.0.1"]
    assert sorted(i["InstanceId"] for i in describe(ecs_server, Status="Running")) == ["i-cpu-1", "i-gpu-r1", "i-gpu-r2"]
    tagged = describe(ecs_server, Tags=[{"Key": "pool", "Value": "cpu"}])
    assert [i["InstanceId"] for i in tagged] == ["i-cpu-1"]


def test_token_paging(ecs_server):
    seen, token = [], None
    for _ in range(5):
        request = DescribeInstancesRequest()
        request.set_MaxResults(5)
        if token:
            request.set_NextToken(token)
        body = call(ecs_server, request)
        seen += [i["InstanceId"] for i in body["Instances"]["Instance"]]
        token = body["NextToken"]
        if not token:
            break
    assert len(seen) == len(set(seen)) == 6


def test_describe_instance_status_and_types(ecs_server):
    request = DescribeInstanceStatusRequest()
    request.set_InstanceIds(["i-gpu-r1", "i-gpu-a"])
    body = call(ecs_server, request)
    assert {s["InstanceId"]: s["Status"] for s in body["InstanceStatuses"]["InstanceStatus"]} == {
        "i-gpu-r1": "Running", "i-gpu-a": "Stopped"}
    types = call(ecs_server, DescribeInstanceTypesRequest())["InstanceTypes"]["InstanceType"]
    a10 = next(t for t in types if t["InstanceTypeId"] == "ecs.gn7i-c32g1.8xlarge")
    assert (a10["CpuCoreCount"], a10["MemorySize"], a10["GPUAmount"], a10["GPUSpec"]) == (32, 188.0, 1, "NVIDIA A10")


def test_errors_surface_code_message_and_request_id(ecs_server):
    err = server_error(ecs_server, start("i-gpu-r1"))
    assert (err.get_error_code(), err.get_http_status()) == ("IncorrectInstanceStatus", 403)
    assert err.get_request_id() and "does not support this operation" in err.get_error_msg()
    err = server_error(ecs_server, start("i-missing"))
    assert (err.get_error_code(), err.get_http_status()) == ("InvalidInstanceId.NotFound", 404)
    ecs_server.faults.no_stock = ["ecs.gn6i-c4g1.xlarge@cn-hangzhou-h"]
    err = server_error(ecs_server, start("i-gpu-a"))
    assert (err.get_error_code(), err.get_http_status()) == ("OperationDenied.NoStock", 403)
    err = server_error(ecs_server, start("i-gpu-b", DryRun=True))
    assert err.get_error_code() == "DRYRUN.SUCCESS"


def test_throttling(ecs_server):
    ecs_server.faults.ecs_throttle_rate = 1.0
    err = server_error(ecs_server, DescribeInstancesRequest())
    assert (err.get_error_code(), err.get_http_status()) == ("Throttling.User", 400)
    assert err.get_error_msg() == "Request was denied due to user flow control."


def test_wrong_secret(ecs_server):
    err = server_error(ecs_server, DescribeInstancesRequest(), secret="not-the-secret")
    # the server's string to sign equals the client's, so the SDK itself concludes the secret is wrong
    assert (err.get_error_code(), err.get_http_status()) == ("InvalidAccessKeySecret", 400)


def test_unknown_access_key(ecs_server):
    err = server_error(ecs_server, DescribeInstancesRequest(), key_id="LTAI-unknown")
    assert (err.get_error_code(), err.get_http_status()) == ("InvalidAccessKeyId.NotFound", 404)


def signed_url(server, params: dict) -> str:
    """A request URL signed by the legacy SDK's own V1 composer."""
    path, _ = rpc_signature_composer.get_signed_url(
        {"Action": "DescribeInstances", "Version": "2014-05-26", "RegionId": REGION, **params},
        ACCESS_KEY_ID, ACCESS_KEY_SECRET, "JSON", "GET", {})
    return f"http://{server.endpoint}{path}"


def test_tampered_request_is_refused(ecs_server):
    url = signed_url(ecs_server, {"Status": "Running"})
    resp = requests.get(url.replace("Status=Running", "Status=Stopped"), timeout=5)
    body = resp.json()
    assert (resp.status_code, body["Code"]) == (400, "SignatureDoesNotMatch")
    assert set(body) == {"RequestId", "HostId", "Code", "Message", "Recommend"}
    assert ACCESS_KEY_SECRET not in resp.text


def test_replayed_nonce_is_refused(ecs_server):
    url = signed_url(ecs_server, {})
    assert requests.get(url, timeout=5).status_code == 200
    resp = requests.get(url, timeout=5)
    assert (resp.status_code, resp.json()["Code"]) == (400, "SignatureNonceUsed")
