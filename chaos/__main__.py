"""`python -m chaos [--jobs N] [--seed S] [--kill-step place|start|wait_gpu_ready|launch] [--burst] [--workdir DIR]`

The fault-injection run of chaos.scenario against a fresh local cloud. Progress goes to
stdout, every log to DIR/chaos.log and DIR/workers.log; the last line is the summary
`chaos: J jobs, S succeeded, F failed with a reason, 0 overcommitted, 0 leaked
reservations, 0 idle instances left running`. Exit status 1 when any of the zero figures
is not zero, a job ended without a reason, the killed step left a second pod or was not
retried to success. `--burst` releases every job in the same instant (a barrier) instead
of one after another as their threads come up.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n\n")[1])
    parser.add_argument("--jobs", type=int, default=16, help="number of concurrent GPU jobs (default 16)")
    parser.add_argument("--seed", type=int, default=7, help="seed for the job mix and the cloud's randomness")
    parser.add_argument("--kill-step", default="launch", choices=["place", "start", "wait_gpu_ready", "launch"],
                        help="the step whose worker is SIGKILLed once (default launch, while it creates the pods)")
    parser.add_argument("--burst", action="store_true",
                        help="fire every job at the same instant (all held at a barrier, then released)")
    parser.add_argument("--workdir", type=Path, default=None, help="where logs go (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpuboot-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    os.environ.setdefault("GPUBOOT_MIN_BOOT_SECONDS", "1")      # the local cloud boots in seconds
    console = quiet(workdir / "chaos.log")

    from chaos.scenario import run_chaos

    def progress(line: str) -> None:
        print(line, file=console, flush=True)

    outcome = run_chaos(args.jobs, args.seed, workdir, args.kill_step, progress, burst=args.burst)
    for problem in outcome.problems():
        progress(f"  problem: {problem}")
    progress(outcome.summary())
    return 1 if outcome.problems() else 0


def quiet(log_path: Path):
    """Send everything written to stdout/stderr (Airflow's and the clients' logs included) to
    `log_path`; return a stream on the real stdout for the progress lines and the summary."""
    console = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s", force=True)
    return console


if __name__ == "__main__":
    sys.exit(main())
