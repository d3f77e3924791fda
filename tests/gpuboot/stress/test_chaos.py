"""`make chaos` in small: a few jobs through every injected fault (throttled ECS, NoStock on the
preferred type, a node never Ready, a device plugin never registering, 409 bursts, one launch
worker SIGKILLed mid-pod), each step try in its own forked worker process (chaos.scenario)."""
from __future__ import annotations

import re

from chaos.scenario import run_chaos

SUMMARY = re.compile(r"chaos: (\d+) jobs, (\d+) succeeded, (\d+) failed with a reason, 0 overcommitted, "
                     r"0 leaked reservations, 0 idle instances left running")


def test_small_chaos_run_keeps_every_promise(tmp_path):
    outcome = run_chaos(job_count=5, seed=3, workdir=tmp_path, kill_step="launch")
    summary = outcome.summary()
    assert outcome.problems() == [], summary
    jobs, succeeded, failed = map(int, SUMMARY.fullmatch(summary).groups())
    assert jobs == 5 and succeeded + failed == jobs
    # The killed launch was retried and re-attached to its running pod: one pod, job succeeded.
    assert outcome.killed is not None and outcome.killed_retried and outcome.duplicate_pods == {}
    # The faults were met and got over: the nodes that never became Ready / never registered GPUs
    # were given up on at the boot timeout (whether a job meets NoStock depends on the mix; the
    # full `make chaos` run of 16 jobs does). Every job not pinned to V100 succeeds; the V100 job
    # meets both broken V100 nodes and may use up its bounded re-placements: then it fails, with
    # the boot timeout as its reason.
    log = (tmp_path / "workers.log").read_text()
    assert "not GPU-ready" in log
    unpinned = [r for r in outcome.results if r.conf.get("gpu_model") != "V100"]
    assert all(r.state == "success" for r in unpinned), [(r.run_id, r.reason) for r in unpinned]
    assert all("not GPU-ready" in r.reason for r in outcome.failed_with_reason)
