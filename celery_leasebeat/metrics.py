"""Prometheus metrics, all named ``leasebeat_*``, with low-cardinality labels.

Beat serves them on ``leasebeat_metrics_port``. A worker serves them on
``leasebeat_worker_metrics_port`` from its main process in prometheus-client's
multiprocess mode, so that what every prefork child records is summed, not lost: the
worker points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder (unless it is set already)
before any metric exists, and marks each child's files dead when the child exits.

Metrics are created on first use, never at import, because multiprocess mode must be
chosen before the first metric is made.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from functools import cache
from typing import Any

logger = logging.getLogger("celery_leasebeat.metrics")

_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, float("inf"))
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600, float("inf"))
_lock = threading.Lock()


class Metrics:
    """The instruments; one instance per process (see :func:`metrics`)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.runs = Counter(
            "leasebeat_runs_total",
            "Runs by schedule and outcome (succeeded, failed, skipped, missed, lost).",
            ["schedule", "outcome"],
        )
        self.run_duration = Histogram(
            "leasebeat_run_duration_seconds", "How long runs took.", ["schedule"], buckets=_DURATION_BUCKETS
        )
        # Not per schedule: it measures whether beat keeps up, and one series per schedule
        # would cost a histogram per schedule on each replica (and in Prometheus) for it.
        self.dispatch_lag = Histogram(
            "leasebeat_dispatch_lag_seconds", "Publish time minus the nominal occurrence.", buckets=_LAG_BUCKETS
        )
        self.start_lag = Histogram(
            "leasebeat_start_lag_seconds",
            "Start of the task body minus the nominal occurrence.",
            ["schedule"],
            buckets=_LAG_BUCKETS,
        )
        self.claims = Counter("leasebeat_claims_total", "Occurrences claimed by this beat replica.")
        self.lease_expiries = Counter(
            "leasebeat_lease_expiries_total",
            "Occurrences claimed again because their lease expired without an outcome.",
            ["schedule"],
        )
        self.missed = Counter(
            "leasebeat_missed_occurrences_total",
            "Occurrences that did not run: dropped after a late or overrunning run, or not claimed within grace.",
            ["schedule"],
        )
        self.alerts = Counter(
            "leasebeat_run_alerts_total",
            "Runs flagged by missed-run detection (reason: late_start, overrun).",
            ["schedule", "reason"],
        )
        self.api_refusals = Counter(
            "leasebeat_api_refusals_total",
            "HTTP triggers refused (reason: unauthorized, cap_job_type, cap_overall).",
            ["job_type", "reason"],
        )
        self.cycle = Histogram(
            "leasebeat_cycle_seconds", "Duration of one beat cycle (probe, claim, publish).", buckets=_LAG_BUCKETS
        )


@cache
def metrics() -> Metrics:
    """This process's instruments, created on first use."""
    with _lock:
        return Metrics()


def serve_beat_metrics(port: int, address: str = "0.0.0.0") -> Any:
    """Serve this process's registry on *port* (beat)."""
    from prometheus_client import start_http_server

    metrics()
    return start_http_server(port, addr=address)


def prepare_worker_multiprocess() -> str:
    """Choose multiprocess mode for a worker, before any metric exists; return the folder."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        return folder  # the user's: prometheus-client chose multiprocess mode at import
    folder = tempfile.mkdtemp(prefix="leasebeat-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # re-read the variable just set
    return folder


def serve_worker_metrics(port: int, address: str = "0.0.0.0") -> Any:
    """Serve the sum over every process of the worker on *port* (the worker's main process)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return start_http_server(port, addr=address, registry=registry)


def mark_process_dead(pid: int) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
