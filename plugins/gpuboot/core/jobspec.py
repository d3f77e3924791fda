"""The user's GPU job, validated once for the UI form, the YAML specs and the operators.

Every mistake is caught before anything is booted or reserved, and each error
names the field and how to fix it: `f"{source}: {field}: {problem}. {fix}"`.
"""
from __future__ import annotations

import difflib
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gpuboot.core.inventory import gpu_model_alternatives, gpu_model_tokens
from gpuboot.core.model import FrozenDict
from gpuboot.core.placement import JobRequest, TaskRequest
from gpuboot.core.queue import DEFAULT_PRIORITY_CLASS, DEFAULT_TEAM, PRIORITY_CLASSES
from gpuboot.core.resources import CPU, GPU, MEMORY, QUANTITY_PATTERN, QuantityError, Resources, format_quantity
from gpuboot.exceptions import JobSpecError

# Normalized names (see inventory.normalize_gpu_model) of the NVIDIA GPUs ECS GPU families carry.
KNOWN_GPU_MODELS: tuple[str, ...] = (
    "T4", "A10", "V100", "P100", "P4", "M40", "A100", "A800", "A30", "L20", "L40", "L40S", "L4",
    "H20", "H100", "H800", "GU8TF", "GU8TEF",
)
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600
# The fastest a stopped ECS GPU instance goes from StartInstances to registered GPUs (start,
# OS + kubelet, NVIDIA device plugin; typically 60 + 60 + 30 s): boot_timeout_seconds must
# cover it plus settle_seconds. GPUBOOT_MIN_BOOT_SECONDS lowers it for a faster cloud (the
# local cloud boots in seconds); read when the form is built and when a spec is validated.
# What a container's exec can take. Linux refuses (E2BIG) any one argument or "NAME=value"
# environment string of MAX_ARG_STRLEN bytes or more (the terminating NUL included), and all
# of them together beyond ARG_MAX (2 MiB by default, shared with the image's and Kubernetes'
# own variables); the whole pod must also fit etcd's 1.5 MiB object limit. So command, args
# and env together get MAX_CONTAINER_ARGV_ENV_BYTES, well under both.
MAX_ARG_STRLEN = 131072
MAX_CONTAINER_ARGV_ENV_BYTES = 512 * 1024
MIN_BOOT_SECONDS_ENV = "GPUBOOT_MIN_BOOT_SECONDS"
DEFAULT_MIN_BOOT_SECONDS = 60
MAX_SETTLE_SECONDS = 600
MAX_REPLICAS = 1000
MAX_BOOT_FILL_FROM_LOAD = 64       # boot_fill_from_load: past this the forecast is "any node fills" (off in effect)
# The namespaces jobs may run in: an allow-list, so that whoever may trigger `gpu_job` cannot
# create pods in kube-system or another team's namespace. Comma-separated, set in the
# environment of every Airflow component (the form is built by the DAG processor, the spec
# re-checked by the place step on a worker); the first is the default of the `namespace`
# field. deploy/kubernetes/rbac.yaml grants the pod rights in these namespaces only (a Role and
# RoleBinding each): change the two together.
JOB_NAMESPACES_ENV = "GPUBOOT_JOB_NAMESPACES"
DEFAULT_JOB_NAMESPACES = ("gpu-jobs",)

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_LABEL = re.compile(DNS_LABEL)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
# What a job's env value reads as wherever gpuboot shows or passes the job on (XCom "job", rendered
# fields, the spec DAGs' docs): its names only. Values may be tokens; launch alone reads them, from
# the job's source (the DAG run's params or the group's `job`), and puts them in the pods.
ENV_WITHHELD = "(withheld: env values never leave the job's source)"
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def min_boot_seconds() -> int:
    """The shortest boot a boot timeout must allow for, settle window excluded."""
    raw = os.environ.get(MIN_BOOT_SECONDS_ENV, "").strip()
    if not raw:
        return DEFAULT_MIN_BOOT_SECONDS
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_TIMEOUT_SECONDS:
        raise ValueError(f"{MIN_BOOT_SECONDS_ENV}={raw!r}: use whole seconds between 1 and {MAX_TIMEOUT_SECONDS}, "
                         f"e.g. {DEFAULT_MIN_BOOT_SECONDS}")
    return int(raw)


def job_namespaces() -> tuple[str, ...]:
    """The namespaces jobs may run in (GPUBOOT_JOB_NAMESPACES), the default first."""
    raw = os.environ.get(JOB_NAMESPACES_ENV, "").strip()
    if not raw:
        return DEFAULT_JOB_NAMESPACES
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    bad = [n for n in names if not _DNS_LABEL.match(n)]
    if bad or not names:
        problem = f"{bad[0]!r} is not a namespace name" if bad else "names no namespace"
        raise ValueError(f"{JOB_NAMESPACES_ENV}={raw!r}: {problem}; use comma-separated DNS-1123 labels, "
                         f"e.g. {DEFAULT_JOB_NAMESPACES[0]},team-a")
    return names


