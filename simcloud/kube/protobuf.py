"""Just enough of Kubernetes' protobuf encoding to read the reviews `kubectl auth can-i` sends.

`kubectl auth can-i` (and `--list`) posts its review as `application/vnd.kubernetes.protobuf`
whatever the server prefers, so the API reads those bodies: the `k8s\\0` envelope
(runtime.Unknown: typeMeta, raw) around an authorization/v1 SelfSubjectAccessReview or
SelfSubjectRulesReview, turned into the JSON shape the rest of the server handles.
Everything else stays JSON-only.
"""
from __future__ import annotations

MAGIC = b"k8s\x00"


class ProtobufError(ValueError):
    """The body is not the protobuf message expected."""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def fields(data: bytes) -> dict[int, list]:
    """Field number -> values (ints for varints, bytes for length-delimited); other wire types refused."""
    out: dict[int, list] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            length, i = _varint(data, i)
            if i + length > len(data):
                raise ProtobufError("truncated field")
            value, i = data[i:i + length], i + length
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def _text(message: dict[int, list], number: int) -> str:
    values = message.get(number) or [b""]
    return values[-1].decode() if isinstance(values[-1], bytes) else ""


def _message(message: dict[int, list], number: int) -> dict[int, list] | None:
    values = message.get(number)
    return fields(values[-1]) if values and isinstance(values[-1], bytes) else None


def review(body: bytes) -> dict:
    """The JSON form of a protobuf-encoded authorization.k8s.io/v1 SelfSubject{Access,Rules}Review."""
    if not body.startswith(MAGIC):
        raise ProtobufError("missing the k8s protobuf envelope")
    unknown = fields(body[len(MAGIC):])
    type_meta = _message(unknown, 1) or {}
    kind = _text(type_meta, 2)
    if kind not in ("SelfSubjectAccessReview", "SelfSubjectRulesReview"):
        raise ProtobufError(f"expected a SelfSubjectAccessReview or SelfSubjectRulesReview, got {kind!r}")
    spec = _message(fields((unknown.get(2) or [b""])[-1]), 2) or {}
    if kind == "SelfSubjectRulesReview":
        return {"apiVersion": _text(type_meta, 1), "kind": kind, "spec": {"namespace": _text(spec, 1)}}
    out: dict = {}
    res, non_res = _message(spec, 1), _message(spec, 2)
    if res is not None:
        names = {1: "namespace", 2: "verb", 3: "group", 4: "version", 5: "resource", 6: "subresource", 7: "name"}
        out["resourceAttributes"] = {k: _text(res, n) for n, k in names.items() if _text(res, n)}
    if non_res is not None:
        out["nonResourceAttributes"] = {k: _text(non_res, n) for n, k in ((1, "path"), (2, "verb"))}
    return {"apiVersion": _text(type_meta, 1), "kind": "SelfSubjectAccessReview", "spec": out}
