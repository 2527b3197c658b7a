"""The Celery app every scheduler under test runs, configured from the environment.

BENCH_SCHEDULER picks the scheduler (celery, redbeat, django, leasebeat); BENCH_N schedules
are crontab entries firing at minute BENCH_MINUTE of every hour, all sent to BENCH_QUEUE.
"""

import os

from celery import Celery
from celery.schedules import crontab

SCHEDULER = os.environ.get("BENCH_SCHEDULER", "leasebeat")
COUNT = int(os.environ.get("BENCH_N", "0"))
MINUTE = int(os.environ.get("BENCH_MINUTE", "0"))
QUEUE = os.environ.get("BENCH_QUEUE", "bench")

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
    beat_max_loop_interval=5,
    leasebeat_database_url=os.environ.get("BENCH_DATABASE", "postgresql+psycopg://postgres@127.0.0.1/test"),
    leasebeat_table_prefix=os.environ.get("BENCH_PREFIX", "bench_"),
    leasebeat_batch_size=int(os.environ.get("BENCH_BATCH", "500")),
    redbeat_redis_url=os.environ.get("BENCH_REDBEAT_URL", "redis://127.0.0.1:6379/5"),
    redbeat_key_prefix=os.environ.get("BENCH_PREFIX", "bench_"),
)


@app.task(name="bench.noop")
def noop(index: int = 0) -> None:
    """Never run: the burst has no worker; only its messages are counted."""


if SCHEDULER != "django":  # django-celery-beat reads its rows, written by the harness
    app.conf.beat_schedule = {
        f"bench-{i:06d}": {"task": "bench.noop", "schedule": crontab(minute=MINUTE), "args": (i,)} for i in range(COUNT)
    }
