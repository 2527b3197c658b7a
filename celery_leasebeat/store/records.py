"""The values that cross the store's boundary: immutable, keyword-only, no SQL in them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..timing import CronSpec, IntervalSpec, Spec, TriggeredSpec

# Fixed forever: changing it would change every run id, and with it every dedupe key.
_RUN_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://pypi.org/project/celery-leasebeat/")


def run_id_for(schedule: str, occurrence: datetime) -> str:
    """The deterministic id of an occurrence: its ledger key and its Celery task id."""
    return str(uuid.uuid5(_RUN_NAMESPACE, f"{schedule}\x00{occurrence.isoformat()}"))


class RunState:
    """The states of a ledger row. Terminal states are the outcomes."""

    CLAIMED = "claimed"
    DISPATCHED = "dispatched"
    PUBLISH_FAILED = "publish_failed"
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    LOST = "lost"
    MISSED = "missed"

    STARTABLE = (CLAIMED, DISPATCHED)
    OUTCOMES = (SUCCEEDED, FAILED, SKIPPED, LOST, MISSED)


@dataclass(frozen=True, kw_only=True)
class ScheduleDefinition:
    """What code (or configuration) says a schedule is; the store upserts these by name."""

    name: str
    task: str
    kind: str  # "cron", "crontab" or "interval"
    cron: str | None = None
    interval_seconds: float | None = None
    timezone: str = "UTC"
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    grace_seconds: float | None = None
    max_runtime_seconds: float | None = None
    #: Runs for the same window after this upstream schedule succeeds (kind "triggered").
    after: str | None = None
    #: Run inline by the HTTP API, passing cap=inline_cap; the task returns its count.
    inline_cap: int | None = None
    #: Triggered runs allowed per UTC day.
    daily_cap: int | None = None
    #: Triggers within this many seconds of the last one collapse into its job.
    dedupe_seconds: float | None = None

    def spec(self, override: str | None = None) -> Spec:
        return spec_for(self.kind, self.cron, self.interval_seconds, self.timezone, override)


def spec_for(
    kind: str,
    cron: str | None,
    interval_seconds: float | None,
    timezone: str,
    override: str | None = None,
) -> Spec:
    """The effective timing of a schedule: the override (a standard cron expression) wins
    when set and non-blank."""
    if override is not None and override.strip():
        return CronSpec(override.strip(), timezone)
    if kind == "triggered":
        return TriggeredSpec()
    if kind == "interval":
        assert interval_seconds is not None
        return IntervalSpec(interval_seconds)
    assert cron is not None
    return CronSpec(cron, timezone, day_or=kind != "crontab")


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One cheap read of the database clock and of the earliest moments something changes."""

    now: datetime
    #: Earliest ``next_run_at`` of enabled rows without a live lease (may be in the past).
    next_due: datetime | None
    #: Earliest expiry of a live lease.
    next_expiry: datetime | None
    #: Earliest moment a schedule whose run is in flight is due again (see ``following_at``).
    next_following: datetime | None


@dataclass(frozen=True, kw_only=True)
class ClaimedRun:
    """One occurrence claimed by this replica: what to publish and how to fence it."""

    schedule: str
    occurrence: datetime
    run_id: str
    lease_token: str
    lease_until: datetime  # once published (until then, the store's shorter publish lease)
    attempt: int
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    spec: Spec
    #: When the schedule is due again once this occurrence is dispatched.
    following: datetime
    grace_seconds: float | None = None
    after: str | None = None
    inline_cap: int | None = None

    @property
    def label(self) -> str:
        return f"{self.schedule}@{self.occurrence.isoformat()}"


@dataclass(frozen=True, kw_only=True)
class StartDecision:
    """Whether a worker may run a delivered occurrence, and why not."""

    run: bool
    reason: str = ""
    state: str | None = None


@dataclass(frozen=True, kw_only=True)
class Finished:
    """What recording an outcome did: nothing (a stale token), or applied it, dropping
    *missed* elapsed occurrences and setting the next run time."""

    applied: bool
    missed: int = 0
    next_run_at: datetime | None = None
    schedule: str | None = None

    def __bool__(self) -> bool:
        return self.applied


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    inserted: list[str] = field(default_factory=list)
    retimed: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    #: The rows already matched the definitions: nothing was read or written.
    skipped: bool = False
