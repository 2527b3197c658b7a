"""Cron, zones and the DST rules of DESIGN.md (Cronos's rules)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from celery_leasebeat.errors import InvalidCron, UnknownTimezone
from celery_leasebeat.timing import CronSpec, IntervalSpec, occurrences_between, preview

UTC = timezone.utc


def local_times(expression: str, zone: str, start: str, count: int) -> list[str]:
    tz = ZoneInfo(zone)
    begin = datetime.fromisoformat(start).replace(tzinfo=tz)
    return [t.astimezone(tz).isoformat() for t in preview(CronSpec(expression, zone), begin, count)]


# -- spring forward: a wall time that does not exist runs once, at the first instant after the gap


@pytest.mark.parametrize(
    ("zone", "day", "expected"),
    [
        ("Europe/Berlin", "2026-03-29", "2026-03-29T03:00:00+02:00"),
        ("America/New_York", "2026-03-08", "2026-03-08T03:00:00-04:00"),
    ],
)
def test_nonexistent_wall_time_runs_at_the_first_instant_after_the_gap(zone: str, day: str, expected: str) -> None:
    times = local_times("30 2 * * *", zone, f"{day}T00:00", 2)
    assert times[0] == expected
    assert times[1].startswith((datetime.fromisoformat(day) + timedelta(days=1)).date().isoformat() + "T02:30")


def test_several_occurrences_inside_one_gap_collapse_into_one_run() -> None:
    times = local_times("*/20 2 * * *", "Europe/Berlin", "2026-03-29T00:00", 2)
    assert times == ["2026-03-29T03:00:00+02:00", "2026-03-30T02:00:00+02:00"]


def test_lord_howe_half_hour_gap() -> None:
    # 02:00 -> 02:30 on 2026-10-04: 02:00 and 02:15 do not exist.
    times = local_times("*/15 * * * *", "Australia/Lord_Howe", "2026-10-04T01:40", 4)
    assert times == [
        "2026-10-04T01:45:00+10:30",
        "2026-10-04T02:30:00+11:00",
        "2026-10-04T02:45:00+11:00",
        "2026-10-04T03:00:00+11:00",
    ]


# -- fall back: a repeated wall time runs once for a fixed hour, twice for * or */n


@pytest.mark.parametrize(
    ("zone", "day", "first"),
    [
        ("Europe/Berlin", "2026-10-25", "2026-10-25T02:30:00+02:00"),
        ("America/New_York", "2026-11-01", "2026-11-01T01:30:00-04:00"),
    ],
)
def test_repeated_wall_time_with_a_fixed_hour_runs_once_at_its_first_instant(zone: str, day: str, first: str) -> None:
    hour = first[11:13]
    times = local_times(f"30 {hour} * * *", zone, f"{day}T00:00", 2)
    assert times[0] == first
    assert times[1].startswith((datetime.fromisoformat(day) + timedelta(days=1)).date().isoformat())


def test_fixed_hour_with_minute_steps_runs_only_the_first_pass() -> None:
    times = local_times("*/30 2 * * *", "Europe/Berlin", "2026-10-25T00:00", 3)
    assert times == [
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T02:00:00+01:00",
    ]


@pytest.mark.parametrize("expression", ["0 * * * *", "0 */1 * * *"])
def test_every_hour_stays_hourly_in_real_time_across_fall_back(expression: str) -> None:
    tz = ZoneInfo("Europe/Berlin")
    start = datetime(2026, 10, 25, 0, 30, tzinfo=tz)
    times = preview(CronSpec(expression, "Europe/Berlin"), start, 5)
    gaps = {b - a for a, b in zip(times, times[1:])}
    assert gaps == {timedelta(hours=1)}
    assert [t.astimezone(tz).isoformat() for t in times[1:3]] == [
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:00:00+01:00",
    ]


def test_lord_howe_half_hour_fold_runs_both_passes_for_star_hour() -> None:
    # 02:00 (+11) -> 01:30 (+10:30) on 2026-04-05: 01:30-02:00 happens twice.
    times = local_times("*/15 * * * *", "Australia/Lord_Howe", "2026-04-05T01:20", 5)
    assert times == [
        "2026-04-05T01:30:00+11:00",
        "2026-04-05T01:45:00+11:00",
        "2026-04-05T01:30:00+10:30",
        "2026-04-05T01:45:00+10:30",
        "2026-04-05T02:00:00+10:30",
    ]


def test_lord_howe_fixed_hour_in_the_fold_runs_once() -> None:
    times = local_times("45 1 * * *", "Australia/Lord_Howe", "2026-04-05T00:00", 2)
    assert times == ["2026-04-05T01:45:00+11:00", "2026-04-06T01:45:00+10:30"]


def test_search_from_inside_the_fold_finds_the_second_pass() -> None:
    spec = CronSpec("*/30 * * * *", "Europe/Berlin")
    tz = ZoneInfo("Europe/Berlin")
    # 02:45 CEST, first pass: next is 02:00 CET (second pass), not 03:00.
    after = datetime(2026, 10, 25, 2, 45, tzinfo=tz, fold=0)
    assert spec.next_after(after).astimezone(tz).isoformat() == "2026-10-25T02:00:00+01:00"


# -- calendars and fields


def test_leap_day() -> None:
    assert local_times("0 12 29 2 *", "UTC", "2026-01-01T00:00", 2) == [
        "2028-02-29T12:00:00+00:00",
        "2032-02-29T12:00:00+00:00",
    ]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("0 0 L * *", "2026-02-28T00:00:00+00:00"),  # last day of the month
        ("0 0 15W * *", "2026-02-16T00:00:00+00:00"),  # weekday nearest the 15th (a Sunday)
        ("0 0 * * 5#3", "2026-02-20T00:00:00+00:00"),  # third Friday
        ("0 0 * * L1", "2026-02-23T00:00:00+00:00"),  # last Monday (croniter spells it L1)
    ],
)
def test_special_characters(expression: str, expected: str) -> None:
    assert local_times(expression, "UTC", "2026-02-01T00:00", 1) == [expected]


def test_six_fields_put_seconds_first() -> None:
    assert local_times("*/5 * * * * *", "UTC", "2026-01-01T00:00:00", 3) == [
        "2026-01-01T00:00:05+00:00",
        "2026-01-01T00:00:10+00:00",
        "2026-01-01T00:00:15+00:00",
    ]
    assert local_times("30 0 12 * * *", "UTC", "2026-01-01T00:00:00", 1) == ["2026-01-01T12:00:30+00:00"]


def test_crontab_semantics_require_both_day_fields() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    cron = CronSpec("0 0 13 * 5", "UTC")  # standard cron: the 13th OR any Friday
    crontab = CronSpec("0 0 13 * 5", "UTC", day_or=False)  # Celery's crontab: Friday the 13th
    assert cron.next_after(start) == datetime(2026, 1, 2, tzinfo=UTC)
    assert crontab.next_after(start) == datetime(2026, 2, 13, tzinfo=UTC)


def test_next_after_is_strict() -> None:
    spec = CronSpec("0 * * * *", "UTC")
    at = datetime(2026, 1, 1, 5, tzinfo=UTC)
    assert spec.next_after(at) == at + timedelta(hours=1)


# -- intervals keep their nominal cadence


def test_interval_keeps_its_cadence_from_the_previous_occurrence() -> None:
    spec = IntervalSpec(10)
    previous = datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC)
    # Dispatched late (at +3.7 s) and finished at +4 s: the next is still +10 s, no drift.
    assert spec.next_after(previous + timedelta(seconds=4), previous=previous) == previous + timedelta(seconds=10)
    # After an outage the next is the first one on the cadence after now.
    assert spec.next_after(previous + timedelta(seconds=95), previous=previous) == previous + timedelta(seconds=100)
    assert occurrences_between(spec, previous, previous + timedelta(seconds=95), 1000) == 9


# -- bad input


@pytest.mark.parametrize("expression", ["61 * * * *", "* * * *", "0 0 30 2 * 1 1", "not a cron", "* * * * * * *"])
def test_invalid_expressions_name_the_schedule_and_the_value(expression: str) -> None:
    with pytest.raises(InvalidCron) as info:
        CronSpec(expression, "UTC").validate(schedule="nightly-purge")
    assert "nightly-purge" in str(info.value) and repr(expression) in str(info.value)


@pytest.mark.parametrize("zone", ["Mars/Olympus", "", "Europe/Berlinn"])
def test_unknown_zones_name_the_schedule_and_the_value(zone: str) -> None:
    with pytest.raises(UnknownTimezone) as info:
        CronSpec("* * * * *", zone).validate(schedule="nightly-purge")
    assert "nightly-purge" in str(info.value) and repr(zone) in str(info.value)
