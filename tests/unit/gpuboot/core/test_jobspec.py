"""Job specs: each mistake rejected early with the field named; valid specs round-trip."""
import jsonschema
import pytest

from gpuboot.core.jobspec import (
    FORM_MAIN_FIELDS,
    JOB_NAMESPACES_ENV,
    KNOWN_GPU_MODELS,
    JobSpec,
    JobSpecError,
    check_known_fields,
    field_errors,
    form_fields,
    job_namespaces,
    params_schema,
)
from gpuboot.core.resources import GPU, Resources

BASE = {"name": "train", "image": "pytorch/pytorch:2.3", "command": ["python", "train.py"]}


def spec(**changes):
    return {**BASE, **changes}


def test_minimal_spec_gets_defaults():
    s = JobSpec.from_dict(BASE)
    assert s.gpus == 1 and s.cpu == "1" and s.memory == "4Gi" and s.namespace == "gpu-jobs"
    assert s.replicas == 1 and s.min_available is None and s.gpu_model == ()
    assert s.requests() == Resources.parse({"cpu": "1", "memory": "4Gi", GPU: 1})


def test_queue_fields_default_so_todays_jobs_run_unchanged_and_the_runtime_reaches_placement():
    s = JobSpec.from_dict(BASE)
    assert (s.team, s.priority_class, s.preemptible, s.expected_runtime_seconds) == ("default", "normal", False, None)
    given = JobSpec.from_dict(spec(team="vision", priority_class="high", preemptible=True,
                                   expected_runtime_seconds=600))
    assert JobSpec.from_dict(given.to_dict()) == given
    assert given.to_job_request("j").expected_run_seconds == 600
    with pytest.raises(JobSpecError, match=r"priority_class: 'urgent' is not a priority class\. Use one of 'low'"):
        JobSpec.from_dict(spec(priority_class="urgent"))


def test_command_string_is_shell_split():
    s = JobSpec.from_dict(spec(command="python train.py --name 'my run'", args="--epochs 3"))
    assert s.command == ("python", "train.py", "--name", "my run")
    assert s.args == ("--epochs", "3")


FULL = spec(args=["--epochs", "3"], env={"EPOCHS": "3", "SEED": 7}, gpus=2, cpu="3500m", memory="1.5Gi",
            gpu_model="Tesla-T4", namespace="gpu-jobs", replicas=4, min_available=2,
            node_selector={"pool": "gpu"}, tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            queue_timeout_seconds=60, boot_timeout_seconds=300, settle_seconds=0, reservation_ttl_seconds=600,
            extra_resources={"example.com/fpga": 1}, allow_gpu_nodes=True)


def test_round_trip_through_json_types():
    import json
    s = JobSpec.from_dict(FULL)
    d = s.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert JobSpec.from_dict(d) == s
    assert s.env == {"EPOCHS": "3", "SEED": "7"}


def test_to_job_request_names_tasks_and_gang_size():
    s = JobSpec.from_dict(FULL)
    job = s.to_job_request("run-1")
    assert [t.name for t in job.tasks] == ["train-0", "train-1", "train-2", "train-3"]
    assert job.min_available == 2
    t = job.tasks[0]
    assert t.requests == Resources.parse({"cpu": "3500m", "memory": "1.5Gi", GPU: 2, "example.com/fpga": 1})
    assert t.gpu_model == ("Tesla-T4",) and dict(t.node_selector) == {"pool": "gpu"}
    single = JobSpec.from_dict(BASE).to_job_request("r")
    assert [t.name for t in single.tasks] == ["train"] and single.min_available == 1
    gang = JobSpec.from_dict(spec(replicas=3)).to_job_request("r")
    assert gang.min_available == 3


