"""The three PATCH flavours the Kubernetes API accepts, as pure functions.

`apply_patch(obj, body, content_type)` returns a new document and never edits `obj`.
`PatchError` carries the HTTP status the API answers (400 malformed, 422 not applicable).
Strategic merge keys follow the Kubernetes struct tags for the fields clients patch;
other lists are replaced, as for types without patch metadata.
"""
from __future__ import annotations

import copy
import json

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, "application/apply-patch+yaml", STRATEGIC_MERGE_PATCH)


class PatchError(ValueError):
    def __init__(self, message: str, code: int = 422):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- RFC 7386
def merge_patch(target, patch):
    """JSON merge patch: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ---------------------------------------------------------------- RFC 6902
def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f'invalid JSON pointer "{path}": must start with "/"', 400)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc, tokens: list[str], path: str):
    node = doc
    for token in tokens[:-1]:
        node = _child(node, token, path)
    return node


def _child(node, token: str, path: str):
    if isinstance(node, dict):
        if token not in node:
            raise PatchError(f"doc is missing path: {path}")
        return node[token]
    if isinstance(node, list):
        index = _index(node, token, path)
        if index >= len(node):
            raise PatchError(f"doc is missing path: {path}: index out of range")
        return node[index]
    raise PatchError(f"doc is missing path: {path}")


def _index(node: list, token: str, path: str, allow_end: bool = False) -> int:
    if token == "-" and allow_end:
        return len(node)
    if not token.isdigit():
        raise PatchError(f"invalid array index {token!r} in {path}")
    index = int(token)
    if index > len(node) or (index == len(node) and not allow_end):
        raise PatchError(f"doc is missing path: {path}: index out of range")
    return index


def _get(doc, path: str):
    node = doc
    for token in _pointer(path):
        node = _child(node, token, path)
    return node


def _remove(doc, path: str):
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict):
        if tokens[-1] not in parent:
            raise PatchError(f"doc is missing path: {path}")
        return parent.pop(tokens[-1])
    if isinstance(parent, list):
        return parent.pop(_index(parent, tokens[-1], path))
    raise PatchError(f"doc is missing path: {path}")


def _add(doc, path: str, value):
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    if isinstance(parent, dict):
        parent[tokens[-1]] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, tokens[-1], path, allow_end=True), value)
    else:
        raise PatchError(f"doc is missing path: {path}")
    return doc


def json_patch(target, operations):
    """RFC 6902: add, remove, replace, move, copy, test; all or nothing."""
    if not isinstance(operations, list):
        raise PatchError("json patch must be a list of operations", 400)
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid json patch operation {op!r}: needs op and path", 400)
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f'json patch {kind} operation at "{path}" needs a value', 400)
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            if _pointer(path):
                _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind in ("move", "copy"):
            if "from" not in op:
                raise PatchError(f'json patch {kind} operation at "{path}" needs "from"', 400)
            value = _remove(doc, op["from"]) if kind == "move" else copy.deepcopy(_get(doc, op["from"]))
            doc = _add(doc, path, value)
        elif kind == "test":
            if _get(doc, path) != op["value"]:
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"Unexpected kind: {kind}", 400)
    return doc


# ---------------------------------------------------------------- strategic merge patch
# list field name -> merge key (patchMergeKey in the Kubernetes types); None = merge a primitive list as a set.
MERGE_KEYS: dict[str, str | None] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "containerStatuses": "name", "initContainerStatuses": "name", "ephemeralContainerStatuses": "name",
    "conditions": "type", "addresses": "type",
    "env": "name", "volumes": "name", "imagePullSecrets": "name", "volumeMounts": "mountPath",
    "volumeDevices": "devicePath", "ports": "containerPort", "ownerReferences": "uid",
    "hostAliases": "ip", "resourceClaims": "name", "schedulingGates": "name",
    "finalizers": None,
}


def _smp_list(key: str, current, patch: list):
    merge_key = MERGE_KEYS.get(key, "<replace>")
    if merge_key == "<replace>" or not isinstance(current, list):
        return [_strip_directives(item) for item in patch]
    if merge_key is None:
        return list(current) + [item for item in patch if item not in current]
    result = list(current)
    for item in patch:
        if not isinstance(item, dict):
            raise PatchError(f"strategic merge patch: {key} items must be objects with {merge_key!r}", 400)
        directive = item.get("$patch")
        if directive == "replace":
            return [_strip_directives(i) for i in patch if i.get("$patch") != "replace"]
        if merge_key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {merge_key}", 400)
        positions = [i for i, existing in enumerate(result)
                     if isinstance(existing, dict) and existing.get(merge_key) == item[merge_key]]
        if directive == "delete":
            result = [e for i, e in enumerate(result) if i not in positions]
        elif positions:
            result[positions[0]] = strategic_merge_patch(result[positions[0]], item)
        else:
            result.append(_strip_directives(item))
    return result


def _strip_directives(value):
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items()
                if not k.startswith("$") and v is not None}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def strategic_merge_patch(target, patch):
    """Kubernetes strategic merge: maps merge, keyed lists merge by their merge key, $patch directives."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return _strip_directives(patch)
    if directive == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [v for v in result.get(name) or [] if v not in (value or [])]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _smp_list(key, result.get(key), value)
        else:
            result[key] = value
    return result


def apply_patch(obj: dict, body: bytes | str | object, content_type: str) -> dict:
    """Apply a PATCH request body of `content_type` to `obj`; returns the new document."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind not in (MERGE_PATCH, JSON_PATCH, STRATEGIC_MERGE_PATCH):
        raise PatchError(
            "the body of the request was in an unknown format - accepted media types include: "
            + ", ".join(PATCH_TYPES), 415)
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except ValueError as exc:
            raise PatchError(f"error decoding patch: {exc}", 400) from None
    if kind == JSON_PATCH:
        return json_patch(obj, body)
    if not isinstance(body, dict):
        raise PatchError("patch body must be a JSON object", 400)
    if kind == MERGE_PATCH:
        return merge_patch(obj, body)
    return strategic_merge_patch(obj, body)
