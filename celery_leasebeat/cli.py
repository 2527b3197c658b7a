"""The ``leasebeat`` command: see, change and trust the schedule without a SQL prompt.

``leasebeat -A proj COMMAND`` or ``celery -A proj leasebeat COMMAND``. Every option can also
be set from the environment: ``LEASEBEAT_APP`` for ``-A``, and ``LEASEBEAT_<COMMAND>_<OPTION>``
for the others (``LEASEBEAT_HISTORY_LIMIT=100``). Read commands print a table, or JSON with
``--json``. Errors are one line on stderr and a non-zero exit code from the table below.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn, TypeVar
from zoneinfo import ZoneInfo

import click

from . import __version__
from .binding import store_for
from .config import LeaseBeatConfig
from .dispatcher import BrokerUnavailable, Dispatcher
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidSchedule,
    LeaseBeatError,
    MissingTables,
    OutdatedTables,
    SchedulePaused,
    UnknownSchedule,
)
from .lint import describe, lint
from .registry import inspect_definitions
from .scheduler import HEARTBEAT_SECONDS
from .store import RunState, Store, spec_for
from .timing import CronSpec, IntervalSpec, Spec, preview, utc, zone_for

UTC = timezone.utc

# Exit codes, stable for scripts.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2  # click's own: a bad option or argument
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_UNAVAILABLE = 5
EXIT_LINT_FAILED = 6
EXIT_BUSY = 7
EXIT_PAUSED = 8

#: A replica is live when it refreshed its row within this many heartbeat periods (each the
#: polling interval or HEARTBEAT_SECONDS, whichever is longer) + 10 s.
LIVE_INTERVALS = 2

F = TypeVar("F", bound=Callable[..., Any])


class _State:
    """What the group resolved for its commands: the app (imported on first use)."""

    def __init__(self, app_name: str | None, app: Any) -> None:
        self._app_name = app_name
        self._app = app

    @property
    def app(self) -> Any:
        if self._app is None:
            if not self._app_name:
                _fail("no Celery app: pass -A/--app (or set LEASEBEAT_APP)", EXIT_USAGE)
            from celery.app.utils import find_app

            try:
                self._app = find_app(self._app_name)
            except Exception as exc:
                _fail(f"cannot load the app {self._app_name!r}: {type(exc).__name__}: {exc}", EXIT_ERROR)
        return self._app

    @property
    def config(self) -> LeaseBeatConfig:
        return LeaseBeatConfig.from_app(self.app)

    @property
    def store(self) -> Store:
        store = store_for(self.app)
        store.create_tables = False  # a typo in a URL must not create tables; `migrate` creates them
        return store


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"leasebeat: {message}", err=True)
    sys.exit(code)


def _errors_as_exit_codes(command: F) -> F:
    """One clear line and a distinct exit code for every expected failure."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (UnknownSchedule, MissingTables, OutdatedTables) as exc:
            _fail(str(exc), EXIT_NOT_FOUND)
        except SchedulePaused as exc:
            _fail(str(exc), EXIT_PAUSED)
        except (InvalidSchedule, ConfigurationError) as exc:
            _fail(str(exc), EXIT_INVALID)
        except DatabaseUnavailable as exc:
            _fail(str(exc), EXIT_UNAVAILABLE)
        except BrokerUnavailable as exc:
            _fail(f"broker unavailable: {exc}", EXIT_UNAVAILABLE)
        except LeaseBeatError as exc:
            _fail(str(exc), EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


@click.group(name="leasebeat", help=__doc__, context_settings={"auto_envvar_prefix": "LEASEBEAT"})
@click.option(
    "-A", "--app", "app_name", metavar="APP", envvar="LEASEBEAT_APP", help="The Celery app, as for `celery -A`."
)
@click.version_option(__version__, prog_name="leasebeat")
@click.pass_context
def leasebeat(ctx: click.Context, app_name: str | None) -> None:
    # Under `celery -A proj leasebeat`, celery's context already holds the app.
    celery_app = None if app_name else getattr(ctx.obj, "app", None)
    ctx.obj = _State(app_name, celery_app)


pass_state = click.make_pass_decorator(_State)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


# -- read commands -------------------------------------------------------------------------


@leasebeat.command("list")
@json_option
@pass_state
@_errors_as_exit_codes
def list_command(state: _State, as_json: bool) -> None:
    """One line per schedule: timing, next and last run, lease, state."""
    store = state.store
    rows = store.list_schedules()
    now = store.now()
    attention = store.attention(now - timedelta(days=1))
    items = [_schedule_summary(row, attention.get(row["name"])) for row in rows]
    if as_json:
        _print_json(items)
        return
    _print_table(
        items,
        [
            ("name", "NAME"),
            ("cron", "CRON"),
            ("description", "DESCRIPTION"),
            ("timezone", "ZONE"),
            ("next_run_local", "NEXT (LOCAL)"),
            ("next_run_utc", "NEXT (UTC)"),
            ("last_run", "LAST RUN"),
            ("last_outcome", "OUTCOME"),
            ("lease", "LEASE"),
            ("state", "STATE"),
            ("attention", "ATTENTION (24H)"),
        ],
    )


@leasebeat.command("show")
@click.argument("name")
@json_option
@pass_state
@_errors_as_exit_codes
def show_command(state: _State, name: str, as_json: bool) -> None:
    """A schedule's definition, override, next 10 occurrences and last 20 runs."""
    store = state.store
    row = store.get_schedule(name)
    spec = _spec(row)
    now = store.now()
    upcoming = [row["next_run_at"], *_safe_preview(spec, row["next_run_at"], 9)]
    runs = store.list_runs(name, limit=20)
    detail = {
        **_schedule_summary(row, store.attention(now - timedelta(days=1)).get(name)),
        "task": row["task"],
        "args": row["args"],
        "kwargs": row["kwargs"],
        "options": row["options"],
        "code_cron": row["cron"],
        "interval_seconds": row["interval_seconds"],
        "override": row["override_cron"],
        "grace_seconds": row["grace_seconds"],
        "max_runtime_seconds": row["max_runtime_seconds"],
        "last_error": row["last_error"],
        "next_occurrences": [_iso(t) for t in upcoming],
        "runs": [_run_summary(r) for r in runs],
    }
    if as_json:
        _print_json(detail)
        return
    for key in (
        "name",
        "task",
        "cron",
        "description",
        "timezone",
        "code_cron",
        "override",
        "interval_seconds",
        "args",
        "kwargs",
        "options",
        "grace_seconds",
        "max_runtime_seconds",
        "state",
        "lease",
        "last_run",
        "last_outcome",
        "last_error",
        "attention",
    ):
        value = detail[key]
        if value not in (None, "", [], {}):
            click.echo(f"{key.replace('_', ' '):>20}: {value if isinstance(value, str) else json.dumps(value)}")
    zone = ZoneInfo(row["timezone"])
    click.echo("\nnext occurrences:")
    for moment in upcoming:
        click.echo(f"  {moment.astimezone(zone).isoformat()}  ({_iso(moment)})")
    click.echo("\nlast runs:")
    _print_table(detail["runs"], _RUN_COLUMNS)


_RUN_COLUMNS = [
    ("schedule", "SCHEDULE"),
    ("occurrence", "OCCURRENCE (UTC)"),
    ("state", "STATE"),
    ("attempts", "ATTEMPTS"),
    ("duration_ms", "MS"),
    ("replica", "DISPATCHED BY"),
    ("worker", "WORKER"),
    ("note", "NOTE"),
]


@leasebeat.command("history")
@click.argument("name", required=False)
@click.option("--since", help="ISO-8601 time, or an age such as 30m, 12h, 7d.")
@click.option(
    "--outcome",
    "outcomes",
    multiple=True,
    type=click.Choice([*RunState.OUTCOMES, RunState.STARTED, RunState.DISPATCHED, RunState.PUBLISH_FAILED]),
    help="Only runs in this state (repeatable).",
)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1), help="The newest N runs.")
@json_option
@pass_state
@_errors_as_exit_codes
def history_command(
    state: _State, name: str | None, since: str | None, outcomes: Sequence[str], limit: int, as_json: bool
) -> None:
    """Runs from the ledger, oldest first."""
    store = state.store
    since_at = _parse_since(since, store.now()) if since else None
    rows = store.list_runs(name, since=since_at, states=outcomes or None, limit=limit)
    if name is not None and not rows:
        store.get_schedule(name)  # a name never seen is an error; a removed schedule keeps its history
    runs = [_run_summary(r) for r in rows]
    if as_json:
        _print_json(runs)
    else:
        _print_table(runs, _RUN_COLUMNS)


