"""python -m bench [--quick] [--parts placement,readiness,overhead] [--out results/bench]"""
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
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from bench import report  # noqa: E402

PARTS = ("placement", "readiness", "overhead")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes and few boots (a smoke run)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--boots", type=int, default=50, help="emulated boots for the readiness lag")
    p.add_argument("--out", default=str(REPO / "results" / "bench"), help="where the JSON goes")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if unknown := [x for x in parts if x not in PARTS]:
        print(f"error: --parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="gpuboot-bench-"))
    summary = {"machine": machine(), "quick": args.quick, "parts": {}}
    failed = False
    for part in parts:
        began = time.perf_counter()
        try:
            if part == "placement":
                from bench import placement_cost as module
                result = module.run(work / part, quick=args.quick)
            elif part == "readiness":
                from bench import readiness_lag as module
                result = module.run(work / part, quick=args.quick, boots=args.boots)
            else:
                from bench import overhead as module
                result = module.run(work / part, quick=args.quick)
        except Exception as error:  # one broken part must not hide the others' figures
            failed = True
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"}
        result["wall_seconds"] = round(time.perf_counter() - began, 1)
        summary["parts"][part] = result
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{part}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(report.render(part, result), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"machine: {summary['machine']['cpu']}, {summary['machine']['cores']} cores; wrote {out}/*.json")
    return 1 if failed else 0


raise SystemExit(main())
