"""Real beat replicas and workers of tests/e2e/e2eapp.py, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from celery_leasebeat.store import Store

from .conftest import MYSQL_URL, POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_server

E2E_DIR = Path(__file__).parent / "e2e"


class Cluster:
    """Real beat replicas and workers of ``tests/e2e/e2eapp.py``, sharing one environment."""

    def __init__(self, tmp_path: Path, broker: str, database: str, **env: str) -> None:
        self.tmp_path = tmp_path
        self.record = tmp_path / "record.jsonl"
        self.record.touch()
        self.prefix = f"e{uuid.uuid4().hex[:10]}_"
        self.store = Store(database, table_prefix=self.prefix)
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(E2E_DIR), os.environ.get("PYTHONPATH", "")]),
            "E2E_BROKER": broker,
            "E2E_DATABASE": database,
            "E2E_PREFIX": self.prefix,
            "E2E_RECORD": str(self.record),
            "E2E_QUEUE": f"q-{self.prefix}",
            **env,
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "e2eapp", *args],
            cwd=self.tmp_path,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.processes[name] = process
        return process

    def beat(self, name: str, scheduler: str = "leasebeat") -> subprocess.Popen[bytes]:
        return self._start(name, "beat", "-S", scheduler, "-l", "info", "-s", str(self.tmp_path / f"{name}-schedule"))

    def worker(self, name: str, concurrency: int = 2) -> subprocess.Popen[bytes]:
        return self._start(
            name,
            "worker",
            "-l",
            "info",
            "-c",
            str(concurrency),
            "-n",
            f"{name}-{self.prefix}@%h",
            "-Q",
            self.env["E2E_QUEUE"],
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        )

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]

    def logs(self) -> str:
        return "\n".join(
            f"----- {path.name}\n{path.read_text(errors='replace')[-6000:]}"
            for path in sorted(self.tmp_path.glob("*.log"))
        )

    def wait_for(self, predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")


def services(broker: str, database: str) -> tuple[str, str]:
    urls = {"redis": REDIS_URL, "rabbitmq": RABBITMQ_URL, "postgresql": POSTGRES_URL, "mysql": MYSQL_URL}
    require_server(urls[broker], broker)
    require_server(urls[database], database)
    return urls[broker], urls[database]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Prometheus text as {"name{labels}": value}."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples
