"""The ``leasebeat_*`` Celery settings, read once per app into one validated object.

Every setting is an ordinary Celery setting (``app.conf.leasebeat_lease_seconds = 60``, or
``LEASEBEAT_LEASE_SECONDS`` in a config module with a namespace). A malformed value raises
:class:`~celery_leasebeat.errors.ConfigurationError` naming the setting when beat starts,
not at 03:00 when the first run is due.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError

#: The embedded default: a SQLite file in the working directory, so a laptop with no
#: database server still runs beat, its replicas and a worker against one shared table.
DEFAULT_DATABASE_URL = "sqlite:///leasebeat.sqlite"
#: Upper bound of beat's sleep: the longest a replica waits before it notices a change made
#: elsewhere (an operator edit, a dead replica's expired lease). The smart wait is shorter
#: whenever something can become due sooner.
DEFAULT_POLLING_INTERVAL = 30.0
#: How long a claim holds an occurrence without a sign of life. A running task extends its
#: lease every third of this, so it bounds the recovery time after a killed worker, not the
#: length of a job.
DEFAULT_LEASE_SECONDS = 300.0
#: Occurrences claimed per statement: big enough to drain a burst in few round trips, small
#: enough that one claim's locks and IN-lists stay cheap.
DEFAULT_BATCH_SIZE = 500
#: Dispatches of one occurrence without any outcome before it is recorded as lost. A worker
#: killed mid-run is recovered by the second attempt; a worker that never reports (the
#: result handler is not installed) must not re-run the job forever.
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_TABLE_PREFIX = "leasebeat_"
#: The history purge (off unless leasebeat_history_retention_days is set) deletes at most
#: this many ledger rows per run: a backlog drains over several runs, none of them long.
DEFAULT_PURGE_BATCH_SIZE = 10_000
#: Hourly, so a busy ledger (a per-second schedule adds 86,400 rows a day) keeps up.
DEFAULT_PURGE_CRON = "17 * * * *"

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class LeaseBeatConfig:
    """The validated ``leasebeat_*`` settings of one app."""

    database_url: str = DEFAULT_DATABASE_URL
    polling_interval: float = DEFAULT_POLLING_INTERVAL
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    batch_size: int = DEFAULT_BATCH_SIZE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    table_prefix: str = DEFAULT_TABLE_PREFIX
    schema: str | None = None
    #: Cron overrides by schedule name, from configuration; an override persisted in the
    #: table by :func:`celery_leasebeat.set_override` wins over these.
    overrides: dict[str, str] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)
    #: Where beat serves Prometheus metrics; None: not served.
    metrics_port: int | None = None
    #: Where a worker's main process serves the metrics of all its pool processes.
    worker_metrics_port: int | None = None
    #: Ledger rows finished longer ago than this are purged; None: never (no purge schedule).
    history_retention_days: float | None = None
    purge_batch_size: int = DEFAULT_PURGE_BATCH_SIZE
    purge_cron: str = DEFAULT_PURGE_CRON
    #: Refuse to start beat when a schedule names a task the app does not know.
    check_tasks: bool = True
    #: The HTTP API's bearer tokens: the current one and the previous one (rotation).
    api_token: str | None = field(default=None, repr=False)
    api_previous_token: str | None = field(default=None, repr=False)
    #: Triggered runs per UTC day over every job type; None: no overall cap.
    api_daily_cap: int | None = None
    #: "production" unless said otherwise; DEV_AUTH=1 is honoured only in "local" or "dev".
    environment: str = "production"
    #: A TOML file of schedules kept next to the code (see docs/http-api.md).
    schedule_file: str | None = None

    @property
    def heartbeat_interval(self) -> float:
        """How often a running task extends its lease."""
        return max(self.lease_seconds / 3.0, 0.2)

    @classmethod
    def from_app(cls, app: Any) -> LeaseBeatConfig:
        """Return the app's config, read and validated on first use and cached on the app."""
        cached = getattr(app, "_leasebeat_config", None)
        if cached is None:
            cached = cls.from_mapping(app.conf)
            app._leasebeat_config = cached
        return cached

    @classmethod
    def from_mapping(cls, conf: Any) -> LeaseBeatConfig:
        def get(name: str, default: Any) -> Any:
            value = conf.get(f"leasebeat_{name}")
            return default if value is None else value

        url = get("database_url", os.environ.get("LEASEBEAT_DATABASE_URL", DEFAULT_DATABASE_URL))
        if not isinstance(url, str) or "://" not in url:
            raise ConfigurationError(
                f"leasebeat_database_url must be an SQLAlchemy URL such as "
                f"'postgresql+psycopg://user@host/db', got {url!r}"
            )
        prefix = get("table_prefix", DEFAULT_TABLE_PREFIX)
        if not isinstance(prefix, str) or (prefix and not _IDENTIFIER.match(prefix)):
            raise ConfigurationError(f"leasebeat_table_prefix must be letters, digits and underscores, got {prefix!r}")
        schema = get("schema", None)
        if schema is not None and not (isinstance(schema, str) and _IDENTIFIER.match(schema)):
            raise ConfigurationError(f"leasebeat_schema must be an identifier, got {schema!r}")
        overrides = get("overrides", {})
        if not isinstance(overrides, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in overrides.items()
        ):
            raise ConfigurationError(f"leasebeat_overrides must map schedule names to cron strings, got {overrides!r}")
        engine_options = get("engine_options", {})
        if not isinstance(engine_options, dict):
            raise ConfigurationError(f"leasebeat_engine_options must be a dict, got {engine_options!r}")
        return cls(
            database_url=url,
            polling_interval=_positive_number("polling_interval", get("polling_interval", DEFAULT_POLLING_INTERVAL)),
            lease_seconds=_positive_number("lease_seconds", get("lease_seconds", DEFAULT_LEASE_SECONDS)),
            batch_size=_positive_int("batch_size", get("batch_size", DEFAULT_BATCH_SIZE)),
            max_attempts=_positive_int("max_attempts", get("max_attempts", DEFAULT_MAX_ATTEMPTS)),
            table_prefix=prefix,
            schema=schema,
            overrides=dict(overrides),
            engine_options=dict(engine_options),
            metrics_port=_optional_port("metrics_port", get("metrics_port", None)),
            worker_metrics_port=_optional_port("worker_metrics_port", get("worker_metrics_port", None)),
            history_retention_days=(
                None
                if get("history_retention_days", None) is None
                else _positive_number("history_retention_days", get("history_retention_days", None), "days")
            ),
            purge_batch_size=_positive_int("purge_batch_size", get("purge_batch_size", DEFAULT_PURGE_BATCH_SIZE)),
            purge_cron=_cron_text("purge_cron", get("purge_cron", DEFAULT_PURGE_CRON)),
            check_tasks=bool(get("check_tasks", True)),
            api_token=_optional_text("api_token", get("api_token", os.environ.get("LEASEBEAT_API_TOKEN"))),
            api_previous_token=_optional_text(
                "api_previous_token", get("api_previous_token", os.environ.get("LEASEBEAT_API_PREVIOUS_TOKEN"))
            ),
            api_daily_cap=(
                None if get("api_daily_cap", None) is None else _positive_int("api_daily_cap", get("api_daily_cap", 1))
            ),
            environment=str(get("environment", os.environ.get("LEASEBEAT_ENVIRONMENT", "production"))).lower(),
            schedule_file=_optional_text("schedule_file", get("schedule_file", None)),
        )


def _positive_number(name: str, value: Any, unit: str = "seconds") -> float:
    try:
        number = float(value)
        if isinstance(value, bool) or not number > 0 or number != number or number == float("inf"):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigurationError(f"leasebeat_{name} must be a positive number of {unit}, got {value!r}") from None
    return number


def _optional_port(name: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool) or float(value) != int(value) or not 0 < int(value) < 65536:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"leasebeat_{name} must be a TCP port (1-65535), got {value!r}") from None
    return int(value)


def _optional_text(name: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"leasebeat_{name} must be a string")  # never echo a secret
    return value.strip()


def _cron_text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"leasebeat_{name} must be a cron expression, got {value!r}")
    return value.strip()


def _positive_int(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool) or float(value) != int(value) or int(value) < 1:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"leasebeat_{name} must be a positive whole number, got {value!r}") from None
    return int(value)
