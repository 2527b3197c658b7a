"""Warnings about expressions that parse but are probably not what was meant."""

from __future__ import annotations

import calendar
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo

from cron_descriptor import Options, get_description
from croniter import croniter

from .errors import InvalidSchedule
from .timing import CronSpec, IntervalSpec, Spec, TriggeredSpec, utc

_YEAR = timedelta(days=366)
# Months that lack day 29, 30 or 31 (in some year).
_SHORT_MONTHS = {29: {2}, 30: {2}, 31: {2, 4, 6, 9, 11}}


def describe(spec: Spec) -> str:
    """A plain-English description: "At 03:15 AM", "Every 5 seconds"."""
    if isinstance(spec, IntervalSpec):
        return f"Every {spec.seconds:g} seconds"
    if isinstance(spec, TriggeredSpec):
        return "When triggered"
    options = Options()
    options.use_24hour_time_format = True
    try:
        text = get_description(spec.expression, options)
    except Exception:  # a valid croniter expression cron-descriptor does not know (e.g. "L1")
        return spec.expression
    if not spec.day_or:  # Celery's crontab: both day fields must match
        text = text.replace(", or on ", " if it is a ")
    return f"{text} ({spec.timezone})" if spec.timezone != "UTC" else text


def lint(spec: Spec, now: datetime) -> list[str]:
    """Return warnings for *spec* as of *now*: never fires within a year, a day of month
    some months lack, wall times DST skips or repeats, more often than once a minute."""
    if isinstance(spec, IntervalSpec):
        return ["fires more than once a minute"] if spec.seconds < 60 else []
    if isinstance(spec, TriggeredSpec):
        return []
    warnings: list[str] = []
    now = utc(now)
    try:
        first = spec.next_after(now)
    except InvalidSchedule:
        first = None
    if first is None or first - now > _YEAR:
        return ["never fires within a year"]
    fields = _expanded(spec)
    days, months = fields[2], fields[3]
    seconds = fields[5] if spec.has_seconds else [0]
    frequent = seconds == ["*"] or len(seconds) > 1
    if frequent:
        warnings.append("fires more than once a minute")
    weekdays = fields[4]
    # Standard cron with a weekday too: a day runs if either field matches, so no month is empty.
    if days != ["*"] and not (spec.day_or and weekdays != ["*"]):
        chosen_months = set(range(1, 13)) if months == ["*"] else {m for m in months if isinstance(m, int)}
        for day in sorted({d for d in days if isinstance(d, int) and d >= 29}):
            missing = sorted(chosen_months & _SHORT_MONTHS[day])
            if missing:
                names = ", ".join(calendar.month_abbr[m] for m in missing)
                warnings.append(f"day {day} does not exist in {names} (in some years): those months have no run")
    if not frequent:  # for sub-minute schedules DST is just more of the same
        warnings.extend(_dst_warnings(spec, now))
    return warnings


def _expanded(spec: CronSpec) -> list[list[int | str]]:
    expanded, _nth = croniter.expand(spec.expression, second_at_beginning=spec.has_seconds)
    return [list(field) for field in expanded]


def _dst_warnings(spec: CronSpec, now: datetime) -> list[str]:
    """Wall times of the coming year that fall in a DST gap or fold of the schedule's zone."""
    zone = ZoneInfo(spec.timezone)
    warnings = []
    for day in _transition_days(zone, now):
        start = datetime(day.year, day.month, day.day) - timedelta(microseconds=1)
        walls = croniter(spec.expression, start, day_or=spec.day_or, second_at_beginning=spec.has_seconds)
        for _ in range(1440):
            wall = walls.get_next(datetime)
            if wall.date() != day:
                break
            first, second = wall.replace(tzinfo=zone, fold=0), wall.replace(tzinfo=zone, fold=1)
            if first.utcoffset() == second.utcoffset():
                continue
            exists = first.astimezone(ZoneInfo("UTC")).astimezone(zone).replace(tzinfo=None) == wall
            if exists:
                times = "both instants" if spec.fires_at_both_instants else "its first instant only"
                warnings.append(f"{wall:%Y-%m-%d %H:%M} occurs twice (DST ends): runs at {times}")
            else:
                warnings.append(f"{wall:%Y-%m-%d %H:%M} does not exist (DST starts): runs at the end of the gap")
            break
    return warnings


def _transition_days(zone: ZoneInfo, now: datetime) -> list[date]:
    days = []
    previous = now.astimezone(zone).utcoffset()
    for offset in range(1, 368):
        moment = now + timedelta(days=offset)
        current = moment.astimezone(zone).utcoffset()
        if current != previous:
            # The change happened within the last day: find the local date it happened on.
            low, high = moment - timedelta(days=1), moment
            while high - low > timedelta(minutes=1):
                middle = low + (high - low) / 2
                if middle.astimezone(zone).utcoffset() == previous:
                    low = middle
                else:
                    high = middle
            days.append(high.astimezone(zone).date())
            previous = current
    return days
