"""`python -m gpuboot.replay.sweep`: the replay over idle timeouts and boot delays, as cost vs mean wait.

Each (idle timeout, boot delay) pair replays the same window and fleet under every policy
(gpuboot.replay.cli does each run); the points land in sweep.json and in a scatter
(sweep.png: billed cost against mean wait, one line per policy and boot delay, each point
labelled with its idle timeout), so an operator can pick idle_seconds from data: the knee
where a shorter timeout stops saving money and starts costing waits.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import cli, trace
from .report import format_table, write_json

DEFAULT_POLICIES = "allocate-time,queue-time,gpuboot"
TABLE = [("policy", "policy"), ("idle_timeout", "idle s"), ("boot_delay", "boot s"), ("billed_cost", "cost $"),
         ("lower_bound_cost", "cost lower bound $"), ("cost_ratio", "x bound"), ("billed_node_hours", "node-h"), ("wait_mean_seconds", "wait mean s"),
         ("wait_p95_seconds", "wait p95 s"), ("boots", "boots"), ("jobs_never_placed", "never placed")]
_PHASES = (("start_seconds", 60.0), ("boot_seconds", 60.0), ("device_plugin_seconds", 30.0))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpuboot.replay.sweep", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--idle-timeouts", default="2m,5m,10m,30m,60m", help="comma-separated durations")
    p.add_argument("--boot-delays", default="150,300",
                   help="comma-separated total boot delays (ECS start + kubelet + device plugin, split 60:60:30)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated replay policies")
    p.add_argument("--spares", default="",
                   help="comma-separated spare times (e.g. 0,1h,4h): gpuboot's policies once per spare, side by side "
                        "as 'gpuboot, spare 1h' (the baselines keep no spare and run once); default: --spare alone")
    p.add_argument("--out", default=str(cli.DEFAULT_OUT), help="directory for sweep.json and sweep.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def _list(text: str, field: str) -> list[float]:
    values = [trace.parse_duration(v, field) for v in text.split(",") if v.strip()]
    if not values:
        raise trace.TraceError(f"{field}: give at least one value, e.g. 10m")
    return values


def phases(boot_delay: float) -> dict[str, float]:
    """The three boot phases for a total delay, in the default 60:60:30 proportions."""
    total = sum(seconds for _, seconds in _PHASES)
    return {name: boot_delay * seconds / total for name, seconds in _PHASES}


def run(argv: list[str]) -> dict:
    """Sweep with the replay's own options (cli.parser) plus this parser's; returns sweep.json's content."""
    args, rest = parser().parse_known_args(argv)
    idles, boots = _list(args.idle_timeouts, "--idle-timeouts"), _list(args.boot_delays, "--boot-delays")
    spares = _list(args.spares, "--spares") if args.spares.strip() else [None]
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    points, base = [], None
    for boot in boots:
        for idle in idles:
            for i, spare in enumerate(spares):
                # the baselines ignore the spare: run them with the first spare only
                policies = [n for n in names if i == 0 or n in cli.PLACES]
                if not policies:
                    continue
                extra = [] if spare is None else ["--spare", f"{spare:g}"]
                replay_args = cli.parser().parse_args([*rest, *extra, "--policies", ",".join(policies), "--no-plot",
                                                       "--out", str(Path(args.out) / "sweep-runs"),
                                                       "--idle-timeout", f"{idle:g}"])
                for name, value in phases(boot).items():
                    setattr(replay_args, name, value)
                summary = cli.run(replay_args)
                base = base or {k: summary[k] for k in ("trace", "window", "fleet", "jobs")}
                for row in summary["policies"]:
                    label = row["policy"]
                    if spare is not None and len(spares) > 1 and label in cli.PLACES:
                        label = f"{label}, spare {spare / 3600:g}h"
                    points.append({"idle_timeout": idle, "boot_delay": boot, **row, "policy": label})
    result = {**base, "idle_timeouts": idles, "boot_delays": boots, "spares": [s for s in spares if s is not None],
              "points": points}
    out = Path(args.out)
    write_json(out / "sweep.json", result)
    if not args.no_plot:
        plot_sweep(out / "sweep.png", result)
    return result


def plot_sweep(path: Path, result: dict) -> Path:
    """Billed cost (y) against mean wait (x): a line per (policy, boot delay) through its idle timeouts."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axis = plt.subplots(figsize=(10, 6.5), constrained_layout=True)
    lines: dict[tuple, list[dict]] = {}
    for point in result["points"]:
        lines.setdefault((point["policy"], point["boot_delay"]), []).append(point)
    styles = ("-", "--", ":", "-.")
    boots = sorted({b for _, b in lines})
    for (policy, boot), points in sorted(lines.items()):
        group = [p for p in sorted(points, key=lambda p: p["idle_timeout"]) if p["wait_mean_seconds"] is not None]
        xs, ys = [p["wait_mean_seconds"] for p in group], [p["billed_cost"] for p in group]
        line, = axis.plot(xs, ys, styles[boots.index(boot) % len(styles)], marker="o",
                          label=f"{policy}, boot {boot:g} s")
        for p, x, y in zip(group, xs, ys):
            axis.annotate(f"{p['idle_timeout'] / 60:g}m", (x, y), textcoords="offset points", xytext=(4, 4),
                          fontsize=7, color=line.get_color())
    bound = next((p["lower_bound_cost"] for p in result["points"] if p.get("lower_bound_cost") is not None), None)
    if bound is not None:
        axis.axhline(bound, color="black", linewidth=0.8, linestyle=":", label=f"cost lower bound {bound:,.0f} $")
    floor = next((p["whole_node_floor_cost"] for p in result["points"] if p.get("whole_node_floor_cost")), None)
    if floor is not None:
        axis.axhline(floor, color="grey", linewidth=0.8, linestyle="--",
                     label=f"whole-node floor {floor:,.0f} $ (jobs free to move)")
    axis.set_xscale("symlog", linthresh=10)
    axis.set_xlim(left=0)                         # waits are never negative
    axis.set_xlabel("mean wait per job (s)")
    axis.set_ylabel("billed cost (USD)")
    f, w = result["fleet"], result["window"]
    axis.set_title(f"openb replay, days {w['start_day']:g} + {w['days']:g}, {f['nodes']} nodes ({f['sample']}); "
                   "labels: idle timeout", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    began = time.perf_counter()
    result, status = cli.attempt(run, argv)
    if status:
        return status
    print(format_table(result["points"], TABLE))
    out = Path(parser().parse_known_args(argv)[0].out)
    print(f"wrote {out / 'sweep.json'} and {out / 'sweep.png'} in {time.perf_counter() - began:.1f}s")
    return 0


if __name__ == "__main__" and __package__ == "gpuboot.replay":
    raise SystemExit(main())
