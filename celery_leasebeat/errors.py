"""The exceptions celery-leasebeat raises: one root, one class per kind of mistake."""

from __future__ import annotations


class LeaseBeatError(Exception):
    """Root of every error raised by celery-leasebeat."""


class ConfigurationError(LeaseBeatError):
    """A ``leasebeat_*`` setting is malformed; the message names the setting."""


class InvalidSchedule(LeaseBeatError):
    """A schedule cannot be served: the message names the schedule and the bad value."""


class InvalidCron(InvalidSchedule):
    """A cron expression does not parse."""


class UnknownTimezone(InvalidSchedule):
    """A time zone is not a known IANA name."""


class UnknownSchedule(LeaseBeatError):
    """No schedule of that name exists in the schedule table."""


class MissingTables(LeaseBeatError):
    """The database has no leasebeat tables (and this caller must not create them)."""


class OutdatedTables(LeaseBeatError):
    """The leasebeat tables are at an older schema than this version: run ``leasebeat migrate``."""


class SchedulePaused(LeaseBeatError):
    """The schedule is paused: it cannot be triggered until it is resumed."""


class UnknownJob(LeaseBeatError):
    """No run with that id exists in the ledger."""


class SpendCapExceeded(LeaseBeatError):
    """A daily cap on triggered runs is reached; ``retry_after`` is the seconds until it resets."""

    def __init__(self, message: str, *, retry_after: int, scope: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.scope = scope


class DatabaseUnavailable(LeaseBeatError):
    """The schedule database could not be reached; the operation may be retried."""


class DatabaseConflict(DatabaseUnavailable):
    """The database aborted a transaction to break a deadlock; retry it at once."""
