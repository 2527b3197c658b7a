"""Alembic environment of the leasebeat tables: run by ``celery_leasebeat.migrations.upgrade``."""

from __future__ import annotations

from alembic import context

store = context.config.attributes["leasebeat_store"]

with store.engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=store.tables.metadata,
        version_table=f"{store.table_prefix}alembic_version",
        version_table_schema=store.tables.metadata.schema,
        # Only ever compare the leasebeat tables, never an application's own.
        include_name=lambda name, type_, parent: type_ != "table" or (name or "").startswith(store.table_prefix),
    )
    with context.begin_transaction():
        context.run_migrations(prefix=store.table_prefix, schema=store.tables.metadata.schema)
    connection.commit()
