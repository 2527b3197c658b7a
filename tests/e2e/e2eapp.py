"""The app the end-to-end tests run as real ``celery beat`` and ``celery worker`` processes.

Everything comes from the environment, so one module serves every broker and database.
Each task body appends one JSON line per event to ``E2E_RECORD``: the tests count what the
bodies themselves saw, next to what the ledger says.
"""

import json
import os
import time
from datetime import timedelta

from celery import Celery

import celery_leasebeat  # noqa: F401  (connects the worker-side result handler)
from celery_leasebeat import register_schedule

app = Celery("e2eapp", broker=os.environ["E2E_BROKER"])
app.conf.update(
    leasebeat_database_url=os.environ["E2E_DATABASE"],
    leasebeat_table_prefix=os.environ.get("E2E_PREFIX", "leasebeat_"),
    # Passed through as strings: leasebeat validates its own settings.
    leasebeat_polling_interval=os.environ.get("E2E_POLLING", "0.5"),
    leasebeat_lease_seconds=os.environ.get("E2E_LEASE", "4"),
    leasebeat_overrides=json.loads(os.environ.get("E2E_OVERRIDES", "{}")),
    task_default_queue=os.environ.get("E2E_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_acks_late=os.environ.get("E2E_ACKS_LATE") == "1",
    leasebeat_metrics_port=os.environ.get("E2E_METRICS_PORT"),
    leasebeat_worker_metrics_port=os.environ.get("E2E_WORKER_METRICS_PORT"),
    leasebeat_history_retention_days=os.environ.get("E2E_RETENTION_DAYS"),
)
if os.environ.get("E2E_BEAT_SCHEDULE") == "1":
    # An existing project's schedule, unchanged.
    app.conf.beat_schedule = {
        "legacy-interval": {"task": "e2eapp.record", "schedule": timedelta(seconds=1), "args": ("legacy",)},
        "legacy-number": {"task": "e2eapp.record", "schedule": 2.0, "args": ("number",)},
    }
if os.environ.get("E2E_UNKNOWN_TASK") == "1":
    app.conf.beat_schedule = {"typo": {"task": "e2eapp.recrod", "schedule": 1.0}}
RECORD = os.environ["E2E_RECORD"]


def _write(event: str, task) -> None:
    headers = task.request.headers or {}
    line = {
        "event": event,
        "schedule": headers.get("leasebeat_schedule"),
        "occurrence": headers.get("leasebeat_occurrence"),
        "task_id": task.request.id,
        "pid": os.getpid(),
        "at": time.time(),
    }
    with open(RECORD, "a") as handle:
        handle.write(json.dumps(line) + "\n")


@app.task(bind=True)
def record(self, label: str = "") -> str:
    _write("run", self)
    time.sleep(float(os.environ.get("E2E_RECORD_SLEEP", "0")))
    return label


@app.task(bind=True)
def slow(self, seconds: float) -> None:
    _write("start", self)
    time.sleep(seconds)
    _write("end", self)


for name in filter(None, os.environ.get("E2E_EVERY_SECOND", "").split(",")):
    register_schedule(record, "* * * * * *", name=name, args=[name])
if os.environ.get("E2E_SLOW"):
    register_schedule(slow, os.environ["E2E_SLOW"], name="slow", args=[float(os.environ.get("E2E_SLOW_SECONDS", "5"))])


@app.task(bind=True)
def sweep(self, cap: int) -> int:
    """An inline job: does at most *cap* units of work and says how many."""
    _write("run", self)
    return min(cap, 25)


@app.task(bind=True)
def cluster(self, fail: bool = False) -> str:
    _write("run", self)
    if fail:
        raise RuntimeError("clustering failed")
    return "clustered"


if os.environ.get("E2E_API") == "1":
    register_schedule(record, None, name="reindex", triggered=True, args=["reindex"])
    register_schedule(sweep, None, name="sweep", triggered=True, inline_cap=40)
    register_schedule(cluster, None, name="clustering", triggered=True)
    register_schedule(record, None, name="rollup", after="clustering", args=["rollup"])
    register_schedule(cluster, None, name="clustering-bad", triggered=True, kwargs={"fail": True})
    register_schedule(record, None, name="rollup-bad", after="clustering-bad", args=["rollup-bad"])
    register_schedule(record, None, name="batch-reindex", triggered=True, queue=f"{app.conf.task_default_queue}-batch")
    remote = os.environ.get("E2E_REMOTE_URL", "http://127.0.0.1:1")
    register_schedule("celery_leasebeat.call_job", None, name="remote-sweep", triggered=True, args=[remote, "sweep"])
    register_schedule(
        "celery_leasebeat.call_job", None, name="remote-reindex", triggered=True, args=[remote, "reindex"],
        kwargs={"poll_interval": 0.2, "timeout": 30},
    )  # fmt: skip
