"""simcloud.kube.validation's pure rules: the typed decode's messages, names, labels and quantities."""
import pytest

from simcloud.kube.errors import ApiError
from simcloud.kube.resources import RESOURCES
from simcloud.kube.validation import decode_errors, is_extended, label_value_errors, qualified_name_errors, validate


def test_decode_errors_name_the_go_field_and_type():
    node = {"metadata": {"name": "n", "labels": {"a": True}}, "spec": {"taints": "notalist"},
            "status": {"allocatable": {"cpu": 4, "nvidia.com/gpu": "1"}}}
    assert decode_errors(RESOURCES["nodes"], node) == [
        "json: cannot unmarshal bool into Go struct field ObjectMeta.metadata.labels of type string",
        "json: cannot unmarshal string into Go struct field NodeSpec.spec.taints of type []v1.Taint"]
    assert decode_errors(RESOURCES["pods"], {"spec": {"containers": [{"name": "c", "command": "python"}]}}) == [
        "json: cannot unmarshal string into Go struct field Container.spec.containers.command of type []string"]
    assert decode_errors(RESOURCES["pods"], {"spec": {"priority": 1.5, "hostNetwork": "yes",
                                                      "terminationGracePeriodSeconds": 30.0}}) == [
        "json: cannot unmarshal number 1.5 into Go struct field PodSpec.spec.priority of type int64",
        "json: cannot unmarshal string into Go struct field PodSpec.spec.hostNetwork of type bool",
        ("json: cannot unmarshal number 30.0 into Go struct field PodSpec.spec.terminationGracePeriodSeconds of type "
        "int64")]
    assert decode_errors(RESOURCES["configmaps"], {"data": {"k": None}, "metadata": None}) == []   # null decodes


def test_qualified_names_and_label_values():
    assert qualified_name_errors("aliyun.accelerator/nvidia_name") == []
    assert qualified_name_errors("gpuboot.io/managed") == []
    assert qualified_name_errors("Bad_Prefix/x")[0].startswith("prefix part a lowercase RFC 1123 subdomain")
    assert qualified_name_errors("x" * 64) == ["name part must be no more than 63 bytes"]
    assert qualified_name_errors("") == ["name part must be non-empty", qualified_name_errors("-")[0]]
    assert label_value_errors("") == [] and label_value_errors("Tesla-T4") == []
    assert label_value_errors("a b")[0].startswith("a valid label must be an empty string")
    assert is_extended("nvidia.com/gpu") and is_extended("rdma/hca")
    assert not is_extended("cpu") and not is_extended("kubernetes.io/foo") and not is_extended("requests.x/y")


def test_rbac_objects_are_validated_and_role_refs_are_immutable():
    binding = {"metadata": {"name": "b"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                       "name": "view"},
               "subjects": [{"kind": "ServiceAccount", "name": "sa"}]}
    with pytest.raises(ApiError) as err:                     # a cluster binding's SA needs its namespace
        validate(RESOURCES["clusterrolebindings"], binding)
    assert err.value.details["causes"][0]["field"] == "subjects[0].namespace"
    validate(RESOURCES["rolebindings"], binding)
    changed = {**binding, "roleRef": {**binding["roleRef"], "name": "edit"}}
    with pytest.raises(ApiError, match="cannot change roleRef"):
        validate(RESOURCES["rolebindings"], changed, binding)
    with pytest.raises(ApiError, match="verbs must contain at least one value"):
        validate(RESOURCES["roles"], {"metadata": {"name": "r"}, "rules": [{"apiGroups": [""], "resources": ["pods"]}]})
    with pytest.raises(ApiError, match="namespaced rules cannot apply to non-resource URLs"):
        validate(RESOURCES["roles"], {"metadata": {"name": "r"}, "rules": [{"nonResourceURLs": ["/x"], "verbs": ["get"]}]})
