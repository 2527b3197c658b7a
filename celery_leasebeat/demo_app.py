"""The demo's Celery app: the embedded default, no server anywhere.

The schedule table is a SQLite file and the broker is kombu's ``filesystem://`` transport,
both in the folder named by ``LEASEBEAT_DEMO_DIR``. ``python -m celery_leasebeat.demo``
runs two beat replicas and a worker on it.
"""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from pathlib import Path

from celery import Celery

from celery_leasebeat import register_schedule

folder = Path(os.environ.get("LEASEBEAT_DEMO_DIR", "leasebeat-demo")).resolve()
messages = folder / "broker"
messages.mkdir(parents=True, exist_ok=True)

app = Celery("demo", broker="filesystem://")
app.conf.update(
    broker_transport_options={
        "data_folder_in": str(messages),
        "data_folder_out": str(messages),
        "control_folder": str(folder / "control"),
    },
    broker_connection_retry_on_startup=True,
    result_expires=None,
    leasebeat_database_url=f"sqlite:///{folder / 'schedules.sqlite'}",
    leasebeat_polling_interval=1,
    leasebeat_lease_seconds=15,
    # An existing beat_schedule runs unchanged next to register_schedule() calls.
    beat_schedule={"heartbeat-every-3s": {"task": "demo.heartbeat", "schedule": timedelta(seconds=3)}},
)


@app.task(name="demo.greet")
def greet(who: str) -> str:
    time.sleep(random.uniform(0.01, 0.2))
    return f"hello, {who}"


@app.task(name="demo.heartbeat")
def heartbeat() -> None:
    time.sleep(0.05)


@app.task(name="demo.flaky")
def flaky() -> None:
    if random.random() < 0.3:
        raise RuntimeError("the demo fails this one on purpose")


register_schedule(greet, "*/2 * * * * *", name="greet-every-2s", args=["world"])
register_schedule(flaky, "*/5 * * * * *", name="flaky-every-5s", timezone="Europe/Berlin")
