"""docker-compose.yaml, the Dockerfile and the compose guide, checked statically: no Docker engine
runs where this is tested.

What would break `docker compose up` or the demo and can be seen without running it: the file
does not parse, a service or mount is missing, services disagree on how to reach Redis,
PostgreSQL, the api-server or the local cloud, on the JWT secret, the Fernet key or the uid
files belong to, the dependency graph is broken, the image lacks what a service runs or is built
from a different Airflow or Python than requirements.txt and constraints.txt, or the guide
names a `python -m simcloud` option the CLI lacks or a .env that compose refuses.
"""
from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "docker-compose.md"
AIRFLOW_SERVICES = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-worker", "airflow-triggerer", "airflow-init")
REQUIRED = ("postgres", "redis", "simcloud", "simcloud-bootstrap", *AIRFLOW_SERVICES)
ONE_SHOT = ("airflow-init", "simcloud-bootstrap")
LONG_RUNNING = tuple(s for s in REQUIRED if s not in ONE_SHOT)
SIMCLOUD_WORKDIR = "/opt/simcloud"
# The secrets the compose file requires from the environment (or .env), as the tests give them.
DEMO_ENV = {"FERNET_KEY": base64.urlsafe_b64encode(bytes(range(32))).decode(),
            "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret-of-the-test"}


class Refused(Exception):
    """What `docker compose` stops with: a ${VAR:?message} whose variable is unset or empty."""


_VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def _interpolate(value, env: dict[str, str]):
    """Compose's interpolation with `env` as the environment: ${VAR}, $VAR, ${VAR:-default},
    ${VAR-default}, ${VAR:?message} and ${VAR?message} (Refused); $$ is a literal $."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            if m.group(1):
                return "$"
            name, op, arg = (m.group(2), m.group(3), m.group(4)) if m.group(2) else (m.group(5), None, None)
            present = name in env and (env[name] != "" or not (op or "").startswith(":"))
            if present:
                return env[name]
            if op and op.endswith("?"):
                raise Refused(f"{name}: {arg}")
            return arg if op else ""
        return _VARIABLE.sub(sub, value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


def load_compose(env: dict[str, str]) -> dict:
    return _interpolate(yaml.safe_load((ROOT / "docker-compose.yaml").read_text()), env)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose(DEMO_ENV)


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
def test_every_airflow_service_mounts_dags_and_the_cloud_state_but_not_the_package(services, name):
    mounts = _mounts(services[name])
    assert Path(mounts.get("/opt/airflow/dags", "")) == Path("dags"), f"{name} must mount ./dags"
    # The triggerer imports the GPU-readiness trigger, the worker the operators, from the wheel the
    # image installed. A mounted ./plugins would register the plugin a second time (Airflow reports
    # it as an import error) and its gpuboot would not even be imported: site-packages comes first.
    assert not any(Path(source) == Path("plugins") or Path(source).is_relative_to("plugins")
                   for source in mounts.values()), f"{name} mounts ./plugins over the installed provider"
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
    # Connections come from the file the local cloud's bootstrap writes, never from this file.
    assert env["AIRFLOW__SECRETS__BACKEND"] == "airflow.secrets.local_filesystem.LocalFilesystemBackend"
    kwargs = json.loads(env["AIRFLOW__SECRETS__BACKEND_KWARGS"])
    assert kwargs == {"connections_file_path": f"{SIMCLOUD_WORKDIR}/connections-gpuboot.json"}
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
                assert dep in ONE_SHOT, f"{name} waits for {dep} to exit"
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
        assert services[name]["depends_on"]["simcloud-bootstrap"]["condition"] == "service_completed_successfully", \
            f"{name} must wait for the ServiceAccount's connections"
    assert services["simcloud-bootstrap"]["depends_on"]["simcloud"]["condition"] == "service_healthy"
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
    # The fleet path, seen from the host through the Dockerfile's COPY into the working directory.
    host_fleet = _image_path_on_host(Path(service["working_dir"]) / options["--fleet"])
    assert host_fleet.is_file(), \
        f"compose serves {options['--fleet']}, but {host_fleet.relative_to(ROOT)} does not exist"


def _bootstrap_steps(services) -> list[list[str]]:
    """The `python -m simcloud ...` lines of the bootstrap's script, as argument lists."""
    script = services["simcloud-bootstrap"]["command"][-1]
    return [line.split() for line in script.splitlines() if line.strip().startswith("python -m simcloud")]


