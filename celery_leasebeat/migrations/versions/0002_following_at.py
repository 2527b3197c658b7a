"""The schedules' ``following_at``: when a schedule whose run is in flight is due again.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Every replica's probe reads the earliest ``following_at`` of the leased rows, so the
survivors of a replica that died after dispatching wake when its schedules are due again.
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


def downgrade(prefix: str, schema: str | None) -> None:
    op.drop_index(f"ix_{prefix}schedules_following_at", f"{prefix}schedules", schema=schema)
    with op.batch_alter_table(f"{prefix}schedules", schema=schema) as batch:  # SQLite rebuilds the table
        batch.drop_column("following_at")
