"""The permissions we ship (deploy/) are exactly what the code needs: all of it, nothing more.

The API calls are derived statically from plugins/gpuboot and dags/ (see api_calls.py) and
from the cncf-kubernetes provider's KubernetesPodOperator, which launches the job's pod.
Each call must appear in the explicit tables below; a new call fails here with the line to
add, until the table and deploy/ are updated together.
"""
from __future__ import annotations

import ast
import json
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from tests.static.api_calls import Use, kube_rest, pod_operator_uses, scan_files

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "deploy" / "kubernetes" / "rbac.yaml"
FLOW_CONTROL = ROOT / "deploy" / "kubernetes" / "flowcontrol.yaml"
RAM = ROOT / "deploy" / "ram" / "gpuboot-ecs-policy.json"
LEDGER_CONFIGMAP = "gpuboot-reservations"
QUEUE_SHARDS = tuple(f"{LEDGER_CONFIGMAP}-queue-{i}" for i in range(64))   # gpuboot.lifecycle.ledger.RequestQueue
LEDGER_SHARDS = tuple(f"{LEDGER_CONFIGMAP}-{k}" for k in range(64))      # gpuboot.lifecycle.ledger.SHARDS
JOB_QUEUE = "gpuboot-queue"    # gpuboot.lifecycle.jobqueue
INSTANCE_ARN = "acs:ecs:*:*:instance/*"
MANAGED_TAG = "acs:ResourceTag/gpuboot:managed"

# Kubernetes client method -> (apiGroup, resource, RBAC verb). Listing a method here does not
# grant anything: only methods the code really uses must be granted in rbac.yaml.
KUBE_CALLS: dict[str, tuple[str, str, str]] = {
    "read_node": ("", "nodes", "get"),
    "list_node": ("", "nodes", "list"),
    "patch_node": ("", "nodes", "patch"),
    "read_namespace": ("", "namespaces", "get"),
    "replace_node": ("", "nodes", "update"),
    "list_pod_for_all_namespaces": ("", "pods", "list"),
    "list_namespaced_pod": ("", "pods", "list"),
    "read_namespaced_pod": ("", "pods", "get"),
    "create_namespaced_pod": ("", "pods", "create"),
    "patch_namespaced_pod": ("", "pods", "patch"),
    "delete_namespaced_pod": ("", "pods", "delete"),
    "read_namespaced_pod_log": ("", "pods/log", "get"),
    "list_namespaced_event": ("", "events", "list"),
    "list_event_for_all_namespaces": ("", "events", "list"),
    "create_namespaced_event": ("", "events", "create"),
    "read_namespaced_config_map": ("", "configmaps", "get"),
    "create_namespaced_config_map": ("", "configmaps", "create"),
    "replace_namespaced_config_map": ("", "configmaps", "update"),
    "patch_namespaced_config_map": ("", "configmaps", "patch"),
    "create_self_subject_access_review": ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
}

# Rights every authenticated identity holds by default, granted by the cluster, not by deploy/:
# the ClusterRole system:basic-user, bound to system:authenticated (the local cloud binds it too).
BUILT_IN: dict[tuple[str, str, str], str] = {
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"):
        "the place step reviews its rights in the job namespace (KubeClient.denied)",
}

# Pod-operator calls that gpuboot's use of it never reaches (checked below).
NOT_REACHED = {
    "connect_get_namespaced_pod_exec": "the XCom sidecar, only with do_xcom_push=True",
}

# Grants shipped ahead of the code that needs them, with why. Tolerated only while unused:
# once the code makes the call, the entry must go (test_planned_grants_are_still_planned).
PLANNED: dict[tuple[str, str, str], str] = {}

# The placer's ClusterRole (its own ServiceAccount, so flowcontrol.yaml can queue it apart): what its view and
# its batches need, written out because the scan cannot tell which process makes a call, nor see the view's
# watches (`KubeClient.stream_events` calls the list method `_collection` picks, with watch=True).
# tests/integration/test_cluster_view.py runs a placer as this identity, so a right missing here fails there.
PLACER_ROLE = "gpuboot-placer"
PLACER_RIGHTS: dict[tuple[str, str, str], str] = {
    ("", "nodes", "list"): "the view's first read, and after a 410 (ClusterView, KubeClient.list_versioned)",
    ("", "nodes", "watch"): "the view's watch (KubeClient.stream_events)",
    ("", "pods", "list"): "the view's first read of every non-terminated pod",
    ("", "pods", "watch"): "the view's watch of them",
    ("", "nodes", "patch"): "a batch claims the Nodes it books for its ledger (ReservationLedger._claim)",
    ("", "nodes", "get"): "a claim that conflicted reads its Node again",
}

