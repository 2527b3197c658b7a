"""The smoke form of the steady and failover benchmarks (benchmarks/steady.py): a few seconds
of every-second schedules per scheduler, a short leasebeat failover, cleanup after a failure,
and the counting rules on made-up records."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, inspect

from benchmarks import steady
from benchmarks.harness import SCHEDULER_CLASSES, Settings

from .conftest import POSTGRES_URL, REDIS_URL, require_server

pytestmark = pytest.mark.e2e


@pytest.fixture
def settings() -> Settings:
    require_server(REDIS_URL, "Redis")
    require_server(POSTGRES_URL, "PostgreSQL")
    return Settings(redis=REDIS_URL, postgres=POSTGRES_URL)


def leftover_keys() -> list[bytes]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return list(client.scan_iter("steady-*")) + list(client.scan_iter("_kombu.binding*.steady-*"))
    finally:
        client.close()


def test_steady_smoke_for_every_scheduler(settings: Settings, tmp_path: Path) -> None:
    before = set(leftover_keys())
    results = {"steady": []}
    for scheduler in SCHEDULER_CLASSES:
        outcome = steady.steady(settings, scheduler, schedules=3, seconds=4.0)
        results["steady"].append(outcome)
        assert outcome.expected == 12, outcome
        assert outcome.runs_per_occurrence > 0.5, outcome
        assert outcome.dispatch_lag_p50 is not None and outcome.start_lag_p99 is not None, outcome
        assert outcome.start_lag_p50 >= outcome.dispatch_lag_p50 - 0.05, outcome  # a run starts after its publish
        if scheduler == "leasebeat":
            assert outcome.nominal == "occurrence" and outcome.duplicates == 0, outcome
    assert set(leftover_keys()) <= before  # results lists, queues and bindings removed
    lines = "\n".join(steady.markdown_steady(results))
    for scheduler in SCHEDULER_CLASSES:
        assert f"| {scheduler} | 1 | 3 | 4 s |" in lines
    steady.steady_chart(results, tmp_path / "steady.png")
    assert (tmp_path / "steady.png").stat().st_size > 1000


def test_leasebeat_failover_smoke(settings: Settings) -> None:
    outcome = steady.failover(settings, "leasebeat", schedules=3, before=4.0, after=6.0)
    assert outcome.replicas == 3
    assert outcome.duplicates == 0, outcome
    assert outcome.runs_after_kill >= 3 * 6 * 0.5, outcome  # the two survivors carry on
    assert outcome.runs_per_occurrence > 0.8, outcome
    assert outcome.longest_gap is not None and outcome.longest_gap < 6.0, outcome
    lines = "\n".join(steady.markdown_failover({"failover": [outcome]}))
    assert "| leasebeat |" in lines


def test_cleanup_after_a_failure(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[steady._Cluster] = []
    real_warm_up = steady._warm_up

    def warm_up_then_fail(cluster: steady._Cluster) -> float:
        seen.append(cluster)
        real_warm_up(cluster)  # the tables exist and results are recorded by now
        raise RuntimeError("boom")

    monkeypatch.setattr(steady, "_warm_up", warm_up_then_fail)
    with pytest.raises(RuntimeError, match="boom"):
        steady.steady(settings, "leasebeat", schedules=2, seconds=1.0)
    (cluster,) = seen
    assert all(process.poll() is not None for process in [*cluster.beats, cluster.worker])
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert not client.exists(cluster.results, cluster.queue)
    finally:
        client.close()
    engine = create_engine(POSTGRES_URL)
    try:
        assert not [t for t in inspect(engine).get_table_names() if t.startswith(cluster.prefix)]
    finally:
        engine.dispose()
    assert (cluster.folder / "beat0.log").exists()  # the logs of a failed run are kept
    for log in cluster.folder.iterdir():
        log.unlink()
    cluster.folder.rmdir()


def test_counting_rules_on_made_up_records() -> None:
    def record(schedule: str, published: float, occurrence: float | None = None) -> dict[str, object]:
        return {"schedule": schedule, "occurrence": occurrence, "published": published, "started": published + 0.01}

    # leasebeat: exact by occurrence. bench-000000 runs 100..109 with 103 twice and 105 missing.
    exact = [record("bench-000000", t + 0.02, t) for t in range(100, 110) if t != 105]
    exact.append(record("bench-000000", 103.5, 103))
    measure = steady.measure_runs(exact, exact=True, every=1.0, start=100, end=110, schedules=1)
    assert (measure.runs, measure.expected, measure.duplicates, measure.losses) == (10, 10, 1, 1)
    assert steady.percentile(measure.dispatch_lags, 50) == pytest.approx(0.02)

    # The others: three uncoordinated replicas a third of an interval apart publish every
    # occurrence three times (20 extra runs). The half-interval rule, against the previous
    # counted run, counts at least 15 of them and never reports a loss.
    interleaved = [record("bench-000000", 100 + k + offset) for k in range(10) for offset in (0.0, 0.33, 0.66)]
    measure = steady.measure_runs(interleaved, exact=False, every=1.0, start=100, end=110, schedules=1)
    assert (measure.runs, measure.expected, measure.losses) == (30, 10, 0)
    assert 15 <= measure.duplicates <= 20
    # One replica stalled for 3 s: nothing counted twice, 3 occurrences lost, and the gap shows.
    stalled = [record("bench-000000", 100 + k * 1.0) for k in range(10) if k not in (4, 5, 6)]
    measure = steady.measure_runs(stalled, exact=False, every=1.0, start=100, end=110, schedules=1)
    assert (measure.runs, measure.duplicates, measure.losses) == (7, 0, 3)
    assert steady.longest_gap(stalled, killed=104.5, end=110) == (pytest.approx(4.0), "bench-000000")
