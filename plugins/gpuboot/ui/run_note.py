"""The DAG run's note: every gpuboot step's summary line, so a run's details say what happened (the
plan, the boot and where its time went, the pods' fate, which step failed) without opening a log.

A running task cannot set a note in Airflow 3.3 (gpuboot.operators.base.summarize says why), so this
listener writes it where the metadata database is at hand: Airflow calls dag-run listeners in the
process that moves a run to success or failed (the scheduler; `dag.test()` in tests), inside that
process's session, so the note lands in the same commit as the run's final state (a second session
would wait on the first's lock with SQLite). A run with no
gpuboot step (no XCom "summary") is left alone, and so is a note a person already wrote.
"""
from __future__ import annotations

from collections.abc import Iterable

from airflow.listeners import hookimpl

SUMMARY_KEY = "summary"
NOTE_LIMIT = 1000          # characters: the dag_run_note.content column's size


def run_note(summaries: Iterable[tuple[str, str]], failed: Iterable[str]) -> str | None:
    """The note from (task id, summary line) in the order the steps ran and the failed tasks' ids;
    None when there is nothing to say. Markdown, as the UI renders notes."""
    lines = [f"- **{task.rsplit('.', 1)[-1]}**: {line}" for task, line in summaries]
    failed = [task.rsplit(".", 1)[-1] for task in failed]
    if failed:
        lines.append(f"- **failed**: {', '.join(failed)} (its log says why)")
    if not lines:
        return None
    note = "\n".join(lines)
    return note if len(note) <= NOTE_LIMIT else note[:NOTE_LIMIT - 1] + "…"


def _annotate(dag_run) -> None:
    from airflow import settings
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from sqlalchemy import select
    from sqlalchemy.orm import object_session

    # the caller's session: the run's own, or the thread's scoped session, which the scheduler's and
    # dag.test()'s loops use (dag.test() hands listeners a run detached from it); the caller commits
    session = object_session(dag_run) or settings.Session()
    run = session.get(DagRun, dag_run.id)
    if run is None or run.note:
        return
    rows = session.scalars(select(XComModel).where(
        XComModel.dag_id == run.dag_id, XComModel.run_id == run.run_id,
        XComModel.key == SUMMARY_KEY, XComModel.map_index == -1)).all()
    if not rows:
        return
    tis = {ti.task_id: ti for ti in run.get_task_instances(session=session) if ti.map_index in (-1, 0)}
    began = {task: (ti.start_date.timestamp() if ti.start_date else float("inf")) for task, ti in tis.items()}
    summaries = sorted(((row.task_id, str(XComModel.deserialize_value(row))) for row in rows),
                       key=lambda item: began.get(item[0], float("inf")))
    failed = [task for task, ti in tis.items() if ti.state == "failed"]
    note = run_note(summaries, failed)
    if note:
        run.note = note


@hookimpl
def on_dag_run_success(dag_run, msg: str) -> None:
    _annotate(dag_run)


@hookimpl
def on_dag_run_failed(dag_run, msg: str) -> None:
    _annotate(dag_run)
