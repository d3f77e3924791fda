"""DescribePrice, DescribeAvailableResource, the tag actions and the per-API quota, through both ECS
SDKs: the official `alibabacloud-ecs20140526` (ACS3 signatures, typed models) and the legacy
`aliyun-python-sdk-ecs` (V1 signatures, JSON bodies). Each behaviour is checked through both."""
from __future__ import annotations

import time

import pytest
from alibabacloud_ecs20140526 import models as ecs
from aliyunsdkecs.request.v20140526.DescribeAvailableResourceRequest import DescribeAvailableResourceRequest
from aliyunsdkecs.request.v20140526.DescribeInstancesRequest import DescribeInstancesRequest
from aliyunsdkecs.request.v20140526.DescribePriceRequest import DescribePriceRequest
from aliyunsdkecs.request.v20140526.ListTagResourcesRequest import ListTagResourcesRequest
from aliyunsdkecs.request.v20140526.TagResourcesRequest import TagResourcesRequest
from aliyunsdkecs.request.v20140526.UntagResourcesRequest import UntagResourcesRequest

from tests.conformance.ecs_harness import REGION, ecs_server, wait_until  # noqa: F401
from tests.conformance.test_ecs_legacy_sdk import call, server_error
from tests.conformance.test_ecs_official_sdk import api_error, client_for


def legacy(request_class, **params):
    request = request_class()
    for name, value in params.items():
        getattr(request, f"set_{name}")(value)
    return request


def legacy_error(server, request) -> tuple[str, int]:
    err = server_error(server, request)
    return err.get_error_code(), err.get_http_status()


def official_error(fn) -> tuple[str, int]:
    err = api_error(fn)
    return err.code, err.status_code


# ------------------------------------------------------------------ DescribePrice

def test_describe_price_official(ecs_server):
    client = client_for(ecs_server)
    body = client.describe_price(ecs.DescribePriceRequest(region_id=REGION, resource_type="instance",
                                                          instance_type="ecs.gn6i-c4g1.xlarge", amount=3)).body
    price = body.price_info.price
    assert (price.original_price, price.trade_price, price.discount_price, price.currency) == (3.6, 3.6, 0.0, "USD")
    assert [d.resource for d in price.detail_infos.detail_info] == ["instanceType"]
    assert body.price_info.rules.rule == [] and body.request_id
    assert official_error(lambda: client.describe_price(ecs.DescribePriceRequest(
        region_id=REGION, instance_type="ecs.nope.large"))) == ("InvalidInstanceType.ValueNotSupported", 400)
    assert official_error(lambda: client.describe_price(ecs.DescribePriceRequest(
        region_id=REGION, instance_type="ecs.gn7i-c32g1.8xlarge"))) == ("PriceNotFound", 400)
    assert official_error(lambda: client.describe_price(ecs.DescribePriceRequest(region_id=REGION))) == (
        "MissingParameter", 400)


def test_describe_price_legacy(ecs_server):
    body = call(ecs_server, legacy(DescribePriceRequest, InstanceType="ecs.g7.xlarge", PriceUnit="Hour"))
    assert body["PriceInfo"]["Price"]["TradePrice"] == 0.2 and body["PriceInfo"]["Price"]["Currency"] == "USD"
    assert legacy_error(ecs_server, legacy(DescribePriceRequest, InstanceType="ecs.g7.xlarge",
                                           PriceUnit="Month")) == ("InvalidParameter", 400)
    assert legacy_error(ecs_server, legacy(DescribePriceRequest, InstanceType="ecs.g7.xlarge",
                                           ResourceType="disk")) == ("InvalidParameter", 400)


def test_describe_price_per_zone_and_system_disk_both_sdks(ecs_server):
    """What gpuboot asks (gpuboot.hooks.ecs.EcsHook.describe_price): a type in a zone, per hour."""
    client = client_for(ecs_server)
    body = client.describe_price(ecs.DescribePriceRequest(
        region_id=REGION, resource_type="instance", instance_type="ecs.gn6i-c4g1.xlarge", zone_id="cn-hangzhou-h",
        price_unit="Hour", system_disk=ecs.DescribePriceRequestSystemDisk(category="cloud_essd"))).body
    assert (body.price_info.price.trade_price, body.price_info.price.original_price) == (1.2, 1.2)
    assert official_error(lambda: client.describe_price(ecs.DescribePriceRequest(
        region_id=REGION, instance_type="ecs.gn6i-c4g1.xlarge", zone_id="cn-hangzhou-z"))) == ("InvalidParameter", 400)
    assert official_error(lambda: client.describe_price(ecs.DescribePriceRequest(
        region_id=REGION, instance_type="ecs.gn6i-c4g1.xlarge",
        system_disk=ecs.DescribePriceRequestSystemDisk(category="floppy")))) == ("InvalidParameter", 400)
    legacy_body = call(ecs_server, legacy(DescribePriceRequest, InstanceType="ecs.gn6i-c4g1.xlarge",
                                          ZoneId="cn-hangzhou-h", PriceUnit="Hour", SystemDiskCategory="cloud_essd"))
    assert legacy_body["PriceInfo"]["Price"]["TradePrice"] == 1.2
    assert legacy_error(ecs_server, legacy(DescribePriceRequest, InstanceType="ecs.gn6i-c4g1.xlarge",
                                           SystemDiskCategory="floppy")) == ("InvalidParameter", 400)
    assert legacy_error(ecs_server, legacy(DescribePriceRequest, InstanceType="ecs.gn6i-c4g1.xlarge",
                                           ZoneId="cn-hangzhou-z")) == ("InvalidParameter", 400)


