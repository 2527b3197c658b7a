"""When a schedule fires: cron expressions, intervals, time zones and the DST rules.

Every instant this module takes or returns is an aware UTC ``datetime``. Cron expressions
are evaluated on local wall time in the schedule's IANA zone, then mapped to instants by
the rules of Cronos (the parser seed 000 names), which DESIGN.md adopts:

* a wall time that does not exist (spring forward) fires once, at the first instant after
  the gap; several occurrences inside one gap collapse into that one run;
* a wall time that occurs twice (fall back) fires once, at its first instant, when the
  expression fixes the hour; when the hour field is ``*`` or ``*/n`` it fires at both
  instants, so "every hour" stays hourly in real time.

croniter 7 alone does not follow these rules (it yields both instants of a repeated wall
time even for a fixed hour), so croniter only enumerates naive wall times here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterError

from .errors import InvalidCron, InvalidSchedule, UnknownTimezone

UTC = timezone.utc

# The widest DST shift in the tz database is two hours; a fold never spans more.
_ONE_MICROSECOND = timedelta(microseconds=1)
# How many wall times one search may inspect before giving up: a per-second schedule
# walks at most one fold (3,600 wall times); anything beyond this is an expression that
# (almost) never fires, e.g. "0 0 30 2 *".
_MAX_WALL_TIMES = 20_000
_STEP_OR_STAR = re.compile(r"^\*(/\d+)?$")


def utc(value: datetime) -> datetime:
    """Return *value* as an aware UTC datetime; a naive value is taken to be UTC already."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def zone_for(name: str, *, schedule: str = "?") -> ZoneInfo:
    """Return the IANA zone *name*, or raise :class:`UnknownTimezone` naming the schedule."""
    try:
        return _zone(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise UnknownTimezone(
            f"schedule {schedule!r}: unknown time zone {name!r} (expected an IANA name such as "
            f"'Europe/Berlin' or 'UTC')"
        ) from None


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(name)
    return ZoneInfo(name)


@lru_cache(maxsize=4096)
def _cron_problem(expression: str, day_or: bool, seconds: bool) -> str | None:
    """What croniter finds wrong with *expression*, or None. Cached: parsing costs about a
    millisecond, and thousands of schedules often share a handful of expressions."""
    try:
        croniter(expression, datetime(2000, 1, 1), day_or=day_or, second_at_beginning=seconds).get_next(datetime)
    except (CroniterError, ValueError, KeyError, TypeError) as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class CronSpec:
    """A cron expression in a time zone.

    Five fields are standard cron; six fields put seconds first (``*/5 * * * * *`` is every
    five seconds). ``day_or`` is croniter's: True is standard cron (a day matches when the
    day-of-month *or* the day-of-week matches), False is Celery's ``crontab`` (both must).
    """

    expression: str
    timezone: str = "UTC"
    day_or: bool = True

    @property
    def has_seconds(self) -> bool:
        return len(self.expression.split()) == 6

    @property
    def fires_at_both_instants(self) -> bool:
        """True when a repeated wall time fires twice: the hour field is ``*`` or ``*/n``."""
        fields = self.expression.split()
        hour = fields[2] if self.has_seconds else fields[1]
        return bool(_STEP_OR_STAR.match(hour))

    def validate(self, *, schedule: str = "?") -> CronSpec:
        """Raise :class:`InvalidCron` or :class:`UnknownTimezone` naming *schedule*."""
        zone_for(self.timezone, schedule=schedule)
        fields = self.expression.split() if isinstance(self.expression, str) else []
        if len(fields) not in (5, 6):
            raise InvalidCron(
                f"schedule {schedule!r}: invalid cron expression {self.expression!r}: expected "
                f"5 fields (minute hour day month weekday) or 6 with seconds first"
            )
        problem = _cron_problem(self.expression, self.day_or, self.has_seconds)
        if problem is not None:
            raise InvalidCron(f"schedule {schedule!r}: invalid cron expression {self.expression!r}: {problem}")
        return self

    def next_after(self, after: datetime, previous: datetime | None = None) -> datetime:
        """Return the first occurrence strictly after the instant *after*."""
        zone = _zone(self.timezone)
        after = utc(after)
        local_after = after.astimezone(zone)
        wall = local_after.replace(tzinfo=None, fold=0)
        fold = _fold_walls(zone, wall)
        # Inside a repeated hour, earlier wall times can still map to later instants (the
        # second pass), so the search starts at the fold's first wall time and runs past it.
        start = fold[0] - _ONE_MICROSECOND if fold else wall
        walls = croniter(
            self.expression,
            start,
            day_or=self.day_or,
            second_at_beginning=self.has_seconds,
        )
        best: datetime | None = None
        for _ in range(_MAX_WALL_TIMES):
            try:
                candidate_wall = walls.get_next(datetime)
            except CroniterError as exc:  # e.g. "0 0 30 2 *": croniter finds no date at all
                raise InvalidSchedule(
                    f"cron expression {self.expression!r} in {self.timezone} has no occurrence after "
                    f"{after.isoformat()}: {exc}"
                ) from None
            for instant in self._instants(zone, candidate_wall):
                if instant > after and (best is None or instant < best):
                    best = instant
            if best is not None and (fold is None or candidate_wall >= fold[1]):
                return best
        raise InvalidSchedule(
            f"cron expression {self.expression!r} in {self.timezone} has no occurrence "
            f"after {after.isoformat()} within {_MAX_WALL_TIMES} wall times"
        )

    def _instants(self, zone: ZoneInfo, wall: datetime) -> list[datetime]:
        first = wall.replace(tzinfo=zone, fold=0)
        second = wall.replace(tzinfo=zone, fold=1)
        if first.utcoffset() == second.utcoffset():
            return [first.astimezone(UTC)]
        first_utc, second_utc = first.astimezone(UTC), second.astimezone(UTC)
        if first_utc.astimezone(zone).replace(tzinfo=None) == wall:
            # The wall time exists twice (fall back): fold 0 is the earlier instant.
            return [first_utc, second_utc] if self.fires_at_both_instants else [first_utc]
        # The wall time falls in a gap (spring forward): the first instant after the gap.
        return [_transition(zone, second_utc, first_utc)]


@dataclass(frozen=True)
class IntervalSpec:
    """Every *seconds*, on a nominal cadence: occurrences are ``previous + k * seconds``,
    so a late dispatch never shifts later occurrences (no drift)."""

    seconds: float

    def validate(self, *, schedule: str = "?") -> IntervalSpec:
        if not isinstance(self.seconds, (int, float)) or not self.seconds > 0:
            raise InvalidSchedule(
                f"schedule {schedule!r}: an interval must be a positive number of seconds, got {self.seconds!r}"
            )
        return self

    def next_after(self, after: datetime, previous: datetime | None = None) -> datetime:
        """Return the first ``previous + k * seconds`` (k >= 1) strictly after *after*."""
        after = utc(after)
        step = timedelta(seconds=self.seconds)
        if previous is None:
            return after + step
        previous = utc(previous)
        if previous + step > after:
            return previous + step
        steps = math.floor((after - previous) / step) + 1
        candidate = previous + steps * step
        while candidate <= after:  # guard against float rounding of the division
            candidate += step
        return candidate


@dataclass(frozen=True)
class TriggeredSpec:
    """No timing of its own: runs only when triggered (an upstream schedule, the HTTP API or
    ``leasebeat trigger``). Its next occurrence is the end of time."""

    def validate(self, *, schedule: str = "?") -> TriggeredSpec:
        return self

    def next_after(self, after: datetime, previous: datetime | None = None) -> datetime:
        return NEVER


#: The next_run_at of a schedule that is never due on its own.
NEVER = datetime(9999, 12, 31, tzinfo=UTC)

Spec = CronSpec | IntervalSpec | TriggeredSpec


def occurrences_between(spec: Spec, first: datetime, until: datetime, limit: int) -> int:
    """Count the occurrences strictly after *first* and at or before *until*, up to *limit*."""
    count, current = 0, utc(first)
    until = utc(until)
    while count < limit:
        current = spec.next_after(current, previous=current)
        if current > until:
            break
        count += 1
    return count


def preview(spec: Spec, start: datetime, count: int) -> list[datetime]:
    """Return the next *count* occurrences after *start*."""
    out: list[datetime] = []
    current = utc(start)
    previous = None
    for _ in range(count):
        current = spec.next_after(current, previous=previous)
        previous = current
        out.append(current)
    return out


def _fold_walls(zone: ZoneInfo, wall: datetime) -> tuple[datetime, datetime] | None:
    """When *wall* is a repeated wall time, return the repeated range [start, end) of walls."""
    first = wall.replace(tzinfo=zone, fold=0)
    second = wall.replace(tzinfo=zone, fold=1)
    if first.utcoffset() == second.utcoffset():
        return None
    first_utc, second_utc = first.astimezone(UTC), second.astimezone(UTC)
    if first_utc.astimezone(zone).replace(tzinfo=None) != wall:
        return None  # a gap, not a fold
    change = _transition(zone, first_utc, second_utc)
    offset_before = first.utcoffset()
    offset_after = second.utcoffset()
    assert offset_before is not None and offset_after is not None
    return (change + offset_after).replace(tzinfo=None), (change + offset_before).replace(tzinfo=None)


@lru_cache(maxsize=1024)
def _transition(zone: ZoneInfo, low: datetime, high: datetime) -> datetime:
    """Return the first instant in (low, high] whose UTC offset is already high's offset."""
    target = high.astimezone(zone).utcoffset()
    while high - low > timedelta(seconds=1):
        middle = low + (high - low) / 2
        middle = middle.replace(microsecond=0)
        if middle <= low:
            break
        if middle.astimezone(zone).utcoffset() == target:
            high = middle
        else:
            low = middle
    return high
