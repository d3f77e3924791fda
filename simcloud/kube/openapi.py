"""OpenAPI v3 (and v2) discovery and server-side field validation, so `kubectl apply/create -f` validate.

kubectl 1.32 validates manifests (`--validate=strict`, its default) in one of two ways:
if the OpenAPI v3 document of the group-version says the kind's PATCH accepts the
`fieldValidation` query parameter, it sends `fieldValidation=Strict` and the server
rejects unknown fields; otherwise it validates client-side against `/openapi/v2`, which
client-go only reads as gnostic protobuf. simcloud takes the first way: `/openapi/v3`
lists each group-version, each document holds the create/update/patch operations of
the served kinds with that parameter (paths only; no component schemas, so kubectl's
apply builds strategic merge patches from its compiled-in types, as with a 404), and
`drop_unknown_fields` checks request bodies for real.

Field names and types come from the `kubernetes` client's models, which are generated
from the upstream OpenAPI document: the same fields a real API server knows. They are
kept in `fields.json` (regenerate: `python -m simcloud.kube.openapi`; a unit test checks
it matches the installed client) because importing the client would add seconds and
much memory to every simcloud start.
"""
from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from pathlib import Path

from simcloud.kube.resources import KUBERNETES_VERSION, RESOURCES, ResourceInfo

FIELDS_FILE = Path(__file__).with_name("fields.json")

FIELD_VALIDATION = ("Ignore", "Warn", "Strict")
_CONTAINER = re.compile(r"(list)\[(.+)\]|dict\[str, (.+)\]")
# the client names the core/v1 Event CoreV1Event (events.k8s.io has its own)
_MODEL_NAMES = {("", "Event"): "CoreV1Event"}


def model_name(info: ResourceInfo) -> str:
    return _MODEL_NAMES.get((info.group, info.kind), f"V1{info.kind}")


@cache
def _models() -> dict[str, dict[str, str]]:
    """Client model name -> {JSON field name -> type ('str', 'list[V1Container]', 'dict[str, str]', 'V1PodSpec')}."""
    return json.loads(FIELDS_FILE.read_text())


def generate_fields() -> dict[str, dict[str, str]]:
    """The models the served kinds reach, read from the installed `kubernetes` client (for FIELDS_FILE)."""
    from kubernetes import client  # slow: only when regenerating or checking the file

    table: dict[str, dict[str, str]] = {}

    def visit(name: str) -> None:
        if name in table:
            return
        cls = getattr(client, name)
        table[name] = {cls.attribute_map[attr]: kind for attr, kind in sorted(cls.openapi_types.items())}
        for kind in table[name].values():
            for ident in re.findall(r"\w+", kind):
                if ident not in ("list", "dict", "str") and hasattr(client, ident):
                    visit(ident)

    for info in RESOURCES.values():
        visit(model_name(info))
    return dict(sorted(table.items()))


def dump_fields(table: dict[str, dict[str, str]]) -> str:
    """One model per line, so a client upgrade shows as a readable diff."""
    return "{\n" + ",\n".join(f"{json.dumps(name)}: {json.dumps(fields)}" for name, fields in table.items()) + "\n}\n"


def drop_unknown_fields(info: ResourceInfo, obj: dict) -> list[str]:
    """Remove from `obj` the fields its kind does not define, as the real server's decoder drops them.

    Returns their paths ("spec.containers[0].foo") for the warning or the Strict refusal.
    """
    found: list[str] = []
    _walk(model_name(info), obj, "", found)
    return found


def _walk(kind: str, value, path: str, found: list[str]) -> None:
    if value is None:
        return
    container = _CONTAINER.fullmatch(kind)
    if container:
        item = container.group(2) or container.group(3)
        if container.group(1) and isinstance(value, list):
            for i, element in enumerate(value):
                _walk(item, element, f"{path}[{i}]", found)
        elif not container.group(1) and isinstance(value, dict):
            for key, element in value.items():
                _walk(item, element, f"{path}[{key}]", found)
        return
    fields = _models().get(kind)
    if fields is None or not isinstance(value, dict):
        return      # a scalar, `object` (anything goes), or a type mismatch the store's checks report
    for key in list(value):
        if key.startswith("$"):          # strategic merge patch directives ($patch, $setElementOrder/...)
            continue
        where = f"{path}.{key}" if path else key
        if key not in fields:
            found.append(where)
            del value[key]
        else:
            _walk(fields[key], value[key], where, found)


# --------------------------------------------------------------------------- documents
def _group_versions() -> dict[str, list[ResourceInfo]]:
    by_gv: dict[str, list[ResourceInfo]] = {}
    for info in RESOURCES.values():
        prefix = f"apis/{info.group}/{info.version}" if info.group else f"api/{info.version}"
        by_gv.setdefault(prefix, []).append(info)
    return by_gv


