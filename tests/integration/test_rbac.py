"""The shipped RBAC (deploy/kubernetes/rbac.yaml) against the local cloud's real authorizer, in
process (cheap: no kubelets, no Airflow): every right it grants is one the product's calls use,
removing any one of them makes that call 403 for the ServiceAccount that needs it (gpuboot, the steps';
gpuboot-placer, the placer's), and the steps' ServiceAccount can create pods only in the job namespaces. The e2e, stress, chaos and distributed tests run the
whole product with the same ServiceAccount's token (SimCloud.gpuboot_connections).
"""
from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jsonschema
import pytest

if TYPE_CHECKING:
    from gpuboot.hooks.kube import KubeClient
import yaml
from kubernetes import utils
from kubernetes.client.rest import ApiException

from gpuboot.core.jobspec import DEFAULT_JOB_NAMESPACES, JobSpec, JobSpecError, params_schema
from gpuboot.lifecycle.ledger import CONFIGMAP
from simcloud.harness import wait_until
from tests.conformance.k8s_harness import K8sServer, k8s, pod_body  # noqa: F401  (k8s: the fixture)

REPO = Path(__file__).resolve().parents[2]
NAMESPACES = REPO / "deploy/kubernetes/namespace.yaml"
RBAC = REPO / "deploy/kubernetes/rbac.yaml"
SA = "system:serviceaccount:gpuboot:gpuboot"
PLACER = "gpuboot-placer"        # the placer's ServiceAccount, and its ClusterRole
JOBS = DEFAULT_JOB_NAMESPACES[0]
LEDGER = "default"
NODE = "gpu-a"


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    """The real plane the harness's `k8s` fixture uses under --kube=real, with the shipped manifests'
    namespaces (this module's name overrides the conformance suite's)."""
    from tests.real_k8s.cluster import real_k8s
    with real_k8s(tmp_path_factory.mktemp("rbac-k8s"), (NAMESPACES, RBAC)) as cluster:
        yield cluster


def create_all(api_client, docs: list[dict]) -> None:
    """Create each object as the admin; one that exists already is left as it is."""
    for doc in docs:
        try:
            utils.create_from_dict(api_client, doc)
        except utils.FailToCreateError as exc:
            if not all(e.status == 409 for e in exc.api_exceptions):
                raise


def _watch(method, *args, **kwargs):
    """Open a watch (RBAC verb watch) and drop it: authorization is decided when it opens."""
    method(*args, watch=True, timeout_seconds=1, _preload_content=False, **kwargs).close()


