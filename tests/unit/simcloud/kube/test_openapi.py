"""simcloud.kube.openapi: field knowledge of the served kinds, and the OpenAPI v3 documents kubectl reads."""
import json

from simcloud.kube.openapi import (
    FIELDS_FILE,
    drop_unknown_fields,
    dump_fields,
    generate_fields,
    v2_document,
    v3_document,
    v3_root,
)
from simcloud.kube.resources import RESOURCES


def test_every_served_kind_has_a_schema_and_known_fields_pass():
    for info in RESOURCES.values():
        obj = {"apiVersion": info.api_version, "kind": info.kind, "metadata": {"name": "x", "labels": {"a": "b"}}}
        assert drop_unknown_fields(info, obj) == [], info.kind


def test_unknown_fields_are_dropped_and_named_by_path():
    pod = {"apiVersion": "v1", "kind": "Pod", "colour": "red",
           "metadata": {"name": "p", "annotations": {"any.key/x": "1"}},
           "spec": {"nodeSelector": {"gpu": "t4"}, "containers": [
               {"name": "a", "image": "i", "resources": {"limits": {"nvidia.com/gpu": 1}}},
               {"name": "b", "image": "i", "imagePullPolicyy": "Always", "env": [{"name": "X", "valu": "1"}]}]}}
    found = drop_unknown_fields(RESOURCES["pods"], pod)
    assert found == ["colour", "spec.containers[1].imagePullPolicyy", "spec.containers[1].env[0].valu"]
    assert "colour" not in pod and pod["spec"]["containers"][1] == {"name": "b", "image": "i", "env": [{"name": "X"}]}


def test_strategic_merge_directives_are_not_fields():
    patch = {"spec": {"$setElementOrder/containers": [{"name": "a"}],
                      "containers": [{"name": "a", "$patch": "delete"}]}}
    assert drop_unknown_fields(RESOURCES["pods"], patch) == []


def test_v3_documents_offer_field_validation_on_each_kinds_patch():
    root = v3_root()["paths"]
    assert set(root) == {"api/v1", "apis/coordination.k8s.io/v1", "apis/rbac.authorization.k8s.io/v1",
                         "apis/authorization.k8s.io/v1"}
    assert root["api/v1"]["serverRelativeURL"].startswith("/openapi/v3/api/v1?hash=")
    doc = json.loads(v3_document("apis/coordination.k8s.io/v1"))
    patch = doc["paths"]["/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "coordination.k8s.io", "version": "v1",
                                                        "kind": "Lease"}
    assert {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}} \
        in patch["parameters"]
    assert "/api/v1/nodes/{name}" in json.loads(v3_document("api/v1"))["paths"]
    assert v3_document("apis/apps/v1") is None


def test_the_shipped_field_table_matches_the_installed_kubernetes_client():
    # regenerate with `python -m simcloud.kube.openapi` after upgrading the `kubernetes` pin
    assert FIELDS_FILE.read_text() == dump_fields(generate_fields())


def test_openapi_v2_lists_a_patch_with_dry_run_for_every_kind_in_json_and_protobuf():
    body, content_type = v2_document("application/json")
    doc = json.loads(body)
    assert content_type == "application/json" and doc["swagger"] == "2.0" and doc["definitions"] == {}
    kinds = {(op["patch"]["x-kubernetes-group-version-kind"]["kind"]) for op in doc["paths"].values()
             if "dryRun" in [p["name"] for p in op["patch"]["parameters"]]}
    assert kinds == {info.kind for info in RESOURCES.values()}
    # kubectl 1.20 asks with the deprecated "@" spelling; Go cannot parse it back, so the answer is dotted
    pb, pb_type = v2_document("application/com.github.proto-openapi.spec.v2@v1.0+protobuf")
    assert pb_type == "application/com.github.proto-openapi.spec.v2.v1.0+protobuf" and pb.startswith(b"\n\x032.0")
    assert all(path.encode() in pb for path in doc["paths"])
