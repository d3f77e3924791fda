"""The demo: the local cloud, Airflow standalone, and one `gpu_job` run that needs a stopped GPU node.

`make demo` runs this. It starts simcloud with the demo fleet, starts `airflow standalone`
(SQLite, AIRFLOW_HOME under the demo folder, this repo's dags/ and plugins/, the cloud's
connections as AIRFLOW_CONN_* variables: Kubernetes as the ServiceAccount of the shipped
deploy/kubernetes/rbac.yaml, applied with namespace.yaml first), triggers `gpu_job` through the REST API for a
job only a stopped node can hold, and follows it: task states as they change, then the
pod's log lines from the launch task's log. Then it shows the idle scale-down (which runs
from the start, unpaused) stopping the node the job booted: it triggers
`gpuboot_idle_scaledown` with a short idle time (DEMO_IDLE_MINUTES, default 0.25; the
DAG's own default is 10) until that node's instance is Stopped. Airflow then stays up
until Ctrl-C.

DEMO_JOB=gang (`make demo-gang`) runs a 2-rank gang instead (scripts/gang_rendezvous.py),
2 GPUs per rank, which only two stopped nodes can hold: both boot, the ranks rendezvous at rank
0's pod IP and exchange a message, and both ranks' log lines show from the launch task's log.

Environment: DEMO_ONESHOT=1 exits after the job and the scale-down (0 = the job succeeded,
its pods' expected lines reached the launch task's log and the nodes it booted were stopped
again; otherwise the failing task's log is printed and the status is 1). DEMO_DIR (default .demo/), DEMO_PASSWORD
(default admin), DEMO_FLEET (default simcloud/fleets/demo.yaml).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "plugins"), str(REPO)]

from gpuboot.core.idle import DEFAULT_SPARE_SECONDS  # noqa: E402
from simcloud.harness import SimCloud, interrupts_held  # noqa: E402  (needs the repo on sys.path)
from simcloud.harness import wait_until as testing_wait_until  # noqa: E402

DAG_ID = "gpu_job"
SCALEDOWN_DAG_ID = "gpuboot_idle_scaledown"
ADMIN_USER = "admin"
# The job: 2 GPUs, which only a stopped node of the demo fleet can hold.
JOB = {
    "name": "demo-train",
    "image": "python:3.11-slim",
    "command": [
        "python",
        "-c",
        ("import time\n"
        "for epoch in range(1, 11):\n"
        "    print(f'epoch {epoch}/10 loss={2.0 / epoch:.3f} gpus=2', flush=True)\n"
        "    time.sleep(1)\n"
        "print('training done, checkpoint saved', flush=True)\n"),
    ],
    "gpus": 2,
    "cpu": "2",
    "memory": "8Gi",
}
# The gang: 2 ranks of 2 GPUs each, so two stopped nodes must boot; they rendezvous and talk.
GANG_JOB = {
    "name": "demo-gang",
    "image": "python:3.11-slim",
    "command": ["python", "-c", (REPO / "scripts" / "gang_rendezvous.py").read_text()],
    "env": {"RENDEZVOUS_TAG": "demo-gang"},
    "replicas": 2,
    "gpus": 2,
    "cpu": "2",
    "memory": "8Gi",
}
# DEMO_JOB -> (the job, lines its launch log must show for the demo to count as a success)
JOBS = {
    "train": (JOB, ["training done, checkpoint saved"]),
    "gang": (GANG_JOB, ["demo-gang rank 0 got: hello from rank 1", "demo-gang rank 1 got: welcome from rank 0"]),
}
FINISHED = {"success", "failed"}
POD_LINE = re.compile(r"^(?P<line>\[rank \d+\] .*)$")     # the launch trigger's rank-prefixed pod lines


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and where to look."""


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def wait_until(what: str, predicate: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
    """simcloud.harness.wait_until, failing with a DemoError that names what we waited for."""
    try:
        return testing_wait_until(predicate, timeout, interval)
    except TimeoutError:
        raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conn_env(connections_file: Path) -> dict[str, str]:
    """AIRFLOW_CONN_<ID> variables (JSON form) from the cloud's connections file."""
    connections = json.loads(connections_file.read_text())
    return {
        f"AIRFLOW_CONN_{conn_id.upper()}": value if isinstance(value, str) else json.dumps(value)
        for conn_id, value in connections.items()
    }


def sqlite_database(home: Path) -> str:
    """The demo's metadata database URL: SQLite in WAL mode.

    Airflow standalone runs five processes on one SQLite file. In SQLite's default journal mode
    a reader blocks a writer, and a lock held past the driver's 5 s busy timeout fails the
    statement ("database is locked"): the API server answers 500. WAL lets readers and one
    writer go on together, so fewer statements meet a lock (the mode is kept in the file, so it
    is set before Airflow creates its tables). Writers still take turns, and one can still be
    failed: AirflowApi sends a call again. (A 30 s busy timeout was tried: in CI the API server
    then held a request past the client's 30 s, with the scheduler's task calls waiting behind it.)
    """
    path = home / "airflow.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode != "wal":
        raise DemoError(f"{path}: SQLite would not use WAL mode (got {mode!r})")
    return f"sqlite:///{path}"


def airflow_env(home: Path, port: int, password_file: Path, connections_file: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_"))}
    env.update(
        {
            "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",  # standalone runs `airflow` from PATH
            "PYTHONPATH": os.pathsep.join([str(REPO / "plugins"), str(REPO)]),
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlite_database(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            # New DAGs are created paused, as in many deployments: the recurring YAML jobs would otherwise
            # run at once (their latest interval is due) and compete with the demo job for the GPUs.
            # gpu_job is unpaused at trigger; the idle scale-down runs from the start on its own.
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(password_file),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "300",
        }
    )
    env.update(conn_env(connections_file))
    return env


@contextlib.contextmanager
def running_cloud(fleet: Path, workdir: Path) -> Iterator[SimCloud]:
    say(f"starting the local cloud with fleet {fleet.relative_to(REPO) if fleet.is_relative_to(REPO) else fleet}")
    with SimCloud.start(fleet, workdir) as cloud:
        api = ("the real control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager "
               f"{kubernetes.client.VersionApi(cloud.core_v1().api_client).get_code().git_version})"
               if cloud.kube == "real" else "simcloud's own API server")
        say(f"local cloud ready on {api} (kubectl --kubeconfig {cloud.kubeconfig} get nodes -o wide)")
        try:
            yield cloud
        finally:
            ignore_interrupts()
            say("stopping the local cloud")


@contextlib.contextmanager
def running_airflow(env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen]:
    """`airflow standalone` in its own process group, always stopped with all its children."""
    say(f"starting airflow standalone (output in {log_path})")
    with interrupts_held() as release:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "airflow"), "standalone"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            release()   # an interrupt that came while standalone started is raised here, inside the try
            yield proc
        finally:
            ignore_interrupts()
            say("stopping airflow (a few seconds)")
            stop_group(proc)


def handle_interrupts() -> None:
    """Ctrl-C, `kill -INT` and SIGTERM all run the cleanup. SIGINT needs installing: a background job
    of a non-interactive shell (`make demo &` in a script) starts with SIGINT ignored (POSIX, for
    `&` without job control), and Python keeps an inherited SIG_IGN instead of raising
    KeyboardInterrupt, so the demo would ignore SIGINT and only SIGTERM stopped it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def ignore_interrupts() -> None:
    """Cleanup has begun: a second Ctrl-C (or SIGTERM) must not cut it short and leak processes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def stop_group(proc: subprocess.Popen) -> None:
    """Interrupt standalone (it stops its components), then end whatever is left of its group."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(DemoError):
            wait_until("airflow processes to exit", lambda: not _group_alive(proc), grace, interval=0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap standalone itself so it does not count as alive
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False


class AirflowApi:
    """The few REST API v2 calls the demo needs, authenticated with a JWT from /auth/token.

    Each call is sent again while the server answers 5xx or not at all, for up to RETRY_SECONDS.
    On standalone's SQLite a statement that meets another process's lock fails after the driver's
    5 s busy timeout ("database is locked"), and the API server answers 500: Airflow's own task
    clients meet that and retry, and so does the demo. Every call it sends is safe to repeat: a run
    is triggered with an id of the demo's own, so a repeat finds it (409) rather than adding one."""

    RETRY_SECONDS = 120.0

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=30)

    def send(self, method: str, path: str, **kwargs) -> httpx.Response:
        deadline, delay = time.monotonic() + self.RETRY_SECONDS, 0.5
        while True:
            try:
                r = self.http.request(method, path, **kwargs)
                if r.status_code < 500:
                    return r
                problem = f"HTTP {r.status_code} {r.text[:200]}"
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay > deadline:
                raise DemoError(f"{method} {path}: the API server kept failing for {self.RETRY_SECONDS:.0f}s; "
                                f"last: {problem}")
            say(f"{method} {path}: {problem}; sending it again in {delay:.1f}s")
            time.sleep(delay)
            delay = min(8.0, delay * 2)

    def healthy(self) -> bool:
        try:
            health = self.http.get("/api/v2/monitor/health").json()
        except (httpx.HTTPError, ValueError):
            return False
        parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
        return all((health.get(p) or {}).get("status") == "healthy" for p in parts)

    def login(self, user: str, password: str) -> None:
        r = self.send("POST", "/auth/token", json={"username": user, "password": password})
        if r.status_code != 201:
            raise DemoError(f"login as {user!r} refused: HTTP {r.status_code}")
        self.http.headers["Authorization"] = f"Bearer {r.json()['access_token']}"

    def get(self, path: str, **params) -> httpx.Response:
        return self.send("GET", f"/api/v2{path}", params=params)

    def dag_loaded(self, dag_id: str) -> bool:
        if self.get(f"/dags/{dag_id}").status_code == 200:
            return True
        errors = self.get("/importErrors").json().get("import_errors", [])
        for error in errors:
            if Path(error.get("filename", "")).name == f"{dag_id}.py":
                raise DemoError(f"{error['filename']} failed to import:\n{error.get('stack_trace')}")
        return False

    def is_paused(self, dag_id: str) -> bool:
        return bool(self.get(f"/dags/{dag_id}").json()["is_paused"])

    def trigger(self, dag_id: str, conf: dict, unpause: bool = True) -> str:
        if unpause:
            r = self.send("PATCH", f"/api/v2/dags/{dag_id}", json={"is_paused": False})
            if r.status_code >= 300:
                raise DemoError(f"unpausing {dag_id} refused: HTTP {r.status_code} {r.text}")
        run_id = f"demo__{time.strftime('%Y%m%dT%H%M%S')}__{secrets.token_hex(4)}"
        r = self.send("POST", f"/api/v2/dags/{dag_id}/dagRuns",
                      json={"dag_run_id": run_id, "logical_date": None, "conf": conf})
        if r.status_code == 409 and self.get(f"/dags/{dag_id}/dagRuns/{run_id}").status_code == 200:
            return run_id                # a repeat of a request whose first answer was lost: the run is there
        if r.status_code >= 300:
            raise DemoError(f"trigger of {dag_id} refused: HTTP {r.status_code} {r.text}")
        return r.json()["dag_run_id"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.get(f"/dags/{dag_id}/dagRuns/{run_id}").json()["state"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]

    def log_events(self, dag_id: str, run_id: str, ti: dict) -> list[str]:
        """A task try's log: the text of each structured entry (may span lines)."""
        try_number = max(ti.get("try_number") or 1, 1)
        r = self.get(
            f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/{try_number}",
            full_content="true",
            map_index=ti.get("map_index", -1),
        )
        if r.status_code != 200:
            return []
        return [str(e.get("event", "")) if isinstance(e, dict) else str(e) for e in r.json().get("content", [])]


class CloudWatcher:
    """Prints each GPU node's ECS status, Ready condition and allocatable GPUs when they change."""

    def __init__(self, cloud: SimCloud):
        self.cloud, self.seen = cloud, {}

    def poll(self, started: float, show: bool = True) -> None:
        state = self.cloud.state()
        instances = {i["name"]: i["status"] for i in state["instances"]}
        for node in sorted(state["nodes"], key=lambda n: n["name"]):
            if node.get("allocatable_gpu") is None:
                continue
            line = (f"ECS {instances.get(node['name'], '?'):<8} Ready={node['ready']:<7} "
                    f"nvidia.com/gpu={node['allocatable_gpu']}")
            if self.seen.get(node["name"]) != line:
                self.seen[node["name"]] = line
                if show:
                    say(f"{time.monotonic() - started:6.1f}s  node {node['name']:<21} {line}")


def follow(api: AirflowApi, cloud: SimCloud, run_id: str, timeout: float) -> tuple[str, list[str]]:
    """Print node and task state changes, the placement decision and the pods' log lines (while
    launch runs deferred, too) until the run ends; returns the run's state and those lines."""
    started = time.monotonic()
    watcher = CloudWatcher(cloud)
    states: dict[str, str] = {}
    shown: dict[str, int] = {}
    pod_lines: list[str] = []
    while True:
        state = api.run_state(DAG_ID, run_id)
        watcher.poll(started)
        for ti in sorted(api.task_instances(DAG_ID, run_id), key=lambda t: t.get("start_date") or "~"):
            key, now, short = ti["task_id"], ti.get("state"), ti["task_id"].rsplit(".", 1)[-1]
            if now and states.get(key) != now:
                states[key] = now
                say(f"{time.monotonic() - started:6.1f}s  task {key:<26} {now}")
                if now in FINISHED:      # the place step's table, and every step's summary line
                    wanted = ("placement of job", "decision:", "summary:") if short == "place" else ("summary:",)
                    for event in api.log_events(DAG_ID, run_id, ti):
                        if event.startswith(wanted):
                            print("\n".join(f"    {short} | {line}" for line in event.splitlines()), flush=True)
            if short == "launch" and now in {"running", "deferred", "success", "failed", "up_for_retry"}:
                lines = [m["line"] for e in api.log_events(DAG_ID, run_id, ti) for m in [POD_LINE.match(e)] if m]
                for line in lines[shown.get(key, 0):]:
                    print(f"    pod | {line}", flush=True)
                pod_lines += lines[shown.get(key, 0):]
                shown[key] = max(shown.get(key, 0), len(lines))
        if state in FINISHED:
            say(f"run {run_id} finished: {state}")
            return state, pod_lines
        if time.monotonic() - started > timeout:
            raise DemoError(f"run {run_id} still {state} after {timeout:.0f}s")
        time.sleep(1)


def print_failed_logs(failed: list[dict], api: AirflowApi, run_id: str, dag_id: str = DAG_ID) -> None:
    for ti in failed:
        say(f"log of failed task {ti['task_id']}:")
        for event in api.log_events(dag_id, run_id, ti):
            print("\n".join(f"    {line}" for line in event.splitlines()), flush=True)


def instance_statuses(cloud: SimCloud) -> dict[str, str]:
    return {i["name"]: i["status"] for i in cloud.state()["instances"]}


def scale_down(api: AirflowApi, cloud: SimCloud, booted: list[str], idle_minutes: float, timeout: float) -> bool:
    """Trigger the idle scale-down (short idle time) until every node in `booted` is Stopped; print
    each run's verdict for them. True when they all were stopped within `timeout`."""
    if api.is_paused(SCALEDOWN_DAG_ID):
        raise DemoError(f"{SCALEDOWN_DAG_ID} is paused: it must run from the start (is_paused_upon_creation)")
    say(f"{SCALEDOWN_DAG_ID} is unpaused (every 5 min, idle_minutes 10, spare_minutes {DEFAULT_SPARE_SECONDS / 60:g}: "
        f"the last idle node whose GPUs no other running node could replace is kept that much longer); "
        f"triggering it with idle_minutes {idle_minutes:g} and spare_minutes 0 to show it stopping {', '.join(booted)}")
    started, watcher = time.monotonic(), CloudWatcher(cloud)
    watcher.poll(started, show=False)       # from here on, print only what changes

    def finished(run_id: str) -> str | None:
        watcher.poll(started)
        state = api.run_state(SCALEDOWN_DAG_ID, run_id)
        return state if state in FINISHED else None

    while True:
        run_id = api.trigger(SCALEDOWN_DAG_ID, {"idle_minutes": idle_minutes, "spare_minutes": 0, "dry_run": False},
                             unpause=False)
        state = wait_until(f"{SCALEDOWN_DAG_ID} run {run_id}", lambda: finished(run_id), timeout=timeout)
        tis = api.task_instances(SCALEDOWN_DAG_ID, run_id)
        for ti in tis:
            for event in api.log_events(SCALEDOWN_DAG_ID, run_id, ti):
                if any(event.startswith(node) for node in booted):
                    print(f"    scale-down | {event}", flush=True)
        if state != "success":
            print_failed_logs(tis, api, run_id, SCALEDOWN_DAG_ID)
            return False
        watcher.poll(started)
        statuses = instance_statuses(cloud)
        if all(statuses.get(node) == "Stopped" for node in booted):
            say(f"scale-down stopped {', '.join(booted)} (StopCharging): nothing is left running idle")
            return True
        if time.monotonic() - started > timeout:
            say(f"scale-down did not stop {booted} within {timeout:.0f}s: {statuses}")
            return False


def main() -> int:
    oneshot = os.environ.get("DEMO_ONESHOT") == "1"
    job_kind = os.environ.get("DEMO_JOB", "train")
    if job_kind not in JOBS:
        say(f"FAILED: DEMO_JOB={job_kind!r} is not one of {sorted(JOBS)}")
        return 2
    demo_dir = Path(os.environ.get("DEMO_DIR", REPO / ".demo")).resolve()
    password = os.environ.get("DEMO_PASSWORD", "admin")
    fleet = Path(os.environ.get("DEMO_FLEET", REPO / "simcloud" / "fleets" / "demo.yaml")).resolve()

    for part in ("airflow", "cloud"):  # every demo starts from a fresh cloud and database
        shutil.rmtree(demo_dir / part, ignore_errors=True)
    home = demo_dir / "airflow"
    home.mkdir(parents=True)
    password_file = home / "passwords.json"
    password_file.write_text(json.dumps({ADMIN_USER: password}) + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    handle_interrupts()
    try:
        with running_cloud(fleet, demo_dir / "cloud") as cloud:
            connections = cloud.gpuboot_connections()   # the product runs with the rights it ships
            say("applied deploy/kubernetes/{namespace,rbac}.yaml; Airflow acts as ServiceAccount gpuboot/gpuboot")
            env = airflow_env(home, port, password_file, connections)
            with running_airflow(env, home / "standalone.log") as proc:
                api = AirflowApi(url)
                try:
                    wait_until(
                        "Airflow to be healthy",
                        lambda: api.healthy() or (proc.poll() is not None and _died(proc)),
                        timeout=300,
                    )
                except DemoError:
                    _tail(home / "standalone.log")
                    raise
                api.login(ADMIN_USER, password)
                say(f"Airflow UI: {url}   login: {ADMIN_USER} / {password}   GPU fleet: {url}/plugin/gpu-fleet")
                for dag_id in (DAG_ID, SCALEDOWN_DAG_ID):
                    wait_until(f"DAG {dag_id} to be parsed", lambda: api.dag_loaded(dag_id), timeout=180)
                job, expected = JOBS[job_kind]
                say(f"triggering {DAG_ID}: {job.get('replicas', 1)} pod(s) of {job['gpus']} GPUs, cpu {job['cpu']}, "
                    f"memory {job['memory']}")
                before = instance_statuses(cloud)
                run_id = api.trigger(DAG_ID, job)
                say(f"run {run_id}: {url}/dags/{DAG_ID}/runs/{run_id}")
                state, pod_lines = follow(api, cloud, run_id, timeout=600)
                failed = [ti for ti in api.task_instances(DAG_ID, run_id) if ti.get("state") == "failed"]
                missing = [e for e in expected if not any(e in line for line in pod_lines)]
                if missing:
                    say(f"the launch log is missing {missing}")
                ok = state == "success" and not failed and not missing  # judged by the tasks and logs too
                if ok:
                    say("the job succeeded")
                else:
                    say(f"the job FAILED (run {state}; failed tasks: {[ti['task_id'] for ti in failed]})")
                    print_failed_logs(failed, api, run_id)
                booted = sorted(n for n, status in instance_statuses(cloud).items()
                                if before.get(n) == "Stopped" and status != "Stopped")
                if ok and booted:
                    idle_minutes = float(os.environ.get("DEMO_IDLE_MINUTES", "0.25"))
                    ok = scale_down(api, cloud, booted, idle_minutes, timeout=300)
                if oneshot:
                    return 0 if ok else 1
                say(f"Airflow stays up for exploring: {url}  login: {ADMIN_USER} / {password}")
                say(f"kubectl --kubeconfig {cloud.kubeconfig} get nodes,pods -o wide")
                say("the recurring YAML jobs (dags/jobs/) are loaded paused: unpause one in the UI to run it")
                say("press Ctrl-C to stop everything")
                while proc.poll() is None:
                    time.sleep(1)
                raise DemoError(f"airflow standalone exited with status {proc.returncode}")
    except KeyboardInterrupt:
        say("interrupted; everything is stopped")
        return 0 if not oneshot else 130
    except DemoError as e:
        say(f"FAILED: {e}")
        if (home / "standalone.log").exists():   # a refused request's cause is in the API server's output
            say(f"the API server's last lines (all of Airflow's output: {home / 'standalone.log'}):")
            _tail(home / "standalone.log", only="api-server")
        return 1


def _died(proc: subprocess.Popen) -> bool:
    raise DemoError(f"airflow standalone exited early with status {proc.returncode}")


def _tail(path: Path, lines: int = 40, only: str = "") -> None:
    """The last `lines` lines of `path`, or of those lines in it that start with `only`
    (standalone prefixes each line with its component's name)."""
    with contextlib.suppress(OSError):
        kept = [line for line in path.read_text(errors="replace").splitlines() if line.startswith(only)]
        for line in kept[-lines:]:
            print(f"    {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
