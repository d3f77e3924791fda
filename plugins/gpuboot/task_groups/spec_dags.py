"""Recurring GPU jobs written as YAML job specs: one YAML file becomes one scheduled DAG.

A spec holds the JobSpec fields plus the DAG-level keys in ``DAG_KEYS``::

    # dags/jobs/nightly_finetune.yaml
    schedule: "0 2 * * *"          # cron or preset (@daily, @hourly, ...); required
    image: python:3.11
    command: python train.py --epochs 3
    gpus: 1
    gpu_model: T4

Airflow only imports ``.py`` files and records import errors per Python file, so each
spec has a two-line loader next to it (``nightly_finetune.py``) that calls
``dag_from_spec_file(__file__)``. A malformed spec then fails the import of its own
loader only: the UI lists it as an import error naming the YAML file and the field,
and every other job keeps loading.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gpuboot.core.jobspec import JobSpec, check_known_fields

SPEC_SUFFIXES = (".yaml", ".yml")
DEFAULT_START_DATE = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
DAG_KEYS = {
    "schedule": "cron expression or preset, e.g. '0 2 * * *' or '@daily'",
    "start_date": "date the schedule starts from, e.g. 2025-01-01 (default)",
    "tags": "list of UI tags, e.g. [nightly, llm]",
    "description": "one line shown in the DAG list",
}


class SpecFileError(ValueError):
    """A problem in a spec file's DAG-level keys, formatted like JobSpecError."""

    def __init__(self, source: str, field: str, problem: str, fix: str):
        self.source, self.field = source, field
        super().__init__(f"{source}: {field}: {problem}. {fix}")


@dataclasses.dataclass(frozen=True)
class SpecFile:
    """A parsed spec file: the job and how to schedule it."""

    path: Path
    job: JobSpec
    schedule: str
    start_date: dt.datetime
    tags: tuple[str, ...]
    description: str | None


def spec_path_for(path: str | Path) -> Path:
    """The YAML spec a loader file stands for: same folder, same stem."""
    path = Path(path)
    if path.suffix in SPEC_SUFFIXES:
        return path
    for suffix in SPEC_SUFFIXES:
        candidate = path.with_suffix(suffix)
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{path}: no job spec next to this loader; expected {path.with_suffix('.yaml').name}"
    )


def load_spec_file(path: str | Path) -> SpecFile:
    """Read and validate one spec file; every error names the file and the field."""
    path = Path(path)
    source = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise SpecFileError(
            source, "(yaml)", f"not valid YAML at {where}: {e.problem}", "Fix the YAML syntax"
        ) from None
    if not isinstance(data, Mapping):
        raise SpecFileError(
            source, "(top level)", "must be a mapping of fields", "Write 'field: value' lines, e.g. 'image: python:3.11'"
        )
    data = dict(data)
    check_known_fields(data, source, also=DAG_KEYS)
    options = {key: data.pop(key) for key in list(data) if key in DAG_KEYS}
    data.setdefault("name", path.stem.replace("_", "-"))
    job = JobSpec.from_dict(data, source=source)
    return SpecFile(
        path=path,
        job=job,
        schedule=_schedule(source, options.get("schedule")),
        start_date=_start_date(source, options.get("start_date", DEFAULT_START_DATE)),
        tags=_tags(source, options.get("tags", ())),
        description=_description(source, options.get("description")),
    )


def dag_from_spec_file(path: str | Path):
    """Build the scheduled DAG for a spec; ``path`` is the spec or its loader ``.py``."""
    from airflow.sdk import DAG

    from gpuboot.task_groups.gpu_job import gpu_job_group

    spec = load_spec_file(spec_path_for(path))
    source = str(spec.path)
    try:
        dag = DAG(
            dag_id=spec.job.name,
            schedule=spec.schedule,
            start_date=spec.start_date,
            catchup=False,
            max_active_runs=1,  # a recurring training run never overlaps its previous one
            tags=["gpuboot", *spec.tags],
            description=spec.description or f"GPU job from {spec.path.name}",
            doc_md=_doc_md(spec),
        )
        dag.timetable.validate()
    except Exception as e:  # every other argument is validated above; Airflow raises several types here
        raise SpecFileError(
            source, "schedule", f"{spec.schedule!r} is not a valid schedule ({e})", f"Use {DAG_KEYS['schedule']}"
        ) from None
    with dag:
        gpu_job_group(spec.job.to_dict())
    return dag


def _schedule(source: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        problem = "missing" if value is None else f"must be a string, got {value!r}"
        raise SpecFileError(source, "schedule", problem, f"Add 'schedule:' with a {DAG_KEYS['schedule']}")
    return value.strip()


def _start_date(source: str, value: Any) -> dt.datetime:
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            value = None
    elif isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime(value.year, value.month, value.day)
    if not isinstance(value, dt.datetime):
        raise SpecFileError(source, "start_date", "not a date", "Write an ISO date, e.g. 2025-01-01")
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def _tags(source: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) and 0 < len(t) <= 100 for t in value):
        raise SpecFileError(
            source, "tags", f"must be a list of strings (1-100 characters), got {value!r}", "Write e.g. tags: [nightly, llm]"
        )
    return tuple(value)


def _description(source: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise SpecFileError(source, "description", f"must be a string, got {value!r}", "Quote it")
    return value


def _doc_md(spec: SpecFile) -> str:
    fields = spec.job.to_dict(env_values=False)    # names only: values may be tokens
    job = yaml.safe_dump(fields, sort_keys=False)
    return (
        f"### Recurring GPU job `{spec.job.name}`\n\n"
        f"Generated from `{spec.path.name}` (schedule `{spec.schedule}`). Each run places the job "
        "on a node that can hold it alone, powers on a stopped ECS instance only when needed, waits "
        "until its GPUs are registered, then runs the pod there.\n\n"
        f"```yaml\n{job}```\n"
    )