@dataclass(frozen=True)
class JobSpec:
    name: str
    image: str
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=FrozenDict)
    secret_env: Mapping[str, str] = field(default_factory=FrozenDict)   # NAME -> "secret-name/key"
    env_from_secrets: tuple[str, ...] = ()    # Secrets whose every key becomes a variable (envFrom)
    gpus: int = 1
    cpu: str = "1"
    memory: str = "4Gi"
    gpu_model: tuple[str, ...] = ()           # the GPU models the job accepts, any one will do; () = any
    namespace: str = DEFAULT_JOB_NAMESPACES[0]   # from_dict: the first of job_namespaces()
    replicas: int = 1
    min_available: int | None = None          # None = replicas (a gang: all or nothing)
    node_selector: Mapping[str, str] = field(default_factory=FrozenDict)
    tolerations: tuple[dict, ...] = ()
    queue_timeout_seconds: int = 3600
    boot_timeout_seconds: int = 900
    settle_seconds: int = 5
    reservation_ttl_seconds: int | None = None
    extra_resources: Mapping[str, str] = field(default_factory=FrozenDict)
    allow_gpu_nodes: bool = False             # may a CPU-only job (gpus: 0) use, and boot, GPU nodes?
    # the job queue (gpuboot.core.queue): whose quota and share, its class, and hints for holds and backfill
    team: str = DEFAULT_TEAM
    priority_class: str = DEFAULT_PRIORITY_CLASS
    preemptible: bool = False
    expected_runtime_seconds: int | None = None
    # placement: how full a node this job starts will get, from the load now (placement.CostModel; 0: off)
    boot_fill_from_load: int = 0

    def __post_init__(self):
        for name in ("env", "secret_env", "node_selector", "extra_resources"):
            object.__setattr__(self, name, FrozenDict(getattr(self, name) or {}))
        object.__setattr__(self, "gpu_model", gpu_model_alternatives(self.gpu_model))

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "job spec") -> JobSpec:
        """Validate `data` (YAML spec, DAG params, XCom) into a JobSpec; JobSpecError names the bad field."""
        return _Validator(source).spec(data)

    def to_dict(self, env_values: bool = True) -> dict:
        """JSON-safe; `JobSpec.from_dict(spec.to_dict()) == spec`. `env_values=False`: the env's
        values withheld (ENV_WITHHELD), as the job is passed on and shown."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = [dict(v) if isinstance(v, Mapping) else v for v in value]
            out[f.name] = value
        if not env_values:
            out["env"] = dict.fromkeys(self.env, ENV_WITHHELD)
        return out

    @property
    def env_withheld(self) -> bool:
        """Whether this spec came from a view of the job without its env values (see ENV_WITHHELD)."""
        return any(value == ENV_WITHHELD for value in self.env.values())

    def env_names(self) -> tuple[str, ...]:
        """Every variable the job sets itself (env and secret_env; env_from_secrets' keys are the Secrets')."""
        return (*self.env, *self.secret_env)

    @property
    def gang_size(self) -> int:
        """How many tasks must be placed at once."""
        return self.min_available or self.replicas

    def requests(self) -> Resources:
        """The resources of one task (pod): requests and limits of its container."""
        return Resources.parse({CPU: self.cpu, MEMORY: self.memory, GPU: self.gpus, **self.extra_resources},
                               field="resources")

    def task_names(self) -> tuple[str, ...]:
        if self.replicas == 1:
            return (self.name,)
        return tuple(f"{self.name}-{i}" for i in range(self.replicas))

    def to_job_request(self, job_id: str) -> JobRequest:
        requests = self.requests()
        avoid_gpu_nodes = self.gpus == 0 and not self.allow_gpu_nodes
        tasks = tuple(TaskRequest(name=name, requests=requests, node_selector=self.node_selector,
                                  tolerations=self.tolerations, gpu_model=self.gpu_model,
                                  avoid_gpu_nodes=avoid_gpu_nodes)
                      for name in self.task_names())
        return JobRequest(job_id=job_id, tasks=tasks, min_available=self.gang_size,
                          expected_run_seconds=self.expected_runtime_seconds,
                          boot_fill_from_load=float(self.boot_fill_from_load))


# --- validation ---------------------------------------------------------------

_DEFAULTS = {f.name: f for f in fields(JobSpec)}
_REQUIRED = ("name", "image", "command")


def check_known_fields(data: Mapping, source: str = "job spec", also: Iterable[str] = ()) -> None:
    """Refuse any key that is not a JobSpec field (nor one of `also`, a caller's own keys),
    suggesting the closest known one: the one typo check of the form, the YAML specs and `job`."""
    known = [*_DEFAULTS, *also]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"Did you mean {close[0]!r}?" if close else f"Known fields: {', '.join(known)}"
            raise JobSpecError(str(key), "unknown field", hint, source)


class _Validator:
    """One pass over a raw mapping; each check raises JobSpecError naming the field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, field: str, problem: str, fix: str):
        raise JobSpecError(field, problem, fix, self.source)

    def spec(self, data: Mapping) -> JobSpec:
        if not isinstance(data, Mapping):
            self.fail("(spec)", f"expected a mapping of fields, got {type(data).__name__}",
                      "Write the job as key: value pairs, e.g. name, image, command, gpus")
        check_known_fields(data, self.source)
        raw = {k: v for k, v in data.items() if v is not None}
        for key in _REQUIRED:
            if key not in raw:
                self.fail(key, "is required", f"Set {key}, e.g. {_EXAMPLES[key]}")
        values: dict[str, Any] = {
            "name": self.dns_label("name", raw["name"]),
            "image": self.image(raw["image"]),
            "command": self.argv("command", raw["command"], required=True),
            "args": self.argv("args", raw.get("args", ())),
            "env": self.env(raw.get("env", {})),
            "secret_env": self.secret_env(raw.get("secret_env", {})),
            "env_from_secrets": self.env_from_secrets(raw.get("env_from_secrets", ())),
            "gpus": self.integer("gpus", raw.get("gpus", 1), 0, None),
            "cpu": self.quantity(CPU, raw.get("cpu", "1")),
            "memory": self.quantity(MEMORY, raw.get("memory", "4Gi")),
            "gpu_model": self.gpu_model(raw.get("gpu_model")),
            "namespace": self.namespace(raw.get("namespace")),
            "replicas": self.integer("replicas", raw.get("replicas", 1), 1, MAX_REPLICAS),
            "node_selector": self.node_selector(raw.get("node_selector", {})),
            "tolerations": self.tolerations(raw.get("tolerations", ())),
            "extra_resources": self.extra_resources(raw.get("extra_resources", {})),
            "allow_gpu_nodes": self.boolean("allow_gpu_nodes", raw.get("allow_gpu_nodes", False)),
        }
        values.update(self.queue_fields(raw))
        values["boot_fill_from_load"] = self.integer(
            "boot_fill_from_load", raw.get("boot_fill_from_load", 0), 0, MAX_BOOT_FILL_FROM_LOAD)
        values["queue_timeout_seconds"] = self.integer(
            "queue_timeout_seconds", raw.get("queue_timeout_seconds", 3600), 1, MAX_TIMEOUT_SECONDS)
        values["settle_seconds"] = self.integer("settle_seconds", raw.get("settle_seconds", 5), 0, MAX_SETTLE_SECONDS)
        values["boot_timeout_seconds"] = self.boot_timeout(raw.get("boot_timeout_seconds", 900),
                                                           values["settle_seconds"])
        if "reservation_ttl_seconds" in raw:
            values["reservation_ttl_seconds"] = self.integer(
                "reservation_ttl_seconds", raw["reservation_ttl_seconds"], 1, MAX_TIMEOUT_SECONDS)
        if "min_available" in raw:
            values["min_available"] = self.integer("min_available", raw["min_available"], 1, values["replicas"])
        both = sorted(set(values["env"]) & set(values["secret_env"]))
        if both:
            self.fail(f"secret_env.{both[0]}", "is also set in env", f"Set {both[0]} in one of env and secret_env")
        self.exec_size(values["command"], values["args"], values["env"])
        replicas = values["replicas"]
        longest = len(values["name"]) + (len(f"-{replicas - 1}") if replicas > 1 else 0)
        if longest > 63:
            self.fail("name", f"task names like {values['name']}-{values['replicas'] - 1} would be {longest} "
                      "characters, over the 63 a Kubernetes label value allows", "Use a shorter name")
        return JobSpec(**values)

    def queue_fields(self, raw: Mapping) -> dict:
        """team, priority_class, preemptible, expected_runtime_seconds: all optional."""
        values = {"team": self.dns_label("team", raw.get("team", DEFAULT_TEAM)),
                  "preemptible": self.boolean("preemptible", raw.get("preemptible", False))}
        priority = raw.get("priority_class", DEFAULT_PRIORITY_CLASS)
        if priority not in PRIORITY_CLASSES:
            self.fail("priority_class", f"{priority!r} is not a priority class",
                      f"Use one of {', '.join(map(repr, PRIORITY_CLASSES))} ({DEFAULT_PRIORITY_CLASS!r} when left out)")
        values["priority_class"] = priority
        if "expected_runtime_seconds" in raw:
            values["expected_runtime_seconds"] = self.integer(
                "expected_runtime_seconds", raw["expected_runtime_seconds"], 1, MAX_TIMEOUT_SECONDS)
        return values

    def dns_label(self, key: str, value) -> str:
        if not isinstance(value, str) or not _DNS_LABEL.match(value):
            self.fail(key, f"{value!r} is not a DNS-1123 label",
                      "Use at most 63 lower-case letters, digits and '-', starting and ending with a letter "
                      "or digit, e.g. 'train-resnet'")
        return value

    def namespace(self, value) -> str:
        """One of the configured job namespaces (GPUBOOT_JOB_NAMESPACES); absent: the first."""
        allowed = job_namespaces()
        if value is None:
            return allowed[0]
        if value not in allowed:
            self.fail("namespace", f"{value!r} is not a namespace gpuboot runs jobs in",
                      f"Use {' or '.join(map(repr, allowed))} ({allowed[0]!r} when left out); an "
                      f"administrator adds namespaces to {JOB_NAMESPACES_ENV} and grants gpuboot a Role there "
                      "(deploy/kubernetes/rbac.yaml)")
        return value

    def image(self, value) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail("image", "is missing or empty", "Set a container image, e.g. 'pytorch/pytorch:2.3.0-cuda12.1'")
        if any(c.isspace() for c in value.strip()):
            self.fail("image", f"{value!r} contains whitespace", "Set one image reference, e.g. 'repo/name:tag'")
        return value.strip()

    def argv(self, key: str, value, required: bool = False) -> tuple[str, ...]:
        if isinstance(value, str):
            try:
                items = shlex.split(value)
            except ValueError as err:
                self.fail(key, f"cannot be split into words ({err})", "Check the quotes, or give a list of strings")
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                                      for v in value):
            items = [str(v) for v in value]
        else:
            self.fail(key, f"expected a string or a list of strings, got {type(value).__name__}",
                      f"Write e.g. {_EXAMPLES['command']}")
        if required and not items:
            self.fail(key, "is empty", f"Give the program to run, e.g. {_EXAMPLES['command']}")
        return tuple(items)

    def env(self, value) -> dict[str, str]:
        if not isinstance(value, Mapping):
            self.fail("env", f"expected a mapping of NAME: value, got {type(value).__name__}",
                      "Write e.g. {EPOCHS: '3'}")
        out = {}
        for name, item in value.items():
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                self.fail(f"env.{name}", "is not a valid environment variable name",
                          "Use letters, digits, '_', '-' or '.', not starting with a digit")
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                self.fail(f"env.{name}", f"expected a string value, got {type(item).__name__}", "Quote the value")
            out[name] = str(item)
        return out

    def secret_env(self, value) -> dict[str, str]:
        """NAME: "secret-name/key", each a variable whose value the kubelet reads from a Secret of the
        job's namespace (valueFrom.secretKeyRef): the value never passes through Airflow."""
        example = "{HF_TOKEN: 'hf-token/token'}"
        if not isinstance(value, Mapping):
            self.fail("secret_env", f"expected a mapping of NAME: 'secret-name/key', got {type(value).__name__}",
                      f"Write e.g. {example}")
        out = {}
        for name, item in value.items():
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                self.fail(f"secret_env.{name}", "is not a valid environment variable name",
                          "Use letters, digits, '_', '-' or '.', not starting with a digit")
            secret, _, key = item.partition("/") if isinstance(item, str) else ("", "", "")
            if not (self._secret_name(secret) and _SECRET_KEY.fullmatch(key) and len(key) <= 253):
                self.fail(f"secret_env.{name}", f"{item!r} does not name a Secret and a key",
                          f"Write 'secret-name/key' (a Secret of the job's namespace and one of its keys), e.g. {example}")
            out[name] = f"{secret}/{key}"
        return out

    def env_from_secrets(self, value) -> tuple[str, ...]:
        """Secrets of the job's namespace whose every key becomes a variable (envFrom.secretRef)."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            self.fail("env_from_secrets", f"expected a list of Secret names, got {type(value).__name__}",
                      "Write e.g. [wandb, s3-credentials]")
        for i, item in enumerate(value):
            if not self._secret_name(item):
                self.fail(f"env_from_secrets[{i}]", f"{item!r} is not a Secret name",
                          "Use lower-case letters, digits, '-' and '.', at most 253, e.g. 'wandb'")
        return tuple(dict.fromkeys(value))

    @staticmethod
    def _secret_name(value) -> bool:
        return isinstance(value, str) and len(value) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(value))

    def boot_timeout(self, value, settle: int) -> int:
        """Long enough for a boot to become GPU-ready and hold it: else every boot would time out
        and take a healthy node out of service."""
        timeout = self.integer("boot_timeout_seconds", value, 1, MAX_TIMEOUT_SECONDS)
        floor = min_boot_seconds()
        if timeout < floor + settle:
            self.fail("boot_timeout_seconds", f"{timeout}s is shorter than a boot can take: {floor}s for the node "
                      f"to start and register its GPUs plus settle_seconds={settle}",
                      f"Use at least {floor + settle} (or a smaller settle_seconds)")
        return timeout

    def exec_size(self, command: tuple[str, ...], args: tuple[str, ...], env: Mapping[str, str]) -> None:
        """Refuse what no container can exec (E2BIG): the pod would never start, holding its node."""
        strings = [(f"command[{i}]", a) for i, a in enumerate(command)] + \
            [(f"args[{i}]", a) for i, a in enumerate(args)] + [(f"env.{k}", f"{k}={v}") for k, v in env.items()]
        total = 0
        for where, text in strings:
            size = len(text.encode()) + 1
            total += size
            if size > MAX_ARG_STRLEN:
                self.fail(where, f"is {size - 1} bytes, over Linux's per-argument limit of {MAX_ARG_STRLEN - 1} "
                          "(MAX_ARG_STRLEN), so no container can start with it",
                          "Pass large data in a file (a ConfigMap, a volume, the image) and give its path")
        if total > MAX_CONTAINER_ARGV_ENV_BYTES:
            self.fail("command+args+env", f"take {total} bytes together, over the {MAX_CONTAINER_ARGV_ENV_BYTES} "
                      "gpuboot allows (Linux's ARG_MAX, 2 MiB, is shared with the image's and Kubernetes' own "
                      "variables)", "Pass large data in a file (a ConfigMap, a volume, the image) and give its path")

    def integer(self, key: str, value, low: int, high: int | None) -> int:
        if (isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value)) or (isinstance(value, float) and value.is_integer()):
            value = int(value)
        bounds = f"between {low} and {high}" if high is not None else f"an integer >= {low}"
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"{value!r} is not a whole number", f"Use {bounds}")
        if value < low or (high is not None and value > high):
            self.fail(key, f"{value} is out of range", f"Use {bounds}")
        return value

    def boolean(self, key: str, value) -> bool:
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if not isinstance(value, bool):
            self.fail(key, f"{value!r} is not true or false", "Use true or false")
        return value

    def quantity(self, key: str, value) -> str:
        """Checked with the exact parser; kept as the user wrote it."""
        try:
            amount = Resources.parse({key: value}, field=key).get(key)
        except QuantityError as err:       # its text begins with the field's path: the field is named already
            self.fail(key, str(err).split(": ", 1)[-1].rstrip("."), f"Write e.g. {_EXAMPLES[key]}")
        if amount <= 0:
            self.fail(key, f"{value!r} must be more than zero", f"Write e.g. {_EXAMPLES[key]}")
        return value.strip() if isinstance(value, str) else str(value)

    def gpu_model(self, value) -> tuple[str, ...]:
        """One model, a list of models, or 'A|B' (the openb trace's gpu_spec): the job runs on a node
        of any of them. None, '' and [] accept any model."""
        if value is None:
            return ()
        if isinstance(value, str):
            items = [("gpu_model", part) for part in value.split("|")] if value.strip() else []
        elif isinstance(value, (list, tuple)):
            items = [(f"gpu_model[{i}]", item) for i, item in enumerate(value)]
        else:
            self.fail("gpu_model", f"expected a model name or a list of them, got {type(value).__name__}",
                      f"Write e.g. 'T4', or [V100M16, V100M32] (or 'V100M16|V100M32') for any of several. "
                      f"{_GPU_MODEL_HINT}")
        for where, item in items:
            if not isinstance(item, str):
                self.fail(where, f"expected a model name, got {type(item).__name__}", f"Quote it. {_GPU_MODEL_HINT}")
            if not item.strip():
                self.fail(where, f"{value!r} has an empty model name",
                          "Separate models with a single '|' (e.g. 'V100M16|V100M32') or give a list")
            tokens = gpu_model_tokens(item)
            if not tokens or tokens[0] not in KNOWN_GPU_MODELS:
                self.fail(where, f"{item.strip()!r} is not a GPU model ECS offers", _GPU_MODEL_HINT)
        return gpu_model_alternatives(item for _, item in items)

    def labels(self, key: str, value) -> dict[str, str]:
        if not isinstance(value, Mapping):
            self.fail(key, f"expected a mapping of label: value, got {type(value).__name__}",
                      "Write e.g. {'aliyun.accelerator/nvidia_name': 'Tesla-T4'}")
        out = {}
        for name, item in value.items():
            if not isinstance(name, str) or not _qualified_name(name, domain_required=False):
                self.fail(f"{key}.{name}", "is not a valid label key", "Use e.g. 'example.com/pool' or 'pool'")
            if isinstance(item, bool) or not isinstance(item, (str, int)) or \
                    not _LABEL_VALUE.fullmatch(str(item)) or len(str(item)) > 63:
                self.fail(f"{key}.{name}", f"{item!r} is not a valid label value",
                          "Use at most 63 letters, digits, '-', '_' or '.', quoted as a string")
            out[name] = str(item)
        return out

    def node_selector(self, value) -> dict[str, str]:
        return self.labels("node_selector", value)

    def tolerations(self, value) -> tuple[dict, ...]:
        if not isinstance(value, (list, tuple)):
            self.fail("tolerations", f"expected a list, got {type(value).__name__}",
                      "Write e.g. [{key: gpu, operator: Exists, effect: NoSchedule}]")
        out = []
        for i, item in enumerate(value):
            where = f"tolerations[{i}]"
            if not isinstance(item, Mapping) or set(item) - _TOLERATION_KEYS:
                self.fail(where, f"expected a toleration with keys {sorted(_TOLERATION_KEYS)}, got {item!r}",
                          "Write e.g. {key: gpu, operator: Exists, effect: NoSchedule}")
            operator = item.get("operator", "Equal")
            if operator not in ("Equal", "Exists"):
                self.fail(f"{where}.operator", f"{operator!r} is not an operator", "Use Equal or Exists")
            if item.get("effect", "") not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
                self.fail(f"{where}.effect", f"{item['effect']!r} is not a taint effect",
                          "Use NoSchedule, PreferNoSchedule or NoExecute (or leave it out for all)")
            if operator == "Exists" and item.get("value"):
                self.fail(f"{where}.value", "must be empty with operator Exists", "Remove value or use Equal")
            if operator == "Equal" and not item.get("key"):
                self.fail(f"{where}.key", "is required with operator Equal", "Set key, or use operator Exists")
            out.append(dict(item))
        return tuple(out)

    def extra_resources(self, value) -> dict[str, str]:
        if not isinstance(value, Mapping):
            self.fail("extra_resources", f"expected a mapping of resource: quantity, got {type(value).__name__}",
                      "Write e.g. {'example.com/fpga': 1}")
        out = {}
        for name, item in value.items():
            where = f"extra_resources.{name}"
            if name in (CPU, MEMORY, GPU):
                self.fail(where, "is set by its own field", f"Use the {'gpus' if name == GPU else name} field")
            standard = name == "ephemeral-storage" or str(name).startswith("hugepages-")
            if not isinstance(name, str) or not (standard or _qualified_name(name, domain_required=True)):
                self.fail(where, "is not a known resource name",
                          "Use a qualified name with a domain, e.g. 'example.com/foo', or ephemeral-storage")
            try:
                amount = Resources.parse({name: item}, field=where).get(name)
            except QuantityError as err:
                self.fail(where, f"{item!r} is not a valid amount ({err})", "Write a whole number, e.g. 1")
            out[name] = format_quantity(name, amount)
        return out


def _qualified_name(name: str, domain_required: bool) -> bool:
    prefix, _, local = name.rpartition("/")
    if domain_required and not prefix:
        return False
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    if domain_required and "." not in prefix:
        return False
    return len(local) <= 63 and bool(_NAME_PART.fullmatch(local))


_GPU_MODEL_HINT = (f"Use one of {', '.join(KNOWN_GPU_MODELS)} (e.g. 'T4'; 'Tesla-T4' and 'NVIDIA T4' work too), "
                   "with the memory per GPU when it matters ('V100M16' or 'V100-16GB'); several as a list "
                   "[V100M16, V100M32] or 'V100M16|V100M32' (any of them will do); or leave it empty for any model")
_EXAMPLES = {
    "name": "'train-resnet'",
    "image": "'pytorch/pytorch:2.3.0-cuda12.1'",
    "command": "['python', 'train.py'] or 'python train.py --epochs 3'",
    CPU: "'500m', '2' or 4",
    MEMORY: "'512Mi', '16Gi'",
}


# --- the UI form ----------------------------------------------------------------

# The fields a form shows first; the rest go under "Advanced" (the trigger form and the job page).
FORM_MAIN_FIELDS: tuple[str, ...] = ("name", "image", "command", "args", "gpus", "gpu_model", "cpu", "memory")
# A valid stand-in for a required field while the other fields are checked (field_errors).
_STAND_INS = {"name": "job", "image": "image", "command": ["true"]}


def field_errors(data: Mapping, source: str = "job form") -> dict[str, str]:
    """Every field's mistake at once, keyed by top-level field ("problem. fix"); {} when `data` is a
    valid spec. JobSpec.from_dict stops at the first mistake, so this asks it again with each field it
    named set aside (its default, or a valid stand-in for a required field), so that a form can show
    every message next to its field from the one validator the place step uses."""
    data, errors = dict(data), dict[str, str]()
    for _ in range(len(_DEFAULTS) + len(data) + 1):
        try:
            JobSpec.from_dict(data, source)
            break
        except JobSpecError as error:
            key = re.split(r"[.\[]", error.field, maxsplit=1)[0]
            if key in errors or (key not in data and key not in _REQUIRED):
                errors.setdefault(key, f"{error.problem}. {error.fix}")
                break                      # a mistake no single field holds: said once, not looped on
            errors[key] = f"{error.problem}. {error.fix}"
            if key in _REQUIRED:
                data[key] = _STAND_INS[key]
            else:
                data.pop(key)
    return errors


# The GPU models the trigger form offers (the common ECS GPU families; any of KNOWN_GPU_MODELS is accepted
# from YAML specs and the REST API). "any" is the empty choice.
FORM_GPU_MODELS: tuple[str, ...] = ("T4", "A10", "V100", "A100", "L20", "H20")


# Rules the trigger form's schema states as a "format", checked when Airflow validates the params at
# trigger time. jsonschema says a failed format as "<value> is not a '<format>'", so each format's name is
# its rule in words: "'Bad_Name' is not a 'Kubernetes name: ...'" instead of the regex the pattern would
# quote ("does not match '^[a-z0-9]...'"), and "-1 is not a 'whole number...'" instead of "less than or
# equal to the minimum of -1". Each format comes before the pattern or bound that checks the same rule
# (jsonschema reports the first failed keyword of equal weight), which stays in the schema for a process
# where the formats are not registered (register_form_formats: params_schema and the gpuboot plugin do).
NAME_FORMAT = "Kubernetes name: use lower case letters, digits and '-', at most 63, starting and ending with a letter or digit"
GPUS_FORMAT = "whole number of GPUs: 0 or more (0 runs on CPU only)"
FORM_FORMATS = {
    NAME_FORMAT: lambda v: not isinstance(v, str) or bool(_DNS_LABEL.match(v)),
    GPUS_FORMAT: lambda v: isinstance(v, bool) or not isinstance(v, int) or v >= 0,
}


def register_form_formats() -> None:
    """Make jsonschema's FormatChecker (the one Airflow validates params with) know FORM_FORMATS."""
    from jsonschema import FormatChecker  # type: ignore[import-untyped]

    for name, check in FORM_FORMATS.items():
        FormatChecker.checkers.setdefault(name, (check, ()))


def _optional(schema: dict) -> dict:
    """The schema with "null" among its types: Airflow's form marks a field required unless it may be null,
    and an empty optional field sends null, which JobSpec reads as "the default"."""
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return {**schema, "type": ["null", *[t for t in types if t != "null"]]}


def params_schema() -> dict[str, dict]:
    """field -> {"default", "schema", "description"}: Airflow Params that validate like from_dict.

    Shaped for Airflow 3.3's trigger form, which picks the widget from the schema: a single type
    "string" is a one-line input, an array of strings a one-per-line box, "object" a JSON editor, an
    enum a drop-down (labels from values_display), integer a number box (it clamps to "minimum" when
    the field is left, so bounds are given as exclusiveMinimum: refused with the rule, never changed).
    Only name, image and command lack "null" in their type: those alone show as required. The form
    checks types and JSON syntax as you type; patterns and bounds are checked when Trigger is pressed
    (Airflow's validation of the params), and JobSpec.from_dict stays the backstop with the field and
    the fix named. Titles and descriptions say the rule in words, with an example in the field's syntax."""
    # what one schema can check of the exec limits (characters, not bytes; the rest is checked by place)
    string_list = {"type": "array", "items": {"type": "string", "maxLength": MAX_ARG_STRLEN - 1},
                   "maxLength": MAX_CONTAINER_ARGV_ENV_BYTES}
    # a quantity above zero: QUANTITY_PATTERN, unless it is all zeros (0, 0.0, 0Gi, 0e3)
    positive = r"^(?![\s+]*[0.]+(?:[eE][+-]?\d+)?[A-Za-z]*\s*$)" + QUANTITY_PATTERN.removeprefix("^")
    quantity = {"type": ["null", "string"], "pattern": positive, "minLength": 1}
    seconds = {"type": ["null", "integer"], "exclusiveMinimum": 0, "exclusiveMaximum": MAX_TIMEOUT_SECONDS + 1}
    register_form_formats()
    namespaces = job_namespaces()
    min_boot = min_boot_seconds()
    spec = {
        "name": (None, {"type": "string", "format": NAME_FORMAT, "pattern": DNS_LABEL, "title": "Job name"},
                 ("Lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63 "
                 "characters (a Kubernetes name), e.g. train-resnet")),
        "image": (None, {"type": "string", "minLength": 1, "pattern": r"^\S+$", "title": "Container image"},
                  "One image reference, no spaces, e.g. pytorch/pytorch:2.3.0-cuda12.1"),
        "command": (None, {"type": ["array", "string"], "items": string_list["items"],
                           "maxLength": MAX_CONTAINER_ARGV_ENV_BYTES, "minLength": 1, "minItems": 1,
                           "title": "Command"},
                    "The program and its arguments, one per line (e.g. python, then train.py)"),
        "args": (None, _optional({**string_list, "title": "Arguments"}),
                 "Optional: more arguments after the command, one per line (e.g. --epochs, then 3)"),
        "env": (None, {"type": ["null", "object"], "title": "Environment",
                       "additionalProperties": {"type": ["string", "number"], "maxLength": MAX_ARG_STRLEN - 2}},
                ('Optional: environment variables as a JSON object, e.g. {"EPOCHS": "3"}; shown everywhere '
                 'by name only. For secrets use Secret environment')),
        "secret_env": (None, {"type": ["null", "object"], "title": "Secret environment",
                              "additionalProperties": {"type": "string", "pattern": r"^[a-z0-9][-a-z0-9.]*/[-._a-zA-Z0-9]+$"}},
                       ('Optional: variables read from Kubernetes Secrets of the namespace, as JSON NAME: '
                        '"secret-name/key", e.g. {"HF_TOKEN": "hf-token/token"}')),
        "env_from_secrets": (None, _optional({"type": "array", "items": {"type": "string"},
                                              "title": "Secrets as environment"}),
                             "Optional: Secrets of the namespace whose every key becomes a variable, one per line"),
        "gpus": (1, {"type": ["null", "integer"], "format": GPUS_FORMAT, "exclusiveMinimum": -1, "title": "GPUs"},
                 "GPUs per task: a whole number, 0 or more (0 runs on CPU only)"),
        "cpu": ("1", {**quantity, "title": "CPU"},
                "CPU per task as a Kubernetes quantity above zero: 500m is half a core, 2 is two cores"),
        "memory": ("4Gi", {**quantity, "title": "Memory"},
                   "Memory per task as a Kubernetes quantity above zero with a unit: 512Mi, 16Gi"),
        "gpu_model": (None, {"type": ["null", "string"], "enum": [None, *FORM_GPU_MODELS],
                             "values_display": {"null": "any"}, "title": "GPU model"},
                      "Run only on this GPU model, or any"),
        "namespace": (namespaces[0], {"type": ["null", "string"], "enum": list(namespaces), "title": "Namespace"},
                      "Namespace for the pod(s): one of those gpuboot is configured for"),
        "replicas": (1, {"type": ["null", "integer"], "exclusiveMinimum": 0, "exclusiveMaximum": MAX_REPLICAS + 1,
                         "title": "Replicas"}, f"Number of pods, 1 to {MAX_REPLICAS}"),
        "min_available": (None, {"type": ["null", "integer"], "exclusiveMinimum": 0, "title": "Minimum available"},
                          "Optional: pods that must be placed together (empty: all replicas)"),
        "node_selector": (None, {"type": ["null", "object"], "additionalProperties": {"type": "string"},
                                 "title": "Node selector"},
                          'Optional: node labels the pods require, as JSON, e.g. {"pool": "training"}'),
        "tolerations": (None, {"type": ["null", "array"], "items": {"type": "object"}, "title": "Tolerations"},
                        ('Optional: taints the pods tolerate, as a JSON list, e.g. '
                        '[{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]')),
        "queue_timeout_seconds": (3600, {**seconds, "title": "Queue timeout (s)"},
                                  "Seconds to wait for busy capacity, 1 or more"),
        "boot_timeout_seconds": (900, {**seconds, "exclusiveMinimum": min_boot - 1, "title": "Boot timeout (s)"},
                                 (f"Seconds a started node may take to have its GPUs ready: at least "
                                 f"{min_boot} plus settle_seconds")),
        "settle_seconds": (5, {"type": ["null", "integer"], "exclusiveMinimum": -1, "exclusiveMaximum": MAX_SETTLE_SECONDS + 1,
                               "title": "Settle (s)"},
                           f"Seconds readiness must hold before the pod is committed, 0 to {MAX_SETTLE_SECONDS}"),
        "reservation_ttl_seconds": (None, {**seconds, "title": "Reservation lifetime (s)"},
                                    "Optional: how long a reservation lives (empty: derived from the timeouts)"),
        "extra_resources": (None, {"type": ["null", "object"], "additionalProperties": {"type": ["string", "integer"]},
                                   "title": "Extra resources"},
                            'Optional: other extended resources per task, as JSON, e.g. {"example.com/fpga": 1}'),
        "allow_gpu_nodes": (False, {"type": ["null", "boolean"], "title": "Allow GPU nodes"},
                            "Let a CPU-only job (gpus 0) run on, and boot, GPU nodes (off: it stays on CPU nodes)"),
        "team": (DEFAULT_TEAM, {"type": ["null", "string"], "pattern": DNS_LABEL, "title": "Team (queue)"},
                 "Whose quota and fair share the job counts against, e.g. vision"),
        "priority_class": (DEFAULT_PRIORITY_CLASS, {"type": ["null", "string"], "enum": list(PRIORITY_CLASSES),
                                                    "title": "Priority class"},
                           "Waiting jobs of a higher class go first; high also gets held nodes at once"),
        "preemptible": (False, {"type": ["null", "boolean"], "title": "Preemptible"},
                        "The job may be stopped and requeued to make room for a job of a higher class"),
        "boot_fill_from_load": (0, {"type": ["null", "integer"], "minimum": 0, "maximum": MAX_BOOT_FILL_FROM_LOAD,
                                    "title": "Boot fill from load"},
                                ("Optional, 0 (off) to 64: a node this job starts is priced as if it would carry "
                                 "this times the GPUs in use now; e.g. 4 on a fleet whose demand seldom fills "
                                 "a large node")),
        "expected_runtime_seconds": (None, {**seconds, "title": "Expected runtime (s)"},
                                     ("Optional: how long the job runs; lets it use nodes held for others "
                                      "when it ends before they are due")),
    }
    assert set(spec) == set(_DEFAULTS), "params_schema must cover every JobSpec field"
    return {key: {"default": default, "schema": schema, "description": description}
            for key, (default, schema, description) in spec.items()}


def form_fields() -> list[dict]:
    """The job form's fields in the order a form shows them (main fields first, then "Advanced"):
    key, title, description, default, schema (params_schema's), required, main. The trigger form of
    `gpu_job` and gpuboot's own job page are both built from this."""
    schema = params_schema()
    order = [f for f in FORM_MAIN_FIELDS if f in schema] + [f for f in schema if f not in FORM_MAIN_FIELDS]
    return [{"key": key, "title": schema[key]["schema"].get("title", key), "description": schema[key]["description"],
             "default": schema[key]["default"], "schema": schema[key]["schema"], "required": key in _REQUIRED,
             "main": key in FORM_MAIN_FIELDS} for key in order]

