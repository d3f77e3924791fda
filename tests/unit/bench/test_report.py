"""The bench's side-by-side table: one row per headline figure, one column per Kubernetes backend."""
from bench import report

BURST = {"rows": [{"nodes": 1000, "jobs": 200, "placements_per_s": 22.9, "failed": 0}]}


def test_side_by_side_puts_each_backends_figure_in_its_column_and_marks_what_did_not_run():
    table = report.side_by_side({"simcloud": {"burst": BURST},
                                 "real": {"burst": {"rows": [{**BURST["rows"][0], "placements_per_s": 17.5}]},
                                          "gang": {"error": "RuntimeError: boom"}}})
    lines = table.splitlines()
    assert lines[0] == "== Side by side: the same parts on each Kubernetes backend"
    header = lines[1].split()
    assert header[-2:] == ["simcloud", "real"]
    placements = next(line for line in lines if "placements/s" in line)
    assert placements.split()[-2:] == ["22.9", "17.5"]
    assert not any("gang" in line for line in lines)          # a failed part has no figures to compare


def test_headlines_of_a_failed_part_are_empty():
    assert report.headlines("burst", {"error": "x"}) == {}
    assert report.headlines("burst", BURST) == {"200 jobs on 1000 nodes: placements/s": 22.9,
                                                "200 jobs on 1000 nodes: failed": 0}


def test_overhead_headlines_take_the_difference_row_without_a_trigger_time():
    rows = [{"case": "gpu_job, needs a boot", "trigger_to_running_s": 9.0, "overhead_s": 1.0},
            {"case": "difference", "overhead_s": 0.5}]
    assert report.headlines("overhead", {"rows": rows}) == {"gpu_job, needs a boot: trigger -> Running s": 9.0,
                                                            "gpu_job, needs a boot: overhead s": 1.0,
                                                            "difference: overhead s": 0.5}
