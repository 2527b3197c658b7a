"""The tables, as SQLAlchemy Core ``Table`` objects built in one function.

``schedules`` holds one row per schedule: its definition, when it fires next, what happened
last, and the lease of the occurrence in flight. ``runs`` is the ledger: one row per claimed
occurrence, unique on ``(schedule, occurrence)``; its primary key is the Celery task id.
``replicas`` lists the beat processes and when each last completed a cycle;
``registrations`` records what the last sync wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeDecorator, TypeEngine

UTC = timezone.utc

# Names and tokens are short; these lengths fit every backend's index-key limit.
NAME_LENGTH = 200
TOKEN_LENGTH = 36


class UTCDateTime(TypeDecorator[datetime]):
    """A UTC instant, stored naive (no backend agrees on zone storage) with microseconds,
    returned aware."""

    impl = DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        instant = datetime.fromisoformat(value) if isinstance(value, str) else value  # SQLite's clock is text
        assert isinstance(instant, datetime)
        if instant.tzinfo is None:
            return instant.replace(tzinfo=UTC)
        return instant.astimezone(UTC)


#: The migration (celery_leasebeat/migrations/versions) whose schema these tables are:
#: tables created on first use are stamped with it.
SCHEMA_REVISION = "0002"


@dataclass(frozen=True)
class Tables:
    metadata: MetaData
    schedules: Table
    runs: Table
    replicas: Table
    registrations: Table
    #: Alembic's version table, under the prefix: which migration the tables are at.
    version: Table


def build_tables(prefix: str = "leasebeat_", schema: str | None = None) -> Tables:
    """Build the tables on a fresh ``MetaData``; *prefix* and *schema* place them."""
    metadata = MetaData(schema=schema)
    schedules = Table(
        f"{prefix}schedules",
        metadata,
        Column("name", String(NAME_LENGTH), primary_key=True),
        Column("task", String(255), nullable=False),
        Column("args", JSON, nullable=False),
        Column("kwargs", JSON, nullable=False),
        Column("options", JSON, nullable=False),
        # "cron" (standard cron), "crontab" (Celery's: day-of-month AND day-of-week), "interval"
        Column("kind", String(16), nullable=False),
        Column("cron", String(NAME_LENGTH)),
        Column("interval_seconds", Float),
        Column("timezone", String(64), nullable=False),
        # The operator's override: wins over ``cron`` when set and non-blank.
        Column("override_cron", String(NAME_LENGTH)),
        Column("enabled", Boolean, nullable=False, default=True),
        # Missed-run detection: an occurrence not claimed within grace_seconds is recorded
        # missed, one dispatched but not started within it is flagged, and a run longer than
        # max_runtime_seconds is flagged. Null: no detection.
        Column("grace_seconds", Float),
        Column("max_runtime_seconds", Float),
        # Triggered work (docs/http-api.md): the upstream schedule this one runs after, the
        # per-run cap of an inline job, the daily cap on triggered runs, the dedupe window.
        Column("after_schedule", String(NAME_LENGTH)),
        Column("inline_cap", Integer),
        Column("daily_cap", Integer),
        Column("dedupe_seconds", Float),
        # Where the row came from: "code" rows follow the registrations and are removed
        # when no longer registered.
        Column("origin", String(16), nullable=False, default="code"),
        # The next occurrence not yet run; while a lease is held, the occurrence in flight.
        Column("next_run_at", UTCDateTime, nullable=False),
        Column("last_run_at", UTCDateTime),
        Column("last_outcome", String(16)),
        Column("last_duration_ms", Integer),
        Column("last_error", Text),
        Column("lease_until", UTCDateTime),
        Column("lease_token", String(TOKEN_LENGTH)),
        Column("lease_owner", String(255)),
        # While a lease is held: the occurrence after the one in flight, when the schedule
        # is due again. Every replica's probe reads the earliest, so the survivors of a
        # replica that died after dispatching wake when its schedules are due, not a polling
        # interval later. A hint: cleared whenever the lease is.
        Column("following_at", UTCDateTime),
        # Dispatches of the occurrence in flight without an outcome (1 on a fresh claim).
        Column("attempt", Integer, nullable=False, default=0),
        Column("created_at", UTCDateTime, nullable=False),
        Column("updated_at", UTCDateTime, nullable=False),
        Column("version", Integer, nullable=False, default=1),
        Index(f"ix_{prefix}schedules_next_run_at", "next_run_at"),
        Index(f"ix_{prefix}schedules_lease_until", "lease_until"),
        Index(f"ix_{prefix}schedules_lease_token", "lease_token"),
        Index(f"ix_{prefix}schedules_following_at", "following_at"),
        Index(f"ix_{prefix}schedules_after_schedule", "after_schedule"),
    )
    runs = Table(
        f"{prefix}runs",
        metadata,
        Column("id", String(TOKEN_LENGTH), primary_key=True),
        Column("schedule", String(NAME_LENGTH), nullable=False),
        Column("occurrence", UTCDateTime, nullable=False),
        # claimed, dispatched, publish_failed, started, succeeded, failed, skipped, lost
        Column("state", String(16), nullable=False),
        Column("attempts", Integer, nullable=False, default=1),
        Column("lease_token", String(TOKEN_LENGTH)),
        Column("replica", String(255)),
        Column("claimed_at", UTCDateTime),
        Column("dispatched_at", UTCDateTime),
        Column("started_at", UTCDateTime),
        Column("finished_at", UTCDateTime),
        Column("duration_ms", Integer),
        Column("worker", String(255)),
        # Celery's retry count of the delivery that started this claim; null: not started.
        # A delivery may start only with a higher count (a retry), never the same (a redelivery).
        Column("retries", Integer),
        Column("error", Text),
        # Occurrences dropped after this one because they elapsed before it finished.
        Column("missed_count", Integer, nullable=False, default=0),
        # Why missed-run detection flagged this run (late start, overrun); null when it did not.
        Column("alert", Text),
        # What created the run: "schedule", "api", "cli" or "after" (an upstream succeeded).
        Column("source", String(16), nullable=False, default="schedule"),
        # The Idempotency-Key of the HTTP trigger that created it.
        Column("dedupe_key", String(NAME_LENGTH)),
        # A short JSON summary of what the task returned (an inline job's count).
        Column("result", Text),
        UniqueConstraint("schedule", "occurrence", name=f"uq_{prefix}runs_occurrence"),
        Index(f"ix_{prefix}runs_finished_at", "finished_at"),
        Index(f"ix_{prefix}runs_state", "state"),
        Index(f"ix_{prefix}runs_dedupe_key", "dedupe_key", unique=True),
        Index(f"ix_{prefix}runs_source_claimed_at", "source", "claimed_at"),
    )
    replicas = Table(
        f"{prefix}replicas",
        metadata,
        # One row per beat process, refreshed while it runs: what `leasebeat status` shows.
        Column("name", String(255), primary_key=True),
        Column("host", String(255), nullable=False),
        Column("pid", Integer, nullable=False),
        Column("version", String(32), nullable=False),
        Column("started_at", UTCDateTime, nullable=False),
        Column("last_cycle_at", UTCDateTime, nullable=False),
        Column("claims", Integer, nullable=False, default=0),
        Index(f"ix_{prefix}replicas_last_cycle_at", "last_cycle_at"),
    )
    registrations = Table(
        f"{prefix}registrations",
        metadata,
        # One row per source of schedule rows; "code" (register_schedule and beat_schedule)
        # is the only one. ``digest`` identifies the definitions that source's rows match as
        # the last sync left them (null: no replica's), so a replica whose definitions have
        # that digest starts, and re-checks, without comparing every row. Syncs lock it.
        Column("source", String(16), primary_key=True),
        Column("digest", String(64)),
        Column("schedules", Integer, nullable=False),
        Column("synced_at", UTCDateTime, nullable=False),
    )
    version = Table(
        f"{prefix}alembic_version",
        metadata,
        # Alembic's own layout, so `leasebeat migrate` reads and moves it.
        Column("version_num", String(32), nullable=False),
        PrimaryKeyConstraint("version_num", name=f"{prefix}alembic_version_pkc"),
    )
    return Tables(
        metadata=metadata,
        schedules=schedules,
        runs=runs,
        replicas=replicas,
        registrations=registrations,
        version=version,
    )