# (role, resource, verb) -> the call of the product (gpuboot's adapters or the pod operator it
# launches with) that needs it, made as the ServiceAccount.
PROBES: dict[tuple[str, str, str], Callable] = {
    ("gpuboot", "nodes", "get"): lambda v1: v1.read_node(NODE),                        # readiness trigger
    ("gpuboot", "nodes", "list"): lambda v1: v1.list_node(),                           # inventory
    ("gpuboot", "nodes", "watch"): lambda v1: _watch(v1.list_node, field_selector=f"metadata.name={NODE}"),
    ("gpuboot", "nodes", "patch"): lambda v1: v1.patch_node(NODE, {"spec": {"unschedulable": False}}),  # cordon
    ("gpuboot", "pods", "list"): lambda v1: (v1.list_pod_for_all_namespaces(),       # inventory
                                             v1.list_namespaced_pod(JOBS, label_selector="gpuboot.io/job=x")),
    ("gpuboot", "namespaces", "get"): lambda v1: v1.read_namespace(JOBS),              # place's check
    ("gpuboot-jobs", "pods", "create"): lambda v1: v1.create_namespaced_pod(JOBS, pod_body("job-1")),
    ("gpuboot-jobs", "pods", "get"): lambda v1: v1.read_namespaced_pod("job-0", JOBS),
    ("gpuboot-jobs", "pods", "watch"): lambda v1: _watch(v1.list_namespaced_pod, JOBS,   # launch: rank 0's IP
                                                         field_selector="metadata.name=job-0"),
    ("gpuboot-jobs", "pods", "patch"): lambda v1: v1.patch_namespaced_pod(
        "job-0", JOBS, {"metadata": {"labels": {"already_checked": "True"}}}),
    ("gpuboot-jobs", "pods", "delete"): lambda v1: v1.delete_namespaced_pod("job-0", JOBS),
    ("gpuboot-jobs", "pods/log", "get"): lambda v1: v1.read_namespaced_pod_log("job-0", JOBS),
    ("gpuboot-jobs", "events", "list"): lambda v1: v1.list_namespaced_event(JOBS),
    ("gpuboot-jobs", "events", "watch"): lambda v1: _watch(v1.list_namespaced_event, JOBS),
    ("gpuboot-ledger", "configmaps", "get"): lambda v1: v1.read_namespaced_config_map(CONFIGMAP, LEDGER),
    ("gpuboot-ledger", "configmaps", "update"): lambda v1: v1.replace_namespaced_config_map(
        CONFIGMAP, LEDGER, {"metadata": {"name": CONFIGMAP}, "data": {"reservations": "[]"}}),
    ("gpuboot-ledger", "configmaps", "patch"): lambda v1: v1.patch_namespaced_config_map(     # the batch queue
        f"{CONFIGMAP}-queue-0", LEDGER, {"data": {"q.probe": None}}, _content_type="application/merge-patch+json"),
    ("gpuboot-ledger", "configmaps", "create"): lambda v1: v1.create_namespaced_config_map(
        LEDGER, {"metadata": {"name": CONFIGMAP}}),                                    # 409: it exists
    # the placer's, as its own ServiceAccount (account_of): its view's reads and watches, its claims
    (PLACER, "nodes", "get"): lambda v1: v1.read_node(NODE),                           # a claim read again
    (PLACER, "nodes", "list"): lambda v1: v1.list_node(limit=500),                     # the view's first read
    (PLACER, "nodes", "watch"): lambda v1: _watch(v1.list_node),                       # ... and its watch
    (PLACER, "nodes", "patch"): lambda v1: v1.patch_node(                              # a batch's claim
        NODE, {"metadata": {"annotations": {"gpuboot.io/ledger": "default/probe"}}}),
    (PLACER, "pods", "list"): lambda v1: v1.list_pod_for_all_namespaces(
        limit=500, field_selector="status.phase!=Succeeded,status.phase!=Failed"),
    (PLACER, "pods", "watch"): lambda v1: _watch(v1.list_pod_for_all_namespaces,
                                                 field_selector="status.phase!=Succeeded,status.phase!=Failed"),
}


def account_of(role: str) -> str:
    """The ServiceAccount whose calls need `role`'s rights (the ledger's Role is both's: probed as the steps')."""
    return PLACER if role == PLACER else "gpuboot"


def shipped_grants() -> list[tuple[str, str, str]]:
    return sorted({(doc["metadata"]["name"], resource, verb)
                   for doc in yaml.safe_load_all(RBAC.read_text()) if doc and doc["kind"] in ("Role", "ClusterRole")
                   for rule in doc["rules"] for resource in rule["resources"] for verb in rule["verbs"]})


def rbac_without(grant: tuple[str, str, str] | None) -> list[dict]:
    """rbac.yaml's objects, minus one (role, resource, verb) (a rule left without verbs goes)."""
    docs = [copy.deepcopy(d) for d in yaml.safe_load_all(RBAC.read_text()) if d]
    if grant is None:
        return docs
    role, resource, verb = grant
    for doc in docs:
        if doc["kind"] in ("Role", "ClusterRole") and doc["metadata"]["name"] == role:
            rules = []
            for rule in doc["rules"]:
                if resource in rule["resources"]:
                    rule["verbs"] = [v for v in rule["verbs"] if v != verb]
                if rule["verbs"]:
                    rules.append(rule)
            doc["rules"] = rules
    return docs


