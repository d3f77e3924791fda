"""What kube-apiserver refuses before anything is stored: decoding (types) and field validation.

Two stages, in the real server's order:

* `decode_errors`: the typed decode. A field of the wrong JSON type (a label value that is
  not a string, `spec.taints: "notalist"`, `tolerations: "x"`) cannot become a Go struct:
  a create or update body is then 400 BadRequest ("cannot be handled as a Pod: json: cannot
  unmarshal ..."), a patch whose result does not decode is 422 Invalid on the field `patch`.
  Types come from the `kubernetes` client's models (`fields.json`, see simcloud.kube.openapi).
* `validate`: pkg/apis/core/validation and rbac validation for the fields the product and
  kubectl send: names per kind, label keys and values, nodeSelector, tolerations, taints,
  resource names and quantities (extended resources integral, requests equal to limits),
  ConfigMap keys and the 1 MiB limit, RBAC rules and immutable roleRefs. 422 Invalid with
  `details.causes`, as kubectl prints them.

Nothing malformed gets stored, so the in-process scheduler and kubelets never meet it.
"""
from __future__ import annotations

import base64
import json
import re

from simcloud.kube.admission import DNS_SUBDOMAIN, dns_label_errors, parse_quantity
from simcloud.kube.errors import ApiError, invalid
from simcloud.kube.openapi import _models, model_name
from simcloud.kube.resources import ResourceInfo

# --------------------------------------------------------------------------- decoding
_CONTAINER = re.compile(r"list\[(.+)\]|dict\[str, (.+)\]")
_SCALARS = {"str": ("string", (str,)), "int": ("int64", (int,)), "bool": ("bool", (bool,)),
            "float": ("float64", (int, float)), "datetime": ("v1.Time", (str,))}
# Fields the client models as strings that are resource.Quantity (a JSON number decodes too).
_QUANTITY_MAPS = {("V1ResourceRequirements", "limits"), ("V1ResourceRequirements", "requests"),
                  ("V1VolumeResourceRequirements", "limits"), ("V1VolumeResourceRequirements", "requests"),
                  ("V1NodeStatus", "allocatable"), ("V1NodeStatus", "capacity"), ("V1PodSpec", "overhead"),
                  ("V1ResourceQuotaSpec", "hard"), ("V1ResourceQuotaStatus", "hard"),
                  ("V1ResourceQuotaStatus", "used"), ("V1LimitRangeItem", "default"),
                  ("V1LimitRangeItem", "defaultRequest"), ("V1LimitRangeItem", "max"), ("V1LimitRangeItem", "min"),
                  ("V1LimitRangeItem", "maxLimitRequestRatio"), ("V1PersistentVolumeSpec", "capacity"),
                  ("V1PersistentVolumeClaimStatus", "capacity"),
                  ("V1PersistentVolumeClaimStatus", "allocatedResources"),
                  ("V1ContainerStatus", "allocatedResources"), ("V1PodStatus", "allocatedResources"),
                  ("V1EmptyDirVolumeSource", "sizeLimit")}


def _go_type(kind: str) -> str:
    container = _CONTAINER.fullmatch(kind)
    if container:
        return f"[]{_go_type(container.group(1))}" if container.group(1) else f"map[string]{_go_type(container.group(2))}"
    if kind in _SCALARS:
        return _SCALARS[kind][0]
    if kind == "object":
        return "interface {}"
    return "v1." + re.sub(r"^(CoreV1|RbacV1|V1)", "", kind)


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "value")


def decode_errors(info: ResourceInfo, obj: dict) -> list[str]:
    """Go decoder messages for every field of `obj` whose JSON type its kind's schema refuses."""
    errors: list[str] = []
    name = model_name(info)
    _check(name, obj, re.sub(r"^(CoreV1|RbacV1|V1)", "", name), "", errors)
    return errors


