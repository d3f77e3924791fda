"""Manifests through `kubectl apply/create -f` (validation on) and server-side field validation."""
from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException

from tests.conformance.k8s_harness import KUBECTLS, K8sServer, k8s, kubectl  # noqa: F401

KUBECTL_132 = KUBECTLS["kubectl-1.32"]
MANIFEST = """apiVersion: v1
kind: ConfigMap
metadata:
  name: {name}
  namespace: default
data:
  a: "{value}"
{extra}"""


def _write(k8s: K8sServer, name: str, value: str = "1", extra: str = "") -> str:
    path = k8s.workdir / f"{name}-{value}.yaml"
    path.write_text(MANIFEST.format(name=name, value=value, extra=extra))
    return str(path)


@pytest.mark.kubectl
def test_kubectl_apply_and_create_validate_against_the_server(k8s: K8sServer):
    v1 = k8s.core_v1()
    assert "configmap/demo created" in kubectl(KUBECTL_132, k8s, "apply", "-f", _write(k8s, "demo")).stdout
    again = kubectl(KUBECTL_132, k8s, "create", "-f", _write(k8s, "demo"), check=False)
    assert again.returncode != 0 and 'configmaps "demo" already exists' in again.stderr
    assert "configured" in kubectl(KUBECTL_132, k8s, "apply", "-f", _write(k8s, "demo", "2")).stdout
    assert v1.read_namespaced_config_map("demo", "default").data == {"a": "2"}

    # an unknown field: refused (Strict, kubectl's default), nothing written
    typo = _write(k8s, "demo", "3", extra="datta:\n  b: x\n")
    for verb in ("apply", "create"):
        refused = kubectl(KUBECTL_132, k8s, verb, "-f", typo, check=False)
        assert refused.returncode != 0
        assert 'strict decoding error: unknown field "datta"' in refused.stderr, refused.stderr
    assert v1.read_namespaced_config_map("demo", "default").data == {"a": "2"}
    # --validate=warn: written without the unknown field, with the server's warning
    warned = kubectl(KUBECTL_132, k8s, "create", "--validate=warn", "-f", _write(k8s, "other", extra="datta: {}\n"))
    assert 'Warning: unknown field "datta"' in warned.stderr and "configmap/other created" in warned.stdout
    raw = json.loads(v1.read_namespaced_config_map("other", "default", _preload_content=False).data)
    assert "datta" not in raw


def test_field_validation_through_the_kubernetes_client(k8s: K8sServer):
    v1 = k8s.core_v1()
    body = {"metadata": {"name": "p"}, "spec": {"nodeSelector": {"none": "x"}, "containers": [
        {"name": "c", "image": "img:1", "colour": "red"}]}}
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod("default", body, field_validation="Strict")
    assert err.value.status == 400
    assert json.loads(err.value.body)["message"] == ('Pod in version "v1" cannot be handled as a Pod: strict '
                                                     'decoding error: unknown field "spec.containers[0].colour"')
    with pytest.raises(ApiException) as err:
        v1.create_namespaced_pod("default", body, field_validation="Loose")
    assert err.value.status == 400 and "fieldValidation" in json.loads(err.value.body)["message"]
    created = v1.create_namespaced_pod("default", body, _preload_content=False)   # Warn, the default
    assert created.status == 201
    assert created.headers["Warning"] == '299 - "unknown field \\"spec.containers[0].colour\\""'
    assert "colour" not in json.loads(created.data)["spec"]["containers"][0]
    patched = v1.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "b"}}, "spek": {}},
                                      _preload_content=False)
    assert patched.headers["Warning"] == '299 - "unknown field \\"spek\\""'
    assert json.loads(patched.data)["metadata"]["labels"] == {"a": "b"}
