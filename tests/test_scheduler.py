"""LeaseScheduler in process, against a real database and a real Redis: start-up that
touches nothing, the smart wait, and outages of the database and of the broker."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kombu
import kombu.exceptions
import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy import event

from celery_leasebeat import LeaseScheduler, register_schedule
from celery_leasebeat.scheduler import TAKEOVER_DELAY_SECONDS
from celery_leasebeat.store import RunState, Store

from .conftest import POSTGRES_URL, REDIS_URL, drop_tables, make_all_due, require_server, sqlite_url
from .tcp_proxy import TcpProxy


def make_app(database_url: str, broker_url: str = "memory://", **settings: object) -> Celery:
    app = Celery(f"sched-{uuid.uuid4().hex[:6]}", broker=broker_url, set_as_current=False)
    app.conf.update(
        leasebeat_database_url=database_url,
        leasebeat_table_prefix=f"s{uuid.uuid4().hex[:10]}_",
        task_default_queue=f"q-{uuid.uuid4().hex[:10]}",
        broker_connection_retry_on_startup=False,
        result_expires=None,  # no celery.backend_cleanup entry: count only our schedules
        **settings,
    )

    @app.task(name="proj.work", shared=False)
    def work() -> None: ...

    return app


def store_of(app: Celery) -> Store:
    return app._leasebeat_store  # type: ignore[attr-defined, no-any-return]


def drain(app: Celery) -> list[str]:
    """The task ids waiting on the app's queue, consumed."""
    return [message.headers["id"] for message in drain_messages(app)]


def drain_messages(app: Celery) -> list[Any]:
    """The messages waiting on the app's queue, consumed."""
    messages = []
    with Connection(app.conf.broker_url) as connection:
        queue = connection.SimpleQueue(app.conf.task_default_queue)
        while True:
            try:
                message = queue.get(timeout=0.5)
            except queue.Empty:
                break
            messages.append(message)
            message.ack()
        queue.close()
    return messages


def declare_queue(app: Celery) -> None:
    with Connection(app.conf.broker_url) as connection:
        connection.SimpleQueue(app.conf.task_default_queue).close()


def three_due_jobs(app: Celery) -> tuple[LeaseScheduler, Store]:
    """Three every-minute schedules on *app*'s queue, synced by a first tick, then all due
    a second ago: the next tick claims and publishes them."""
    for i in range(3):
        register_schedule("proj.work", "* * * * *", name=f"job{i}", app=app)
    declare_queue(app)
    scheduler = LeaseScheduler(app)
    scheduler.tick()
    store = store_of(app)
    make_all_due(store)
    return scheduler, store


@pytest.fixture
def cleanup() -> Iterator[list[tuple[Celery, str]]]:
    """(app, database URL without any proxy): their tables are dropped afterwards."""
    apps: list[tuple[Celery, str]] = []
    yield apps
    for app, url in apps:
        store = getattr(app, "_leasebeat_store", None)
        if store is not None:
            store.dispose()
        drop_tables(Store(url, table_prefix=app.conf.leasebeat_table_prefix))


def test_construction_and_the_banner_touch_no_database(tmp_path: Path) -> None:
    # Port 9 (discard) on loopback: any connection attempt would fail loudly.
    app = make_app("postgresql+psycopg://nobody@127.0.0.1:9/none")
    register_schedule("proj.work", "* * * * *", app=app)
    lazy = LeaseScheduler(app, lazy=True)
    assert "postgresql+psycopg://nobody@127.0.0.1:9/none" in lazy.info
    eager = LeaseScheduler(app)
    assert store_of(app)._engine is None
    assert eager.max_interval == 30.0


def test_a_nightly_table_sleeps_the_polling_interval(tmp_path: Path, cleanup: list[tuple[Celery, str]]) -> None:
    app = make_app(sqlite_url(tmp_path), leasebeat_polling_interval=20)
    cleanup.append((app, sqlite_url(tmp_path)))
    register_schedule("proj.work", "15 3 * * *", name="nightly", app=app)
    scheduler = LeaseScheduler(app)
    assert scheduler.tick() == 20.0


