"""YAML job specs become scheduled DAGs; a malformed spec is an import error naming file and field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpuboot.task_groups.spec_dags import SpecFileError, load_spec_file
from tests.e2e.conftest import REPO

JOBS = REPO / "dags" / "jobs"
LOADER = (JOBS / "nightly_finetune.py").read_text()
GOOD = """\
schedule: "@daily"
image: python:3.11
command: python -c "print('hi')"
gpus: 1
"""


def dagbag(folder: Path):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(folder), safe_mode=True)


def write_job(folder: Path, stem: str, yaml_text: str) -> None:
    (folder / f"{stem}.yaml").write_text(yaml_text)
    (folder / f"{stem}.py").write_text(LOADER)


def test_repo_dags_folder_loads_without_import_errors():
    bag = dagbag(REPO / "dags")
    assert bag.import_errors == {}
    assert "gpu_job" in bag.dags
    assert bag.dags["gpu_job"].schedule is None
    nightly = bag.dags["nightly-finetune"]
    assert nightly.schedule == "0 2 * * *"
    assert nightly.timetable.can_be_scheduled
    assert {"gpuboot", "nightly"} <= set(nightly.tags)
    assert {t.task_id.rsplit(".", 1)[-1] for t in nightly.tasks} >= {"place", "start", "wait_gpu_ready", "launch"}
    assert bag.dags["weekly-eval"].schedule == "@weekly"


def test_every_shipped_spec_has_its_loader_and_vice_versa():
    specs = {p.stem for p in JOBS.glob("*.y*ml")}
    loaders = {p.stem for p in JOBS.glob("*.py")}
    assert specs and specs == loaders


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        (GOOD.replace("gpus: 1", "gpus: -2"), "gpus"),
        (GOOD.replace('"@daily"', '"every day at noon"'), "schedule"),
        (GOOD.replace('schedule: "@daily"\n', ""), "schedule"),
        (GOOD + "shedule: '@hourly'\n", "shedule"),
        (GOOD.replace("image: python:3.11\n", ""), "image"),
        (GOOD + "start_date: next tuesday\n", "start_date"),
        (GOOD + "tags: nightly\n", "tags"),
    ],
)
def test_bad_spec_is_an_import_error_naming_file_and_field_and_others_still_load(tmp_path, yaml_text, field):
    write_job(tmp_path, "good_job", GOOD)
    write_job(tmp_path, "bad_job", yaml_text)

    bag = dagbag(tmp_path)

    assert "good-job" in bag.dags, bag.import_errors
    assert "bad-job" not in bag.dags
    (path, error), = bag.import_errors.items()
    assert Path(path).name == "bad_job.py"
    assert str(tmp_path / "bad_job.yaml") in error
    assert f": {field}: " in error


def test_a_typo_in_a_yaml_job_field_gets_the_likely_field(tmp_path):
    """Issue 10: the loader's own unknown-key check ran first and lost JobSpec's hint."""
    spec = tmp_path / "typo.yaml"
    spec.write_text(GOOD.replace("gpus: 1", "gpu: 1"))
    with pytest.raises(ValueError) as caught:
        load_spec_file(spec)
    assert str(caught.value) == f"{spec}: gpu: unknown field. Did you mean 'gpus'?"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    spec = tmp_path / "broken.yaml"
    spec.write_text(GOOD + "command: [unclosed\n")
    with pytest.raises(SpecFileError) as caught:
        load_spec_file(spec)
    assert str(spec) in str(caught.value) and "line" in str(caught.value)


def test_name_defaults_to_the_file_name_and_spec_fields_pass_through(tmp_path):
    spec = tmp_path / "my_train.yml"
    spec.write_text(GOOD + "gpu_model: T4\ntags: [a]\nstart_date: 2024-06-01\n")
    loaded = load_spec_file(spec)
    assert loaded.job.name == "my-train"
    assert loaded.job.gpu_model is not None and loaded.job.gpus == 1
    assert (loaded.schedule, loaded.tags) == ("@daily", ("a",))
    assert loaded.start_date.isoformat() == "2024-06-01T00:00:00+00:00"


def test_shipped_examples_validate():
    for spec in JOBS.glob("*.yaml"):
        assert load_spec_file(spec).job.image


def test_loader_without_spec_says_what_is_missing(tmp_path):
    (tmp_path / "orphan.py").write_text(LOADER)
    bag = dagbag(tmp_path)
    (error,) = bag.import_errors.values()
    assert "orphan.yaml" in error


def test_dags_folder_copy_is_self_contained(tmp_path):
    """The loaders need nothing but gpuboot: a copied jobs folder loads on its own."""
    shutil.copytree(JOBS, tmp_path / "jobs")
    bag = dagbag(tmp_path)
    assert bag.import_errors == {}
    assert {"nightly-finetune", "weekly-eval"} <= set(bag.dags)


def test_shipped_nightly_job_runs_on_the_running_t4_without_booting_anything(cloud, connections, capfd):
    """The YAML path end to end: the 1-T4 nightly job fits the running T4 node, so nothing is started."""
    from tests.e2e.conftest import task_log

    dag = dagbag(JOBS).dags["nightly-finetune"]
    stopped_boot_ids = {n: cloud.core_v1().read_node(n).status.node_info.boot_id for n in ("t4-stopped", "t4x2-stopped")}

    dag_run = dag.test(conn_file_path=str(connections))
    output = capfd.readouterr().out

    assert dag_run.state == "success", output[-4000:]
    pods = [p for p in cloud.core_v1().list_pod_for_all_namespaces().items if (p.metadata.labels or {}).get("gpuboot.io/job")]
    assert [(p.spec.node_name, p.status.phase) for p in pods] == [("t4-running", "Succeeded")]
    assert {n: cloud.core_v1().read_node(n).status.node_info.boot_id for n in stopped_boot_ids} == stopped_boot_ids
    assert "finetune done" in task_log(output, dag_run, "launch")
