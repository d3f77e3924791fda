"""The ECS OpenAPI endpoint (version 2014-05-26, RPC style) over an `EcsCloud`.

`POST /` (or `GET /`) with the parameters in the query (a form body is merged in,
as the SDKs may send one). Each request is authenticated first (ACS3-HMAC-SHA256
or V1 signatures, see `signing`), then counted against its per-API quota
(`quota`), then the injected API faults are drawn, then the action runs (power and
describe actions here, prices and stock in `catalog`, tags in `tags`). Errors are answered like the real service:
`{"RequestId","HostId","Code","Message","Recommend"}` with its HTTP status.
"""
from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from urllib.parse import parse_qsl

from aiohttp import web

from simcloud.config import Faults
from simcloud.ecs import catalog, signing, tags
from simcloud.ecs.model import STATUSES, EcsCloud, EcsError, Instance, InstanceType, Outcome
from simcloud.ecs.params import (
    Params,
    as_bool,
    check_region,
    json_list,
    missing,
    one_of,
    page,
    repeat_list,
    require,
    tag_filter,
)
from simcloud.ecs.quota import THROTTLED, ApiQuota

log = logging.getLogger(__name__)

API_VERSION = "2014-05-26"
ECS_CLOUD = web.AppKey("ecs_cloud", EcsCloud)   # the app's cloud, for whoever assembles the server
NONCE_TTL_SECONDS = 2 * 15 * 60   # a nonce can be replayed only within the timestamp window; keep it that long

# ---------------------------------------------------------------- representations

def instance_view(i: Instance) -> dict:
    t = i.instance_type
    return {
        "InstanceId": i.instance_id,
        "InstanceName": i.instance_name,
        "HostName": i.hostname,
        "Description": "",
        "Status": i.status,
        "InstanceType": t.instance_type_id,
        "InstanceTypeFamily": t.family,
        "Cpu": t.cpu,
        "Memory": round(t.memory_gib * 1024),
        "GPUAmount": t.gpu,
        "GPUSpec": t.gpu_spec,
        "ZoneId": i.zone_id,
        "RegionId": i.region_id,
        "StoppedMode": i.stopped_mode,
        "StartTime": i.start_time or "",
        "CreationTime": i.creation_time,
        "ExpiredTime": "2099-12-31T15:59Z",
        "InstanceChargeType": "PostPaid",
        "InternetChargeType": "PayByTraffic",
        "InstanceNetworkType": "vpc",
        "IoOptimized": True,
        "OSType": "linux",
        "DeletionProtection": False,
        "Tags": {"Tag": [{"TagKey": k, "TagValue": v} for k, v in i.tags.items()]},
        "VpcAttributes": {"PrivateIpAddress": {"IpAddress": [i.private_ip] if i.private_ip else []},
                          "VpcId": "", "VSwitchId": "", "NatIpAddress": ""},
        "PublicIpAddress": {"IpAddress": []},
        "InnerIpAddress": {"IpAddress": []},
        "OperationLocks": {"LockReason": []},
    }


def instance_type_view(t: InstanceType) -> dict:
    return {
        "InstanceTypeId": t.instance_type_id,
        "InstanceTypeFamily": t.family,
        "CpuCoreCount": t.cpu,
        "MemorySize": float(t.memory_gib),
        "GPUAmount": t.gpu,
        "GPUSpec": t.gpu_spec,
    }


def outcome_view(o: Outcome) -> dict:
    code, message = ("200", "success") if o.ok else (o.error.code, o.error.message)
    return {"InstanceId": o.instance_id, "Code": code, "Message": message,
            "PreviousStatus": o.previous_status, "CurrentStatus": o.current_status}


# ---------------------------------------------------------------- actions

def dry_run_passed(batch: bool = False) -> EcsError:
    """A passing dry run: the batch actions (StartInstances, StopInstances) answer DRYRUN.SUCCESS,
    the single-instance ones DryRunOperation, as their API references say."""
    if batch:
        return EcsError("DRYRUN.SUCCESS", "This request is a dryrun request with successful result.", 400)
    return EcsError("DryRunOperation", "Request validation has been passed with DryRun flag set.", 400)


