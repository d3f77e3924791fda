"""Issue 35 #3: two deployments with different ledger namespaces on the same nodes.

Before: each promised the same GPUs (neither reads the other's ledger), and one's scale-down stopped
a node the other had booked. Now the first booking of a node marks it with its ledger
(gpuboot.io/ledger), a booking through another ledger is refused before anything is written, and
a scale-down never stops a node booked through another ledger."""
from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.core.idle import IdleVerdict
from gpuboot.core.model import ANNOTATION_LEDGER
from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.ledger import ReservationLedger
from gpuboot.operators.place import PlaceGpuJobOperator
from tests.integration.test_operators import JOB, context, place
from tests.integration.test_scaledown import LATER, ScaleDown

TEAM_B = "team-b"
ONE_GPU = {**JOB, "gpus": 1}


def test_a_second_ledger_on_the_same_node_is_refused_and_its_scaledown_leaves_the_node_alone(cloud):
    from kubernetes import client

    cloud.core_v1().create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=TEAM_B)))
    plan, _ = place(ONE_GPU, job_id="a-1")                      # deployment A, ledger default/
    assert [a.get("node") for a in plan["assignments"]] == ["gpu-run"], plan["message"]
    annotations = KubeClient().get_node("gpu-run")["metadata"]["annotations"]
    assert annotations[ANNOTATION_LEDGER] == "default/gpuboot-reservations"

    b = PlaceGpuJobOperator(task_id="place", job=ONE_GPU, job_id="b-1", ledger_namespace=TEAM_B)
    with pytest.raises(AirflowFailException) as refused:        # deployment B would book the same GPU
        b.execute(context("place"))
    assert ("node gpu-run is booked through ledger default/gpuboot-reservations, this deployment's is "
            "team-b/gpuboot-reservations") in str(refused.value)
    assert "Give every deployment on these nodes the same ledger_namespace" in str(refused.value)
    assert [r for r in ReservationLedger(KubeClient(), TEAM_B).read()[0] if r.job_id == "b-1"] == []

    running = EcsHook().statuses([plan["assignments"][0]["instance_id"]])
    for offset in (0.0, LATER):                                 # idle-since recorded, then "an hour later"
        summary = ScaleDown(ledger_namespace=TEAM_B, offset=offset).execute(context("scale_down"))
    kept = summary["decisions"]["gpu-run"]
    assert kept["verdict"] == IdleVerdict.KEPT.value and "booked through ledger default/" in kept["reason"]
    assert "gpu-run" not in summary["stopped"]
    assert EcsHook().statuses(list(running)) == running         # still Running