@pytest.mark.parametrize("changes, field", [
    ({"image": ""}, "image"),
    ({"image": None}, "image"),
    ({"image": "bad image"}, "image"),
    ({"command": []}, "command"),
    ({"command": ""}, "command"),
    ({"command": 5}, "command"),
    ({"gpus": -1}, "gpus"),
    ({"gpus": 1.5}, "gpus"),
    ({"gpus": "two"}, "gpus"),
    ({"gpus": True}, "gpus"),
    ({"cpu": "lots"}, "cpu"),
    ({"cpu": "-1"}, "cpu"),
    ({"cpu": 0}, "cpu"),
    ({"memory": "16GB"}, "memory"),
    ({"extra_resources": {"fpga": 1}}, "extra_resources.fpga"),
    ({"extra_resources": {"example/fpga": 1}}, "extra_resources.example/fpga"),
    ({"extra_resources": {"example.com/fpga": "0.5"}}, "extra_resources.example.com/fpga"),
    ({"extra_resources": {"nvidia.com/gpu": 1}}, "extra_resources.nvidia.com/gpu"),
    ({"namespace": "My_NS"}, "namespace"),
    ({"namespace": "-ns"}, "namespace"),
    ({"namespace": "kube-system"}, "namespace"),
    ({"namespace": ""}, "namespace"),
    ({"name": "Train"}, "name"),
    ({"name": "x" * 64}, "name"),
    ({"name": "x" * 62, "replicas": 2}, "name"),
    ({"replicas": 0}, "replicas"),
    ({"min_available": 3, "replicas": 2}, "min_available"),
    ({"min_available": 0}, "min_available"),
    ({"queue_timeout_seconds": 0}, "queue_timeout_seconds"),
    ({"boot_timeout_seconds": 8 * 24 * 3600}, "boot_timeout_seconds"),
    ({"reservation_ttl_seconds": -5}, "reservation_ttl_seconds"),
    ({"settle_seconds": 601}, "settle_seconds"),
    ({"settle_seconds": -1}, "settle_seconds"),
    ({"gpu_model": "Voodoo5"}, "gpu_model"),
    ({"gpu_model": 4}, "gpu_model"),
    ({"gpu_model": ["V100M16", "Voodoo5"]}, "gpu_model[1]"),
    ({"gpu_model": ["T4", 4]}, "gpu_model[1]"),
    ({"gpu_model": ["T4", ""]}, "gpu_model[1]"),
    ({"gpu_model": "V100M16|"}, "gpu_model"),
    ({"gpu_model": "T4|Voodoo5"}, "gpu_model"),
    ({"gpu_model": {"T4": 1}}, "gpu_model"),
    ({"node_selector": {"pool": "a b"}}, "node_selector.pool"),
    ({"tolerations": [{"key": "gpu", "operator": "Maybe"}]}, "tolerations[0].operator"),
    ({"tolerations": [{"key": "gpu", "effect": "Sometimes"}]}, "tolerations[0].effect"),
    ({"env": {"1BAD": "x"}}, "env.1BAD"),
    ({"gpu": 1}, "gpu"),
    ({"allow_gpu_nodes": "maybe"}, "allow_gpu_nodes"),
    ({"team": "Vision Team"}, "team"),
    ({"priority_class": "urgent"}, "priority_class"),
    ({"preemptible": "sometimes"}, "preemptible"),
    ({"expected_runtime_seconds": 0}, "expected_runtime_seconds"),
])
def test_catalogue_of_mistakes_names_the_field(changes, field):
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(spec(**changes), source="dags/train.yaml")
    assert err.value.field == field
    assert err.value.source == "dags/train.yaml"
    text = str(err.value)
    assert text.startswith(f"dags/train.yaml: {field}: ")
    assert text == f"dags/train.yaml: {field}: {err.value.problem}. {err.value.fix}"
    assert err.value.fix


def test_missing_required_field():
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict({"name": "x", "image": "i"})
    assert err.value.field == "command" and "required" in str(err.value)


def test_unknown_field_suggests_the_close_one():
    with pytest.raises(JobSpecError, match="Did you mean 'gpus'"):
        JobSpec.from_dict(spec(gpu=1))


