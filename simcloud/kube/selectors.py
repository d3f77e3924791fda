"""Label and field selectors with the Kubernetes API server's grammar and errors.

Pure functions: parse once per request, then call `.matches(obj)` per object.
Bad input raises `SelectorError`, which the API answers as 400 BadRequest.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "FIELD_LABELS",
    "FieldSelector",
    "LabelSelector",
    "SelectorError",
    "parse_field_selector",
    "parse_label_selector",
]


class SelectorError(ValueError):
    """An invalid selector; the message is what the real server says."""


_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY_RE = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME}$")
_VALUE_RE = re.compile(rf"^({_NAME})?$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str            # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if not present:
            return False
        try:
            number = int(value)
        except ValueError:
            return False
        bound = int(self.values[0])
        return number > bound if self.op == "gt" else number < bound


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: dict | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses (`a in (x,y),b`)."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise SelectorError(f"unable to parse requirement: unbalanced parentheses in {text!r}")
    parts.append("".join(current))
    return parts


def _check_key(key: str) -> str:
    if not _KEY_RE.match(key) or len(key) > 316:
        raise SelectorError(
            f'unable to parse requirement: values[0][{key}]: Invalid value: "{key}": name part must consist of '
            "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")
    return key


def _check_value(key: str, value: str) -> str:
    if not _VALUE_RE.match(value):
        raise SelectorError(
            f'unable to parse requirement: values[0][{key}]: Invalid value: "{value}": a valid label must be an '
            "empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
            "alphanumeric character")
    return value


_SET_RE = re.compile(r"^\s*(\S+?)\s+(in|notin)\s*\((.*)\)\s*$")
_CMP_RE = re.compile(r"^\s*([^=!<>\s]+)\s*(==|=|!=|>|<)\s*(.*?)\s*$")


def _parse_requirement(text: str) -> Requirement:
    stripped = text.strip()
    if not stripped:
        raise SelectorError("unable to parse requirement: found '', expected: identifier")
    m = _SET_RE.match(stripped)
    if m:
        key, op, inner = m.groups()
        values = tuple(_check_value(key, v.strip()) for v in inner.split(",")) if inner.strip() else ()
        if not values:
            raise SelectorError(f"unable to parse requirement: for '{op}' operator, values set can't be empty")
        return Requirement(_check_key(key), op, values)
    m = _CMP_RE.match(stripped)
    if m:
        key, op, value = m.groups()
        if op in (">", "<"):
            if not re.fullmatch(r"-?\d+", value):
                raise SelectorError("unable to parse requirement: for 'gt', 'lt' operators, the value must be an integer")
            return Requirement(_check_key(key), "gt" if op == ">" else "lt", (value,))
        return Requirement(_check_key(key), "!=" if op == "!=" else "=", (_check_value(key, value),))
    if stripped.startswith("!"):
        return Requirement(_check_key(stripped[1:].strip()), "!")
    if re.fullmatch(r"\S+", stripped):
        return Requirement(_check_key(stripped), "exists")
    raise SelectorError(f"unable to parse requirement: found '{stripped}', expected: in, notin, =, ==, !=, gt, lt")


def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse `a=b,c!=d,e in (f,g),h notin (i),j,!k`; None or "" selects everything."""
    if not text or not text.strip():
        return LabelSelector()
    return LabelSelector(tuple(_parse_requirement(part) for part in _split_top_level(text)))


# Field labels each resource supports (the real server refuses others).
_COMMON = ("metadata.name", "metadata.namespace")
FIELD_LABELS: dict[str, tuple[str, ...]] = {
    "pods": (*_COMMON, "spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"),
    "nodes": (*_COMMON, "spec.unschedulable"),
    "namespaces": (*_COMMON, "status.phase"),
    "events": (*_COMMON, "involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"),
}


# Boolean fields the server formats with strconv.FormatBool from the typed object: absent is "false".
_BOOLEAN_FIELDS = ("spec.unschedulable", "spec.hostNetwork")


def field_value(obj: dict, path: str) -> str:
    """The string the server compares for field `path` ("" when absent, booleans as true/false;
    an absent boolean field is false, as the typed object the real server reads has it)."""
    if path == "source":
        return (obj.get("source") or {}).get("component") or obj.get("reportingComponent") or ""
    value: object = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "false" if path in _BOOLEAN_FIELDS else ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class FieldSelector:
    terms: tuple[tuple[str, bool, str], ...] = ()   # (field, equal?, value)

    def matches(self, obj: dict) -> bool:
        return all((field_value(obj, f) == v) == eq for f, eq, v in self.terms)

    def value_for(self, field: str) -> str | None:
        """The value an `=` term pins `field` to (lets the store look one object up)."""
        for f, eq, v in self.terms:
            if f == field and eq:
                return v
        return None

    @property
    def empty(self) -> bool:
        return not self.terms


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts = re.split(rf"(?<!\\){re.escape(sep)}", text)
    return parts


def parse_field_selector(text: str | None, resource: str | None = None) -> FieldSelector:
    """Parse `a=b,c!=d` (also `==`); unsupported fields of `resource` are refused like the real server."""
    if not text or not text.strip():
        return FieldSelector()
    allowed = FIELD_LABELS.get(resource or "", _COMMON)
    terms = []
    for raw in _split_unescaped(text, ","):
        part = raw.strip()
        m = re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(.*)", part)
        if not m:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = m.groups()
        if field not in allowed:
            raise SelectorError(f'field label not supported: {field}')
        terms.append((field, op != "!=", value.replace("\\,", ",").replace("\\=", "=")))
    return FieldSelector(tuple(terms))
