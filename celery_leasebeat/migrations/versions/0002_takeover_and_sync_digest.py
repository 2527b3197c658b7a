"""Schedules' ``following_at`` and the ``registrations`` table.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

``following_at``: while a run is in flight, when its schedule is due again. Every replica's
probe reads the earliest, so the survivors of a replica that died after dispatching take
its schedules over on time. ``registrations``: the digest of the definitions the rows match
as the last sync left them, so a replica with the same definitions skips the sync.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_leasebeat.store.tables import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade(prefix: str, schema: str | None) -> None:
    op.add_column(f"{prefix}schedules", sa.Column("following_at", UTCDateTime), schema=schema)
    op.create_index(f"ix_{prefix}schedules_following_at", f"{prefix}schedules", ["following_at"], schema=schema)
    op.create_table(
        f"{prefix}registrations",
        sa.Column("source", sa.String(16), primary_key=True),
        sa.Column("digest", sa.String(64)),
        sa.Column("schedules", sa.Integer, nullable=False),
        sa.Column("synced_at", UTCDateTime, nullable=False),
        schema=schema,
    )


def downgrade(prefix: str, schema: str | None) -> None:
    op.drop_table(f"{prefix}registrations", schema=schema)
    op.drop_index(f"ix_{prefix}schedules_following_at", f"{prefix}schedules", schema=schema)
    with op.batch_alter_table(f"{prefix}schedules", schema=schema) as batch:  # SQLite rebuilds the table
        batch.drop_column("following_at")
