"""The tables `make bench` prints, one per part, from the JSON it writes."""
from __future__ import annotations

from gpuboot.replay.report import format_table


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)


def placement(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        rows.append({"nodes": r["nodes"], "pods": r["pods"],
                     "list nodes": _ms(r["api_list_nodes_s"]), "list pods": _ms(r["api_list_pods_s"]),
                     "describe instances": _ms(r["api_describe_instances_s"]), "API total": _ms(r["api_total_s"]),
                     "build inventory": _ms(r["build_inventory_s"]),
                     "place 1 task": _ms(r["place 1 task_s"]),
                     f"place {result['gang_tasks']}-gang": _ms(r[f"place {result['gang_tasks']}-task gang_s"])})
        if "place 1 task_cpu_s" in r:     # CPU time of the pure parts (see bench/placement_cost.py)
            gang = f"place {result['gang_tasks']}-task gang"
            rows[-1].update({"build CPU": _ms(r["build_inventory_cpu_s"]), "place 1 CPU": _ms(r["place 1 task_cpu_s"]),
                             "first place 1 CPU": _ms(r["place 1 task first_cpu_s"]),
                             "place gang CPU": _ms(r[f"{gang}_cpu_s"]), "first place gang CPU": _ms(r[f"{gang} first_cpu_s"])})
        if "place never 1 task_cpu_s" in r:    # the jobs that do not fit: BUSY on a full fleet, NEVER
            rows[-1].update({"busy 1 CPU": _ms(r["place busy 1 task_cpu_s"]),
                             "busy gang CPU": _ms(r[f"place busy {result['gang_tasks']}-task gang_cpu_s"]),
                             "never 1 CPU": _ms(r["place never 1 task_cpu_s"])})
    columns = [(k, k) for k in rows[0]]
    growth = ", ".join(f"{k} {v:g}" for k, v in result["growth_exponent"].items())
    return (f"== Placement cost (ms; API = reads from the local cloud, the rest is pure; wall clock, and CPU time "
            f"of the pure parts), {result['pods_per_node']} pods per running node\n"
            + format_table(rows, columns) + f"\ngrowth exponent (time ~ nodes^k, 1 = linear): {growth}\n")


def readiness(result: dict) -> str:
    rows = []
    for scenario, part in result["scenarios"].items():
        for name, overall in part["lag_seconds"].items():
            by_path = part.get("lag_seconds_by_path", {}).get(name) or {"": overall}
            early = part.get("fired_before_registration_by_path", {}).get(name, {})
            for path, s in by_path.items():
                rows.append({"scenario": scenario, "detector": name, "path": path,
                             **{k: v for k, v in s.items() if k in ("n", "median", "p95", "max")},
                             "early": early.get(path, part["fired_before_registration"][name]),
                             "missed": part["missed"][name]})
    columns = [("scenario", "boot order"), ("detector", "detector"), ("path", "path"), ("n", "boots"),
               ("median", "median s"), ("p95", "p95 s"), ("max", "max s"), ("early", "early fires"),
               ("missed", "missed")]
    return (f"== Readiness detection lag: GPUs registered -> detector fires (fast path: no window; fallback: "
            f"{result.get('fallback_seconds', result['settle_seconds']):g} s; {result['boots']} boots per scenario)\n"
            + format_table(rows, columns) + "\n" + "\n".join(result.get("notes", [])) + "\n")


def overhead(result: dict) -> str:
    rows = result["rows"]
    columns = [("case", "case"), ("trigger_to_running_s", "trigger->Running s"),
               ("emulated_physical_s", "emulated boot s"), ("overhead_s", "overhead s")]
    return ("== End-to-end: DAG run triggered -> pod Running, minus the emulated boot + device-plugin time\n"
            + format_table(rows, columns) + "\n" + "\n".join(result.get("notes", [])) + "\n")


def burst(result: dict) -> str:
    rows = [{**r, "reads": f"{r['reads_per_placement_mean']:g} / {r['reads_median']:g} / {r['reads_max']:g}",
             "ledger": f"{r['ledger_peak_bytes'] / 1024:.0f} KiB"} for r in result["rows"]]
    columns = [("nodes", "nodes"), ("jobs", "jobs"), ("placed", "placed"), ("failed", "failed"),
               ("wall_s", "wall s"), ("placements_per_s", "placements/s"),
               ("reads", "full reads per placement (mean / median / max)"), ("conflicts", "conflicts"),
               ("deferrals", "deferrals"), ("ledger", "ledger at peak")]
    if any("api_bytes_per_placement" in r for r in rows):
        columns += [("api_bytes_per_placement", "API B/placement"),
                    ("api_bytes_per_placement_leader", "of which leader"),
                    ("api_bytes_per_placement_amortised", "amortised (+ placer start)")]
    growth = "".join(f"API bytes per placement ~ nodes^{v:g} ({k})\n"
                     for k, v in (result.get("bytes_growth_exponent") or {}).items())
    cpu = "".join(f"CPU s from the release to the last answer, {r['nodes']} nodes / {r['jobs']} jobs: "
                  + ", ".join(f"{k} {v:g}" for k, v in r["cpu_s"].items()) + "\n" for r in rows if r.get("cpu_s"))
    cpu += "".join(f"the same over {r['cpu_s_quiet']['window_s']:g} s before the release (no burst): " + ", ".join(
        f"{k} {v:g}" for k, v in r["cpu_s_quiet"].items() if k != "window_s") + "\n" for r in rows if r.get("cpu_s_quiet"))
    cpu += "".join(f"Kubernetes requests per placement, {r['nodes']} nodes / {r['jobs']} jobs: " + "; ".join(
        f"{who}: " + (", ".join(f"{k} {v:g}" for k, v in kinds.items()) or "none")
        for who, kinds in r["requests_per_placement"].items()) + "\n" for r in rows if r.get("requests_per_placement"))
    return (f"== Bursts: N place transactions at once ({result.get('note', 'one process each')})\n"
            + format_table(rows, columns) + "\n" + growth + cpu)


def distributed(result: dict) -> str:
    rows = [{"step": step, **{k: v for k, v in s.items() if k in ("n", "median", "p95", "max")}}
            for step, s in result["steps_s"].items()]
    rows.append({"step": "GPUs registered -> pod Running",
                 **{k: v for k, v in result["registered_to_running_s"].items() if k in ("n", "median", "p95", "max")}})
    columns = [("step", "step"), ("n", "runs"), ("median", "median s"), ("p95", "p95 s"), ("max", "max s")]
    return (f"== End to end on the distributed stack (CeleryExecutor, triggerer; stack up in {result['stack_up_s']} s)\n"
            + format_table(rows, columns) + "\n" + "\n".join(result.get("notes", [])) + "\n")


def triggerer(result: dict) -> str:
    keys = ("loop", "triggers", "nodes", "ready", "blocking_callbacks", "worst_callback_cpu_s", "worst_callback_wall_s",
            "worst_gc_s", "heartbeat_worst_lag_s", "loop_cpu_s", "peak_node_watches", "last_fired_after_s")
    rows = [{k: run.get(k) for k in keys} for run in result["runs"]]
    columns = [("loop", "loop"), ("triggers", "triggers"), ("nodes", "booting nodes"), ("ready", "fired ready"),
               ("blocking_callbacks", f"blocking (> {result['threshold_s']:g} s CPU not GC, or > {result['wait_limit_s']:g} s)"),
               ("worst_callback_cpu_s", "worst callback CPU s"), ("worst_callback_wall_s", "worst callback wall s"), ("worst_gc_s", "worst GC pause s"),
               ("heartbeat_worst_lag_s", "worst loop lag s"), ("loop_cpu_s", "loop CPU s"),
               ("peak_node_watches", "Node watches"), ("last_fired_after_s", "last fired after s")]
    lines = ""
    for run in result["runs"]:
        window = run.get("worst_lag_window") or {}
        lines += (f"{run['loop']}: the worst lag, {run['heartbeat_worst_lag_s']} s at {run.get('heartbeat_worst_at_s')} s, "
                  f"ran {window.get('callbacks')} callbacks for {window.get('callbacks_wall_s')} s; most: "
                  + "; ".join(f"{kind[:60]} x{n} {wall} s" for kind, n, wall in (window.get("by_kind") or [])[:3]) + "\n")
        lines += "".join(f"  {run['loop']} callback over {result['threshold_s']:g} s: cpu {s['cpu_s']} s (GC {s['gc_s']} s), "
                         f"wall {s['wall_s']} s: {s['callback'][:300]}\n" for s in run.get("slowest") or [])
    lines += (f"(load average {result['load_average_1m']:g} on this machine when it ended: on a crowded machine "
              f"even trivial callbacks, e.g. a timer's, wait for a core; that is wall time, not CPU)\n")
    return ("== Triggerer loop: readiness triggers waiting at once in one fresh process (every callback timed)\n"
            + format_table(rows, columns) + "\n" + lines)


def gang(result: dict) -> str:
    rows = [{"stage": stage, **{k: v for k, v in result[key].items() if k in ("n", "median", "p95", "max")}}
            for stage, key in (("launch called -> all pods created", "launch_to_created_s"),
                               ("rank 0 created -> last rank created", "rank0_to_last_created_s"),
                               ("launch called -> all ranks Running", "launch_to_all_running_s"),
                               ("last rank done -> trigger fired", "last_done_to_verdict_s"))]
    columns = [("stage", "stage"), ("n", "runs"), ("median", "median s"), ("p95", "p95 s"), ("max", "max s")]
    return (f"== Gang launch: {result['ranks']} ranks on running nodes (rank 0 first, the others once its pod IP is known)\n"
            + format_table(rows, columns) + "\n")


def headlines(part: str, result: dict) -> dict[str, float | None]:
    """The figures of a part worth comparing across backends: {label: value}."""
    if "error" in result:
        return {}
    if part == "readiness":
        return {f"{scenario}, {detector}: median lag s": s.get("median")
                for scenario, p in result["scenarios"].items() for detector, s in p["lag_seconds"].items()}
    if part == "overhead":
        return {f"{r['case']}: trigger -> Running s": r["trigger_to_running_s"] for r in result["rows"]
                if "trigger_to_running_s" in r} | {f"{r['case']}: overhead s": r["overhead_s"] for r in result["rows"]}
    if part == "burst":
        out: dict[str, float | None] = {}
        for r in result["rows"]:
            name = f"{r['jobs']} jobs on {r['nodes']} nodes{', placer' if r.get('placer') else ''}"
            out |= {f"{name}: placements/s": r["placements_per_s"], f"{name}: failed": r["failed"]}
            if "api_bytes_per_placement" in r:
                out |= {f"{name}: API bytes per placement": r["api_bytes_per_placement"],
                        f"{name}: same, amortised with the placer's start": r["api_bytes_per_placement_amortised"],
                        f"{name}: ledger at peak, bytes": r["ledger_peak_bytes"]}
        return out
    if part == "gang":
        return {"launch -> all ranks Running, median s": result["launch_to_all_running_s"].get("median")}
    if part == "placement":
        return {f"{r['nodes']} nodes: API reads ms": _ms(r["api_total_s"]) for r in result["rows"]}
    if part == "ledger":        # in memory: the same on every backend
        return {f"{result['jobs_held_at_once']} jobs: largest ledger object KiB": round(
            result["peak_object"]["bytes"] / 1024), "conflicts per commit": result["conflicts_per_commit"]}
    if part == "preemption":
        return {f"{key}, median s": result[key].get("median") for key in PREEMPTION_FIGURES}
    if part == "placer_idle":
        return {"idle placer: the local cloud's CPU it adds, % of a core": result["placer_cost_to_cloud_pct"],
                "idle placer: its own CPU, % of a core": result["placer_cpu_pct"]}
    return {}


def side_by_side(backends: dict[str, dict]) -> str:
    """One row per headline figure, one column per backend (the same parts, the same machine, one run)."""
    names = list(backends)
    rows = []
    for part in dict.fromkeys(p for results in backends.values() for p in results):
        figures = {kube: headlines(part, backends[kube].get(part, {"error": "not run"})) for kube in names}
        for label in dict.fromkeys(k for f in figures.values() for k in f):
            rows.append({"part": part, "figure": label, **{kube: figures[kube].get(label) for kube in names}})
    columns = [("part", "part"), ("figure", "figure"), *((kube, kube) for kube in names)]
    return "== Side by side: the same parts on each Kubernetes backend\n" + format_table(rows, columns) + "\n"


def queue_wake(result: dict) -> str:
    lines = ["== release -> waiter placed (bench.queue_wake: the job queue's release counter wakes the waiter)"]
    for r in result["runs"]:
        lines.append(f"   release {r['offset']:5.1f} s into the {result['poll_seconds']:g} s poll: woken by "
                     f"{r['woken']}, placed {r['release_to_placed']:.2f} s after the release")
    s = result["release_to_placed"]
    lines.append(f"   median {s['median']} s, mean {result['mean_release_to_placed']} s, max {s['max']} s")
    return "\n".join(lines) + "\n"


PREEMPTION_FIGURES = ("place_with_preemption", "victim_told", "release_to_relaunched")


def preemption(result: dict) -> str:
    lines = ["== live preemption (bench.preemption: a high 8-GPU job preempts a low preemptible one, which runs again)"]
    for r in result["runs"]:
        lines.append(f"   placed with preemption in {r['place_with_preemption']:.2f} s; victim told "
                     f"{r['victim_told']:.2f} s later; relaunched {r['release_to_relaunched']:.2f} s after the release")
    for key in PREEMPTION_FIGURES:
        s = result[key]
        lines.append(f"   {key}: median {s['median']} s, max {s['max']} s")
    return "\n".join(lines) + "\n"


def render(part: str, result: dict) -> str:
    if "error" in result:
        return f"== {part}: FAILED: {result['error']}\n"
    return {"placement": placement, "readiness": readiness, "overhead": overhead, "gang": gang, "burst": burst,
            "distributed": distributed, "triggerer": triggerer, "queue_wake": queue_wake,
            "preemption": preemption, "ledger": ledger, "placer_idle": placer_idle}[part](result)


def placer_idle(result: dict) -> str:
    return (f"== an idle placer's cost (bench.placer_idle: {result['nodes']} nodes, {result['queue_shards']} queue "
            f"shards, {result['window_s']:g} s windows)\n   the local cloud: {result['cloud_cpu_pct_without_placer']} % "
            f"of a core without a placer, {result['cloud_cpu_pct_with_placer']} % with one leading an empty queue "
            f"(+{result['placer_cost_to_cloud_pct']} %); the placer itself {result['placer_cpu_pct']} %\n")


def ledger(result: dict) -> str:
    from bench.ledger_scale import line

    return f"== ledger at scale (bench.ledger_scale)\n{line(result)}\n"
