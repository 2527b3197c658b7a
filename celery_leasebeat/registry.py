"""Where schedules come from: ``register_schedule()`` calls and an existing ``beat_schedule``.

Registrations accumulate on the app from any module. When beat starts, they are merged
with every entry of ``app.conf.beat_schedule`` (and Celery's default
``celery.backend_cleanup``), the ``leasebeat_overrides`` setting is applied, and each
definition is validated; the store then upserts them by name.
"""

from __future__ import annotations

import json
import logging
import numbers
import sys
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from celery import Celery, Task
from celery.schedules import crontab, schedule

from .config import LeaseBeatConfig
from .errors import InvalidSchedule
from .store.records import ScheduleDefinition

logger = logging.getLogger("celery_leasebeat.registry")

#: The package's own schedule: the ledger retention purge (see celery_leasebeat.history).
PURGE_SCHEDULE = "leasebeat.purge_history"
PURGE_TASK = "celery_leasebeat.purge_history"

_REGISTRY_ATTRIBUTE = "_leasebeat_registrations"


def register_schedule(
    task: Task | str,
    cron: Any = None,
    *,
    name: str | None = None,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    timezone: str = "UTC",
    options: Mapping[str, Any] | None = None,
    app: Celery | None = None,
    grace: float | timedelta | None = None,
    max_runtime: float | timedelta | None = None,
    queue: str | None = None,
    after: str | None = None,
    triggered: bool = False,
    inline_cap: int | None = None,
    daily_cap: int | None = None,
    dedupe_window: float | timedelta | None = None,
) -> ScheduleDefinition:
    """Register *task* to run on a schedule under LeaseScheduler.

    *cron* is a cron expression (5 fields, or 6 with seconds first), evaluated in the IANA
    *timezone*; a number of seconds, a ``timedelta``, a ``celery.schedules.schedule`` or a
    ``crontab`` are accepted too, exactly as in ``beat_schedule``. It may be None only when
    the ``leasebeat_overrides`` setting supplies the expression. *name* defaults to the
    task's name. An invalid expression or zone raises
    :class:`~celery_leasebeat.errors.InvalidSchedule` here, naming the schedule.

    *grace* and *max_runtime* (seconds or ``timedelta``) turn on missed-run detection: an
    occurrence not claimed within *grace* of its time is recorded ``missed`` and not run, one
    dispatched but not started within *grace* is flagged, and a run longer than
    *max_runtime* is flagged (see docs/operations.md).

    *queue* routes the runs to their own queue (a separate worker pool for batch work).
    *after* names an upstream schedule: this one has no timing of its own and runs for the
    same window when the upstream run succeeds (it is recorded skipped when the upstream
    fails). *triggered* makes a schedule that runs only when triggered (HTTP API, CLI).
    *inline_cap* makes the HTTP API run it inline, passing ``cap=inline_cap`` to the task,
    which returns how much it did (at most the cap). *daily_cap* limits triggered runs per
    UTC day; *dedupe_window* collapses triggers within that many seconds into one job
    (see docs/http-api.md).
    """
    if app is None:
        app = task.app if isinstance(task, Task) else _current_app()
    definition = make_definition(
        task,
        cron,
        name=name,
        args=args,
        kwargs=kwargs,
        timezone=timezone,
        options=options,
        app=app,
        grace=grace,
        max_runtime=max_runtime,
        queue=queue,
        after=after,
        triggered=triggered,
        inline_cap=inline_cap,
        daily_cap=daily_cap,
        dedupe_window=dedupe_window,
    )
    registrations(app)[definition.name] = definition
    return definition


