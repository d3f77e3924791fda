"""Read the openb GPU-cluster trace (alibaba/clusterdata, cluster-trace-gpu-v2023).

Fleet from the node list, jobs from the pod list. The CSVs are read in place
(never copied into the repo). What cannot be replayed is skipped and counted,
so every report can say how much of the trace it covers.
"""
from __future__ import annotations

import csv
import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from gpuboot.core.inventory import gpu_model_alternatives, gpu_model_matches
from gpuboot.core.resources import CPU, GPU, MEMORY, Resources

from .prices import node_price

NODE_FILE = "openb_node_list_gpu_node.csv"
POD_FILE = "openb_pod_list_default.csv"
_REPO = Path(__file__).resolve().parents[3]
DEFAULT_TRACE_DIRS = (_REPO.parent / "shared" / "traces", Path("/work/shared/traces"))

# Trace model column -> the ACK node label value (aliyun.accelerator/nvidia_name).
# G2/G3 are anonymised in the trace and kept as they are.
MODEL_LABELS = {
    "T4": "Tesla-T4",
    "P100": "Tesla-P100-PCIE-16GB",
    "V100M16": "Tesla-V100-SXM2-16GB",
    "V100M32": "Tesla-V100-SXM2-32GB",
    "A10": "NVIDIA-A10",
}

_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class TraceError(ValueError):
    """A trace file or option that cannot be used; the message says which and how to fix it."""


@dataclass(frozen=True)
class FleetNode:
    name: str
    gpus: int
    cpu_milli: int
    memory_mib: int
    model: str       # as in the trace (T4, V100M16, G2, ...)

    @property
    def gpu_model(self) -> str:
        return MODEL_LABELS.get(self.model, self.model)

    @property
    def instance_type(self) -> str:
        return f"openb.{self.model.lower()}.{self.gpus}g{self.cpu_milli // 1000}c{self.memory_mib // 1024}g"

    @property
    def capacity(self) -> Resources:
        return Resources({CPU: self.cpu_milli, MEMORY: self.memory_mib * 2**20, GPU: self.gpus})

    @property
    def price_per_hour(self) -> float:
        """USD per hour while powered on (gpuboot.replay.prices)."""
        return node_price(self.model, self.gpus, self.cpu_milli, self.memory_mib)


@dataclass(frozen=True)
class TraceJob:
    name: str
    arrival: float        # creation_time
    run_seconds: float    # deletion_time - scheduled_time
    requests: Resources
    fractional: bool = False   # the pod shared a GPU (gpu_milli < 1000); replayed as 1 whole GPU
    gpu_models: tuple[str, ...] = ()   # gpu_spec: the models the pod accepts, as the trace names them; () = any

    @property
    def gpus(self) -> int:
        return self.requests.gpus

    def accepts(self, node: FleetNode) -> bool:
        """Whether the pod may run on `node`'s GPU model (the baselines' filter; gpuboot's is place())."""
        return gpu_model_matches(self.gpu_models, node.gpu_model)


