"""Steady and failover: N schedules every second, a real worker running them, and what
happened to each run (benchmarks/benchapp.py, ``BENCH_MODE=steady``: the task ``bench.stamp``
appends its schedule, nominal occurrence, publish time and start time to a Redis list).

- steady: *replicas* beat processes of one scheduler for a window of *seconds*: p50 and p99
  dispatch lag (published - nominal occurrence) and start lag (worker start - nominal
  occurrence), runs per expected occurrence, duplicates and losses.
- failover: 3 beat replicas; after *before* seconds the replica that is dispatching is killed
  with SIGKILL, then *after* more seconds: duplicates, losses, the longest gap between consecutive
  runs of one schedule across and after the kill, and runs per expected occurrence.

The measured window starts once every schedule has run at least once (start-up, schema
creation and the first sync are not measured) and ends *seconds* (steady) or *before* +
*after* (failover) later; beat and worker keep running a few seconds more so that the runs
nominally due before the end are recorded.

Nominal occurrence. leasebeat leases a named occurrence and sends it in a header, so its
runs are counted exactly: a run is in the window when its occurrence is; a duplicate is a
second run of one (schedule, occurrence); a loss is an occurrence of the schedule's
cadence (``first occurrence + k * interval``) in the window that has no run (leasebeat skips
occurrences it is more than one interval late for instead of firing them in a burst, so a
stall shows as losses, not as lag).

Celery's PersistentScheduler, django-celery-beat and RedBeat have no nominal occurrence for
an interval schedule: the next run is due one interval after the previous one ran. We use
that, their own notion: a run's nominal time is the publish time of the same schedule's
previous (counted) run plus the interval; the first run of each schedule has none and gives
no lag. A run is in the window when it was published in it. A run published less than half
an interval after the previous counted run of its schedule is a duplicate (it counts no
occurrence and is not the "previous run" of the next one: comparing with the previous run
of any kind would call almost every run a duplicate when uncoordinated replicas interleave
their runs a third of an interval apart). Losses are the expected count (schedules x window
/ interval) minus the counted runs, floored at 0. Celery's and django-celery-beat's
schedulers do not coordinate replicas: with 3 replicas each publishes every run, which these
numbers show as it is.

Which replica is killed: the one that published the latest run (the beat's pid travels in a
header, ``before_task_publish``). For RedBeat that is the lock holder, so the others wait for
the lock to expire (``redbeat_lock_timeout``, 5 x
``beat_max_loop_interval`` = 25 s here): *after* must exceed that to see RedBeat resume. The
leasebeat replicas are peers; any one is as good as another.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from .harness import (
    Settings,
    cleanup,
    declare,
    delete_queue,
    environment,
    prepare_django,
    start_beat,
    start_worker,
    stop,
)
from .harness import workdir as make_workdir

#: Every schedule runs every EVERY seconds.
EVERY = 1.0
#: Longest wait for every schedule's first run (process start, schema, first sync).
WARMUP_TIMEOUT = 120.0
#: How long beat and worker run after the window, so the runs due before its end are recorded.
DRAIN_SECONDS = 3.0
FAILOVER_REPLICAS = 3


@dataclass
class Steady:
    scheduler: str
    schedules: int
    replicas: int
    seconds: float  # the measured window
    every: float
    runs: int  # runs in the window
    expected: int  # occurrences in the window
    runs_per_occurrence: float
    duplicates: int
    losses: int
    dispatch_lag_p50: float | None  # seconds, published - nominal occurrence
    dispatch_lag_p99: float | None
    start_lag_p50: float | None  # seconds, worker start - nominal occurrence
    start_lag_p99: float | None
    nominal: str  # "occurrence" (leasebeat's header) or "previous publish + interval"


@dataclass
class Failover:
    scheduler: str
    schedules: int
    replicas: int
    before: float  # seconds measured before the kill
    after: float  # seconds measured after the kill
    every: float
    runs: int  # runs in the window
    expected: int  # occurrences in the window
    runs_per_occurrence: float
    duplicates: int
    losses: int
    runs_after_kill: int  # runs published after the kill, in the window
    longest_gap: float | None  # seconds between consecutive runs of one schedule, across or after the kill
    longest_gap_schedule: str | None
    nominal: str


@dataclass
class _Measure:
    runs: int = 0
    expected: int = 0
    duplicates: int = 0
    losses: int = 0
    dispatch_lags: list[float] = field(default_factory=list)
    start_lags: list[float] = field(default_factory=list)


def _exact(scheduler: str) -> bool:
    return scheduler == "leasebeat"


def _nominal(scheduler: str) -> str:
    return "occurrence" if _exact(scheduler) else "previous publish + interval"


# -- the processes ----------------------------------------------------------------------------


@dataclass
class _Cluster:
    scheduler: str
    schedules: int
    beats: list[subprocess.Popen[bytes]]
    worker: subprocess.Popen[bytes]
    folder: Path
    queue: str
    prefix: str  # leasebeat's tables, RedBeat's keys
    results: str  # the Redis list the worker appends to
    client: Any  # redis client


@contextmanager
def _cluster(settings: Settings, scheduler: str, schedules: int, replicas: int) -> Iterator[_Cluster]:
    """One worker and *replicas* beat processes in steady mode, with their own queue, table or
    key prefix and results list; everything stopped and removed on the way out, whatever
    failed. The work folder (the logs) is removed only after a clean run."""
    import redis

    run_id = uuid.uuid4().hex[:8]
    queue, prefix, results = f"steady-{run_id}", f"s{run_id}_", f"steady-results-{run_id}"
    env = environment(
        settings, scheduler, prefix, queue,
        BENCH_MODE="steady", BENCH_N=schedules, BENCH_EVERY=EVERY, BENCH_RESULTS=results, BENCH_TASK="bench.stamp",
    )  # fmt: skip
    folder = make_workdir(scheduler)
    client = redis.Redis.from_url(settings.redis)
    clean = False
    with ExitStack() as stack:  # callbacks run last-in first-out, each even if another raised
        stack.callback(lambda: clean and shutil.rmtree(folder, ignore_errors=True))  # after the processes stop
        stack.callback(client.close)
        stack.callback(client.delete, results, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        stack.callback(delete_queue, settings.redis, queue)
        stack.callback(cleanup, scheduler, settings, prefix)
        if scheduler == "django":
            prepare_django(env, schedules, every=EVERY)  # one database for every replica
        declare(settings.redis, queue)
        worker = start_worker(env, folder)
        stack.callback(stop, worker)
        beats: list[subprocess.Popen[bytes]] = []
        for index in range(replicas):
            beats.append(start_beat(env, scheduler, folder, f"beat{index}"))
            stack.callback(stop, beats[-1])
        yield _Cluster(scheduler, schedules, beats, worker, folder, queue, prefix, results, client)
        clean = True  # reached only without an exception: the logs of a failed run are kept


def _records(cluster: _Cluster) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in cluster.client.lrange(cluster.results, 0, -1)]


def _check_alive(cluster: _Cluster, expected_dead: int = 0) -> None:
    dead = [b for b in cluster.beats if b.poll() is not None]
    if len(dead) > expected_dead or cluster.worker.poll() is not None:
        raise RuntimeError(
            f"{cluster.scheduler}: a beat or the worker exited; logs in {cluster.folder}\n{_tails(cluster)}"
        )


def _tails(cluster: _Cluster) -> str:
    parts = []
    for log in sorted(cluster.folder.glob("*.log")):
        text = log.read_text(errors="replace")[-1500:]
        parts.append(f"--- {log.name}\n{text}")
    return "\n".join(parts)


def _warm_up(cluster: _Cluster) -> float:
    """Wait until every schedule has run once; return that moment (the window's start)."""
    deadline = time.time() + WARMUP_TIMEOUT
    while time.time() < deadline:
        _check_alive(cluster)
        seen = {record["schedule"] for record in _records(cluster)}
        if len(seen) >= cluster.schedules:
            return time.time()
        time.sleep(0.25)
    raise RuntimeError(
        f"{cluster.scheduler}: not every schedule ran within {WARMUP_TIMEOUT:.0f} s; logs in {cluster.folder}\n"
        + _tails(cluster)
    )


def _wait(cluster: _Cluster, until: float, expected_dead: int = 0) -> None:
    while (left := until - time.time()) > 0:
        _check_alive(cluster, expected_dead)
        time.sleep(min(left, 0.25))


# -- the scenarios ----------------------------------------------------------------------------


def steady(settings: Settings, scheduler: str, schedules: int = 10, seconds: float = 60.0, replicas: int = 1) -> Steady:
    """*schedules* schedules every second run by *replicas* beat processes of *scheduler* and
    one worker, measured over *seconds* once every schedule has run."""
    with _cluster(settings, scheduler, schedules, replicas) as cluster:
        start = _warm_up(cluster)
        end = start + seconds
        _wait(cluster, end + DRAIN_SECONDS)
        records = _records(cluster)
    measure = measure_runs(records, exact=_exact(scheduler), every=EVERY, start=start, end=end, schedules=schedules)
    return Steady(
        scheduler=scheduler,
        schedules=schedules,
        replicas=replicas,
        seconds=seconds,
        **_counts(measure),
        dispatch_lag_p50=percentile(measure.dispatch_lags, 50),
        dispatch_lag_p99=percentile(measure.dispatch_lags, 99),
        start_lag_p50=percentile(measure.start_lags, 50),
        start_lag_p99=percentile(measure.start_lags, 99),
        nominal=_nominal(scheduler),
    )


def _counts(measure: _Measure) -> dict[str, Any]:
    """The fields Steady and Failover share: what the window held against what was due."""
    return {
        "every": EVERY,
        "runs": measure.runs,
        "expected": measure.expected,
        "runs_per_occurrence": measure.runs / measure.expected if measure.expected else 0.0,
        "duplicates": measure.duplicates,
        "losses": measure.losses,
    }


def failover(
    settings: Settings, scheduler: str, schedules: int = 10, before: float = 20.0, after: float = 45.0
) -> Failover:
    """3 beat replicas of *scheduler* and one worker; *before* seconds into the window the
    replica that published last is killed (SIGKILL), and the window goes on *after* seconds."""
    with _cluster(settings, scheduler, schedules, FAILOVER_REPLICAS) as cluster:
        start = _warm_up(cluster)
        _wait(cluster, start + before)
        victim = _dispatching_replica(cluster)
        victim.send_signal(signal.SIGKILL)
        killed = time.time()
        victim.wait()
        end = killed + after
        _wait(cluster, end + DRAIN_SECONDS, expected_dead=1)
        records = _records(cluster)
    measure = measure_runs(records, exact=_exact(scheduler), every=EVERY, start=start, end=end, schedules=schedules)
    gap, gap_schedule = longest_gap(records, killed, end)
    return Failover(
        scheduler=scheduler,
        schedules=schedules,
        replicas=FAILOVER_REPLICAS,
        before=before,
        after=after,
        **_counts(measure),
        runs_after_kill=sum(1 for r in records if r.get("published") is not None and killed <= r["published"] < end),
        longest_gap=gap,
        longest_gap_schedule=gap_schedule,
        nominal=_nominal(scheduler),
    )


def _dispatching_replica(cluster: _Cluster) -> subprocess.Popen[bytes]:
    """The replica that published the latest run (its pid is in every record): RedBeat's
    lock holder, or any one of the leasebeat peers. The first started when none is known."""
    published = [r for r in _records(cluster) if r.get("publisher") and r.get("published")]
    if published:
        latest = max(published, key=lambda r: r["published"])["publisher"]
        for beat in cluster.beats:
            if beat.pid == latest:
                return beat
    return cluster.beats[0]


# -- the arithmetic ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The *q*-th percentile, linearly interpolated between the closest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _by_schedule(records: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get(key) is not None and record.get("published") is not None:
            groups[record["schedule"]].append(record)
    for runs in groups.values():
        runs.sort(key=lambda r: (r[key], r["published"]))
    return groups


def measure_runs(
    records: list[dict[str, Any]], *, exact: bool, every: float, start: float, end: float, schedules: int
) -> _Measure:
    """Runs, expected occurrences, duplicates, losses and lags in the window [start, end)
    (see the module docstring for the two ways of counting)."""
    measure = _Measure()
    if exact:
        groups = _by_schedule(records, "occurrence")
        for name in (f"bench-{i:06d}" for i in range(schedules)):
            runs = groups.get(name, [])
            if not runs:  # never ran: every occurrence of the window is lost
                missing = math.ceil((end - start) / every)
                measure.expected += missing
                measure.losses += missing
                continue
            anchor = runs[0]["occurrence"]  # the cadence: anchor + k * every
            first, last = math.ceil((start - anchor) / every - 1e-6), math.ceil((end - anchor) / every - 1e-6) - 1
            seen: set[int] = set()
            for run in runs:
                if not start <= run["occurrence"] < end:
                    continue
                measure.runs += 1
                index = round((run["occurrence"] - anchor) / every)
                if index in seen:
                    measure.duplicates += 1
                    continue
                seen.add(index)
                measure.dispatch_lags.append(run["published"] - run["occurrence"])
                measure.start_lags.append(run["started"] - run["occurrence"])
            measure.expected += max(0, last - first + 1)
            measure.losses += sum(1 for k in range(first, last + 1) if k not in seen)
        return measure
    groups = _by_schedule(records, "published")
    for runs in groups.values():
        previous: float | None = None  # the publish time of the previous counted run
        for run in runs:
            published = run["published"]
            duplicate = previous is not None and published - previous < every / 2
            if start <= published < end:
                measure.runs += 1
                if duplicate:
                    measure.duplicates += 1
                elif previous is not None:
                    nominal = previous + every
                    measure.dispatch_lags.append(published - nominal)
                    measure.start_lags.append(run["started"] - nominal)
            if not duplicate:
                previous = published
    measure.expected = round(schedules * (end - start) / every)
    measure.losses = max(0, measure.expected - (measure.runs - measure.duplicates))
    return measure


def longest_gap(records: list[dict[str, Any]], killed: float, end: float) -> tuple[float | None, str | None]:
    """The longest time between consecutive runs (publish times) of one schedule that ends
    after the kill, counting the run before the kill and, for a schedule that stopped, the
    time from its last run to the end of the window."""
    best: tuple[float | None, str | None] = (None, None)
    for name, runs in _by_schedule(records, "published").items():
        times = [r["published"] for r in runs if r["published"] < end]
        times.append(end)
        for earlier, later in zip(times, times[1:]):
            if later > killed and (best[0] is None or later - earlier > best[0]):
                best = (later - earlier, name)
    return best


# -- the report -------------------------------------------------------------------------------


def _entries(results: Any, key: str) -> list[dict[str, Any]]:
    """The entries under *key* of a results dict (or a list of entries), as dicts."""
    entries = results.get(key, []) if isinstance(results, dict) else results
    return [asdict(e) if is_dataclass(e) and not isinstance(e, type) else dict(e) for e in entries]


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f} ms"