@leasebeat.command("preview")
@click.argument("cron")
@click.option("--tz", "zone", default="UTC", show_default=True, help="IANA time zone.")
@click.option("--count", default=10, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--start", help="ISO-8601 start (default: now); without an offset it is read in --tz.")
@json_option
@_errors_as_exit_codes
def preview_command(cron: str, zone: str, count: int, start: str | None, as_json: bool) -> None:
    """The next occurrences of CRON, with the scheduler's DST rules."""
    spec = CronSpec(" ".join(cron.split()), zone).validate(schedule="preview")
    tz = zone_for(zone, schedule="preview")
    if start:
        try:
            begin = datetime.fromisoformat(start)
        except ValueError:
            raise InvalidSchedule(f"--start must be an ISO-8601 time, got {start!r}") from None
        begin = begin.replace(tzinfo=tz) if begin.tzinfo is None else begin
    else:
        begin = datetime.now(UTC)
    times = [t.astimezone(tz) for t in preview(spec, begin - timedelta(microseconds=1), count)]
    if as_json:
        _print_json([t.isoformat() for t in times])
        return
    click.echo(f"{spec.expression}: {describe(spec)}")
    for moment in times:
        click.echo(f"  {moment.isoformat()}  ({_iso(moment)})")


@leasebeat.command("lint")
@json_option
@pass_state
@_errors_as_exit_codes
def lint_command(state: _State, as_json: bool) -> None:
    """Validate every registered schedule; warn on suspicious ones. Exits non-zero on an error."""
    app = state.app
    app.loader.import_default_modules()  # as beat and the worker do: tasks and registrations in `include`
    definitions, errors = inspect_definitions(app, state.config)
    now = datetime.now(UTC)
    report: list[dict[str, Any]] = [{"name": None, "level": "error", "message": str(error)} for error in errors]
    for definition in definitions:
        spec = definition.spec()
        if state.config.check_tasks and definition.task not in app.tasks:
            report.append({"name": definition.name, "level": "error", "message": f"unknown task {definition.task!r}"})
        warnings = lint(spec, now)
        for warning in warnings:
            report.append({"name": definition.name, "level": "warning", "message": warning})
        upcoming = [_iso(t) for t in _safe_preview(spec, now, 3)]
        report.append(
            {"name": definition.name, "level": "ok", "message": f"{describe(spec)}; next: {', '.join(upcoming)}"}
        )
    failed = any(item["level"] == "error" for item in report)
    if as_json:
        _print_json({"ok": not failed, "report": report})
    else:
        for item in report:
            click.echo(f"{item['level'].upper():8} {item['name'] or '-'}: {item['message']}")
        click.echo(f"\n{len(definitions)} schedule(s), {sum(i['level'] == 'error' for i in report)} error(s)")
    if failed:
        sys.exit(EXIT_LINT_FAILED)


@leasebeat.command("status")
@json_option
@pass_state
@_errors_as_exit_codes
def status_command(state: _State, as_json: bool) -> None:
    """The beat replicas: host, pid, version, last cycle, claims made."""
    now, replicas = state.store.list_replicas()
    horizon = timedelta(seconds=LIVE_INTERVALS * max(state.config.polling_interval, HEARTBEAT_SECONDS) + 10)
    items = [
        {
            "name": r["name"],
            "host": r["host"],
            "pid": r["pid"],
            "version": r["version"],
            "started_at": _iso(r["started_at"]),
            "last_cycle_at": _iso(r["last_cycle_at"]),
            "seconds_since_cycle": round((now - r["last_cycle_at"]).total_seconds(), 1),
            "claims": r["claims"],
            "live": now - r["last_cycle_at"] <= horizon,
        }
        for r in replicas
    ]
    if as_json:
        _print_json(items)
        return
    _print_table(
        [{**item, "live": "live" if item["live"] else "stale"} for item in items],
        [
            ("name", "REPLICA"),
            ("version", "VERSION"),
            ("started_at", "STARTED"),
            ("last_cycle_at", "LAST CYCLE"),
            ("seconds_since_cycle", "AGO (S)"),
            ("claims", "CLAIMS"),
            ("live", "STATE"),
        ],
    )
    click.echo(f"\n{sum(item['live'] for item in items)} live replica(s)")


# -- write commands ------------------------------------------------------------------------


@leasebeat.command("trigger")
@click.argument("name")
@pass_state
@_errors_as_exit_codes
def trigger_command(state: _State, name: str) -> None:
    """Run NAME now, through the same claim and ledger path as a scheduled occurrence."""
    store, config = state.store, state.config
    now, held_until = store.make_due(name)
    if held_until is not None:
        _fail(f"schedule {name!r}: a run holds its lease until {_iso(held_until)}; nothing started", EXIT_BUSY)
    claims = store.claim(now, limit=1, lease_seconds=config.lease_seconds, owner=f"cli:{_host()}", names=[name])
    if not claims:
        click.echo(f"{name}: made due now; a beat replica claimed it first")
        return
    dispatcher = Dispatcher(state.app, store, config)
    try:
        published = dispatcher.dispatch(claims, now)
    finally:
        dispatcher.close()
    for claim in published:
        click.echo(f"{name}: dispatched occurrence {_iso(claim.occurrence)} as task {claim.run_id}")
    if not published:
        _fail(f"schedule {name!r}: the occurrence was not dispatched (see `leasebeat history {name}`)", EXIT_ERROR)


@leasebeat.command("pause")
@click.argument("name")
@pass_state
@_errors_as_exit_codes
def pause_command(state: _State, name: str) -> None:
    """Stop dispatching NAME (a run in flight finishes)."""
    state.store.set_enabled(name, False)
    click.echo(f"{name}: paused")


@leasebeat.command("resume")
@click.argument("name")
@click.option("--skip-missed", is_flag=True, help="Drop an occurrence missed while paused.")
@pass_state
@_errors_as_exit_codes
def resume_command(state: _State, name: str, skip_missed: bool) -> None:
    """Dispatch NAME again; an occurrence missed while paused runs once, unless skipped."""
    next_run = state.store.resume(name, skip_missed=skip_missed)
    click.echo(f"{name}: resumed; next run {_iso(next_run)}")


@leasebeat.command("retime")
@click.argument("name")
@click.argument("cron", required=False)
@click.option("--clear", is_flag=True, help="Remove the override: the code's expression applies again.")
@pass_state
@_errors_as_exit_codes
def retime_command(state: _State, name: str, cron: str | None, clear: bool) -> None:
    """Override NAME's cron expression on every replica from their next cycle."""
    if clear == bool(cron):
        _fail("give either a CRON expression or --clear", EXIT_USAGE)
    next_run = state.store.set_override(name, None if clear else cron)
    what = "override cleared" if clear else f"retimed to {cron!r}"
    click.echo(f"{name}: {what}; next run {_iso(next_run)}")


@leasebeat.command("migrate")
@pass_state
@_errors_as_exit_codes
def migrate_command(state: _State) -> None:
    """Apply the shipped migrations (for teams that manage the schema themselves)."""
    from sqlalchemy.exc import OperationalError

    from .migrations import upgrade

    store = state.store
    store.create_tables = True
    try:
        before, after = upgrade(store)
    except OperationalError as exc:
        raise DatabaseUnavailable(f"database {store.safe_url} unavailable: {exc.orig}") from exc
    click.echo(f"{store.safe_url}: {before or 'empty'} -> {after}")


@leasebeat.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@pass_state
@_errors_as_exit_codes
def serve_command(state: _State, host: str, port: int) -> None:
    """Serve the HTTP trigger API (needs the `api` extra). Refuses to start without a token."""
    try:
        import uvicorn

        from .api import create_api
    except ImportError as exc:
        _fail(
            f"the HTTP API needs the api extra: pip install 'celery-leasebeat[api]' ({exc.name} is missing)", EXIT_ERROR
        )
    uvicorn.run(create_api(state.app), host=host, port=port, log_level="info")


# -- formatting ------------------------------------------------------------------------------


def _spec(row: dict[str, Any]) -> Spec:
    return spec_for(row["kind"], row["cron"], row["interval_seconds"], row["timezone"], row["override_cron"])


def _schedule_summary(row: dict[str, Any], attention: tuple[int, str] | None) -> dict[str, Any]:
    spec = _spec(row)
    zone = ZoneInfo(row["timezone"])
    lease = ""
    if row["lease_token"] and row["lease_until"]:
        lease = f"{row['lease_owner']} until {_iso(row['lease_until'])}"
    duration = f" in {row['last_duration_ms']} ms" if row["last_duration_ms"] is not None else ""
    return {
        "name": row["name"],
        "cron": _timing(spec),
        "description": describe(spec),
        "timezone": row["timezone"],
        "next_run_local": row["next_run_at"].astimezone(zone).isoformat(),
        "next_run_utc": _iso(row["next_run_at"]),
        "last_run": _iso(row["last_run_at"]),
        "last_outcome": f"{row['last_outcome']}{duration}" if row["last_outcome"] else "",
        "lease": lease,
        "state": "enabled" if row["enabled"] else "paused",
        "attention": f"{attention[0]}: {attention[1]}" if attention else "",
        "override": row["override_cron"],
    }


def _run_summary(run: dict[str, Any]) -> dict[str, Any]:
    note = run["alert"] or run["error"] or ""
    if run["missed_count"]:
        note = f"{run['missed_count']} later occurrence(s) dropped; {note}".rstrip("; ")
    return {
        "id": run["id"],
        "schedule": run["schedule"],
        "occurrence": _iso(run["occurrence"]),
        "state": run["state"],
        "attempts": run["attempts"],
        "replica": run["replica"],
        "worker": run["worker"],
        "dispatched_at": _iso(run["dispatched_at"]),
        "started_at": _iso(run["started_at"]),
        "finished_at": _iso(run["finished_at"]),
        "duration_ms": run["duration_ms"],
        "missed_count": run["missed_count"],
        "alert": run["alert"],
        "error": run["error"],
        "note": note,
    }


def _timing(spec: Spec) -> str:
    if isinstance(spec, CronSpec):
        return spec.expression
    if isinstance(spec, IntervalSpec):
        return f"every {spec.seconds:g}s"
    return "triggered"


def _iso(moment: datetime | None) -> str:
    return utc(moment).isoformat() if moment else ""


def _safe_preview(spec: Spec, now: datetime, count: int) -> list[datetime]:
    try:
        return preview(spec, now, count)
    except InvalidSchedule:
        return []


_AGE = re.compile(r"([0-9]{1,9})([smhd])", re.ASCII)


def _parse_since(text: str, now: datetime) -> datetime:
    age = _AGE.fullmatch(text.strip())
    try:
        if age:
            units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
            return now - timedelta(seconds=int(age.group(1)) * units[age.group(2)])
        return utc(datetime.fromisoformat(text))
    except (ValueError, OverflowError):
        raise InvalidSchedule(f"--since must be an ISO-8601 time or an age like 12h or 7d, got {text!r}") from None


def _host() -> str:
    import socket

    return socket.gethostname()


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def _print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    if not rows:
        click.echo("(none)")
        return
    cells = [[("" if row.get(key) is None else str(row.get(key))) for key, _ in columns] for row in rows]
    widths = [max(len(title), *(len(line[i]) for line in cells)) for i, (_, title) in enumerate(columns)]
    click.echo("  ".join(title.ljust(width) for (_, title), width in zip(columns, widths)).rstrip())
    for line in cells:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())


def main() -> None:
    """The ``leasebeat`` console script."""
    leasebeat()