def _check(kind: str, value, struct: str, path: str, errors: list[str], quantity: bool = False) -> None:
    if value is None:
        return        # null decodes to the zero value
    container = _CONTAINER.fullmatch(kind)
    expected = _go_type(kind)
    got = f"number {value}" if kind == "int" and isinstance(value, float) else _json_type(value)   # Go names it
    fail = f"json: cannot unmarshal {got} into Go struct field {struct}.{path} of type {expected}"
    if container:
        item = container.group(1) or container.group(2)
        if not isinstance(value, list if container.group(1) else dict):
            errors.append(fail)
            return
        for element in (value if container.group(1) else value.values()):
            _check(item, element, struct, path, errors, quantity)
        return
    if quantity and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return
    if kind in _SCALARS:
        types = _SCALARS[kind][1]
        if not isinstance(value, types) or (kind in ("int", "float", "str") and isinstance(value, bool)):
            errors.append(fail)     # 30.0 for an int64 too: Go's decoder refuses a fraction literal
        return
    if kind == "object":
        return
    fields = _models().get(kind)
    if fields is None:
        return
    if not isinstance(value, dict):
        errors.append(fail)
        return
    name = re.sub(r"^(CoreV1|RbacV1|V1)", "", kind)
    for key, child in value.items():
        if key in fields:
            _check(fields[key], child, name, f"{path}.{key}" if path else key, errors,
                   (kind, key) in _QUANTITY_MAPS)


def undecodable_body(info: ResourceInfo, errors: list[str]) -> ApiError:
    """A create/update body that does not decode: the real 400."""
    return ApiError(400, "BadRequest", f'{info.kind} in version "{info.version}" cannot be handled as a '
                                       f'{info.kind}: {errors[0]}')


def undecodable_patch(patched: dict, errors: list[str]) -> ApiError:
    """A patch whose result does not decode: the real 422 on the field `patch` (empty kind and name)."""
    value = json.dumps(patched, separators=(",", ":"))
    message = f"Invalid value: {json.dumps(value)}: {errors[0]}"
    return ApiError(422, "Invalid", f' "" is invalid: patch: {message}',
                    {"causes": [{"reason": "FieldValueInvalid", "message": message, "field": "patch"}]})


# --------------------------------------------------------------------------- names
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")

SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                 "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                 "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
               "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
               "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
NAME_PART_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                 "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
                 "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
                   "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
                   "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
CONFIG_KEY_MSG = ("a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or "
                  "'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')")
MAX_CONFIGMAP_BYTES = 1024 * 1024
MAX_ANNOTATION_BYTES = 256 * 1024

Cause = tuple[str, str, str]     # field, reason, message


def _invalid_value(path: str, value, detail: str) -> Cause:
    shown = json.dumps(value) if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return (path, "FieldValueInvalid", f"Invalid value: {shown}: {detail}")


def _required(path: str, detail: str = "") -> Cause:
    return (path, "FieldValueRequired", "Required value" + (f": {detail}" if detail else ""))


def _unsupported(path: str, value, allowed: list[str]) -> Cause:
    return (path, "FieldValueNotSupported",
            f"Unsupported value: {json.dumps(value)}: supported values: " + ", ".join(f'"{a}"' for a in allowed))


def _name_errors(resource: str, name: str) -> list[str]:
    """The name rule of each kind (pkg/apis/*/validation ValidateXName)."""
    if resource in ("roles", "rolebindings", "clusterroles", "clusterrolebindings"):   # path segment names
        if name in (".", ".."):
            return [f"may not be '{name}'"]
        return [f"may not contain '{c}'" for c in ("/", "%") if c in name]
    if resource == "namespaces":
        return dns_label_errors(name)
    if resource == "services":
        return [] if len(name) <= 63 and _DNS_1035.match(name) else [DNS1035_MSG]
    if len(name) > 253:
        return ["must be no more than 253 characters"]
    return [] if DNS_SUBDOMAIN.match(name) else [SUBDOMAIN_MSG]


