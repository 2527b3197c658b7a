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

from ..store import Store
from ..store.tables import SCHEMA_REVISION

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

    Tables created on first use are stamped with their revision when created. Tables
    without a stamp were created on first use by a version before stamps: they are stamped
    0001 (or the current revision, when they already have every column) and migrated on.
    """
    config = alembic_config(store)
    before = current(store)
    missing = store.missing_columns() if before is None else None
    if missing is not None:  # tables without a stamp
        command.stamp(config, "0001" if missing else SCHEMA_REVISION)
    command.upgrade(config, revision)
    return before, current(store) or "base"
