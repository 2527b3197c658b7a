"""No Docker engine runs here, so every command of compose.yaml runs as a local process:
the migration, the worker, a beat replica, their health checks and Flower with basic auth."""

from __future__ import annotations

import base64
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sqlalchemy import create_engine

from celery_leasebeat.migrations import head
from celery_leasebeat.store import RunState, Store

from .conftest import POSTGRES_URL, REDIS_URL, require_server

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.e2e


def interpolate(text: str, env: dict[str, str]) -> str:
    """What compose does to a value: ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` from the
    environment, and ``$$`` for a literal ``$`` (left for the container's shell)."""

    def value(match: re.Match[str]) -> str:
        name, operator, argument = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if operator == ":?":
            raise AssertionError(f"compose would refuse to start: {argument}")
        return argument or ""

    return _VARIABLE.sub(value, text.replace("$$", "\0")).replace("\0", "$")


_VARIABLE = re.compile(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}")


def command(service: dict, env: dict[str, str]) -> list[str]:
    """A service's command as compose runs it: interpolated, split, no shell."""
    return shlex.split(interpolate(service["command"], env))


def healthcheck(service: dict, env: dict[str, str]) -> str:
    """A CMD-SHELL health check as the container's shell runs it."""
    kind, text = service["healthcheck"]["test"][0], service["healthcheck"]["test"][1:]
    joined = text[0] if kind == "CMD-SHELL" else shlex.join(text)
    return interpolate(joined, env)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str, auth: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def compose_database() -> Iterator[str]:
    """A database of its own, as compose's postgres service gives the project."""
    require_server(POSTGRES_URL, "PostgreSQL")
    name = f"lbcompose_{uuid.uuid4().hex[:8]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f"CREATE DATABASE {name}")
    yield POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as connection:
        connection.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
    admin.dispose()


def test_every_compose_command_works_as_a_local_process(tmp_path: Path, compose_database: str) -> None:
    require_server(REDIS_URL, "Redis")
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    flower_port = free_port()
    env = {
        **os.environ,
        **services["worker"]["environment"],
        "CELERY_BROKER_URL": REDIS_URL.rsplit("/", 1)[0] + "/3",
        "LEASEBEAT_DATABASE_URL": compose_database,
        "LEASEBEAT_POLLING_INTERVAL": "1",
        "PYTHONPATH": str(ROOT / "examples"),
        "HOSTNAME": socket.gethostname(),
        "FLOWER_PASSWORD": "s3cret",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str]) -> None:
        log = open(tmp_path / f"{name}.log", "wb")
        processes.append(
            subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def check(name: str) -> None:
        result = subprocess.run(
            healthcheck(services[name], env),
            shell=True,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, f"{name}'s health check failed: {result.stdout}{result.stderr}\n{logs()}"

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in tmp_path.glob("*.log"))

    with pytest.raises(AssertionError, match="set FLOWER_PASSWORD"):
        command(services["flower"], {**env, "FLOWER_PASSWORD": ""})  # compose refuses without a password
    try:
        check("redis")
        check("postgres")
        migrate = subprocess.run(
            command(services["migrate"], env), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        assert f"empty -> {head()}" in migrate.stdout

        start("worker", command(services["worker"], env))
        start("beat1", command(services["beat1"], env))
        flower = [arg.replace("--port=5555", f"--port={flower_port}") for arg in command(services["flower"], env)]
        start("flower", [*flower, "--address=127.0.0.1"])

        store = Store(compose_database)
        deadline = time.monotonic() + 60
        while not [r for r in store.list_runs("proj.refresh_dashboard") if r["state"] == RunState.SUCCEEDED]:
            assert time.monotonic() < deadline, f"no scheduled run succeeded\n{logs()}"
            time.sleep(0.5)
        store.dispose()

        check("beat1")
        check("worker")
        base = f"http://127.0.0.1:{flower_port}"
        deadline = time.monotonic() + 30
        while get(f"{base}/healthcheck") != 200:
            assert time.monotonic() < deadline, logs()
            time.sleep(0.5)
        flower_check = healthcheck(services["flower"], env).replace("5555", str(flower_port))
        assert subprocess.run(flower_check, shell=True, env=env, timeout=60).returncode == 0
        assert get(f"{base}/") == 401  # basic auth is on
        assert get(f"{base}/", auth=("admin", "wrong")) == 401
        assert get(f"{base}/", auth=("admin", "s3cret")) == 200
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