# Resources used only in the ledger namespace: granted by a Role there, never cluster-wide.
LEDGER_RESOURCES = {"configmaps"}
# The Roles, by scope (see _scope): the jobs' pods in each job namespace, the ledger in its own.
JOBS_ROLE, LEDGER_ROLE = "gpuboot-jobs", "gpuboot-ledger"
NAMESPACES = ROOT / "deploy" / "kubernetes" / "namespace.yaml"

# ECS action -> (RAM Resource it is granted on, whether the gpuboot:managed tag is required).
ECS_ACTIONS: dict[str, tuple[str, bool]] = {
    "DescribeInstances": (INSTANCE_ARN, False),
    "DescribeInstanceStatus": (INSTANCE_ARN, False),
    "DescribeInstanceTypes": ("*", False),  # a catalogue, not an instance: no resource level
    "DescribePrice": ("*", False),          # a price list: ECS authorises it on all resources only
    "StartInstances": (INSTANCE_ARN, True),
    "StopInstances": (INSTANCE_ARN, True),
}


def _sources() -> list[Path]:
    return sorted(p for d in ("plugins/gpuboot", "dags") for p in (ROOT / d).rglob("*.py"))


@pytest.fixture(scope="module")
def plugin_uses() -> list[Use]:
    uses = scan_files(_sources(), ROOT)
    if not uses:
        pytest.skip("plugins/gpuboot makes no Kubernetes or ECS calls yet")
    return uses


@pytest.fixture(scope="module")
def kube_uses(plugin_uses) -> list[Use]:
    kpo = [u for u in pod_operator_uses() if u.name not in NOT_REACHED]
    return [u for u in plugin_uses + kpo if u.api == "kube"]


def _scope(method: str, resource: str) -> str:
    """Where a call needs its right: "cluster" (cluster-scoped objects, or every namespace at once:
    placement's reads, scale-down's cordon), "ledger" (the ConfigMap in the ledger namespace) or
    "jobs" (anything else namespaced: the pod operator, in the job's namespace only)."""
    if resource in LEDGER_RESOURCES:
        return "ledger"
    if method.endswith("_for_all_namespaces") or "_namespaced_" not in method:
        return "cluster"
    return "jobs"


@pytest.fixture(scope="module")
def needed(kube_uses) -> dict[str, dict[tuple[str, str, str], list[Use]]]:
    """scope -> (apiGroup, resource, verb) -> the uses that need it."""
    out: dict[str, dict[tuple[str, str, str], list[Use]]] = {s: defaultdict(list) for s in ("cluster", "jobs", "ledger")}
    for use in kube_uses:
        if use.name in KUBE_CALLS and KUBE_CALLS[use.name] not in BUILT_IN:
            group, resource, verb = KUBE_CALLS[use.name]
            out[_scope(use.name, resource)][(group, resource, "watch" if use.watch else verb)].append(use)
    return out


@pytest.fixture(scope="module")
def rbac() -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for doc in yaml.safe_load_all(RBAC.read_text()):
        if doc:
            by_kind[doc["kind"]].append(doc)
    return by_kind


def _grants(role: dict):
    for rule in role.get("rules", []):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    yield (group, resource, verb), tuple(rule.get("resourceNames", ()))


def _where(uses: list[Use]) -> str:
    return "; ".join(str(u) for u in uses[:3]) + (" ..." if len(uses) > 3 else "")


# -- the tables are right ------------------------------------------------------------------

@pytest.mark.parametrize("method", sorted(KUBE_CALLS))
def test_kube_table_matches_the_client_url(method):
    assert kube_rest(method) == KUBE_CALLS[method], (
        f"KUBE_CALLS[{method!r}] disagrees with the kubernetes client's own URL/HTTP method")


