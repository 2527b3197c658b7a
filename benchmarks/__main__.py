"""``python -m benchmarks``: the burst and publishing-floor benchmarks, side by side.

Burst: N crontab schedules all due at the same minute boundary and no worker; the time from
the boundary until the last of the N messages is in the broker (Redis), for Celery's
PersistentScheduler, django-celery-beat, RedBeat and leasebeat, each as a real ``celery
beat`` process against the same Redis and PostgreSQL. Floor: how fast one process publishes
the same Celery task messages to the same broker, so each rate is also a fraction of it.

Results go to docs/benchmarks/ (results.json, results.md, burst.png). Absolute numbers
depend on the machine; compare the ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "benchmarks"
SCHEDULER_CLASSES = {
    "celery": "celery.beat:PersistentScheduler",
    "django": "django_celery_beat.schedulers:DatabaseScheduler",
    "redbeat": "redbeat.RedBeatScheduler",
    "leasebeat": "leasebeat",
}
UTC = timezone.utc


@dataclass
class Burst:
    scheduler: str
    schedules: int
    complete: bool
    seconds: float | None  # boundary -> last message in the broker
    first_seconds: float | None  # boundary -> first message
    delivered: int
    rate: float | None  # messages per second over the burst


@dataclass
class Settings:
    redis: str
    postgres: str
    django_postgres: str


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 20000])
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULER_CLASSES), choices=list(SCHEDULER_CLASSES))
    parser.add_argument("--redis", default=os.environ.get("LEASEBEAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument(
        "--postgres",
        default=os.environ.get("LEASEBEAT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1/test"),
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="longest wait for one burst, in seconds")
    parser.add_argument("--output", type=Path, default=RESULTS)
    options = parser.parse_args(argv)
    settings = Settings(
        redis=options.redis,
        postgres=options.postgres,
        django_postgres=options.postgres.replace("+psycopg", "").rsplit("/", 1)[0] + "/lbbench_django",
    )
    started = datetime.now(UTC)
    floor = {n: publishing_floor(settings, n) for n in options.sizes}
    bursts = []
    for n in options.sizes:
        for scheduler in options.schedulers:
            result = burst(settings, scheduler, n, options.timeout)
            print(json.dumps(asdict(result)), flush=True)
            bursts.append(result)
    report = {
        "started": started.isoformat(),
        "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
        "timeout": options.timeout,
        "machine": machine(),
        "floor": floor,
        "bursts": [asdict(b) for b in bursts],
    }
    write_results(report, options.output)
    return 0


def publishing_floor(settings: Settings, count: int) -> float:
    """Messages per second one process publishes with Celery's apply_async over one connection."""
    from celery import Celery
    from kombu import Connection

    queue = f"floor-{uuid.uuid4().hex[:8]}"
    app = Celery("floor", broker=settings.redis, set_as_current=False)
    app.conf.task_default_queue = queue

    @app.task(name="bench.noop", shared=False)
    def noop(index: int = 0) -> None: ...

    declare(settings.redis, queue)
    with app.producer_or_acquire() as producer:
        began = time.perf_counter()
        for i in range(count):
            noop.apply_async((i,), producer=producer)
        elapsed = time.perf_counter() - began
    with Connection(settings.redis) as connection:
        connection.default_channel.client.delete(queue)
    return count / elapsed


def declare(broker: str, queue: str) -> None:
    """Declare the queue (and its binding) so that messages published before any worker
    exists are kept, as they would be in production."""
    from kombu import Connection

    with Connection(broker) as connection:
        connection.SimpleQueue(queue).close()


def burst(settings: Settings, scheduler: str, count: int, timeout: float) -> Burst:
    from kombu import Connection

    run_id = uuid.uuid4().hex[:8]
    queue, prefix = f"burst-{run_id}", f"b{run_id}_"
    warmup = 12 + count / 1000 * 1.5  # time to start, load and sync the schedules
    boundary = (datetime.now(UTC) + timedelta(seconds=warmup)).replace(second=0, microsecond=0) + timedelta(minutes=1)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "BENCH_SCHEDULER": scheduler,
        "BENCH_N": str(count),
        "BENCH_MINUTE": str(boundary.minute),
        "BENCH_QUEUE": queue,
        "BENCH_BROKER": settings.redis,
        "BENCH_DATABASE": settings.postgres,
        "BENCH_DJANGO_DATABASE": settings.django_postgres,
        "BENCH_PREFIX": prefix,
        "BENCH_REDBEAT_URL": settings.redis,
    }
    if scheduler == "django":
        prepare_django(env, count, boundary.minute)
    declare(settings.redis, queue)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{scheduler}-"))
    log = open(folder / "beat.log", "wb")
    beat = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "benchmarks.benchapp", "beat", "-S", SCHEDULER_CLASSES[scheduler],
         "-l", "warning", "-s", str(folder / "schedule")],
        cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    first = last = None
    delivered = 0
    try:
        with Connection(settings.redis) as connection:
            client = connection.default_channel.client
            deadline = boundary.timestamp() + timeout
            while time.time() < deadline:
                delivered = int(client.llen(queue))
                now = time.time()
                if delivered and first is None:
                    first = now
                if delivered >= count:
                    last = now
                    break
                if beat.poll() is not None:
                    break
                time.sleep(0.005 if now > boundary.timestamp() - 1 else 0.2)
            client.delete(queue)
    finally:
        beat.send_signal(signal.SIGTERM)
        try:
            beat.wait(30)
        except subprocess.TimeoutExpired:
            beat.kill()
        cleanup(scheduler, settings, prefix)
    start = boundary.timestamp()
    seconds = None if last is None else max(last - start, 1e-3)
    return Burst(
        scheduler=scheduler,
        schedules=count,
        complete=last is not None,
        seconds=seconds,
        first_seconds=None if first is None else first - start,
        delivered=delivered,
        rate=None if seconds is None else count / seconds,
    )


