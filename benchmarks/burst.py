"""Burst: N crontab schedules all due at the same minute boundary and no worker; the time
from the boundary until the last of the N messages is in the broker (Redis). Floor: how fast
one process publishes the same Celery task messages to the same broker, so each rate is also
a fraction of it."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from .harness import Settings, cleanup, declare, delete_queue, environment, prepare_django, start_beat, stop, workdir

UTC = timezone.utc


@dataclass
class Burst:
    scheduler: str
    schedules: int
    complete: bool
    seconds: float | None  # boundary -> last message in the broker
    first_seconds: float | None  # boundary -> first message
    delivered: int
    rate: float | None  # messages per second over the burst
    replicas: int = 1


def publishing_floor(settings: Settings, count: int) -> float:
    """Messages per second one process publishes with Celery's apply_async over one connection."""
    from celery import Celery

    queue = f"floor-{uuid.uuid4().hex[:8]}"
    app = Celery("floor", broker=settings.redis, set_as_current=False)
    app.conf.task_default_queue = queue

    @app.task(name="bench.noop", shared=False)
    def noop(name: str = "") -> None: ...

    declare(settings.redis, queue)
    with app.producer_or_acquire() as producer:
        began = time.perf_counter()
        for i in range(count):
            noop.apply_async((f"bench-{i:06d}",), producer=producer)
        elapsed = time.perf_counter() - began
    delete_queue(settings.redis, queue)
    return count / elapsed


def burst(settings: Settings, scheduler: str, count: int, timeout: float, replicas: int = 1) -> Burst:
    """One burst of *count* schedules with *replicas* beat processes of *scheduler*."""
    from kombu import Connection

    run_id = uuid.uuid4().hex[:8]
    queue, prefix = f"burst-{run_id}", f"b{run_id}_"
    warmup = 12 + count / 1000 * 1.5  # time to start, load and sync the schedules
    boundary = (datetime.now(UTC) + timedelta(seconds=warmup)).replace(second=0, microsecond=0) + timedelta(minutes=1)
    env = environment(settings, scheduler, prefix, queue, BENCH_N=count, BENCH_MINUTE=boundary.minute)
    if scheduler == "django":
        prepare_django(env, count, minute=boundary.minute)
    declare(settings.redis, queue)
    folder = workdir(scheduler)
    beats = [start_beat(env, scheduler, folder, f"beat{i}") for i in range(replicas)]
    first = last = None
    delivered = 0
    try:
        with Connection(settings.redis) as connection:
            client = connection.default_channel.client
            deadline = boundary.timestamp() + timeout
            while time.time() < deadline:
                delivered = int(client.llen(queue))
                now = time.time()
                if delivered and first is None:
                    first = now
                if delivered >= count:
                    last = now
                    break
                if any(beat.poll() is not None for beat in beats):
                    break
                time.sleep(0.005 if now > boundary.timestamp() - 1 else 0.2)
            client.delete(queue)
    finally:
        for beat in beats:
            stop(beat)
        cleanup(scheduler, settings, prefix)
    start = boundary.timestamp()
    seconds = None if last is None else max(last - start, 1e-3)
    return Burst(
        scheduler=scheduler,
        schedules=count,
        complete=last is not None,
        seconds=seconds,
        first_seconds=None if first is None else first - start,
        delivered=delivered,
        rate=None if seconds is None else count / seconds,
        replicas=replicas,
    )
