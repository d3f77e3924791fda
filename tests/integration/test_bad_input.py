"""Bad input through the operators' own validation path: a malformed `job` mapping fails the
place step at once (AirflowFailException: no retry) naming the field, before anything is
reserved or booted. One local cloud serves the whole catalogue."""
from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from gpuboot.hooks.ecs import EcsHook
from gpuboot.hooks.kube import KubeClient
from gpuboot.lifecycle.ledger import CONFIGMAP
from gpuboot.operators.place import PlaceGpuJobOperator
from tests.integration.conftest import FLEET, SimCloud, expose_connections, with_job_namespaces
from tests.integration.test_operators import JOB, context

CATALOGUE = [
    ({"gpus": -1}, "gpus"),
    ({"gpus": "two"}, "gpus"),
    ({"extra_resources": {"fpga": 1}}, "extra_resources.fpga"),              # unknown resource name
    ({"extra_resources": {"nvidia.com/gpu": 1}}, "extra_resources.nvidia.com/gpu"),
    ({"memory": "16GB"}, "memory"),                                           # bad quantity
    ({"cpu": "lots"}, "cpu"),
    ({"image": ""}, "image"),                                                 # missing image
    ({"image": None}, "image"),
    ({"namespace": "Team_A"}, "namespace"),                                   # not a DNS label
    ({"boot_timeout_seconds": 8 * 24 * 3600}, "boot_timeout_seconds"),        # absurd timeouts
    ({"queue_timeout_seconds": 0}, "queue_timeout_seconds"),
    ({"settle_seconds": -1}, "settle_seconds"),
    ({"gpu_model": "Voodoo5"}, "gpu_model"),                                  # unknown GPU model
    ({"gpuz": 1}, "gpuz"),                                                    # unknown field
]