def test_unknown_field_check_knows_the_callers_own_keys():
    """The YAML loader adds its DAG keys (schedule, ...) to the same check and keeps the hint."""
    check_known_fields({"schedule": "@daily", **BASE}, "x.yaml", also=["schedule"])
    with pytest.raises(JobSpecError, match=r"^x.yaml: shedule: unknown field. Did you mean 'schedule'\?$"):
        check_known_fields({"shedule": "@daily"}, "x.yaml", also=["schedule"])
    with pytest.raises(JobSpecError, match=r"^x.yaml: gpu: unknown field. Did you mean 'gpus'\?$"):
        check_known_fields({"gpu": 1}, "x.yaml", also=["schedule"])


def test_gpu_model_spellings_accepted():
    for model in ("T4", "Tesla-T4", "NVIDIA T4", "nvidia-a100-sxm4-80gb", "A10", ""):
        JobSpec.from_dict(spec(gpu_model=model))
    assert JobSpec.from_dict(spec(gpu_model="")).gpu_model == ()
    assert {"T4", "A10", "V100", "P100", "P4", "A100", "L20", "H20"} <= set(KNOWN_GPU_MODELS)


def test_gpu_model_any_of_a_list_or_the_trace_spelling():
    """A job may accept several models: a list, or 'A|B' as the openb trace's gpu_spec writes it;
    each is checked, kept as written, once, in order, and reaches every task of the job."""
    for value in (["V100M16", "V100M32"], "V100M16|V100M32", " V100M16 | V100M32 ", ("V100M16", "V100M32", "V100M16")):
        assert JobSpec.from_dict(spec(gpu_model=value)).gpu_model == ("V100M16", "V100M32")
    assert JobSpec.from_dict(spec(gpu_model="T4")).gpu_model == ("T4",)
    assert JobSpec.from_dict(spec(gpu_model=[])).gpu_model == ()
    s = JobSpec.from_dict(spec(gpu_model=["A10", "V100-16GB"], replicas=2))
    assert JobSpec.from_dict(s.to_dict()) == s and s.to_dict()["gpu_model"] == ["A10", "V100-16GB"]
    assert {t.gpu_model for t in s.to_job_request("r").tasks} == {("A10", "V100-16GB")}


def test_gpu_model_errors_name_the_entry_and_the_fix():
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(spec(gpu_model=["V100M16", "V100M"]))
    assert str(err.value).startswith("job spec: gpu_model[1]: 'V100M' is not a GPU model ECS offers. Use one of T4,")
    assert "'V100M16'" in err.value.fix
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(spec(gpu_model="V100M16||V100M32"))
    assert err.value.field == "gpu_model" and "empty model name" in err.value.problem and "'|'" in err.value.fix


def test_cpu_only_jobs_avoid_gpu_nodes_unless_they_allow_them():
    assert JobSpec.from_dict(spec(gpus=0, cpu="40")).to_job_request("r").tasks[0].avoid_gpu_nodes
    assert not JobSpec.from_dict(spec(gpus=0, allow_gpu_nodes="true")).to_job_request("r").tasks[0].avoid_gpu_nodes
    assert not JobSpec.from_dict(spec(gpus=1)).to_job_request("r").tasks[0].avoid_gpu_nodes


def test_a_boot_timeout_shorter_than_a_boot_plus_the_settle_window_is_refused(monkeypatch):
    """Issue 9: boot_timeout_seconds 1 with settle_seconds 5 was accepted, so every boot timed out
    and marked a healthy node unavailable for everyone."""
    monkeypatch.delenv("GPUBOOT_MIN_BOOT_SECONDS", raising=False)
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(spec(boot_timeout_seconds=1, settle_seconds=5))
    assert err.value.field == "boot_timeout_seconds"
    assert str(err.value) == ("job spec: boot_timeout_seconds: 1s is shorter than a boot can take: 60s for the node "
                              "to start and register its GPUs plus settle_seconds=5. Use at least 65 (or a smaller "
                              "settle_seconds)")
    assert JobSpec.from_dict(spec(boot_timeout_seconds=65, settle_seconds=5)).boot_timeout_seconds == 65
    form = params_schema()["boot_timeout_seconds"]["schema"]        # the form refuses what it can alone
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(59, form)
    jsonschema.validate(60, form)


