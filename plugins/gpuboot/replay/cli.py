"""`python -m gpuboot.replay`: replay a window of the trace under each policy, side by side."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from gpuboot.core.idle import DEFAULT_SPARE_SECONDS

from . import prices, trace
from .metrics import demand_series, lower_bound_cost, lower_bound_gpu_seconds, overload, whole_node_floor
from .policies import DEFAULT_QUEUE, POLICIES, Gpuboot
from .report import format_table, write_json
from .sim import SimConfig, Simulation

DAY = 86400
PLACES = {name for name, cls in POLICIES.items() if issubclass(cls, Gpuboot)}   # policies that call place()
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "results" / "replay"
TABLE = [("policy", "policy"), ("billed_cost", "cost $"), ("lower_bound_cost", "cost lower bound $"),
         ("cost_ratio", "x bound"), ("whole_node_floor_cost", "whole-node floor $"),
         ("billed_node_hours", "node-h"), ("billed_gpu_hours", "GPU-h"),
         ("lower_bound_gpu_hours", "GPU-h lower bound"), ("wait_mean_seconds", "wait mean s"),
         ("wait_p95_seconds", "wait p95 s"), ("boots", "boots"), ("wasted_boots", "wasted boots"),
         ("jobs_never_placed", "never placed"), ("wall_seconds", "sim s")]


SIZE_TABLE = [("policy", "policy"), ("size", "job size"), ("started", "started"), ("never_started", "never started"),
              ("timeouts", "timeouts"), ("wait_p50_seconds", "wait p50 s"), ("wait_p95_seconds", "wait p95 s"),
              ("wait_p99_seconds", "wait p99 s"), ("wait_max_seconds", "wait max s"),
              ("floor_p95_seconds", "no-preemption floor p95 s"), ("jain_teams_bucket", "Jain (teams, this size)"),
              ("jain_teams", "Jain (teams)"), ("jain_teams_slowdown", "Jain (teams, slowdown)"),
              ("hold_cost", "hold cost $"), ("preemptions", "preemptions")]


GAP_TABLE = [("policy", "policy"), ("fragmentation", "fragmentation $"), ("spare", "spare $"), ("idle", "idle $"),
             ("boots", "boots $"), ("placement", "placement $"), ("shift", "shift $")]


def gap_rows(policies: list[dict]) -> list[dict]:
    """One row per policy: its bill above the lower bound, by cause (metrics.Recorder.gap)."""
    return [{"policy": r["policy"], **r["gap_to_bound"]} for r in policies if r.get("gap_to_bound")]


def size_rows(policies: list[dict]) -> list[dict]:
    """One row per policy and job-size bucket; the policy's team fairness and hold cost on its first row."""
    rows = []
    for result in policies:
        for i, (size, figures) in enumerate(result["by_size"].items()):
            rows.append({"policy": result["policy"], "size": size, **figures,
                         **({k: result[k] for k in ("jain_teams", "jain_teams_slowdown", "hold_cost", "preemptions")}
                            if i == 0 else {})})
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpuboot.replay", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", help="directory with the openb CSVs (default ../shared/traces, then /work/shared/traces)")
    p.add_argument("--start", default="0", help="window start, trace time (e.g. 115d, 2760h, 9936000)")
    window = p.add_mutually_exclusive_group()
    window.add_argument("--duration", help="window length (e.g. 6h, 7d); default: until the last job ends")
    window.add_argument("--end", help="window end, trace time, instead of --duration")
    p.add_argument("--fleet", type=int, help="fleet size (default: the whole node list)")
    p.add_argument("--fleet-sample", choices=("first", "random"), default="random",
                   help="which nodes make a smaller fleet: the first N of the list or a seeded random N")
    p.add_argument("--seed", type=int, default=0, help="seed of the random fleet sample")
    p.add_argument("--start-seconds", type=float, default=60.0, help="ECS Starting -> Running")
    p.add_argument("--boot-seconds", type=float, default=60.0, help="Running -> kubelet Ready")
    p.add_argument("--device-plugin-seconds", type=float, default=30.0, help="Ready -> GPUs registered")
    p.add_argument("--stop-seconds", type=float, default=30.0, help="Stopping -> Stopped (billed)")
    p.add_argument("--idle-timeout", default="10m", help="stop a node after it has been empty this long")
    p.add_argument("--spare", default=f"{DEFAULT_SPARE_SECONDS / 3600:g}h",
                   help="gpuboot's scale-down keeps the fleet's spare (an idle node whose GPUs the other running "
                        "nodes could not replace) this much longer; 0 for none (gpuboot.core.idle.IdleRule)")
    p.add_argument("--boot-fill-from-load", type=float, default=0.0,
                   help="gpuboot's jobs set the gpu_job field boot_fill_from_load: a start is priced as if the node "
                        "would carry this times the GPUs in use now (0: off, every slot of the node)")
    p.add_argument("--queue-timeout", default="0", help="a job still waiting this long fails (live default 1h); 0: never")
    p.add_argument("--expected-runtime", action="store_true",
                   help="jobs state their runtime (the trace's own), so holds know when nodes free and backfill fits")
    p.add_argument("--preemptible", type=float, default=0.0,
                   help="share of jobs (0..1, by a hash of the name) that say they are preemptible: a job held past "
                        "the preemption threshold may requeue them")
    p.add_argument("--starve", default=f"{DEFAULT_QUEUE.starve_seconds:g}",
                   help="gpuboot's queue: a job of more than one GPU waiting this long gets holds (QueueConfig)")
    p.add_argument("--max-holds", type=int, default=DEFAULT_QUEUE.max_holds,
                   help="gpuboot's queue: how many starving jobs hold nodes at once, the first in line (QueueConfig)")
    p.add_argument("--teams", type=int, default=4, help="teams the trace's jobs are spread over (by a hash of the name)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--gpu-share", choices=trace.GPU_SHARE, default="all",
                   help="the trace's GPU-sharing variants: every GPU pod, only those with whole GPUs, or only those "
                        "sharing a GPU (each as 1 whole GPU)")
    p.add_argument("--gpu-model-share", type=float, default=0.0,
                   help="the GPU-model variant: this share (0..1) of the jobs that accept any GPU model accept only "
                        "one model of the fleet, by a hash of the name, in proportion to the fleet's GPUs")
    p.add_argument("--include-cpu-pods", action="store_true", help="also replay pods asking for no GPU")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory for summary.json and replay.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--exact", action="store_true",
                   help="give place() every node instead of one per class of identical nodes (same plans, slower)")
    return p