def power_batch(params: Params, cloud: EcsCloud, act: Callable[..., list[Outcome]], **extra) -> dict:
    check_region(params, cloud)
    ids = repeat_list(params, "InstanceId")
    if not ids:
        raise missing("InstanceId.1")
    all_together = one_of(params, "BatchOptimization", ("AllTogether", "SuccessFirst"), "AllTogether") == "AllTogether"
    dry_run = as_bool(params, "DryRun")
    if dry_run and not all_together:   # the real API answers DRYRUN.SUCCESS regardless of instance state
        raise dry_run_passed(batch=True)
    outcomes = act(ids, all_together=all_together, dry_run=dry_run, **extra)
    if dry_run:
        raise dry_run_passed(batch=True)
    return {"InstanceResponses": {"InstanceResponse": [outcome_view(o) for o in outcomes]}}


def start_instances(params: Params, cloud: EcsCloud) -> dict:
    return power_batch(params, cloud, cloud.start_instances)


def stop_instances(params: Params, cloud: EcsCloud) -> dict:
    return power_batch(params, cloud, cloud.stop_instances, **stop_options(params))


def stop_options(params: Params) -> dict:
    """StoppedMode is validated by the model; ForceStop must be a boolean."""
    return {"stopped_mode": params.get("StoppedMode") or None, "force": as_bool(params, "ForceStop")}


def start_instance(params: Params, cloud: EcsCloud) -> dict:
    dry_run = as_bool(params, "DryRun")
    cloud.start_instances([require(params, "InstanceId")], dry_run=dry_run)
    if dry_run:
        raise dry_run_passed()
    return {}


def stop_instance(params: Params, cloud: EcsCloud) -> dict:
    dry_run = as_bool(params, "DryRun")
    cloud.stop_instances([require(params, "InstanceId")], dry_run=dry_run, **stop_options(params))
    if dry_run:
        raise dry_run_passed()
    return {}


def describe_instances(params: Params, cloud: EcsCloud) -> dict:
    check_region(params, cloud)
    found = cloud.find(
        instance_ids=json_list(params, "InstanceIds"),
        status=one_of(params, "Status", STATUSES),
        instance_type=params.get("InstanceType") or None,
        family=params.get("InstanceTypeFamily") or None,
        zone_id=params.get("ZoneId") or None,
        name=params.get("InstanceName") or None,
        tags=tag_filter(params),
    )
    chunk, paging = page(found, params, max_page=100, default_size=10)
    return {**paging, "Instances": {"Instance": [instance_view(i) for i in chunk]}}


def describe_instance_status(params: Params, cloud: EcsCloud) -> dict:
    check_region(params, cloud)
    ids = repeat_list(params, "InstanceId") or json_list(params, "InstanceIds")
    found = cloud.find(instance_ids=ids or None, zone_id=params.get("ZoneId") or None)
    chunk, paging = page(found, params, max_page=50, default_size=10, token_paging=False)
    paging.pop("NextToken")
    return {**paging, "InstanceStatuses": {"InstanceStatus": [
        {"InstanceId": i.instance_id, "Status": i.status} for i in chunk]}}


def describe_instance_types(params: Params, cloud: EcsCloud) -> dict:
    wanted = set(repeat_list(params, "InstanceTypes", limit=10))
    family = params.get("InstanceTypeFamily") or None
    types = [t for t in cloud.instance_types.values()
             if (not wanted or t.instance_type_id in wanted) and (family is None or t.family == family)]
    chunk, paging = page(types, params, max_page=1600, default_size=1600, page_paging=False)
    return {"NextToken": paging["NextToken"], "InstanceTypes": {"InstanceType": [instance_type_view(t) for t in chunk]}}


ACTIONS: dict[str, Callable[[Params, EcsCloud], dict]] = {
    "StartInstances": start_instances,
    "StartInstance": start_instance,
    "StopInstances": stop_instances,
    "StopInstance": stop_instance,
    "DescribeInstances": describe_instances,
    "DescribeInstanceStatus": describe_instance_status,
    "DescribeInstanceTypes": describe_instance_types,
    "DescribePrice": catalog.describe_price,
    "DescribeAvailableResource": catalog.describe_available_resource,
    "TagResources": tags.tag_resources,
    "UntagResources": tags.untag_resources,
    "ListTagResources": tags.list_tag_resources,
}


