"""The schedule store: every SQL statement celery-leasebeat runs lives here.

The contract, stated once:

* ``now`` is always the **database's** clock, so replicas on skewed hosts agree.
* A row is **due** when it is enabled, ``next_run_at <= now`` and it holds no live lease
  (``lease_until`` is null or past).
* :meth:`Store.claim` leases a batch of due rows with one atomic UPDATE that sets a fresh
  ``lease_token``, re-reads the claimed rows by that token, and writes one ledger row per
  claimed occurrence (unique on ``(schedule, occurrence)``), all in one transaction.
* Every later write about an occurrence is **fenced**: it applies only where the row still
  holds the lease token it was claimed with. A fenced write that matches nothing changes
  nothing, is logged, and is reported to the caller as ``False``.
* A lease is released (token and expiry cleared) by the run's outcome, by a failed publish,
  or by giving the occurrence up as lost; otherwise it expires and the occurrence becomes
  due again under the same run id.

The store knows nothing of Celery: callers pass names, tokens and definitions.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, and_, case, create_engine, delete, event, func, inspect, literal, or_, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    InterfaceError,
    NoSuchTableError,
    OperationalError,
    ProgrammingError,
)

from ..errors import (
    DatabaseConflict,
    DatabaseUnavailable,
    MissingTables,
    OutdatedTables,
    SchedulePaused,
    SpendCapExceeded,
    UnknownJob,
    UnknownSchedule,
)
from ..timing import Spec, occurrences_between
from .dialects import (
    claim_statement,
    database_now,
    insert_ignoring_duplicates,
    upsert,
)
from .records import (
    ClaimedRun,
    Finished,
    Probe,
    RunState,
    ScheduleDefinition,
    StartDecision,
    SyncReport,
    run_id_for,
    spec_for,
)
from .tables import SCHEMA_REVISION, Tables, UTCDateTime, build_tables

__all__ = [
    "ClaimedRun",
    "Finished",
    "Probe",
    "RunState",
    "ScheduleDefinition",
    "StartDecision",
    "Store",
    "SyncReport",
    "digest_of",
    "run_id_for",
    "spec_for",
]

logger = logging.getLogger("celery_leasebeat.store")

# Counting dropped occurrences walks the schedule; past this many, the count is a floor.
MAX_MISSED_COUNT = 10_000
# Rows per IN-list when reading registrations back: well inside every backend's limits.
_CHUNK = 500
#: Rows per INSERT executemany when a sync adds many schedules (bounded memory per call).
_INSERT_CHUNK = 5_000
#: What sync reads to compare a row with its definition: the columns a definition sets,
#: and the override, which decides the row's effective timing.
_DEFINITION_COLUMNS = (
    "name", "task", "args", "kwargs", "options", "kind", "cron", "interval_seconds", "timezone", "grace_seconds",
    "max_runtime_seconds", "after_schedule", "inline_cap", "daily_cap", "dedupe_seconds", "origin", "override_cron",
)  # fmt: skip
#: See Store.publish_lease_seconds: ample for publishing one batch, broker retries included.
PUBLISH_LEASE_SECONDS = 30.0
#: What a claim reads back of each row it leased: what publishing and fencing need.
_CLAIM_COLUMNS = (
    "name", "next_run_at", "attempt", "task", "args", "kwargs", "options", "kind", "cron", "interval_seconds",
    "timezone", "override_cron", "grace_seconds", "after_schedule", "inline_cap",
)  # fmt: skip
_SUPPORTED = ("postgresql", "mysql", "mariadb", "sqlite")
#: The origin of rows from register_schedule() and beat_schedule, and their registrations row.
_CODE = "code"

F = TypeVar("F", bound=Callable[..., Any])


def _translate_errors(method: F) -> F:
    """Turn a lost or refused connection into :class:`DatabaseUnavailable` (retryable);
    integrity and programming errors are bugs or bad data and pass through unchanged."""

    @functools.wraps(method)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (IntegrityError, ProgrammingError):
            raise
        except DBAPIError as exc:
            if _is_deadlock(exc):
                raise DatabaseConflict(f"database {self.safe_url}: {_first_line(exc.orig or exc)}") from exc
            if not (isinstance(exc, (OperationalError, InterfaceError)) or exc.connection_invalidated):
                raise
            raise DatabaseUnavailable(f"database {self.safe_url} unavailable: {_first_line(exc.orig or exc)}") from exc

    return wrapper  # type: ignore[return-value]


class Store:
    """The schedule table and the run ledger in one SQL database."""

    def __init__(
        self,
        url: str,
        *,
        table_prefix: str = "leasebeat_",
        schema: str | None = None,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = make_url(url)
        backend = self.url.get_backend_name()
        if backend not in _SUPPORTED:
            raise ValueError(f"unsupported database {backend!r}: use PostgreSQL, MySQL/MariaDB or SQLite")
        self.safe_url = self.url.render_as_string(hide_password=True)
        self.table_prefix = table_prefix
        self.tables: Tables = build_tables(table_prefix, schema)
        self._engine_options = dict(engine_options or {})
        self._engine: Engine | None = None
        self._probe_engine: Engine | None = None
        self._schema_ready = False
        #: Whether first use creates missing tables (beat and workers) or reports them
        #: missing (the CLI, where a wrong URL must not create anything).
        self.create_tables = True
        #: How long a claim holds its lease before :meth:`mark_dispatched` extends it to the
        #: full lease: a replica that dies between claiming and publishing delays those
        #: occurrences by this much, not by a whole lease.
        self.publish_lease_seconds = PUBLISH_LEASE_SECONDS

    # -- connection management -------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine, created on first use: constructing a Store touches no database."""
        if self._engine is None:
            self._engine = self._create_engine()
        return self._engine

    def _create_engine(self) -> Engine:
        options: dict[str, Any] = {"pool_pre_ping": True}
        backend = self.url.get_backend_name()
        if backend == "sqlite":
            options["connect_args"] = {"timeout": 30}
        elif backend in ("mysql", "mariadb"):
            # Claims lock only the rows they read; REPEATABLE READ would add gap locks.
            options["isolation_level"] = "READ COMMITTED"
            options["pool_recycle"] = 3600
        options.update(self._engine_options)
        engine = create_engine(self.url, **options)
        if backend == "sqlite":
            _make_sqlite_concurrent(engine)
        return engine

    @property
    def probe_engine(self) -> Engine:
        """The engine of :meth:`probe`, beat's statement when nothing is due, and of the
        heartbeat: its own autocommit connection without a pre-ping, so an idle cycle is one
        round trip (not a ping, BEGIN, the query and ROLLBACK), and on SQLite a read that
        takes no write lock."""
        if self._probe_engine is None:
            options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"}
            if hasattr(self.engine.dialect, "skip_autocommit_rollback"):  # SQLAlchemy 2.0.43+
                options["skip_autocommit_rollback"] = True
            backend = self.url.get_backend_name()
            if backend == "sqlite":
                options["connect_args"] = {"timeout": 30}
            elif "poolclass" not in self._engine_options:  # e.g. NullPool behind PgBouncer
                options["pool_size"] = 1
            if backend in ("mysql", "mariadb"):
                options["pool_recycle"] = 3600
            self._probe_engine = create_engine(self.url, **{**self._engine_options, **options})
            if backend == "sqlite":
                _make_sqlite_concurrent(self._probe_engine, immediate=False)
        return self._probe_engine

    def dispose(self, close: bool = True) -> None:
        """Drop pooled connections. After a fork, call with ``close=False`` in the child so
        the parent's connections are abandoned there, never shared."""
        for engine in (self._engine, self._probe_engine):
            if engine is not None:
                engine.dispose(close=close)

    @_translate_errors
    def ensure_schema(self) -> None:
        """On first use (never at import): check that existing tables have every column this
        version reads, and create what is missing (stamping tables it creates with their
        migration). One metadata query per process, plus create_all's checks for beat and
        workers."""
        if self._schema_ready:
            return
        exists = self._check_columns()
        if self.create_tables:
            # Also when the schedules exist: a process creating the tables at this moment may
            # not have created the others yet.
            self._create_tables(stamp=not exists)
        elif not exists:
            raise MissingTables(
                f"no leasebeat tables in {self.safe_url} (prefix {self.table_prefix!r}): start beat once or "
                f"run `leasebeat migrate`"
            )
        self._schema_ready = True

    def missing_columns(self) -> list[str] | None:
        """The schedules columns this version reads that the database lacks; None when the
        table does not exist."""
        schedules = self.tables.schedules
        try:
            present = {c["name"] for c in inspect(self.engine).get_columns(schedules.name, schema=schedules.schema)}
        except NoSuchTableError:
            return None
        return [c.name for c in schedules.columns if c.name not in present]

    def _check_columns(self) -> bool:
        """Whether the tables exist; :class:`OutdatedTables` when they lack a column."""
        missing = self.missing_columns()
        if missing:
            raise OutdatedTables(
                f"the leasebeat tables in {self.safe_url} (prefix {self.table_prefix!r}) were created by an "
                f"older version: {self.tables.schedules.name} lacks {', '.join(missing)}. Run `leasebeat migrate`."
            )
        return missing is not None

    def _create_tables(self, *, stamp: bool) -> None:
        tables = self.tables
        try:
            tables.metadata.create_all(self.engine, checkfirst=True)
        except (IntegrityError, ProgrammingError, OperationalError):
            # Another process created them at the same moment: fine if they exist now.
            tables.metadata.create_all(self.engine, checkfirst=True)
        if not stamp:
            return
        self._check_columns()  # an older version may have created them at the same moment
        try:
            with self.engine.begin() as connection:
                if connection.execute(select(tables.version.c.version_num)).first() is None:
                    connection.execute(tables.version.insert().values(version_num=SCHEMA_REVISION))
        except IntegrityError:
            pass  # another process stamped them at the same moment

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        self.ensure_schema()
        with self.engine.begin() as connection:
            yield connection

    def _schedule_row(self, connection: Connection, name: str, *, lock: bool = False) -> Any:
        """The schedule row *name* (locked for update with *lock*), or :class:`UnknownSchedule`."""
        s = self.tables.schedules
        query = select(s).where(s.c.name == name)
        row = connection.execute(query.with_for_update() if lock else query).one_or_none()
        if row is None:
            raise UnknownSchedule(f"no schedule named {name!r}")
        return row

    def _now(self, connection: Connection) -> datetime:
        value = connection.execute(select(database_now(self.engine))).scalar_one()
        assert isinstance(value, datetime)
        return value

    @_translate_errors
    def now(self) -> datetime:
        """The database's clock, as an aware UTC datetime."""
        with self._transaction() as connection:
            return self._now(connection)

    # -- registrations and operator edits ------------------------------------------------

    @_translate_errors
    def synced_digest(self) -> str | None:
        """The digest (:func:`digest_of`) of the definitions the rows match, as the last sync
        left them; None when they match no replica's or nothing was synced yet."""
        g = self.tables.registrations
        with self._transaction() as connection:
            return connection.execute(select(g.c.digest).where(g.c.source == _CODE)).scalar_one_or_none()

    @_translate_errors
    def sync(
        self,
        definitions: Sequence[ScheduleDefinition],
        *,
        remove_missing: bool = False,
        digest: str | None = None,
    ) -> SyncReport:
        """Upsert *definitions* by name.

        A new schedule gets ``next_run_at`` = its first occurrence after now. A row whose
        effective timing (override, or else the definition's expression) changed is retimed
        from now; a row where only the task, arguments or options changed keeps its
        ``next_run_at``; an unchanged row is not written. With *remove_missing*, rows that
        came from code, are no longer defined and hold no live lease are deleted (their
        ledger stays).

        Syncs take turns (they lock the ``registrations`` row). When the rows already match
        *definitions* (the digest the last sync recorded is theirs, *digest* or computed),
        nothing is read or written and the report says ``skipped``.
        """
        s, g = self.tables.schedules, self.tables.registrations
        digest = digest or digest_of(definitions)
        report = SyncReport()
        first_occurrence: dict[Spec, datetime] = {}  # many schedules share one timing

        def first_after(spec: Spec) -> datetime:
            if spec not in first_occurrence:
                first_occurrence[spec] = spec.next_after(now, previous=now)
            return first_occurrence[spec]

        with self._transaction() as connection:
            now = self._now(connection)
            registration = select(g.c.digest).where(g.c.source == _CODE).with_for_update()
            row = connection.execute(registration).one_or_none()
            if row is None:  # the first sync: create the row (or wait for a racing one's), then lock it
                connection.execute(
                    insert_ignoring_duplicates(self.engine, g),
                    [{"source": _CODE, "digest": None, "schedules": 0, "synced_at": now}],
                )
                row = connection.execute(registration).one()
            # Locked first and inserted only when missing: on InnoDB, INSERT IGNORE of an
            # existing row takes a shared lock, and two syncs upgrading theirs would deadlock.
            if row.digest == digest:
                return SyncReport(skipped=True)
            by_name = {d.name: d for d in definitions}
            # One pass over the table, streamed, compared here: no IN list of every name
            # (drivers bind at most 65,535 parameters, and a planner without statistics on a
            # freshly filled table scans it once per chunk of names).
            changed: list[tuple[str, dict[str, Any]]] = []
            stale: list[str] = []
            in_flight = 0  # rows not defined here that must stay: their run must be able to finish
            seen: set[str] = set()
            compared = [s.c[name] for name in _DEFINITION_COLUMNS]
            rows = connection.execute(select(*compared, s.c.lease_until).execution_options(yield_per=_CHUNK))
            for row in rows:
                definition = by_name.get(row.name)
                if definition is None:
                    if row.origin != _CODE:
                        continue
                    if row.lease_until is None or row.lease_until < now:
                        stale.append(row.name)
                    else:
                        in_flight += 1
                    continue
                seen.add(row.name)
                changes = self._definition_changes(row, definition)
                if not changes:
                    continue
                old_spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron)
                new_spec = definition.spec(row.override_cron)
                if new_spec != old_spec:
                    changes["next_run_at"] = first_after(new_spec)
                    report.retimed.append(row.name)
                else:
                    report.updated.append(row.name)
                changed.append((row.name, changes))
            for name, changes in changed:
                changes.update(updated_at=now, version=s.c.version + 1)
                connection.execute(s.update().where(s.c.name == name).values(**changes))
            report.inserted.extend(name for name in by_name if name not in seen)
            for start in range(0, len(report.inserted), _INSERT_CHUNK):  # built chunk by chunk: bounded memory
                chunk = [by_name[name] for name in report.inserted[start : start + _INSERT_CHUNK]]
                connection.execute(
                    insert_ignoring_duplicates(self.engine, s),
                    [self._definition_values(d, now, first_after(d.spec())) for d in chunk],
                )
            removed = 0
            for start in range(0, len(stale) if remove_missing else 0, _CHUNK):
                removed += connection.execute(
                    delete(s).where(
                        s.c.name.in_(stale[start : start + _CHUNK]),
                        # Claimed since the scan? Its run must be able to finish.
                        or_(s.c.lease_until.is_(None), s.c.lease_until < database_now(self.engine)),
                    )
                ).rowcount
            if remove_missing:
                report.removed.extend(stale)
            connection.execute(
                g.update()
                .where(g.c.source == _CODE)
                .values(
                    # Rows of other definitions left (not removed, or in flight): no digest.
                    digest=digest if removed == len(stale) and not in_flight else None,
                    schedules=len(by_name),
                    synced_at=now,
                )
            )
        return report

    @staticmethod
    def _definition_columns(definition: ScheduleDefinition) -> dict[str, Any]:
        """The columns a definition from code sets; the rest is the schedule's own state."""
        return {
            "task": definition.task,
            "args": list(definition.args),
            "kwargs": dict(definition.kwargs),
            "options": dict(definition.options),
            "kind": definition.kind,
            "cron": definition.cron,
            "interval_seconds": definition.interval_seconds,
            "timezone": definition.timezone,
            "grace_seconds": definition.grace_seconds,
            "max_runtime_seconds": definition.max_runtime_seconds,
            "after_schedule": definition.after,
            "inline_cap": definition.inline_cap,
            "daily_cap": definition.daily_cap,
            "dedupe_seconds": definition.dedupe_seconds,
            "origin": _CODE,
        }

    @classmethod
    def _definition_values(cls, definition: ScheduleDefinition, now: datetime, first: datetime) -> dict[str, Any]:
        return {
            **cls._definition_columns(definition),
            "name": definition.name,
            "override_cron": None,
            "enabled": True,
            "next_run_at": first,
            "attempt": 0,
            "created_at": now,
            "updated_at": now,
            "version": 1,
        }

    @classmethod
    def _definition_changes(cls, row: Any, definition: ScheduleDefinition) -> dict[str, Any]:
        wanted = cls._definition_columns(definition)
        return {key: value for key, value in wanted.items() if getattr(row, key) != value}

    @_translate_errors
    def set_override(self, name: str, cron: str | None) -> datetime:
        """Set (or, with None or blank, clear) the operator's cron override of *name*.

        When the effective expression changes, ``next_run_at`` is recomputed from now, so
        every replica follows it on its next cycle. Returns the row's ``next_run_at``.
        """
        s = self.tables.schedules
        cron = cron.strip() if cron and cron.strip() else None
        with self._transaction() as connection:
            now = self._now(connection)
            row = self._schedule_row(connection, name, lock=True)
            old_spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron)
            new_spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, cron)
            if cron is not None:
                new_spec.validate(schedule=name)
            values: dict[str, Any] = {"override_cron": cron, "updated_at": now, "version": s.c.version + 1}
            next_run_at: datetime = row.next_run_at
            if new_spec != old_spec:
                next_run_at = values["next_run_at"] = new_spec.next_after(now, previous=now)
            connection.execute(s.update().where(s.c.name == name).values(**values))
            return next_run_at

    @_translate_errors
    def set_enabled(self, name: str, enabled: bool) -> None:
        """Pause (False) or resume (True) a schedule."""
        s = self.tables.schedules
        with self._transaction() as connection:
            now = self._now(connection)
            result = connection.execute(
                s.update().where(s.c.name == name).values(enabled=enabled, updated_at=now, version=s.c.version + 1)
            )
            if result.rowcount == 0:
                raise UnknownSchedule(f"no schedule named {name!r}")

    # -- the beat cycle ------------------------------------------------------------------

    def _due(self, now: datetime) -> Any:
        s = self.tables.schedules
        return and_(
            s.c.enabled.is_(True),
            s.c.next_run_at <= now,
            or_(s.c.lease_until.is_(None), s.c.lease_until < now),
        )

    @_translate_errors
    def probe(self) -> Probe:
        """Read the clock, the earliest unleased ``next_run_at``, the earliest lease expiry
        and the earliest ``following_at`` of a live lease in one statement, each answered
        from an index."""
        s = self.tables.schedules
        self.ensure_schema()
        now = database_now(self.engine)
        next_due = (
            select(s.c.next_run_at)
            .where(s.c.enabled.is_(True), or_(s.c.lease_until.is_(None), s.c.lease_until < now))
            .order_by(s.c.next_run_at)
            .limit(1)
            .scalar_subquery()
        )
        next_expiry = (
            select(s.c.lease_until).where(s.c.lease_until >= now).order_by(s.c.lease_until).limit(1).scalar_subquery()
        )
        # Live leases only: following_at is cleared with the lease, so this walks the rows in flight.
        next_following = (
            select(s.c.following_at)
            .where(s.c.following_at > now, s.c.lease_until >= now)
            .order_by(s.c.following_at)
            .limit(1)
            .scalar_subquery()
        )
        query = select(
            now.label("now"),
            next_due.label("next_due"),
            next_expiry.label("next_expiry"),
            next_following.label("next_following"),
        )
        try:
            with self.probe_engine.connect() as connection:
                row = connection.execute(query).one()
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            # Without a pre-ping, a connection the server dropped (restart, idle timeout) is
            # found here: it was discarded, so try once more on a fresh one.
            with self.probe_engine.connect() as connection:
                row = connection.execute(query).one()
        return Probe(now=row.now, next_due=row.next_due, next_expiry=row.next_expiry, next_following=row.next_following)

    @_translate_errors
    def claim(
        self,
        now: datetime,
        *,
        limit: int,
        lease_seconds: float,
        owner: str,
        names: Sequence[str] | None = None,
        source: str = "schedule",
        dedupe_key: str | None = None,
    ) -> list[ClaimedRun]:
        """Lease up to *limit* occurrences due at *now* (the cycle's database clock) and
        write their ledger rows; return them earliest first. *names* restricts the claim to
        those schedules (a manual trigger). The lease lasts *lease_seconds* once
        :meth:`mark_dispatched` confirms the publish, ``publish_lease_seconds`` until then."""
        s, r = self.tables.schedules, self.tables.runs
        token = uuid.uuid4().hex
        lease_until = now + timedelta(seconds=lease_seconds)
        values = [
            # First: it reads the lease_token this statement overwrites.
            ("attempt", case((s.c.lease_token.is_(None), 1), else_=s.c.attempt + 1)),
            ("lease_token", token),
            ("lease_until", now + timedelta(seconds=min(lease_seconds, self.publish_lease_seconds))),
            ("lease_owner", owner),
            ("following_at", None),  # set once published
        ]
        with self._transaction() as connection:
            due = self._due(now) if names is None else and_(self._due(now), s.c.name.in_(list(names)))
            result = connection.execute(claim_statement(self.engine, s, due, values, limit))
            if not result.rowcount:
                return []
            rows = connection.execute(
                select(*(s.c[name] for name in _CLAIM_COLUMNS))
                .where(s.c.lease_token == token)
                .order_by(s.c.next_run_at)
            ).all()
            claims = []
            for row in rows:
                spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron)
                claims.append(
                    ClaimedRun(
                        schedule=row.name,
                        occurrence=row.next_run_at,
                        run_id=run_id_for(row.name, row.next_run_at),
                        lease_token=token,
                        lease_until=lease_until,
                        attempt=row.attempt,
                        task=row.task,
                        args=list(row.args or []),
                        kwargs=dict(row.kwargs or {}),
                        options=dict(row.options or {}),
                        spec=spec,
                        following=following_occurrence(spec, row.next_run_at, now),
                        grace_seconds=row.grace_seconds,
                        after=row.after_schedule,
                        inline_cap=row.inline_cap,
                    )
                )
            ledger = [
                {
                    "id": claim.run_id,
                    "schedule": claim.schedule,
                    "occurrence": claim.occurrence,
                    "state": RunState.CLAIMED,
                    "attempts": claim.attempt,
                    "lease_token": token,
                    "replica": owner,
                    "claimed_at": now,
                    "dispatched_at": None,
                    "started_at": None,
                    "worker": None,
                    "retries": None,
                    "error": None,
                    "missed_count": 0,
                    "source": "after" if claim.after else source,
                    "dedupe_key": dedupe_key,
                }
                for claim in claims
            ]
            connection.execute(
                upsert(
                    self.engine,
                    r,
                    [
                        "state",
                        "attempts",
                        "lease_token",
                        "replica",
                        "claimed_at",
                        "dispatched_at",
                        "started_at",
                        "worker",
                        "retries",
                        "error",
                    ],
                ),
                ledger,
            )
        return claims

    @_translate_errors
    def mark_dispatched(self, published: Sequence[ClaimedRun]) -> None:
        """Stamp the publish time on the runs of *published* (claims of one batch), extend
        their leases from the publish lease to the full lease and record when each schedule
        is due again (all fenced by the claim's token)."""
        if not published:
            return
        s, r = self.tables.schedules, self.tables.runs
        token, run_ids = published[0].lease_token, [claim.run_id for claim in published]
        by_following: dict[datetime, list[str]] = {}
        for claim in published:
            by_following.setdefault(claim.following, []).append(claim.schedule)
        if len(by_following) == 1:  # the common case: a burst of one expression, or one schedule
            following: Any = published[0].following
        else:  # CASE results are untyped: bind them as the column's type (UTC, naive)
            following = case(*((s.c.name.in_(names), _instant(at)) for at, names in by_following.items()))
        with self._transaction() as connection:
            now = database_now(self.engine)
            connection.execute(
                s.update()
                .where(s.c.lease_token == token, s.c.name.in_([claim.schedule for claim in published]))
                .values(
                    # A worker that started the run may have extended the lease already.
                    lease_until=case(
                        (s.c.lease_until < published[0].lease_until, _instant(published[0].lease_until)),
                        else_=s.c.lease_until,
                    ),
                    following_at=following,
                )
            )
            connection.execute(
                r.update()
                .where(r.c.lease_token == token, r.c.id.in_(list(run_ids)))
                .values(
                    dispatched_at=now,
                    state=case((r.c.state == RunState.CLAIMED, RunState.DISPATCHED), else_=r.c.state),
                )
            )

    @_translate_errors
    def release(self, claims: Sequence[ClaimedRun], error: str) -> int:
        """Give the leases of unpublished *claims* back at once, so the occurrences are
        claimed again on the next cycle; returns how many leases were still held."""
        if not claims:
            return 0
        s, r = self.tables.schedules, self.tables.runs
        released = 0
        with self._transaction() as connection:
            for token, group in _by_token(claims).items():
                result = connection.execute(
                    s.update()
                    .where(s.c.lease_token == token, s.c.name.in_([c.schedule for c in group]))
                    .values(lease_token=None, lease_until=None, lease_owner=None, following_at=None)
                )
                released += result.rowcount
                connection.execute(
                    r.update()
                    .where(r.c.lease_token == token, r.c.id.in_([c.run_id for c in group]))
                    .values(state=RunState.PUBLISH_FAILED, error=error)
                )
        return released

    @_translate_errors
    def give_up(self, claim: ClaimedRun, now: datetime, reason: str, outcome: str = RunState.LOST) -> Finished:
        """Record an occurrence that will not run (lost, or failed to publish) and advance
        its schedule past it (fenced)."""
        next_run_at, missed = advance(claim.spec, claim.occurrence, now)
        s, r = self.tables.schedules, self.tables.runs
        with self._transaction() as connection:
            applied = connection.execute(
                s.update()
                .where(s.c.name == claim.schedule, s.c.lease_token == claim.lease_token)
                .values(
                    next_run_at=next_run_at,
                    last_run_at=claim.occurrence,
                    last_outcome=outcome,
                    last_error=reason,
                    last_duration_ms=None,
                    lease_token=None,
                    lease_until=None,
                    lease_owner=None,
                    following_at=None,
                    attempt=0,
                    updated_at=now,
                    version=s.c.version + 1,
                )
            ).rowcount
            connection.execute(
                r.update()
                .where(r.c.id == claim.run_id, r.c.lease_token == claim.lease_token)
                .values(state=outcome, error=reason, finished_at=now, missed_count=missed)
            )
        if not applied:
            logger.warning("leasebeat: stale give-up of %s@%s ignored", claim.schedule, claim.occurrence.isoformat())
        return Finished(applied=bool(applied), missed=missed, next_run_at=next_run_at)

    @_translate_errors
    def still_leased(self, leases: Iterable[tuple[str, str]]) -> set[str]:
        """Return the names among *(name, token)* pairs whose lease that token still holds."""
        wanted = dict(leases)
        if not wanted:
            return set()
        s = self.tables.schedules
        with self.engine.connect() as connection:
            rows = connection.execute(select(s.c.name, s.c.lease_token).where(s.c.name.in_(list(wanted)))).all()
        return {row.name for row in rows if row.lease_token == wanted[row.name]}

    # -- the worker side -----------------------------------------------------------------

    @_translate_errors
    def start_run(
        self, *, schedule: str, run_id: str, token: str, worker: str, lease_seconds: float, retries: int = 0
    ) -> StartDecision:
        """Mark a delivered occurrence started, extending its lease, if this delivery may
        run: its token must still hold the lease (else a newer claim owns the occurrence),
        the run must not have finished, and no delivery with the same Celery retry count may
        have started it (else this is a redelivery; a task's own retry counts higher)."""
        s, r = self.tables.schedules, self.tables.runs
        with self._transaction() as connection:
            now = self._now(connection)
            held = connection.execute(
                s.update()
                .where(s.c.name == schedule, s.c.lease_token == token)
                .values(lease_until=now + timedelta(seconds=lease_seconds))
            ).rowcount
            started = 0
            if held:
                started = connection.execute(
                    r.update()
                    .where(
                        r.c.id == run_id,
                        r.c.lease_token == token,
                        r.c.state.in_([*RunState.STARTABLE, RunState.STARTED]),
                        or_(r.c.retries.is_(None), r.c.retries < retries),
                    )
                    .values(state=RunState.STARTED, started_at=now, worker=worker, retries=retries)
                ).rowcount
            if started:
                return StartDecision(run=True)
            state = connection.execute(select(r.c.state).where(r.c.id == run_id)).scalar_one_or_none()
            known = held or connection.execute(select(s.c.name).where(s.c.name == schedule)).first() is not None
        if not known:
            return StartDecision(
                run=False,
                reason=f"schedule {schedule!r} is not in {self.safe_url}: the worker must use the same "
                f"leasebeat_database_url (and table prefix) as beat",
            )
        if not held and state in RunState.OUTCOMES:
            return StartDecision(run=False, reason=f"the occurrence already finished (state {state})", state=state)
        if not held:
            return StartDecision(run=False, reason="its lease token no longer holds the lease", state=state)
        return StartDecision(run=False, reason=f"this delivery already ran (state {state})", state=state)

    @_translate_errors
    def extend_leases(self, leases: Iterable[tuple[str, str]], lease_seconds: float) -> set[str]:
        """Push out the leases of running occurrences; return the names whose lease is lost."""
        s = self.tables.schedules
        lost: set[str] = set()
        leases = list(leases)
        if not leases:
            return lost
        with self._transaction() as connection:
            until = self._now(connection) + timedelta(seconds=lease_seconds)
            for name, token in leases:
                result = connection.execute(
                    s.update().where(s.c.name == name, s.c.lease_token == token).values(lease_until=until)
                )
                if not result.rowcount:
                    lost.add(name)
        return lost

    @_translate_errors
    def finish_run(
        self,
        *,
        schedule: str,
        run_id: str,
        token: str,
        occurrence: datetime,
        outcome: str,
        duration_ms: int,
        error: str | None = None,
        result: str | None = None,
    ) -> Finished:
        """Record the outcome of a run, advance the schedule to its next occurrence and
        release the lease, all fenced by *token*. Occurrences that elapsed while the run
        was in flight (or while nothing ran) are dropped and counted on the ledger row.

        Schedules that run after this one are released for the same window when it
        succeeded, and recorded skipped with the reason when it did not."""
        s, r = self.tables.schedules, self.tables.runs
        with self._transaction() as connection:
            now = self._now(connection)
            row = connection.execute(
                select(
                    s.c.kind,
                    s.c.cron,
                    s.c.interval_seconds,
                    s.c.timezone,
                    s.c.override_cron,
                    s.c.next_run_at,
                    s.c.max_runtime_seconds,
                ).where(s.c.name == schedule, s.c.lease_token == token)
            ).one_or_none()
            if row is None:
                logger.warning(
                    "leasebeat: stale outcome %s of %s@%s ignored: its lease token no longer holds the lease",
                    outcome,
                    schedule,
                    occurrence.isoformat(),
                )
                return Finished(applied=False)
            spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron)
            next_run_at, missed = advance(spec, occurrence, now)
            if row.kind == "triggered" and row.next_run_at > occurrence:
                next_run_at = row.next_run_at  # a newer window was released while this one ran
            overran = row.max_runtime_seconds is not None and duration_ms / 1000 > row.max_runtime_seconds
            connection.execute(
                s.update()
                .where(s.c.name == schedule, s.c.lease_token == token)
                .values(
                    next_run_at=next_run_at,
                    last_run_at=occurrence,
                    last_outcome=outcome,
                    last_duration_ms=duration_ms,
                    last_error=error,
                    lease_token=None,
                    lease_until=None,
                    lease_owner=None,
                    following_at=None,
                    attempt=0,
                    updated_at=now,
                    version=s.c.version + 1,
                )
            )
            connection.execute(
                r.update()
                .where(r.c.id == run_id, r.c.lease_token == token)
                .values(
                    state=outcome,
                    finished_at=now,
                    duration_ms=duration_ms,
                    error=error,
                    missed_count=missed,
                    result=result,
                    **({"alert": _appended_alert(r, row.max_runtime_seconds, duration_ms)} if overran else {}),
                )
            )
            self._follow_up(connection, schedule, occurrence, outcome, now)
        if missed:
            logger.warning(
                "leasebeat: schedule %s dropped %s%d occurrence(s) that elapsed before its "
                "run of %s finished; next run %s",
                schedule,
                "at least " if missed >= MAX_MISSED_COUNT else "",
                missed,
                occurrence.isoformat(),
                next_run_at.isoformat(),
            )
        return Finished(applied=True, missed=missed, next_run_at=next_run_at, schedule=schedule)

    def _follow_up(self, connection: Connection, upstream: str, window: datetime, outcome: str, now: datetime) -> None:
        """Release the schedules that run after *upstream* for *window*, or record why not."""
        s, r = self.tables.schedules, self.tables.runs
        if outcome == RunState.SUCCEEDED:
            connection.execute(
                s.update()
                .where(s.c.after_schedule == upstream, s.c.enabled.is_(True))
                .values(next_run_at=window, updated_at=now)
            )
            return
        downstream = connection.execute(select(s.c.name).where(s.c.after_schedule == upstream)).scalars().all()
        if downstream:
            connection.execute(
                insert_ignoring_duplicates(self.engine, r),
                [
                    {
                        "id": run_id_for(name, window),
                        "schedule": name,
                        "occurrence": window,
                        "state": RunState.SKIPPED,
                        "attempts": 0,
                        "claimed_at": now,
                        "finished_at": now,
                        "error": f"not started: upstream {upstream!r} {outcome} for this window",
                        "missed_count": 0,
                        "source": "after",
                    }
                    for name in downstream
                ],
            )

    @_translate_errors
    def hold_lease(self, *, schedule: str, token: str, seconds: float) -> bool:
        """Keep a lease for *seconds* from now while no process runs the occurrence (the
        task asked Celery to retry it later: the retried message carries the same token)."""
        s = self.tables.schedules
        with self._transaction() as connection:
            until = self._now(connection) + timedelta(seconds=seconds)
            return bool(
                connection.execute(
                    s.update().where(s.c.name == schedule, s.c.lease_token == token).values(lease_until=until)
                ).rowcount
            )

    @_translate_errors
    def fail_run(self, *, run_id: str, error: str, token: str | None = None, worker: str | None = None) -> Finished:
        """Record a started run as failed when its process died under it. The dying delivery
        is identified by its lease *token* when known, else by the *worker* that started it:
        a newer claim of the same occurrence (same run id) is never touched."""
        r = self.tables.runs
        query = select(r.c.schedule, r.c.occurrence, r.c.lease_token, r.c.started_at).where(
            r.c.id == run_id, r.c.state == RunState.STARTED
        )
        if token is not None:
            query = query.where(r.c.lease_token == token)
        elif worker is not None:
            query = query.where(r.c.worker == worker)
        else:
            raise ValueError("fail_run needs the token or the worker of the dying delivery")
        with self._transaction() as connection:
            row = connection.execute(query).one_or_none()
            if row is None:
                return Finished(applied=False)
            now = self._now(connection)
        duration_ms = int((now - row.started_at).total_seconds() * 1000) if row.started_at else 0
        return self.finish_run(
            schedule=row.schedule,
            run_id=run_id,
            token=row.lease_token,
            occurrence=row.occurrence,
            outcome=RunState.FAILED,
            duration_ms=duration_ms,
            error=error,
        )

    # -- reads ---------------------------------------------------------------------------

    @_translate_errors
    def get_schedule(self, name: str) -> dict[str, Any]:
        with self._transaction() as connection:
            return dict(self._schedule_row(connection, name)._mapping)

    @_translate_errors
    def list_schedules(self) -> list[dict[str, Any]]:
        s = self.tables.schedules
        with self._transaction() as connection:
            return [dict(row._mapping) for row in connection.execute(select(s).order_by(s.c.name))]

    @_translate_errors
    def list_runs(
        self,
        schedule: str | None = None,
        *,
        since: datetime | None = None,
        states: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Ledger rows, oldest occurrence first; with *limit*, the newest *limit* of them."""
        r = self.tables.runs
        query = select(r)
        if schedule is not None:
            query = query.where(r.c.schedule == schedule)
        if since is not None:
            query = query.where(r.c.occurrence >= since)
        if states:
            query = query.where(r.c.state.in_(list(states)))
        if limit is not None:
            query = query.order_by(r.c.occurrence.desc(), r.c.schedule).limit(limit)
        else:
            query = query.order_by(r.c.occurrence, r.c.schedule)
        with self._transaction() as connection:
            rows = [dict(row._mapping) for row in connection.execute(query)]
        return rows[::-1] if limit is not None else rows

    # -- operators -----------------------------------------------------------------------

    @_translate_errors
    def make_due(self, name: str) -> tuple[datetime, datetime | None]:
        """Make schedule *name* due now (a manual trigger), unless a run holds its lease
        (even an expired one: beat claims that occurrence again first).

        Returns (now, lease_until): ``lease_until`` is None when the schedule was made due,
        else the expiry of the lease that prevented it. A paused schedule raises
        :class:`SchedulePaused`.
        """
        s = self.tables.schedules
        with self._transaction() as connection:
            now = self._now(connection)
            row = self._schedule_row(connection, name)
            if not row.enabled:
                raise SchedulePaused(f"schedule {name!r} is paused: resume it first")
            changed = connection.execute(
                s.update().where(s.c.name == name, s.c.lease_token.is_(None)).values(next_run_at=now, updated_at=now)
            ).rowcount
        return now, None if changed else row.lease_until

    @_translate_errors
    def resume(self, name: str, *, skip_missed: bool = False) -> datetime:
        """Enable a paused schedule. An occurrence missed while paused runs once, at once;
        with *skip_missed* it is dropped and the schedule waits for its next occurrence."""
        s = self.tables.schedules
        with self._transaction() as connection:
            now = self._now(connection)
            row = self._schedule_row(connection, name)
            next_run_at: datetime = row.next_run_at
            if next_run_at <= now:
                if skip_missed:
                    spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron)
                    next_run_at = spec.next_after(now, previous=next_run_at)
                else:
                    next_run_at = now  # run it now: an operator's resume is not a late claim
            connection.execute(
                s.update()
                .where(s.c.name == name)
                .values(enabled=True, next_run_at=next_run_at, updated_at=now, version=s.c.version + 1)
            )
        return next_run_at

    @_translate_errors
    def flag_overdue(self) -> list[tuple[dict[str, Any], str]]:
        """Missed-run detection for runs in flight: flag those dispatched but not started
        within their schedule's grace, and those running past its maximum runtime. Each run
        is flagged once (its ``alert`` records why); returns the newly flagged with reasons."""
        s, r = self.tables.schedules, self.tables.runs
        query = (
            select(r, s.c.grace_seconds, s.c.max_runtime_seconds)
            .join(s, s.c.name == r.c.schedule)
            .where(
                or_(
                    and_(r.c.state.in_([RunState.CLAIMED, RunState.DISPATCHED]), r.c.alert.is_(None)),
                    # A run flagged for its late start may still overrun: flagged once more.
                    and_(r.c.state == RunState.STARTED, or_(r.c.alert.is_(None), r.c.alert.not_like("%runtime%"))),
                ),
                or_(s.c.grace_seconds.is_not(None), s.c.max_runtime_seconds.is_not(None)),
            )
        )
        flagged: list[tuple[dict[str, Any], str]] = []
        with self._transaction() as connection:
            now = self._now(connection)
            for row in connection.execute(query).all():
                reason = _overdue_reason(row, now)
                if reason is None:
                    continue
                alert = f"{row.alert}; {reason}" if row.alert else reason
                written = connection.execute(
                    r.update()
                    .where(r.c.id == row.id, r.c.alert.is_(None) if row.alert is None else r.c.alert == row.alert)
                    .values(alert=alert)
                ).rowcount
                if written:  # another replica may have flagged it a moment ago
                    flagged.append((dict(row._mapping), reason))
        return flagged

    @_translate_errors
    def purge_runs(self, retention: timedelta, *, limit: int) -> int:
        """Delete at most *limit* ledger rows that finished more than *retention* ago, oldest
        first; return how many. Capped so a backlog drains over several short runs, and
        harmless to run twice."""
        r = self.tables.runs
        with self._transaction() as connection:
            cutoff = self._now(connection) - retention
            ids = (
                connection.execute(
                    select(r.c.id).where(r.c.finished_at < cutoff).order_by(r.c.finished_at).limit(limit)
                )
                .scalars()
                .all()
            )
            deleted = 0
            for start in range(0, len(ids), _CHUNK):
                deleted += connection.execute(
                    delete(r).where(r.c.id.in_(ids[start : start + _CHUNK]), r.c.finished_at < cutoff)
                ).rowcount
        return deleted

    @_translate_errors
    def attention(self, since: datetime) -> dict[str, tuple[int, str]]:
        """Per schedule, the runs since *since* that missed-run detection flagged or recorded
        missed or lost: how many, and the latest reason."""
        r = self.tables.runs
        query = (
            select(r.c.schedule, r.c.alert, r.c.error, r.c.state)
            .where(
                r.c.occurrence >= since,
                or_(r.c.alert.is_not(None), r.c.state.in_([RunState.MISSED, RunState.LOST])),
            )
            .order_by(r.c.occurrence)
        )
        found: dict[str, tuple[int, str]] = {}
        with self._transaction() as connection:
            for row in connection.execute(query):
                count = found.get(row.schedule, (0, ""))[0]
                found[row.schedule] = (count + 1, row.alert or f"{row.state}: {row.error}")
        return found

    # -- triggered runs (HTTP API) ---------------------------------------------------------

    @_translate_errors
    def begin_trigger(
        self, name: str, *, dedupe_key: str | None = None, overall_daily_cap: int | None = None, source: str = "api"
    ) -> tuple[datetime, str | None]:
        """Prepare a triggered run of *name*: returns (now, the id of an existing job it
        collapses into) or (now, None) after making the schedule due now, to be claimed.

        A trigger collapses into the job created with the same *dedupe_key*, into the last
        job of the schedule's dedupe window, and into the run in flight (one run per schedule
        at a time). A new run beyond a daily cap (the schedule's, or *overall_daily_cap* over
        all triggered runs of *source*) raises :class:`SpendCapExceeded`.
        """
        s = self.tables.schedules
        with self._transaction() as connection:
            now = self._now(connection)
            row = self._schedule_row(connection, name)
            existing = self._existing_job(connection, row, now, dedupe_key)
            if existing is not None:
                return now, existing
            if not row.enabled:
                raise SchedulePaused(f"schedule {name!r} is paused")
            self._check_caps(connection, row, now, overall_daily_cap, source)
            connection.execute(
                s.update().where(s.c.name == name, s.c.lease_token.is_(None)).values(next_run_at=now, updated_at=now)
            )
        return now, None

    @_translate_errors
    def existing_job(self, name: str, dedupe_key: str | None = None) -> str | None:
        """The job a trigger of *name* collapses into right now, if any."""
        with self._transaction() as connection:
            now = self._now(connection)
            row = self._schedule_row(connection, name)
            return self._existing_job(connection, row, now, dedupe_key)

    def _existing_job(self, connection: Connection, row: Any, now: datetime, dedupe_key: str | None) -> str | None:
        r = self.tables.runs
        if dedupe_key is not None:
            found = connection.execute(select(r.c.id).where(r.c.dedupe_key == dedupe_key)).scalar_one_or_none()
            if found is not None:
                return str(found)
        if row.dedupe_seconds:
            found = connection.execute(
                select(r.c.id)
                .where(r.c.schedule == row.name, r.c.claimed_at >= now - timedelta(seconds=row.dedupe_seconds))
                .order_by(r.c.claimed_at.desc())
                .limit(1)
            ).scalar_one_or_none()
            if found is not None:
                return str(found)
        if row.lease_token is not None and row.lease_until is not None and row.lease_until >= now:
            found = connection.execute(
                select(r.c.id).where(r.c.schedule == row.name, r.c.lease_token == row.lease_token)
            ).scalar_one_or_none()
            if found is not None:
                return str(found)
        return None

    def _check_caps(self, connection: Connection, row: Any, now: datetime, overall: int | None, source: str) -> None:
        r = self.tables.runs
        day = now.replace(hour=0, minute=0, second=0, microsecond=0)
        retry_after = max(1, int((day + timedelta(days=1) - now).total_seconds()) + 1)
        today = select(func.count()).select_from(r).where(r.c.source == source, r.c.claimed_at >= day)
        if row.daily_cap is not None:
            used = connection.execute(today.where(r.c.schedule == row.name)).scalar_one()
            if used >= row.daily_cap:
                raise SpendCapExceeded(
                    f"schedule {row.name!r} reached its daily cap of {row.daily_cap} triggered runs",
                    retry_after=retry_after,
                    scope="job_type",
                )
        if overall is not None:
            used = connection.execute(today).scalar_one()
            if used >= overall:
                raise SpendCapExceeded(
                    f"the daily cap of {overall} triggered runs is reached", retry_after=retry_after, scope="overall"
                )

    @_translate_errors
    def get_run(self, run_id: str) -> dict[str, Any]:
        r = self.tables.runs
        with self._transaction() as connection:
            row = connection.execute(select(r).where(r.c.id == run_id)).one_or_none()
        if row is None:
            raise UnknownJob(f"no job with id {run_id!r}")
        return dict(row._mapping)

    # -- beat replicas ---------------------------------------------------------------------

    @_translate_errors
    def heartbeat_replica(self, *, name: str, host: str, pid: int, version: str, claims: int) -> None:
        """Record that beat replica *name* completed a cycle (and its claims so far): one
        autocommit UPDATE, and an INSERT the first time."""
        p = self.tables.replicas
        self.ensure_schema()
        with self.probe_engine.connect() as refresh:
            updated = refresh.execute(
                p.update().where(p.c.name == name).values(last_cycle_at=database_now(self.engine), claims=claims)
            ).rowcount
        if updated:
            return
        with self._transaction() as connection:
            now = self._now(connection)
            row = dict(name=name, host=host, pid=pid, version=version, started_at=now, last_cycle_at=now, claims=claims)
            connection.execute(insert_ignoring_duplicates(self.engine, p), [row])

    @_translate_errors
    def remove_replica(self, name: str) -> None:
        p = self.tables.replicas
        with self._transaction() as connection:
            connection.execute(delete(p).where(p.c.name == name))

    @_translate_errors
    def list_replicas(self) -> tuple[datetime, list[dict[str, Any]]]:
        """The database clock and every replica row, most recently active first."""
        p = self.tables.replicas
        with self._transaction() as connection:
            now = self._now(connection)
            rows = connection.execute(select(p).order_by(p.c.last_cycle_at.desc())).all()
        return now, [dict(row._mapping) for row in rows]


def digest_of(definitions: Iterable[ScheduleDefinition]) -> str:
    """A digest of what :meth:`Store.sync` writes for *definitions*: equal digests, equal
    rows. Independent of their order; a few microseconds per definition."""
    lines = sorted(repr((d.name, *Store._definition_columns(d).values())) for d in definitions)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


@functools.lru_cache(maxsize=4096)
def following_occurrence(spec: Spec, occurrence: datetime, now: datetime) -> datetime:
    """When a schedule whose *occurrence* is dispatched at *now* is due again: the next
    occurrence after it (after now, when catching up). Cached: a burst of one expression
    at one occurrence computes it once."""
    return spec.next_after(max(occurrence, now), previous=occurrence)


def advance(spec: Spec, occurrence: datetime, now: datetime) -> tuple[datetime, int]:
    """The occurrence after *occurrence*, or, when that has already elapsed, the first one
    after *now* with the count of elapsed ones dropped (run once, then advance)."""
    following = spec.next_after(occurrence, previous=occurrence)
    if following > now:
        return following, 0
    missed = occurrences_between(spec, occurrence, now, MAX_MISSED_COUNT)
    return spec.next_after(now, previous=occurrence), missed


def _instant(value: datetime) -> Any:
    """*value* bound as a UTCDateTime where SQLAlchemy cannot infer it (a CASE result):
    otherwise an aware datetime reaches PostgreSQL as timestamptz and is shifted into the
    session's zone when stored."""
    return literal(value, UTCDateTime())


