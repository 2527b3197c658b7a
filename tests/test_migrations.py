"""The shipped migrations build exactly the tables the scheduler's metadata declares, tables
created on first use are stamped, and tables of an older schema are refused until migrated."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from celery_leasebeat.errors import OutdatedTables
from celery_leasebeat.migrations import current, head, upgrade
from celery_leasebeat.store import Store
from celery_leasebeat.store.tables import SCHEMA_REVISION


def differences(store: Store) -> list:  # type: ignore[type-arg]
    """What autogenerate finds between the database and the metadata (leasebeat's tables only)."""
    prefix = store.table_prefix
    with store.engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={
                "compare_type": True,
                "include_name": lambda name, type_, parent: type_ != "table" or name.startswith(prefix),
            },
        )
        return list(compare_metadata(context, store.tables.metadata))


def test_the_tables_declare_the_newest_migration() -> None:
    assert SCHEMA_REVISION == head()


def test_migrating_an_empty_database_matches_the_metadata(store: Store) -> None:
    assert current(store) is None
    assert upgrade(store) == (None, head())
    assert differences(store) == []


def test_tables_created_on_first_use_are_stamped_with_their_revision(store: Store) -> None:
    store.now()  # the scheduler's create-on-first-use
    assert current(store) == head()
    assert upgrade(store) == (head(), head())
    assert differences(store) == []


def test_tables_of_an_older_schema_are_refused_until_migrated(store: Store, database_url: str) -> None:
    upgrade(store, "0001")
    older = Store(database_url, table_prefix=store.table_prefix)
    with pytest.raises(OutdatedTables, match=r"lacks following_at\. Run `leasebeat migrate`"):
        older.probe()
    older.dispose()
    assert upgrade(store) == ("0001", head())
    assert differences(store) == []
    assert store.probe().next_following is None


def test_unstamped_tables_of_the_first_schema_are_stamped_then_migrated(store: Store) -> None:
    """Before stamps, first use created the 0001 tables without a version row."""
    upgrade(store, "0001")
    with store.engine.begin() as connection:
        connection.execute(store.tables.version.delete())
    assert upgrade(store) == (None, head())
    assert differences(store) == []