def _operation(info: ResourceInfo, action: str) -> dict:
    return {
        "operationId": f"{action}{info.kind}",
        "parameters": [{"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
                       for name in ("dryRun", "fieldManager", "fieldValidation")],
        "responses": {"200": {"description": "OK"}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": info.group, "version": info.version, "kind": info.kind},
    }


@cache
def _documents() -> dict[str, bytes]:
    """'api/v1' / 'apis/coordination.k8s.io/v1' -> the OpenAPI v3 document of that group-version."""
    docs = {}
    for prefix, infos in _group_versions().items():
        paths = {}
        for info in infos:
            base = f"/{prefix}/namespaces/{{namespace}}/{info.name}" if info.namespaced else f"/{prefix}/{info.name}"
            paths[base] = {"post": _operation(info, "post")}
            paths[f"{base}/{{name}}"] = {"put": _operation(info, "put"), "patch": _operation(info, "patch")}
        docs[prefix] = json.dumps({"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": KUBERNETES_VERSION},
                                   "paths": paths}).encode()
    return docs


def v3_document(prefix: str) -> bytes | None:
    return _documents().get(prefix)


def v3_root() -> dict:
    """The /openapi/v3 discovery: each group-version's document, with a content hash clients cache by."""
    return {"paths": {prefix: {"serverRelativeURL": f"/openapi/v3/{prefix}?hash="
                               f"{hashlib.sha512(doc).hexdigest().upper()}"}
                      for prefix, doc in _documents().items()}}


# --------------------------------------------------------------------------- OpenAPI v2
# kubectl before 1.27 (Debian's is 1.20) reads only `/openapi/v2`, as gnostic protobuf: `apply`
# fails on a 404 there, and `--dry-run=server` is refused unless the kind's PATCH operation
# (found by its x-kubernetes-group-version-kind) lists a `dryRun` query parameter. The document
# has those paths and no definitions: for a kind without a schema that kubectl skips client-side
# validation and builds patches from its compiled-in types, so bodies are still checked here, by
# `drop_unknown_fields`, as for kubectl 1.32.
# Clients ask with an "@" (kube-openapi's deprecated spelling), which Go's mime parser refuses in
# a response's Content-Type; the server answers with the dotted spelling, as kube-openapi does.
V2_PROTOBUF_ASKED = ("com.github.proto-openapi.spec.v2@v1.0+protobuf", "com.github.proto-openapi.spec.v2.v1.0+protobuf")
V2_PROTOBUF = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
_INFO = {"title": "Kubernetes", "version": KUBERNETES_VERSION}
_QUERY_PARAMETERS = ("dryRun", "fieldManager", "fieldValidation")


def _v2_paths() -> list[tuple[str, ResourceInfo]]:
    """(item path, kind) for every served kind: where its PATCH lives."""
    paths = []
    for prefix, infos in _group_versions().items():
        for info in infos:
            base = f"/{prefix}/namespaces/{{namespace}}/{info.name}" if info.namespaced else f"/{prefix}/{info.name}"
            paths.append((f"{base}/{{name}}", info))
    return paths


def _gvk(info: ResourceInfo) -> dict:
    return {"group": info.group, "kind": info.kind, "version": info.version}


@cache
def _v2_json() -> bytes:
    return json.dumps({"swagger": "2.0", "info": _INFO, "definitions": {}, "paths": {
        path: {"patch": {"operationId": f"patch{info.kind}",
                         "parameters": [{"name": name, "in": "query", "type": "string", "uniqueItems": True}
                                        for name in _QUERY_PARAMETERS],
                         "responses": {"200": {"description": "OK"}},
                         "x-kubernetes-action": "patch", "x-kubernetes-group-version-kind": _gvk(info)}}
        for path, info in _v2_paths()}}).encode()


def _pb(field: int, value: bytes | str) -> bytes:
    """One length-delimited protobuf field (a string or an embedded message)."""
    value = value.encode() if isinstance(value, str) else value
    key, size = field << 3 | 2, len(value)
    varint = bytearray()
    while True:
        varint.append(size & 0x7F | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            break
    return bytes([key]) + bytes(varint) + value


@cache
def _v2_protobuf() -> bytes:
    """The same document as gnostic's openapi.v2.Document (field numbers from OpenAPIv2.proto)."""
    def patch(info: ResourceInfo) -> bytes:                      # Operation
        params = b"".join(_pb(8, _pb(1, _pb(2, _pb(3, _pb(2, "query") + _pb(4, name) + _pb(6, "string")))))
                          for name in _QUERY_PARAMETERS)        # ParametersItem.parameter.non_body.query
        gvk = "".join(f'{key}: "{value}"\n' for key, value in _gvk(info).items())
        return _pb(5, f"patch{info.kind}") + params + \
            _pb(13, _pb(1, "x-kubernetes-group-version-kind") + _pb(2, _pb(2, gvk)))  # NamedAny{Any.yaml}
    paths = b"".join(_pb(2, _pb(1, path) + _pb(2, _pb(8, patch(info)))) for path, info in _v2_paths())
    return _pb(1, "2.0") + _pb(2, _pb(1, _INFO["title"]) + _pb(2, _INFO["version"])) + _pb(8, paths)


def v2_document(accept: str) -> tuple[bytes, str]:
    """The /openapi/v2 document and its content type: gnostic protobuf when asked for, else JSON."""
    if any(asked in accept for asked in V2_PROTOBUF_ASKED):
        return _v2_protobuf(), V2_PROTOBUF
    return _v2_json(), "application/json"


if __name__ == "__main__":
    FIELDS_FILE.write_text(dump_fields(generate_fields()))
    print(f"wrote {FIELDS_FILE}")
