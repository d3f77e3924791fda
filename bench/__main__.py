"""python -m bench [--quick] [--parts placement,readiness,overhead,gang,burst,triggerer,ledger,placer_idle|distributed]
[--kube simcloud,real] [--out results/bench]

`--kube simcloud,real` runs the parts on each Kubernetes backend in turn (simcloud's own API server, then
the real control plane from `make controlplane`), each in a process of its own writing into
results/bench/<backend>/, and prints their headline figures side by side.

`distributed` (GPUs registered -> pod Running on the CeleryExecutor stack) takes minutes and needs
PostgreSQL and Redis: not in the default parts (`make bench-distributed`)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Airflow fixes its home and database at first import: a throwaway one, never the user's.
if "airflow" not in __import__("sys").modules:
    _home = tempfile.mkdtemp(prefix="gpuboot-bench-airflow-")
    os.environ["AIRFLOW_HOME"] = _home
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_home}/airflow.db"
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
# dag.test() needs its DAG in a bundle folder: a scratch one with gpu_job and the bench's baseline DAG.
_dags = Path(tempfile.mkdtemp(prefix="gpuboot-bench-dags-"))
for _source in (REPO / "dags" / "gpu_job.py", REPO / "bench" / "dags" / "bench_plain_kpo.py"):
    (_dags / _source.name).symlink_to(_source)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(_dags)
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from bench import report  # noqa: E402
from bench.common import output_to, write_json  # noqa: E402

PARTS = ("placement", "readiness", "overhead", "gang", "burst", "triggerer", "queue_wake", "preemption", "ledger",
         "placer_idle")
SLOW_PARTS = ("distributed",)     # only when asked for by name


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def run_part(part: str, workdir: Path, args) -> dict:
    if part == "placement":
        from bench import placement_cost
        return placement_cost.run(workdir, quick=args.quick)
    if part == "readiness":
        from bench import readiness_lag
        return readiness_lag.run(workdir, quick=args.quick, boots=args.boots)
    if part == "distributed":
        from bench import distributed
        return distributed.run(workdir, quick=args.quick, runs=args.runs, tuned=not args.untuned)
    if part == "burst":
        from bench import burst
        return burst.run(workdir, quick=args.quick, sizes=_ints(args.burst_fleets), bursts=_ints(args.burst_jobs),
                         placer=args.burst_placer, per_process=args.burst_threads, steps_nice=args.burst_steps_nice)
    if part == "gang":
        from bench import gang_launch
        return gang_launch.run(workdir, quick=args.quick)
    if part == "triggerer":
        from bench import triggerer_loop
        return triggerer_loop.run(workdir, quick=args.quick)
    if part == "queue_wake":
        from bench import queue_wake
        return queue_wake.run(2 if args.quick else 4, seed=0)
    if part == "ledger":
        from bench import ledger_scale
        return ledger_scale.run(jobs=500 if args.quick else 5000, nodes=1000 if args.quick else 10_000)
    if part == "preemption":
        from bench import preemption
        return preemption.run(1 if args.quick else 3)
    if part == "placer_idle":
        from bench import placer_idle
        return placer_idle.run(workdir, quick=args.quick)
    from bench import overhead
    return overhead.run(workdir, quick=args.quick)


def _ints(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",") if x.strip()) if text else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes and few boots (a smoke run)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS + SLOW_PARTS)}")
    p.add_argument("--runs", type=int, default=5, help="distributed: gpu_job runs, one boot each")
    p.add_argument("--untuned", action="store_true", help="distributed: without the recommended Airflow settings")
    p.add_argument("--boots", type=int, default=50, help="emulated boots for the readiness lag")
    p.add_argument("--burst-fleets", help="burst: fleet sizes, comma-separated (default 100,1000; --quick 100)")
    p.add_argument("--burst-jobs", help="burst: jobs per burst, comma-separated (default 50,200; --quick 50)")
    p.add_argument("--burst-placer", action="store_true",
                   help="burst: a placer process (gpuboot.lifecycle.placer, watch-fed view) leads the batches")
    p.add_argument("--burst-threads", type=int, default=1,
                   help="burst: place transactions per forked process, as threads (default 1: a process each)")
    p.add_argument("--burst-steps-nice", type=int, default=0, metavar="N",
                   help="burst: the place steps' processes run at niceness N (default 0): with N > 0 they take "
                        "only the CPU the control plane and the placer leave, as on workers of their own")
    p.add_argument("--kube", default="simcloud",
                   help="Kubernetes backends, comma-separated, of simcloud, real (several: side by side)")
    p.add_argument("--out", default=str(REPO / "results" / "bench"), help="where the JSON goes")
    args = p.parse_args(argv)
    backends = [x.strip() for x in args.kube.split(",") if x.strip()]
    if not backends or set(backends) - {"simcloud", "real"}:
        print(f"error: --kube: {args.kube!r}; choose simcloud, real or simcloud,real", file=sys.stderr)
        return 2
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if unknown := [x for x in parts if x not in PARTS + SLOW_PARTS]:
        print(f"error: --parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS + SLOW_PARTS)}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if len(backends) > 1:
        return _side_by_side(argv if argv is not None else sys.argv[1:], backends, parts, out)
    kube = backends[0]
    os.environ["GPUBOOT_KUBE"] = kube          # every SimCloud a part starts uses this backend
    work = Path(tempfile.mkdtemp(prefix="gpuboot-bench-"))
    summary = {"machine": machine(), "quick": args.quick, "kube": kube, "parts": {}}
    failed = False
    for part in parts:
        began = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / f"{part}.log"
        log_path.write_text("")
        os.environ["GPUBOOT_BENCH_LOG"] = str(log_path)
        print(f"-- {part} on {kube}: running (its log: {log_path})", flush=True)
        try:
            with output_to(log_path):   # Airflow, simcloud and trigger logs go to the part's log file
                result = run_part(part, work / part, args)
        except Exception as error:  # one broken part must not hide the others' figures
            failed = True
            with open(log_path, "a") as log:
                traceback.print_exc(file=log)
            result = {"error": f"{type(error).__name__}: {error}"}
        result["wall_seconds"] = round(time.perf_counter() - began, 1)
        summary["parts"][part] = result
        write_json(out / f"{part}.json", result)
        print(report.render(part, result), flush=True)
    write_json(out / "summary.json", summary)
    print(f"machine: {summary['machine']['cpu']}, {summary['machine']['cores']} cores; wrote {out}/*.json")
    return 1 if failed else 0


def _side_by_side(argv: list[str], backends: list[str], parts: list[str], out: Path) -> int:
    """Each backend in a process of its own (Airflow keeps its connections and hooks per process),
    into out/<backend>/; then their headline figures side by side."""
    plain = [a for i, a in enumerate(argv)
             if not (a.startswith(("--kube", "--out")) or (i and argv[i - 1] in ("--kube", "--out")))]
    failed = False
    for kube in backends:
        done = subprocess.run([sys.executable, "-m", "bench", *plain, "--kube", kube, "--out", str(out / kube)],
                              check=False)
        failed = failed or done.returncode != 0
    results = {kube: {part: json.loads(path.read_text()) if (path := out / kube / f"{part}.json").exists()
                      else {"error": "not run"} for part in parts} for kube in backends}
    write_json(out / "side_by_side.json", {"machine": machine(), "backends": results})
    print(report.side_by_side(results), flush=True)
    print(f"wrote {out}/<backend>/*.json and {out}/side_by_side.json")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
