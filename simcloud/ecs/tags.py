"""ECS resource tags: TagResources, UntagResources, ListTagResources (ResourceType instance).

Tags live on the instances (the same ones DescribeInstances shows and filters by), so the
RAM-policy opt-in `gpuboot:managed=true` can be set or removed through the API. Limits as
the API reference states them: 1-50 resources and 1-20 tags per call, at most 20 tags per
resource, keys 1-128 characters, values 0-128, neither starting with `aliyun` or `acs:` nor
containing `http://` or `https://`. Every check passes before anything changes.
"""
from __future__ import annotations

from simcloud.ecs.model import EcsCloud, EcsError, Instance
from simcloud.ecs.params import (
    Params,
    as_bool,
    check_region,
    decode_token,
    encode_token,
    invalid,
    missing,
    one_of,
    repeat_list,
)

RESOURCE_TYPES = ("instance", "disk", "snapshot", "image", "securitygroup", "volume", "eni", "ddh",
                  "ddhcluster", "keypair", "launchtemplate", "reservedinstance", "snapshotpolicy",
                  "elasticityassurance", "capacityreservation")
MAX_TAGS_PER_RESOURCE = 20


def _resource_type(params: Params) -> str:
    kind = params.get("ResourceType")
    if not kind:
        raise missing("ResourceType")
    one_of(params, "ResourceType", RESOURCE_TYPES)
    if kind != "instance":
        raise invalid("ResourceType", kind, "instance (simcloud has no other taggable resources)")
    return kind


def _resources(params: Params, cloud: EcsCloud, required: bool) -> list[Instance]:
    ids = repeat_list(params, "ResourceId", limit=50)
    if required and not ids:
        raise missing("ResourceId.1")
    instances = []
    for rid in ids:
        if rid not in cloud.instances:
            raise EcsError("InvalidResourceId.NotFound", f"The specified ResourceIds are not found in our records: "
                           f"{rid}.", 404)
        instances.append(cloud.instances[rid])
    return instances


def _check_text(kind: str, text: str, allow_empty: bool) -> None:
    code = f"InvalidTag{kind}.Malformed"
    if (not text and not allow_empty) or len(text) > 128 or text.lower().startswith(("aliyun", "acs:")) \
            or "http://" in text or "https://" in text:
        raise EcsError(code, f"The specified Tag.n.{kind} {text!r} is not valid: 1-128 characters (values may be "
                       "empty), not starting with aliyun or acs:, without http:// or https://.", 400)


def _tags(params: Params) -> dict[str, str]:
    tags: dict[str, str] = {}
    for n in range(1, 22):
        key, value = params.get(f"Tag.{n}.Key"), params.get(f"Tag.{n}.Value")
        if key is None and value is None:
            continue
        if n > 20:
            raise invalid("Tag.N", str(n), "at most 20 tags")
        _check_text("Key", key or "", allow_empty=False)
        _check_text("Value", value or "", allow_empty=True)
        tags[key] = value or ""
    return tags


def tag_resources(params: Params, cloud: EcsCloud) -> dict:
    check_region(params, cloud)
    _resource_type(params)
    instances = _resources(params, cloud, required=True)
    tags = _tags(params)
    if not tags:
        raise missing("Tag.1.Key")
    for instance in instances:
        if len({**instance.tags, **tags}) > MAX_TAGS_PER_RESOURCE:
            raise EcsError("OperationDenied.QuotaExceed", f"The quota of tags on resource {instance.instance_id} "
                           f"is beyond permitted range: at most {MAX_TAGS_PER_RESOURCE} tags.", 403)
    for instance in instances:
        instance.tags.update(tags)
    return {}


def untag_resources(params: Params, cloud: EcsCloud) -> dict:
    check_region(params, cloud)
    _resource_type(params)
    instances = _resources(params, cloud, required=True)
    keys = repeat_list(params, "TagKey", limit=20)
    remove_all = as_bool(params, "All")
    for instance in instances:
        for key in list(instance.tags) if remove_all else keys:   # neither given: nothing removed
            instance.tags.pop(key, None)
    return {}


def list_tag_resources(params: Params, cloud: EcsCloud) -> dict:
    """(resource, tag) pairs of the given resources, or of every resource carrying the given tags;
    up to 50 per page, paged by NextToken."""
    check_region(params, cloud)
    _resource_type(params)
    instances = _resources(params, cloud, required=False)
    wanted = {}
    for n in range(1, 21):
        key = params.get(f"Tag.{n}.Key")
        if key:
            wanted[key] = params.get(f"Tag.{n}.Value")
    if not instances and not wanted:
        raise missing("ResourceId.1 or Tag.1.Key")
    pool = instances or list(cloud.instances.values())
    rows = [{"ResourceType": "instance", "ResourceId": i.instance_id, "TagKey": k, "TagValue": v}
            for i in pool
            if all(key in i.tags and value in (None, i.tags[key]) for key, value in wanted.items())
            for k, v in i.tags.items()]
    offset = decode_token(params["NextToken"]) if params.get("NextToken") else 0
    chunk = rows[offset:offset + 50]
    more = offset + 50 < len(rows)
    return {"NextToken": encode_token(offset + 50) if more else "", "TagResources": {"TagResource": chunk}}
