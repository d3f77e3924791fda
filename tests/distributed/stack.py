"""The distributed stack: PostgreSQL, Redis and Airflow 3.3 on CeleryExecutor, as separate processes.

    with Processes(workdir / "logs") as procs:
        pg = start_postgres(procs, workdir / "pg")
        broker = start_redis(procs, workdir / "redis")
        airflow = start_airflow(procs, workdir / "airflow", pg, broker, dags_folder, connections_file)
        airflow.api   # an authenticated scripts.demo.AirflowApi

Everything listens on 127.0.0.1 on free ports; nothing here installs anything (the
Makefile's `test-distributed` target installs postgresql and redis-server when missing).
"""
from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography.fernet import Fernet

from scripts.demo import AirflowApi, conn_env, free_port
from simcloud.harness import wait_until
from tests.distributed.processes import Processes

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
ADMIN = "admin"
AIRFLOW_LAYER = 1  # stopped before PostgreSQL and Redis (layer 0), all components together


def _pg_bin(name: str) -> str:
    """A PostgreSQL server binary: Debian keeps them under /usr/lib/postgresql/<major>/bin."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    path = found[-1] if found else shutil.which(name)
    if not path:
        raise RuntimeError(f"{name} not found: install PostgreSQL (`make test-distributed` does)")
    return path


@dataclass(frozen=True)
class Postgres:
    port: int
    user: str = "airflow"
    database: str = "airflow"

    def url(self, scheme: str = "postgresql+psycopg2") -> str:
        return f"{scheme}://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def connect(self, database: str | None = None):
        import psycopg2
        return psycopg2.connect(host="127.0.0.1", port=self.port, user=self.user,
                                dbname=database or self.database, connect_timeout=5)


def start_postgres(procs: Processes, datadir: Path, timeout: float = 60) -> Postgres:
    """A private cluster (initdb) served on 127.0.0.1 only, with an empty `airflow` database.

    PostgreSQL refuses to run as root, so as root it runs as the `postgres` user: the
    directory must then be reachable by that user (not under a 0700 pytest tmp dir)."""
    user = "postgres" if os.geteuid() == 0 else None
    datadir.mkdir(parents=True)
    if user:
        shutil.chown(datadir, user, user)
    pg = Postgres(free_port())
    subprocess.run([_pg_bin("initdb"), "-D", str(datadir / "data"), "-U", pg.user, "--auth=trust", "-E", "UTF8",
                    "--no-sync", "--no-instructions"], user=user, check=True, capture_output=True, timeout=120)
    # Fast shutdown on SIGINT (SIGTERM would wait for every client to leave).
    procs.start("postgres", [_pg_bin("postgres"), "-D", str(datadir / "data"), "-p", str(pg.port),
                             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={datadir}",
                             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                             "-c", "max_connections=200"], user=user, stop_signal=signal.SIGINT)
    wait_until(lambda: _accepts(pg, procs), timeout=timeout, interval=0.2,
               message=lambda: f"postgres not accepting connections in {timeout}s\n{procs.tails()}")
    conn = pg.connect("postgres")
    conn.autocommit = True
    try:
        conn.cursor().execute(f"CREATE DATABASE {pg.database}")
    finally:
        conn.close()
    return pg


def _accepts(pg: Postgres, procs: Processes) -> bool:
    import psycopg2
    procs.check_alive()
    try:
        pg.connect("postgres").close()
        return True
    except psycopg2.OperationalError:
        return False


@dataclass(frozen=True)
class Redis:
    port: int

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"


def start_redis(procs: Processes, workdir: Path, timeout: float = 30) -> Redis:
    """redis-server in the foreground, no persistence, on 127.0.0.1 only."""
    binary = shutil.which("redis-server")
    if not binary:
        raise RuntimeError("redis-server not found: install it (`make test-distributed` does)")
    workdir.mkdir(parents=True)
    broker = Redis(free_port())
    service = procs.start("redis", [binary, "--port", str(broker.port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--daemonize", "no", "--dir", str(workdir)])
    procs.wait_for_log(service, "Ready to accept connections", timeout)
    return broker


@dataclass
class Airflow:
    url: str
    home: Path
    env: dict[str, str]
    api: AirflowApi
    password: str


def airflow_env(home: Path, port: int, pg: Postgres, broker: Redis, dags_folder: Path,
                connections_file: Path) -> dict[str, str]:
    """One environment for every component, so secrets, URLs and folders agree across processes.

    PYTHONPATH is dropped on purpose: the components must find gpuboot through the plugins
    folder alone, as they do in the compose deployment (the triggerer loads no DAG bundle)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHONPATH"))}
    url = f"http://127.0.0.1:{port}"
    env.update({
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": pg.url(),
        "AIRFLOW__CELERY__BROKER_URL": broker.url(),
        "AIRFLOW__CELERY__RESULT_BACKEND": pg.url("db+postgresql+psycopg2"),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
        "AIRFLOW__API__BASE_URL": url,
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
    })
    env.update(conn_env(connections_file))
    return env


def start_airflow(procs: Processes, home: Path, pg: Postgres, broker: Redis, dags_folder: Path,
                  connections_file: Path, timeout: float = 300, extra_env: dict[str, str] | None = None) -> Airflow:
    """`airflow db migrate`, then api-server, scheduler, dag-processor, triggerer and a Celery
    worker as separate processes; returns once all report healthy and the worker is ready.
    `extra_env` is added to every component's environment (e.g. a larger worker concurrency)."""
    home.mkdir(parents=True)
    password = secrets.token_urlsafe(12)
    (home / "passwords.json").write_text(json.dumps({ADMIN: password}))
    port = free_port()
    env = {**airflow_env(home, port, pg, broker, dags_folder, connections_file), **(extra_env or {})}
    airflow = str(VENV_BIN / "airflow")
    migrate = subprocess.run([airflow, "db", "migrate"], env=env, cwd=home, capture_output=True, text=True,
                             timeout=timeout)
    if migrate.returncode:
        raise RuntimeError(f"airflow db migrate failed:\n{migrate.stdout[-3000:]}\n{migrate.stderr[-3000:]}")

    # --skip-serve-logs: the log servers bind every interface; all components share AIRFLOW_HOME/logs here.
    commands = {
        "api-server": ["api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        "scheduler": ["scheduler"],
        "dag-processor": ["dag-processor"],
        "triggerer": ["triggerer", "--skip-serve-logs"],
        "celery-worker": ["celery", "worker", "--skip-serve-logs", "--without-mingle", "--without-gossip"],
    }
    started = {name: procs.start(name, [airflow, *args], env=env, cwd=home, layer=AIRFLOW_LAYER)
               for name, args in commands.items()}
    worker = started["celery-worker"]
    api = AirflowApi(f"http://127.0.0.1:{port}")

    def healthy() -> bool:
        procs.check_alive()
        return api.healthy()

    wait_until(healthy, timeout=timeout, interval=1,
               message=lambda: f"Airflow not healthy in {timeout}s\n{procs.tails()}")
    procs.wait_for_log(worker, " ready.", timeout)
    api.login(ADMIN, password)
    return Airflow(api.base_url, home, env, api, password)