def test_every_kube_call_is_mapped(kube_uses):
    unmapped = sorted({u.name for u in kube_uses if u.name not in KUBE_CALLS})
    assert not unmapped, "Kubernetes calls missing from KUBE_CALLS (add them with their RBAC, " \
        "then grant them in deploy/kubernetes/rbac.yaml):\n" + "\n".join(
            f'    "{n}": {kube_rest(n)!r},  # {_where([u for u in kube_uses if u.name == n])}'
            for n in unmapped)


def test_every_ecs_call_is_mapped(plugin_uses):
    unmapped = sorted({u.name for u in plugin_uses if u.api == "ecs" and u.name not in ECS_ACTIONS})
    assert not unmapped, "ECS actions missing from ECS_ACTIONS (add them, then allow them in " \
        f"deploy/ram/gpuboot-ecs-policy.json): {unmapped}"


# -- Kubernetes RBAC -----------------------------------------------------------------------

def _roles(rbac, scope: str) -> list[dict]:
    if scope == "cluster":
        return [r for r in rbac["ClusterRole"] if r["metadata"]["name"] != PLACER_ROLE]
    return [r for r in rbac["Role"] if r["metadata"]["name"] == (JOBS_ROLE if scope == "jobs" else LEDGER_ROLE)]


def test_rbac_has_only_the_known_roles(rbac):
    assert {r["metadata"]["name"] for r in rbac["Role"]} == {JOBS_ROLE, LEDGER_ROLE}
    assert [r["metadata"]["name"] for r in rbac["ClusterRole"]] == ["gpuboot", PLACER_ROLE]


def test_the_placer_is_granted_what_it_needs_and_no_more(rbac):
    (role,) = [r for r in rbac["ClusterRole"] if r["metadata"]["name"] == PLACER_ROLE]
    assert sorted(perm for perm, _ in _grants(role)) == sorted(PLACER_RIGHTS)


def test_rbac_grants_every_call(needed, rbac):
    missing = []
    cluster = {g for r in _roles(rbac, "cluster") for g, _ in _grants(r)}
    for scope, perms in needed.items():
        for role in _roles(rbac, scope):
            granted = {g for g, _ in _grants(role)} | (cluster if scope == "jobs" else set())   # a ClusterRole
            for perm, uses in sorted(perms.items()):
                if perm not in granted:
                    where = role["metadata"].get("namespace")
                    missing.append(f"{role['kind']} {role['metadata']['name']}{f' in {where}' if where else ''}: "
                                   f"apiGroup {perm[0]!r} {perm[1]} {perm[2]}  <- {_where(uses)}")
    assert not missing, "deploy/kubernetes/rbac.yaml lacks:\n  " + "\n  ".join(missing)


def test_rbac_grants_nothing_more(needed, rbac):
    """Nothing a call does not need, and each right in its own scope only: no pod write
    cluster-wide, no ConfigMap right outside the ledger's Role."""
    extra = sorted({f"{role['kind']} {role['metadata']['name']}: {perm}"
                    for scope in needed for role in _roles(rbac, scope)
                    for perm, _ in _grants(role) if perm not in needed[scope] and perm not in PLANNED})
    assert not extra, "granted but no call needs it in that scope (remove it, or the code lost a call):\n  " + \
        "\n  ".join(extra)


def test_planned_grants_are_still_planned(needed):
    landed = sorted(perm for perm in PLANNED if any(perm in perms for perms in needed.values()))
    assert not landed, f"the code now makes these calls: drop them from PLANNED: {landed}"


def test_the_rights_the_place_step_reviews_are_the_job_role(rbac):
    """kube.JOB_POD_RIGHTS (what the place step checks before it boots) is what the Role grants."""
    from gpuboot.hooks.kube import JOB_POD_RIGHTS

    (role,) = list(_roles(rbac, "jobs"))
    assert sorted(JOB_POD_RIGHTS) == sorted(perm for perm, _ in _grants(role))


def test_built_in_rights_are_granted_by_the_local_cloud_to_every_identity():
    """What BUILT_IN leaves out of deploy/ must be there without it, in the local cloud as in a cluster."""
    from simcloud.kube import auth

    basic = next(r for r in auth.BOOTSTRAP_ROLES if r["metadata"]["name"] == "system:basic-user")
    bound_to = {(s["kind"], s["name"]) for b in auth.BOOTSTRAP_BINDINGS if b["roleRef"]["name"] == "system:basic-user"
                for s in b["subjects"]}
    assert ("Group", auth.AUTHENTICATED) in bound_to
    for group, resource, verb in BUILT_IN:
        assert any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                   for rule in basic["rules"]), (group, resource, verb)


def test_rbac_has_no_wildcards(rbac):
    for kind in ("ClusterRole", "Role"):
        for role in rbac[kind]:
            for (group, resource, verb), _ in _grants(role):
                assert "*" not in (group, resource, verb), f"{kind} {role['metadata']['name']} uses '*'"


def test_ledger_is_granted_only_on_its_configmap(rbac):
    """get/update are pinned to the ledger, its shards and its queue's shards by resourceNames, patch to the
    queue's shards (RequestQueue's merge patches); create
    cannot be (Kubernetes does not know the name when it authorizes a create), so it stands alone."""
    assert not any(perm[1] in LEDGER_RESOURCES for r in rbac["ClusterRole"] for perm, _ in _grants(r))
    for role in rbac["Role"]:
        for (_, resource, verb), names in _grants(role):
            if resource in LEDGER_RESOURCES:
                expected = () if verb == "create" else QUEUE_SHARDS if verb == "patch" else \
                    (LEDGER_CONFIGMAP, *LEDGER_SHARDS, *QUEUE_SHARDS, JOB_QUEUE)
                assert names == expected, f"configmaps {verb}: resourceNames {names}, want {expected}"


def test_ledger_shard_count_is_the_one_rbac_names():
    from gpuboot.lifecycle.ledger import SHARDS, ReservationLedger

    assert tuple(ReservationLedger(None).shard_names()) == LEDGER_SHARDS and len(LEDGER_SHARDS) == SHARDS


def test_ledger_name_is_the_one_the_plugin_uses(plugin_uses):
    if not any(u.name.endswith("_config_map") for u in plugin_uses):
        pytest.skip("the plugin does not use the ledger ConfigMap yet")
    literals = {n.value for p in _sources() for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert LEDGER_CONFIGMAP in literals, f"no {LEDGER_CONFIGMAP!r} in plugins/gpuboot: update rbac.yaml"


def _defaults(name: str) -> set:
    """Default values of every parameter called `name` in plugins/gpuboot and dags/."""
    found = set()
    for path in _sources():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = fn.args.posonlyargs + fn.args.args
                pairs = list(zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults))
                pairs += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None]
                found |= {d.value for a, d in pairs if a.arg == name and isinstance(d, ast.Constant)}
    return found


def test_ledger_role_is_where_the_plugin_keeps_the_ledger(rbac):
    defaults = _defaults("ledger_namespace")
    if not defaults:
        pytest.skip("no ledger_namespace parameter in the plugin yet")
    namespaces = {r["metadata"]["namespace"] for r in _roles(rbac, "ledger")}
    assert defaults == namespaces, (f"the plugin's default ledger_namespace {defaults} != the Role's "
                                    f"namespace {namespaces}: change rbac.yaml and docs together")


def test_job_roles_are_in_the_default_job_namespaces_which_namespace_yaml_creates(rbac):
    """A Role and RoleBinding gpuboot-jobs in each namespace GPUBOOT_JOB_NAMESPACES defaults to,
    and no other (the form and the place step refuse the rest), each created by namespace.yaml."""
    from gpuboot.core.jobspec import DEFAULT_JOB_NAMESPACES

    for kind in ("Role", "RoleBinding"):
        where = sorted(r["metadata"]["namespace"] for r in rbac[kind] if r["metadata"]["name"] == JOBS_ROLE)
        assert where == sorted(DEFAULT_JOB_NAMESPACES), f"{kind} {JOBS_ROLE} in {where}, want {DEFAULT_JOB_NAMESPACES}"
    created = {d["metadata"]["name"] for d in yaml.safe_load_all(NAMESPACES.read_text()) if d and d["kind"] == "Namespace"}
    assert set(DEFAULT_JOB_NAMESPACES) <= created, f"{NAMESPACES.name} creates {created}"