def _window(args) -> tuple[float, float | None]:
    """(start, end) in trace seconds; end None = open (until the last job of the window ends)."""
    start = trace.parse_duration(args.start, "--start")
    if args.end is not None:
        return start, trace.parse_duration(args.end, "--end")
    if args.duration is not None:
        return start, start + trace.parse_duration(args.duration, "--duration")
    return start, None


def run(args) -> dict:
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise trace.TraceError(f"--policies: unknown {', '.join(unknown) or '(none given)'}; "
                               f"choose from {', '.join(POLICIES)}")
    directory = trace.find_trace_dir(args.trace)
    start, end = _window(args)
    loaded = trace.load_jobs(directory, start, end, include_cpu_only=args.include_cpu_pods, gpu_share=args.gpu_share)
    if end is None:   # open window: until the last job ends, so every job may run to completion
        end = max((j.arrival + j.run_seconds for j in loaded.jobs), default=start + 1)
    fleet = trace.load_fleet(directory, args.fleet, args.fleet_sample, args.seed)
    if args.gpu_model_share:
        loaded.jobs = trace.pin_gpu_models(loaded.jobs, fleet, args.gpu_model_share)
        loaded.gpu_spec = sum(bool(job.gpu_models) for job in loaded.jobs)
    config = SimConfig(start=start, end=end, start_seconds=args.start_seconds, boot_seconds=args.boot_seconds,
                       device_plugin_seconds=args.device_plugin_seconds, stop_seconds=args.stop_seconds,
                       idle_timeout=trace.parse_duration(args.idle_timeout, "--idle-timeout"),
                       queue_timeout=trace.parse_duration(args.queue_timeout, "--queue-timeout"), teams=args.teams,
                       expected_runtime=args.expected_runtime, preemptible=args.preemptible)
    if args.max_holds < 0:
        raise ValueError(f"--max-holds: must be >= 0, got {args.max_holds}")
    queue = dataclasses.replace(DEFAULT_QUEUE, starve_seconds=trace.parse_duration(args.starve, "--starve"),
                                max_holds=args.max_holds)
    bound = lower_bound_gpu_seconds(loaded.jobs, end)
    money_bound = lower_bound_cost(loaded.jobs, fleet, end)
    floor = round(whole_node_floor(loaded.jobs, fleet, end), 2)
    fitting = [job for job in loaded.jobs if any(job.requests.fits_in(n.capacity) and job.accepts(n) for n in fleet)]
    load = overload(fitting, sum(n.gpus for n in fleet), start, end)
    results, series = [], {}
    for name in names:
        spare = {"spare_seconds": trace.parse_duration(args.spare, "--spare"),
                 "boot_fill_from_load": args.boot_fill_from_load} if name in PLACES else {}
        if name == Gpuboot.name:
            spare["queue"] = queue
        policy = POLICIES[name](exact=args.exact, **spare) if name in PLACES else POLICIES[name]()
        sim = Simulation(fleet, loaded.jobs, policy, config)
        recorder = sim.run()
        results.append(recorder.summary(bound, sim.wall_seconds, money_bound) | {"whole_node_floor_cost": floor})
        series[name] = recorder.series
    summary = {
        "trace": str(directory),
        "window": {"start_seconds": start, "end_seconds": end, "start_day": round(start / DAY, 3),
                   "days": round((end - start) / DAY, 3)},
        "fleet": {"nodes": len(fleet), "gpus": sum(n.gpus for n in fleet),
                  "sample": "all" if args.fleet is None else f"{args.fleet_sample} (seed {args.seed})"},
        "jobs": {"replayed": len(loaded.jobs), "skipped": dict(loaded.skipped), "gpu_share": args.gpu_share,
                 "gpu_model_share": args.gpu_model_share,
                 "fractional_gpu_as_one": loaded.fractional, "gpu_spec": loaded.gpu_spec},
        "overload": load,
        "prices": {"source": prices.SOURCE, "per_gpu_hour": dict(prices.PER_GPU), "per_vcpu_hour": prices.PER_VCPU,
                   "per_gib_hour": prices.PER_GIB,
                   "fleet_per_hour": round(sum(n.price_per_hour for n in fleet), 2)},
        "config": {k: getattr(config, k) for k in ("start_seconds", "boot_seconds", "device_plugin_seconds",
                                                     "stop_seconds", "idle_timeout", "scaledown_every",
                                                     "queue_timeout", "teams", "expected_runtime",
                                                     "preemptible")}
        | {"gpuboot_spare_seconds": trace.parse_duration(args.spare, "--spare"),
           "gpuboot_starve_seconds": queue.starve_seconds, "gpuboot_max_holds": queue.max_holds,
           "gpuboot_boot_fill_from_load": args.boot_fill_from_load},
        "notes": [
            "Each pod is one job of one task; arrival = creation_time, run = deletion_time - scheduled_time.",
            "Pods sharing a GPU (gpu_milli < 1000) are replayed as 1 whole GPU: gpuboot allocates whole GPUs.",
            ("A pod's gpu_spec (the GPU models it accepts, e.g. V100M16|V100M32) is honoured: it runs only on a "
            "node of one of them (jobs.gpu_spec counts such pods)."),
            ("Boot-on-demand policies start with every node stopped; billed time is clipped to the window; "
            "jobs not started by the window end count as never placed; waits are over the jobs that started."),
            "A boot is wasted when none of the jobs it was started for ran on that node while it was up.",
            ("billed_cost: each node's price (gpuboot.replay.prices) for every second it was powered on (booting, "
            "running, idle, stopping). lower_bound_cost: each job, from arrival for its run, pays its largest share "
            "(GPUs, CPU or memory) of the cheapest node that holds it (perfect packing, no boot, no idle time)."),
            ("whole_node_floor_cost: the cheapest whole nodes of the fleet whose GPUs and CPUs cover the summed "
             "demand at every instant, jobs free to move and split (metrics.whole_node_floor); gap_to_bound: "
             "billed_cost - lower_bound_cost by cause (metrics.Recorder.gap)."),
        ],
        "policies": results,
    }
    out = Path(args.out)
    write_json(out / "summary.json", summary)
    if not args.no_plot:
        from .plot import plot_replay
        title = (f"openb trace, days {start / DAY:g}-{end / DAY:g}, {len(fleet)} nodes, "
                 f"{len(loaded.jobs)} jobs, boot {config.boot_delay:g}s, idle stop {config.idle_timeout:g}s")
        plot_replay(out / "replay.png", series, demand_series(loaded.jobs, start, end), start, end, title)
    return summary


