"""The `gpu_job` DAG end to end with dag.test() against the local cloud (fast emulated timings)."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import REPO, task_log
from tests.shared import live_reservations, two_gpu_training_job

JOB = two_gpu_training_job("e2e")
TWO_GPU_NODE = "t4x2-stopped"


@pytest.fixture(scope="module")
def gpu_job_dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "gpu_job.py"), safe_mode=False)
    assert bag.import_errors == {}
    return bag.dags["gpu_job"]


def states(dag_run) -> dict[str, str]:
    """Task states by short task id (the part after the task group prefix)."""
    return {ti.task_id.rsplit(".", 1)[-1]: ti.state for ti in dag_run.get_task_instances()}


def all_pods(cloud) -> list:
    return cloud.core_v1().list_pod_for_all_namespaces().items


def admission_failures(cloud) -> list[str]:
    """Every sign, in pods and events, that a pod was refused by a kubelet."""
    core = cloud.core_v1()
    bad = [
        f"pod {p.metadata.namespace}/{p.metadata.name}: {p.status.reason}: {p.status.message}"
        for p in core.list_pod_for_all_namespaces().items
        if p.status.phase == "Failed" or (p.status.reason or "").endswith("AdmissionError")
    ]
    bad += [
        f"event {e.involved_object.name}: {e.reason}: {e.message}"
        for e in core.list_event_for_all_namespaces().items
        if "AdmissionError" in (e.reason or "") or "devices unavailable" in (e.message or "")
    ]
    return bad


def node_boot_id(cloud, name: str) -> str:
    return cloud.core_v1().read_node(name).status.node_info.boot_id


def test_job_needing_a_stopped_node_boots_it_waits_for_gpus_and_succeeds_there(cloud, connections, gpu_job_dag, capfd):
    boot_id_before = node_boot_id(cloud, TWO_GPU_NODE)
    small_boot_id_before = node_boot_id(cloud, "t4-stopped")

    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=JOB)
    output = capfd.readouterr().out

    assert dag_run.state == "success", output[-5000:]
    assert {k: v for k, v in states(dag_run).items() if k in {"place", "start", "wait_gpu_ready", "launch"}} == {
        "place": "success", "start": "success", "wait_gpu_ready": "success", "launch": "success"
    }
    # The stopped 2-GPU node was powered on (a new boot) and the pod ran there and nowhere else.
    assert node_boot_id(cloud, TWO_GPU_NODE) != boot_id_before
    job_pods = [p for p in all_pods(cloud) if (p.metadata.labels or {}).get("gpuboot.io/job")]
    assert len(job_pods) == 1, [p.metadata.name for p in job_pods]
    (pod,) = job_pods
    assert (pod.spec.node_name, pod.status.phase) == (TWO_GPU_NODE, "Succeeded")
    assert pod.spec.containers[0].resources.requests["nvidia.com/gpu"] == "2"
    # The stopped 1-GPU node was never started (per-node fit: it cannot hold 2 GPUs alone).
    assert node_boot_id(cloud, "t4-stopped") == small_boot_id_before
    assert admission_failures(cloud) == []
    # The pod's output is in the launch task's log.
    launch_log = task_log(output, dag_run, "launch")
    assert "e2e-epoch 1/3" in launch_log and "e2e-training-done" in launch_log
    # The sensor deferred to its trigger, which watched that node through the zeroed GPU count.
    wait_log = task_log(output, dag_run, "wait_gpu_ready")
    assert "DEFERRED" in wait_log and TWO_GPU_NODE in wait_log
    assert live_reservations(cloud) == []
    # Each step ends with its summary line; the boot's says where the time went.
    assert re.search(rf"summary: booted {TWO_GPU_NODE} in [\d.]+ s \(instance up [\d.]+ s, kubelet Ready",
                     wait_log), wait_log[-3000:]
    assert "summary: placed e2e-train in " in task_log(output, dag_run, "place")
    assert "summary: start requested for t4x2-stopped at 20" in task_log(output, dag_run, "start")
    assert re.search(rf"summary: ran e2e-train on {TWO_GPU_NODE}: pod e2e-train-[\w-]+ Succeeded", launch_log)
    assert "Skipping masking for a secret" not in output
    # "Rendered Templates" of launch: what the pod ran with, env names only.
    rendered = rendered_fields(dag_run, "launch")
    assert rendered["launched"]["image"] == JOB["image"] and rendered["launched"]["command"] == JOB["command"]
    assert rendered["launched"]["pods"] == [pod.metadata.name] and rendered["launched"]["nodes"] == [TWO_GPU_NODE]
    assert rendered["launched"]["resources"]["nvidia.com/gpu"] == "2"


def rendered_fields(dag_run, task: str) -> dict:
    """What Airflow stored for the task's "Rendered Templates" tab (RenderedTaskInstanceFields)."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields

    (ti,) = [t for t in dag_run.get_task_instances() if t.task_id.rsplit(".", 1)[-1] == task]
    return RenderedTaskInstanceFields.get_templated_fields(ti) or {}


def test_job_bigger_than_any_node_fails_at_place_with_the_reason(cloud, connections, gpu_job_dag, capfd):
    job = dict(JOB, gpus=8)
    boot_id_before = node_boot_id(cloud, TWO_GPU_NODE)

    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=job)
    output = capfd.readouterr().out

    assert states(dag_run)["place"] == "failed"
    assert states(dag_run)["start"] in {"upstream_failed", "skipped"}
    place_log = task_log(output, dag_run, "place")
    assert "8 nvidia.com/gpu" in place_log, place_log[-3000:]
    assert "ecs.gn6i-c24g1.12xlarge" in place_log  # the largest node type there is, named
    assert [p for p in all_pods(cloud) if (p.metadata.labels or {}).get("gpuboot.io/job")] == []
    assert live_reservations(cloud) == []
    assert node_boot_id(cloud, TWO_GPU_NODE) == boot_id_before  # nothing was powered on
    assert dag_run.state == "failed", states(dag_run)  # the run is red, not green
    note = run_note_of(dag_run)          # and its note says why, without opening the log
    assert "**place**: failed: job e2e-train can never run in this fleet" in note and "**failed**: place" in note


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"gpus": -1}, "gpus"),
        ({"gpus": "two"}, "gpus"),
        ({"namespace": "Not_A_Label"}, "namespace"),
        ({"gpu_model": "Z80"}, "gpu_model"),
        ({"boot_timeout_seconds": 0}, "boot_timeout_seconds"),
        ({"image": ""}, "image"),
    ],
)
def test_bad_trigger_params_are_rejected_before_any_task_runs(gpu_job_dag, change, param):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=param):
        gpu_job_dag.test(run_conf=dict(JOB, **change))


def test_the_runs_note_gathers_every_steps_summary_line(cloud, connections, gpu_job_dag):
    """gpuboot.ui.run_note: when the run ends, its note lists each step's summary in the order they ran."""
    dag_run = gpu_job_dag.test(conn_file_path=str(connections), run_conf=dict(JOB, name="e2e-note"))
    assert dag_run.state == "success"
    note = run_note_of(dag_run)
    lines = note.splitlines()
    assert [line.split("**")[1] for line in lines] == ["place", "start", "wait_gpu_ready", "launch", "release"], note
    assert "placed e2e-note in " in lines[0] and re.search(r"booted \S+ in [\d.]+ s \(instance up", lines[2])
    assert "failed" not in note


def run_note_of(dag_run) -> str:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        return session.get(DagRun, dag_run.id).note or ""