def name_causes(info: ResourceInfo, name: str) -> list[Cause]:
    """The name's causes, reported with the rest of the object's (the real server validates all at once)."""
    return [_invalid_value("metadata.name", name, e) for e in _name_errors(info.name, name)]


def qualified_name_errors(key: str) -> list[str]:
    """IsQualifiedName: `[prefix/]name`, prefix a DNS subdomain, name at most 63 characters."""
    parts = key.split("/")
    if len(parts) > 2:     # IsQualifiedName is IsLabelKey since 1.37, and words it so
        return ["a valid label key " + NAME_PART_MSG.removeprefix("name part ") +
                " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    errors = []
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append("prefix part must be non-empty")
        elif len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix):
            errors.append("prefix part " + SUBDOMAIN_MSG)
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 bytes")   # MaxLenError, as 1.37 words it
    if not _QUALIFIED.match(name):
        errors.append(NAME_PART_MSG)
    return errors


def label_value_errors(value: str) -> list[str]:
    errors = ["must be no more than 63 bytes"] if len(value) > 63 else []
    return errors + ([] if _LABEL_VALUE.match(value) else [LABEL_VALUE_MSG])


def _labels(labels, path: str) -> list[Cause]:
    causes = []
    for key, value in (labels or {}).items():
        causes += [_invalid_value(path, key, e) for e in qualified_name_errors(key)]
        if isinstance(value, str):
            causes += [_invalid_value(path, value, e) for e in label_value_errors(value)]
    return causes


def _metadata(meta: dict) -> list[Cause]:
    causes = _labels(meta.get("labels"), "metadata.labels")
    annotations = meta.get("annotations") or {}
    for key in annotations:
        causes += [_invalid_value("metadata.annotations", key, e) for e in qualified_name_errors(key.lower())]
    size = sum(len(k) + len(v or "") for k, v in annotations.items() if isinstance(v, str))
    if size > MAX_ANNOTATION_BYTES:
        causes.append(("metadata.annotations", "FieldValueTooLong",
                       f"Too long: may not be more than {MAX_ANNOTATION_BYTES} bytes"))
    return causes


# --------------------------------------------------------------------------- resources and quantities
_STANDARD_CONTAINER = ("cpu", "memory", "ephemeral-storage")


def is_extended(resource: str) -> bool:
    """IsExtendedResourceName: a domain-qualified name outside kubernetes.io, not `requests.*`."""
    native = "/" not in resource or "kubernetes.io/" in resource
    return not native and not resource.startswith("requests.") and not qualified_name_errors("requests." + resource)


def _integral(resource: str) -> bool:
    return is_extended(resource) or resource == "pods"


def _overcommittable(resource: str) -> bool:
    """IsOvercommitAllowed: native resources but hugepages; extended resources never."""
    return ("/" not in resource or "kubernetes.io/" in resource) and not resource.startswith("hugepages-")


def _quantities(values, path: str, container: bool) -> list[Cause]:
    causes = []
    for resource, raw in (values or {}).items():
        where = f"{path}[{resource}]"
        if container and resource not in _STANDARD_CONTAINER and not resource.startswith("hugepages-") \
                and not is_extended(resource):
            causes.append(_invalid_value(where, resource, "must be a standard resource for containers"))
        causes += [_invalid_value(where, resource, e) for e in qualified_name_errors(resource)]
        causes += _quantity_value(where, resource, raw, canonical=False)
    return causes


def _quantity_value(where: str, resource: str, raw, canonical: bool) -> list[Cause]:
    """ValidateResourceQuantityValue: a quantity that parses, is non-negative and whole for integer
    resources; the value shown as sent, or `canonical` (a node's status: its Quantity's String())."""
    try:
        quantity = parse_quantity(raw)
    except ValueError as exc:
        return [_invalid_value(where, str(raw), str(exc))]
    shown = _decimal_si(quantity) if canonical else str(raw)
    if quantity < 0:
        return [_invalid_value(where, shown, "must be greater than or equal to 0")]
    if _integral(resource) and quantity != quantity.to_integral_value():
        return [_invalid_value(where, shown, "must be an integer")]
    return []


