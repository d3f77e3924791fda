"""The run note's text (gpuboot.ui.run_note.run_note): pure, no database."""
from gpuboot.ui.run_note import NOTE_LIMIT, run_note


def test_each_step_gets_a_line_in_order_and_failures_are_named():
    note = run_note([("gpu_job.place", "placed x in 0.1 s"), ("gpu_job.wait_gpu_ready", "failed: node a not GPU-ready")],
                    ["gpu_job.wait_gpu_ready"])
    assert note.splitlines() == ["- **place**: placed x in 0.1 s", "- **wait_gpu_ready**: failed: node a not GPU-ready",
                                 "- **failed**: wait_gpu_ready (its log says why)"]


def test_nothing_to_say_is_no_note_and_a_long_one_fits_the_column():
    assert run_note([], []) is None
    note = run_note([(f"g.step{i}", "x" * 200) for i in range(10)], [])
    assert len(note) == NOTE_LIMIT and note.endswith("…")