def test_the_boot_minimum_can_be_lowered_for_a_faster_cloud(monkeypatch):
    monkeypatch.setenv("GPUBOOT_MIN_BOOT_SECONDS", "3")
    assert JobSpec.from_dict(spec(boot_timeout_seconds=4, settle_seconds=1)).boot_timeout_seconds == 4
    with pytest.raises(JobSpecError, match="Use at least 4 "):
        JobSpec.from_dict(spec(boot_timeout_seconds=3, settle_seconds=1))
    assert params_schema()["boot_timeout_seconds"]["schema"]["exclusiveMinimum"] == 2     # i.e. at least 3
    monkeypatch.setenv("GPUBOOT_MIN_BOOT_SECONDS", "soon")
    with pytest.raises(ValueError, match="GPUBOOT_MIN_BOOT_SECONDS='soon'"):
        JobSpec.from_dict(BASE)


ARG_LIMIT = 131071     # bytes in one argument or NAME=value string (MAX_ARG_STRLEN less the NUL)


@pytest.mark.parametrize("changes, field", [
    ({"args": ["--data", "x" * 200_000]}, "args[1]"),                      # issue 9: a 200 KB argument
    ({"command": ["python", "-c", "é" * 70_000]}, "command[2]"),            # 140,000 bytes in 70,000 characters
    ({"env": {"BLOB": "x" * (ARG_LIMIT - 4)}}, "env.BLOB"),                 # BLOB=... is one byte too long
    ({"args": ["x" * 100_000] * 6}, "command+args+env"),                    # each fine, 600 KB together
])
def test_container_arguments_and_env_no_exec_can_take_are_refused(changes, field):
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(spec(**changes))
    assert err.value.field == field and "file" in err.value.fix


def test_container_arguments_up_to_the_limits_are_accepted():
    JobSpec.from_dict(spec(args=["x" * ARG_LIMIT], env={"BLOB": "x" * (ARG_LIMIT - 5)}))
    JobSpec.from_dict(spec(args=["x" * 100_000] * 5))


