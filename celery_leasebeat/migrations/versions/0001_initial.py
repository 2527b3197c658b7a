"""The first schema: schedules, the run ledger and beat replicas.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

A migration is a frozen record of a schema: the columns are spelled out here rather than
taken from ``store/tables.py``, which moves on with later versions.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_leasebeat.store.tables import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade(prefix: str, schema: str | None) -> None:
    op.create_table(
        f"{prefix}schedules",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("args", sa.JSON, nullable=False),
        sa.Column("kwargs", sa.JSON, nullable=False),
        sa.Column("options", sa.JSON, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("cron", sa.String(200)),
        sa.Column("interval_seconds", sa.Float),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("override_cron", sa.String(200)),
        sa.Column("enabled", sa.Boolean, nullable=False),
        sa.Column("grace_seconds", sa.Float),
        sa.Column("max_runtime_seconds", sa.Float),
        sa.Column("after_schedule", sa.String(200)),
        sa.Column("inline_cap", sa.Integer),
        sa.Column("daily_cap", sa.Integer),
        sa.Column("dedupe_seconds", sa.Float),
        sa.Column("origin", sa.String(16), nullable=False),
        sa.Column("next_run_at", UTCDateTime, nullable=False),
        sa.Column("last_run_at", UTCDateTime),
        sa.Column("last_outcome", sa.String(16)),
        sa.Column("last_duration_ms", sa.Integer),
        sa.Column("last_error", sa.Text),
        sa.Column("lease_until", UTCDateTime),
        sa.Column("lease_token", sa.String(36)),
        sa.Column("lease_owner", sa.String(255)),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("updated_at", UTCDateTime, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        schema=schema,
    )
    for column in ("next_run_at", "lease_until", "lease_token", "after_schedule"):
        op.create_index(f"ix_{prefix}schedules_{column}", f"{prefix}schedules", [column], schema=schema)
    op.create_table(
        f"{prefix}runs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("schedule", sa.String(200), nullable=False),
        sa.Column("occurrence", UTCDateTime, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("lease_token", sa.String(36)),
        sa.Column("replica", sa.String(255)),
        sa.Column("claimed_at", UTCDateTime),
        sa.Column("dispatched_at", UTCDateTime),
        sa.Column("started_at", UTCDateTime),
        sa.Column("finished_at", UTCDateTime),
        sa.Column("duration_ms", sa.Integer),
        sa.Column("worker", sa.String(255)),
        sa.Column("retries", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("missed_count", sa.Integer, nullable=False),
        sa.Column("alert", sa.Text),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("dedupe_key", sa.String(200)),
        sa.Column("result", sa.Text),
        sa.UniqueConstraint("schedule", "occurrence", name=f"uq_{prefix}runs_occurrence"),
        schema=schema,
    )
    op.create_index(f"ix_{prefix}runs_finished_at", f"{prefix}runs", ["finished_at"], schema=schema)
    op.create_index(f"ix_{prefix}runs_state", f"{prefix}runs", ["state"], schema=schema)
    op.create_index(f"ix_{prefix}runs_dedupe_key", f"{prefix}runs", ["dedupe_key"], unique=True, schema=schema)
    op.create_index(f"ix_{prefix}runs_source_claimed_at", f"{prefix}runs", ["source", "claimed_at"], schema=schema)
    op.create_table(
        f"{prefix}replicas",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("version", sa.String(32), nullable=False),
        sa.Column("started_at", UTCDateTime, nullable=False),
        sa.Column("last_cycle_at", UTCDateTime, nullable=False),
        sa.Column("claims", sa.Integer, nullable=False),
        schema=schema,
    )
    op.create_index(f"ix_{prefix}replicas_last_cycle_at", f"{prefix}replicas", ["last_cycle_at"], schema=schema)


def downgrade(prefix: str, schema: str | None) -> None:
    for table in ("replicas", "runs", "schedules"):
        op.drop_table(f"{prefix}{table}", schema=schema)
