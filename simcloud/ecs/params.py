"""Parameters and paging of ECS RPC actions, as the real service reads and checks them.

Shared by every action module (simcloud.ecs.api, catalog, tags) so each answers a
missing or malformed parameter with the same MissingParameter / InvalidParameter errors.
"""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping

from simcloud.ecs.model import EcsCloud, EcsError

Params = Mapping[str, str]


# ---------------------------------------------------------------- parameter parsing

def missing(name: str) -> EcsError:
    return EcsError("MissingParameter",
                    f'The input parameter "{name}" that is mandatory for processing this request is not supplied.', 400)


def invalid(name: str, value: str, expected: str) -> EcsError:
    return EcsError("InvalidParameter", f"The specified parameter {name} {value!r} is not valid; expected {expected}.", 400)


def require(params: Params, name: str) -> str:
    value = params.get(name)
    if value is None or value == "":
        raise missing(name)
    return value


def as_bool(params: Params, name: str, default: bool = False) -> bool:
    value = params.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise invalid(name, value, "true or false")


def as_int(params: Params, name: str, default: int, lo: int, hi: int) -> int:
    value = params.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise invalid(name, value, f"an integer from {lo} to {hi}") from None
    if not lo <= number <= hi:
        raise invalid(name, value, f"an integer from {lo} to {hi}")
    return number


def one_of(params: Params, name: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
    value = params.get(name) or default
    if value is not None and value not in choices:
        raise invalid(name, value, " or ".join(choices))
    return value


def repeat_list(params: Params, prefix: str, limit: int = 100) -> list[str]:
    """`InstanceId.1`, `InstanceId.2`, ... in index order."""
    indexed = []
    for key, value in params.items():
        head, dot, index = key.rpartition(".")
        if dot and head == prefix and index.isdigit():
            indexed.append((int(index), value))
    if len(indexed) > limit:
        raise invalid(f"{prefix}.N", str(len(indexed)), f"at most {limit} values")
    return [value for _, value in sorted(indexed)]


def json_list(params: Params, name: str, limit: int = 100) -> list[str] | None:
    """A JSON array of strings given as one parameter, like InstanceIds='["i-1","i-2"]'."""
    raw = params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(name, raw, 'a JSON array of strings such as ["i-xxx","i-yyy"]')
    if len(value) > limit:
        raise invalid(name, raw, f"at most {limit} ids")
    return value


def tag_filter(params: Params) -> dict[str, str | None]:
    tags: dict[str, str | None] = {}
    for n in range(1, 21):
        key = params.get(f"Tag.{n}.Key")
        if key:
            tags[key] = params.get(f"Tag.{n}.Value") or None
        elif params.get(f"Tag.{n}.Value"):
            raise missing(f"Tag.{n}.Key")
    return tags


def check_region(params: Params, cloud: EcsCloud) -> None:
    region = require(params, "RegionId")
    if region != cloud.region_id:
        raise EcsError("InvalidRegionId.NotFound",
                       f"The specified RegionId does not exist: {region} (this endpoint serves {cloud.region_id}).", 404)


# ---------------------------------------------------------------- paging

def encode_token(offset: int) -> str:
    return base64.urlsafe_b64encode(f"offset:{offset}".encode()).decode().rstrip("=")


def decode_token(token: str) -> int:
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        kind, _, offset = text.partition(":")
        if kind == "offset" and offset.isdigit():
            return int(offset)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise invalid("NextToken", token, "a NextToken returned by a previous call of this action")


def page(items: list, params: Params, *, max_page: int, default_size: int,
         token_paging: bool = True, page_paging: bool = True) -> tuple[list, dict]:
    """Slice `items` by MaxResults/NextToken (when either is given) or PageNumber/PageSize.
    Returns the slice and the paging fields of the response."""
    if token_paging and (params.get("MaxResults") or params.get("NextToken")):
        size = as_int(params, "MaxResults", default_size, 1, max_page)
        offset = decode_token(params["NextToken"]) if params.get("NextToken") else 0
        chunk = items[offset:offset + size]
        more = offset + size < len(items)
        return chunk, {"TotalCount": len(items), "NextToken": encode_token(offset + size) if more else "",
                       "PageSize": size, "PageNumber": offset // size + 1}
    if not page_paging:
        return items, {"NextToken": ""}
    number = as_int(params, "PageNumber", 1, 1, 1_000_000)
    size = as_int(params, "PageSize", default_size, 1, max_page)
    start = (number - 1) * size
    return items[start:start + size], {"TotalCount": len(items), "PageNumber": number, "PageSize": size,
                                       "NextToken": ""}
