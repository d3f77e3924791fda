"""Pods on emulated kubelets through the `kubernetes` client and kubectl: real processes, logs, exit codes,
GPU admission, restarts and deletion."""
from __future__ import annotations

import subprocess

import pytest
from alibabacloud_ecs20140526 import models as ecs_models

from simcloud.harness import SimCloud, pod_log, process_alive, small_fleet, wait_until
from simcloud.machines.kubelet import admission_message
from tests.conftest import kubectl_binaries

FLEET = small_fleet([
    {"name": "cpu-1", "instance_type": "ecs.g7.xlarge", "status": "Running"},
    {"name": "gpu-run", "instance_type": "ecs.gn6i-c24g1.12xlarge", "status": "Running"},
    {"name": "gpu-off", "instance_type": "ecs.gn6i-c24g1.12xlarge", "status": "Stopped"},
    {"name": "gpu-off-2", "instance_type": "ecs.gn6i-c4g1.xlarge", "status": "Stopped"},
], timings={"device_plugin_seconds": 1.5})   # a wide window for binding "too early" even on a slow CI box


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    """One cloud for the module: every test uses its own pod names (and its own stopped node)."""
    with SimCloud.start(FLEET, tmp_path_factory.mktemp("simcloud")) as running:
        yield running



def make_pod(name: str, command: list[str] | None, *, node: str | None = None, gpus: int = 0,
             restart: str = "Never", env: dict | None = None, **spec) -> dict:
    container = {"name": "main", "image": "python:3.11-slim"}
    if command is not None:
        container["command"] = command
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    body = {"metadata": {"name": name}, "spec": {"restartPolicy": restart, "containers": [container], **spec}}
    if node:
        body["spec"]["nodeName"] = node
    return body


def phase_of(v1, name: str, *phases: str):
    pod = v1.read_namespaced_pod(name, "default")
    return pod if pod.status.phase in phases else None


