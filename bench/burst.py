"""Bursts: N place transactions at the same instant, each in its own process, on one ledger.

What a burst of `gpu_job` runs does to the place step, without Airflow's scheduling noise:
the parent imports everything (as a Celery prefork worker does), forks one process per job,
and releases them all at once; each runs the place step's transaction (`gpuboot.lifecycle.batching.book_first`,
a first placement through a batch) for a 1-GPU job (each with its own job id) through the real
hooks against simcloud. A transaction
that gives up for contention (`LedgerContended`) is what makes the place step defer: the
process then waits a short, jittered while, as the deferral would, and books again, until the
job's queue timeout; a job that never commits by then is failed. The fleet is the placement
bench's (bench.placement_cost.fleet: four GPU types, 80 % running with 10 pods each), with room
for every job, so every job should be placed.

Figures per run: jobs placed, failed (and why), wall time from the release to the last
commit, placements per second, full cluster reads (the Nodes + Pods + ECS `survey`) per
placement, median and max, ledger conflicts seen, and the ledger ConfigMap's size at its
peak (polled; and at the end, when it holds every job's reservation).

With `--burst-placer` a placer (`gpuboot.lifecycle.placer`: a long-lived process, its cluster view fed
by watches) runs in a process of its own, started and leading before the burst, and answers the queued
jobs; without it a place step leads, reading the cluster in full. API bytes read are counted in every
process at the socket (TLS payload: status lines, headers and bodies, Kubernetes and ECS): the jobs'
(their queue and ledger polls), the placer's during the burst, and its start-up (the first LISTs and
DescribeInstances of its view), amortised over the burst's placements. `--burst-threads N` runs N jobs
per forked process (threads), for bursts larger than the machine's memory allows processes for.

Where the CPU went (`cpu_s`): each part's from the release to the last answer (kube-apiserver, etcd, the
scheduler and the controller-manager on the real backend, the rest of the local cloud, the placer, the place
steps, the machine's busy time), and the same over QUIET_SECONDS before the release (`cpu_s_quiet`: the
fleet's own load); and the Kubernetes requests each placement made, by verb and resource
(`requests_per_placement`, counted in each process's client).

Everything shares the machine's cores: the simcloud process (the API servers, which in production
have machines of their own) competes with the job processes, so the figures are pessimistic;
`--burst-steps-nice N` runs the place steps at niceness N, as if on workers of their own.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import random
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

from .common import export_connections, growth_exponent, local_cloud
from .cpu import cloud_parts, machine_busy_s, own_cpu_s, processes, used_between
from .placement_cost import PODS_PER_NODE, fleet

SIZES = (100, 1000)
BURSTS = (50, 200)
QUEUE_TIMEOUT_SECONDS = 600
QUIET_SECONDS = 10          # the window before the release whose CPU is the burst's baseline (`cpu_s_quiet`)
DEFER_SECONDS = (1.0, 3.0)      # how long a contended place step stays deferred (WakeUpTrigger), jittered
# GPUBOOT_BURST_NO_DEFER=1: a LedgerContended fails the job, as the place step did before it deferred
# (how the "before" figures were measured, on the code of that time)
DEFERS = os.environ.get("GPUBOOT_BURST_NO_DEFER") != "1"
# why a waiter placed on its own, or led a batch itself (gpuboot.lifecycle.batching's log lines)
FALLBACKS = ("could not queue", "no batch answered", "holds a placement already", "batch: decided")


def count_bytes() -> list[int]:
    """Count every byte this process reads from a socket from now on (TLS payload, or plain): [total]."""
    import socket
    import ssl

    total = [0]

    def counted(read):
        def recv_into(self, buffer, *args, **kwargs):
            n = read(self, buffer, *args, **kwargs)
            total[0] += n or 0
            return n
        return recv_into

    ssl.SSLSocket.recv_into = counted(ssl.SSLSocket.recv_into)
    socket.socket.recv_into = counted(socket.socket.recv_into)
    return total


def count_requests() -> Counter:
    """Count every HTTP request this process makes through urllib3 (the Kubernetes client's) from now on,
    by `request_kind`: what each placement asks of the API server, beside the bytes it reads."""
    from urllib3.connectionpool import HTTPConnectionPool

    kinds: Counter = Counter()
    urlopen = HTTPConnectionPool.urlopen

    def counted(self, method, url, *args, **kwargs):
        kinds[request_kind(method, url)] += 1
        return urlopen(self, method, url, *args, **kwargs)

    HTTPConnectionPool.urlopen = counted
    return kinds


def request_kind(method: str, url: str) -> str:
    """"PATCH configmaps", "GET nodes", "LIST pods", "WATCH nodes", "PUT leases", ...: a Kubernetes request
    by verb and resource (subresource after a slash), from its method and path."""
    path, _, query = url.partition("?")
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        parts = parts[2:]
    elif parts[:1] == ["apis"]:
        parts = parts[3:]
    else:
        return f"{method} {path or '/'}"
    if len(parts) > 2 and parts[0] == "namespaces":
        parts = parts[2:]
    resource = "/".join(parts[:1] + parts[2:3])
    if method == "GET" and len(parts) < 2:
        method = "WATCH" if "watch=true" in query.lower() or "watch=1" in query else "LIST"
    return f"{method} {resource}"


def job(n: int) -> dict:
    return {"name": f"burst-{n:03d}", "image": "busybox", "command": ["true"], "gpus": 1, "cpu": "1", "memory": "1Gi",
            "queue_timeout_seconds": QUEUE_TIMEOUT_SECONDS}


def _acting_as(connections: Path | None) -> None:
    """This process talks to Kubernetes as the identity of `connections` (its kubernetes_default), as an
    Airflow worker or the placer does in a cluster, rather than as the local cloud's admin (whom priority
    and fairness exempts from every queue)."""
    if connections is not None:
        export_connections(connections)


def _place(ns: list[int], go, ready, results, steps_as: Path | None = None, nice: int = 0) -> None:
    """Place steps in a forked process (one per thread): each books until committed or the queue timeout.
    `nice`: this process's niceness (see `burst`)."""
    os.nice(nice)
    _acting_as(steps_as)
    counted, requests = count_bytes(), count_requests()
    set_up = threading.Barrier(len(ns) + 1)        # passed twice: every thread set up, then counted from here
    threads = [threading.Thread(target=_one, args=(n, go, ready, results, set_up)) for n in ns]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):     # a thread failed in its set-up (reported)
        set_up.wait()
    began, before = own_cpu_s(), Counter(requests)
    with contextlib.suppress(threading.BrokenBarrierError):
        set_up.wait()
    for t in threads:
        t.join()
    results.put({"process_bytes": counted[0], "cpu_s": own_cpu_s() - began, "requests": requests - before})