# ------------------------------------------------------------------ DescribeAvailableResource

def test_available_resource_follows_the_no_stock_fault_official(ecs_server):
    client = client_for(ecs_server)

    def stock(**kw):
        body = client.describe_available_resource(ecs.DescribeAvailableResourceRequest(
            region_id=REGION, destination_resource="InstanceType", **kw)).body
        return {(z.zone_id, r.value): (r.status, r.status_category)
                for z in body.available_zones.available_zone
                for res in z.available_resources.available_resource
                for r in res.supported_resources.supported_resource}
    assert stock(instance_type="ecs.gn6i-c4g1.xlarge") == {
        ("cn-hangzhou-h", "ecs.gn6i-c4g1.xlarge"): ("Available", "WithStock"),
        ("cn-hangzhou-i", "ecs.gn6i-c4g1.xlarge"): ("Available", "WithStock")}
    ecs_server.faults.no_stock = ["ecs.gn6i-c4g1.xlarge@cn-hangzhou-h"]
    sold = stock(zone_id="cn-hangzhou-h")
    assert sold[("cn-hangzhou-h", "ecs.gn6i-c4g1.xlarge")] == ("SoldOut", "WithoutStock")
    assert sold[("cn-hangzhou-h", "ecs.g7.xlarge")] == ("Available", "WithStock")
    # what it calls SoldOut, StartInstances refuses
    assert official_error(lambda: client.start_instances(ecs.StartInstancesRequest(
        region_id=REGION, instance_id=["i-gpu-a"]))) == ("OperationDenied.NoStock", 403)
    assert official_error(lambda: client.describe_available_resource(ecs.DescribeAvailableResourceRequest(
        region_id=REGION))) == ("MissingParameter", 400)


def test_available_resource_zone_view_legacy(ecs_server):
    ecs_server.faults.no_stock = ["ecs.gn6i-c4g1.xlarge", "ecs.gn7i-c32g1.8xlarge", "ecs.g7.xlarge"]
    body = call(ecs_server, legacy(DescribeAvailableResourceRequest, DestinationResource="Zone"))
    zones = body["AvailableZones"]["AvailableZone"]
    assert [(z["ZoneId"], z["Status"], z["StatusCategory"]) for z in zones] == [
        ("cn-hangzhou-h", "SoldOut", "WithoutStock"), ("cn-hangzhou-i", "SoldOut", "WithoutStock")]
    assert legacy_error(ecs_server, legacy(DescribeAvailableResourceRequest, DestinationResource="Network")) == (
        "InvalidParameter", 400)


# ------------------------------------------------------------------ tags

def test_tag_untag_list_official(ecs_server):
    client = client_for(ecs_server)
    tag = ecs.TagResourcesRequestTag
    client.tag_resources(ecs.TagResourcesRequest(region_id=REGION, resource_type="instance",
                                                 resource_id=["i-gpu-a", "i-gpu-b"],
                                                 tag=[tag(key="gpuboot:managed", value="true")]))

    def listed(**kw):
        body = client.list_tag_resources(ecs.ListTagResourcesRequest(region_id=REGION, resource_type="instance",
                                                                     **kw)).body
        return sorted((t.resource_id, t.tag_key, t.tag_value) for t in body.tag_resources.tag_resource)
    managed = listed(tag=[ecs.ListTagResourcesRequestTag(key="gpuboot:managed", value="true")])
    assert {r for r, k, _ in managed if k == "gpuboot:managed"} == {"i-gpu-a", "i-gpu-b"}
    body = client.describe_instances(ecs.DescribeInstancesRequest(
        region_id=REGION, tag=[ecs.DescribeInstancesRequestTag(key="gpuboot:managed", value="true")])).body
    assert sorted(i.instance_id for i in body.instances.instance) == ["i-gpu-a", "i-gpu-b"]   # one set of tags

    client.untag_resources(ecs.UntagResourcesRequest(region_id=REGION, resource_type="instance",
                                                     resource_id=["i-gpu-a"], tag_key=["gpuboot:managed"]))
    assert listed(resource_id=["i-gpu-a"]) == [("i-gpu-a", "pool", "gpu"), ("i-gpu-a", "team", "ml")]
    client.untag_resources(ecs.UntagResourcesRequest(region_id=REGION, resource_type="instance",
                                                     resource_id=["i-gpu-a"], all=True))
    assert listed(resource_id=["i-gpu-a"]) == []

    assert official_error(lambda: client.tag_resources(ecs.TagResourcesRequest(
        region_id=REGION, resource_type="instance", resource_id=["i-nope"], tag=[tag(key="k", value="v")]))) == (
        "InvalidResourceId.NotFound", 404)
    assert official_error(lambda: client.tag_resources(ecs.TagResourcesRequest(
        region_id=REGION, resource_type="instance", resource_id=["i-gpu-b"],
        tag=[tag(key="aliyun:reserved", value="v")]))) == ("InvalidTagKey.Malformed", 400)


