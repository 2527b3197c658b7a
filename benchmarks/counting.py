"""Counting inside a ``celery beat`` process under benchmark (installed by benchapp.py when
BENCH_COUNT_FILE is set): database round trips and completed beat cycles, written as JSON to
that file every half second (and once more at exit).

What is counted:

- ``statements``: cursor executions, SQLAlchemy's (``before_cursor_execute``, one per
  ``execute`` or ``executemany``) and Django's (``CursorWrapper.execute``/``executemany``);
- ``transactions_ends``: SQLAlchemy ``commit``/``rollback`` connection events and Django
  commits/rollbacks, each a round trip; not on autocommit connections, where they are no-ops;
- ``pings``: SQLAlchemy's pool pre-ping (``SELECT 1`` at each connection checkout), a round
  trip no statement event sees;
- ``connects``: new database connections (SQLAlchemy pool, Django), each several round trips;
- ``cycles``: completed calls of the scheduler's ``tick`` (returned without raising and
  without logging an error), with ``tick_seconds`` their total wall time,
  ``longest_later_tick`` the longest after the first (in seconds), and
  ``first_cycle_done_at``/``last_cycle_done_at`` (epoch seconds) when the first and the latest
  returned; ``failed_cycles``: ticks that raised or logged an error (leasebeat logs a
  database error and backs off instead of raising), with ``last_error`` the latest message.

Raw DBAPI statements the drivers or frameworks run outside these hooks (Django's time zone
set-up on connect, for instance) are not counted.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import threading
import time
from typing import Any

FIELDS = ("statements", "transactions_ends", "pings", "connects", "cycles", "failed_cycles", "errors")


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(FIELDS, 0)
        self.tick_seconds = 0.0
        self.first_cycle_done_at: float | None = None
        self.last_cycle_done_at: float | None = None
        self.longest_later_tick = 0.0  # the longest completed tick after the first
        self.last_error: str | None = None

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.values[name] += amount

    def tick_done(self, seconds: float) -> None:
        with self._lock:
            self.values["cycles"] += 1
            self.tick_seconds += seconds
            if self.first_cycle_done_at is not None:
                self.longest_later_tick = max(self.longest_later_tick, seconds)
            self.last_cycle_done_at = time.time()
            if self.first_cycle_done_at is None:
                self.first_cycle_done_at = self.last_cycle_done_at

    def error(self, message: str) -> None:
        with self._lock:
            self.values["errors"] += 1
            self.last_error = message[:500]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.values,
                "tick_seconds": self.tick_seconds,
                "longest_later_tick": self.longest_later_tick,
                "first_cycle_done_at": self.first_cycle_done_at,
                "last_cycle_done_at": self.last_cycle_done_at,
                "last_error": self.last_error,
                "time": time.time(),
                "pid": os.getpid(),
            }


_installed: Counters | None = None


def install(path: str, interval: float = 0.5) -> Counters:
    """Start counting in this process and writing the totals to *path* every *interval*."""
    global _installed
    if _installed is not None:
        return _installed
    counters = _installed = Counters()
    _count_sqlalchemy(counters)
    _count_django(counters)
    _count_ticks(counters, os.environ.get("BENCH_SCHEDULER", "leasebeat"))

    def write() -> None:
        temporary = f"{path}.tmp"
        with open(temporary, "w") as handle:
            json.dump(counters.snapshot(), handle)
        os.replace(temporary, path)

    def loop() -> None:
        while True:
            try:
                write()
            except OSError:
                pass  # the work dir is gone: the run is over
            time.sleep(interval)

    threading.Thread(target=loop, name="bench-counting", daemon=True).start()
    atexit.register(lambda: _quietly(write))
    return counters


def _quietly(function: Any) -> None:
    try:
        function()
    except OSError:
        pass


def _count_sqlalchemy(counters: Counters) -> None:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    from sqlalchemy.engine.default import DefaultDialect
    from sqlalchemy.pool import Pool

    def ended(connection: Any) -> None:
        # On an AUTOCOMMIT connection the DBAPI commit/rollback is no round trip (psycopg
        # sends nothing outside a transaction; SQLAlchemy may skip the call altogether).
        autocommit = getattr(connection, "_is_autocommit_isolation", None)
        if autocommit is None or not autocommit():
            counters.add("transactions_ends")

    event.listen(Engine, "before_cursor_execute", lambda *args: counters.add("statements"))
    event.listen(Engine, "commit", ended)
    event.listen(Engine, "rollback", ended)
    event.listen(Pool, "connect", lambda *args: counters.add("connects"))
    original = DefaultDialect._do_ping_w_event  # what the pool calls for pre-ping

    @functools.wraps(original)
    def ping(self: Any, dbapi_connection: Any) -> bool:
        counters.add("pings")
        return original(self, dbapi_connection)

    DefaultDialect._do_ping_w_event = ping  # type: ignore[method-assign]


def _count_django(counters: Counters) -> None:
    import sys

    if "django" not in sys.modules:
        return
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.utils import CursorWrapper

    local = threading.local()  # CursorDebugWrapper calls up to CursorWrapper: count once

    def counted(method: Any) -> Any:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(local, "inside", False):
                return method(self, *args, **kwargs)
            counters.add("statements")
            local.inside = True
            try:
                return method(self, *args, **kwargs)
            finally:
                local.inside = False

        return wrapper

    CursorWrapper.execute = counted(CursorWrapper.execute)  # type: ignore[method-assign]
    CursorWrapper.executemany = counted(CursorWrapper.executemany)  # type: ignore[method-assign]

    def ending(method: Any) -> Any:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.connection is not None and not self.autocommit:  # a real COMMIT/ROLLBACK
                counters.add("transactions_ends")
            return method(self, *args, **kwargs)

        return wrapper

    BaseDatabaseWrapper.commit = ending(BaseDatabaseWrapper.commit)  # type: ignore[method-assign]
    BaseDatabaseWrapper.rollback = ending(BaseDatabaseWrapper.rollback)  # type: ignore[method-assign]
    original_connect = BaseDatabaseWrapper.connect

    @functools.wraps(original_connect)
    def connect(self: Any) -> Any:
        counters.add("connects")
        return original_connect(self)

    BaseDatabaseWrapper.connect = connect  # type: ignore[method-assign]


def scheduler_class(scheduler: str) -> type:
    """The class ``celery beat -S`` loads for *scheduler* (a harness.SCHEDULER_CLASSES key)."""
    from celery.utils.imports import symbol_by_name

    from .harness import SCHEDULER_CLASSES

    name = SCHEDULER_CLASSES[scheduler]
    cls: type = symbol_by_name("celery_leasebeat:LeaseScheduler" if name == "leasebeat" else name)
    return cls


class _ErrorCounter(logging.Handler):
    def __init__(self, counters: Counters) -> None:
        super().__init__(logging.ERROR)
        self.counters = counters

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.counters.error(f"{record.name}: {record.getMessage()}")
        except Exception:  # a malformed record must not break beat
            self.counters.error(f"{record.name}: {record.msg!r}")


def _count_ticks(counters: Counters, scheduler: str) -> None:
    cls = scheduler_class(scheduler)
    owner = next(klass for klass in cls.__mro__ if "tick" in vars(klass))
    original = vars(owner)["tick"]
    if getattr(original, "_bench_counted", False):
        return
    local = threading.local()  # a tick calling super().tick() is still one cycle
    handler = _ErrorCounter(counters)

    @functools.wraps(original)
    def tick(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(local, "inside", False):
            return original(self, *args, **kwargs)
        root = logging.getLogger()
        if handler not in root.handlers:  # Celery sets up (and resets) logging after import
            root.addHandler(handler)
        errors = counters.values["errors"]
        local.inside = True
        started = time.perf_counter()
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            counters.add("failed_cycles")
            raise
        finally:
            local.inside = False
        if counters.values["errors"] > errors:
            counters.add("failed_cycles")
        else:
            counters.tick_done(time.perf_counter() - started)
        return result

    tick._bench_counted = True  # type: ignore[attr-defined]
    owner.tick = tick  # type: ignore[attr-defined]