def markdown_steady(results: Any) -> list[str]:
    """The steady table, from ``results["steady"]`` (entries of :class:`Steady` as dicts)."""
    entries = _entries(results, "steady")
    if not entries:
        return []
    lines = [
        "## Steady",
        "",
        f"Schedules every {entries[0]['every']:g} s, a worker running them, measured over a window that starts once",
        "every schedule has run. Dispatch lag: published minus the nominal occurrence; start lag: the task body",
        "starting in the worker minus the nominal occurrence (for leasebeat after the worker has marked the run",
        "started in the database). leasebeat's nominal occurrence is the one it leased (exact); the others have",
        "none for an interval schedule, so theirs is the previous run's publish time plus the interval (their",
        "own notion). Duplicates: for leasebeat a second run of one occurrence; for the others a run published",
        "within half an interval of the previous counted run. Losses: occurrences of the window without a run.",
        "",
        "| scheduler | replicas | schedules | window | dispatch lag p50 | p99 | start lag p50 | p99 "
        "| runs per occurrence | duplicates | losses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        lines.append(
            f"| {e['scheduler']} | {e['replicas']} | {e['schedules']:,} | {e['seconds']:g} s "
            f"| {_ms(e['dispatch_lag_p50'])} | {_ms(e['dispatch_lag_p99'])} "
            f"| {_ms(e['start_lag_p50'])} | {_ms(e['start_lag_p99'])} | {e['runs_per_occurrence']:.2f} "
            f"| {e['duplicates']:,} | {e['losses']:,} |"
        )
    return [*lines, ""]


