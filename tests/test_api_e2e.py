"""The HTTP API for real: `celery -A e2eapp leasebeat serve` (uvicorn) in front of real
workers, a beat replica, Redis and PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from celery_leasebeat.store import RunState

from .cluster import Cluster, free_port, services

pytestmark = pytest.mark.e2e
TOKEN = "e2e-api-token"


def wait_for(cluster: Cluster, predicate: Any, what: str, timeout: float = 40) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{cluster.logs()}")


def test_the_http_api_end_to_end(make_cluster: Any) -> None:
    broker_url, database_url = services("redis", "postgresql")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cluster = make_cluster(
        broker_url,
        database_url,
        E2E_API="1",
        LEASEBEAT_API_TOKEN=TOKEN,
        LEASEBEAT_OUTBOUND_TOKEN=TOKEN,
        E2E_REMOTE_URL=base,
    )
    queue = cluster.env["E2E_QUEUE"]
    cluster.worker("worker", concurrency=4)
    cluster._start(
        "batch", "worker", "-l", "info", "-c", "1", "-Q", f"{queue}-batch", "-n", f"batch-{cluster.prefix}@%h"
    )
    cluster.beat("beat1")
    cluster._start("api", "leasebeat", "serve", "--port", str(port))
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def ready() -> bool:
        try:
            return http.get("/internal/jobs/none").status_code == 404
        except httpx.HTTPError:
            return False

    wait_for(cluster, ready, "the API server")
    store = cluster.store

    def finished(job_id: str) -> dict[str, Any] | None:
        status = http.get(f"/internal/jobs/{job_id}").json()
        return status if status["status"] in ("succeeded", "failed", "skipped") else None

    # Queue and poll: 202, then the job runs on a worker and the poll says succeeded.
    accepted = http.post("/internal/jobs/reindex")
    assert accepted.status_code == 202, accepted.text
    status = wait_for(cluster, lambda: finished(accepted.json()["job_id"]), "reindex")
    assert status["status"] == "succeeded" and status["duration_ms"] is not None and status["started_at"]

    # Inline: the work happens in the request.
    inline = http.post("/internal/jobs/sweep")
    assert inline.status_code == 200 and inline.json()["count"] == 25

    # Ordering: the rollup runs for the same window after clustering succeeds...
    upstream = http.post("/internal/jobs/clustering").json()["job_id"]
    wait_for(cluster, lambda: finished(upstream), "clustering")
    window = store.get_run(upstream)["occurrence"]
    rollup = wait_for(
        cluster,
        lambda: [r for r in store.list_runs("rollup") if r["state"] == RunState.SUCCEEDED],
        "the rollup after clustering",
    )
    assert [r["occurrence"] for r in rollup] == [window] and rollup[0]["source"] == "after"
    # ... and is not started after it fails, with the reason on its ledger row.
    failing = http.post("/internal/jobs/clustering-bad").json()["job_id"]
    assert wait_for(cluster, lambda: finished(failing), "clustering-bad")["status"] == "failed"
    (skipped,) = store.list_runs("rollup-bad")
    assert skipped["state"] == RunState.SKIPPED and "upstream 'clustering-bad' failed" in skipped["error"]
    assert skipped["occurrence"] == store.get_run(failing)["occurrence"]

    # Separate pools: the batch schedule runs only on the batch worker.
    batch = http.post("/internal/jobs/batch-reindex").json()["job_id"]
    wait_for(cluster, lambda: finished(batch), "batch-reindex")
    assert store.get_run(batch)["worker"].startswith("batch-")
    assert store.get_run(accepted.json()["job_id"])["worker"].startswith("worker-")

    # Driving another service: the built-in task triggers, polls and records the outcome.
    remote_inline = http.post("/internal/jobs/remote-sweep").json()["job_id"]
    assert wait_for(cluster, lambda: finished(remote_inline), "remote-sweep")["status"] == "succeeded"
    assert http.get(f"/internal/jobs/{remote_inline}").json()["count"] == 25
    remote_queued = http.post("/internal/jobs/remote-reindex").json()["job_id"]
    result = wait_for(cluster, lambda: finished(remote_queued), "remote-reindex")
    assert result["status"] == "succeeded" and result["result"]["status"] == "succeeded"
    assert len([r for r in store.list_runs("reindex") if r["state"] == RunState.SUCCEEDED]) == 2


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "no API token"),
        ({"DEV_AUTH": "1", "LEASEBEAT_ENVIRONMENT": "production"}, "DEV_AUTH=1 is set but the environment is"),
    ],
)
def test_serve_refuses_to_start_without_authentication(tmp_path: Any, env: dict[str, str], expected: str) -> None:
    import os
    import subprocess
    import sys

    from .cluster import E2E_DIR

    environment = {key: value for key, value in os.environ.items() if key not in ("LEASEBEAT_API_TOKEN", "DEV_AUTH")}
    environment.update(
        PYTHONPATH=str(E2E_DIR),
        E2E_BROKER="memory://",
        E2E_DATABASE=f"sqlite:///{tmp_path / 'serve.sqlite'}",
        E2E_RECORD=str(tmp_path / "record.jsonl"),
        **env,
    )
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "e2eapp", "leasebeat", "serve", "--port", "1"],
        env=environment, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 4 and expected in result.stderr, result.stderr