def test_roles_are_bound_to_the_service_accounts(rbac):
    """The steps' ServiceAccount (gpuboot) gets every role but the placer's; the placer's (gpuboot-placer)
    its ClusterRole and the ledger's Role; each role bound exactly once."""
    accounts = {a["metadata"]["name"]: {"kind": "ServiceAccount", "name": a["metadata"]["name"],
                                        "namespace": a["metadata"]["namespace"]} for a in rbac["ServiceAccount"]}
    assert sorted(accounts) == ["gpuboot", PLACER_ROLE]
    steps, placer = accounts["gpuboot"], accounts[PLACER_ROLE]
    want = {PLACER_ROLE: [placer], LEDGER_ROLE: [steps, placer]}
    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        roles = {(r["metadata"]["name"], r["metadata"].get("namespace")) for r in rbac[role_kind]}
        bound = set()
        for binding in rbac[binding_kind]:
            name = binding["roleRef"]["name"]
            assert binding["subjects"] == want.get(name, [steps]), f"{binding_kind} {binding['metadata']['name']}"
            assert binding["roleRef"]["kind"] == role_kind
            bound.add((name, binding["metadata"].get("namespace")))
        assert bound == roles, f"every {role_kind} must be bound exactly once ({role_kind}s {roles})"


def test_flow_control_queues_both_identities_before_the_built_in_schemas(rbac):
    """flowcontrol.yaml: one FlowSchema per ServiceAccount of rbac.yaml, each into a priority level of its own
    that the file defines, matched before the built-in `service-accounts` schema (precedence 9000); the steps'
    level never borrows seats (a burst of place steps queues instead of widening)."""
    docs = [d for d in yaml.safe_load_all(FLOW_CONTROL.read_text()) if d]
    levels = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PriorityLevelConfiguration"}
    schemas = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "FlowSchema"}
    accounts = {(a["metadata"]["namespace"], a["metadata"]["name"]) for a in rbac["ServiceAccount"]}
    matched = {}
    for name, spec in schemas.items():
        assert spec["matchingPrecedence"] < 9000, name
        assert spec["priorityLevelConfiguration"]["name"] in levels, name
        for rule in spec["rules"]:
            for subject in rule["subjects"]:
                sa = subject["serviceAccount"]
                matched[(sa["namespace"], sa["name"])] = spec["priorityLevelConfiguration"]["name"]
    assert set(matched) == accounts and len(set(matched.values())) == len(accounts), matched
    steps = levels[matched[("gpuboot", "gpuboot")]]["limited"]
    assert steps["borrowingLimitPercent"] == 0 and steps["limitResponse"]["type"] == "Queue"
    placer = levels[matched[("gpuboot", PLACER_ROLE)]]["limited"]
    assert placer["nominalConcurrencyShares"] > steps["nominalConcurrencyShares"]


def test_gpuboot_never_turns_on_the_xcom_sidecar():
    """NOT_REACHED holds only while nothing passes do_xcom_push=True to the pod operator."""
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "do_xcom_push":
                assert isinstance(node.value, ast.Constant) and node.value.value is False, \
                    f"{path.relative_to(ROOT)}:{node.value.lineno}: do_xcom_push needs pods/exec in rbac.yaml"


# -- ECS RAM policy ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ram() -> list[dict]:
    policy = json.loads(RAM.read_text())
    assert policy["Version"] == "1"
    return policy["Statement"]


def _actions(statement: dict) -> list[str]:
    actions = statement["Action"]
    return [actions] if isinstance(actions, str) else actions


def test_ram_allows_exactly_the_actions_used(plugin_uses, ram):
    used = {u.name for u in plugin_uses if u.api == "ecs"}
    allowed = {a.removeprefix("ecs:") for s in ram if s["Effect"] == "Allow" for a in _actions(s)}
    assert used <= allowed, f"deploy/ram/gpuboot-ecs-policy.json lacks {sorted(used - allowed)}"
    assert allowed <= used, f"RAM policy allows actions no code calls: {sorted(allowed - used)}"


def test_ram_scopes_each_action(ram):
    for statement in ram:
        assert statement["Effect"] == "Allow"
        for action in _actions(statement):
            assert action.startswith("ecs:") and "*" not in action, f"{action}: name actions exactly"
            resource, tagged = ECS_ACTIONS[action.removeprefix("ecs:")]
            assert statement["Resource"] == resource, f"{action}: Resource {statement['Resource']!r}"
            condition = statement.get("Condition", {})
            if tagged:
                assert condition == {"StringEquals": {MANAGED_TAG: "true"}}, \
                    f"{action} must be limited to instances tagged gpuboot:managed=true"
            else:
                assert not condition, f"{action}: unexpected condition {condition}"