def _appended_alert(runs: Any, limit: float, duration_ms: int) -> Any:
    """The ledger's alert with an overrun noted, unless beat already flagged the overrun."""
    reason = f"ran {duration_ms / 1000:.0f}s, past its maximum runtime of {limit:g}s"
    return case(
        (runs.c.alert.is_(None), reason),
        (runs.c.alert.like("%runtime%"), runs.c.alert),
        else_=runs.c.alert + "; " + reason,
    )


def _overdue_reason(run: Any, now: datetime) -> str | None:
    if run.state == RunState.STARTED:
        if run.max_runtime_seconds is not None and run.started_at is not None:
            running = (now - run.started_at).total_seconds()
            if running > run.max_runtime_seconds:
                return f"running for {running:.0f}s, past its maximum runtime of {run.max_runtime_seconds:g}s"
        return None
    if run.grace_seconds is not None:
        waiting = (now - (run.dispatched_at or run.claimed_at or run.occurrence)).total_seconds()
        if waiting > run.grace_seconds:
            return f"dispatched {waiting:.0f}s ago and not started within its grace of {run.grace_seconds:g}s"
    return None


def _by_token(claims: Sequence[ClaimedRun]) -> dict[str, list[ClaimedRun]]:
    groups: dict[str, list[ClaimedRun]] = {}
    for claim in claims:
        groups.setdefault(claim.lease_token, []).append(claim)
    return groups


def _make_sqlite_concurrent(engine: Engine, *, immediate: bool = True) -> None:
    """Several beat replicas and a worker share one SQLite file: WAL lets readers run
    beside the writer, and BEGIN IMMEDIATE (with *immediate*) takes the write lock up front
    so two transactions never deadlock upgrading a read lock."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    if immediate:

        @event.listens_for(engine, "begin")
        def _on_begin(connection: Connection) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")


# InnoDB's deadlock (1213) and lock-wait timeout (1205); PostgreSQL's deadlock_detected.
_MYSQL_CONFLICTS = (1205, 1213)
_POSTGRES_CONFLICTS = ("40P01",)


def _is_deadlock(exc: DBAPIError) -> bool:
    original = exc.orig
    if getattr(original, "sqlstate", None) in _POSTGRES_CONFLICTS:
        return True
    args: tuple[Any, ...] = getattr(original, "args", ())
    return bool(args) and args[0] in _MYSQL_CONFLICTS


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