def prepare_django(env: dict[str, str], count: int, minute: int) -> None:
    """Create the database, migrate, and write the rows django-celery-beat reads."""
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
from django_celery_beat.models import CrontabSchedule, PeriodicTask
schedule = CrontabSchedule.objects.create(minute="{minute}", hour="*", day_of_week="*", day_of_month="*",
                                          month_of_year="*", timezone="UTC")
PeriodicTask.objects.bulk_create(
    [PeriodicTask(name=f"bench-{{i:06d}}", task="bench.noop", crontab=schedule, args=f"[{{i}}]",
                  queue=os.environ["BENCH_QUEUE"]) for i in range({count})],
    batch_size=2000,
)
from django_celery_beat.models import PeriodicTasks
PeriodicTasks.update_changed()
"""
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=ROOT)


def cleanup(scheduler: str, settings: Settings, prefix: str) -> None:
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


def write_results(report: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(report, indent=2))
    (output / "results.md").write_text(markdown(report))
    chart(report, output / "burst.png")


def markdown(report: dict[str, Any]) -> str:
    floor = {int(n): rate for n, rate in report["floor"].items()}
    lines = [
        "# Burst benchmark",
        "",
        f"Measured {report['started']} with `{report['command']}`.",
        "",
        "N crontab schedules due at the same minute boundary, no worker: seconds from the boundary until",
        "the last message is in Redis, the rate, and the rate as a fraction of the publishing floor",
        "(one process publishing the same messages with `apply_async` over one connection).",
        "",
        "| schedules | scheduler | last message after | rate (msg/s) | of the floor |",
        "|---:|---|---:|---:|---:|",
    ]
    for entry in report["bursts"]:
        n = entry["schedules"]
        if entry["complete"]:
            lines.append(
                f"| {n:,} | {entry['scheduler']} | {entry['seconds']:.2f} s | {entry['rate']:,.0f} "
                f"| {entry['rate'] / floor[n]:.0%} |"
            )
        else:
            waited = f" in {report['timeout']:.0f} s" if "timeout" in report else ""
            lines.append(
                f"| {n:,} | {entry['scheduler']} | unfinished: {entry['delivered']:,} of {n:,}{waited} | – | – |"
            )
    lines += ["", "| schedules | publishing floor (msg/s) |", "|---:|---:|"]
    lines += [f"| {n:,} | {rate:,.0f} |" for n, rate in sorted(floor.items())]
    info = report["machine"]
    lines += [
        "",
        f"Machine: {info['platform']}, {info['cpus']} CPUs, Python {info['python']}.",
        "Versions: " + ", ".join(f"{name} {v}" for name, v in info["versions"].items()) + ".",
        "",
    ]
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({b["schedules"] for b in report["bursts"]})
    schedulers = list(dict.fromkeys(b["scheduler"] for b in report["bursts"]))
    figure, axes = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / (len(schedulers) + 1)
    for index, scheduler in enumerate(schedulers):
        rates = [
            next((b["rate"] or 0 for b in report["bursts"] if b["scheduler"] == scheduler and b["schedules"] == n), 0)
            for n in sizes
        ]
        axes.bar([i + index * width for i in range(len(sizes))], rates, width, label=scheduler)
    floors = [report["floor"][str(n)] if str(n) in report["floor"] else report["floor"][n] for n in sizes]
    axes.bar([i + len(schedulers) * width for i in range(len(sizes))], floors, width, label="publishing floor",
             color="lightgrey")  # fmt: skip
    axes.set_xticks([i + width * len(schedulers) / 2 for i in range(len(sizes))], [f"{n:,}" for n in sizes])
    axes.set_xlabel("schedules due at the same minute")
    axes.set_ylabel("messages per second (higher is better)")
    axes.set_title("Burst: rate from the boundary to the last message")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
