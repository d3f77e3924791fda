"""The three PATCH flavours: RFC 7386, RFC 6902 and Kubernetes strategic merge."""
import pytest

from simcloud.kube.patching import (
    JSON_PATCH,
    MERGE_PATCH,
    STRATEGIC_MERGE_PATCH,
    PatchError,
    apply_patch,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)

NODE = {
    "metadata": {"name": "n1", "labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
    "spec": {"taints": [{"key": "k1", "effect": "NoSchedule"}, {"key": "k2", "effect": "NoExecute"}]},
    "status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "MemoryPressure", "status": "False"}],
               "allocatable": {"cpu": "8", "nvidia.com/gpu": "1"}},
}


def test_merge_patch_rfc7386():
    out = merge_patch(NODE, {"metadata": {"labels": {"a": None, "c": "3"}}, "spec": {"unschedulable": True}})
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["spec"]["unschedulable"] is True
    assert out["spec"]["taints"] == NODE["spec"]["taints"]
    assert NODE["metadata"]["labels"] == {"a": "1", "b": "2"}          # input untouched
    # lists are replaced wholesale
    assert merge_patch(NODE, {"spec": {"taints": []}})["spec"]["taints"] == []


def test_json_patch_rfc6902_operations():
    ops = [
        {"op": "add", "path": "/metadata/labels/c", "value": "3"},
        {"op": "remove", "path": "/metadata/labels/a"},
        {"op": "replace", "path": "/status/allocatable/nvidia.com~1gpu", "value": "0"},
        {"op": "add", "path": "/spec/taints/-", "value": {"key": "k3", "effect": "NoSchedule"}},
        {"op": "copy", "from": "/metadata/labels/b", "path": "/metadata/labels/d"},
        {"op": "move", "from": "/metadata/labels/d", "path": "/metadata/labels/e"},
        {"op": "test", "path": "/metadata/name", "value": "n1"},
    ]
    out = json_patch(NODE, ops)
    assert out["metadata"]["labels"] == {"b": "2", "c": "3", "e": "2"}
    assert out["status"]["allocatable"]["nvidia.com/gpu"] == "0"
    assert [t["key"] for t in out["spec"]["taints"]] == ["k1", "k2", "k3"]


def test_json_patch_failed_test_is_all_or_nothing():
    with pytest.raises(PatchError) as err:
        json_patch(NODE, [{"op": "add", "path": "/metadata/labels/z", "value": "1"},
                          {"op": "test", "path": "/metadata/resourceVersion", "value": "9"}])
    assert err.value.code == 422
    assert "z" not in NODE["metadata"]["labels"]
    with pytest.raises(PatchError, match="missing path"):
        json_patch(NODE, [{"op": "remove", "path": "/spec/nope"}])
    with pytest.raises(PatchError) as err:
        json_patch(NODE, {"op": "add"})
    assert err.value.code == 400


def test_strategic_merge_merges_conditions_by_type_and_containers_by_name():
    out = strategic_merge_patch(NODE, {"status": {"conditions": [{"type": "Ready", "status": "True"},
                                                                 {"type": "DiskPressure", "status": "False"}]}})
    assert out["status"]["conditions"] == [{"type": "Ready", "status": "True"},
                                           {"type": "MemoryPressure", "status": "False"},
                                           {"type": "DiskPressure", "status": "False"}]
    pod = {"spec": {"containers": [{"name": "a", "image": "x:1"}, {"name": "b", "image": "y:1"}]}}
    out = strategic_merge_patch(pod, {"spec": {"containers": [{"name": "b", "image": "y:2"}]}})
    assert out["spec"]["containers"] == [{"name": "a", "image": "x:1"}, {"name": "b", "image": "y:2"}]


def test_strategic_merge_directives_and_replaced_lists():
    # taints carry no patch strategy in the Kubernetes types: the list is replaced
    out = strategic_merge_patch(NODE, {"spec": {"taints": [{"key": "k9", "effect": "NoSchedule"}]}})
    assert out["spec"]["taints"] == [{"key": "k9", "effect": "NoSchedule"}]
    out = strategic_merge_patch(NODE, {"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}})
    assert [c["type"] for c in out["status"]["conditions"]] == ["MemoryPressure"]
    out = strategic_merge_patch(NODE, {"metadata": {"labels": {"$patch": "replace", "only": "me"}}})
    assert out["metadata"]["labels"] == {"only": "me"}
    out = strategic_merge_patch(NODE, {"metadata": {"finalizers": ["y", "x"]}})
    assert out["metadata"]["finalizers"] == ["x", "y"]            # primitive merge list: union
    out = strategic_merge_patch(NODE, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]}})
    assert out["metadata"]["finalizers"] == []
    out = strategic_merge_patch(NODE, {"metadata": {"labels": {"a": None}}, "spec": {"unschedulable": True}})
    assert out["metadata"]["labels"] == {"b": "2"} and out["spec"]["unschedulable"] is True


def test_apply_patch_dispatches_on_content_type():
    body = b'{"metadata":{"labels":{"c":"3"}}}'
    for ctype in (MERGE_PATCH, STRATEGIC_MERGE_PATCH, MERGE_PATCH + "; charset=utf-8"):
        assert apply_patch(NODE, body, ctype)["metadata"]["labels"]["c"] == "3"
    assert apply_patch(NODE, '[{"op":"remove","path":"/metadata/labels"}]', JSON_PATCH)["metadata"].get("labels") is None
    with pytest.raises(PatchError) as err:
        apply_patch(NODE, body, "application/json")
    assert err.value.code == 415 and "merge-patch+json" in str(err.value)
    with pytest.raises(PatchError) as err:
        apply_patch(NODE, b"{not json", MERGE_PATCH)
    assert err.value.code == 400