def test_the_product_acts_as_the_shipped_serviceaccount_not_the_admin(services):
    """The bootstrap applies deploy/kubernetes/ (the files the image carries) as the admin, then writes
    connections with the ServiceAccount rbac.yaml binds; that file is the one every Airflow service
    reads, so a right missing from rbac.yaml fails under compose as on a real cluster."""
    bootstrap = services["simcloud-bootstrap"]
    assert bootstrap["image"] == services["simcloud"]["image"]
    assert _mounts(bootstrap)[SIMCLOUD_WORKDIR] == _mounts(services["simcloud"])[SIMCLOUD_WORKDIR]
    apply, token = _bootstrap_steps(services)
    assert apply[:4] == ["python", "-m", "simcloud", "apply"]
    manifests = [a for a in apply[4:] if not a.startswith("--") and a != SIMCLOUD_WORKDIR]
    assert {Path(m).name for m in manifests} == {"namespace.yaml", "rbac.yaml"}
    for manifest in manifests:
        on_host = _image_path_on_host(Path(bootstrap["working_dir"]) / manifest)
        assert on_host.is_file() and on_host.is_relative_to(ROOT / "deploy" / "kubernetes"), on_host
    options = dict(zip(token[4::2], token[5::2]))
    assert token[:4] == ["python", "-m", "simcloud", "token"] and options["--workdir"] == SIMCLOUD_WORKDIR
    rbac = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/rbac.yaml").read_text()))
    account = next(o["metadata"] for o in rbac if o and o["kind"] == "ServiceAccount")
    assert options["--serviceaccount"] == f"{account['namespace']}/{account['name']}"
    for name in AIRFLOW_SERVICES:
        kwargs = json.loads(_env(services[name])["AIRFLOW__SECRETS__BACKEND_KWARGS"])
        assert kwargs["connections_file_path"] == options["--connections"], \
            f"{name} must read the ServiceAccount's connections, not the admin's"


@cache
def _cli_options(subcommand: str) -> frozenset[str]:
    """The options of `python -m simcloud SUBCOMMAND`, read from its --help."""
    result = subprocess.run([sys.executable, "-m", "simcloud", subcommand, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"python -m simcloud {subcommand} --help failed:\n{result.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", result.stdout))


def test_simcloud_cli_accepts_the_compose_options(services):
    """The options compose passes exist in the real CLI (`serve --help`)."""
    passed = {c for c in _command(services["simcloud"]) if c.startswith("--")}
    missing = passed - _cli_options("serve")
    assert not missing, f"simcloud serve has no {sorted(missing)} (compose passes them)"
    for step in _bootstrap_steps(services):
        passed = {c for c in step if c.startswith("--")}
        missing = passed - _cli_options(step[3])
        assert not missing, f"simcloud {step[3]} has no {sorted(missing)} (the bootstrap passes them)"


# -- secrets and ownership: what every service must agree on (issue 16, points 1 and 2) ---------

REQUIRED_VARIABLES = tuple(DEMO_ENV)


@pytest.mark.parametrize("missing", REQUIRED_VARIABLES)
def test_compose_refuses_to_start_without_a_secret(missing):
    """No silent fallback: an empty Fernet key stores connections unencrypted, and without a JWT
    secret each service would make its own and every task fail with "Signature verification failed"."""
    for env in ({k: v for k, v in DEMO_ENV.items() if k != missing}, {**DEMO_ENV, missing: ""}):
        with pytest.raises(Refused, match=rf"^{missing}: .*docs/docker-compose\.md"):
            load_compose(env)


@pytest.mark.parametrize("name", AIRFLOW_SERVICES)
def test_every_airflow_service_gets_the_secrets_from_the_environment(services, name):
    env = _env(services[name])
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"] == DEMO_ENV["AIRFLOW__API_AUTH__JWT_SECRET"]
    assert env["AIRFLOW__CORE__FERNET_KEY"] == DEMO_ENV["FERNET_KEY"]


def _uid(user: str) -> str:
    uid, _, gid = user.partition(":")
    assert gid == "0", f"user {user!r}: the image's files are group 0, containers must run with gid 0"
    return uid


@pytest.mark.parametrize("uid_env", [{}, {"AIRFLOW_UID": ""}, {"AIRFLOW_UID": "1234"}], ids=["unset", "empty", "1234"])
def test_init_hands_the_files_to_the_uid_every_service_runs_as(uid_env):
    """airflow-init (root) writes airflow.cfg 0600 and chowns the shared folders: to the uid the
    other containers run as, also when AIRFLOW_UID is unset (a compose-time ${AIRFLOW_UID} in the
    script would make it `chown ":0"` and leave the file root's)."""
    compose = load_compose({**DEMO_ENV, **uid_env})
    services = compose["services"]
    uids = {name: _uid(services[name]["user"]) for name in LONG_RUNNING if name not in ("postgres", "redis")}
    expected = uid_env.get("AIRFLOW_UID") or "50000"
    assert set(uids.values()) == {expected}, uids
    init = services["airflow-init"]
    init_env = _env(init)
    assert init_env["AIRFLOW_UID"] == expected and init["user"] == "0:0"
    script = _command(init)[-1]
    shell_expanded = re.sub(r"\$\{AIRFLOW_UID\}|\$AIRFLOW_UID\b", init_env["AIRFLOW_UID"], script)
    owners = re.findall(r'^\s*chown\s+(?:-\S+\s+)*"?([^"\s]*)', shell_expanded, re.MULTILINE)
    assert len(owners) >= 2 and set(owners) == {f"{expected}:0"}, f"airflow-init chowns to {owners}"
    # The local cloud's state volume belongs to the same uid (point 5).
    options = dict(o.split("=", 1) for o in compose["volumes"]["simcloud-state"]["driver_opts"]["o"].split(","))
    assert (options["uid"], options["gid"]) == (expected, "0")


