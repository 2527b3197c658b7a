"""The Celery app every scheduler under test runs (beat and worker), configured from the
environment by the harness (benchmarks/harness.py).

BENCH_SCHEDULER picks the scheduler (celery, redbeat, django, leasebeat); BENCH_N schedules
named ``bench-000000``... all send to BENCH_QUEUE. BENCH_MODE shapes them:

- ``burst`` (default): crontab entries firing at minute BENCH_MINUTE of every hour, task
  ``bench.noop`` (no worker runs it: the burst counts messages in the broker).
- ``steady``: entries every BENCH_EVERY seconds, task ``bench.stamp``, which the worker runs
  and which appends what happened (schedule, nominal occurrence, publish and start times,
  task id) to the Redis list BENCH_RESULTS. Every published message carries its publish time
  and the publishing beat's pid in headers (``before_task_publish``), whatever the scheduler.
- ``idle``: crontab entries due once a year, months away: nothing is due while measured.

With BENCH_COUNT_FILE set, the beat process counts its database statements (SQLAlchemy and
Django) and its cycles, and writes the totals to that file every second.
"""

import json
import os
import time
from datetime import datetime, timezone

from celery import Celery
from celery.schedules import crontab
from celery.signals import before_task_publish

SCHEDULER = os.environ.get("BENCH_SCHEDULER", "leasebeat")
MODE = os.environ.get("BENCH_MODE", "burst")
COUNT = int(os.environ.get("BENCH_N", "0"))
MINUTE = int(os.environ.get("BENCH_MINUTE", "0"))
EVERY = float(os.environ.get("BENCH_EVERY", "1"))
QUEUE = os.environ.get("BENCH_QUEUE", "bench")
RESULTS = os.environ.get("BENCH_RESULTS", "bench-results")
PUBLISHED_HEADER = "bench_published"
PUBLISHER_HEADER = "bench_publisher"  # the pid of the beat that published it

if SCHEDULER == "django":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.djsettings")
    import django

    django.setup()

import celery_leasebeat  # noqa: E402,F401  (the worker-side handler; inert for other schedulers)

app = Celery("benchapp", broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/4"))
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    result_expires=None,  # no celery.backend_cleanup entry: count only the benchmark's schedules
    timezone="UTC",
    beat_max_loop_interval=float(os.environ.get("BENCH_MAX_LOOP", "5")),
    leasebeat_database_url=os.environ.get("BENCH_DATABASE", "postgresql+psycopg://postgres@127.0.0.1/test"),
    leasebeat_table_prefix=os.environ.get("BENCH_PREFIX", "bench_"),
    leasebeat_batch_size=int(os.environ.get("BENCH_BATCH", "500")),
    leasebeat_polling_interval=float(os.environ.get("BENCH_MAX_LOOP", "5")),
    redbeat_redis_url=os.environ.get("BENCH_REDBEAT_URL", "redis://127.0.0.1:6379/5"),
    redbeat_key_prefix=os.environ.get("BENCH_PREFIX", "bench_"),
)


@app.task(name="bench.noop")
def noop(name: str = "") -> None:
    """Never run: the burst has no worker; only its messages are counted."""


@app.task(name="bench.stamp", bind=True)
def stamp(self, name: str = "") -> None:
    """Record when this run was published and started, and which occurrence it is."""
    started = time.time()
    headers = self.request.headers or {}
    occurrence = headers.get("leasebeat_occurrence") or getattr(self.request, "leasebeat_occurrence", None)
    record = {
        "schedule": name,
        "task_id": self.request.id,
        "occurrence": datetime.fromisoformat(occurrence).timestamp() if occurrence else None,
        "published": headers.get(PUBLISHED_HEADER, getattr(self.request, PUBLISHED_HEADER, None)),
        "publisher": headers.get(PUBLISHER_HEADER, getattr(self.request, PUBLISHER_HEADER, None)),
        "started": started,
    }
    with app.connection_for_write() as connection:
        connection.default_channel.client.rpush(RESULTS, json.dumps(record))


if MODE == "steady":

    @before_task_publish.connect
    def _stamp_publish_time(headers=None, **kwargs):  # type: ignore[no-untyped-def]
        headers[PUBLISHED_HEADER] = time.time()
        headers[PUBLISHER_HEADER] = os.getpid()


def _schedules() -> dict:
    names = [f"bench-{i:06d}" for i in range(COUNT)]
    if MODE == "steady":
        return {name: {"task": "bench.stamp", "schedule": EVERY, "args": (name,)} for name in names}
    if MODE == "idle":
        now = datetime.now(timezone.utc)
        month = (now.month + 5) % 12 + 1  # half a year away; the hour as django's rows (scale.py)
        due = crontab(minute=0, hour=now.hour, day_of_month=1, month_of_year=month)
        return {name: {"task": "bench.noop", "schedule": due, "args": (name,)} for name in names}
    return {name: {"task": "bench.noop", "schedule": crontab(minute=MINUTE), "args": (name,)} for name in names}


if SCHEDULER != "django":  # django-celery-beat reads its rows, written by the harness
    app.conf.beat_schedule = _schedules()

if os.environ.get("BENCH_COUNT_FILE"):
    from benchmarks import counting

    counting.install(os.environ["BENCH_COUNT_FILE"])