def attempt(action, *args):
    """(action's result, 0), or (None, 2) with `error: ...` on stderr for a bad option or trace."""
    try:
        return action(*args), 0
    except (trace.TraceError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return None, 2


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    began = time.perf_counter()
    summary, status = attempt(run, args)
    if status:
        return status
    w, f, j = summary["window"], summary["fleet"], summary["jobs"]
    print(f"trace {summary['trace']}: days {w['start_day']:g} + {w['days']:g}, fleet {f['nodes']} nodes / "
          f"{f['gpus']} GPUs ({f['sample']}), {j['replayed']} jobs "
          f"({j['fractional_gpu_as_one']} fractional-GPU pods as 1 GPU)")
    for reason, count in j["skipped"].items():
        print(f"  skipped {count} pods: {reason}")
    load = summary["overload"]
    print(f"demand as a fluid on the fleet's {load['fleet_gpus']} GPUs (metrics.overload): peak backlog "
          f"{load['peak_backlog_gpu_hours']:,} GPU-h on day {load['peak_day']:g} ({load['backlog_fleet_hours']:,} h of the "
          f"whole fleet), {load['demanded_gpu_hours']:,} GPU-h demanded vs {load['available_gpu_hours']:,} available "
          f"from day {load['busy_from_day']:g}; drained "
          + ("not within the window" if load["drained_day"] is None else f"by day {load['drained_day']:g}"))
    print(format_table(summary["policies"], TABLE))
    print("above the cost lower bound, by cause:")
    print(format_table(gap_rows(summary["policies"]), GAP_TABLE))
    print(format_table(size_rows(summary["policies"]), SIZE_TABLE))
    print(f"wrote {Path(args.out) / 'summary.json'}" + ("" if args.no_plot else f" and {Path(args.out) / 'replay.png'}")
          + f" in {time.perf_counter() - began:.1f}s")
    return 0