def parse_duration(text: str | float | int, field: str) -> float:
    """'90', '90s', '15m', '6h', '7d' -> seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _DURATION.fullmatch(str(text).strip())
        if not match:
            raise TraceError(f"{field}: {text!r} is not a duration; write seconds or e.g. 90s, 15m, 6h, 7d")
        value = float(match["n"]) * _UNIT[match["unit"]]
    if value < 0:
        raise TraceError(f"{field}: {text!r} is negative; durations are >= 0, e.g. 10m")
    return value


def find_trace_dir(explicit: str | Path | None = None) -> Path:
    """The explicit directory, else ../shared/traces next to the repo, else /work/shared/traces."""
    candidates = [Path(explicit)] if explicit else list(DEFAULT_TRACE_DIRS)
    for directory in candidates:
        if (directory / NODE_FILE).is_file() and (directory / POD_FILE).is_file():
            return directory
    where = ", ".join(str(c) for c in candidates)
    raise TraceError(f"trace dir: {NODE_FILE} and {POD_FILE} not found in {where}; pass --trace DIR")


def _int(row: dict, column: str, source: str) -> int:
    try:
        return int(row[column])
    except (KeyError, TypeError, ValueError):
        raise TraceError(f"{source}: row {row.get('name') or row.get('sn')}: column {column} "
                         f"must be an integer, got {row.get(column)!r}") from None


def load_fleet(directory: Path, size: int | None = None, sample: str = "first", seed: int = 0) -> list[FleetNode]:
    """GPU nodes from the node list: all, the first `size`, or a seeded random `size` (sorted by name)."""
    source = str(directory / NODE_FILE)
    with open(directory / NODE_FILE, newline="") as handle:
        nodes = [FleetNode(row["sn"], _int(row, "gpu", source), _int(row, "cpu_milli", source),
                           _int(row, "memory_mib", source), row["model"]) for row in csv.DictReader(handle)]
    if size is None or size >= len(nodes):
        return nodes
    if size < 1:
        raise TraceError(f"fleet size: {size} must be >= 1 (the node list has {len(nodes)})")
    if sample == "first":
        return nodes[:size]
    if sample == "random":
        return sorted(random.Random(seed).sample(nodes, size), key=lambda n: n.name)
    raise TraceError(f"fleet sample: {sample!r} is not known; use 'first' or 'random'")


@dataclass
class JobLoad:
    """The replayable jobs of a window, and what the replay had to drop or simplify."""

    jobs: list[TraceJob]
    skipped: Counter            # reason -> pods not replayed
    fractional: int = 0         # pods sharing a GPU, replayed as 1 whole GPU
    gpu_spec: int = 0           # pods that accept only some GPU models (gpu_spec), placed on one of them


GPU_SHARE = ("all", "whole", "shared")     # load_jobs' gpu_share: every GPU pod, or only one kind


def load_jobs(directory: Path, start: float = 0.0, end: float | None = None,
              include_cpu_only: bool = False, gpu_share: str = "all") -> JobLoad:
    """Pods created in [start, end) as jobs of one task each. `gpu_share` derives the trace's
    GPU-sharing variants: "whole" keeps only the pods with whole GPUs, "shared" only the pods
    sharing a GPU (gpu_milli < 1000, each replayed as 1 whole GPU), "all" both."""
    if gpu_share not in GPU_SHARE:
        raise TraceError(f"gpu share: {gpu_share!r} is not known; use one of {', '.join(GPU_SHARE)}")
    source = str(directory / POD_FILE)
    jobs: list[TraceJob] = []
    skipped: Counter = Counter()
    fractional_count = gpu_spec_count = 0
    with open(directory / POD_FILE, newline="") as handle:
        for row in csv.DictReader(handle):
            created = _int(row, "creation_time", source)
            if created < start or (end is not None and created >= end):
                continue
            if not row.get("scheduled_time") or not row.get("deletion_time"):
                skipped["no scheduled or deletion time (never ran in the trace)"] += 1
                continue
            run = _int(row, "deletion_time", source) - _int(row, "scheduled_time", source)
            if run <= 0:
                skipped["run time <= 0"] += 1
                continue
            gpus, milli = _int(row, "num_gpu", source), _int(row, "gpu_milli", source)
            if gpus == 0 and not include_cpu_only:
                skipped["CPU-only (runs on CPU nodes, not this GPU fleet)"] += 1
                continue
            fractional = gpus == 1 and 0 < milli < 1000
            if gpus and gpu_share != "all" and fractional != (gpu_share == "shared"):
                skipped[f"not in the '{gpu_share}' GPU-sharing variant"] += 1
                continue
            fractional_count += fractional
            models = gpu_model_alternatives(row.get("gpu_spec") or "")    # 'V100M16|V100M32'
            gpu_spec_count += bool(models)
            requests = Resources({CPU: _int(row, "cpu_milli", source),
                                  MEMORY: _int(row, "memory_mib", source) * 2**20, GPU: gpus})
            jobs.append(TraceJob(row["name"], float(created), float(run), requests, fractional, models))
    jobs.sort(key=lambda j: (j.arrival, j.name))
    return JobLoad(jobs, skipped, fractional_count, gpu_spec_count)


def pin_gpu_models(jobs: list[TraceJob], fleet: list[FleetNode], share: float) -> list[TraceJob]:
    """The trace's GPU-model variant: a `share` (0..1) of the GPU jobs that accept any model, chosen
    by a hash of the name, accept only one model of `fleet` that can hold them, drawn by the same
    hash in proportion to the fleet's GPUs of each model (as gpu_spec pins a pod to its models)."""
    if not 0 <= share <= 1:
        raise TraceError(f"gpu-model share: {share!r} must be between 0 and 1, e.g. 0.3")
    gpus: Counter = Counter()
    for node in fleet:
        gpus[node.model] += node.gpus
    pinned = []
    for job in jobs:
        draw = zlib.crc32(f"gpu-model:{job.name}".encode())
        if job.gpu_models or not job.gpus or draw % 1000 >= share * 1000:
            pinned.append(job)
            continue
        fits = sorted(m for m in gpus if any(n.model == m and job.requests.fits_in(n.capacity) for n in fleet))
        weights = [gpus[m] for m in fits]
        point = (draw // 1000) % max(1, sum(weights))
        chosen = ()
        for model, weight in zip(fits, weights):
            if point < weight:
                chosen = (model,)
                break
            point -= weight
        pinned.append(replace(job, gpu_models=chosen) if chosen else job)
    return pinned
