"""The few statements that differ between PostgreSQL, MySQL/MariaDB and SQLite."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Executable, Select, Table, Update, func, type_coerce
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.ext.compiler import compiles

from .tables import UTCDateTime


def is_mysql(engine: Engine) -> bool:
    return engine.dialect.name in ("mysql", "mariadb")


def database_now(engine: Engine) -> ColumnElement[Any]:
    """The database's clock as a naive UTC timestamp, constant within one statement."""
    name = engine.dialect.name
    if name == "postgresql":
        expression = func.timezone("UTC", func.statement_timestamp())
    elif is_mysql(engine):
        expression = func.utc_timestamp(6)
    elif name == "sqlite":
        # "%f" is seconds with milliseconds; pad to the microseconds SQLAlchemy stores so
        # that text comparison with stored values orders correctly.
        expression = func.strftime("%Y-%m-%d %H:%M:%f000", "now")
    else:  # pragma: no cover - guarded by Store.__init__
        raise NotImplementedError(name)
    return type_coerce(expression, UTCDateTime())


def claim_statement(
    engine: Engine, table: Table, due: ColumnElement[bool], values: list[tuple[str, Any]], limit: int
) -> Executable:
    """One atomic UPDATE that leases up to *limit* due rows, earliest first.

    PostgreSQL selects the batch with ``FOR UPDATE SKIP LOCKED`` (in a materialised CTE)
    so concurrent replicas
    take disjoint batches instead of queueing on each other's rows; SQLite serialises
    writers anyway. MySQL cannot update a table it selects from in a subquery, but takes
    ``ORDER BY ... LIMIT`` on a single-table UPDATE, which skips rows another replica has
    just claimed because InnoDB re-reads the latest committed row under its lock. The
    ``due`` condition is repeated on the outer statement so that a row leased between
    the subquery's snapshot and the update is never taken twice. *values* keep their
    order in the SET clause, because MySQL evaluates assignments left to right.
    """
    if is_mysql(engine):
        return _OrderedLimitedUpdate(table, table.c.next_run_at, limit).where(due).ordered_values(*values)
    batch: Select[Any] = (
        table.select().with_only_columns(table.c.name).where(due).order_by(table.c.next_run_at).limit(limit)
    )
    if engine.dialect.name == "postgresql":
        # A materialised CTE runs the locking subquery exactly once; as an IN-subquery the
        # planner may re-run it per row and update more than *limit* rows.
        locked = batch.with_for_update(skip_locked=True).cte("leasebeat_batch").prefix_with("MATERIALIZED")
        return table.update().where(table.c.name == locked.c.name).where(due).ordered_values(*values)
    return table.update().where(table.c.name.in_(batch)).where(due).ordered_values(*values)


def insert_ignoring_duplicates(engine: Engine, table: Table) -> Any:
    """An INSERT that leaves an existing row (same primary key) alone."""
    if engine.dialect.name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    if engine.dialect.name == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing()
    return mysql.insert(table).prefix_with("IGNORE")


def upsert(engine: Engine, table: Table, update: list[str]) -> Any:
    """An INSERT that overwrites the columns *update* of a row that already exists. Execute
    it with a list of rows: one cached statement, batched by the driver (a multi-row VALUES
    clause would be compiled anew for every batch, which costs more than the round trip)."""
    if engine.dialect.name == "postgresql":
        pg = postgresql.insert(table)
        return pg.on_conflict_do_update(
            index_elements=list(table.primary_key.columns),
            set_={name: pg.excluded[name] for name in update},
        )
    if engine.dialect.name == "sqlite":
        lite = sqlite.insert(table)
        return lite.on_conflict_do_update(
            index_elements=list(table.primary_key.columns),
            set_={name: lite.excluded[name] for name in update},
        )
    my = mysql.insert(table)
    return my.on_duplicate_key_update({name: my.inserted[name] for name in update})


class _OrderedLimitedUpdate(Update):
    """``UPDATE ... ORDER BY ... LIMIT n`` for MySQL/MariaDB, which SQLAlchemy lacks."""

    inherit_cache = False

    def __init__(self, table: Table, order_by: ColumnElement[Any], limit: int) -> None:
        super().__init__(table)
        self.leasebeat_order_by = order_by
        self.leasebeat_limit = int(limit)


@compiles(_OrderedLimitedUpdate)
def _compile_ordered_limited_update(element: _OrderedLimitedUpdate, compiler: Any, **kw: Any) -> str:
    statement = compiler.visit_update(element, **kw)
    order = compiler.process(element.leasebeat_order_by, **kw)
    return f"{statement} ORDER BY {order} LIMIT {element.leasebeat_limit}"