def test_the_wait_ends_at_the_next_due_occurrence(tmp_path: Path, cleanup: list[tuple[Celery, str]]) -> None:
    app = make_app(sqlite_url(tmp_path), leasebeat_polling_interval=20)
    cleanup.append((app, sqlite_url(tmp_path)))
    register_schedule("proj.work", "* * * * * *", name="every-second", app=app)
    scheduler = LeaseScheduler(app)
    waits = []
    for _ in range(6):  # as beat does: tick, sleep what it says
        waits.append(scheduler.tick())
        time.sleep(waits[-1])
    assert all(w <= 1.0 for w in waits), waits
    # It dispatched (its broker is in memory); the leased schedule's next occurrence is the wait.
    runs = store_of(app).list_runs("every-second")
    assert runs and runs[0]["state"] == RunState.DISPATCHED


def test_a_replica_wakes_when_a_run_another_dispatched_is_due_again(
    tmp_path: Path, cleanup: list[tuple[Celery, str]]
) -> None:
    """A replica that died after dispatching takes its memory of the run along: the others
    learn from the probe when the schedule is due again, and look shortly after."""
    app = make_app(sqlite_url(tmp_path), leasebeat_polling_interval=20)
    cleanup.append((app, sqlite_url(tmp_path)))
    register_schedule("proj.work", "* * * * * *", name="every-second", app=app)
    dispatcher = LeaseScheduler(app)
    while not store_of(app).list_runs("every-second"):
        time.sleep(dispatcher.tick())
    # No worker: the run's lease stays held, as while a run is in flight.
    following = store_of(app).get_schedule("every-second")["following_at"]
    survivor = LeaseScheduler(app)
    wait = survivor.tick()
    now = store_of(app).now()
    expected = (following - now).total_seconds() + TAKEOVER_DELAY_SECONDS
    assert following > now and 0 < wait <= 1 + TAKEOVER_DELAY_SECONDS
    assert abs(wait - expected) < 0.2, (wait, expected)


def test_database_outage_backs_off_and_never_double_dispatches(
    cleanup: list[tuple[Celery, str]], caplog: pytest.LogCaptureFixture
) -> None:
    require_server(POSTGRES_URL, "PostgreSQL")
    require_server(REDIS_URL, "Redis")
    target = urlparse(POSTGRES_URL.replace("+psycopg", ""))
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    try:
        url = POSTGRES_URL.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
        app = make_app(url, REDIS_URL, leasebeat_polling_interval=5)
        cleanup.append((app, POSTGRES_URL))
        for i in range(3):
            register_schedule("proj.work", "* * * * *", name=f"job{i}", app=app)
        declare_queue(app)
        scheduler = LeaseScheduler(app)
        store = store_of(app)

        proxy.cut()
        with caplog.at_level(logging.ERROR, logger="celery_leasebeat"):
            assert scheduler.tick() == 1.0
            assert scheduler.tick() == 2.0  # backing off, not crashing
        assert "unavailable" in caplog.text and "retrying in" in caplog.text

        proxy.restore()
        scheduler.tick()  # syncs the registrations
        make_all_due(store)
        for _ in range(3):
            scheduler.tick()
        dispatched = drain(app)
        assert len(dispatched) == 3

        proxy.cut()
        scheduler.tick()
        proxy.restore()
        for _ in range(3):
            scheduler.tick()
        assert drain(app) == []  # the connection came back: nothing sent twice
        assert {r["id"] for r in store.list_runs()} == set(dispatched)
    finally:
        proxy.close()


