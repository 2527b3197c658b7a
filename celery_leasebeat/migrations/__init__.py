"""The shipped Alembic migrations of the leasebeat tables, with their own version table.

``upgrade(store)`` (or ``leasebeat migrate``) brings a database to the newest schema. The
version table is ``<prefix>alembic_version``, so these migrations never touch an
application's own Alembic history; see docs/operations.md for excluding the leasebeat
tables from an application's autogenerate.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from ..store import Store

HERE = Path(__file__).parent


def alembic_config(store: Store) -> Config:
    config = Config()
    config.set_main_option("script_location", str(HERE))
    config.attributes["leasebeat_store"] = store
    return config


def version_table(store: Store) -> str:
    return f"{store.table_prefix}alembic_version"


def head() -> str:
    script = ScriptDirectory(str(HERE))
    revision = script.get_current_head()
    assert revision is not None
    return revision


def current(store: Store) -> str | None:
    with store.engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={"version_table": version_table(store), "version_table_schema": store.tables.metadata.schema},
        )
        return context.get_current_revision()


def upgrade(store: Store, revision: str = "head") -> tuple[str | None, str]:
    """Apply the migrations up to *revision*; return (before, after).

    Tables that the scheduler created on first use (without migrations) are at the newest
    schema of the version that created them: they are stamped, not created again.
    """
    config = alembic_config(store)
    before = current(store)
    if before is None and inspect(store.engine).has_table(
        store.tables.schedules.name, schema=store.tables.metadata.schema
    ):
        command.stamp(config, revision)
    else:
        command.upgrade(config, revision)
    return before, current(store) or "base"
