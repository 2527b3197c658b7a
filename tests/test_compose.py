"""No Docker engine runs here, so every command of compose.yaml runs as a local process:
the migration, the worker, a beat replica, their health checks and Flower with basic auth."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from celery_leasebeat.store import RunState, Store

from .conftest import REDIS_URL, require_server

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.e2e


def local(command: str | list[str]) -> str:
    """A compose command as a local shell command: ``$$`` is compose's escape for ``$``."""
    if isinstance(command, list):
        command = command[1] if command[0] == "CMD-SHELL" else " ".join(command[1:])
    return command.replace("$$", "$")


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


def test_every_compose_command_works_as_a_local_process(tmp_path: Path) -> None:
    require_server(REDIS_URL, "Redis")
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    database = f"sqlite:///{tmp_path / 'compose.sqlite'}"
    flower_port = free_port()
    env = {
        **os.environ,
        **services["worker"]["environment"],
        "CELERY_BROKER_URL": REDIS_URL.rsplit("/", 1)[0] + "/3",
        "LEASEBEAT_DATABASE_URL": database,
        "LEASEBEAT_POLLING_INTERVAL": "1",
        "PYTHONPATH": str(ROOT / "examples"),
        "HOSTNAME": socket.gethostname(),
        "FLOWER_PASSWORD": "s3cret",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, command: str) -> None:
        log = open(tmp_path / f"{name}.log", "wb")
        processes.append(
            subprocess.Popen(
                command, shell=True, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in tmp_path.glob("*.log"))

    try:
        migrate = subprocess.run(
            local(services["migrate"]["command"]),
            shell=True,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        assert "-> 0001" in migrate.stdout

        start("worker", local(services["worker"]["command"]))
        start("beat1", local(services["beat1"]["command"]))
        flower = local(services["flower"]["command"]).replace("--port=5555", f"--port={flower_port}")
        start("flower", flower + " --address=127.0.0.1")

        store = Store(database)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = [r for r in store.list_runs("proj.refresh_dashboard") if r["state"] == RunState.SUCCEEDED]
            if runs:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no scheduled run succeeded\n{logs()}")

        for service in ("beat1", "worker"):
            check = subprocess.run(
                local(services[service]["healthcheck"]["test"]),
                shell=True,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert check.returncode == 0, f"{service} health check failed: {check.stdout}{check.stderr}\n{logs()}"

        base = f"http://127.0.0.1:{flower_port}"
        deadline = time.monotonic() + 30
        while get(f"{base}/healthcheck") != 200:
            assert time.monotonic() < deadline, logs()
            time.sleep(0.5)
        assert get(f"{base}/") == 401  # basic auth is on
        assert get(f"{base}/", auth=("admin", "wrong")) == 401
        assert get(f"{base}/", auth=("admin", "s3cret")) == 200
        store.dispose()
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
