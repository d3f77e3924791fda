"""What is secret in the product's connections is masked in task logs, and nothing else makes Airflow
warn "Skipping masking for a secret as it's too short (<5 chars)" at the top of every log.

Airflow registers every value of a connection's extra with its secrets masker (whatever the key)
and warns once per process for one under 5 characters: the local cloud's ECS connection used to
carry `protocol: "http"`. The secrets themselves: the ECS AccessKey secret (the connection's
password, registered by Airflow) and the ServiceAccount token, which sits in the kubeconfig file
the Kubernetes connection names, where Airflow cannot see it (registered by gpuboot.hooks.kube)."""
from __future__ import annotations

import pytest
from airflow.sdk._shared.secrets_masker.secrets_masker import SecretsMasker, redact

from gpuboot.hooks.ecs import EcsHook, endpoint_settings
from gpuboot.hooks.kube import KubeClient
from tests.integration.conftest import expose_connections


@pytest.fixture
def product_connections(cloud, monkeypatch):
    """The connections the product runs with (Kubernetes as the shipped ServiceAccount)."""
    expose_connections(cloud.gpuboot_connections(), monkeypatch)
    monkeypatch.setattr(SecretsMasker, "_has_warned_short_secret", False)
    return cloud


def test_the_product_connections_register_no_short_value(product_connections):
    EcsHook().get_conn()
    KubeClient().core.list_node(limit=1)
    assert SecretsMasker._has_warned_short_secret is False, "a connection value under 5 characters was registered"


def test_the_ecs_secret_and_the_serviceaccount_token_are_masked(product_connections):
    cloud = product_connections
    EcsHook().get_conn()
    core = KubeClient().core
    (token,) = [v.removeprefix("Bearer ").strip() for v in core.api_client.configuration.api_key.values()]
    secret = cloud.ecs["access_key_secret"]
    assert len(token) > 20 and len(secret) > 20
    line = f"calling with token={token} and key secret {secret}"
    assert redact(line) == "calling with token=*** and key secret ***"


def test_the_endpoint_url_sets_the_protocol_and_contradictions_are_refused():
    assert endpoint_settings("c", {"endpoint": "http://127.0.0.1:8080"}) == ("127.0.0.1:8080", "http")
    assert endpoint_settings("c", {"endpoint": "ecs.example:443", "protocol": "https"}) == ("ecs.example:443", "https")
    with pytest.raises(ValueError, match=r"extra.protocol 'https' contradicts extra.endpoint's scheme 'http'"):
        endpoint_settings("c", {"endpoint": "http://h:1", "protocol": "https"})
    with pytest.raises(ValueError, match=r"extra.endpoint must be host"):
        endpoint_settings("c", {"endpoint": "ftp://h:1"})