def test_broker_outage_releases_claims_and_retries_them(
    cleanup: list[tuple[Celery, str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_server(REDIS_URL, "Redis")
    target = urlparse(REDIS_URL)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    try:
        broker = REDIS_URL.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
        app = make_app(sqlite_url(tmp_path), broker, leasebeat_polling_interval=5)
        cleanup.append((app, sqlite_url(tmp_path)))
        scheduler, store = three_due_jobs(app)

        proxy.cut()
        with caplog.at_level(logging.ERROR, logger="celery_leasebeat"):
            delay = scheduler.tick()
        assert delay >= 1.0 and "broker unavailable" in caplog.text
        runs = store.list_runs()
        assert len(runs) == 3 and {r["state"] for r in runs} == {RunState.PUBLISH_FAILED}
        assert all(row["lease_token"] is None for row in store.list_schedules())

        proxy.restore()
        for _ in range(3):
            scheduler.tick()
        dispatched = drain(app)
        assert sorted(dispatched) == sorted(r["id"] for r in runs)  # the same occurrences, not lost
        assert {r["state"] for r in store.list_runs()} == {RunState.DISPATCHED}
        scheduler.close()
    finally:
        proxy.close()


def test_a_batch_whose_flush_fails_waits_for_its_publish_lease_and_never_runs_twice(
    cleanup: list[tuple[Celery, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu's batch publish reports a failed flush as delivery uncertain: beat must neither
    record the occurrences failed nor release them (a copy that did arrive may be starting);
    after the publish lease they are published again, and a copy that arrived is fenced off."""
    require_server(REDIS_URL, "Redis")
    from kombu.transport import redis as kombu_redis

    if not hasattr(kombu_redis, "PublishBatch"):
        pytest.skip(f"kombu {kombu.__version__} has no batch publishing")
    app = make_app(sqlite_url(tmp_path), REDIS_URL, leasebeat_polling_interval=5)
    cleanup.append((app, sqlite_url(tmp_path)))
    scheduler, store = three_due_jobs(app)
    store.publish_lease_seconds = 1

    real_flush = kombu_redis.PublishBatch.flush

    def flush_then_fail(batch: Any) -> None:  # the commands went out; the reply was lost
        real_flush(batch)
        raise kombu.exceptions.BatchPublishError("Redis publish batch failed; delivery is uncertain")

    monkeypatch.setattr(kombu_redis.PublishBatch, "flush", flush_then_fail)
    assert scheduler.tick() >= 1.0  # backing off: the broker failed
    assert {r["state"] for r in store.list_runs()} == {RunState.CLAIMED}  # not failed, not released
    first = drain_messages(app)
    assert len(first) == 3
    # A worker takes one copy while its lease still holds: it runs, and is not dispatched again.
    started = first[0].headers
    assert store.start_run(
        schedule=started["leasebeat_schedule"], run_id=started["id"], token=started["leasebeat_token"],
        worker="w", lease_seconds=60,
    ).run  # fmt: skip

    monkeypatch.setattr(kombu_redis.PublishBatch, "flush", real_flush)
    time.sleep(1.2)  # the publish lease of the two copies no worker started expires
    scheduler.tick()
    again = drain_messages(app)
    assert sorted(m.headers["leasebeat_schedule"] for m in again) == sorted(
        m.headers["leasebeat_schedule"] for m in first[1:]
    )
    for late_copy in first[1:]:  # the first copies, delivered late, are fenced off
        headers = late_copy.headers
        decision = store.start_run(
            schedule=headers["leasebeat_schedule"], run_id=headers["id"], token=headers["leasebeat_token"],
            worker="w", lease_seconds=60,
        )  # fmt: skip
        assert not decision.run and "no longer holds the lease" in decision.reason
    scheduler.close()


def test_an_occurrence_claimed_after_its_grace_is_recorded_missed_not_run(
    tmp_path: Path, cleanup: list[tuple[Celery, str]]
) -> None:
    app = make_app(sqlite_url(tmp_path))
    cleanup.append((app, sqlite_url(tmp_path)))
    register_schedule("proj.work", "* * * * *", name="strict", grace=5, app=app)
    register_schedule("proj.work", "* * * * *", name="relaxed", app=app)
    scheduler = LeaseScheduler(app)
    scheduler.tick()
    store = store_of(app)
    long_ago = (store.now() - timedelta(minutes=10)).replace(second=0, microsecond=0)
    with store.engine.begin() as connection:
        connection.execute(store.tables.schedules.update().values(next_run_at=long_ago))
    scheduler.tick()
    runs = {r["schedule"]: r for r in store.list_runs()}
    assert runs["strict"]["state"] == RunState.MISSED
    assert "not claimed within its grace of 5s" in runs["strict"]["error"]
    assert store.get_schedule("strict")["next_run_at"] > long_ago + timedelta(minutes=10)
    assert runs["relaxed"]["state"] == RunState.DISPATCHED  # no grace: runs once, late


def test_the_history_purge_is_the_packages_own_schedule(tmp_path: Path, cleanup: list[tuple[Celery, str]]) -> None:
    app = make_app(sqlite_url(tmp_path), leasebeat_history_retention_days=7, leasebeat_purge_batch_size=2)
    cleanup.append((app, sqlite_url(tmp_path)))
    scheduler = LeaseScheduler(app)
    scheduler.tick()
    store = store_of(app)
    assert store.get_schedule("leasebeat.purge_history")["task"] == "celery_leasebeat.purge_history"
    now = store.now()
    rows = [
        {
            "id": f"old-{i}",
            "schedule": "x",
            "occurrence": now - timedelta(days=30, minutes=i),
            "state": "succeeded",
            "attempts": 1,
            "finished_at": now - timedelta(days=30, minutes=i),
            "missed_count": 0,
        }
        for i in range(5)
    ] + [
        {
            "id": "recent",
            "schedule": "x",
            "occurrence": now,
            "state": "succeeded",
            "attempts": 1,
            "finished_at": now - timedelta(days=1),
            "missed_count": 0,
        }
    ]
    with store.engine.begin() as connection:
        connection.execute(store.tables.runs.insert(), rows)
    purge = app.tasks["celery_leasebeat.purge_history"]
    assert purge.apply().get() == {"deleted": 2, "capped": True}  # capped per run
    assert purge.apply().get() == {"deleted": 2, "capped": True}
    assert purge.apply().get() == {"deleted": 1, "capped": False}  # the backlog drained
    assert purge.apply().get() == {"deleted": 0, "capped": False}  # harmless twice
    assert [r["id"] for r in store.list_runs("x")] == ["recent"]


def test_an_idle_tick_is_the_probe_alone(tmp_path: Path, cleanup: list[tuple[Celery, str]]) -> None:
    """Nothing due and nothing in flight: no heartbeat (once a minute), no missed-run check."""
    app = make_app(sqlite_url(tmp_path))
    cleanup.append((app, sqlite_url(tmp_path)))
    register_schedule("proj.work", "0 0 1 1 *", name="yearly", app=app)
    scheduler = LeaseScheduler(app)
    scheduler.tick()  # the first sync and the first heartbeat
    statements: list[str] = []
    store = store_of(app)
    for engine in {store.engine, store.probe_engine}:
        event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    for _ in range(3):
        scheduler.tick()
    assert len(statements) == 3 and all("next_run_at" in sql for sql in statements), statements
    scheduler.close()


def test_a_replica_started_on_rows_that_match_its_definitions_compares_none(
    tmp_path: Path, cleanup: list[tuple[Celery, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common restart: the last sync recorded these definitions' digest, so start-up
    reads one row instead of every schedule, and no replica keeps the definitions once synced."""
    app = make_app(sqlite_url(tmp_path))
    cleanup.append((app, sqlite_url(tmp_path)))
    for i in range(3):
        register_schedule("proj.work", "0 0 1 1 *", name=f"yearly{i}", app=app)
    first = LeaseScheduler(app)
    first.tick()
    assert first._definitions is None and len(store_of(app).list_schedules()) == 3
    statements: list[str] = []
    store = store_of(app)
    for engine in {store.engine, store.probe_engine}:
        event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    restarted = LeaseScheduler(app)
    with monkeypatch.context() as patch:
        patch.setattr(store, "sync", lambda *args, **kwargs: pytest.fail("synced rows that already match"))
        restarted.tick()
    assert statements and not [sql for sql in statements if "kwargs" in sql], statements
    assert restarted._definitions is None

    register_schedule("proj.work", "0 0 1 1 *", name="added-at-run-time", app=app)
    restarted.tick()
    assert len(store.list_schedules()) == 4
    late = LeaseScheduler(app)
    register_schedule("proj.work", "0 0 1 1 *", name="added-before-its-first-tick", app=app)
    late.tick()
    assert len(store.list_schedules()) == 5


def test_missed_run_detection_flags_a_run_in_flight_that_did_not_start_within_grace(
    tmp_path: Path, cleanup: list[tuple[Celery, str]], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(sqlite_url(tmp_path))
    cleanup.append((app, sqlite_url(tmp_path)))
    register_schedule("proj.work", "* * * * *", name="strict", grace=1, app=app)
    scheduler = LeaseScheduler(app)
    scheduler.tick()
    store = store_of(app)
    make_all_due(store, timedelta(milliseconds=500))
    scheduler.tick()  # dispatched; no worker starts it
    assert [r["state"] for r in store.list_runs()] == [RunState.DISPATCHED]
    time.sleep(1.2)
    with caplog.at_level(logging.WARNING, logger="celery_leasebeat"):
        scheduler.tick()
    [run] = store.list_runs()
    assert "not started within its grace of 1s" in (run["alert"] or ""), run
    assert "not started within its grace" in caplog.text
    scheduler.close()
