"""The worker side, with an in-process worker on real Redis and PostgreSQL: outcomes are
recorded fenced, and a delivery that may not run is skipped."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_leasebeat import LeaseScheduler, register_schedule
from celery_leasebeat.recorder import HEADER_OCCURRENCE, HEADER_SCHEDULE, HEADER_TOKEN
from celery_leasebeat.store import RunState, Store

from .conftest import POSTGRES_URL, REDIS_URL, drop_tables, make_all_due, require_server

BODIES: list[str] = []


@pytest.fixture
def app() -> Iterator[Celery]:
    require_server(POSTGRES_URL, "PostgreSQL")
    require_server(REDIS_URL, "Redis")
    app = Celery(f"rec-{uuid.uuid4().hex[:6]}", broker=REDIS_URL, set_as_current=False)
    app.conf.update(
        leasebeat_database_url=POSTGRES_URL,
        leasebeat_table_prefix=f"r{uuid.uuid4().hex[:10]}_",
        task_default_queue=f"q-{uuid.uuid4().hex[:10]}",
        result_expires=None,
    )

    @app.task(name=f"{app.main}.boom", shared=False)
    def boom() -> None:
        BODIES.append("boom")
        raise ValueError("the disk is full")

    @app.task(name=f"{app.main}.fine", bind=True, shared=False)
    def fine(self) -> str:
        BODIES.append(self.request.id)
        return "ok"

    BODIES.clear()
    yield app
    store = getattr(app, "_leasebeat_store", None)
    if store is not None:
        store.dispose()
        drop_tables(Store(POSTGRES_URL, table_prefix=app.conf.leasebeat_table_prefix))


def dispatch_now(app: Celery) -> tuple[LeaseScheduler, Store]:
    """Make every schedule due and run one beat cycle: each is claimed and published."""
    scheduler = LeaseScheduler(app)
    scheduler.tick()
    store: Store = app._leasebeat_store  # type: ignore[attr-defined]
    make_all_due(store)
    scheduler.tick()
    return scheduler, store


def wait_until(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_failure_is_recorded_with_its_error_and_the_schedule_advances(app: Celery) -> None:
    register_schedule(f"{app.main}.boom", "0 * * * *", name="boom", app=app)
    with start_worker(app, perform_ping_check=False):
        scheduler, store = dispatch_now(app)
        wait_until(lambda: store.list_runs() and store.list_runs()[0]["state"] == RunState.FAILED)
    (run,) = store.list_runs()
    assert run["error"] == "ValueError: the disk is full" and run["duration_ms"] is not None
    row = store.get_schedule("boom")
    assert row["last_outcome"] == RunState.FAILED and row["last_error"] == "ValueError: the disk is full"
    assert row["lease_token"] is None and row["next_run_at"] > run["occurrence"]
    assert row["next_run_at"].minute == 0
    scheduler.close()


class Remember(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_redelivered_and_stale_messages_are_not_executed(app: Celery) -> None:
    remembered = Remember()
    recorder_log = logging.getLogger("celery_leasebeat.recorder")
    recorder_log.addHandler(remembered)
    recorder_log.setLevel(logging.WARNING)  # the test worker sets the root logger to ERROR
    name = f"{app.main}.fine"
    register_schedule(name, "0 * * * *", name="fine", app=app)
    with start_worker(app, perform_ping_check=False):
        scheduler, store = dispatch_now(app)
        wait_until(lambda: store.list_runs() and store.list_runs()[0]["state"] == RunState.SUCCEEDED)
        (run,) = store.list_runs()
        assert BODIES == [run["id"]]

        headers = {
            HEADER_SCHEDULE: "fine",
            HEADER_OCCURRENCE: run["occurrence"].isoformat(),
            HEADER_TOKEN: run["lease_token"],
        }
        # The same message again (a broker redelivery): the run already completed.
        app.tasks[name].apply_async(task_id=run["id"], headers=headers)
        # A message whose token never held the lease.
        app.tasks[name].apply_async(task_id=run["id"], headers={**headers, HEADER_TOKEN: "forged"})
        # An ordinary call of the same task, without leasebeat headers, runs as usual.
        plain = app.tasks[name].apply_async()
        wait_until(lambda: plain.id in BODIES)
        time.sleep(0.5)
    assert BODIES == [run["id"], plain.id]
    assert store.list_runs()[0]["state"] == RunState.SUCCEEDED
    recorder_log.removeHandler(remembered)
    recorder_log.setLevel(logging.NOTSET)
    skipped = [m for m in remembered.messages if m.startswith("leasebeat: not running fine@")]
    assert len(skipped) == 2, remembered.messages
    assert all("already finished (state succeeded)" in message for message in skipped)
    scheduler.close()
