"""The gang's pods and verdicts (gpuboot.core.gang): rank environment, pinning, one fate, adoption."""
from __future__ import annotations

from gpuboot.core.gang import LABEL_ATTEMPT, LABEL_RANK, MASTER_PORT, adoptable, gang_pods, judge, pod_name, pod_times
from gpuboot.core.jobspec import JobSpec
from gpuboot.core.model import NodeState
from gpuboot.core.placement import Assignment, Outcome, Plan
from gpuboot.core.resources import Resources

SPEC = JobSpec.from_dict({"name": "train", "image": "python:3.11", "command": ["python", "-c", "pass"],
                          "replicas": 3, "gpus": 1, "env": {"RANK": "user's", "EPOCHS": "3"},
                          "node_selector": {"pool": "gpu"}})


def plan(*tasks_nodes: tuple[str, str]) -> Plan:
    return Plan(job_id="gb-1", outcome=Outcome.FITS, message="", assignments=tuple(
        Assignment(task=t, node=n, hostname=f"host-{n}", instance_id=None, state=NodeState.STOPPED,
                   requests=Resources.parse({"nvidia.com/gpu": 1, "cpu": "1", "memory": "1Gi"}))
        for t, n in tasks_nodes))


def env_of(pod: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_each_rank_gets_the_launcher_environment_pinned_to_its_node():
    pods = gang_pods(SPEC, plan(("train-0", "a"), ("train-1", "b"), ("train-2", "c")), attempt=2,
                     master_addr="127.16.0.2")
    assert [p["spec"]["nodeSelector"] for p in pods] == [
        {"pool": "gpu", "kubernetes.io/hostname": f"host-{n}"} for n in "abc"]
    envs = [env_of(p) for p in pods]
    # rank 0 is the master: its own pod IP through the downward API; the others get the address
    assert envs[0]["MASTER_ADDR"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert [e["MASTER_ADDR"] for e in envs[1:]] == ["127.16.0.2", "127.16.0.2"]
    for rank, env in enumerate(envs):
        assert {k: env[k] for k in ("WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_PORT", "GPUBOOT_TASK_INDEX")} == {
            "WORLD_SIZE": "3", "RANK": str(rank), "NODE_RANK": str(rank), "MASTER_PORT": str(MASTER_PORT),
            "GPUBOOT_TASK_INDEX": str(rank)}
        assert env["EPOCHS"] == "3"                   # the job's own env stays; its RANK loses to gpuboot's
    assert [p["metadata"]["labels"][LABEL_RANK] for p in pods] == ["0", "1", "2"]
    assert {p["metadata"]["labels"][LABEL_ATTEMPT] for p in pods} == {"2"}
    assert len({p["metadata"]["name"] for p in pods}) == 3
    assert pod_name("train-0", "gb-1", 2) != pod_name("train-0", "gb-1", 3) != pod_name("train-0", "gb-2", 3)
    assert all(p["spec"]["restartPolicy"] == "Never" for p in pods)


def test_a_partly_placed_gang_is_the_tasks_that_got_a_place():
    """min_available < replicas: the world is the placed tasks; the task index stays the replica's."""
    pods = gang_pods(SPEC, plan(("train-0", "a"), ("train-2", "c")), attempt=1, master_addr="127.16.0.2")
    assert [(env_of(p)["WORLD_SIZE"], env_of(p)["RANK"], env_of(p)["GPUBOOT_TASK_INDEX"]) for p in pods] == [
        ("2", "0", "0"), ("2", "1", "2")]


def pod(rank: int, phase: str, attempt: int = 1, code: int | None = None, finished: str | None = None,
        node: str = "n", **status) -> dict:
    statuses = []
    if code is not None:
        statuses = [{"name": "base", "state": {"terminated": {"exitCode": code, "finishedAt": finished}}}]
    return {"metadata": {"name": f"p{rank}", "labels": {LABEL_RANK: str(rank), LABEL_ATTEMPT: str(attempt)}},
            "spec": {"nodeName": node}, "status": {"phase": phase, "containerStatuses": statuses, **status}}


def test_one_verdict_over_the_gang():
    assert judge({0: pod(0, "Running"), 1: pod(1, "Succeeded", code=0)}, 2).status == "running"
    assert judge({0: pod(0, "Succeeded", code=0), 1: pod(1, "Succeeded", code=0)}, 2).status == "succeeded"
    failed = judge({0: pod(0, "Running"), 1: pod(1, "Failed", code=3)}, 2)
    assert (failed.status, failed.failure.rank, failed.failure.exit_code) == ("failed", 1, 3)
    assert "rank 1 (pod p1) failed with exit code 3" in failed.failure.describe()
    # several failed: the one that ended first is named (the others most likely followed it)
    both = judge({0: pod(0, "Failed", code=1, finished="2026-01-01T00:00:09Z"),
                  1: pod(1, "Failed", code=2, finished="2026-01-01T00:00:05Z")}, 2)
    assert both.failure.rank == 1
    refused = judge({0: pod(0, "Failed", reason="UnexpectedAdmissionError", message="no devices")}, 1)
    assert refused.failure.reason == "UnexpectedAdmissionError: no devices"
    assert judge({0: pod(0, "Running")}, 2).failure.reason == "its pod is gone (deleted)"
    lost = judge({0: pod(0, "Running", node="gone")}, 1,
                 {"gone": {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}})
    assert "node gone is not Ready" in lost.failure.reason
    up = {"n": {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}}
    assert judge({0: pod(0, "Running")}, 1, up).status == "running"


def test_a_retry_adopts_only_a_whole_live_attempt():
    assert adoptable([pod(0, "Running", 1), pod(1, "Pending", 1)], 2) == (1, ["p0", "p1"])
    assert adoptable([pod(0, "Succeeded", 1, code=0), pod(1, "Running", 1)], 2) == (1, ["p0", "p1"])
    assert adoptable([], 2) is None
    assert adoptable([pod(0, "Running", 1)], 2) is None                                # rank 1 never created
    assert adoptable([pod(0, "Running", 1), pod(1, "Failed", 1, code=1)], 2) is None   # one fate: relaunch
    assert adoptable([pod(0, "Running", 1), pod(1, "Running", 2)], 2) is None          # mixed attempts
    done = [pod(0, "Succeeded", 1, code=0), pod(1, "Succeeded", 1, code=0)]
    assert adoptable(done, 2, try_number=2) is None            # a finished gang of an earlier try: launch again
    assert adoptable(done, 2, try_number=1) == (1, ["p0", "p1"])   # this try's own gang: its verdict stands


def test_a_draft_gang_is_the_launch_pods_pinned_to_a_placeholder_node():
    from gpuboot.core.gang import DRAFT_HOST, draft_gang

    spec = JobSpec.from_dict({"name": "pair", "image": "python:3.11", "command": ["python"], "gpus": 1, "replicas": 2,
                              "tolerations": [{"key": "team", "operator": "Exists"}]})
    pods = draft_gang(spec, "job-1")
    assert [p["metadata"]["name"] for p in pods] == [pod_name(t, "job-1", 1) for t in spec.task_names()]
    assert {p["spec"]["nodeSelector"]["kubernetes.io/hostname"] for p in pods} == {DRAFT_HOST}
    assert pods[0]["spec"]["tolerations"] == [{"key": "team", "operator": "Exists"}]
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_a_refused_pod_field_names_the_job_field_it_comes_from():
    from gpuboot.core.gang import spec_field

    assert spec_field("spec.tolerations[0].operator") == "tolerations"
    assert spec_field("spec.containers[0].env[2].name") == "env"
    assert spec_field("metadata.name") == "name" and spec_field("spec.nodeSelector") == "node_selector"
    assert spec_field("spec.containers[0].resources.limits[nvidia.com/gpu]") == "gpus, cpu, memory or extra_resources"
    assert spec_field("spec.somethingElse") is None and spec_field(None) is None


def test_a_job_ran_to_completion_only_when_every_pod_of_its_last_attempt_succeeded():
    from gpuboot.core.gang import completion

    def p(name, attempt, phase):
        return {"metadata": {"name": name, "labels": {LABEL_ATTEMPT: str(attempt)}}, "status": {"phase": phase}}

    assert completion([]) == "no pod of it ran"
    assert completion([p("a-1", 1, "Succeeded"), p("b-1", 1, "Succeeded")]) is None
    assert completion([p("a-1", 1, "Failed"), p("a-2", 2, "Succeeded")]) is None        # the retry's gang counts
    assert completion([p("a-2", 2, "Succeeded"), p("b-2", 2, "Running")]) == \
        "its pod(s) did not all succeed: b-2 Running"


def test_a_pods_bound_running_and_finished_times_come_from_its_status():
    pod = {"metadata": {"name": "train-0"}, "spec": {"nodeName": "gpu-1"},
           "status": {"phase": "Succeeded",
                      "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2027-01-15T08:00:01Z"}],
                      "containerStatuses": [{"state": {"terminated": {"startedAt": "2027-01-15T08:00:04Z",
                                                                      "finishedAt": "2027-01-15T08:01:04Z"}}}]}}
    times = pod_times(pod)
    assert (times["pod"], times["node"], times["phase"]) == ("train-0", "gpu-1", "Succeeded")
    assert (times["running_at"] - times["bound_at"], times["finished_at"] - times["running_at"]) == (3, 60)
    pending = pod_times({"metadata": {"name": "train-0"}, "status": {"phase": "Pending"}})
    assert (pending["bound_at"], pending["running_at"], pending["finished_at"]) == (None, None, None)
    assert pod_times(None)["pod"] is None             # a rank whose pod is gone


def test_secret_env_and_env_from_secrets_become_references_the_kubelet_resolves():
    spec = JobSpec.from_dict({"name": "train", "image": "i", "command": ["true"], "env": {"EPOCHS": "3"},
                              "secret_env": {"HF_TOKEN": "hf-token/token"}, "env_from_secrets": ["wandb"]})
    (pod,) = gang_pods(spec, plan(("train", "a")), attempt=1, master_addr=None)
    container = pod["spec"]["containers"][0]
    assert env_of(pod)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env_of(pod)["EPOCHS"] == "3"
    assert container["envFrom"] == [{"secretRef": {"name": "wandb"}}]


def test_a_missing_secret_fails_the_rank_naming_it_and_the_fix():
    from gpuboot.core.gang import rank_failure

    pod = {"metadata": {"name": "train-x-1"}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "base", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                               "message": 'secret "hf-token" not found'}}}]}}
    failure = rank_failure(0, pod)
    assert failure is not None and 'secret "hf-token" not found' in failure.reason
    assert "Create the Secret" in failure.reason and "secret_env" in failure.reason