def test_python_pod_succeeds_and_its_lines_show_in_the_log_and_kubectl_logs(cloud):
    v1 = cloud.core_v1()
    v1.create_namespaced_pod("default", make_pod(
        "hello", ["python", "-c", "for i in range(3): print(f'epoch {i} loss {1/(i+1):.2f}')"]))
    pod = wait_until(lambda: phase_of(v1, "hello", "Succeeded", "Failed"), timeout=15)
    assert pod.status.phase == "Succeeded"
    assert pod.spec.node_name in ("cpu-1", "gpu-run")          # placed by the scheduler
    status = pod.status.container_statuses[0]
    assert status.state.terminated.exit_code == 0 and status.state.terminated.reason == "Completed"
    assert status.container_id.startswith("containerd://") and status.image_id
    assert pod.status.pod_ip and pod.status.host_ip and pod.status.start_time
    expected = "epoch 0 loss 1.00\nepoch 1 loss 0.50\nepoch 2 loss 0.33\n"
    assert pod_log(v1, "hello") == expected
    stamped = pod_log(v1, "hello", timestamps=True, tail_lines=1)
    assert stamped.endswith("Z epoch 2 loss 0.33\n")
    for kubectl in kubectl_binaries():
        out = subprocess.run([str(kubectl), "--kubeconfig", str(cloud.kubeconfig), "logs", "hello"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected, kubectl
    reasons = {e.reason for e in v1.list_namespaced_event("default",
                                                          field_selector="involvedObject.name=hello").items}
    assert {"Scheduled", "Pulled", "Created", "Started"} <= reasons


def test_failing_and_missing_commands_fail_the_pod_with_real_exit_codes(cloud):
    v1 = cloud.core_v1()
    v1.create_namespaced_pod("default", make_pod("crash", ["sh", "-c", "echo bye; exit 3"], node="cpu-1"))
    v1.create_namespaced_pod("default", make_pod("missing", ["train-model-not-installed"], node="cpu-1"))
    crash = wait_until(lambda: phase_of(v1, "crash", "Succeeded", "Failed"), timeout=15)
    assert crash.status.phase == "Failed"
    assert crash.status.container_statuses[0].state.terminated.exit_code == 3
    assert crash.status.container_statuses[0].state.terminated.reason == "Error"
    missing = wait_until(lambda: phase_of(v1, "missing", "Succeeded", "Failed"), timeout=15)
    term = missing.status.container_statuses[0].state.terminated
    assert (missing.status.phase, term.exit_code, term.reason) == ("Failed", 128, "StartError")   # as containerd
    assert "executable file not found in $PATH" in term.message


@pytest.mark.parametrize(("name", "command", "env", "why"), [
    ("huge-arg", ["python", "-c", "pass", "x" * 200_000], None, "argument list too long"),   # > MAX_ARG_STRLEN
    ("huge-env", ["python", "-c", "pass"], {"BLOB": "x" * 200_000}, "argument list too long"),
    ("not-executable", ["{data_file}"], None, "permission denied"),          # found, but no exec bit
])
def test_a_container_the_runtime_cannot_exec_fails_the_pod_as_a_real_kubelet_reports_it(cloud, tmp_path, name,
                                                                                         command, env, why):
    """Issue 9: a 200 KB argument left the pod in ContainerCreating forever, holding its CPU."""
    data_file = tmp_path / "weights.bin"
    data_file.write_text("not a program")
    data_file.chmod(0o644)
    command = [part.format(data_file=data_file) if part == "{data_file}" else part for part in command]
    v1 = cloud.core_v1()
    v1.create_namespaced_pod("default", make_pod(name, command, node="cpu-1", env=env))
    pod = wait_until(lambda: phase_of(v1, name, "Succeeded", "Failed"), timeout=15)
    term = pod.status.container_statuses[0].state.terminated
    assert (pod.status.phase, term.exit_code, term.reason) == ("Failed", 128, "StartError")
    assert term.message.startswith("failed to create containerd task: ") and f": {why}: unknown" in term.message
    events = v1.list_namespaced_event("default", field_selector=f"involvedObject.name={name}").items
    assert any(e.reason == "Failed" and e.type == "Warning" and why in e.message for e in events)
    assert all(e.reason != "Started" for e in events)


def test_a_container_that_cannot_exec_is_restarted_under_restart_policy_always(cloud):
    v1 = cloud.core_v1()
    v1.create_namespaced_pod("default", make_pod("huge-always", ["python", "-c", "pass", "x" * 200_000],
                                                 node="cpu-1", restart="Always"))

    def backing_off():
        status = (v1.read_namespaced_pod("huge-always", "default").status.container_statuses or [None])[0]
        return status if status and status.restart_count >= 1 and status.last_state.terminated else None
    status = wait_until(backing_off, timeout=15)
    assert status.last_state.terminated.reason == "StartError"
    assert status.state.waiting and status.state.waiting.reason == "CrashLoopBackOff"
    v1.delete_namespaced_pod("huge-always", "default", grace_period_seconds=0)


def test_on_failure_restarts_until_the_container_succeeds(cloud, tmp_path):
    v1 = cloud.core_v1()
    marker = tmp_path / "attempts"
    script = ("import os, sys; p = os.environ['MARKER']; n = len(open(p).read()) if os.path.exists(p) else 0; "
              "open(p, 'a').write('x'); print('attempt', n); sys.exit(0 if n >= 1 else 1)")
    v1.create_namespaced_pod("default", make_pod("flaky", ["python", "-c", script], node="cpu-1",
                                                 restart="OnFailure", env={"MARKER": str(marker)}))
    pod = wait_until(lambda: phase_of(v1, "flaky", "Succeeded", "Failed"), timeout=20)
    assert pod.status.phase == "Succeeded"
    assert pod.status.container_statuses[0].restart_count == 1
    assert pod.status.container_statuses[0].last_state.terminated.exit_code == 1
    assert pod_log(v1, "flaky") == "attempt 1\n"   # the current container's log
    assert marker.read_text() == "xx"


def test_gpu_pod_on_a_registered_node_gets_its_devices(cloud):
    v1 = cloud.core_v1()
    v1.create_namespaced_pod("default", make_pod(
        "gpu", ["python", "-c", "import os; print(os.environ['NVIDIA_VISIBLE_DEVICES'])"], gpus=2,
        nodeSelector={"kubernetes.io/hostname": "gpu-run"}))
    pod = wait_until(lambda: phase_of(v1, "gpu", "Succeeded", "Failed"), timeout=15)
    assert (pod.status.phase, pod.spec.node_name) == ("Succeeded", "gpu-run")
    assert pod_log(v1, "gpu") == "0,1\n"


def test_gpu_pod_bound_while_gpus_are_stale_fails_admission_like_the_kubelet(cloud):
    """The field bug: a pod bound right after the start, while the Node still shows its old GPU count."""
    v1 = cloud.core_v1()
    assert v1.read_node("gpu-off").status.allocatable["nvidia.com/gpu"] == "2"    # stale but tempting
    cloud.ecs_client().start_instances(ecs_models.StartInstancesRequest(
        region_id=cloud.region, instance_id=[cloud.instance_id("gpu-off")]))
    v1.create_namespaced_pod("default", make_pod("too-early", ["python", "-c", "print('never')"],
                                                 node="gpu-off", gpus=2))
    pod = wait_until(lambda: phase_of(v1, "too-early", "Failed", "Succeeded", "Running"), timeout=15)
    assert pod.status.phase == "Failed"
    assert pod.status.reason == "UnexpectedAdmissionError"
    assert pod.status.message == admission_message(2, 0) == (
        "Pod Update plugin resources failed due to requested number of devices unavailable for "
        "nvidia.com/gpu. Requested: 2, Available: 0, which is unexpected.")
    events = v1.list_namespaced_event("default", field_selector="involvedObject.name=too-early").items
    assert any(e.reason == "UnexpectedAdmissionError" and e.type == "Warning" for e in events)

    # bound while the count reads 0: same failure; once registered, the same pod runs
    wait_until(lambda: v1.read_node("gpu-off").status.allocatable["nvidia.com/gpu"] == "0", timeout=10)
    v1.create_namespaced_pod("default", make_pod("at-zero", ["python", "-c", "print('never')"],
                                                 node="gpu-off", gpus=1))
    pod = wait_until(lambda: phase_of(v1, "at-zero", "Failed", "Succeeded"), timeout=10)
    assert (pod.status.reason, pod.status.message) == ("UnexpectedAdmissionError", admission_message(1, 0))
    wait_until(lambda: v1.read_node("gpu-off").status.allocatable["nvidia.com/gpu"] == "2", timeout=10)
    v1.create_namespaced_pod("default", make_pod("in-time", ["python", "-c", "print('trained')"],
                                                 node="gpu-off", gpus=2))
    pod = wait_until(lambda: phase_of(v1, "in-time", "Failed", "Succeeded"), timeout=10)
    assert pod.status.phase == "Succeeded"


def test_pod_bound_to_a_stopped_node_waits_pending(cloud):
    v1 = cloud.core_v1()
    v1.create_namespaced_pod("default", make_pod("waiting", ["python", "-c", "print(1)"], node="gpu-off-2"))
    # its kubelet is down: the pod stays untouched (observed for a second)
    with pytest.raises(TimeoutError):
        wait_until(lambda: v1.read_namespaced_pod("waiting", "default").status.phase != "Pending", timeout=1.0)
    assert v1.read_namespaced_pod("waiting", "default").status.container_statuses is None
    v1.delete_namespaced_pod("waiting", "default")          # no kubelet to confirm it: Terminating
    assert v1.read_namespaced_pod("waiting", "default").metadata.deletion_timestamp is not None
    v1.delete_namespaced_pod("waiting", "default", grace_period_seconds=0)    # forced: gone at once
    assert not v1.list_namespaced_pod("default", field_selector="metadata.name=waiting").items


@pytest.mark.parametrize("grace", [5, 0], ids=["graceful", "forced"])
def test_deleting_a_running_pod_kills_its_process_then_removes_it(cloud, grace):
    v1 = cloud.core_v1()
    name = f"sleeper-{grace}"
    v1.create_namespaced_pod("default", make_pod(
        name, ["python", "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],  # sleep-ok: the pod's own workload, not a wait
        node="cpu-1", restart="Always"))
    wait_until(lambda: phase_of(v1, name, "Running"), timeout=10)
    pid = int(wait_until(lambda: pod_log(v1, name).strip(), timeout=10))
    v1.delete_namespaced_pod(name, "default", grace_period_seconds=grace)
    wait_until(lambda: not v1.list_namespaced_pod("default", field_selector=f"metadata.name={name}").items,
               timeout=10)
    wait_until(lambda: not process_alive(pid), timeout=5, message=f"process {pid} outlived its pod")
    node = next(n for n in cloud.state()["nodes"] if n["name"] == "cpu-1")
    assert node["pods"] == 0, "restartPolicy Always must not bring a deleted pod's container back"
