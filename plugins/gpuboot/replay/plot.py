"""The replay's PNG: powered-on nodes, and powered-on GPUs against GPU demand, per policy."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

DAY = 86400.0


def plot_replay(path: Path, series: Mapping[str, Sequence[tuple[float, int, int]]],
                demand: Sequence[tuple[float, int]], start: float, end: float, title: str) -> Path:
    """Two panels over the window (x in trace days): nodes on per policy; GPUs on per policy and demand."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 7), constrained_layout=True)
    for name, points in series.items():
        xs, nodes, gpus = _extend(points, start, end, width=3)
        xs = [x / DAY for x in xs]
        top.step(xs, nodes, where="post", label=name, linewidth=1)
        bottom.step(xs, gpus, where="post", label=f"{name}: GPUs powered on", linewidth=1)
    xs, needed = _extend(demand, start, end, width=2)
    xs = [x / DAY for x in xs]
    bottom.step(xs, needed, where="post", color="black", linewidth=1.2, label="GPU demand (jobs' GPUs if started on arrival)")
    top.set_ylabel("powered-on nodes")
    bottom.set_ylabel("GPUs")
    bottom.set_xlabel("trace time (days)")
    for axis in (top, bottom):
        axis.set_yscale("symlog", linthresh=10)   # always-on is the whole fleet; the others are far lower
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8, loc="upper right")
    top.set_title(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _extend(points: Sequence[tuple], start: float, end: float, width: int) -> tuple[list, ...]:
    """Step series of `width`-tuples from `start` (level 0 before the first point) to `end` (last level held)."""
    points = [p for p in points if p[0] <= end]
    if not points or points[0][0] > start:
        points.insert(0, (start, *([0] * (width - 1))))
    points.append((end, *points[-1][1:]))
    return tuple(list(column) for column in zip(*points))
