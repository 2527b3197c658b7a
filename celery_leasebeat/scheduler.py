"""``LeaseScheduler``: the Celery beat scheduler, thin glue over the store.

Each ``tick`` is one cycle: read the database clock (one indexed probe), claim the due
occurrences in batches, publish each as a Celery task under its deterministic run id over
one producer connection, and return how long to sleep: until the earliest moment anything
can become due, capped by the polling interval.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery.beat import Scheduler

from . import __version__
from .binding import store_for
from .config import LeaseBeatConfig
from .dispatcher import BrokerUnavailable, Dispatcher
from .errors import DatabaseConflict, DatabaseUnavailable, InvalidSchedule
from .metrics import metrics, serve_beat_metrics
from .registry import collect_definitions, registrations
from .store import Probe, RunState, ScheduleDefinition, Store, SyncReport, digest_of

logger = logging.getLogger("celery_leasebeat.scheduler")

#: While a run this replica dispatched is overdue (its next occurrence has passed and the
#: lease is still held), how often to look whether it has finished, so a schedule whose run
#: overran resumes promptly without waiting a whole polling interval.
OVERRUN_RECHECK_SECONDS = 1.0
#: Back-off after a failed cycle (database or broker away): doubles up to the polling
#: interval, so an outage is retried quickly at first and never crash-loops.
FIRST_BACKOFF_SECONDS = 1.0
#: After a claim found nothing although the probe saw a due row (another replica took it
#: between the two statements), look again almost at once.
CONTENDED_RETRY_SECONDS = 0.05
#: How often a replica refreshes its row in the replicas table (what `leasebeat status`
#: shows): one UPDATE a minute, so an idle cycle stays the probe alone.
HEARTBEAT_SECONDS = 60.0
#: How often missed-run detection looks at the runs in flight while a lease is held;
#: otherwise only with the heartbeat, so an idle cycle stays the probe alone.
OVERDUE_CHECK_SECONDS = 10.0
#: How long after another replica's schedule is due again (its ``following_at``) to look
#: whether that replica dispatched it: the replica that dispatched a run wakes on time for
#: the next occurrence, and the others look only this much later, so they do not race it
#: for every occurrence yet take over within this delay when it died.
TAKEOVER_DELAY_SECONDS = 0.25
#: How often to look whether the last sync was another replica's, with other definitions
#: (a rolling deploy), and upsert this replica's again if so.
RESYNC_SECONDS = 300.0


@dataclass
class _InFlight:
    token: str
    following: datetime


class LeaseScheduler(Scheduler):
    """Celery beat scheduler that keeps schedules in SQL and leases every occurrence, so any
    number of replicas run at once and each occurrence is dispatched exactly once.

    ``celery -A proj beat -S celery_leasebeat.LeaseScheduler`` (or ``-S leasebeat``).
    """

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._config: LeaseBeatConfig | None = None
        self._store: Store | None = None
        #: Held from start-up until synced, then dropped: a replica's memory does not grow
        #: with the schedules it is not dispatching.
        self._definitions: list[ScheduleDefinition] | None = None
        self._digest = ""
        self._collected_version: int | None = None  # the registry's version _digest reflects
        self._schedule_count = 0
        self._synced_version: int | None = None
        self._failures = 0
        self._inflight: dict[str, _InFlight] = {}
        self._dispatcher: Dispatcher | None = None
        self._claims = 0
        self._empty_claims = 0
        self._ever_synced = False
        self._resync_due = 0.0
        self._heartbeat_due = 0.0
        self._overdue_check_due = 0.0
        self._last_probe: Probe | None = None
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        super().__init__(app, *args, **kwargs)

    # -- start-up --------------------------------------------------------------------------

    def setup_schedule(self) -> None:
        """Validate the settings and every schedule; stop beat with a clear message if any is
        malformed. Touches no database: the first tick syncs the registrations."""
        self._config = LeaseBeatConfig.from_app(self.app)
        self.max_interval = self._config.polling_interval
        self._collect()
        assert self._definitions is not None
        self._check_tasks(self._definitions)
        self._store = store_for(self.app)
        self._dispatcher = Dispatcher(self.app, self._store, self._config, self.Producer)
        if self._config.metrics_port is not None:
            serve_beat_metrics(self._config.metrics_port)
            logger.info("beat: serving Prometheus metrics on port %d", self._config.metrics_port)
        logger.info(
            "beat: leasebeat using %s with %d schedule(s), lease %ss, polling %ss, replica %s",
            self._store.safe_url,
            self._schedule_count,
            self._config.lease_seconds,
            self._config.polling_interval,
            self.owner,
        )

    def _collect(self) -> None:
        assert self._config is not None
        self._collected_version = registrations(self.app).version
        self._definitions = collect_definitions(self.app, self._config)
        self._digest = digest_of(self._definitions)
        self._schedule_count = len(self._definitions)

    def _check_tasks(self, definitions: list[ScheduleDefinition]) -> None:
        assert self._config is not None
        if not self._config.check_tasks:
            return
        known = self.app.tasks
        for definition in definitions:
            if definition.task not in known:
                raise InvalidSchedule(
                    f"schedule {definition.name!r}: unknown task {definition.task!r} (not "
                    f"registered in this app; import its module, or set "
                    f"leasebeat_check_tasks = False to send tasks by name)"
                )

    @property
    def info(self) -> str:
        try:
            config = LeaseBeatConfig.from_app(self.app)
        except Exception as exc:  # the banner must never be what fails
            return f"    . leasebeat -> invalid settings: {exc}"
        url = store_for(self.app).safe_url
        return (
            f"    . leasebeat -> {url}\n    . lease -> {config.lease_seconds}s, polling -> {config.polling_interval}s"
        )

    # -- the cycle ---------------------------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One cycle; returns the seconds to sleep. A database or broker outage is logged and
        retried with back-off, never raised: beat keeps running."""
        assert self._config is not None and self._store is not None
        started = time.monotonic()
        try:
            self._sync_if_needed()
            wait = self._cycle()
            self._housekeeping(started)
        except DatabaseConflict as exc:
            logger.info("beat: %s; retrying the cycle", exc)  # a deadlock victim: not an outage
            return CONTENDED_RETRY_SECONDS
        except DatabaseUnavailable as exc:
            return self._back_off(f"beat: {exc}")
        except BrokerUnavailable as exc:
            return self._back_off(f"beat: broker unavailable: {exc}")
        finally:
            metrics().cycle.observe(time.monotonic() - started)
        if self._failures:
            logger.info("beat: database and broker reachable again")
            self._failures = 0
        return wait

    def _housekeeping(self, now: float) -> None:
        """Refresh this replica's row (for `leasebeat status`) every HEARTBEAT_SECONDS, and
        every OVERDUE_CHECK_SECONDS while runs are in flight, flag those that missed-run
        detection finds late or overrunning."""
        assert self._store is not None
        heartbeat = now >= self._heartbeat_due
        if heartbeat:
            self._store.heartbeat_replica(
                name=self.owner, host=socket.gethostname(), pid=os.getpid(), version=__version__, claims=self._claims
            )
            self._heartbeat_due = now + HEARTBEAT_SECONDS
        # A run in flight holds its schedule's lease: while the last probe saw none held, look
        # only with the heartbeat (a paused schedule's run whose lease expired is still seen).
        idle = self._last_probe is not None and self._last_probe.next_expiry is None
        if idle:
            if not heartbeat:
                return
        elif now < self._overdue_check_due:
            return
        else:  # the 10-second cadence runs only while a lease is held
            self._overdue_check_due = now + OVERDUE_CHECK_SECONDS
        for run, reason in self._store.flag_overdue():
            kind = "overrun" if run["state"] == RunState.STARTED else "late_start"
            metrics().alerts.labels(run["schedule"], kind).inc()
            logger.warning("beat: %s@%s %s", run["schedule"], run["occurrence"].isoformat(), reason)

    def _back_off(self, message: str) -> float:
        assert self._config is not None and self._store is not None
        self._failures += 1
        delay = min(FIRST_BACKOFF_SECONDS * 2 ** (self._failures - 1), self._config.polling_interval)
        logger.error("%s; retrying in %.1fs (failure %d)", message, delay, self._failures)
        # The database may come back empty or restored: check the tables and upsert again.
        self._synced_version = None
        self._store._schema_ready = False
        return delay

    def _sync_if_needed(self) -> None:
        """Upsert the registrations at start, when one is added at run time, after a database
        outage, and when the last sync was another replica's with other definitions (looked
        at every RESYNC_SECONDS: one read of the registrations row). Definitions whose
        digest the last sync recorded are not compared row by row.

        Rows no longer registered are removed only by the first sync of a replica, and never
        while leased: during a rolling deploy an old replica that restarts may remove what
        only the new code registers, and the new replicas put it back within RESYNC_SECONDS.
        """
        assert self._store is not None and self._config is not None
        registry = registrations(self.app)
        now = time.monotonic()
        if self._synced_version == registry.version and now < self._resync_due:
            return
        if self._collected_version != registry.version:
            self._collect()  # registered after start-up collected the others
        if self._store.synced_digest() == self._digest:
            report = SyncReport(skipped=True)
        else:
            if self._definitions is None:  # dropped after the last sync
                self._collect()
            assert self._definitions is not None
            report = self._store.sync(self._definitions, remove_missing=not self._ever_synced, digest=self._digest)
        self._definitions = None
        self._synced_version = registry.version
        self._ever_synced = True
        self._resync_due = now + RESYNC_SECONDS
        for label, names in (
            ("added", report.inserted),
            ("retimed", report.retimed),
            ("updated", report.updated),
            ("removed (no longer registered)", report.removed),
        ):
            if names:
                logger.info("beat: schedules %s: %s", label, ", ".join(sorted(names)))

    def _cycle(self) -> float:
        assert self._store is not None and self._config is not None
        probe = self._last_probe = self._store.probe()
        if probe.next_due is not None and probe.next_due <= probe.now:
            claims = self._store.claim(
                probe.now,
                limit=self._config.batch_size,
                lease_seconds=self._config.lease_seconds,
                owner=self.owner,
            )
            if not claims:
                # Another replica took them, or holds their rows locked mid-claim: look again
                # soon, backing off while that lasts instead of spinning.
                self._empty_claims += 1
                return min(CONTENDED_RETRY_SECONDS * 2 ** (self._empty_claims - 1), 1.0)
            self._empty_claims = 0
            self._claims += len(claims)
            metrics().claims.inc(len(claims))
            assert self._dispatcher is not None
            for claim in self._dispatcher.dispatch(claims, probe.now):
                self._inflight[claim.schedule] = _InFlight(claim.lease_token, claim.following)
            # More may be due (a full batch) and the wait must be computed from a fresh
            # probe that sees what this cycle changed: tick again at once.
            return 0.0
        return self._wait(probe)

    def _wait(self, probe: Probe) -> float:
        """Seconds until the earliest moment something can be due, capped by the polling
        interval: the earliest unleased ``next_run_at``, the earliest lease expiry, the next
        occurrence of each run this replica has in flight (usually finished and released by
        then), and, TAKEOVER_DELAY_SECONDS later, of any replica's run in flight."""
        assert self._store is not None and self._config is not None
        now = probe.now
        candidates = [t for t in (probe.next_due, probe.next_expiry) if t is not None]
        if probe.next_following is not None:
            candidates.append(probe.next_following + timedelta(seconds=TAKEOVER_DELAY_SECONDS))
        overdue = []
        for name, flight in list(self._inflight.items()):
            if flight.following > now:
                candidates.append(flight.following)
            else:
                overdue.append((name, flight.token))
        if overdue:
            still_running = self._store.still_leased(overdue)
            for name, _token in overdue:
                if name not in still_running:
                    del self._inflight[name]
            if len(still_running) < len(overdue):
                return 0.0  # a run finished after the probe: its next occurrence is unseen
            candidates.append(now + timedelta(seconds=OVERRUN_RECHECK_SECONDS))
        if not candidates:
            return self._config.polling_interval
        wait = (min(candidates) - now).total_seconds()
        return max(0.0, min(wait, self._config.polling_interval))

    # -- shutdown ----------------------------------------------------------------------------

    def sync(self) -> None:
        """Nothing to flush: every change is written when it happens."""

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.close()
        if self._store is not None and self._store._engine is not None:
            try:
                self._store.remove_replica(self.owner)
            except DatabaseUnavailable as exc:
                logger.warning("beat: could not remove this replica's row: %s", exc)
        if self._store is not None:
            self._store.dispose()
        super().close()
