"""The example project of compose.yaml: an ordinary Celery app that uses leasebeat.

Run it with any number of beat replicas:

    celery -A proj beat -S leasebeat --enable-remote-control
    celery -A proj worker -E
"""

import os

from celery import Celery

import celery_leasebeat  # noqa: F401  (connects the worker-side result handler)
from celery_leasebeat import register_schedule

# CELERY_BROKER_URL and LEASEBEAT_DATABASE_URL come from the environment (see compose.yaml).
app = Celery("proj")
app.conf.update(
    broker_connection_retry_on_startup=True,
    leasebeat_polling_interval=float(os.environ.get("LEASEBEAT_POLLING_INTERVAL", "5")),
    leasebeat_metrics_port=os.environ.get("LEASEBEAT_METRICS_PORT"),
    leasebeat_history_retention_days=30,
)


@app.task
def purge_audit_rows() -> int:
    return 0  # a real project deletes old rows here, capped per run


@app.task
def refresh_dashboard() -> str:
    return "refreshed"


register_schedule(purge_audit_rows, "15 3 * * *", timezone="Europe/Berlin")
register_schedule(refresh_dashboard, "*/10 * * * * *")
