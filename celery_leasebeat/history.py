"""The package's own first schedule: the ledger retention purge.

It is registered only when ``leasebeat_history_retention_days`` is set; it then runs on
``leasebeat_purge_cron`` (hourly at :17 by default) through the scheduler like any other
schedule, deleting at most ``leasebeat_purge_batch_size`` rows per run.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import shared_task

from .binding import store_for
from .config import LeaseBeatConfig
from .registry import PURGE_TASK


@shared_task(name=PURGE_TASK, bind=True, ignore_result=True)
def purge_history(self: Any) -> dict[str, Any]:
    """Delete ledger rows finished longer ago than the retention, capped per run."""
    config = LeaseBeatConfig.from_app(self.app)
    if config.history_retention_days is None:
        return {"deleted": 0, "reason": "leasebeat_history_retention_days is not set"}
    deleted = store_for(self.app).purge_runs(
        timedelta(days=config.history_retention_days), limit=config.purge_batch_size
    )
    return {"deleted": deleted, "capped": deleted >= config.purge_batch_size}
