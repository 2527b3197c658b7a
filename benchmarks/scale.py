"""Scale: one beat process with N schedules none of which is due for months (benchapp's idle
mode): how long it takes to start (process spawn until its first completed cycle), how much
memory it holds, and what one idle cycle costs: database statements (and commits/rollbacks,
pool pings, new connections) for leasebeat and django-celery-beat, Redis commands for
RedBeat, nothing but a shelve file for Celery's own scheduler; and the wall time of a cycle.

The counts come from inside the beat process (benchmarks/counting.py, written to a file).
RedBeat's commands are the INFO commandstats delta of the whole Redis server over the idle
window, so nothing else may talk to that Redis meanwhile: when ``redis-server`` is installed,
the RedBeat run gets a private one (its broker and its schedule store); otherwise the shared
Redis is used and whatever else runs against it is counted too (the result says which).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .harness import ROOT, Settings, cleanup, environment, start_beat, stop, workdir

UTC = timezone.utc
#: django-celery-beat (2.8+) loads a crontab row only when its numeric hour is within two
#: hours of now (or is 4, Celery's cleanup hour): the idle rows take the current hour.
DJANGO_HOUR_WINDOW = 2


@dataclass
class Scale:
    scheduler: str
    schedules: int
    restart: bool = False  # measured on a second start against the rows the first one wrote
    complete: bool = False  # measured to the end (a failed cycle in the window still sets error)
    startup_seconds: float | None = None  # process spawn -> first completed tick
    startup_statements: int | None = None  # database statements until then (leasebeat, django)
    rss_bytes: int | None = None  # VmRSS after the idle window
    peak_rss_bytes: int | None = None  # VmHWM: the most it ever held (start-up included)
    app_rss_bytes: int | None = None  # VmRSS of a process that only imports the same app
    window_seconds: float | None = None  # the idle window the per-cycle figures cover
    cycles: int | None = None  # completed idle ticks in the window
    failed_cycles: int | None = None  # ticks in the window that raised or logged an error
    statements_per_cycle: float | None = None  # SQL statements (leasebeat, django)
    transactions_ends_per_cycle: float | None = None  # COMMIT/ROLLBACK round trips
    pings_per_cycle: float | None = None  # SQLAlchemy pool pre-ping round trips
    connects_per_cycle: float | None = None  # new database connections
    redis_commands_per_cycle: float | None = None  # RedBeat: commandstats delta of its Redis
    per_cycle: str = ""  # what an idle cycle costs, in words
    tick_ms: float | None = None  # mean wall time inside one idle tick
    longest_tick_ms: float | None = None  # the longest tick after the first (the idle window's)
    interval_seconds: float | None = None  # mean time from one idle tick to the next
    error: str | None = None
    note: str = ""


def _read_counts(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _fresh_counts(path: Path, after: float, beat: subprocess.Popen[bytes], timeout: float = 10.0) -> dict[str, Any]:
    """The first counts written after *after* (epoch seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = _read_counts(path)
        if counts is not None and counts["time"] > after:
            return counts
        if beat.poll() is not None:
            raise RuntimeError(f"beat exited with {beat.returncode}")
        time.sleep(0.1)
    raise RuntimeError(f"no counts written to {path} for {timeout:.0f} s")


#: Failed ticks (raised, or logged an error) before any completed one that end the wait.
MAX_FAILED_STARTS = 2


def _wait_first_cycle(path: Path, beat: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """The counts once beat completed a cycle; an error when it keeps failing instead."""
    began = time.monotonic()
    counts = None
    while time.monotonic() < began + timeout:
        counts = _read_counts(path)
        if counts is not None and counts["first_cycle_done_at"] is not None:
            return counts
        if counts is not None and counts["failed_cycles"] >= MAX_FAILED_STARTS:
            raise RuntimeError(
                f"{counts['failed_cycles']} failed cycles and none completed in {time.monotonic() - began:.0f} s; "
                f"last error: {counts['last_error']}"
            )
        if beat.poll() is not None:
            raise RuntimeError(f"beat exited with {beat.returncode} before its first cycle")
        time.sleep(0.1)
    error = f"; last error: {counts['last_error']}" if counts and counts.get("last_error") else ""
    raise RuntimeError(f"no completed cycle within {timeout:.0f} s{error}")


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process *pid*, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def app_footprint(env: Mapping[str, str]) -> int:
    """VmRSS of a Python process that imports benchapp with *env* and does nothing else: the
    share of beat's memory that is the app's own (its ``beat_schedule``, Celery, the drivers)."""
    script = "import os, benchmarks.benchapp; from benchmarks.scale import memory; print(memory(os.getpid())[0])"
    done = subprocess.run([sys.executable, "-c", script], env=dict(env), cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"importing the app failed: {done.stderr.strip()[-500:]}")
    return int(done.stdout.split()[-1])


def redis_commands(url: str) -> int:
    """Commands the Redis server has run so far, leaving out INFO (this measurement's own)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(value["calls"]) for name, value in stats.items() if name != "cmdstat_info")


class PrivateRedis:
    """A throwaway ``redis-server`` on a free loopback port, without persistence."""

    def __init__(self, folder: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", str(folder)],
            stdout=open(folder / "redis.log", "wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.05)
            finally:
                client.close()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def idle_month() -> int:
    """The month benchapp's idle crontab fires in: half a year away."""
    return (datetime.now(UTC).month + 5) % 12 + 1


def prepare_idle_django(env: dict[str, str], count: int) -> None:
    """Create django-celery-beat's database (BENCH_DJANGO_DATABASE), migrate, and write
    *count* periodic tasks on the crontab benchapp's idle mode uses (00:00 on the 1st of a
    month half a year away), all sharing one CrontabSchedule row."""
    script = f"""
import django, os
from sqlalchemy import create_engine
url = os.environ["BENCH_DJANGO_DATABASE"]
name = url.rsplit("/", 1)[1]
admin = create_engine(url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + "/postgres",
                      isolation_level="AUTOCOMMIT")
with admin.connect() as c:
    c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{{name}}" WITH (FORCE)')
    c.exec_driver_sql(f'CREATE DATABASE "{{name}}"')
admin.dispose()
os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.djsettings"
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django_celery_beat.models import CrontabSchedule, PeriodicTask, PeriodicTasks
schedule = CrontabSchedule.objects.create(minute="0", hour="{idle_hour()}", day_of_month="1",
                                          month_of_year="{idle_month()}",
                                          day_of_week="*", timezone="UTC")
PeriodicTask.objects.bulk_create(
    [PeriodicTask(name=f"bench-{{i:06d}}", task="bench.noop", crontab=schedule, args=f'["bench-{{i:06d}}"]',
                  queue=os.environ["BENCH_QUEUE"]) for i in range({count})],
    batch_size=5000,
)
PeriodicTasks.update_changed()
"""
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=ROOT)


def drop_django_database(env: dict[str, str]) -> None:
    from sqlalchemy import create_engine

    url = env["BENCH_DJANGO_DATABASE"]
    server, name = url.rsplit("/", 1)
    admin = create_engine(server.replace("postgresql://", "postgresql+psycopg://") + "/postgres",
                          isolation_level="AUTOCOMMIT")  # fmt: skip
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def idle_hour() -> int:
    """The idle rows' hour: this one, so that django-celery-beat (which loads a crontab row
    only when its hour is within DJANGO_HOUR_WINDOW of now) holds all of them in memory."""
    return datetime.now(UTC).hour


def django_note() -> str:
    return (
        "django-celery-beat loads crontab rows only within ±2 h of their hour: these rows are at the "
        "current hour (months away), so all were loaded"
    )


def scale(
    settings: Settings,
    scheduler: str,
    schedules: int = 100_000,
    idle_seconds: float = 30.0,
    restart: bool = False,
    startup_timeout: float | None = None,
    private_redis: bool | None = None,
    polling_seconds: float = 5.0,
) -> Scale:
    """Start one beat of *scheduler* with *schedules* schedules none of which is due, and
    measure its start-up, memory and idle cycles over *idle_seconds*. With *restart*
    (leasebeat), a first beat writes the rows and stops, and the second start is measured.
    *private_redis* (RedBeat; by default when ``redis-server`` is installed) runs that beat
    against a Redis of its own, so the command count is that beat's alone. *polling_seconds*
    is every scheduler's longest sleep (``beat_max_loop_interval``, leasebeat's polling
    interval): the length of an idle cycle."""
    if private_redis is None:
        private_redis = shutil.which("redis-server") is not None
    private_redis = private_redis and scheduler == "redbeat"
    run_id = uuid.uuid4().hex[:8]
    queue, prefix = f"scale-{run_id}", f"s{run_id}_"
    extra: dict[str, Any] = {"BENCH_MODE": "idle", "BENCH_N": schedules, "BENCH_MAX_LOOP": polling_seconds}
    if scheduler == "django":  # a database of its own, dropped afterwards
        extra["BENCH_DJANGO_DATABASE"] = settings.django_postgres.rsplit("/", 1)[0] + f"/lbscale_{run_id}"
    folder = workdir(scheduler)
    note = django_note() if scheduler == "django" else ""
    if private_redis:
        note = "a private Redis (broker and schedules): the commands are this beat's alone"
    elif scheduler == "redbeat":
        note = "the shared Redis: its commands per cycle include whatever else ran against it"
    timeout = startup_timeout if startup_timeout is not None else 120 + schedules * 0.004
    result = Scale(scheduler=scheduler, schedules=schedules, restart=restart, note=note)
    redis_server: PrivateRedis | None = None
    beat: subprocess.Popen[bytes] | None = None
    env = environment(settings, scheduler, prefix, queue, **extra)
    try:
        if private_redis:
            redis_server = PrivateRedis(folder)
            settings = Settings(redis=redis_server.url, postgres=settings.postgres)
            env = environment(settings, scheduler, prefix, queue, **extra)
        if scheduler == "django":
            prepare_idle_django(env, schedules)
        if restart:
            first_file = folder / "counts-first.json"
            first = start_beat({**env, "BENCH_COUNT_FILE": str(first_file)}, scheduler, folder, "first")
            try:
                _wait_first_cycle(first_file, first, timeout)
            finally:
                stop(first)
        count_file = folder / "counts.json"
        spawned = time.time()
        beat = start_beat({**env, "BENCH_COUNT_FILE": str(count_file)}, scheduler, folder)
        started = _wait_first_cycle(count_file, beat, timeout)
        result.startup_seconds = started["first_cycle_done_at"] - spawned
        if scheduler in ("leasebeat", "django"):
            result.startup_statements = started["statements"]
        before = _fresh_counts(count_file, started["time"], beat)
        redis_before = redis_commands(settings.redis) if scheduler == "redbeat" else 0
        window_end = time.monotonic() + idle_seconds
        while time.monotonic() < window_end:
            if beat.poll() is not None:
                raise RuntimeError(f"beat exited with {beat.returncode} during the idle window")
            time.sleep(min(0.2, max(0.0, window_end - time.monotonic())))
        redis_after = redis_commands(settings.redis) if scheduler == "redbeat" else 0
        after = _fresh_counts(count_file, time.time(), beat)
        result.rss_bytes, result.peak_rss_bytes = memory(beat.pid)
        _per_cycle(result, before, after, redis_after - redis_before)
        result.app_rss_bytes = app_footprint(env)
        result.complete = True
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        result.error = f"{exc} (logs in {folder})"
        if beat is not None and beat.poll() is None:
            result.rss_bytes, result.peak_rss_bytes = memory(beat.pid)  # what it held meanwhile
    finally:
        if beat is not None:
            stop(beat)
        if redis_server is not None:
            redis_server.close()
        else:
            cleanup(scheduler, settings, prefix)
        if scheduler == "django":
            drop_django_database(env)
    if result.complete and result.error is None:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def _per_cycle(result: Scale, before: dict[str, Any], after: dict[str, Any], redis_delta: int) -> None:
    cycles = after["cycles"] - before["cycles"]
    result.window_seconds = after["time"] - before["time"]
    result.cycles = cycles
    result.failed_cycles = after["failed_cycles"] - before["failed_cycles"]
    if result.failed_cycles:
        result.error = f"{result.failed_cycles} failed cycles in the idle window; last error: {after['last_error']}"
    if cycles <= 0:
        result.per_cycle = "no cycle completed in the window"
        return

    def rate(name: str) -> float:
        return (after[name] - before[name]) / cycles

    result.tick_ms = (after["tick_seconds"] - before["tick_seconds"]) / cycles * 1000
    result.longest_tick_ms = after["longest_later_tick"] * 1000
    result.interval_seconds = (after["last_cycle_done_at"] - before["last_cycle_done_at"]) / cycles
    if result.scheduler in ("leasebeat", "django"):
        result.statements_per_cycle = rate("statements")
        result.transactions_ends_per_cycle = rate("transactions_ends")
        result.pings_per_cycle = rate("pings")
        result.connects_per_cycle = rate("connects")
        result.per_cycle = (
            f"{result.statements_per_cycle:.2f} statements, {result.transactions_ends_per_cycle:.2f} commits/rollbacks"
        )
        if result.pings_per_cycle:
            result.per_cycle += f", {result.pings_per_cycle:.2f} pre-pings"
        if result.connects_per_cycle:
            result.per_cycle += f", {result.connects_per_cycle:.2f} new connections"
    elif result.scheduler == "redbeat":
        result.redis_commands_per_cycle = redis_delta / cycles
        result.per_cycle = f"{result.redis_commands_per_cycle:.1f} Redis commands"
    else:
        result.per_cycle = "none (shelve file)"


# -- report -----------------------------------------------------------------------------------


def _entries(results: Sequence[Scale | Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [asdict(entry) if isinstance(entry, Scale) else dict(entry) for entry in results]


def _label(entry: Mapping[str, Any]) -> str:
    return f"{entry['scheduler']} (restart)" if entry.get("restart") else entry["scheduler"]


def markdown_scale(results: Sequence[Scale | Mapping[str, Any]]) -> list[str]:
    """The scale section of results.md: a short explanation and one row per run."""
    lines = [
        "## Scale",
        "",
        "One beat process with N crontab schedules none of which is due for months. Start-up: from",
        "spawning the process until its first completed cycle, one that neither raised nor logged an",
        "error (leasebeat's first cycle writes the rows; *restart* is a second start against rows",
        "already there, the common case). Memory: resident set after the idle window (peak in",
        "brackets), and that of a process that only imports the same app (its `beat_schedule`, Celery,",
        "the drivers), the part no scheduler can shed. Per idle cycle, over the window: what the",
        "scheduler asks of its store (SQL statements, counted inside beat; commits and rollbacks, pool",
        "pre-pings and new connections are round trips too; RedBeat: the command count of its Redis, a",
        "private one when",
        "`redis-server` is installed), the mean wall time inside one cycle (the longest in brackets),",
        "and the time between cycles.",
        "",
        "| schedules | scheduler | start-up | RSS (peak) | the app alone | per idle cycle | wall per cycle "
        "| between cycles |",
        "|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    notes = []
    for entry in _entries(results):
        rss = "–"
        if entry["rss_bytes"] is not None:
            rss = f"{entry['rss_bytes'] / 2**20:,.0f} MiB ({entry['peak_rss_bytes'] / 2**20:,.0f})"
        if entry.get("note"):
            notes.append(f"{_label(entry)} at {entry['schedules']:,}: {entry['note']}.")
        if entry["error"]:
            notes.append(f"{_label(entry)} at {entry['schedules']:,}: {entry['error']}.".replace("|", "/"))
        if not entry["complete"]:
            lines.append(f"| {entry['schedules']:,} | {_label(entry)} | failed (below) | {rss} | – | – | – | – |")
            continue
        wall = "–"
        if entry["tick_ms"] is not None:
            wall = f"{entry['tick_ms']:,.1f} ms"
            if entry.get("longest_tick_ms") is not None:
                wall += f" ({entry['longest_tick_ms']:,.0f})"
        between = "–" if entry["interval_seconds"] is None else f"{entry['interval_seconds']:.1f} s"
        app = "–" if entry.get("app_rss_bytes") is None else f"{entry['app_rss_bytes'] / 2**20:,.0f} MiB"
        lines.append(
            f"| {entry['schedules']:,} | {_label(entry)} | {entry['startup_seconds']:,.1f} s | {rss} | {app} "
            f"| {entry['per_cycle']} | {wall} | {between} |"
        )
    if notes:
        lines += ["", *notes]
    return [*lines, ""]


def scale_chart(results: Sequence[Scale | Mapping[str, Any]], path: Path) -> None:
    """Start-up time and resident memory per scheduler (one bar group per size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [entry for entry in _entries(results) if entry["complete"]]
    sizes = sorted({entry["schedules"] for entry in entries})
    labels = list(dict.fromkeys(_label(entry) for entry in entries))
    figure, (startup_axes, memory_axes) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(len(labels), 1)
    for index, label in enumerate(labels):
        found = {entry["schedules"]: entry for entry in entries if _label(entry) == label}
        positions = [i + index * width for i in range(len(sizes))]
        startup_axes.bar(positions, [found[n]["startup_seconds"] if n in found else 0 for n in sizes], width,
                         label=label)  # fmt: skip
        memory_axes.bar(positions, [found[n]["rss_bytes"] / 2**20 if n in found else 0 for n in sizes], width,
                        label=label)  # fmt: skip
    for axes, ylabel, title in (
        (startup_axes, "seconds to the first cycle (lower is better)", "Start-up"),
        (memory_axes, "resident memory, MiB (lower is better)", "Memory after the idle window"),
    ):
        axes.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(sizes))], [f"{n:,}" for n in sizes])
        axes.set_xlabel("schedules, none due")
        axes.set_ylabel(ylabel)
        axes.set_title(title)
    memory_axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":  # python -m benchmarks.scale SCHEDULER [N] [IDLE] [restart]
    arguments = sys.argv[1:]
    outcome = scale(
        Settings(
            redis=os.environ.get("LEASEBEAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
            postgres=os.environ.get("LEASEBEAT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1/test"),
        ),
        arguments[0],
        int(arguments[1]) if len(arguments) > 1 else 100_000,
        float(arguments[2]) if len(arguments) > 2 else 30.0,
        restart=len(arguments) > 3 and arguments[3] == "restart",
    )
    print(json.dumps(asdict(outcome)), flush=True)