def make_definition(
    task: Task | str,
    cron: Any = None,
    *,
    name: str | None = None,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    timezone: str = "UTC",
    options: Mapping[str, Any] | None = None,
    app: Celery,
    grace: float | timedelta | None = None,
    max_runtime: float | timedelta | None = None,
    queue: str | None = None,
    after: str | None = None,
    triggered: bool = False,
    inline_cap: int | None = None,
    daily_cap: int | None = None,
    dedupe_window: float | timedelta | None = None,
) -> ScheduleDefinition:
    """The definition :func:`register_schedule` registers (validated), without registering it."""
    task_name = task if isinstance(task, str) else task.name
    if not task_name:
        raise InvalidSchedule(f"register_schedule() needs a task or a task name, got {task!r}")
    schedule_name = name or task_name
    definition = _definition(
        schedule_name,
        task_name,
        cron,
        timezone=timezone,
        args=args,
        kwargs=kwargs,
        options=options,
        app=app,
        allow_missing=True,
        extra={
            "grace_seconds": _seconds(grace, schedule_name, "grace"),
            "max_runtime_seconds": _seconds(max_runtime, schedule_name, "max_runtime"),
            "after": after,
            "inline_cap": _count(inline_cap, schedule_name, "inline_cap"),
            "daily_cap": _count(daily_cap, schedule_name, "daily_cap"),
            "dedupe_seconds": _seconds(dedupe_window, schedule_name, "dedupe_window"),
        },
    )
    if queue:
        definition = replace(definition, options={**definition.options, "queue": queue})
    if (after or triggered) and cron is None:
        definition = replace(definition, kind="triggered")
    if definition.cron is not None or definition.kind in ("interval", "triggered"):
        validate(definition)
    return definition


class Registrations(dict[str, ScheduleDefinition]):
    """The definitions registered on one app, by name, with a version that every change
    bumps, so beat notices a late registration without comparing every entry each cycle."""

    version = 0

    def __setitem__(self, name: str, definition: ScheduleDefinition) -> None:
        super().__setitem__(name, definition)
        self.version += 1

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self.version += 1


def registrations(app: Celery) -> Registrations:
    """The definitions registered on *app* so far (mutable: it is the registry)."""
    registry = getattr(app, _REGISTRY_ATTRIBUTE, None)
    if registry is None:
        registry = Registrations()
        setattr(app, _REGISTRY_ATTRIBUTE, registry)
    return registry


def collect_definitions(app: Celery, config: LeaseBeatConfig) -> list[ScheduleDefinition]:
    """Every schedule this app defines, overrides applied, each validated.

    Raises :class:`InvalidSchedule` naming the first entry that cannot be served.
    """
    definitions, errors = inspect_definitions(app, config)
    if errors:
        raise errors[0]
    return definitions


def inspect_definitions(app: Celery, config: LeaseBeatConfig) -> tuple[list[ScheduleDefinition], list[InvalidSchedule]]:
    """Like :func:`collect_definitions`, but every entry is checked: returns the valid
    definitions and one error per invalid entry (what ``leasebeat lint`` reports)."""
    definitions: dict[str, ScheduleDefinition] = {}
    errors: list[InvalidSchedule] = []
    timezone = _app_timezone(app)
    for entry_name, entry in _beat_schedule_with_defaults(app).items():
        try:
            if not isinstance(entry, Mapping) or "task" not in entry or "schedule" not in entry:
                raise InvalidSchedule(f"beat_schedule entry {entry_name!r} must be a dict with 'task' and 'schedule'")
            definitions[entry_name] = _definition(
                entry_name,
                entry["task"],
                entry["schedule"],
                timezone=timezone,
                args=entry.get("args", ()),
                kwargs=entry.get("kwargs"),
                options=entry.get("options"),
                app=app,
                allow_missing=False,
                app_timezone=timezone,
            )
        except InvalidSchedule as exc:
            errors.append(exc)
    if config.schedule_file:
        from_file, file_errors = load_schedule_file(config.schedule_file, app)
        errors.extend(file_errors)
        for definition in from_file:
            if definition.name in definitions:
                errors.append(
                    InvalidSchedule(f"schedule {definition.name!r} of {config.schedule_file} is also in beat_schedule")
                )
            definitions[definition.name] = definition
    for registered_name, definition in registrations(app).items():
        if registered_name in definitions:
            errors.append(
                InvalidSchedule(
                    f"schedule {registered_name!r} is both registered with register_schedule() "
                    f"and an entry of beat_schedule; give one of them another name"
                )
            )
            continue
        definitions[registered_name] = definition
    if config.history_retention_days is not None:
        definitions.setdefault(
            PURGE_SCHEDULE,
            ScheduleDefinition(name=PURGE_SCHEDULE, task=PURGE_TASK, kind="cron", cron=config.purge_cron),
        )
    for override_name, expression in config.overrides.items():
        if override_name in definitions and expression.strip():
            definitions[override_name] = replace(
                definitions[override_name],
                kind="cron",  # an override is a standard cron expression
                cron=expression.strip(),
                interval_seconds=None,
            )
    valid = []
    for definition in definitions.values():
        try:
            if definition.kind in ("cron", "crontab") and definition.cron is None:
                raise InvalidSchedule(
                    f"schedule {definition.name!r} has no cron expression: pass one to "
                    f"register_schedule() or set leasebeat_overrides[{definition.name!r}]"
                )
            valid.append(validate(definition))
        except InvalidSchedule as exc:
            errors.append(exc)
    return valid, errors