def _one(n: int, go, ready, results, set_up: threading.Barrier) -> None:
    try:
        _book(n, go, ready, results, set_up)
    except BaseException as exc:
        set_up.abort()          # its process must not wait for its set-up
        results.put({"n": n, "outcome": None, "error": f"{type(exc).__name__}: {exc}", "reads": 0, "conflicts": 0,
                     "deferrals": 0, "began": time.time(), "ended": time.time()})


def _placer(go, ready, stop, results, placer_as: Path | None = None) -> None:
    """The placer process: its view started (bytes counted apart), then it leads until `stop`."""
    _acting_as(placer_as)
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle.booking import Booker
    from gpuboot.lifecycle.ledger import ReservationLedger
    from gpuboot.lifecycle.placer import Placer
    from gpuboot.lifecycle.view import ClusterView

    counted, requests = count_bytes(), count_requests()
    log = logging.getLogger("burst.placer")
    kube, ecs = KubeClient(), EcsHook()
    view = ClusterView(kube, ecs, log=log)
    placer = Placer(Booker(kube, ecs, ReservationLedger(kube), log), view, name="bench")
    began = time.monotonic()
    view.start()
    view.basis(placer.booker.ledger.name, placer.booker.ledger.snapshot(), time.time())   # instances described
    start = {"startup_bytes": counted[0], "startup_s": round(time.monotonic() - began, 1)}
    done, released = threading.Event(), []
    threading.Thread(target=lambda: (stop.wait(), done.set()), daemon=True).start()
    threading.Thread(target=lambda: (go.wait(), released.append(Counter(requests))), daemon=True).start()
    ready.put({**start, "me": placer.me})
    placer.run(done)
    results.put({"placer": {**start, "bytes": counted[0] - start["startup_bytes"],
                            "full_reads": placer.booker.full_reads, "describe_batches": view.describes,
                            "lists": view.nodes.lists + view.pods.lists, "gone": view.nodes.gone + view.pods.gone,
                            "resumes": view.nodes.resumes + view.pods.resumes,
                            "requests": requests - released[0] if released else Counter()}})


