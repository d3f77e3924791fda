"""The sweep command: policies x idle timeouts x boot delays, as JSON and a cost-vs-wait scatter."""
import json

import pytest

from gpuboot.replay import sweep
from tests.unit.gpuboot.replay.test_trace import trace_dir  # noqa: F401


def test_boot_delay_is_split_like_the_default_phases():
    assert sweep.phases(300) == {"start_seconds": 120.0, "boot_seconds": 120.0, "device_plugin_seconds": 60.0}


def test_sweep_writes_every_point_and_the_scatter(trace_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert sweep.main(["--trace", str(trace_dir), "--end", "1000", "--out", str(out), "--idle-timeouts", "1m,10m",
                       "--boot-delays", "30,150", "--policies", "allocate-time,gpuboot"]) == 0
    result = json.loads((out / "sweep.json").read_text())
    points = {(p["policy"], p["idle_timeout"], p["boot_delay"]): p for p in result["points"]}
    assert sorted(points) == sorted((policy, idle, boot) for policy in ("allocate-time", "gpuboot")
                                    for idle in (60.0, 600.0) for boot in (30.0, 150.0))
    for p in points.values():
        assert p["billed_cost"] >= p["lower_bound_cost"] > 0
    # a longer boot makes the first job wait longer; a longer idle timeout never bills less
    assert points["gpuboot", 60.0, 150.0]["wait_mean_seconds"] > points["gpuboot", 60.0, 30.0]["wait_mean_seconds"]
    assert points["gpuboot", 600.0, 30.0]["billed_cost"] >= points["gpuboot", 60.0, 30.0]["billed_cost"]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "idle s" in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--idle-timeouts", "--boot-delays"])
def test_bad_lists_name_the_option(trace_dir, tmp_path, capsys, option):
    assert sweep.main(["--trace", str(trace_dir), "--out", str(tmp_path), option, "soon"]) == 2
    assert option in capsys.readouterr().err


def test_spares_put_gpuboot_at_each_spare_beside_the_baselines_run_once(trace_dir, tmp_path):
    out = tmp_path / "out"
    assert sweep.main(["--trace", str(trace_dir), "--end", "1000", "--out", str(out), "--idle-timeouts", "1m",
                       "--boot-delays", "150", "--policies", "allocate-time,gpuboot", "--spares", "0,1h",
                       "--no-plot"]) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert sorted(p["policy"] for p in result["points"]) == ["allocate-time", "gpuboot, spare 0h", "gpuboot, spare 1h"]
    assert result["spares"] == [0.0, 3600.0]
