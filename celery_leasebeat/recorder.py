"""The worker side: run each delivered occurrence at most once and record what happened.

Importing ``celery_leasebeat`` connects this to every Celery app in the process. When a
worker starts, each task's ``run`` is wrapped once; the wrapper does nothing for ordinary
messages, and for a message beat dispatched (it carries the ``leasebeat_*`` headers) it:

1. marks the run started, fenced by the lease token, and skips the body (state IGNORED)
   when the token no longer holds the lease (a newer claim owns the occurrence) or the run
   already started or finished (a redelivered message);
2. keeps the lease alive from a heartbeat thread while the body runs;
3. records the outcome, the duration and the error, advances the schedule to its next
   occurrence and releases the lease, fenced by the token.

A pool child killed under a task (``WorkerLostError``, a hard time limit) never reaches
step 3; the worker's main process records that failure from ``task_failure``. A worker
killed outright records nothing: the lease expires and beat dispatches the occurrence
again under the same task id.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

from billiard.exceptions import WorkerLostError
from celery import signals
from celery.exceptions import Ignore, Reject, Retry, TimeLimitExceeded

from .binding import store_for
from .config import LeaseBeatConfig
from .errors import DatabaseUnavailable
from .metrics import mark_process_dead, metrics, prepare_worker_multiprocess, serve_worker_metrics
from .store import RunState, Store

logger = logging.getLogger("celery_leasebeat.recorder")

HEADER_SCHEDULE = "leasebeat_schedule"
HEADER_OCCURRENCE = "leasebeat_occurrence"
HEADER_TOKEN = "leasebeat_token"
#: Set by the HTTP API on an inline job: the most work the run may report.
HEADER_INLINE_CAP = "leasebeat_inline_cap"
#: Longest JSON summary of a return value kept on the ledger row.
MAX_RESULT_CHARS = 2000

#: A database blip at the start or the end of a run is retried this often before giving up
#: (then the lease expires and beat re-dispatches: at-least-once, never lost).
DATABASE_ATTEMPTS = 4
DATABASE_RETRY_SECONDS = 0.5

T = TypeVar("T")
UTC = timezone.utc


def wrap_tasks(app: Any) -> list[Any]:
    """Wrap the ``run`` of every task of *app* not wrapped yet; return the newly wrapped."""
    wrapped = []
    for task in list(app.tasks.values()):
        if getattr(task, "_leasebeat_wrapped", False):
            continue
        _wrap(task)
        wrapped.append(task)
    return wrapped


def _wrap(task: Any) -> None:
    original = task.run

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        request = task.request
        headers = getattr(request, "headers", None) or {}
        token = headers.get(HEADER_TOKEN) or getattr(request, HEADER_TOKEN, None)
        if not token or getattr(_running, "active", False):
            # An ordinary message, or a scheduled task calling its own run(): just the body.
            return original(*args, **kwargs)
        _running.active = True
        try:
            return _run_occurrence(task, request, headers, token, original, args, kwargs)
        finally:
            _running.active = False

    # An instance attribute: the tracer calls task.run (or task.__call__, which calls it).
    task.run = run
    task._leasebeat_wrapped = True


_running = threading.local()


def _header(request: Any, headers: dict[str, Any], name: str) -> Any:
    return headers.get(name) or getattr(request, name, None)


def _run_occurrence(
    task: Any,
    request: Any,
    headers: dict[str, Any],
    token: str,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    app = task.app
    config = LeaseBeatConfig.from_app(app)
    store = store_for(app)
    schedule = _header(request, headers, HEADER_SCHEDULE)
    occurrence = datetime.fromisoformat(_header(request, headers, HEADER_OCCURRENCE))
    run_id = request.id
    label = f"{schedule}@{occurrence.isoformat()}"
    try:
        decision = _retrying(
            lambda: store.start_run(
                schedule=schedule,
                run_id=run_id,
                token=token,
                worker=request.hostname or os.uname().nodename,
                lease_seconds=config.lease_seconds,
                retries=request.retries or 0,
            ),
            DATABASE_ATTEMPTS,
        )
    except DatabaseUnavailable as exc:
        logger.error("leasebeat: cannot start %s (task %s): %s; it will be dispatched again", label, run_id, exc)
        raise Ignore() from None
    if not decision.run:
        logger.warning("leasebeat: not running %s (task %s): %s", label, run_id, decision.reason)
        raise Ignore()

    heartbeat.add(store, config, schedule, token)
    metrics().start_lag.labels(schedule).observe(max((datetime.now(UTC) - occurrence).total_seconds(), 0.0))
    started = time.monotonic()
    outcome, error, retry_in, result = RunState.SUCCEEDED, None, 0.0, None
    try:
        value = body(*args, **kwargs)
        _enforce_inline_cap(_header(request, headers, HEADER_INLINE_CAP), value)
        result = _summary(value)
        return value
    except Retry as exc:
        outcome, retry_in = _RETRY, _seconds_until(exc.when)
        raise
    except (Ignore, Reject):
        outcome = RunState.SKIPPED
        raise
    except Exception as exc:
        outcome, error = RunState.FAILED, f"{type(exc).__name__}: {exc}"
        raise
    except BaseException:
        outcome = ""  # the process is going away: leave the lease to expire and re-dispatch
        raise
    finally:
        duration_ms = int((time.monotonic() - started) * 1000)
        try:
            if outcome == _RETRY:
                # The retried message (same token, higher retry count) may run anywhere later:
                # hold the lease until then instead of heartbeating it from here.
                _retrying(
                    lambda: store.hold_lease(schedule=schedule, token=token, seconds=retry_in + config.lease_seconds),
                    DATABASE_ATTEMPTS,
                )
            elif outcome:
                _record(store, config, outcome, schedule, run_id, token, occurrence, duration_ms, error, result)
        except DatabaseUnavailable as exc:
            logger.error("leasebeat: could not record %s of %s: %s; the lease will expire", outcome, label, exc)
        finally:
            heartbeat.discard(schedule, token)


_RETRY = "retry"


class InlineCapExceeded(Exception):
    """An inline job reported more work than its cap allows (or no count at all)."""


def _enforce_inline_cap(cap: Any, value: Any) -> None:
    if cap is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= int(cap):
        raise InlineCapExceeded(f"an inline job must return its count, at most its cap of {cap}; it returned {value!r}")


def _summary(value: Any) -> str | None:
    if value is None:
        return None
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return None
    return text if len(text) <= MAX_RESULT_CHARS else None


def _seconds_until(when: Any) -> float:
    if isinstance(when, datetime):
        moment = when if when.tzinfo else when.replace(tzinfo=UTC)
        return max((moment - datetime.now(UTC)).total_seconds(), 0.0)
    try:
        return max(float(when or 0), 0.0)
    except (TypeError, ValueError):
        return 0.0


def _record(
    store: Store,
    config: LeaseBeatConfig,
    outcome: str,
    schedule: str,
    run_id: str,
    token: str,
    occurrence: datetime,
    duration_ms: int,
    error: str | None,
    result: str | None,
) -> None:
    """Record the outcome. The lease is still heartbeated meanwhile, so a database blip
    shorter than about half a lease costs nothing: the write is retried until it lands."""
    attempts = max(DATABASE_ATTEMPTS, int(config.lease_seconds / 2 / DATABASE_RETRY_SECONDS))
    finished = _retrying(
        lambda: store.finish_run(
            schedule=schedule,
            run_id=run_id,
            token=token,
            occurrence=occurrence,
            outcome=outcome,
            duration_ms=duration_ms,
            error=error,
            result=result,
        ),
        attempts,
    )
    if finished:
        metrics().runs.labels(schedule, outcome).inc()
        metrics().run_duration.labels(schedule).observe(duration_ms / 1000)
        if finished.missed:
            metrics().missed.labels(schedule).inc(finished.missed)


def _retrying(operation: Callable[[], T], attempts: int) -> T:
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except DatabaseUnavailable as exc:
            if attempt == attempts:
                raise
            logger.warning("leasebeat: %s; retrying (%d of %d)", exc, attempt, attempts - 1)
            time.sleep(min(DATABASE_RETRY_SECONDS * attempt, 2.0))
    raise AssertionError("unreachable")


class _Heartbeat:
    """One daemon thread per process extending the leases of the runs executing in it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[tuple[str, str], tuple[Store, LeaseBeatConfig]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._wake = threading.Event()

    def add(self, store: Store, config: LeaseBeatConfig, schedule: str, token: str) -> None:
        with self._lock:
            self._leases[(schedule, token)] = (store, config)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="leasebeat-heartbeat", daemon=True)
                self._thread.start()

    def discard(self, schedule: str, token: str) -> None:
        with self._lock:
            self._leases.pop((schedule, token), None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                leases = dict(self._leases)
            interval = min((config.heartbeat_interval for _, config in leases.values()), default=1.0)
            self._wake.wait(interval)
            with self._lock:
                leases = {key: value for key, value in self._leases.items() if key in leases}
            by_store: dict[int, tuple[Store, LeaseBeatConfig, list[tuple[str, str]]]] = {}
            for (schedule, token), (store, config) in leases.items():
                by_store.setdefault(id(store), (store, config, []))[2].append((schedule, token))
            for store, config, pairs in by_store.values():
                try:
                    lost = store.extend_leases(pairs, config.lease_seconds)
                except Exception as exc:  # keep beating: the next round may reach the database
                    logger.warning("leasebeat: could not extend leases: %s", exc)
                    continue
                for name in lost:
                    logger.warning(
                        "leasebeat: the lease of running schedule %s was lost; another claim may run it", name
                    )


heartbeat = _Heartbeat()


_worker_name: dict[str, str] = {}


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    _worker_name["name"] = getattr(sender, "hostname", None) or os.uname().nodename
    wrap_tasks(app)
    port = LeaseBeatConfig.from_app(app).worker_metrics_port
    if port is not None:
        folder = prepare_worker_multiprocess()  # before the pool forks and before any metric exists
        serve_worker_metrics(port)
        logger.info("leasebeat: serving the worker's Prometheus metrics on port %d (%s)", port, folder)


def _on_worker_process_shutdown(pid: int | None = None, **_: Any) -> None:
    mark_process_dead(pid or os.getpid())


def _on_worker_process_init(**_: Any) -> None:
    from celery import current_app
    from celery.app.trace import build_tracer

    app = current_app._get_current_object()
    store = getattr(app, "_leasebeat_store", None)
    if store is not None:
        store.dispose(close=False)  # pooled connections must not cross a fork
    for task in wrap_tasks(app):  # registered after worker_init: rebuild their tracers
        if getattr(task, "__trace__", None) is not None:
            task.__trace__ = build_tracer(task.name, task, app.loader, app=app)


def _on_task_failure(sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any) -> None:
    """A pool child died under a task: only the main process hears of it. The dying
    delivery's request (and so its token) is on the task's request stack for a lost worker;
    for a hard time limit only this worker's name identifies it."""
    if not isinstance(exception, (WorkerLostError, TimeLimitExceeded)) or sender is None or task_id is None:
        return
    request = sender.request
    token = None
    if getattr(request, "id", None) == task_id:
        token = _header(request, getattr(request, "headers", None) or {}, HEADER_TOKEN)
    try:
        finished = store_for(sender.app).fail_run(
            run_id=task_id,
            error=f"{type(exception).__name__}: {exception}",
            token=token,
            worker=None if token else _worker_name.get("name", os.uname().nodename),
        )
    except Exception as exc:
        logger.error("leasebeat: could not record the failure of task %s: %s", task_id, exc)
        return
    if finished and finished.schedule is not None:
        metrics().runs.labels(finished.schedule, RunState.FAILED).inc()


def connect_signals() -> None:
    """Connect the worker-side handlers (idempotent; done when celery_leasebeat is imported)."""
    signals.worker_init.connect(_on_worker_init, weak=False, dispatch_uid="leasebeat-worker-init")
    signals.worker_process_init.connect(
        _on_worker_process_init, weak=False, dispatch_uid="leasebeat-worker-process-init"
    )
    signals.task_failure.connect(_on_task_failure, weak=False, dispatch_uid="leasebeat-task-failure")
    signals.worker_process_shutdown.connect(
        _on_worker_process_shutdown, weak=False, dispatch_uid="leasebeat-worker-process-shutdown"
    )