# -- the image ----------------------------------------------------------------------------------

def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _copies() -> dict[str, str]:
    """Dockerfile COPY source -> destination."""
    return dict(re.findall(r"^COPY (?:--\S+ )*(\S+) (\S+)$", _dockerfile(), re.MULTILINE))


def _image_path_on_host(path: Path) -> Path:
    """The repository file a path of the image was copied from."""
    for source, dest in _copies().items():
        if path.is_relative_to(dest):
            return ROOT / source / path.relative_to(dest)
    raise AssertionError(f"no COPY in the Dockerfile puts anything at {path}")


def _pin(package: str) -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(rf"^{re.escape(package)}==([^\s;#]+)", line.strip(), re.IGNORECASE)
        if match:
            return match.group(1)
    raise AssertionError(f"requirements.txt does not pin {package}")


def _constraints_python() -> str:
    match = re.search(r"^#\s+uv pip compile .*-p (\d+\.\d+)\b", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert match, "constraints.txt must say which Python it was resolved for (uv pip compile -p X.Y)"
    return match.group(1)


def test_dockerfile_builds_from_the_pinned_airflow_on_the_constraints_python():
    froms = re.findall(r"^FROM\s+(\S+)", _dockerfile(), re.MULTILINE)
    assert len(froms) == 1, f"one FROM expected, got {froms}"
    image, _, tag = froms[0].partition(":")
    assert image == "apache/airflow"
    expected = f"{_pin('apache-airflow')}-python{_constraints_python()}"
    assert tag == expected, f"Dockerfile FROM tag {tag} != {expected} (requirements.txt pin, constraints.txt Python)"


def _wheel_name() -> str:
    """The file `make dist` builds: the distribution of pyproject.toml at its version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return f"{project['name']}-{project['version']}-py3-none-any.whl"


def test_dockerfile_installs_the_provider_wheel_with_the_constraints_without_moving_airflow():
    """The image installs the wheel of this version (not files copied from plugins/), with the
    local cloud's extra for the simcloud service, pinned by the constraints."""
    copies = _copies()
    assert copies.get("constraints.txt") == "/constraints.txt"
    wheel = _wheel_name()
    assert copies.get(f"dist/{wheel}") == f"/wheels/{wheel}", \
        f"the Dockerfile must COPY dist/{wheel} (make dist of pyproject.toml's version) to /wheels/"
    assert re.search(rf'^RUN pip install .*"apache-airflow==\$\{{AIRFLOW_VERSION\}}" "/wheels/{re.escape(wheel)}'
                     r'\[simcloud\]" -c /constraints\.txt$', _dockerfile(), re.MULTILINE)
    assert not any(source.startswith(("plugins", "requirements"))
                   for source in copies), "the package and its requirements come from the wheel"


def test_the_wheel_the_image_installs_reaches_the_build_context():
    assert _in_context(f"dist/{_wheel_name()}")
    assert not _in_context("dist/gpuboot-0.0.1-py3-none-any.tar.gz") and not _in_context("plugins/gpuboot/hooks/ecs.py")


# .dockerignore as Docker reads it: patterns in order, the last match wins, `!` re-includes, and
# a pattern matching a parent directory matches everything below it.
def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include, line = line.startswith("!"), line.lstrip("!").strip("/")
        regex = "".join(".*" if part == "**" else "[^/]*" if part == "*" else "[^/]" if part == "?" else re.escape(part)
                        for part in re.split(r"(\*\*|\*|\?)", line))
        out.append((include, re.compile(regex.replace(".*/", "(?:.*/)?") + "$")))
    return out


def _in_context(path: str) -> bool:
    parents = [path] + [str(p) for p in Path(path).parents if str(p) != "."]
    included = True
    for include, pattern in _ignore_patterns():
        if any(pattern.match(p) for p in parents):
            included = include
    return included


@cache
def _tracked_files() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return tuple(out.splitlines())


def test_build_context_holds_everything_the_dockerfile_copies_and_nothing_else():
    assert _ignore_patterns()[0] == (False, re.compile("[^/]*$")), ".dockerignore is an allow-list: it starts with *"
    copies = [source.rstrip("/") for source in _copies()]
    for path in _tracked_files():
        wanted = any(path == source or path.startswith(source + "/") for source in copies)
        assert _in_context(path) == wanted, f"{path}: {'left out of' if wanted else 'sent in'} the build context"
    for junk in (".venv/bin/python", "simcloud/__pycache__/server.cpython-311.pyc", ".git/HEAD"):
        assert not _in_context(junk), f"{junk} reaches the build context"


def test_simcloud_service_runs_the_image_copy_of_the_local_cloud(services):
    """The image is self-sufficient: the service imports simcloud from the copy in the image (its
    working directory), not from a bind mount of the checkout (issue 16, point 5)."""
    service = services["simcloud"]
    package = Path(service["working_dir"]) / "simcloud"
    assert _image_path_on_host(package) == ROOT / "simcloud"
    assert not any(Path(target).is_relative_to(service["working_dir"]) for target in _mounts(service)), \
        "simcloud must run the package in the image, not a mount over it"


def test_simcloud_state_volume_has_explicit_ownership(compose, services):
    """Not the ownership Docker may copy from the image into a fresh named volume: a tmpfs with the
    uid, gid and mode stated, written by simcloud, read (only) by the Airflow services."""
    volume = compose["volumes"]["simcloud-state"]
    assert volume["driver"] == "local"
    opts = volume["driver_opts"]
    assert (opts["type"], opts["device"]) == ("tmpfs", "tmpfs")
    options = dict(o.split("=", 1) for o in opts["o"].split(","))
    assert options["uid"] == _uid(services["simcloud"]["user"]) and options["gid"] == "0"
    mode = int(options["mode"], 8)
    assert mode & 0o700 == 0o700 and not mode & 0o007, f"mode {options['mode']}: owner rwx, nothing for others"
    assert _mounts(services["simcloud"])[SIMCLOUD_WORKDIR] == "simcloud-state"
    for name in AIRFLOW_SERVICES:
        assert f"simcloud-state:{SIMCLOUD_WORKDIR}:ro" in services[name]["volumes"], f"{name} must mount it read-only"


# -- the guide (issue 16, point 3) -------------------------------------------------------------

def _simcloud_commands(text: str) -> list[str]:
    """Every `python -m simcloud ...` command in a markdown text: in inline code spans, and on the
    lines of fenced code blocks (backslash continuations joined)."""
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
    spans = [line for block in fenced.findall(text) for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    spans += re.findall(r"`([^`\n]+)`", fenced.sub("", text))
    return [m.group(0) for span in spans for m in [re.search(r"python -m simcloud \S+.*", span)] if m]


@cache
def _cli_subcommands() -> frozenset[str]:
    """The subcommands of `python -m simcloud`, read from its --help ("{serve,fault,...}")."""
    result = subprocess.run([sys.executable, "-m", "simcloud", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    return frozenset(re.search(r"\{([a-z,]+)\}", result.stdout).group(1).split(","))


def test_every_simcloud_option_the_docs_name_exists_in_the_cli():
    named = 0
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for command in _simcloud_commands(doc.read_text()):
            subcommand = command.split()[3]
            assert subcommand in _cli_subcommands(), f"{doc.name}: unknown command {command!r}"
            for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", command):
                named += 1
                assert option in _cli_options(subcommand), \
                    f"{doc.name} names `python -m simcloud {subcommand} {option}`, which the CLI does not have"
    assert named, "the guide names no python -m simcloud option: this test checks nothing"


def test_the_guides_env_file_is_one_compose_accepts(tmp_path):
    """Run the guide's `.env` step (docs/docker-compose.md, "Run it"): compose must accept the file
    it writes, and the Fernet key must be one Airflow can use."""
    # Only a block that is nothing but `cat > .env <<EOF ... EOF` is run (never docker commands).
    steps = re.findall(r"^```bash\n(cat > \.env <<EOF\n(?:\w+=.*\n)+EOF\n)```", GUIDE.read_text(), re.MULTILINE)
    assert len(steps) == 1, "the guide must write .env in one bash block: cat > .env <<EOF, NAME=value lines, EOF"
    subprocess.run(["bash", "-euo", "pipefail", "-c", steps[0]], cwd=tmp_path, check=True, timeout=60)
    env = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines() if "=" in line)
    compose = load_compose(env)  # raises Refused if a required variable is missing
    assert set(REQUIRED_VARIABLES) <= set(env) and all(env[k] for k in REQUIRED_VARIABLES)
    from cryptography.fernet import Fernet
    token = Fernet(env["FERNET_KEY"]).encrypt(b"connection password")
    assert Fernet(_env(compose["services"]["airflow-worker"])["AIRFLOW__CORE__FERNET_KEY"]).decrypt(token) \
        == b"connection password"
    assert env["AIRFLOW_UID"].isdigit()
