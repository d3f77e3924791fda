"""The pods launch would create are checked by the API server itself at place time (a dry run), so
a pod it refuses costs no boot: the place step fails at once, naming the job's field, with nothing
reserved and no instance started; launch fails at once, without retries, on a refusal no retry can
change (400/422), with the server's message and no HTTP headers."""
from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import InvalidRequest, KubeClient
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.launch import GpuPodOperator
from tests.integration.test_operators import JOB, context, place

LONG_VALUE = "v" * 64          # a label value: at most 63 characters


def instance_statuses(cloud) -> dict[str, str]:
    ids = [cloud.instance_id(n) for n in ("gpu-stop", "gpu2-stop")]
    return EcsHook().statuses(ids)


def test_a_pod_the_server_refuses_fails_place_before_anything_is_reserved_or_booted(cloud):
    before = instance_statuses(cloud)
    job = {**JOB, "gpus": 2, "tolerations": [{"key": "team", "operator": "Equal", "value": LONG_VALUE,
                                               "effect": "NoSchedule"}]}       # only a stopped node fits 2 GPUs
    with pytest.raises(AirflowFailException) as refused:
        place(job, job_id="refused")
    message = str(refused.value)
    assert "the API server refuses the pod launch would create (422)" in message
    # the real API server (v1.37) names the toleration's `operator` for a bad value, and says bytes
    assert "spec.tolerations[0].operator" in message and "must be no more than 63 bytes" in message
    assert "Fix the job's tolerations" in message
    assert "nothing was reserved or booted" in message and "HTTP response headers" not in message
    assert ReservationLedger(KubeClient()).live() == []
    assert instance_statuses(cloud) == before


def test_launch_fails_at_once_on_a_pod_the_server_refuses(cloud):
    plan, pushed = place({**JOB, "name": "ok"}, job_id="later-refused")
    job = {**pushed["job"], "tolerations": [{"key": "team", "operator": "Equal", "value": LONG_VALUE,
                                             "effect": "NoSchedule"}]}       # as if the spec changed after place
    with pytest.raises(AirflowFailException, match=r"refuses pod .* \(422\): .*spec.tolerations\[0\]"):
        GpuPodOperator(task_id="launch", job=job, plan=plan).execute(context("launch"))


def test_a_refusal_carries_the_servers_message_and_fields(cloud):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "Bad_Name"},
           "spec": {"containers": [{"name": "c", "image": "python:3.11"}]}}
    refused = KubeClient().refusal_of_pod("default", pod)
    assert isinstance(refused, InvalidRequest) and refused.status == 422 and "metadata.name" in refused.fields
    assert KubeClient().read_pod("default", "Bad_Name") is None
    good = {**pod, "metadata": {"name": "good-name"}}
    assert KubeClient().refusal_of_pod("default", good) is None
    assert KubeClient().read_pod("default", "good-name") is None       # a dry run stores nothing
