"""What every scenario shares: the schedulers under test, the services, starting and
stopping real ``celery beat`` (and worker) processes, cleaning up, and the machine report."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEDULER_CLASSES = {
    "celery": "celery.beat:PersistentScheduler",
    "django": "django_celery_beat.schedulers:DatabaseScheduler",
    "redbeat": "redbeat.RedBeatScheduler",
    "leasebeat": "leasebeat",
}


@dataclass
class Settings:
    redis: str
    postgres: str  # SQLAlchemy URL (leasebeat)

    @property
    def django_postgres(self) -> str:
        """django-celery-beat's own database on the same server."""
        return self.postgres.replace("+psycopg", "").rsplit("/", 1)[0] + "/lbbench_django"


def declare(broker: str, queue: str) -> None:
    """Declare the queue (and its binding) so that messages published before any worker
    exists are kept, as they would be in production."""
    from kombu import Connection

    with Connection(broker) as connection:
        connection.SimpleQueue(queue).close()


def delete_queue(broker: str, queue: str) -> None:
    from kombu import Connection

    with Connection(broker) as connection:
        connection.default_channel.client.delete(queue)


def environment(settings: Settings, scheduler: str, prefix: str, queue: str, **extra: Any) -> dict[str, str]:
    """The environment the benchmark apps read (benchmarks/benchapp.py)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "BENCH_SCHEDULER": scheduler,
        "BENCH_QUEUE": queue,
        "BENCH_BROKER": settings.redis,
        "BENCH_DATABASE": settings.postgres,
        "BENCH_DJANGO_DATABASE": settings.django_postgres,
        "BENCH_PREFIX": prefix,
        "BENCH_REDBEAT_URL": settings.redis,
        **{key: str(value) for key, value in extra.items()},
    }


def start_beat(env: dict[str, str], scheduler: str, folder: Path, name: str = "beat") -> subprocess.Popen[bytes]:
    """A real ``celery beat`` process for *scheduler*; its log goes to *folder*/*name*.log."""
    log = open(folder / f"{name}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", env.get("BENCH_APP", "benchmarks.benchapp"), "beat",
         "-S", SCHEDULER_CLASSES[scheduler], "-l", "warning", "-s", str(folder / f"{name}-schedule")],
        cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def start_worker(env: dict[str, str], folder: Path, concurrency: int = 8) -> subprocess.Popen[bytes]:
    """A real ``celery worker`` consuming the benchmark queue with a thread pool."""
    log = open(folder / "worker.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", env.get("BENCH_APP", "benchmarks.benchapp"), "worker",
         "-P", "threads", "-c", str(concurrency), "-Q", env["BENCH_QUEUE"], "-l", "warning",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def workdir(scheduler: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"bench-{scheduler}-"))


def prepare_django(env: dict[str, str], count: int, *, minute: int | None = None, every: float | None = None) -> None:
    """Create django-celery-beat's database, migrate, and write *count* periodic tasks:
    crontab rows at *minute* of every hour, or interval rows *every* seconds."""
    schedule = (
        f'CrontabSchedule.objects.create(minute="{minute}", hour="*", day_of_week="*", day_of_month="*", '
        f'month_of_year="*", timezone="UTC")'
        if minute is not None
        else f"IntervalSchedule.objects.create(every={every}, period=IntervalSchedule.SECONDS)"
    )
    field = "crontab" if minute is not None else "interval"
    script = f"""
import django, os
from sqlalchemy import create_engine
url = os.environ["BENCH_DJANGO_DATABASE"]
admin = create_engine(url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + "/postgres",
                      isolation_level="AUTOCOMMIT")
with admin.connect() as c:
    c.exec_driver_sql("DROP DATABASE IF EXISTS lbbench_django WITH (FORCE)")
    c.exec_driver_sql("CREATE DATABASE lbbench_django")
os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.djsettings"
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask, PeriodicTasks
schedule = {schedule}
PeriodicTask.objects.bulk_create(
    [PeriodicTask(name=f"bench-{{i:06d}}", task=os.environ.get("BENCH_TASK", "bench.noop"), {field}=schedule,
                  args=f'["bench-{{i:06d}}"]', queue=os.environ["BENCH_QUEUE"]) for i in range({count})],
    batch_size=2000,
)
PeriodicTasks.update_changed()
"""
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=ROOT)


def cleanup(scheduler: str, settings: Settings, prefix: str) -> None:
    """Drop what a run of *scheduler* left: leasebeat's tables, RedBeat's keys."""
    if scheduler == "leasebeat":
        from celery_leasebeat.store import Store

        store = Store(settings.postgres, table_prefix=prefix)
        store.tables.metadata.drop_all(store.engine, checkfirst=True)
        store.dispose()
    elif scheduler == "redbeat":
        import redis

        client = redis.Redis.from_url(settings.redis)
        keys = list(client.scan_iter(f"{prefix}*", count=5000))
        for start in range(0, len(keys), 5000):
            client.delete(*keys[start : start + 5000])


def machine() -> dict[str, Any]:
    def installed(name: str) -> str:
        try:
            return version(name)
        except Exception:
            return "not installed"

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {
            name: installed(name)
            for name in (
                "celery",
                "kombu",
                "redis",
                "SQLAlchemy",
                "psycopg",
                "celery-leasebeat",
                "celery-redbeat",
                "django-celery-beat",
                "Django",
            )
        },  # fmt: skip
    }