@pytest.fixture(scope="module")
def shared_cloud(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp, SimCloud.start(FLEET, tmp_path_factory.mktemp("bad-input")) as sim:
        with_job_namespaces(sim)
        expose_connections(sim.connections_file, mp)
        yield sim


@pytest.mark.parametrize(("change", "field"), CATALOGUE, ids=[f for _, f in CATALOGUE])
def test_malformed_job_fails_place_naming_the_field_and_reserves_nothing(shared_cloud, change, field):
    op = PlaceGpuJobOperator(task_id="place", job={**JOB, **change}, job_id="bad")
    with pytest.raises(AirflowFailException) as err:
        op.execute(context("place"))
    assert str(err.value).startswith(f"job: {field}: "), str(err.value)
    assert KubeClient().read_configmap("default", CONFIGMAP) is None       # no ledger write at all
    stopped = [shared_cloud.instance_id(n) for n in ("gpu-stop", "gpu2-stop")]
    assert set(EcsHook().statuses(stopped).values()) == {"Stopped"}        # nothing was booted


def test_bad_dag_run_params_name_their_source(shared_cloud):
    op = PlaceGpuJobOperator(task_id="place")            # job=None: the run's params are the job
    with pytest.raises(AirflowFailException, match=r"^DAG run params: gpus: "):
        op.execute(context("place", params={**JOB, "gpus": -2}))


TYPOS = {"gpu": 2, "gpu_modle": "A100", "memroy": "64Gi"}     # issue 9's trigger conf


def test_unknown_keys_in_dag_run_params_fail_place_with_the_likely_field_and_reserve_nothing(shared_cloud):
    """The gpu_job DAG declares exactly the JobSpec fields; a trigger conf key that is none of
    them was dropped before, so the job ran as 1 T4 GPU with 4Gi."""
    from dags.gpu_job import trigger_form

    op = PlaceGpuJobOperator(task_id="place", params=trigger_form())
    with pytest.raises(AirflowFailException) as err:
        op.execute(context("place", params={**JOB, **TYPOS}))
    assert str(err.value) == "DAG run params: gpu: unknown field. Did you mean 'gpus'?"
    assert KubeClient().read_configmap("default", CONFIGMAP) is None


def test_params_a_users_dag_declares_for_itself_are_not_job_fields_but_typos_still_fail():
    from gpuboot.operators.base import resolve_job

    declared = ["dataset", "name"]
    spec = resolve_job(None, {"params": {**JOB, "dataset": "imagenet"}}, declared=declared)
    assert spec.name == JOB["name"]
    with pytest.raises(AirflowFailException, match=r"memroy: unknown field. Did you mean 'memory'"):
        resolve_job(None, {"params": {**JOB, "dataset": "imagenet", "memroy": "64Gi"}}, declared=declared)


def test_a_namespace_outside_the_job_namespaces_fails_place_naming_the_field_before_anything_is_reserved(
        shared_cloud):
    op = PlaceGpuJobOperator(task_id="place", job={**JOB, "gpus": 2, "namespace": "kube-system"}, job_id="ns")
    with pytest.raises(AirflowFailException) as err:
        op.execute(context("place"))
    assert str(err.value).startswith("job: namespace: 'kube-system' is not a namespace gpuboot runs jobs in. "
                                     "Use 'gpu-jobs'")
    assert KubeClient().read_configmap("default", CONFIGMAP) is None
    stopped = [shared_cloud.instance_id(n) for n in ("gpu-stop", "gpu2-stop")]
    assert set(EcsHook().statuses(stopped).values()) == {"Stopped"}


def test_a_namespace_that_does_not_exist_fails_place_naming_it_before_anything_is_reserved(shared_cloud,
                                                                                          monkeypatch):
    monkeypatch.setenv("GPUBOOT_JOB_NAMESPACES", "gpu-jobs,team-nowhere")   # configured, never created
    op = PlaceGpuJobOperator(task_id="place", job={**JOB, "gpus": 2, "namespace": "team-nowhere"}, job_id="ns")
    with pytest.raises(AirflowFailException) as err:
        op.execute(context("place"))
    assert "namespace: 'team-nowhere' does not exist" in str(err.value)
    assert "kubectl create namespace team-nowhere" in str(err.value)
    assert KubeClient().read_configmap("default", CONFIGMAP) is None
    stopped = [shared_cloud.instance_id(n) for n in ("gpu-stop", "gpu2-stop")]
    assert set(EcsHook().statuses(stopped).values()) == {"Stopped"}


@pytest.mark.parametrize("kwargs", [{"max_boot_attempts": 0}, {"deferrable": False, "mode": "reschedule"}])
def test_sensor_arguments_that_cannot_work_are_refused_at_dag_parse_time(kwargs):
    from gpuboot.sensors.gpu_ready import GpuReadySensor

    with pytest.raises(ValueError, match=r"max_boot_attempts|reschedule"):
        GpuReadySensor(task_id="wait", baselines=[], **kwargs)


def test_a_namespace_without_gpuboots_role_fails_place_naming_the_rights_before_anything_is_reserved(
        shared_cloud, monkeypatch):
    """Configured and created but never given the Role gpuboot-jobs: as its ServiceAccount, the product
    would boot a node and meet a 403 at launch. The place step's access review refuses the job first."""
    shared_cloud.core_v1().create_namespace({"metadata": {"name": "team-b"}})
    monkeypatch.setenv("GPUBOOT_JOB_NAMESPACES", "gpu-jobs,team-b")
    expose_connections(shared_cloud.gpuboot_connections(), monkeypatch)       # act as the ServiceAccount
    op = PlaceGpuJobOperator(task_id="place", job={**JOB, "gpus": 2, "namespace": "team-b"}, job_id="rbac")
    with pytest.raises(AirflowFailException) as err:
        op.execute(context("place"))
    assert str(err.value).startswith("job train: namespace: gpuboot may not create pods, get pods, watch pods, patch pods, delete pods, "
                                     "get pods/log, list events, watch events in 'team-b'"), str(err.value)
    assert "gpuboot-jobs of deploy/kubernetes/rbac.yaml in team-b" in str(err.value)
    assert KubeClient().read_configmap("default", CONFIGMAP) is None
    stopped = [shared_cloud.instance_id(n) for n in ("gpu-stop", "gpu2-stop")]
    assert set(EcsHook().statuses(stopped).values()) == {"Stopped"}
