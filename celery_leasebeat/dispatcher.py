"""Publishing claimed occurrences as Celery tasks: beat's cycle and ``leasebeat trigger``
share this, so a triggered run takes exactly the path of a scheduled one."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
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
    """Publishing failed on a broker error: the claims known unpublished were released, and
    those whose delivery is uncertain (a failed batch flush) were left to their publish lease."""


@dataclass
class _Outcome:
    """What became of a claim batch's publish."""

    published: list[ClaimedRun] = field(default_factory=list)
    #: Known not to have reached the broker: released at once for the next cycle.
    unpublished: list[ClaimedRun] = field(default_factory=list)
    #: The batch's flush failed: some may have arrived. Left to their publish lease.
    uncertain: list[ClaimedRun] = field(default_factory=list)
    error: str | None = None


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
        outcome = self._publish(to_publish, now)
        if outcome.published:
            logger.info(
                "beat: dispatched %d occurrence(s): %s",
                len(outcome.published),
                ", ".join(c.label for c in outcome.published[:5]) + (" ..." if len(outcome.published) > 5 else ""),
            )
            self.store.mark_dispatched(outcome.published)
        if outcome.unpublished:
            self.store.release(outcome.unpublished, f"publish failed: {outcome.error}")
            raise BrokerUnavailable(
                f"{outcome.error}; released {len(outcome.unpublished)} claimed occurrence(s) for retry"
            )
        if outcome.uncertain:
            # Not released: a copy that did arrive may be starting under this lease. The
            # publish lease expires soon; then a copy not yet started is fenced off and the
            # occurrence is claimed and published again.
            raise BrokerUnavailable(
                f"{outcome.error}; delivery of {len(outcome.uncertain)} occurrence(s) is uncertain: "
                f"they are dispatched again when their publish lease expires unless a worker starts them"
            )
        return outcome.published

    def _publish(self, claims: list[ClaimedRun], now: datetime) -> _Outcome:
        """Publish in order, as one batch where the transport allows it (see :func:`_batch`).

        On a broker error while building the batch nothing of it was sent (a transport that
        publishes message by message sent those before): the rest is unpublished. When the
        batch's flush fails, delivery is uncertain. A message that cannot be built at all is
        recorded failed and the schedule advances, so one bad row cannot block the others."""
        outcome = _Outcome()
        if not claims:
            return outcome
        try:
            producer = self._connect()
        except Exception as exc:
            self.close()
            outcome.unpublished, outcome.error = claims, _describe(exc)
            return outcome
        # RuntimeError: kombu's batch refusing a message (its channel replaced by a retry).
        broker_errors: tuple[type[BaseException], ...] = (*self._connection_errors(), *_BATCH_ERRORS, RuntimeError)
        batched = bool(getattr(producer, "supports_batch_publish", False))
        sent: list[ClaimedRun] = []
        flushing = False
        started = time.monotonic()
        try:
            with _batch(producer):
                for index, claim in enumerate(claims):
                    try:
                        self._send(claim, producer)
                    except broker_errors:
                        # Out of the batch with the error: kombu discards what it buffered.
                        outcome.unpublished = (sent if batched else []) + claims[index:]
                        sent = [] if batched else sent
                        raise
                    except Exception as exc:
                        reason = f"could not be published: {_describe(exc)}"
                        logger.error("beat: %s %s", claim.label, reason)
                        self.store.give_up(claim, now, reason, outcome=RunState.FAILED)
                        metrics().runs.labels(claim.schedule, RunState.FAILED).inc()
                        continue
                    sent.append(claim)
                flushing = True
        except broker_errors as exc:
            outcome.error = _describe(exc)
            if flushing:
                outcome.uncertain, sent = sent, []
        if outcome.error is not None:
            self.close()
        outcome.published = sent
        # The publish time on the database clock: the cycle's clock plus time spent since.
        elapsed = time.monotonic() - started
        for claim in outcome.published:
            lag = (now - claim.occurrence).total_seconds() + elapsed
            metrics().dispatch_lag.observe(max(lag, 0.0))
        return outcome

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


#: Larger than any claim batch: kombu flushes a batch when its buffer reaches this, and the
#: flush must happen at the end (where its failure is known to concern the whole batch).
_UNBOUNDED_BATCH = 2**31


@contextmanager
def _batch(producer: Any) -> Iterator[None]:
    """Publish a claim's batch as one batch where the transport supports it (kombu 5.7's
    ``Producer.batch``: one Redis pipeline instead of a round trip per message), resolving
    each exchange's bindings once rather than per message (kombu's virtual transports read
    them from the broker for every publish). Other transports publish message by message."""
    channel = producer.channel
    get_table = getattr(channel, "get_table", None)
    if get_table is not None:
        tables: dict[tuple[str, int], Any] = {}
        declared = producer.connection.declared_entities

        def cached_table(exchange: str) -> Any:
            # Keyed by what this connection has declared: a queue bound mid-batch is seen.
            key = (exchange, len(declared))
            if key not in tables:
                tables[key] = get_table(exchange)
            return tables[key]

        channel.get_table = cached_table  # shadows the method on this channel for the batch
    try:
        with producer.batch(max_size=_UNBOUNDED_BATCH) if hasattr(producer, "batch") else nullcontext():
            yield
    finally:
        if get_table is not None:
            del channel.get_table


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