def as_serviceaccount(k8s: K8sServer, rbac: list[dict], account: str = "gpuboot"):
    """Apply namespace.yaml and `rbac` as the admin, prepare what the probes touch, and return a
    CoreV1Api acting as ServiceAccount gpuboot/`account` (the steps' unless told)."""
    admin = k8s.core_v1()
    create_all(admin.api_client, [d for d in yaml.safe_load_all(NAMESPACES.read_text()) if d])
    create_all(admin.api_client, rbac)
    k8s.add_node(NODE, gpu=1)
    admin.create_namespaced_pod(JOBS, pod_body("job-0"))
    admin.create_namespaced_config_map(LEDGER, {"metadata": {"name": CONFIGMAP}, "data": {"reservations": "[]"}})
    return k8s.core_v1(k8s.token_for("gpuboot", account))


def authorized(probe: Callable, v1) -> bool:
    """True when the API server let the call through (it may still answer 404 / 409 / 400)."""
    try:
        probe(v1)
    except ApiException as err:
        if err.status == 403:
            return False
        assert err.status in (400, 404, 409), (err.status, err.body)
    return True


def test_every_right_rbac_yaml_grants_has_its_probe():
    assert shipped_grants() == sorted(PROBES), "add a probe for each new grant (or drop the one no call needs)"


def test_the_shipped_rbac_lets_each_serviceaccount_make_every_call(k8s: K8sServer):
    sa = {"gpuboot": as_serviceaccount(k8s, rbac_without(None))}
    sa[PLACER] = k8s.core_v1(k8s.token_for("gpuboot", PLACER))
    refused = [grant for grant, probe in PROBES.items() if not authorized(probe, sa[account_of(grant[0])])]
    assert refused == []


@pytest.mark.parametrize("grant", sorted(PROBES), ids=lambda g: "-".join(g).replace("/", "_"))
def test_a_right_missing_from_rbac_yaml_is_a_403_for_the_call_that_needs_it(k8s: K8sServer, grant):
    role, resource, verb = grant
    sa = as_serviceaccount(k8s, rbac_without(grant), account_of(role))
    with pytest.raises(ApiException) as err:
        PROBES[grant](sa)
    assert err.value.status == 403, err.value
    user = f"system:serviceaccount:gpuboot:{account_of(role)}"
    assert f'User "{user}" cannot {verb} resource "{resource}"' in json.loads(err.value.body)["message"]