# ---------------------------------------------------------------- the HTTP app

class NonceCache:
    """Signature nonces seen recently: a replayed request is refused like the real gateway does."""

    def __init__(self, ttl: float = NONCE_TTL_SECONDS, clock: Callable[[], float] = time.monotonic):
        self._ttl, self._clock, self._seen = ttl, clock, {}

    def claim(self, nonce: str | None) -> None:
        if not nonce:
            return
        now = self._clock()
        if len(self._seen) > 10_000:
            self._seen = {n: t for n, t in self._seen.items() if now - t < self._ttl}
        seen_at = self._seen.get(nonce)
        if seen_at is not None and now - seen_at < self._ttl:
            raise EcsError("SignatureNonceUsed", "Specified signature nonce was used already; "
                           "send a fresh SignatureNonce with every request.", 400)
        self._seen[nonce] = now


FAULTS = (
    ("ecs_throttle_rate", *THROTTLED),
    ("ecs_internal_error_rate", "InternalError",
     "The request processing has failed due to some unknown error, exception or failure.", 500),
    ("ecs_unavailable_rate", "ServiceUnavailable",
     "The request has failed due to a temporary failure of the server.", 503),
)


def make_ecs_app(cloud: EcsCloud, credentials: dict[str, str], faults: Faults, *,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> web.Application:
    """The ECS endpoint. `credentials` maps AccessKeyId -> AccessKeySecret; `rng` draws the
    injected API faults (seed it for reproducible runs); `clock` times the API quotas."""
    rng = rng or random.Random()
    nonces = NonceCache()
    quota = ApiQuota(faults, clock)

    async def handle(request: web.Request) -> web.Response:
        request_id = str(uuid.uuid4()).upper()
        body = await request.read()
        query = parse_qsl(request.rel_url.raw_query_string, keep_blank_values=True)
        form = parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True) if _is_form(request) else []
        params = {**dict(query), **dict(form)}
        action = request.headers.get("x-acs-action") or params.get("Action", "")
        try:
            verified = signing.verify_request(request.method, request.rel_url.raw_path or "/", query, form,
                                              lambda name: request.headers.getall(name, []), body, credentials)
            nonces.claim(verified.nonce)
            version = request.headers.get("x-acs-version") or params.get("Version", "")
            if version != API_VERSION:
                raise EcsError("InvalidVersion", f"Specified parameter Version {version!r} is not valid; "
                               f"this endpoint serves ECS {API_VERSION}.", 400)
            handler = ACTIONS.get(action)
            if handler is not None:
                quota.claim(action)
            for knob, code, message, status in FAULTS:
                if rng.random() < getattr(faults, knob):
                    raise EcsError(code, message, status)
            if handler is None:
                raise EcsError("InvalidAction.NotFound",
                               f"Specified api {action!r} is not found, please check your url and method.", 404)
            result = handler(params, cloud)
        except (EcsError, signing.SignatureError) as e:
            log.info("ecs %s %s -> %s %s", action or "?", request_id, e.status, e.code)
            return _error(request, request_id, e.code, e.message, e.status)
        return _json({"RequestId": request_id, **result}, 200, request_id)

    app = web.Application()
    app.router.add_route("POST", "/", handle)
    app.router.add_route("GET", "/", handle)
    app[ECS_CLOUD] = cloud
    return app


def _is_form(request: web.Request) -> bool:
    return request.content_type == "application/x-www-form-urlencoded"


def _json(payload: dict, status: int, request_id: str) -> web.Response:
    return web.Response(status=status, text=json.dumps(payload), content_type="application/json",
                        charset="utf-8", headers={"x-acs-request-id": request_id})


def _error(request: web.Request, request_id: str, code: str, message: str, status: int) -> web.Response:
    return _json({
        "RequestId": request_id,
        "HostId": request.host,
        "Code": code,
        "Message": message,
        "Recommend": f"https://api.aliyun.com/troubleshoot?q={code}&product=Ecs&requestId={request_id}",
    }, status, request_id)