def _requirements(resources: dict, path: str) -> list[Cause]:
    """ValidateResourceRequirements: names, values, requests <= limits, non-overcommittable equal."""
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    causes = _quantities(limits, f"{path}.limits", True) + _quantities(requests, f"{path}.requests", True)
    if causes:
        return causes
    for resource, raw in requests.items():
        overcommit = _overcommittable(resource)
        if resource in limits:
            request, limit = parse_quantity(raw), parse_quantity(limits[resource])
            if not overcommit and request != limit:
                causes.append(_invalid_value(f"{path}.requests", str(raw),
                                             f"must be equal to {resource} limit of {limits[resource]}"))
            elif request > limit:
                causes.append(_invalid_value(f"{path}.requests", str(raw),
                                             f"must be less than or equal to {resource} limit of {limits[resource]}"))
        elif not overcommit:
            causes.append(_required(f"{path}.limits", "Limit must be set for non overcommitable resources"))
    return causes


# --------------------------------------------------------------------------- taints and tolerations
_EFFECTS = ["NoSchedule", "PreferNoSchedule", "NoExecute"]


def _taints(taints, path: str) -> list[Cause]:
    causes, seen = [], set()
    for i, taint in enumerate(taints or []):
        where = f"{path}[{i}]"
        key, value, effect = taint.get("key") or "", taint.get("value") or "", taint.get("effect") or ""
        causes += [_invalid_value(f"{where}.key", key, e) for e in qualified_name_errors(key)]
        causes += [_invalid_value(f"{where}.value", value, e) for e in label_value_errors(value)]
        if not effect:
            causes.append(_required(f"{where}.effect"))
        elif effect not in _EFFECTS:
            causes.append(_unsupported(f"{where}.effect", effect, _EFFECTS))
        if (key, effect) in seen:
            causes.append((where, "FieldValueDuplicate", "Duplicate value: taints must be unique by key and effect pair"))
        seen.add((key, effect))
    return causes


def _tolerations(tolerations, path: str) -> list[Cause]:
    causes = []
    for i, t in enumerate(tolerations or []):
        where = f"{path}[{i}]"
        key, op, value, effect = t.get("key") or "", t.get("operator") or "", t.get("value") or "", t.get("effect") or ""
        if key:
            causes += [_invalid_value(f"{where}.key", key, e) for e in qualified_name_errors(key)]
        elif op != "Exists":
            causes.append(_invalid_value(f"{where}.operator", op, 'operator must be Exists when `key` is empty, '
                                                                  'which means "match all values and all keys"'))
        if t.get("tolerationSeconds") is not None and effect != "NoExecute":
            causes.append(_invalid_value(f"{where}.effect", effect,
                                         "effect must be 'NoExecute' when `tolerationSeconds` is set"))
        if op in ("Equal", ""):
            causes += [_invalid_value(f"{where}.operator", value, e) for e in label_value_errors(value)]
        elif op == "Exists":
            if value:
                causes.append(_invalid_value(f"{where}.operator", value,
                                             "value must be empty when `operator` is 'Exists'"))
        else:
            causes.append(_unsupported(f"{where}.operator", op, ["Equal", "Exists"]))
        if effect and effect not in _EFFECTS:
            causes.append(_unsupported(f"{where}.effect", effect, _EFFECTS))
    return causes


