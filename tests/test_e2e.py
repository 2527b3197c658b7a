"""End to end with real ``celery beat`` and ``celery worker`` processes, real brokers and
real databases: exactly once across replicas, and recovery from killed processes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

from celery_leasebeat.store import RunState

from .cluster import Cluster, free_port, scrape, services
from .conftest import sqlite_url

pytestmark = pytest.mark.e2e


def _assert_every_occurrence_once(cluster: Cluster, schedules: list[str], minimum: int) -> dict[str, int]:
    """Every nominal second from the first to the last run is either run exactly once or
    recorded as dropped; the ledger and the task bodies agree run for run."""
    runs = cluster.store.list_runs()
    bodies = Counter((e["schedule"], e["occurrence"]) for e in cluster.events() if e["event"] == "run")
    duplicated = {key: n for key, n in bodies.items() if n > 1}
    assert not duplicated, f"task bodies ran more than once: {duplicated}\n{cluster.logs()}"
    missed = {}
    for schedule in schedules:
        rows = [r for r in runs if r["schedule"] == schedule]
        assert len(rows) >= minimum, f"{schedule}: only {len(rows)} runs\n{cluster.logs()}"
        states = Counter(r["state"] for r in rows)
        assert states == {RunState.SUCCEEDED: len(rows)}, f"{schedule}: {states}\n{cluster.logs()}"
        ran = {(schedule, r["occurrence"].isoformat()) for r in rows}
        assert ran == {key for key in bodies if key[0] == schedule}, "ledger and task bodies disagree"
        for earlier, later in zip(rows, rows[1:]):
            gap = (later["occurrence"] - earlier["occurrence"]).total_seconds()
            assert gap == 1 + earlier["missed_count"], (
                f"{schedule}: {earlier['occurrence']} -> {later['occurrence']} with "
                f"{earlier['missed_count']} recorded as dropped: an occurrence vanished\n{cluster.logs()}"
            )
        missed[schedule] = sum(r["missed_count"] for r in rows)
    return missed


@pytest.mark.parametrize(("broker", "database"), [("redis", "postgresql"), ("rabbitmq", "mysql")])
def test_three_replicas_dispatch_every_occurrence_exactly_once_and_survive_a_sigkill(
    make_cluster, broker: str, database: str
) -> None:
    broker_url, database_url = services(broker, database)
    # Polling every 5 s: a survivor that only polled would skip the occurrences meanwhile.
    cluster = make_cluster(broker_url, database_url, E2E_EVERY_SECOND="alpha,beta", E2E_POLLING="5")
    cluster.worker("worker", concurrency=4)
    for name in ("beat1", "beat2", "beat3"):
        cluster.beat(name)
    cluster.wait_for(lambda: len(cluster.events()) >= 4, 60, "the first runs")
    time.sleep(10)
    # Kill the replica that dispatched the latest run: the one the others must take over from.
    latest = max(cluster.store.list_runs(), key=lambda r: r["dispatched_at"] or r["claimed_at"])
    victim = next(name for name, p in cluster.processes.items() if latest["replica"].endswith(f":{p.pid}"))
    cluster.stop(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    killed_at_db = cluster.store.now()
    time.sleep(12)
    survivors = [name for name in ("beat1", "beat2", "beat3") if name != victim]
    for name in survivors:
        cluster.stop(name)
    time.sleep(3)  # let the worker finish what was dispatched last
    cluster.stop("worker")
    assert time.monotonic() - killed_at > 10

    missed = _assert_every_occurrence_once(cluster, ["alpha", "beta"], minimum=20)
    # A replica killed after publishing is taken over at the next occurrence: nothing dropped.
    # Killed between claiming and publishing, its claim waits out the publish lease (4 s)
    # and is claimed again (attempt 2): what elapsed meanwhile is dropped, and recorded.
    reclaimed = any(r["attempts"] > 1 for r in cluster.store.list_runs())
    assert all(count <= (5 if reclaimed else 0) for count in missed.values()), (missed, reclaimed)
    after = {r["replica"] for r in cluster.store.list_runs() if r["claimed_at"] > killed_at_db}
    assert after and latest["replica"] not in after, f"no survivor took over: {after}"


def test_a_worker_killed_mid_task_is_redispatched_after_lease_expiry_and_recorded_once(make_cluster) -> None:
    broker_url, database_url = services("redis", "postgresql")
    cluster = make_cluster(broker_url, database_url, E2E_SLOW="*/20 * * * * *", E2E_SLOW_SECONDS="4", E2E_LEASE="3")
    cluster.worker("worker1", concurrency=1)
    cluster.beat("beat1")
    cluster.wait_for(lambda: any(e["event"] == "start" for e in cluster.events()), 60, "the slow task to start")
    first = next(e for e in cluster.events() if e["event"] == "start")
    cluster.stop("worker1", signal.SIGKILL)
    cluster.worker("worker2", concurrency=1)

    def finished() -> bool:
        return any(e["event"] == "end" and e["occurrence"] == first["occurrence"] for e in cluster.events())

    cluster.wait_for(finished, 40, "the re-dispatched occurrence to finish")
    time.sleep(0.5)
    events = [e for e in cluster.events() if e["occurrence"] == first["occurrence"]]
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]
    assert len([e for e in events if e["event"] == "end"]) == 1
    assert {e["task_id"] for e in events} == {first["task_id"]}  # same task id on redelivery
    (run,) = [r for r in cluster.store.list_runs() if r["occurrence"].isoformat() == first["occurrence"]]
    assert run["state"] == RunState.SUCCEEDED and run["attempts"] == 2 and run["id"] == first["task_id"]
    assert "no outcome arrived" in (cluster.tmp_path / "beat1.log").read_text()


def test_an_existing_beat_schedule_runs_unchanged(make_cluster, tmp_path: Path) -> None:
    broker_url, _ = services("redis", "postgresql")
    cluster = make_cluster(broker_url, sqlite_url(tmp_path), E2E_BEAT_SCHEDULE="1")
    cluster.worker("worker")
    cluster.beat("beat1", scheduler="celery_leasebeat.LeaseScheduler")  # the full path works too
    cluster.wait_for(lambda: sum(e["schedule"] == "legacy-interval" for e in cluster.events()) >= 5, 60, "five runs")
    cluster.stop("beat1")
    time.sleep(1)
    cluster.stop("worker")
    runs = cluster.store.list_runs()
    interval = [r["occurrence"] for r in runs if r["schedule"] == "legacy-interval"]
    # The nominal cadence: exactly one second apart, whenever each was dispatched.
    assert {b - a for a, b in zip(interval, interval[1:])} == {timedelta(seconds=1)}
    assert any(r["schedule"] == "legacy-number" for r in runs)
    assert all(r["state"] == RunState.SUCCEEDED for r in runs if r["finished_at"])


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"E2E_LEASE": "soon"}, "leasebeat_lease_seconds must be a positive number of seconds, got 'soon'"),
        ({"E2E_POLLING": "-1"}, "leasebeat_polling_interval"),
        (
            {"E2E_EVERY_SECOND": "alpha", "E2E_OVERRIDES": '{"alpha": "0 25 * * *"}'},
            "schedule 'alpha': invalid cron expression '0 25 * * *'",
        ),
        ({"E2E_UNKNOWN_TASK": "1"}, "schedule 'typo': unknown task 'e2eapp.recrod'"),
    ],
)
def test_bad_input_stops_beat_with_a_message_naming_it(make_cluster, tmp_path: Path, env: dict, expected: str) -> None:
    cluster = make_cluster("memory://", sqlite_url(tmp_path), **env)
    beat = cluster.beat("beat")
    try:
        code = beat.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"beat kept running\n{cluster.logs()}") from None
    output = (tmp_path / "beat.log").read_text()
    assert code != 0 and expected in output, output[-3000:]
    assert not (tmp_path / "leasebeat.sqlite").exists()


def test_metrics_from_a_real_beat_and_a_real_prefork_worker(make_cluster) -> None:
    broker_url, database_url = services("redis", "postgresql")
    beat_port, worker_port = free_port(), free_port()
    cluster = make_cluster(
        broker_url,
        database_url,
        E2E_EVERY_SECOND="alpha,beta,gamma",
        E2E_RECORD_SLEEP="0.3",  # three runs due each second overlap: they need three children
        E2E_METRICS_PORT=str(beat_port),
        E2E_WORKER_METRICS_PORT=str(worker_port),
    )
    cluster.worker("worker", concurrency=3)  # prefork: runs land in three child processes
    cluster.beat("beat1")
    cluster.wait_for(lambda: len(cluster.events()) >= 12, 60, "twelve runs")
    cluster.stop("beat1")
    time.sleep(2)
    pids = {e["pid"] for e in cluster.events()}
    assert len(pids) >= 2, "the runs did not spread over pool children"
    worker = scrape(worker_port)
    for name in ("alpha", "beta", "gamma"):
        succeeded = [r for r in cluster.store.list_runs(name) if r["state"] == RunState.SUCCEEDED]
        # Summed over every pool child: exactly the runs the ledger recorded.
        assert worker[f'leasebeat_runs_total{{outcome="succeeded",schedule="{name}"}}'] == len(succeeded)
        assert worker[f'leasebeat_run_duration_seconds_count{{schedule="{name}"}}'] == len(succeeded)
        assert worker[f'leasebeat_start_lag_seconds_count{{schedule="{name}"}}'] == len(succeeded)
    cluster.stop("worker")


def test_beat_serves_its_metrics(make_cluster) -> None:
    broker_url, database_url = services("redis", "postgresql")
    port = free_port()
    cluster = make_cluster(broker_url, database_url, E2E_EVERY_SECOND="alpha", E2E_METRICS_PORT=str(port))
    cluster.worker("worker")
    cluster.beat("beat1")
    cluster.wait_for(lambda: len(cluster.events()) >= 3, 60, "three runs")
    beat = scrape(port)
    assert beat["leasebeat_claims_total"] >= 3
    assert beat["leasebeat_dispatch_lag_seconds_count"] >= 3
    assert beat['leasebeat_dispatch_lag_seconds_bucket{le="1.0"}'] >= 3
    assert beat["leasebeat_cycle_seconds_count"] >= 3


def test_flower_shows_each_run_with_its_schedule_and_occurrence(make_cluster) -> None:
    import urllib.request

    broker_url, database_url = services("redis", "postgresql")
    port = free_port()
    cluster = make_cluster(broker_url, database_url, E2E_EVERY_SECOND="alpha", FLOWER_UNAUTHENTICATED_API="true")
    cluster._start("flower", "flower", f"--port={port}", "--address=127.0.0.1")
    worker = cluster._start(
        "worker",
        "worker",
        "-E",
        "-l",
        "info",
        "-c",
        "2",
        "-Q",
        cluster.env["E2E_QUEUE"],
        "-n",
        f"w-{cluster.prefix}@%h",
    )
    assert worker.poll() is None
    cluster.beat("beat1")
    cluster.wait_for(lambda: len(cluster.events()) >= 3, 60, "three runs")

    def flower_tasks() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks?limit=100", timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            return {}

    ledger = {r["id"]: r for r in cluster.store.list_runs() if r["state"] == RunState.SUCCEEDED}

    def seen() -> bool:
        return any(task_id in ledger and info.get("state") == "SUCCESS" for task_id, info in flower_tasks().items())

    cluster.wait_for(seen, 60, "Flower to report a run")
    tasks = flower_tasks()
    task_id = next(t for t in tasks if t in ledger and tasks[t].get("state") == "SUCCESS")
    info, run = tasks[task_id], ledger[task_id]
    assert info["name"] == "e2eapp.record"  # the task keeps its name: Flower filters and labels by it
    assert info["kwargs"] == f"{{}} [leasebeat alpha@{run['occurrence'].isoformat()}]"
    assert info["runtime"] is not None and info["runtime"] >= 0
