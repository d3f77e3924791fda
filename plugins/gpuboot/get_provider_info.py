"""What the installed `gpuboot` distribution tells Airflow's providers manager (the
`apache_airflow_provider` entry point), as providers do: its operators, sensor, triggers and
hooks by module, and the `gpuboot_ecs` connection type of EcsHook with its form (gpuboot's own name:
`alibaba_cloud` is apache-airflow-providers-alibaba's; see gpuboot.hooks.ecs.CONN_TYPE), declared as
data (`conn-fields`, `ui-field-behaviour`) so the UI lists the type without importing the hook.

The plugin itself (gpuboot.ui.plugin) is registered by the `airflow.plugins` entry point, not by
this info's `plugins` list: Airflow loads a provider's plugins only when
`[core] lazy_discover_providers` is off, while entry-point plugins load always.
"""
from __future__ import annotations

from typing import Any

PACKAGE = "gpuboot"
HOOK_CLASS = "gpuboot.hooks.ecs.EcsHook"
CONN_TYPE = "gpuboot_ecs"            # EcsHook.conn_type (a test keeps the two equal)
HOOK_NAME = "Alibaba Cloud ECS (gpuboot)"
ECS = "Alibaba Cloud ECS (gpuboot)"
JOBS = "GPU jobs on stopped ECS nodes (gpuboot)"
OPERATORS = ("place", "start", "launch", "release", "scaledown")
TRIGGERS = ("gpu_ready", "wake_up", "gang")

# The extra fields of the connection form (stored in the connection's extra under these names).
CONN_FIELDS: dict[str, dict[str, Any]] = {
    "region_id": {
        "label": "Region ID",
        "description": "The ECS region of the GPU nodes, e.g. cn-hangzhou (required).",
        "schema": {"type": ["string", "null"]},
    },
    "endpoint": {
        "label": "Endpoint",
        "description": "host[:port] of a private or local ECS endpoint, or its URL (http://host:port: the "
                       "scheme sets the protocol); empty for the public one.",
        "schema": {"type": ["string", "null"]},
    },
    "protocol": {
        "label": "Protocol",
        "description": "https (default) or http, for a local endpoint.",
        "schema": {"type": ["string", "null"], "enum": ["https", "http", None]},
    },
    "credential_mode": {
        "label": "Credential mode",
        "description": "static: the AccessKey pair in login/password (or extra access_key_id / "
                       "access_key_secret); default_chain: Alibaba Cloud's default credentials chain "
                       "(environment, RRSA OIDC token, ECS instance RAM role), login/password empty.",
        "schema": {"type": ["string", "null"], "enum": ["static", "default_chain", None], "default": "static"},
    },
}

UI_FIELD_BEHAVIOUR: dict[str, Any] = {
    "hidden-fields": ["host", "schema", "port"],
    "relabeling": {"login": "AccessKey ID", "password": "AccessKey secret"},
    "placeholders": {
        "login": "empty with credential mode default_chain",
        "password": "empty with credential mode default_chain",
        "region_id": "cn-hangzhou",
        "endpoint": "ecs-vpc.cn-hangzhou.aliyuncs.com (optional)",
        "credential_mode": "static",
    },
}


def get_provider_info() -> dict[str, Any]:
    """The provider info (airflow/provider_info.schema.json); the version is the distribution's."""
    return {
        "package-name": PACKAGE,
        "name": "gpuboot",
        "description": "GPU jobs on Kubernetes whose GPU nodes are Alibaba ECS instances kept stopped "
                       "while idle: the steps of a GPU job, the ECS hook and its connection type.",
        "integrations": [{"integration-name": ECS, "external-doc-url": "https://www.alibabacloud.com/help/en/ecs/",
                          "tags": ["alibaba"]},
                         {"integration-name": JOBS, "tags": ["software"]}],
        "operators": [{"integration-name": JOBS, "python-modules": [f"gpuboot.operators.{m}" for m in OPERATORS]}],
        "sensors": [{"integration-name": JOBS, "python-modules": ["gpuboot.sensors.gpu_ready"]}],
        "triggers": [{"integration-name": JOBS, "python-modules": [f"gpuboot.triggers.{m}" for m in TRIGGERS]}],
        "hooks": [{"integration-name": ECS, "python-modules": ["gpuboot.hooks.ecs"]}],   # kube wraps the cncf provider's
        "connection-types": [{
            "hook-class-name": HOOK_CLASS,
            "hook-name": HOOK_NAME,
            "connection-type": CONN_TYPE,
            "conn-fields": CONN_FIELDS,
            "ui-field-behaviour": UI_FIELD_BEHAVIOUR,
        }],
    }