def markdown_failover(results: Any) -> list[str]:
    """The failover table, from ``results["failover"]`` (entries of :class:`Failover` as dicts)."""
    entries = _entries(results, "failover")
    if not entries:
        return []
    lines = [
        "## Failover",
        "",
        f"{entries[0]['replicas']} beat replicas of one scheduler, schedules every {entries[0]['every']:g} s and a",
        "worker; some seconds into the window the replica that published the latest run (RedBeat's lock holder)",
        "is killed (SIGKILL) and the window goes on. Longest gap: the longest time between consecutive runs",
        "(publish times) of one schedule across or",
        "after the kill. Duplicates and losses as in the steady table (leasebeat exactly by occurrence; the",
        "others by the half-interval rule and expected minus counted runs). Celery's and django-celery-beat's",
        "schedulers do not coordinate replicas: each replica runs every schedule. RedBeat's survivors wait for",
        "its lock to expire (25 s here).",
        "",
        "| scheduler | schedules | before the kill | after | runs per occurrence | duplicates | losses "
        "| runs after the kill | longest gap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        gap = "–" if e["longest_gap"] is None else f"{e['longest_gap']:.1f} s"
        lines.append(
            f"| {e['scheduler']} | {e['schedules']:,} | {e['before']:g} s | {e['after']:g} s "
            f"| {e['runs_per_occurrence']:.2f} | {e['duplicates']:,} | {e['losses']:,} "
            f"| {e['runs_after_kill']:,} | {gap} |"
        )
    return [*lines, ""]


def steady_chart(results: Any, path: Path) -> None:
    """Bars of the p50 and p99 dispatch lag per scheduler (log scale), written to *path*
    (``steady.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = _entries(results, "steady")
    labels = [e["scheduler"] if e["replicas"] == 1 else f"{e['scheduler']} ×{e['replicas']}" for e in entries]
    floor_ms = 0.1  # a log axis: lags at or below zero are drawn at the floor

    def heights(key: str) -> list[float]:
        return [max((e[key] or 0.0) * 1000, floor_ms) for e in entries]

    figure, axes = plt.subplots(figsize=(8, 4.5))
    positions = range(len(entries))
    axes.bar([i - 0.2 for i in positions], heights("dispatch_lag_p50"), 0.4, label="p50")
    axes.bar([i + 0.2 for i in positions], heights("dispatch_lag_p99"), 0.4, label="p99")
    axes.set_yscale("log")
    axes.set_xticks(list(positions), labels)
    axes.set_ylabel("dispatch lag, ms (lower is better)")
    every = entries[0]["every"] if entries else EVERY
    axes.set_title(f"Steady: published minus nominal occurrence, schedules every {every:g} s")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
