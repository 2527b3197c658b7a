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
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, and_, case, create_engine, delete, event, or_, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError, ProgrammingError

from ..errors import DatabaseUnavailable, UnknownSchedule
from ..timing import Spec, occurrences_between
from .dialects import (
    claim_statement,
    database_now,
    insert_ignoring_duplicates,
    upsert,
)
from .records import (
    ClaimedRun,
    Probe,
    RunState,
    ScheduleDefinition,
    StartDecision,
    SyncReport,
    run_id_for,
    spec_for,
)
from .tables import Tables, build_tables

__all__ = [
    "ClaimedRun",
    "Probe",
    "RunState",
    "ScheduleDefinition",
    "StartDecision",
    "Store",
    "SyncReport",
    "run_id_for",
    "spec_for",
]

logger = logging.getLogger("celery_leasebeat.store")

# Counting dropped occurrences walks the schedule; past this many, the count is a floor.
MAX_MISSED_COUNT = 10_000
# Rows per IN-list when reading registrations back: well inside every backend's limits.
_CHUNK = 500
_SUPPORTED = ("postgresql", "mysql", "mariadb", "sqlite")

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
        self._schema_ready = False

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

    def dispose(self, close: bool = True) -> None:
        """Drop pooled connections. After a fork, call with ``close=False`` in the child so
        the parent's connections are abandoned there, never shared."""
        if self._engine is not None:
            self._engine.dispose(close=close)

    @_translate_errors
    def ensure_schema(self) -> None:
        """Create the tables if they do not exist (first use, never at import)."""
        if self._schema_ready:
            return
        try:
            self.tables.metadata.create_all(self.engine, checkfirst=True)
        except (IntegrityError, ProgrammingError, OperationalError):
            # Another process created them at the same moment: fine if they exist now.
            self.tables.metadata.create_all(self.engine, checkfirst=True)
        self._schema_ready = True

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        self.ensure_schema()
        with self.engine.begin() as connection:
            yield connection

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
    def sync(self, definitions: Sequence[ScheduleDefinition], *, remove_missing: bool = False) -> SyncReport:
        """Upsert *definitions* by name.

        A new schedule gets ``next_run_at`` = its first occurrence after now. A row whose
        effective timing (override, or else the definition's expression) changed is retimed
        from now; a row where only the task, arguments or options changed keeps its
        ``next_run_at``; an unchanged row is not written. With *remove_missing*, rows that
        came from code and are no longer defined are deleted (their ledger stays).
        """
        s = self.tables.schedules
        report = SyncReport()
        by_name = {d.name: d for d in definitions}
        with self._transaction() as connection:
            now = self._now(connection)
            existing: dict[str, Any] = {}
            names = list(by_name)
            for start in range(0, len(names), _CHUNK):
                chunk = names[start : start + _CHUNK]
                for row in connection.execute(select(s).where(s.c.name.in_(chunk))):
                    existing[row.name] = row
            new_rows: list[dict[str, Any]] = []
            for name, definition in by_name.items():
                if name not in existing:
                    new_rows.append(self._definition_values(definition, now, origin=True))
                    report.inserted.append(name)
                    continue
                row = existing[name]
                changes = self._definition_changes(row, definition)
                if not changes:
                    continue
                old_spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron)
                new_spec = definition.spec(row.override_cron)
                if new_spec != old_spec:
                    changes["next_run_at"] = new_spec.next_after(now, previous=now)
                    report.retimed.append(name)
                else:
                    report.updated.append(name)
                changes.update(updated_at=now, version=s.c.version + 1)
                connection.execute(s.update().where(s.c.name == name).values(**changes))
            if new_rows:
                connection.execute(insert_ignoring_duplicates(self.engine, s), new_rows)
            if remove_missing:
                stale = (
                    connection.execute(
                        select(s.c.name).where(s.c.origin == "code", s.c.name.not_in(names))
                        if names
                        else select(s.c.name).where(s.c.origin == "code")
                    )
                    .scalars()
                    .all()
                )
                if stale:
                    connection.execute(delete(s).where(s.c.name.in_(stale)))
                    report.removed.extend(stale)
        return report

    @staticmethod
    def _definition_values(definition: ScheduleDefinition, now: datetime, *, origin: bool) -> dict[str, Any]:
        spec = definition.spec()
        return {
            "name": definition.name,
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
            "override_cron": None,
            "enabled": True,
            "origin": "code" if origin else "api",
            "next_run_at": spec.next_after(now, previous=now),
            "attempt": 0,
            "created_at": now,
            "updated_at": now,
            "version": 1,
        }

    @staticmethod
    def _definition_changes(row: Any, definition: ScheduleDefinition) -> dict[str, Any]:
        wanted = {
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
            "origin": "code",
        }
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
            row = connection.execute(select(s).where(s.c.name == name).with_for_update()).one_or_none()
            if row is None:
                raise UnknownSchedule(f"no schedule named {name!r}")
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
        """Read the clock, the earliest unleased ``next_run_at`` and the earliest lease
        expiry in one statement, each answered from an index."""
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
        with self.engine.connect() as connection:
            row = connection.execute(
                select(now.label("now"), next_due.label("next_due"), next_expiry.label("next_expiry"))
            ).one()
        return Probe(now=row.now, next_due=row.next_due, next_expiry=row.next_expiry)

    @_translate_errors
    def claim(self, now: datetime, *, limit: int, lease_seconds: float, owner: str) -> list[ClaimedRun]:
        """Lease up to *limit* occurrences due at *now* (the cycle's database clock) and
        write their ledger rows; return them earliest first."""
        s, r = self.tables.schedules, self.tables.runs
        token = uuid.uuid4().hex
        lease_until = now + timedelta(seconds=lease_seconds)
        values = [
            # First: it reads the lease_token this statement overwrites.
            ("attempt", case((s.c.lease_token.is_(None), 1), else_=s.c.attempt + 1)),
            ("lease_token", token),
            ("lease_until", lease_until),
            ("lease_owner", owner),
        ]
        with self._transaction() as connection:
            result = connection.execute(claim_statement(self.engine, s, self._due(now), values, limit))
            if not result.rowcount:
                return []
            rows = connection.execute(select(s).where(s.c.lease_token == token).order_by(s.c.next_run_at)).all()
            claims = [
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
                    spec=spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron),
                )
                for row in rows
            ]
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
                    "error": None,
                    "missed_count": 0,
                }
                for claim in claims
            ]
            connection.execute(
                upsert(
                    self.engine,
                    r,
                    ledger,
                    [
                        "state",
                        "attempts",
                        "lease_token",
                        "replica",
                        "claimed_at",
                        "dispatched_at",
                        "started_at",
                        "worker",
                        "error",
                    ],
                )
            )
        return claims

    @_translate_errors
    def mark_dispatched(self, token: str, run_ids: Sequence[str]) -> None:
        """Stamp the publish time on runs of one claim (fenced by its token)."""
        if not run_ids:
            return
        r = self.tables.runs
        with self._transaction() as connection:
            now = database_now(self.engine)
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
                    .values(lease_token=None, lease_until=None, lease_owner=None)
                )
                released += result.rowcount
                connection.execute(
                    r.update()
                    .where(r.c.lease_token == token, r.c.id.in_([c.run_id for c in group]))
                    .values(state=RunState.PUBLISH_FAILED, error=error)
                )
        return released

    @_translate_errors
    def give_up(self, claim: ClaimedRun, now: datetime, reason: str, outcome: str = RunState.LOST) -> bool:
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
        return bool(applied)

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
    def start_run(self, *, schedule: str, run_id: str, token: str, worker: str, lease_seconds: float) -> StartDecision:
        """Mark a delivered occurrence started, extending its lease, if this delivery may
        run: its token must still hold the lease (else a newer claim owns the occurrence)
        and its ledger row must not have started already (else this is a redelivery)."""
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
                        r.c.state.in_(RunState.STARTABLE),
                    )
                    .values(state=RunState.STARTED, started_at=now, worker=worker)
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
    ) -> bool:
        """Record the outcome of a run, advance the schedule to its next occurrence and
        release the lease, all fenced by *token*. Occurrences that elapsed while the run
        was in flight (or while nothing ran) are dropped and counted on the ledger row."""
        s, r = self.tables.schedules, self.tables.runs
        with self._transaction() as connection:
            now = self._now(connection)
            row = connection.execute(
                select(s.c.kind, s.c.cron, s.c.interval_seconds, s.c.timezone, s.c.override_cron).where(
                    s.c.name == schedule, s.c.lease_token == token
                )
            ).one_or_none()
            if row is None:
                logger.warning(
                    "leasebeat: stale outcome %s of %s@%s ignored: its lease token no longer holds the lease",
                    outcome,
                    schedule,
                    occurrence.isoformat(),
                )
                return False
            spec = spec_for(row.kind, row.cron, row.interval_seconds, row.timezone, row.override_cron)
            next_run_at, missed = advance(spec, occurrence, now)
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
                )
            )
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
        return True

    @_translate_errors
    def defer_run(self, *, run_id: str, token: str) -> bool:
        """The task asked Celery to retry it: the retried message carries the same token,
        so make the run startable again while the lease stays held (fenced)."""
        r = self.tables.runs
        with self._transaction() as connection:
            return bool(
                connection.execute(
                    r.update()
                    .where(r.c.id == run_id, r.c.lease_token == token, r.c.state == RunState.STARTED)
                    .values(state=RunState.DISPATCHED)
                ).rowcount
            )

    @_translate_errors
    def fail_run(self, *, run_id: str, error: str) -> bool:
        """Record a started run as failed when only its id is known (its process died)."""
        r = self.tables.runs
        with self._transaction() as connection:
            row = connection.execute(
                select(r.c.schedule, r.c.occurrence, r.c.lease_token, r.c.started_at).where(
                    r.c.id == run_id, r.c.state == RunState.STARTED
                )
            ).one_or_none()
            if row is None:
                return False
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
        s = self.tables.schedules
        with self._transaction() as connection:
            row = connection.execute(select(s).where(s.c.name == name)).one_or_none()
        if row is None:
            raise UnknownSchedule(f"no schedule named {name!r}")
        return dict(row._mapping)

    @_translate_errors
    def list_schedules(self) -> list[dict[str, Any]]:
        s = self.tables.schedules
        with self._transaction() as connection:
            return [dict(row._mapping) for row in connection.execute(select(s).order_by(s.c.name))]

    @_translate_errors
    def list_runs(self, schedule: str | None = None) -> list[dict[str, Any]]:
        r = self.tables.runs
        query = select(r).order_by(r.c.occurrence, r.c.schedule)
        if schedule is not None:
            query = query.where(r.c.schedule == schedule)
        with self._transaction() as connection:
            return [dict(row._mapping) for row in connection.execute(query)]


def advance(spec: Spec, occurrence: datetime, now: datetime) -> tuple[datetime, int]:
    """The occurrence after *occurrence*, or, when that has already elapsed, the first one
    after *now* with the count of elapsed ones dropped (run once, then advance)."""
    following = spec.next_after(occurrence, previous=occurrence)
    if following > now:
        return following, 0
    missed = occurrences_between(spec, occurrence, now, MAX_MISSED_COUNT)
    return spec.next_after(now, previous=occurrence), missed


def _by_token(claims: Sequence[ClaimedRun]) -> dict[str, list[ClaimedRun]]:
    groups: dict[str, list[ClaimedRun]] = {}
    for claim in claims:
        groups.setdefault(claim.lease_token, []).append(claim)
    return groups


def _make_sqlite_concurrent(engine: Engine) -> None:
    """Several beat replicas and a worker share one SQLite file: WAL lets readers run
    beside the writer, and BEGIN IMMEDIATE takes the write lock up front so two
    transactions never deadlock upgrading a read lock."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