#: The keys a schedule may have in a schedule file, each a register_schedule() argument.
_FILE_KEYS = {
    "task", "cron", "every", "timezone", "args", "kwargs", "options", "queue", "grace", "max_runtime",
    "after", "triggered", "inline_cap", "daily_cap", "dedupe_window",
}  # fmt: skip


def load_schedule_file(path: str, app: Celery) -> tuple[list[ScheduleDefinition], list[InvalidSchedule]]:
    """Read schedules kept as code in a TOML file: one ``[schedules.NAME]`` table each, with
    the arguments of :func:`register_schedule` (``every`` for an interval in seconds)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        return [], [InvalidSchedule(f"schedule file {path}: cannot be read: {exc.strerror}")]
    except tomllib.TOMLDecodeError as exc:
        return [], [InvalidSchedule(f"schedule file {path}: not valid TOML: {exc}")]
    tables = document.get("schedules", {})
    if not isinstance(tables, dict):
        return [], [InvalidSchedule(f"schedule file {path}: [schedules] must be a table of tables")]
    definitions, errors = [], []
    for name, entry in tables.items():
        try:
            if not isinstance(entry, dict) or not isinstance(entry.get("task"), str):
                raise InvalidSchedule(f"schedule {name!r} needs a task name")
            unknown = set(entry) - _FILE_KEYS
            if unknown:
                raise InvalidSchedule(f"schedule {name!r}: unknown key(s) {', '.join(sorted(unknown))}")
            if "cron" in entry and "every" in entry:
                raise InvalidSchedule(f"schedule {name!r}: give cron or every, not both")
            fields = {key: value for key, value in entry.items() if key not in ("task", "cron", "every")}
            definitions.append(
                make_definition(entry["task"], entry.get("cron", entry.get("every")), name=name, app=app, **fields)
            )
        except InvalidSchedule as exc:
            errors.append(InvalidSchedule(f"schedule file {path}: {exc}"))
        except TypeError as exc:
            errors.append(InvalidSchedule(f"schedule file {path}: schedule {name!r}: {exc}"))
    return definitions, errors


def validate(definition: ScheduleDefinition) -> ScheduleDefinition:
    """Raise :class:`InvalidSchedule` (naming the schedule) unless it can be served."""
    definition.spec().validate(schedule=definition.name)
    for label, value in (("args", definition.args), ("kwargs", definition.kwargs), ("options", definition.options)):
        if _plain(value):
            continue  # the common case, checked without encoding (start-up with many schedules)
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise InvalidSchedule(
                f"schedule {definition.name!r}: {label} must be JSON-serialisable to be stored "
                f"in the schedule table: {exc}"
            ) from None
    return definition


_SCALARS = (str, int, float, bool, type(None))


def _plain(value: list[Any] | dict[str, Any]) -> bool:
    """Whether *value* is a flat list, or a dict with string keys, of JSON scalars."""
    if isinstance(value, dict):
        return all(type(key) is str for key in value) and all(type(item) in _SCALARS for item in value.values())
    return all(type(item) in _SCALARS for item in value)


def _definition(
    name: str,
    task: str,
    value: Any,
    *,
    timezone: str,
    args: Any,
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any] | None,
    app: Celery,
    allow_missing: bool,
    extra: Mapping[str, Any] | None = None,
    app_timezone: str | None = None,
) -> ScheduleDefinition:
    common: dict[str, Any] = {
        "name": name,
        "task": task,
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        "options": dict(options or {}),
        **(extra or {}),
    }
    if value is None and allow_missing:
        return ScheduleDefinition(kind="cron", cron=None, timezone=timezone, **common)
    if isinstance(value, str):
        return ScheduleDefinition(kind="cron", cron=" ".join(value.split()), timezone=timezone, **common)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return ScheduleDefinition(kind="interval", interval_seconds=float(value), timezone=timezone, **common)
    if isinstance(value, timedelta):
        return ScheduleDefinition(kind="interval", interval_seconds=value.total_seconds(), timezone=timezone, **common)
    if isinstance(value, crontab):
        # A crontab is in the app's zone, as under Celery's own scheduler.
        zone = app_timezone or _app_timezone(app)
        return ScheduleDefinition(kind="crontab", cron=crontab_expression(value), timezone=zone, **common)
    if type(value) is schedule:
        return ScheduleDefinition(
            kind="interval", interval_seconds=value.run_every.total_seconds(), timezone=timezone, **common
        )
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise InvalidSchedule(
        f"schedule {name!r}: LeaseScheduler cannot serve a {kind} schedule; use a cron "
        f"expression, a crontab, a number of seconds, a timedelta or celery.schedules.schedule"
    )


def _seconds(value: float | timedelta | None, schedule: str, label: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise InvalidSchedule(f"schedule {schedule!r}: {label} must be a positive number of seconds, got {value!r}")
    return float(seconds)


def _count(value: int | None, schedule: str, label: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSchedule(f"schedule {schedule!r}: {label} must be a positive whole number, got {value!r}")
    return value


#: crontab_expression's results by the fields as written: thousands of schedules often
#: share a handful of crontabs, and spelling one out costs tens of microseconds.
_CRONTAB_EXPRESSIONS: dict[tuple[str, ...], str] = {}
_LAST_CRONTAB: tuple[crontab, str] | None = None


def crontab_expression(value: crontab) -> str:
    """Celery's ``crontab`` as a 5-field expression over the same sets of values.

    Fields keep ``*`` and ``*/n`` where they came that way (the DST rule for repeated wall
    times looks at the hour field); anything else is spelled out as a list.
    """
    global _LAST_CRONTAB
    if _LAST_CRONTAB is not None and _LAST_CRONTAB[0] is value:  # one object shared by many entries
        return _LAST_CRONTAB[1]
    expression = _crontab_expression(value)
    _LAST_CRONTAB = (value, expression)  # holds the object: its id cannot be reused
    return expression


def _crontab_expression(value: crontab) -> str:
    originals = (value._orig_minute, value._orig_hour, value._orig_day_of_month, value._orig_month_of_year,
                 value._orig_day_of_week)  # fmt: skip
    if not all(isinstance(original, (str, int)) for original in originals):
        return _spell_out(value)  # sets, ranges, generators: no faithful key
    key = tuple(f"{type(original).__name__}:{original}" for original in originals)
    expression = _CRONTAB_EXPRESSIONS.get(key)
    if expression is None:
        expression = _spell_out(value)
        if len(_CRONTAB_EXPRESSIONS) < 4096:
            _CRONTAB_EXPRESSIONS[key] = expression
    return expression


def _spell_out(value: crontab) -> str:
    def field(values: set[int], full: range, original: Any) -> str:
        if set(values) == set(full):
            return "*"
        text = str(original).replace(" ", "")
        if text.startswith("*/") and text[2:].isdigit():
            return text
        return ",".join(str(v) for v in sorted(values))

    return " ".join(
        (
            field(value.minute, range(60), value._orig_minute),
            field(value.hour, range(24), value._orig_hour),
            field(value.day_of_month, range(1, 32), value._orig_day_of_month),
            field(value.month_of_year, range(1, 13), value._orig_month_of_year),
            field(value.day_of_week, range(7), value._orig_day_of_week),
        )
    )


def _beat_schedule_with_defaults(app: Celery) -> dict[str, Any]:
    """``beat_schedule`` plus the entry Celery's own scheduler installs by default."""
    entries = dict(app.conf.beat_schedule or {})
    if app.conf.result_expires and not app.backend.supports_autoexpire:
        entries.setdefault(
            "celery.backend_cleanup",
            {
                "task": "celery.backend_cleanup",
                "schedule": crontab("0", "4", "*"),
                "options": {"expires": 12 * 3600},
            },
        )
    return entries


def _app_timezone(app: Celery) -> str:
    zone = app.timezone
    return getattr(zone, "key", None) or str(zone)


def _current_app() -> Celery:
    from celery import current_app

    return current_app._get_current_object()