def _node_selector_terms(required: dict, path: str) -> list[Cause]:
    causes = []
    ops = ["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    for i, term in enumerate(required.get("nodeSelectorTerms") or []):
        for group in ("matchExpressions", "matchFields"):
            for j, expr in enumerate(term.get(group) or []):
                where = f"{path}.nodeSelectorTerms[{i}].{group}[{j}]"
                op, values = expr.get("operator"), expr.get("values") or []
                if group == "matchExpressions":
                    causes += [_invalid_value(f"{where}.key", expr.get("key") or "", e)
                               for e in qualified_name_errors(expr.get("key") or "")]
                if op not in ops:
                    causes.append(_unsupported(f"{where}.operator", op or "", ops))
                elif op in ("In", "NotIn") and not values:
                    causes.append(_required(f"{where}.values",
                                            "must be specified when `operator` is 'In' or 'NotIn'"))
                elif op in ("Exists", "DoesNotExist") and values:
                    causes.append((f"{where}.values", "FieldValueForbidden",
                                   "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'"))
                elif op in ("Gt", "Lt") and (len(values) != 1 or not re.fullmatch(r"-?\d+", str(values[0]))):
                    causes.append(_required(f"{where}.values",
                                            "must be specified single value when `operator` is 'Lt' or 'Gt'"))
    return causes


# --------------------------------------------------------------------------- kinds
def _pod(pod: dict) -> list[Cause]:
    spec = pod.get("spec") or {}
    causes = _labels(spec.get("nodeSelector"), "spec.nodeSelector")
    causes += _tolerations(spec.get("tolerations"), "spec.tolerations")
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            causes += _requirements(c.get("resources") or {}, f"spec.{group}[{i}].resources")
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if required:
        causes += _node_selector_terms(required, "spec.affinity.nodeAffinity."
                                                 "requiredDuringSchedulingIgnoredDuringExecution")
    causes += _quantities(spec.get("overhead"), "spec.overhead", False)
    return causes


def _decimal_si(quantity) -> str:
    """How a Quantity prints in an error (its canonical String()), for the values validation refuses:
    whole numbers plain, thousandths with `m` ("0.5" is "500m"), finer ones with `u` or `n`."""
    for scale, suffix in ((1, ""), (1000, "m"), (10**6, "u"), (10**9, "n")):
        scaled = quantity * scale
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{suffix}"
    return str(quantity)


def _node_resources(values, path: str) -> list[Cause]:
    """ValidateNodeResources: each quantity on the path `status.capacity.<name>` (Child, not Key) with
    the canonical value, as kube-apiserver 1.37 words it; resource names are not checked there."""
    return [c for resource, raw in (values or {}).items()
            for c in _quantity_value(f"{path}.{resource}", resource, raw, canonical=True)]


def _node(node: dict) -> list[Cause]:
    """ValidateNode: its taints are reported under `metadata.taints` (kube-apiserver's own path, kept
    although the field is spec.taints), its resources by _node_resources."""
    status = node.get("status") or {}
    return (_taints((node.get("spec") or {}).get("taints"), "metadata.taints")
            + _node_resources(status.get("capacity"), "status.capacity")
            + _node_resources(status.get("allocatable"), "status.allocatable"))


def _configmap(cm: dict) -> list[Cause]:
    causes, size = [], 0
    data, binary = cm.get("data") or {}, cm.get("binaryData") or {}
    for field, values in (("data", data), ("binaryData", binary)):
        for key, value in values.items():
            if len(key) > 253 or not _CONFIG_KEY.match(key) or key in (".", "..") or key.startswith(".."):
                causes.append(_invalid_value(f"{field}[{key}]", key, CONFIG_KEY_MSG))
            if field == "binaryData" and key in data:
                causes.append(_invalid_value(f"{field}[{key}]", key, "duplicate of key present in data"))
            size += len(value.encode()) if field == "data" else _decoded_length(value)
    if size > MAX_CONFIGMAP_BYTES:
        causes.append(("[]", "FieldValueTooLong", f"Too long: may not be more than {MAX_CONFIGMAP_BYTES} bytes"))
    return causes


def _decoded_length(value: str) -> int:
    try:
        return len(base64.b64decode(value, validate=True))
    except ValueError:
        return len(value)


def _rules(role: dict, namespaced: bool) -> list[Cause]:
    causes = []
    for i, rule in enumerate(role.get("rules") or []):
        where = f"rules[{i}]"
        if not rule.get("verbs"):
            causes.append(_required(f"{where}.verbs", "verbs must contain at least one value"))
        if rule.get("nonResourceURLs"):
            if namespaced:
                causes.append(_invalid_value(f"{where}.nonResourceURLs", rule["nonResourceURLs"],
                                             "namespaced rules cannot apply to non-resource URLs"))
            if rule.get("apiGroups") or rule.get("resources") or rule.get("resourceNames"):
                causes.append(_invalid_value(f"{where}.nonResourceURLs", rule["nonResourceURLs"],
                                             "rules cannot apply to both regular resources and non-resource URLs"))
            continue
        if not rule.get("apiGroups"):
            causes.append(_required(f"{where}.apiGroups", "resource rules must supply at least one api group"))
        if not rule.get("resources"):
            causes.append(_required(f"{where}.resources", "resource rules must supply at least one resource"))
    return causes


def _binding(binding: dict, cluster: bool) -> list[Cause]:
    ref = binding.get("roleRef") or {}
    kinds = ["ClusterRole"] if cluster else ["Role", "ClusterRole"]
    causes = []
    if ref.get("apiGroup") != "rbac.authorization.k8s.io":
        causes.append(_unsupported("roleRef.apiGroup", ref.get("apiGroup") or "", ["rbac.authorization.k8s.io"]))
    if ref.get("kind") not in kinds:
        causes.append(_unsupported("roleRef.kind", ref.get("kind") or "", kinds))
    if not ref.get("name"):
        causes.append(_required("roleRef.name"))
    for i, subject in enumerate(binding.get("subjects") or []):
        where = f"subjects[{i}]"
        kind = subject.get("kind")
        if kind not in ("ServiceAccount", "User", "Group"):
            causes.append(_unsupported(f"{where}.kind", kind or "", ["ServiceAccount", "User", "Group"]))
        if not subject.get("name"):
            causes.append(_required(f"{where}.name"))
        if kind == "ServiceAccount" and cluster and not subject.get("namespace"):
            causes.append(_required(f"{where}.namespace"))
    return causes


_KINDS = {
    "pods": _pod,
    "nodes": _node,
    "configmaps": _configmap,
    "roles": lambda r: _rules(r, True),
    "clusterroles": lambda r: _rules(r, False),
    "rolebindings": lambda b: _binding(b, False),
    "clusterrolebindings": lambda b: _binding(b, True),
}


def validate(info: ResourceInfo, obj: dict, old: dict | None = None, first: list[Cause] = ()) -> None:
    """422 Invalid with causes when `obj` (a create, or an update of `old`) breaks a rule of its kind;
    `first`: causes found earlier (the name's), listed before the others."""
    resource = info.name
    causes = [*first, *_metadata(obj.get("metadata") or {})]
    if resource in _KINDS:
        causes += _KINDS[resource](obj)
    if old is not None and resource in ("rolebindings", "clusterrolebindings") \
            and obj.get("roleRef") != old.get("roleRef"):
        causes.append(_invalid_value("roleRef", obj.get("roleRef"), "cannot change roleRef"))
    if causes:
        raise invalid(info.kind, (obj.get("metadata") or {}).get("name", ""), causes)


def dry_run(query) -> bool:
    """`dryRun=All` (the only value the real server accepts): validate everything, store nothing."""
    values = query.getall("dryRun", []) if hasattr(query, "getall") else [query.get("dryRun")]
    values = [v for v in values if v]
    if not values:
        return False
    if any(v != "All" for v in values):
        bad = ", ".join(f'"{v}"' for v in values)
        raise ApiError(422, "Invalid", f'CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: '
                                       f'[]string{{{bad}}}: supported values: "All"', {
                           "group": "meta.k8s.io", "kind": "CreateOptions", "causes": [{
                               "reason": "FieldValueNotSupported", "field": "dryRun",
                               "message": f'Unsupported value: []string{{{bad}}}: supported values: "All"'}]})
    return True