def test_the_form_refuses_an_argument_over_the_limit_at_trigger_time():
    form = params_schema()
    for key in ("command", "args"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(["python", "x" * 200_000], form[key]["schema"])
        jsonschema.validate(["python", "x" * ARG_LIMIT], form[key]["schema"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"BLOB": "x" * 200_000}, form["env"]["schema"])


def test_string_integers_from_templates_are_accepted():
    assert JobSpec.from_dict(spec(gpus="2", replicas="3")).gpus == 2


def test_params_schema_covers_every_field_with_valid_defaults():
    schema = params_schema()
    assert set(schema) == set(JobSpec.__dataclass_fields__)
    for key, entry in schema.items():
        jsonschema.Draft7Validator.check_schema(entry["schema"])
        if entry["default"] is not None:
            jsonschema.validate(entry["default"], entry["schema"])
            assert JobSpec.from_dict(spec(**{key: entry["default"]})) is not None


@pytest.mark.parametrize("key, value", [
    ("gpus", 2), ("gpus", -1), ("gpus", 1.5), ("gpus", "x"),
    ("cpu", "500m"), ("cpu", "2"), ("cpu", "lots"), ("cpu", "-1"), ("cpu", "0"),
    ("memory", "16Gi"), ("memory", "16GB"),
    ("namespace", "ml"), ("namespace", "My_NS"), ("namespace", "gpu-jobs"), ("namespace", "kube-system"),
    ("namespace", ""), ("name", "Train"), ("name", "train"),
    ("replicas", 0), ("replicas", 2), ("settle_seconds", 601), ("settle_seconds", 0),
    ("queue_timeout_seconds", 0), ("boot_timeout_seconds", 10**7), ("boot_timeout_seconds", 60),
    ("gpu_model", "T4"), ("gpu_model", "Voodoo5"), ("gpu_model", None),
    ("command", []), ("command", ["python"]), ("command", "python x.py"),
    ("image", ""), ("image", "a/b:c"),
    ("allow_gpu_nodes", True), ("allow_gpu_nodes", "maybe"),
    ("team", "vision"), ("team", "Vision"), ("priority_class", "high"), ("priority_class", "urgent"),
    ("preemptible", True), ("expected_runtime_seconds", 3600), ("expected_runtime_seconds", 0),
    ("boot_fill_from_load", 4), ("boot_fill_from_load", 0), ("boot_fill_from_load", -1), ("boot_fill_from_load", 65),
    ("boot_fill_from_load", 1.5),
])
def test_params_schema_agrees_with_from_dict(key, value):
    entry = params_schema()[key]
    try:
        jsonschema.validate(value, entry["schema"])
        schema_ok = True
    except jsonschema.ValidationError:
        schema_ok = False
    try:
        JobSpec.from_dict(spec(**{key: value}))
        spec_ok = True
    except JobSpecError:
        spec_ok = False
    assert schema_ok == spec_ok


def test_specs_and_job_requests_survive_deepcopy_pickle_and_json():
    """Airflow deep-copies operators and pickles/serializes their arguments."""
    import copy
    import json
    import pickle
    s = JobSpec.from_dict(FULL)
    assert copy.deepcopy(s) == s and pickle.loads(pickle.dumps(s)) == s
    req = s.to_job_request("job-1")
    assert copy.deepcopy(req) == req and pickle.loads(pickle.dumps(req)) == req
    assert json.loads(json.dumps(s.env)) == {"EPOCHS": "3", "SEED": "7"}
    with pytest.raises(TypeError, match="read-only"):
        s.env["X"] = "1"  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        req.tasks[0].node_selector.update({"x": "y"})  # type: ignore[attr-defined]


# -- the job namespaces (GPUBOOT_JOB_NAMESPACES) ---------------------------------------------

def test_jobs_run_only_in_the_configured_namespaces_the_first_by_default(monkeypatch):
    monkeypatch.delenv(JOB_NAMESPACES_ENV, raising=False)
    assert job_namespaces() == ("gpu-jobs",)
    assert params_schema()["namespace"]["schema"]["enum"] == ["gpu-jobs"]
    with pytest.raises(JobSpecError) as err:
        JobSpec.from_dict(spec(namespace="kube-system"), source="dags/jobs/x.yaml")
    assert str(err.value) == (
        "dags/jobs/x.yaml: namespace: 'kube-system' is not a namespace gpuboot runs jobs in. Use 'gpu-jobs' "
        "('gpu-jobs' when left out); an administrator adds namespaces to GPUBOOT_JOB_NAMESPACES and grants "
        "gpuboot a Role there (deploy/kubernetes/rbac.yaml)")
    monkeypatch.setenv(JOB_NAMESPACES_ENV, " team-a, gpu-jobs ,team-a,")
    assert job_namespaces() == ("team-a", "gpu-jobs")
    assert JobSpec.from_dict(BASE).namespace == "team-a"
    assert JobSpec.from_dict(spec(namespace="gpu-jobs")).namespace == "gpu-jobs"
    entry = params_schema()["namespace"]
    assert entry["default"] == "team-a" and entry["schema"]["enum"] == ["team-a", "gpu-jobs"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("kube-system", entry["schema"])
    with pytest.raises(JobSpecError, match="Use 'team-a' or 'gpu-jobs'"):
        JobSpec.from_dict(spec(namespace="default"))


@pytest.mark.parametrize("raw", ["Team_A", "gpu-jobs,kube system", " , "])
def test_a_malformed_namespace_list_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(JOB_NAMESPACES_ENV, raw)
    with pytest.raises(ValueError, match=f"^{JOB_NAMESPACES_ENV}=.*use comma-separated DNS-1123 labels"):
        job_namespaces()


def test_field_errors_names_every_bad_field_at_once_with_the_validators_own_words():
    bad = spec(name="Bad_Name", gpus=-1, memory="lots", cpu="0", gpu_modle="T4")
    errors = field_errors(bad)
    assert set(errors) == {"name", "gpus", "memory", "cpu", "gpu_modle"}
    for key, message in errors.items():       # the message from_dict gives when that field alone is wrong
        alone = {**BASE, key: bad[key]}
        with pytest.raises(JobSpecError) as raised:
            JobSpec.from_dict(alone, "job form")
        assert message == f"{raised.value.problem}. {raised.value.fix}", key
    assert "Did you mean 'gpu_model'?" in errors["gpu_modle"]


def test_field_errors_of_a_valid_spec_is_empty_and_the_input_is_untouched():
    good = spec(gpus=2, env={"EPOCHS": "3"})
    before = dict(good)
    assert field_errors(good) == {} and good == before
    assert field_errors({**good, "gpus": -1}) and good == before


def test_field_errors_checks_the_other_fields_while_a_required_one_is_missing_or_bad():
    assert set(field_errors({})) == {"name", "image", "command"}
    assert set(field_errors({"name": "Bad_Name", "gpus": "two"})) == {"name", "image", "command", "gpus"}


def test_field_errors_keeps_cross_field_rules_on_the_field_they_name():
    errors = field_errors(spec(replicas=2, min_available=5, settle_seconds=5, boot_timeout_seconds=1))
    assert set(errors) == {"min_available", "boot_timeout_seconds"}
    assert "between 1 and 2" in errors["min_available"]
    nested = field_errors(spec(env={"A B": "x"}, tolerations=[{"effect": "Bad"}]))
    assert set(nested) == {"env", "tolerations"}      # env.A B and tolerations[0].effect, by top-level field


def test_form_fields_put_the_main_fields_first_and_mark_only_name_image_command_required():
    fields = form_fields()
    assert [f["key"] for f in fields][:len(FORM_MAIN_FIELDS)] == list(FORM_MAIN_FIELDS)
    assert {f["key"] for f in fields} == set(params_schema())
    assert {f["key"] for f in fields if f["required"]} == {"name", "image", "command"}
    assert all(f["main"] == (f["key"] in FORM_MAIN_FIELDS) for f in fields)


def test_env_values_are_withheld_from_the_view_passed_on_and_secret_references_are_checked():
    from gpuboot.core.jobspec import ENV_WITHHELD

    base = {"name": "train", "image": "i", "command": ["true"]}
    spec = JobSpec.from_dict({**base, "env": {"TOKEN": "s3cr3t-value"}, "secret_env": {"HF": "hf-token/token"},
                              "env_from_secrets": "wandb"})
    shown = spec.to_dict(env_values=False)
    assert shown["env"] == {"TOKEN": ENV_WITHHELD} and "s3cr3t-value" not in str(shown)
    again = JobSpec.from_dict(shown)
    assert again.env_withheld and not spec.env_withheld and again.secret_env == {"HF": "hf-token/token"}
    assert spec.env_from_secrets == ("wandb",) and spec.env_names() == ("TOKEN", "HF")
    for bad, field, words in (({"secret_env": {"HF": "no-key"}}, "secret_env.HF", "'secret-name/key'"),
                              ({"secret_env": {"HF": "Bad_Name/k"}}, "secret_env.HF", "does not name a Secret"),
                              ({"env": {"HF": "x"}, "secret_env": {"HF": "a/b"}}, "secret_env.HF", "also set in env"),
                              ({"env_from_secrets": ["UPPER"]}, "env_from_secrets[0]", "is not a Secret name")):
        with pytest.raises(JobSpecError) as err:
            JobSpec.from_dict({**base, **bad})
        assert err.value.field == field and words in str(err.value), str(err.value)


def test_boot_fill_from_load_reaches_the_job_request_and_is_off_by_default():
    assert JobSpec.from_dict(spec()).to_job_request("j").boot_fill_from_load == 0
    request = JobSpec.from_dict(spec(boot_fill_from_load=4)).to_job_request("j")
    assert request.boot_fill_from_load == 4
    assert type(request).from_json(request.to_json()) == request          # the batch placer's form
    with pytest.raises(JobSpecError, match=r"boot_fill_from_load.*between 0 and 64"):
        JobSpec.from_dict(spec(boot_fill_from_load=100))