def _book(n: int, go, ready, results, set_up: threading.Barrier) -> None:
    from gpuboot.core.jobspec import JobSpec
    from gpuboot.hooks.ecs import EcsError, EcsHook
    from gpuboot.hooks.kube import KubeClient
    from gpuboot.lifecycle import batching, booking
    from gpuboot.lifecycle.ledger import LedgerConflict, ReservationLedger

    reads, conflicts, alone = [0], [0], []

    class Counting(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "re-plac" in message or "conflict" in message or "batch kept" in message:
                conflicts[0] += 1
            for why in FALLBACKS:
                if why in message:
                    alone.append(why)

    log = logging.getLogger(f"burst.{n}")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(Counting())
    kube, ecs = KubeClient(), EcsHook()
    ecs.get_conn()                  # client set-up, as a worker has it before the step
    # the place step's checks (`check_namespace` first) run before its transaction, on the connection the
    # transaction then uses: its TLS handshake is not the transaction's
    kube.namespace_exists("default")
    spec = JobSpec.from_dict(job(n))
    booker = booking.Booker(kube, ecs, ReservationLedger(kube), log)
    rng = random.Random(n)
    set_up.wait()
    set_up.wait()       # its process counts its requests and CPU from here
    ready.put(n)
    go.wait()
    began = time.time()
    deadline = began + spec.queue_timeout_seconds
    outcome, error, deferrals = None, None, 0
    while True:
        try:
            outcome = batching.book_first(booker, spec, f"burst-{n:03d}").plan.outcome.value
            break
        except (booking.LedgerContended, LedgerConflict, EcsError) as exc:
            if isinstance(exc, EcsError) and exc.kind != "transient":
                raise
            if not DEFERS or time.time() >= deadline:
                error = f"{type(exc).__name__}: {exc}"
                break
            deferrals += 1
            time.sleep(rng.uniform(*DEFER_SECONDS))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            break
    reads[0] = booker.full_reads
    results.put({"n": n, "outcome": outcome, "error": error, "reads": reads[0], "conflicts": conflicts[0],
                 "deferrals": deferrals, "alone": alone, "began": began, "ended": time.time()})


def _ledger_size(kube) -> int:
    """Bytes of the largest ledger object (root or shard): what the 1 MiB limit applies to."""
    from gpuboot.lifecycle.ledger import ReservationLedger

    return max(ReservationLedger(kube).sizes().values(), default=0)


def burst(jobs: int, kube, placer: bool = False, per_process: int = 1, steps_as: Path | None = None,
          placer_as: Path | None = None, cloud_pid: int | None = None, steps_nice: int = 0) -> dict:
    """`jobs` place transactions released at once, `per_process` of them (threads) in each forked process;
    with `placer`, a placer process leads from its view (started first, its start-up counted apart).
    `steps_as`, `placer_as`: connections files of the identities they act as (None: the admin's).
    `cloud_pid`: the local cloud's process, whose parts' CPU is counted from the release (`cpu_s`).
    `steps_nice` > 0: the place steps' processes yield the CPU to everything else here (the control plane,
    the local cloud's kubelets, the placer), as Airflow workers on machines of their own would."""
    from gpuboot.hooks.ecs import EcsHook
    from gpuboot.lifecycle.ledger import ReservationLedger

    kube.core, EcsHook().get_conn()     # the clients' modules imported before the fork, as in a prefork worker
    ctx = mp.get_context("fork")
    go, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    started, stop_placer, placer_proc = {}, ctx.Event(), None
    if placer:
        placer_proc = ctx.Process(target=_placer, args=(go, ready, stop_placer, results, placer_as), daemon=True)
        placer_proc.start()
        started = _placer_ready(ready, placer_proc, time.monotonic() + 900)
        led = time.monotonic() + 120
        while _leader(kube) != started["me"] and time.monotonic() < led:
            time.sleep(0.2)
    groups = [list(range(i, min(jobs, i + per_process))) for i in range(0, jobs, per_process)]
    procs = [ctx.Process(target=_place, args=(g, go, ready, results, steps_as, steps_nice), daemon=True)
             for g in groups]
    for p in procs:
        p.start()
    waiting = 0
    with contextlib.suppress(queue.Empty):
        while waiting < jobs:           # every job set up (its clients made) and waiting
            ready.get(timeout=300)
            waiting += 1
    peak, stop = [0], threading.Event()

    def watch_size():
        while not stop.wait(0.5):
            with contextlib.suppress(Exception):
                peak[0] = max(peak[0], _ledger_size(kube))

    watcher = threading.Thread(target=watch_size, daemon=True)
    watcher.start()
    # the same parts' CPU over a quiet window first (every job waiting to be released, the placer leading an
    # empty queue): what the fleet's kubelets, leases and controllers cost with no burst at all
    quiet = (processes(), machine_busy_s(), own_cpu_s())
    time.sleep(QUIET_SECONDS)       # the measured window itself: nothing to wait for
    cpu_before = (processes(), machine_busy_s(), own_cpu_s())
    cpu_quiet = cpu_used(quiet, cpu_before, QUIET_SECONDS, cloud_pid,
                         [used_between(quiet[0], cpu_before[0], p.pid) for p in procs],
                         used_between(quiet[0], cpu_before[0], placer_proc.pid) if placer_proc is not None else None)
    released = time.time()
    go.set()
    rows, process_bytes, process_cpu, placer_row, step_requests = [], [], [], {}, Counter()
    give_up = released + QUEUE_TIMEOUT_SECONDS + 60
    while (len(rows) < jobs or len(process_bytes) < len(procs)) and time.time() < give_up:
        try:
            got = results.get(timeout=5)
        except queue.Empty:
            continue
        if "process_bytes" in got:
            process_bytes.append(got["process_bytes"])
            process_cpu.append(got["cpu_s"])
            step_requests += got["requests"]
        else:
            rows.append(got)
    # the placer still runs here (the place steps may have ended: they count their own CPU)
    cpu_after, window = (processes(), machine_busy_s(), own_cpu_s()), time.time() - released
    for p in procs:
        p.join(timeout=max(0.1, give_up - time.time()))
        if p.is_alive():
            p.kill()
    if placer_proc is not None:
        stop_placer.set()
        with contextlib.suppress(queue.Empty):
            placer_row = results.get(timeout=60)["placer"]
        placer_proc.join(timeout=30)
        if placer_proc.is_alive():
            placer_proc.kill()
    cpu = cpu_used(cpu_before, cpu_after, window, cloud_pid, process_cpu,
                   used_between(cpu_before[0], cpu_after[0], placer_proc.pid) if placer_proc is not None else None)
    seen = {r["n"] for r in rows}
    rows += [{"n": n, "outcome": None, "error": "no answer before the queue timeout", "reads": 0, "conflicts": 0,
              "deferrals": 0, "began": released, "ended": time.time()} for n in range(jobs) if n not in seen]
    stop.set()
    watcher.join(timeout=5)
    end_size = _ledger_size(kube)
    placed = [r for r in rows if r["outcome"] == "fits"]
    failed = [r for r in rows if r["outcome"] != "fits"]
    wall = max(r["ended"] for r in rows) - released
    reads = [r["reads"] for r in rows]
    for name in ReservationLedger(kube).sizes():        # the next burst starts from an empty ledger
        kube.core.delete_namespaced_config_map(name, "default")
    n = max(1, len(placed))
    burst_bytes = sum(process_bytes) + placer_row.get("bytes", 0)
    return {"jobs": jobs, "placer": placer, "jobs_per_process": per_process, "placed": len(placed),
            "failed": len(failed), "failures": sorted({r["error"] or r["outcome"] for r in failed})[:5],
            "wall_s": round(wall, 1), "placements_per_s": round(len(placed) / wall, 2) if wall else None,
            # when the answers came (seconds after the release): the first batch's latency, then the pace
            "answered_s": {f"p{q}": round(statistics.quantiles([r["ended"] - released for r in rows], n=100,
                                                               method="inclusive")[q - 1], 1)
                           for q in (1, 10, 50, 90)} if len(rows) > 1 else None,
            "reads_per_placement_mean": round((sum(reads) + placer_row.get("full_reads", 0)) / n, 2),
            "reads_median": statistics.median(reads), "reads_max": max(reads),
            "conflicts": sum(r["conflicts"] for r in rows), "deferrals": sum(r["deferrals"] for r in rows),
            "left_the_batch": dict(Counter(why for r in rows for why in r.get("alone", ()))),
            "ledger_peak_bytes": max(peak[0], end_size), "ledger_end_bytes": end_size,
            "api_bytes_per_placement": round(burst_bytes / n),
            "api_bytes_per_placement_jobs": round(sum(process_bytes) / n),
            "api_bytes_per_placement_leader": round(placer_row.get("bytes", 0) / n) if placer else None,
            "api_bytes_per_placement_amortised": round((burst_bytes + placer_row.get("startup_bytes", 0)) / n),
            "cpu_s": cpu, "cpu_s_quiet": {"window_s": QUIET_SECONDS, **cpu_quiet},
            # Kubernetes requests per placement from the release, by verb and resource (`request_kind`)
            "requests_per_placement": {"place steps": per_placement(step_requests, n),
                                       "placer": per_placement(placer_row.get("requests", Counter()), n)},
            "placer_startup_bytes": placer_row.get("startup_bytes"), "placer_startup_s": placer_row.get("startup_s"),
            "placer_view": {k: placer_row.get(k) for k in ("full_reads", "describe_batches", "lists", "gone",
                                                            "resumes")} if placer else None}


def per_placement(kinds: Counter, n: int) -> dict[str, float]:
    return {kind: round(count / n, 2) for kind, count in kinds.most_common()}


def cpu_used(before: tuple, after: tuple, window: float, cloud_pid: int | None, steps: list[float],
             placer: float | None) -> dict:
    """CPU seconds used between two snapshots (the release and the last answer; or the quiet window before
    the release): by the local cloud's parts (kube-apiserver, etcd, ... and the rest of the cloud), the
    placer, the place steps (every job process), this process, and whatever else ran ("other": the
    machine's busy time less all of those), beside what the machine's cores could give in that window."""
    (table0, busy0, me0), (table1, busy1, me1) = before, after
    used = {}
    if cloud_pid is not None:
        start = cloud_parts(cloud_pid, table0)
        used = {part: s - start.get(part, 0.0) for part, s in cloud_parts(cloud_pid, table1).items()}
    used |= {"placer": placer or 0.0, "place steps": sum(steps), "bench": me1 - me0}
    used["other"] = (busy1 - busy0) - sum(used.values())
    return {**{k: round(v, 1) + 0.0 for k, v in used.items()}, "machine busy": round(busy1 - busy0, 1),
            "machine cores x window": round((os.cpu_count() or 1) * window, 1)}


def _placer_ready(ready, placer_proc, deadline: float) -> dict:
    """The placer's start-up row once its view is ready; an error as soon as its process has ended instead
    (a crash: its traceback is in this part's log), not at the deadline."""
    while True:
        try:
            return ready.get(timeout=2)
        except queue.Empty:
            if not placer_proc.is_alive():
                raise RuntimeError(f"the placer process ended (exit code {placer_proc.exitcode}) before its view "
                                   "was ready; its traceback is in this part's log") from None
            if time.monotonic() >= deadline:
                raise


def _leader(kube) -> str | None:
    from gpuboot.lifecycle.ledger import ReservationLedger

    return ReservationLedger(kube).snapshot().batch.led_by(time.time())


def run(workdir: Path, quick: bool = False, sizes=None, bursts=None, placer: bool = False,
        per_process: int = 1, steps_nice: int = 0) -> dict:
    from gpuboot.hooks.kube import KubeClient

    sizes = sizes or ((100,) if quick else SIZES)
    bursts = bursts or ((50,) if quick else BURSTS)
    rows = []
    for size in sizes:
        with local_cloud(fleet(size), workdir / f"cloud-{size}", ready_timeout=1800) as cloud:
            # the place steps and the placer as the ServiceAccounts deploy/kubernetes/rbac.yaml makes, their
            # requests queued by flowcontrol.yaml where the API server has priority and fairness
            steps_as, placer_as = cloud.gpuboot_connections(), cloud.placer_connections()
            flow_control = cloud.apply_flow_control()
            kube = KubeClient()
            pods, named = len(kube.list_active_pods()), size * 4 // 5 * PODS_PER_NODE
            if pods < named:                            # a row must be measured on the fleet it names
                raise RuntimeError(f"the {size}-node fleet has {pods} active pods, not the {named} its row would claim")
            for jobs in bursts:
                rows.append({"nodes": size, "pods": named, "flow_control": flow_control,
                             **burst(jobs, kube, placer, per_process, steps_as, placer_as, cloud.process.pid,
                                     steps_nice)})
                print(f"burst: {rows[-1]}", flush=True)
    growth = {}
    for jobs in bursts:
        same = [r for r in rows if r["jobs"] == jobs and r["placed"]]
        if len(same) >= 2:
            growth[f"{jobs} jobs"] = round(growth_exponent(same[0]["nodes"], same[0]["api_bytes_per_placement_amortised"],
                                                           same[-1]["nodes"], same[-1]["api_bytes_per_placement_amortised"]), 2)
    return {"rows": rows, "queue_timeout_s": QUEUE_TIMEOUT_SECONDS, "cores": os.cpu_count(),
            "bytes_growth_exponent": growth,
            "note": ("a placer process leads from its watch-fed view; " if placer else "a place step leads; ")
            + "the place steps act as ServiceAccount gpuboot, the placer as gpuboot-placer (deploy/kubernetes), "
              "queued by flowcontrol.yaml where flow_control; "
            + f"{per_process} place transaction(s) per forked process, all released at once"
            + (f", at niceness {steps_nice}; " if steps_nice else "; ")
            + "reads = full cluster reads (Nodes + Pods + ECS) per placement; bytes = API bytes read, all processes"}