@pytest.mark.parametrize("namespace", ["kube-system", "default", "team-nowhere"])
def test_a_job_outside_the_job_namespaces_is_refused_and_the_serviceaccount_cannot_create_its_pod(
        k8s: K8sServer, namespace):
    """Refused at trigger time (the form's enum, and JobSpec for YAML specs and the place step, before
    anything is reserved: tests/e2e/test_trigger_input.py, test_bad_input.py run them whole),
    and were it let through, the local cloud would refuse the ServiceAccount its pod there (403)."""
    form = params_schema()["namespace"]["schema"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(namespace, form)
    with pytest.raises(JobSpecError) as refused:
        JobSpec.from_dict({"name": "escape", "image": "python:3.11", "command": ["true"], "namespace": namespace})
    assert refused.value.field == "namespace"
    sa = as_serviceaccount(k8s, rbac_without(None))
    if namespace == "team-nowhere":
        k8s.create_namespace(namespace)
    with pytest.raises(ApiException) as err:
        sa.create_namespaced_pod(namespace, pod_body("escape"))
    assert err.value.status == 403
    assert (f'pods is forbidden: User "{SA}" cannot create resource "pods" in API group "" in the namespace '
            f'"{namespace}"') == json.loads(err.value.body)["message"]
    sa.create_namespaced_pod(JOBS, pod_body("inside"))


def reviewer(sa) -> KubeClient:
    """The product's adapter acting through `sa` (its CoreV1Api), as the place step uses it."""
    from gpuboot.hooks.kube import KubeClient

    kube = KubeClient()
    kube.__dict__["core"] = sa
    return kube


@pytest.mark.parametrize("grant", [None, ("gpuboot-jobs", "pods/log", "get"), ("gpuboot-jobs", "pods", "create")],
                         ids=["shipped", "no-pod-log", "no-pod-create"])
def test_the_place_steps_review_finds_exactly_the_rights_missing_in_a_namespace(k8s: K8sServer, grant):
    """KubeClient.denied asks the API server (SelfSubjectAccessReview, which every identity may
    create: system:basic-user) for each right launch needs: in the job namespace the shipped Role
    leaves none out, a Role without one right lacks that one, a namespace without the Role lacks all."""
    from gpuboot.hooks.kube import JOB_POD_RIGHTS

    kube = reviewer(as_serviceaccount(k8s, rbac_without(grant)))
    assert kube.denied(JOBS, JOB_POD_RIGHTS) == ([] if grant is None else [f"{grant[2]} {grant[1]}"])
    k8s.create_namespace("team-b")
    assert kube.denied("team-b", JOB_POD_RIGHTS) == [f"{verb} {resource}" for _, resource, verb in JOB_POD_RIGHTS]


def test_a_cluster_that_refuses_the_review_itself_leaves_the_check_to_launch(k8s: K8sServer):
    """Without system:basic-user's binding the review is a 403: denied() says it could not tell (None),
    and the place step logs it and goes on, rather than refuse every job."""
    from kubernetes import client

    from gpuboot.hooks.kube import JOB_POD_RIGHTS

    sa = as_serviceaccount(k8s, rbac_without(None))
    client.RbacAuthorizationV1Api(k8s.core_v1().api_client).delete_cluster_role_binding("system:basic-user")
    assert reviewer(sa).denied(JOBS, JOB_POD_RIGHTS) is None


FLOW_CONTROL = REPO / "deploy/kubernetes/flowcontrol.yaml"


def test_flow_control_queues_each_serviceaccount_in_a_priority_level_of_its_own(k8s: K8sServer):
    """flowcontrol.yaml as kube-apiserver applies it: a request of the steps' ServiceAccount is classified into
    gpuboot-steps, the placer's into gpuboot-placer (the API server names the level of every request it
    classifies in the X-Kubernetes-PF-PriorityLevel-UID response header), and the admin's stays exempt."""
    if k8s.backend != "real":
        pytest.skip("priority and fairness is kube-apiserver's own (simcloud's API server runs every request as "
                    "it comes, one write at a time under its lock): runs under --kube=real")
    from kubernetes import client

    steps = as_serviceaccount(k8s, rbac_without(None))
    placer = k8s.core_v1(k8s.token_for("gpuboot", PLACER))
    admin = k8s.core_v1()
    flow = client.FlowcontrolApiserverV1Api(admin.api_client)
    docs = [d for d in yaml.safe_load_all(FLOW_CONTROL.read_text()) if d]
    create_all(admin.api_client, docs)
    try:
        uid = {name: flow.read_priority_level_configuration(name).metadata.uid
               for name in ("gpuboot-steps", "gpuboot-placer", "exempt")}

        def level_of(call) -> str | None:
            response = call()
            response.release_conn()
            return response.headers.get("X-Kubernetes-PF-PriorityLevel-UID")

        calls = {"gpuboot-steps": lambda: steps.read_namespaced_config_map(CONFIGMAP, LEDGER, _preload_content=False),
                 "gpuboot-placer": lambda: placer.read_node(NODE, _preload_content=False),
                 "exempt": lambda: admin.read_node(NODE, _preload_content=False)}
        for level, call in calls.items():     # the API server picks new schemas up from its own watch of them
            wait_until(lambda: level_of(call) == uid[level], timeout=30,
                       message=lambda: f"{level}: requests classified into {level_of(call)}, want {uid[level]}")
    finally:
        for doc in docs:
            with contextlib.suppress(ApiException):
                if doc["kind"] == "FlowSchema":
                    flow.delete_flow_schema(doc["metadata"]["name"])
                else:
                    flow.delete_priority_level_configuration(doc["metadata"]["name"])
