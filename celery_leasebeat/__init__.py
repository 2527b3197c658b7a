"""celery-leasebeat: a Celery beat scheduler that runs on every host and dispatches each
occurrence exactly once, by claiming it with a lease in a SQL table.

Importing this package also connects the worker-side result handler, so a worker whose app
module imports ``celery_leasebeat`` records every run's outcome with nothing else to do.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"  # before the imports: modules below read it

from .config import LeaseBeatConfig
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidCron,
    InvalidSchedule,
    LeaseBeatError,
    UnknownSchedule,
    UnknownTimezone,
)
from .history import purge_history
from .outbound import call_job
from .recorder import connect_signals
from .registry import register_schedule
from .scheduler import LeaseScheduler

__all__ = [
    "ConfigurationError",
    "DatabaseUnavailable",
    "InvalidCron",
    "InvalidSchedule",
    "LeaseBeatConfig",
    "LeaseBeatError",
    "LeaseScheduler",
    "UnknownSchedule",
    "UnknownTimezone",
    "__version__",
    "call_job",
    "purge_history",
    "register_schedule",
    "set_override",
]


def set_override(app: Any, name: str, cron: str | None) -> Any:
    """Retime schedule *name* without a release: persist *cron* as the operator's override
    (None or blank clears it). Every replica follows it from its next cycle. Returns the
    schedule's next run time."""
    from .binding import store_for

    return store_for(app).set_override(name, cron)


connect_signals()
