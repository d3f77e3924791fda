"""Label and field selectors behave like the Kubernetes API server's."""
import pytest

from simcloud.kube.selectors import SelectorError, parse_field_selector, parse_label_selector

LABELS = {"app": "train", "tier": "gpu", "gpus": "4"}


@pytest.mark.parametrize("selector, expected", [
    ("", True),
    ("app=train", True),
    ("app==train", True),
    ("app!=train", False),
    ("missing!=x", True),            # != matches objects without the key
    ("app in (train, serve)", True),
    ("app in (serve)", False),
    ("app notin (serve)", True),
    ("missing notin (serve)", True),
    ("tier", True),
    ("missing", False),
    ("!missing", True),
    ("!tier", False),
    ("app=train,tier=gpu", True),     # comma is AND
    ("app=train,tier=cpu", False),
    ("app in (a,train),!missing", True),
    ("gpus>2", True),
    ("gpus<2", False),
    ("example.com/role=x", False),
])
def test_label_selector_matches(selector, expected):
    assert parse_label_selector(selector).matches(LABELS) is expected


@pytest.mark.parametrize("selector", ["app=", "a b c", "app in ()", "app in (a", "-bad=x", "app=bad value!",
                                      "gpus>x"])
def test_invalid_label_selectors_are_refused(selector):
    if selector == "app=":           # an empty value is valid: matches label present with value ""
        assert parse_label_selector(selector).matches({"app": ""})
        return
    with pytest.raises(SelectorError, match="unable to parse requirement"):
        parse_label_selector(selector)


POD = {"metadata": {"name": "p1", "namespace": "ml"}, "spec": {"nodeName": "gpu-1"}, "status": {"phase": "Running"}}
EVENT = {"metadata": {"name": "e", "namespace": "ml"}, "involvedObject": {"kind": "Pod", "name": "p1", "uid": "u1"},
         "reason": "Scheduled", "type": "Normal", "source": {"component": "default-scheduler"}}


@pytest.mark.parametrize("resource, obj, selector, expected", [
    ("pods", POD, "metadata.name=p1", True),
    ("pods", POD, "metadata.name==p1,metadata.namespace=ml", True),
    ("pods", POD, "spec.nodeName=gpu-1", True),
    ("pods", POD, "spec.nodeName=", False),
    ("pods", {"metadata": {"name": "x"}, "spec": {}}, "spec.nodeName=", True),   # unbound pods
    ("pods", POD, "status.phase!=Failed,status.phase!=Succeeded", True),
    ("pods", POD, "status.phase=Pending", False),
    ("events", EVENT, "involvedObject.name=p1,involvedObject.kind=Pod,involvedObject.uid=u1", True),
    ("events", EVENT, "involvedObject.namespace=", True),
    ("events", EVENT, "type=Warning", False),
    ("events", EVENT, "reason=Scheduled,source=default-scheduler", True),
    ("nodes", {"metadata": {"name": "n"}, "spec": {"unschedulable": True}}, "spec.unschedulable=true", True),
    # an absent boolean is false, as the typed Node the real server formats has it
    ("nodes", {"metadata": {"name": "n"}, "spec": {}}, "spec.unschedulable=false", True),
    ("nodes", {"metadata": {"name": "n"}}, "spec.unschedulable=false", True),
    ("nodes", {"metadata": {"name": "n"}}, "spec.unschedulable!=true", True),
    ("nodes", {"metadata": {"name": "n"}, "spec": {"unschedulable": True}}, "spec.unschedulable=false", False),
    ("pods", POD, "spec.hostNetwork=false", True),
])
def test_field_selector_matches(resource, obj, selector, expected):
    assert parse_field_selector(selector, resource).matches(obj) is expected


def test_field_selector_refuses_unsupported_fields_like_the_server():
    with pytest.raises(SelectorError, match=r"field label not supported: spec.nodeName"):
        parse_field_selector("spec.nodeName=x", "configmaps")
    with pytest.raises(SelectorError, match=r"field label not supported: status.podIP"):
        parse_field_selector("status.podIP=1", "nodes")
    with pytest.raises(SelectorError, match="invalid selector"):
        parse_field_selector("metadata.name", "pods")


def test_field_selector_exposes_pinned_name():
    assert parse_field_selector("metadata.name=n1", "nodes").value_for("metadata.name") == "n1"
    assert parse_field_selector("metadata.name!=n1", "nodes").value_for("metadata.name") is None