def test_tag_limits_and_paging_legacy(ecs_server):
    many = {f"Tag.{n}.Key": f"k{n}" for n in range(1, 19)}       # 2 existing + 18 = 20: the limit
    request = legacy(TagResourcesRequest, ResourceType="instance", ResourceIds=["i-gpu-c"])
    for key, value in many.items():
        request.add_query_param(key, value)
    call(ecs_server, request)
    one_more = legacy(TagResourcesRequest, ResourceType="instance", ResourceIds=["i-gpu-c"],
                      Tags=[{"Key": "k19", "Value": "v"}])
    assert legacy_error(ecs_server, one_more) == ("OperationDenied.QuotaExceed", 403)
    listed = call(ecs_server, legacy(ListTagResourcesRequest, ResourceType="instance", ResourceIds=["i-gpu-c"]))
    rows = listed["TagResources"]["TagResource"]
    assert len(rows) == 20 and listed["NextToken"] == ""
    assert legacy_error(ecs_server, legacy(UntagResourcesRequest, ResourceType="disk",
                                           ResourceIds=["i-gpu-c"], TagKeys=["k1"])) == ("InvalidParameter", 400)
    others = ["i-gpu-a", "i-gpu-b", "i-gpu-r1", "i-gpu-r2", "i-cpu-1"]
    call(ecs_server, legacy(TagResourcesRequest, ResourceType="instance", ResourceIds=others,
                            Tags=[{"Key": f"x{n}", "Value": ""} for n in range(5)]))
    rows = 20 + len(others) * (2 + 5)             # every instance carries team=ml
    first = call(ecs_server, legacy(ListTagResourcesRequest, ResourceType="instance", Tags=[{"Key": "team"}]))
    assert len(first["TagResources"]["TagResource"]) == 50 and first["NextToken"]
    rest = call(ecs_server, legacy(ListTagResourcesRequest, ResourceType="instance", Tags=[{"Key": "team"}],
                                   NextToken=first["NextToken"]))
    assert len(rest["TagResources"]["TagResource"]) == rows - 50 and rest["NextToken"] == ""


# ------------------------------------------------------------------ per-API quota

WINDOW = 1.5


def _throttled_until_the_window_ends(ecs_server, attempt, error_of) -> None:
    """Two calls pass, then every call is Throttling.User until WINDOW seconds after the first."""
    ecs_server.faults.ecs_api_quota = {"DescribeInstances": 2}
    ecs_server.faults.ecs_api_quota_window_seconds = WINDOW
    started = time.monotonic()
    attempt()
    attempt()
    refusals = []

    def passes() -> bool:
        code = error_of(attempt)
        if code is not None:
            refusals.append(code)
        return code is None
    wait_until(passes, timeout=WINDOW * 4, interval=0.1)
    assert time.monotonic() - started >= WINDOW - 0.05
    assert refusals and set(refusals) == {("Throttling.User", 400)}, refusals


def test_quota_official(ecs_server):
    client = client_for(ecs_server)

    def attempt():
        client.describe_instances(ecs.DescribeInstancesRequest(region_id=REGION))

    def error_of(fn):
        try:
            fn()
        except Exception as exc:
            return exc.code, exc.status_code
        return None
    _throttled_until_the_window_ends(ecs_server, attempt, error_of)
    # other APIs have their own quota: untouched
    client.describe_instance_status(ecs.DescribeInstanceStatusRequest(region_id=REGION))


def test_quota_legacy_with_a_default_for_every_api(ecs_server):
    def error_of(fn):
        try:
            fn()
        except pytest.fail.Exception:
            raise
        except Exception as exc:
            return exc.get_error_code(), exc.get_http_status()
        return None
    _throttled_until_the_window_ends(ecs_server, lambda: call(ecs_server, DescribeInstancesRequest()), error_of)
    ecs_server.faults.ecs_api_quota = {"*": 0}
    assert legacy_error(ecs_server, legacy(DescribePriceRequest, InstanceType="ecs.g7.xlarge")) == (
        "Throttling.User", 400)
