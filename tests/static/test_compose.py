"""docker-compose.yaml, checked statically: no Docker engine runs where this is tested.

What would break `docker compose up` or the demo and can be seen without running it: the file
does not parse, a service or mount is missing, services disagree on how to reach Redis,
PostgreSQL, the api-server or the local cloud, the dependency graph is broken, or the image is
built from a different Airflow than requirements.txt pins.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
AIRFLOW_SERVICES = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-worker", "airflow-triggerer", "airflow-init")
REQUIRED = ("postgres", "redis", "simcloud") + AIRFLOW_SERVICES
LONG_RUNNING = tuple(s for s in REQUIRED if s != "airflow-init")
SIMCLOUD_WORKDIR = "/opt/simcloud"


def _interpolate(value):
    """Compose's ${VAR:-default} / ${VAR} with the defaults (an empty environment); $$ -> $."""
    if isinstance(value, str):
        value = re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(yaml.safe_load((ROOT / "docker-compose.yaml").read_text()))


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _mounts(service: dict) -> dict[str, str]:
    """Container path -> source (host path or volume name)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        out[target] = source
    return out


def _command(service: dict) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else command


# Compose-spec keys this file may use: a typo (`restrat:`) would be an error for `docker
# compose`, which we cannot run, so catch it here.
SERVICE_KEYS = {"build", "command", "depends_on", "entrypoint", "environment", "expose", "healthcheck",
                "hostname", "image", "ports", "profiles", "restart", "user", "volumes", "working_dir"}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period"}
DURATION = re.compile(r"^(\d+(h|m|s|ms|us))+$")


def test_services_use_only_known_keys_and_valid_values(services):
    for name, service in services.items():
        assert set(service) <= SERVICE_KEYS, f"{name}: unknown keys {set(service) - SERVICE_KEYS}"
        assert service.get("restart", "always") in ("no", "always", "on-failure", "unless-stopped")
        check = service.get("healthcheck", {})
        assert set(check) <= HEALTHCHECK_KEYS, f"{name}: unknown healthcheck keys {set(check) - HEALTHCHECK_KEYS}"
        if check:
            assert check["test"][0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck test must start CMD/CMD-SHELL"
            assert all(DURATION.match(str(check[k])) for k in ("interval", "timeout", "start_period") if k in check)
            assert isinstance(check.get("retries", 1), int)


def test_required_services_present(services):
    missing = [s for s in REQUIRED if s not in services]
    assert not missing, f"docker-compose.yaml lacks services {missing}"


def test_airflow_services_run_the_right_commands(services):
    expected = {"airflow-apiserver": ["api-server"], "airflow-scheduler": ["scheduler"],
                "airflow-dag-processor": ["dag-processor"], "airflow-worker": ["celery", "worker"],
                "airflow-triggerer": ["triggerer"]}
    for name, command in expected.items():
        assert _command(services[name]) == command, f"{name}: command {services[name].get('command')!r}"


@pytest.mark.parametrize("name", AIRFLOW_SERVICES)
def test_every_airflow_service_mounts_dags_plugins_and_the_cloud_state(services, name):
    mounts = _mounts(services[name])
    assert Path(mounts.get("/opt/airflow/dags", "")) == Path("dags"), f"{name} must mount ./dags"
    # The triggerer imports the GPU-readiness trigger from here; the worker the operators.
    assert Path(mounts.get("/opt/airflow/plugins", "")) == Path("plugins"), f"{name} must mount ./plugins"
    assert mounts.get(SIMCLOUD_WORKDIR) == _mounts(services["simcloud"])[SIMCLOUD_WORKDIR], \
        f"{name} must mount the volume simcloud writes its kubeconfig and connections to"


@pytest.mark.parametrize("name", AIRFLOW_SERVICES)
def test_every_airflow_service_builds_the_project_image(services, name):
    service = services[name]
    assert service.get("build") in (".", {"context": "."}), f"{name} must build ./Dockerfile"
    assert service["image"] == services["simcloud"]["image"], "one image for Airflow and simcloud"


@pytest.mark.parametrize("name", AIRFLOW_SERVICES)
def test_airflow_env_is_consistent(services, name):
    env = _env(services[name])
    pg = _env(services["postgres"])
    db = f"{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres/{pg['POSTGRES_DB']}"
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == f"postgresql+psycopg2://{db}"
    assert env["AIRFLOW__CELERY__RESULT_BACKEND"] == f"db+postgresql://{db}"
    broker = urlsplit(env["AIRFLOW__CELERY__BROKER_URL"])
    assert (broker.scheme, broker.hostname, broker.port) == ("redis", "redis", 6379)
    assert "6379" in [str(p) for p in services["redis"].get("expose", [])]
    assert env["AIRFLOW__CORE__LOAD_EXAMPLES"].lower() == "false"
    api = urlsplit(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    assert (api.hostname, api.path) == ("airflow-apiserver", "/execution/")
    assert f"{api.port}:{api.port}" in services["airflow-apiserver"]["ports"]
    # Connections come from the file the local cloud writes, never from this file.
    assert env["AIRFLOW__SECRETS__BACKEND"] == "airflow.secrets.local_filesystem.LocalFilesystemBackend"
    kwargs = json.loads(env["AIRFLOW__SECRETS__BACKEND_KWARGS"])
    assert kwargs == {"connections_file_path": f"{SIMCLOUD_WORKDIR}/connections.json"}
    assert not any("AIRFLOW_CONN_" in k or "ACCESS_KEY" in k.upper() for k in env)


def test_worker_handles_warm_shutdown(services):
    assert _env(services["airflow-worker"])["DUMB_INIT_SETSID"] == "0"


def test_init_migrates_and_creates_the_admin(services):
    env = _env(services["airflow-init"])
    assert env["_AIRFLOW_DB_MIGRATE"] == "true" and env["_AIRFLOW_WWW_USER_CREATE"] == "true"


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_long_running_services_have_healthchecks(services, name):
    assert services[name].get("healthcheck", {}).get("test"), f"{name} needs a healthcheck"


def test_depends_on_graph_is_sane(services):
    graph = {}
    for name, service in services.items():
        deps = service.get("depends_on", {})
        deps = {d: {"condition": "service_started"} for d in deps} if isinstance(deps, list) else deps
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy: no healthcheck"
            elif condition == "service_completed_successfully":
                assert dep == "airflow-init", f"{name} waits for {dep} to exit"
        graph[name] = set(deps)
    # No cycles (Kahn).
    remaining = dict(graph)
    while remaining:
        ready = [n for n, deps in remaining.items() if not deps & remaining.keys()]
        assert ready, f"depends_on cycle among {sorted(remaining)}"
        for n in ready:
            del remaining[n]
    for name in AIRFLOW_SERVICES:
        assert {"postgres", "redis"} <= graph[name], f"{name} must wait for postgres and redis"
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                 "airflow-worker", "airflow-triggerer"):
        assert "airflow-init" in graph[name], f"{name} must start after airflow-init"
    # The two services that talk to the cloud wait until it answers.
    for name in ("airflow-worker", "airflow-triggerer"):
        assert services[name]["depends_on"]["simcloud"]["condition"] == "service_healthy"
    assert "airflow-apiserver" in graph["airflow-worker"]


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes", {}))
    for name, service in services.items():
        for source in _mounts(service).values():
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} mounts undeclared volume {source}"


def test_simcloud_serves_the_demo_fleet_to_the_other_containers(services):
    service = services["simcloud"]
    command = _command(service)
    assert command[:4] == ["python", "-m", "simcloud", "serve"]
    options = dict(zip(command[4::2], command[5::2]))
    assert options["--workdir"] == SIMCLOUD_WORKDIR
    # It must bind where the Airflow containers can reach it, under a name they resolve.
    assert options["--host"] == service["hostname"] == "simcloud"
    # The fleet path, seen from the host through the service's mount of ./simcloud.
    fleet = Path(service["working_dir"]) / options["--fleet"]
    package = Path(service["working_dir"]) / "simcloud"
    assert Path(_mounts(service)[str(package)]) == Path("simcloud")
    host_fleet = ROOT / "simcloud" / fleet.relative_to(package)
    if not host_fleet.parent.is_dir():
        pytest.skip(f"simcloud has not landed {host_fleet.parent.relative_to(ROOT)}/ yet")
    assert host_fleet.is_file(), f"compose serves {fleet}, but {host_fleet.relative_to(ROOT)} does not exist"


def test_simcloud_cli_accepts_the_compose_options(services):
    """The options compose passes exist in the real CLI (`serve --help`)."""
    command = _command(services["simcloud"])
    result = subprocess.run([sys.executable, "-m", "simcloud", "serve", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"python -m simcloud serve --help failed:\n{result.stderr[-2000:]}"
    for option in (c for c in command if c.startswith("--")):
        assert option in result.stdout, f"simcloud serve has no {option} option (compose passes it)"


# -- the image -------------------------------------------------------------------------------

def _pin(package: str) -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(rf"^{re.escape(package)}==([^\s;#]+)", line.strip(), re.IGNORECASE)
        if match:
            return match.group(1)
    raise AssertionError(f"requirements.txt does not pin {package}")


def test_dockerfile_builds_from_the_pinned_airflow():
    dockerfile = (ROOT / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    assert len(froms) == 1, f"one FROM expected, got {froms}"
    image, _, tag = froms[0].partition(":")
    assert image == "apache/airflow"
    assert tag == _pin("apache-airflow"), f"Dockerfile FROM tag {tag} != requirements.txt pin"


def test_dockerfile_installs_requirements_without_moving_airflow():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY .*requirements\.txt", dockerfile, re.MULTILINE)
    assert re.search(r'pip install .*"apache-airflow==\$\{AIRFLOW_VERSION\}" -r /requirements\.txt', dockerfile)


def test_dockerignore_keeps_what_the_dockerfile_copies():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", ".dockerignore is an allow-list: the .venv must never reach the context"
    copied = re.findall(r"^COPY (?:--\S+ )*(\S+) ", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    for source in copied:
        assert f"!{source}" in ignore, f"Dockerfile copies {source} but .dockerignore excludes it"
