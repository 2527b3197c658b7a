"""The smoke form of the scale benchmark: each scheduler's beat with a few hundred schedules
none of which is due, a short idle window with one-second cycles, and the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import SCHEDULER_CLASSES, Settings
from benchmarks.scale import markdown_scale, scale, scale_chart

from .conftest import POSTGRES_URL, REDIS_URL, require_server

pytestmark = pytest.mark.e2e
SCHEDULES = 200
IDLE_SECONDS = 6.0


def test_scale_smoke_for_every_scheduler(tmp_path: Path) -> None:
    require_server(REDIS_URL, "Redis")
    require_server(POSTGRES_URL, "PostgreSQL")
    settings = Settings(redis=REDIS_URL, postgres=POSTGRES_URL)
    runs = [(name, False) for name in SCHEDULER_CLASSES] + [("leasebeat", True)]
    results = [
        scale(settings, name, SCHEDULES, IDLE_SECONDS, restart=restart, startup_timeout=60, polling_seconds=1.0)
        for name, restart in runs
    ]
    for result in results:
        assert result.complete, result
        assert result.schedules == SCHEDULES and result.error is None, result
        assert result.failed_cycles == 0, result
        assert result.startup_seconds is not None and 0 < result.startup_seconds < 60, result
        assert result.rss_bytes is not None and result.rss_bytes > 10 * 2**20, result
        assert result.peak_rss_bytes is not None and result.peak_rss_bytes >= result.rss_bytes, result
        assert result.app_rss_bytes is not None and 10 * 2**20 < result.app_rss_bytes < result.peak_rss_bytes, result
        # One-second cycles over six seconds: each beat ticked about six times.
        assert result.cycles is not None and 3 <= result.cycles <= 10, result
        assert result.interval_seconds is not None and 0.5 < result.interval_seconds < 2, result
        assert result.tick_ms is not None and 0 < result.tick_ms < 1000, result
        assert result.longest_tick_ms is not None and result.longest_tick_ms >= result.tick_ms, result
    by_name = {(r.scheduler, r.restart): r for r in results}
    for restart in (False, True):
        lease = by_name["leasebeat", restart]
        # An idle cycle is the probe alone, on an autocommit connection without a pre-ping
        # (the replica heartbeat, one more statement, comes once a minute: not in this
        # window). A snapshot taken between a cycle's statement and its end shifts one
        # statement across the window's edge: hence 0.8 to 1.2, not exactly 1.
        assert lease.statements_per_cycle is not None and 0.8 <= lease.statements_per_cycle <= 1.2, lease
        assert lease.transactions_ends_per_cycle is not None and lease.transactions_ends_per_cycle <= 0.2, lease
        assert lease.pings_per_cycle is not None and lease.pings_per_cycle <= 0.2, lease
        assert lease.connects_per_cycle == 0, lease  # the pooled connection is reused
        # The start-up wrote (or, on restart, compared) the rows: a handful of statements,
        # not one per schedule.
        assert lease.startup_statements is not None and 1 <= lease.startup_statements < 60, lease
    django = by_name["django", False]
    assert django.statements_per_cycle is not None and 1 <= django.statements_per_cycle <= 5, django
    assert django.startup_statements is not None and django.startup_statements >= 1, django
    redbeat = by_name["redbeat", False]
    assert redbeat.redis_commands_per_cycle is not None and redbeat.redis_commands_per_cycle > 0, redbeat
    assert redbeat.statements_per_cycle is None
    celery = by_name["celery", False]
    assert celery.per_cycle == "none (shelve file)" and celery.statements_per_cycle is None, celery

    text = "\n".join(markdown_scale(results))
    for name in SCHEDULER_CLASSES:
        assert f"| {SCHEDULES} | {name} |" in text, text
    assert f"| {SCHEDULES} | leasebeat (restart) |" in text, text
    scale_chart(results, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 1000
