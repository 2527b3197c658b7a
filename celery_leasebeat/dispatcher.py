"""Publishing claimed occurrences as Celery tasks: beat's cycle and ``leasebeat trigger``
share this, so a triggered run takes exactly the path of a scheduled one."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Any

import kombu.exceptions
from kombu.exceptions import OperationalError as BrokerOperationalError

from .config import LeaseBeatConfig
from .metrics import metrics
from .recorder import HEADER_OCCURRENCE, HEADER_SCHEDULE, HEADER_TOKEN
from .store import ClaimedRun, RunState, Store

logger = logging.getLogger("celery_leasebeat.dispatcher")

#: A batch publish that failed at its flush (kombu 5.7+).
_BATCH_ERRORS: tuple[type[BaseException], ...] = tuple(
    error for error in [getattr(kombu.exceptions, "BatchPublishError", None)] if error is not None
)


class BrokerUnavailable(Exception):
    """Publishing failed on a connection error; the unpublished claims were released."""


class Dispatcher:
    """Publishes claims over one producer connection, kept open between batches."""

    def __init__(self, app: Any, store: Store, config: LeaseBeatConfig, producer_class: Any = None) -> None:
        self.app = app
        self.store = store
        self.config = config
        self._producer_class = type("LeaseBeatProducer", (_DeclaringOnce, producer_class or app.amqp.Producer), {})
        self._producer: Any = None

    def dispatch(self, claims: list[ClaimedRun], now: datetime) -> list[ClaimedRun]:
        """Publish *claims* (one claim's batch); return those published.

        An occurrence claimed later than its schedule's grace is recorded missed instead, and
        one dispatched ``leasebeat_max_attempts`` times without any outcome is recorded lost.
        On a broker error the rest of the batch is released at once, so the next cycle claims
        it again, and :class:`BrokerUnavailable` is raised.
        """
        to_publish = []
        for claim in claims:
            late = (now - claim.occurrence).total_seconds()
            if claim.grace_seconds is not None and claim.attempt == 1 and late > claim.grace_seconds:
                reason = f"not claimed within its grace of {claim.grace_seconds:g}s (claimed {late:.0f}s late)"
                logger.warning("beat: %s recorded as missed: %s", claim.label, reason)
                finished = self.store.give_up(claim, now, reason, outcome=RunState.MISSED)
                metrics().runs.labels(claim.schedule, RunState.MISSED).inc()
                metrics().missed.labels(claim.schedule).inc(1 + finished.missed)
                continue
            if claim.attempt > self.config.max_attempts:
                reason = (
                    f"no outcome after {claim.attempt - 1} dispatches: the run never reported "
                    f"back (are the workers importing celery_leasebeat?)"
                )
                logger.warning("beat: %s recorded as lost: %s", claim.label, reason)
                self.store.give_up(claim, now, reason)
                metrics().runs.labels(claim.schedule, RunState.LOST).inc()
                continue
            if claim.attempt > 1:
                metrics().lease_expiries.labels(claim.schedule).inc()
                logger.warning(
                    "beat: no outcome arrived for %s within its lease; dispatching it again "
                    "(attempt %d of %d). Workers record outcomes only when they import celery_leasebeat.",
                    claim.label,
                    claim.attempt,
                    self.config.max_attempts,
                )
            to_publish.append(claim)
        published, unpublished, broker_error = self._publish(to_publish, now)
        if published:
            logger.info(
                "beat: dispatched %d occurrence(s): %s",
                len(published),
                ", ".join(c.label for c in published[:5]) + (" ..." if len(published) > 5 else ""),
            )
            self.store.mark_dispatched(published)
        if unpublished:
            self.store.release(unpublished, f"publish failed: {broker_error}")
            raise BrokerUnavailable(f"{broker_error}; released {len(unpublished)} claimed occurrence(s) for retry")
        return published

    def _publish(
        self, claims: list[ClaimedRun], now: datetime
    ) -> tuple[list[ClaimedRun], list[ClaimedRun], str | None]:
        """Publish in order, as one batch where the transport allows it (see :func:`_batch`).
        On a broker error, stop and return the rest as unpublished (all of them when the
        batch's flush failed); a message that cannot be built at all is recorded failed and
        the schedule advances, so one bad row cannot block the others."""
        if not claims:
            return [], [], None
        try:
            producer = self._connect()
        except Exception as exc:
            self.close()
            return [], claims, _describe(exc)
        published: list[ClaimedRun] = []
        unpublished: list[ClaimedRun] = []
        error = None
        started = time.monotonic()
        try:
            with _batch(producer, len(claims)):
                for index, claim in enumerate(claims):
                    try:
                        self._send(claim, producer)
                    except self._connection_errors() as exc:
                        unpublished, error = claims[index:], _describe(exc)
                        break
                    except Exception as exc:
                        reason = f"could not be published: {_describe(exc)}"
                        logger.error("beat: %s %s", claim.label, reason)
                        self.store.give_up(claim, now, reason, outcome=RunState.FAILED)
                        metrics().runs.labels(claim.schedule, RunState.FAILED).inc()
                        continue
                    published.append(claim)
        except (*self._connection_errors(), *_BATCH_ERRORS) as exc:
            # The batch's flush failed: none of it is known to be delivered. Released, it is
            # claimed and published again; a message that did arrive carries the old lease
            # token, so the worker's fenced start refuses it.
            published, unpublished, error = [], published + unpublished, _describe(exc)
        if error is not None:
            self.close()
        # The publish time on the database clock: the cycle's clock plus time spent since.
        elapsed = time.monotonic() - started
        for claim in published:
            lag = (now - claim.occurrence).total_seconds() + elapsed
            metrics().dispatch_lag.observe(max(lag, 0.0))
        return published, unpublished, error

    def _send(self, claim: ClaimedRun, producer: Any) -> None:
        options = dict(claim.options)
        headers = dict(options.pop("headers", None) or {})
        headers.update(
            {
                HEADER_SCHEDULE: claim.schedule,
                HEADER_OCCURRENCE: claim.occurrence.isoformat(),
                HEADER_TOKEN: claim.lease_token,
                "celery_beat_task": True,
            }
        )
        for reserved in ("task_id", "producer", "kwargsrepr"):
            options.pop(reserved, None)
        arguments = dict(
            task_id=claim.run_id,
            headers=headers,
            producer=producer,
            # What Flower and worker logs show as the kwargs: the schedule and occurrence at a
            # glance, while the task keeps its own name (Flower filters and labels by name).
            kwargsrepr=f"{claim.kwargs!r} [leasebeat {claim.label}]",
            **options,
        )
        task = self.app.tasks.get(claim.task)
        if task is not None:
            task.apply_async(claim.args, claim.kwargs, **arguments)
        else:
            self.app.send_task(claim.task, claim.args, claim.kwargs, **arguments)

    def _connect(self) -> Any:
        if self._producer is None:
            connection = self.app.connection_for_write()
            try:
                # Bounded: claims are held while this runs, and an outage is beat's back-off's job.
                connection.ensure_connection(max_retries=2, interval_start=0.2, interval_step=0.4, interval_max=1)
            except Exception:
                connection.release()
                raise
            self._producer = self._producer_class(connection, auto_declare=False)
        return self._producer

    def _connection_errors(self) -> tuple[type[BaseException], ...]:
        """What the broker raises when it is away: kombu's own and the transport's."""
        connection = self._producer.connection
        return (BrokerOperationalError, *connection.connection_errors, *connection.channel_errors)

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.connection.release()
            except Exception:  # already broken; nothing more to free
                logger.debug("beat: error closing the broker connection", exc_info=True)


class _DeclaringOnce:
    """Producer mixin: an entity this connection declared already costs nothing more. kombu
    checks the same per-connection cache, but only after copying the entity to bind it, on
    every publish; Celery asks for the queue's declaration with every task message."""

    connection: Any

    def maybe_declare(self, entity: Any, retry: bool = False, **retry_policy: Any) -> Any:
        if entity and entity.can_cache_declaration and hash(entity) in self.connection.declared_entities:
            return False
        return super().maybe_declare(entity, retry, **retry_policy)  # type: ignore[misc]


@contextmanager
def _batch(producer: Any, size: int) -> Iterator[None]:
    """Publish a claim's batch as one batch where the transport supports it (kombu 5.7's
    ``Producer.batch``: one Redis pipeline instead of a round trip per message), resolving
    each exchange's bindings once rather than per message (kombu's virtual transports read
    them from the broker for every publish). Other transports publish message by message."""
    channel = producer.channel
    get_table = getattr(channel, "get_table", None)
    if get_table is not None:
        tables: dict[str, Any] = {}

        def cached_table(exchange: str) -> Any:
            if exchange not in tables:
                tables[exchange] = get_table(exchange)
            return tables[exchange]

        channel.get_table = cached_table  # shadows the method on this channel for the batch
    try:
        with producer.batch(max_size=max(size, 1)) if hasattr(producer, "batch") else nullcontext():
            yield
    finally:
        if get_table is not None:
            del channel.get_table


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
