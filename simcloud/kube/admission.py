"""What the real API server does to an object before storing it: defaults and validation.

Kept apart from the store so the store stays a plain versioned map. Validation
failures raise `errors.invalid`: 422 Invalid with field causes, as kubectl prints them.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from simcloud.kube.errors import invalid

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
             "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
             "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')")


def dns_label_errors(value: str) -> list[str]:
    """IsDNS1123Label as 1.37 words it: a name that is a valid subdomain fails only for its dots."""
    errors = ["must be no more than 63 bytes"] if len(value) > 63 else []
    if not _DNS_LABEL.match(value):
        errors.append("must not contain dots" if DNS_SUBDOMAIN.match(value) else LABEL_MSG)
    return errors

_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|)$")


def parse_quantity(value) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2Gi", "1e3", 4) as a Decimal; ValueError when malformed."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"quantities must match the regular expression "
                         f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {value!r}")
    number, suffix = m.groups()
    try:
        base = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"invalid quantity {value!r}") from None
    if suffix[:1] in ("e", "E"):
        return base * (Decimal(10) ** int(suffix[1:]))
    return base * Decimal(_SUFFIXES[suffix])


def is_extended_resource(name: str) -> bool:
    """Kubernetes' IsExtendedResourceName: domain-prefixed, outside kubernetes.io, not a quota name."""
    domain, slash, _ = name.partition("/")
    return bool(slash) and not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io")) \
        and not name.startswith("requests.")


def extended_requests(pod: dict) -> dict[str, int]:
    """The extended resources a pod needs, as the kubelet counts them: per resource the larger of
    the containers' sum and the largest init container; limits imply requests."""
    def one(c: dict) -> dict[str, int]:
        res = c.get("resources") or {}
        merged = {**(res.get("requests") or {}), **(res.get("limits") or {})}
        return {k: int(parse_quantity(v)) for k, v in merged.items() if is_extended_resource(k)}
    spec = pod.get("spec") or {}
    main: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for k, v in one(c).items():
            main[k] = main.get(k, 0) + v
    for c in spec.get("initContainers") or []:
        for k, v in one(c).items():
            main[k] = max(main.get(k, 0), v)
    return {k: v for k, v in main.items() if v}


# --------------------------------------------------------------------------- pods
_DEFAULT_TOLERATIONS = [
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
]
_MUTABLE_POD_SPEC_MSG = ("Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                         "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
                         "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
                         "(allow it to be set to 1 if it was previously negative)")


def _default_container(c: dict) -> None:
    image = c.get("image") or ""
    tagged = ":" in image.rsplit("/", 1)[-1] or "@" in image
    c.setdefault("imagePullPolicy", "IfNotPresent" if tagged and not image.endswith(":latest") else "Always")
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    resources = c.setdefault("resources", {})
    limits = resources.get("limits") or {}
    if limits:   # requests default to limits, resource by resource
        requests = resources.setdefault("requests", {})
        for key, value in limits.items():
            requests.setdefault(key, value)


def _qos_class(spec: dict) -> str:
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    requests_any = limits_any = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        requests_any |= any(r in req for r in ("cpu", "memory"))   # QoS counts only cpu and memory
        limits_any |= any(r in lim for r in ("cpu", "memory"))
        for r in ("cpu", "memory"):
            if r not in lim or str(req.get(r, lim[r])) != str(lim[r]):
                guaranteed = False
    if not requests_any and not limits_any:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def _validate_containers(name: str, spec: dict) -> None:
    causes = []
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        causes.append(("spec.containers", "FieldValueRequired", "Required value"))
    seen = set()
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            path = f"spec.{group}[{i}]"
            cname = c.get("name") if isinstance(c, dict) else None
            if not cname:
                causes.append((f"{path}.name", "FieldValueRequired", "Required value"))
            elif dns_label_errors(cname):
                causes += [(f"{path}.name", "FieldValueInvalid", f'Invalid value: "{cname}": {e}')
                           for e in dns_label_errors(cname)]
            elif cname in seen:
                causes.append((f"{path}.name", "FieldValueDuplicate", f'Duplicate value: "{cname}"'))
            seen.add(cname)
            if isinstance(c, dict) and not c.get("image"):
                causes.append((f"{path}.image", "FieldValueRequired", "Required value"))
            for kind in ("requests", "limits"):
                for res, qty in ((c.get("resources") or {}).get(kind) or {}).items() if isinstance(c, dict) else ():
                    try:
                        parse_quantity(qty)
                    except ValueError as exc:
                        causes.append((f"{path}.resources.{kind}[{res}]", "FieldValueInvalid",
                                       f'Invalid value: "{qty}": {exc}'))
    if causes:
        raise invalid("Pod", name, causes)


def default_pod(pod: dict, toleration_seconds: int = 300) -> None:
    """Defaults as the apiserver sets them; `toleration_seconds` is DefaultTolerationSeconds' value."""
    spec = pod.setdefault("spec", {})
    _validate_containers(pod["metadata"]["name"], spec)
    for group in ("initContainers", "containers"):
        for c in spec.get(group) or []:
            _default_container(c)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    tolerations = spec.setdefault("tolerations", [])
    for default in _DEFAULT_TOLERATIONS:
        if not any(t.get("key") == default["key"] and t.get("effect") in (None, "", "NoExecute") for t in tolerations):
            tolerations.append({**default, "tolerationSeconds": toleration_seconds})
    status = pod.setdefault("status", {})
    status.setdefault("phase", "Pending")
    status.setdefault("qosClass", _qos_class(spec))


def check_pod_update(old: dict, new: dict) -> None:
    """Refuse spec changes the real server refuses (only images, deadlines and tolerations may change)."""
    def frozen(spec: dict) -> dict:
        spec = dict(spec or {})
        spec.pop("activeDeadlineSeconds", None)
        spec.pop("tolerations", None)
        for group in ("containers", "initContainers"):
            if group in spec:
                spec[group] = [{k: v for k, v in c.items() if k != "image"} for c in spec[group]]
        return spec
    if frozen(old.get("spec")) != frozen(new.get("spec")):
        raise invalid("Pod", old["metadata"]["name"], [("spec", "FieldValueForbidden", _MUTABLE_POD_SPEC_MSG)])


def default_namespace(ns: dict) -> None:
    meta = ns["metadata"]
    meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
    ns.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
    ns.setdefault("status", {}).setdefault("phase", "Active")


DEFAULTERS = {"pods": default_pod, "namespaces": default_namespace}
