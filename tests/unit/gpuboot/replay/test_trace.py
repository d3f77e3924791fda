"""Reading the trace and the replay command, on a tiny synthetic trace in tmp_path."""
import json

import pytest

from gpuboot.replay import cli, trace

NODES = """sn,cpu_milli,memory_mib,gpu,model
node-0,16000,65536,2,T4
node-1,8000,32768,1,V100M16
node-2,96000,393216,8,G2
"""
PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p-full,4000,8192,1,1000,,LS,Running,0,400,10
p-shared,2000,4096,1,460,,BE,Failed,100,300,100
p-cpu,1000,1024,0,0,,BE,Succeeded,150,200,150
p-pending,1000,1024,1,1000,,BE,Pending,200,900,
p-gang,8000,16384,8,1000,,LS,Running,300,5000,300
p-late,1000,1024,1,1000,,LS,Running,9000,9500,9000
p-spec,1000,1024,1,1000,V100M16|V100M32,LS,Running,400,800,400
"""


@pytest.fixture
def trace_dir(tmp_path):
    (tmp_path / trace.NODE_FILE).write_text(NODES)
    (tmp_path / trace.POD_FILE).write_text(PODS)
    return tmp_path


def test_jobs_in_window_with_skips_counted_and_fractional_gpus_as_one(trace_dir):
    loaded = trace.load_jobs(trace_dir, start=0, end=1000)
    assert [j.name for j in loaded.jobs] == ["p-full", "p-shared", "p-gang", "p-spec"]
    full, shared, gang, _ = loaded.jobs
    assert (full.arrival, full.run_seconds, full.gpus) == (0, 390, 1)   # deletion - scheduled
    assert shared.gpus == 1 and shared.fractional
    assert gang.requests.to_k8s() == {"cpu": "8", "memory": "16Gi", "nvidia.com/gpu": "8"}
    assert loaded.fractional == 1
    assert sum(loaded.skipped.values()) == 2   # the CPU-only pod and the never-scheduled one
    assert any("CPU-only" in reason for reason in loaded.skipped)
    assert [j.name for j in trace.load_jobs(trace_dir, 0, 1000, include_cpu_only=True).jobs].count("p-cpu") == 1


def test_fleet_first_or_seeded_sample_and_gpu_model_labels(trace_dir):
    assert [n.name for n in trace.load_fleet(trace_dir, 2, "first")] == ["node-0", "node-1"]
    assert trace.load_fleet(trace_dir, 2, "random", seed=3) == trace.load_fleet(trace_dir, 2, "random", seed=3)
    nodes = {n.name: n for n in trace.load_fleet(trace_dir)}
    assert nodes["node-0"].gpu_model == "Tesla-T4"
    assert nodes["node-2"].capacity.to_k8s() == {"cpu": "96", "memory": "384Gi", "nvidia.com/gpu": "8"}


def test_gpu_spec_lists_the_models_a_pod_accepts(trace_dir):
    """Issue 13: the trace's per-pod gpu_spec ('V100M16|V100M32') is read, not ignored."""
    loaded = trace.load_jobs(trace_dir, start=0, end=1000)
    jobs = {j.name: j for j in loaded.jobs}
    assert jobs["p-spec"].gpu_models == ("V100M16", "V100M32") and jobs["p-full"].gpu_models == ()
    assert loaded.gpu_spec == 1
    fleet = {n.name: n for n in trace.load_fleet(trace_dir)}
    assert jobs["p-spec"].accepts(fleet["node-1"]) and not jobs["p-spec"].accepts(fleet["node-0"])
    assert all(jobs["p-full"].accepts(n) for n in fleet.values())


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("15m", 900), ("6h", 21600), ("1.5d", 129600)])
def test_durations(text, seconds):
    assert trace.parse_duration(text, "--x") == seconds


def test_bad_options_name_the_option():
    with pytest.raises(trace.TraceError, match=r"--idle-timeout.*e.g. 90s"):
        trace.parse_duration("ten minutes", "--idle-timeout")
    with pytest.raises(trace.TraceError, match="pass --trace"):
        trace.find_trace_dir("/nonexistent")


def test_command_writes_summary_and_plot_and_prints_the_table(trace_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["--trace", str(trace_dir), "--end", "1000", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [p["policy"] for p in summary["policies"]] == ["always-on", "queue-time", "allocate-time", "gpuboot-noqueue",
                                                           "gpuboot"]
    assert summary["jobs"]["replayed"] == 4 and summary["jobs"]["fractional_gpu_as_one"] == 1
    assert summary["jobs"]["gpu_spec"] == 1
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "gpuboot" in printed and "wasted boots" in printed


def test_unknown_policy_is_a_clear_error(trace_dir, tmp_path, capsys):
    assert cli.main(["--trace", str(trace_dir), "--policies", "gpuboot,fastest", "--out", str(tmp_path)]) == 2
    assert "--policies: unknown fastest" in capsys.readouterr().err


def test_gpu_sharing_variants_keep_only_whole_or_only_shared_gpu_pods(trace_dir):
    def names(share):
        return [j.name for j in trace.load_jobs(trace_dir, 0, 1000, gpu_share=share).jobs]

    assert names("shared") == ["p-shared"]
    assert names("whole") == ["p-full", "p-gang", "p-spec"]
    assert names("all") == ["p-full", "p-shared", "p-gang", "p-spec"]
    with pytest.raises(trace.TraceError, match=r"gpu share: 'half'.*all, whole, shared"):
        trace.load_jobs(trace_dir, gpu_share="half")


def test_gpu_model_variant_pins_a_share_of_free_jobs_to_one_model_of_the_fleet_that_holds_them(trace_dir):
    fleet = trace.load_fleet(trace_dir)
    jobs = trace.load_jobs(trace_dir, 0, 1000).jobs
    assert trace.pin_gpu_models(jobs, fleet, 0.0) == jobs
    pinned = {j.name: j for j in trace.pin_gpu_models(jobs, fleet, 1.0)}
    assert pinned["p-spec"].gpu_models == ("V100M16", "V100M32")         # the trace's own gpu_spec is kept
    assert pinned["p-gang"].gpu_models == ("G2",)                         # only the G2 node holds 8 GPUs
    for name in ("p-full", "p-shared"):
        (model,) = pinned[name].gpu_models
        assert any(n.model == model and pinned[name].requests.fits_in(n.capacity) for n in fleet)
    assert trace.pin_gpu_models(jobs, fleet, 1.0) == list(pinned.values())    # deterministic
    with pytest.raises(trace.TraceError, match=r"gpu-model share: 1\.5 must be between 0 and 1"):
        trace.pin_gpu_models(jobs, fleet, 1.5)
