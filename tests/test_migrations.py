"""The shipped migrations build exactly the tables the scheduler's metadata declares."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from celery_leasebeat.migrations import current, head, upgrade
from celery_leasebeat.store import Store


def test_migrating_an_empty_database_matches_the_metadata(store: Store) -> None:
    assert not inspect(store.engine).has_table(store.tables.schedules.name)
    before, after = upgrade(store)
    assert (before, after) == (None, head())
    prefix = store.table_prefix
    with store.engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={
                "compare_type": True,
                "include_name": lambda name, type_, parent: (
                    type_ != "table" or (name.startswith(prefix) and name != f"{prefix}alembic_version")
                ),
            },
        )
        differences = compare_metadata(context, store.tables.metadata)
    assert differences == []
    with store.engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE {prefix}alembic_version")


def test_tables_created_on_first_use_are_stamped_not_recreated(store: Store) -> None:
    store.now()  # the scheduler's create-on-first-use
    assert current(store) is None
    assert upgrade(store) == (None, head())
    assert current(store) == head()
    with store.engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE {store.table_prefix}alembic_version")
