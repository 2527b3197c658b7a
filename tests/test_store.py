"""The store's contract, on real SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import multiprocessing
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlparse

import pytest
from sqlalchemy import event, inspect, select, text

from celery_leasebeat.errors import DatabaseUnavailable, InvalidCron, UnknownSchedule
from celery_leasebeat.store import RunState, ScheduleDefinition, Store, digest_of, run_id_for

from .conftest import MYSQL_URL, POSTGRES_URL, drop_tables, require_server
from .tcp_proxy import TcpProxy

UTC = timezone.utc


def every_minute(name: str, **extra: object) -> ScheduleDefinition:
    return ScheduleDefinition(name=name, task="tasks.work", kind="cron", cron="* * * * *", **extra)  # type: ignore[arg-type]


def make_due(store: Store, *names: str, at: datetime) -> None:
    s = store.tables.schedules
    with store.engine.begin() as connection:
        connection.execute(s.update().where(s.c.name.in_(names)).values(next_run_at=at))


def finish(store: Store, claim: Any, outcome: str, duration_ms: int) -> Any:
    """Record *claim*'s outcome with its own token."""
    return store.finish_run(
        schedule=claim.schedule,
        run_id=claim.run_id,
        token=claim.lease_token,
        occurrence=claim.occurrence,
        outcome=outcome,
        duration_ms=duration_ms,
    )


def claim_all(store: Store, now: datetime, lease: float = 60.0, owner: str = "test") -> list:
    return store.claim(now, limit=1000, lease_seconds=lease, owner=owner)


def test_nothing_is_created_until_first_use(store: Store) -> None:
    assert not inspect(store.engine).has_table(store.tables.schedules.name)
    store.now()
    assert inspect(store.engine).has_table(store.tables.schedules.name)
    assert inspect(store.engine).has_table(store.tables.runs.name)


def test_now_is_the_database_clock(store: Store) -> None:
    native = {
        "postgresql": "SELECT now() AT TIME ZONE 'UTC'",
        "mysql": "SELECT UTC_TIMESTAMP(6)",
        "mariadb": "SELECT UTC_TIMESTAMP(6)",
        "sqlite": "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')",
    }[store.engine.dialect.name]
    ours = store.now()
    with store.engine.connect() as connection:
        theirs = connection.execute(text(native)).scalar_one()
    if isinstance(theirs, str):
        theirs = datetime.fromisoformat(theirs)
    assert ours.tzinfo is not None
    assert abs((ours - theirs.replace(tzinfo=UTC)).total_seconds()) < 2


def test_sync_inserts_then_leaves_unchanged_rows_alone(store: Store) -> None:
    report = store.sync([every_minute("a"), every_minute("b")])
    assert sorted(report.inserted) == ["a", "b"]
    first = store.get_schedule("a")
    assert first["next_run_at"] > store.now() - timedelta(seconds=1)

    again = store.sync([every_minute("a"), every_minute("b")])
    assert (again.inserted, again.retimed, again.updated) == ([], [], [])
    assert store.get_schedule("a")["version"] == first["version"]


def test_sync_retimes_a_changed_expression_and_keeps_time_for_other_changes(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b")])
    far = datetime(2030, 1, 1, tzinfo=UTC)
    make_due(store, "a", "b", at=far)

    report = store.sync(
        [
            ScheduleDefinition(name="a", task="tasks.work", kind="cron", cron="0 3 * * *"),
            every_minute("b", args=[1, 2]),
        ]
    )
    assert report.retimed == ["a"] and report.updated == ["b"]
    a, b = store.get_schedule("a"), store.get_schedule("b")
    assert a["next_run_at"] != far and (a["next_run_at"].hour, a["next_run_at"].minute) == (3, 0)
    assert b["next_run_at"] == far and b["args"] == [1, 2]


def test_sync_removes_code_rows_no_longer_registered(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b")])
    report = store.sync([every_minute("a")], remove_missing=True)
    assert report.removed == ["b"]
    with pytest.raises(UnknownSchedule):
        store.get_schedule("b")


def test_a_sync_of_the_definitions_the_rows_already_match_reads_no_row(store: Store) -> None:
    definitions = [every_minute("a"), every_minute("b")]
    assert not store.sync(definitions).skipped
    assert store.synced_digest() == digest_of(definitions) == digest_of(definitions[::-1])
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    assert store.sync(definitions[::-1]).skipped
    assert statements and not [sql for sql in statements if store.tables.schedules.name in sql], statements


def test_rows_left_by_other_definitions_are_compared_again(store: Store) -> None:
    ab = [every_minute("a"), every_minute("b")]
    store.sync(ab)
    # Another replica's code, without b and with other arguments for a, syncs without removing.
    other = [every_minute("a", args=[1])]
    assert store.sync(other).updated == ["a"]
    assert store.synced_digest() is None  # b is still there: the rows match no one's definitions
    again = store.sync(ab)
    assert not again.skipped and again.updated == ["a"] and store.get_schedule("a")["args"] == []
    assert store.synced_digest() == digest_of(ab) and store.sync(ab).skipped


def test_a_removed_schedule_still_in_flight_leaves_no_digest(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b")])
    now = store.now()
    make_due(store, "b", at=now - timedelta(seconds=1))
    claim_all(store, now)
    assert store.sync([every_minute("a")], remove_missing=True).removed == []
    assert store.get_schedule("b")["lease_token"] is not None  # its run must be able to finish
    assert store.synced_digest() is None


def test_the_digest_changes_with_every_column_a_definition_sets() -> None:
    base = every_minute("a")
    variants = [
        every_minute("b"),
        every_minute("a", args=[1]),
        every_minute("a", kwargs={"x": 1}),
        every_minute("a", options={"queue": "q"}),
        every_minute("a", timezone="Europe/Paris"),
        every_minute("a", grace_seconds=5.0),
        every_minute("a", max_runtime_seconds=60.0),
        every_minute("a", after="upstream"),
        every_minute("a", inline_cap=10),
        every_minute("a", daily_cap=10),
        every_minute("a", dedupe_seconds=30.0),
        ScheduleDefinition(name="a", task="tasks.work", kind="interval", interval_seconds=60.0),
        ScheduleDefinition(name="a", task="tasks.other", kind="cron", cron="* * * * *"),
        ScheduleDefinition(name="a", task="tasks.work", kind="cron", cron="*/2 * * * *"),
    ]
    digests = {digest_of([base])} | {digest_of([variant]) for variant in variants}
    assert len(digests) == 1 + len(variants)


def test_syncs_at_the_same_moment_take_turns(store: Store, database_url: str) -> None:
    """Replicas of different code starting together: each sync waits for the other's (the
    registrations row is locked first: on InnoDB, locking it after INSERT IGNORE deadlocked)."""
    store.sync([every_minute("a")])  # the registrations row exists
    replicas = [Store(database_url, table_prefix=store.table_prefix) for _ in range(2)]
    definitions = [[every_minute("a"), every_minute("b")], [every_minute("a"), every_minute("c")]]
    errors: list[BaseException] = []
    try:
        for _ in range(3):
            barrier = threading.Barrier(2)

            def sync(index: int, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    replicas[index].sync(definitions[index])
                except BaseException as exc:  # noqa: BLE001 (reported below)
                    errors.append(exc)

            threads = [threading.Thread(target=sync, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        for replica in replicas:
            replica.dispose()
    assert errors == []
    assert {row["name"] for row in store.list_schedules()} == {"a", "b", "c"}
    assert store.synced_digest() is None  # the rows match neither replica's definitions


def test_sync_of_a_registry_larger_than_the_drivers_parameter_limit(store: Store) -> None:
    """70,000 names: more than one statement may bind on PostgreSQL or MySQL (65,535)."""
    definitions = [every_minute(f"job-{i:05d}") for i in range(70_000)]
    assert len(store.sync(definitions).inserted) == 70_000
    report = store.sync(definitions[1:], remove_missing=True)
    assert report.removed == ["job-00000"] and not report.inserted and not report.updated


def test_override_wins_until_cleared(store: Store) -> None:
    store.sync([every_minute("a")])
    next_run = store.set_override("a", "0 5 * * *")
    assert (next_run.hour, next_run.minute) == (5, 0)
    assert store.get_schedule("a")["override_cron"] == "0 5 * * *"

    # A changed code default does not move a schedule whose override is set.
    store.sync([ScheduleDefinition(name="a", task="tasks.work", kind="cron", cron="0 7 * * *")])
    assert store.get_schedule("a")["next_run_at"] == next_run

    # Blank clears it: the code's default applies again, from now.
    cleared = store.set_override("a", "  ")
    assert store.get_schedule("a")["override_cron"] is None
    assert (cleared.hour, cleared.minute) == (7, 0)


def test_override_is_validated_and_needs_a_known_schedule(store: Store) -> None:
    store.sync([every_minute("a")])
    with pytest.raises(InvalidCron, match="'a'.*'not cron'"):
        store.set_override("a", "not cron")
    with pytest.raises(UnknownSchedule):
        store.set_override("nope", "* * * * *")


def test_claim_takes_due_rows_once_and_writes_the_ledger(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b"), every_minute("later")])
    now = store.now()
    due_at = (now - timedelta(seconds=5)).replace(microsecond=123456)
    make_due(store, "a", "b", at=due_at)

    claims = claim_all(store, now, owner="replica-1")
    assert sorted(c.schedule for c in claims) == ["a", "b"]
    assert all(c.occurrence == due_at and c.attempt == 1 for c in claims)
    assert claims[0].run_id == run_id_for(claims[0].schedule, due_at)
    assert claim_all(store, now) == []  # leased now

    runs = {r["schedule"]: r for r in store.list_runs()}
    assert set(runs) == {"a", "b"}
    assert runs["a"]["state"] == RunState.CLAIMED and runs["a"]["replica"] == "replica-1"
    assert runs["a"]["occurrence"] == due_at


def test_claim_respects_the_batch_limit_earliest_first(store: Store) -> None:
    names = [f"s{i}" for i in range(5)]
    store.sync([every_minute(n) for n in names])
    now = store.now()
    for offset, name in enumerate(names):
        make_due(store, name, at=now - timedelta(minutes=10 - offset))
    first = store.claim(now, limit=2, lease_seconds=60, owner="x")
    assert [c.schedule for c in first] == ["s0", "s1"]
    second = store.claim(now, limit=10, lease_seconds=60, owner="x")
    assert [c.schedule for c in second] == ["s2", "s3", "s4"]


def test_disabled_rows_are_not_claimed(store: Store) -> None:
    store.sync([every_minute("a")])
    now = store.now()
    make_due(store, "a", at=now - timedelta(seconds=1))
    store.set_enabled("a", False)
    assert claim_all(store, now) == []
    store.set_enabled("a", True)
    assert [c.schedule for c in claim_all(store, now)] == ["a"]


def test_fenced_outcome_with_a_stale_token_changes_nothing(store: Store) -> None:
    store.sync([every_minute("a")])
    now = store.now()
    make_due(store, "a", at=now - timedelta(seconds=1))
    (claim,) = claim_all(store, now)
    before = store.get_schedule("a")

    applied = store.finish_run(
        schedule="a",
        run_id=claim.run_id,
        token="stale-token",
        occurrence=claim.occurrence,
        outcome=RunState.SUCCEEDED,
        duration_ms=5,
    )
    assert not applied
    assert store.get_schedule("a") == before
    assert store.list_runs()[0]["state"] == RunState.CLAIMED

    assert finish(store, claim, RunState.SUCCEEDED, 5)
    after = store.get_schedule("a")
    assert after["lease_token"] is None and after["lease_until"] is None
    assert after["last_outcome"] == RunState.SUCCEEDED and after["last_duration_ms"] == 5
    assert after["last_run_at"] == claim.occurrence
    assert after["next_run_at"] > claim.occurrence
    run = store.list_runs()[0]
    assert run["state"] == RunState.SUCCEEDED and run["duration_ms"] == 5


def test_expired_lease_is_reclaimed_under_the_same_run_id_and_fences_the_old_claim(store: Store) -> None:
    store.sync([every_minute("a")])
    now = store.now()
    make_due(store, "a", at=now - timedelta(seconds=1))
    (first,) = store.claim(now, limit=10, lease_seconds=1, owner="r1")
    assert store.claim(now + timedelta(milliseconds=500), limit=10, lease_seconds=1, owner="r2") == []

    (second,) = store.claim(now + timedelta(seconds=2), limit=10, lease_seconds=1, owner="r2")
    assert second.run_id == first.run_id and second.occurrence == first.occurrence
    assert second.lease_token != first.lease_token and second.attempt == 2
    (run,) = store.list_runs()
    assert run["attempts"] == 2 and run["replica"] == "r2" and run["lease_token"] == second.lease_token

    # The first delivery may no longer start nor record.
    stale = store.start_run(schedule="a", run_id=first.run_id, token=first.lease_token, worker="w", lease_seconds=5)
    assert not stale.run
    assert not store.finish_run(
        schedule="a",
        run_id=first.run_id,
        token=first.lease_token,
        occurrence=first.occurrence,
        outcome=RunState.FAILED,
        duration_ms=1,
    )
    assert store.get_schedule("a")["lease_token"] == second.lease_token


def test_a_claim_holds_a_short_publish_lease_until_marked_dispatched(store: Store) -> None:
    """A replica that dies between claiming and publishing delays its claims by the publish
    lease, not by a whole lease; once published, the full lease holds."""
    store.sync([every_minute("a"), every_minute("b")])
    now = store.now()
    make_due(store, "a", "b", at=now - timedelta(seconds=1))
    store.publish_lease_seconds = 2
    claims = store.claim(now, limit=10, lease_seconds=300, owner="r1")
    assert {row["lease_until"] for row in store.list_schedules()} == {now + timedelta(seconds=2)}
    published = [c for c in claims if c.schedule == "a"]
    store.mark_dispatched(published)
    leases = {row["name"]: row["lease_until"] for row in store.list_schedules()}
    assert leases == {"a": now + timedelta(seconds=300), "b": now + timedelta(seconds=2)}
    assert {r["schedule"]: r["state"] for r in store.list_runs()} == {"a": RunState.DISPATCHED, "b": RunState.CLAIMED}

    (again,) = store.claim(now + timedelta(seconds=3), limit=10, lease_seconds=300, owner="r2")
    assert again.schedule == "b" and again.attempt == 2


def test_start_runs_a_delivery_once(store: Store) -> None:
    store.sync([every_minute("a")])
    now = store.now()
    make_due(store, "a", at=now - timedelta(seconds=1))
    (claim,) = claim_all(store, now, lease=5)
    kwargs = dict(schedule="a", run_id=claim.run_id, token=claim.lease_token, worker="w1", lease_seconds=600)

    assert store.start_run(**kwargs).run
    lease_until = store.get_schedule("a")["lease_until"]
    assert lease_until > now + timedelta(seconds=500)  # start extends the lease
    redelivered = store.start_run(**kwargs)
    assert not redelivered.run and redelivered.state == RunState.STARTED

    finish(store, claim, RunState.SUCCEEDED, 1)
    after_completion = store.start_run(**kwargs)
    assert not after_completion.run and after_completion.state == RunState.SUCCEEDED


def test_extend_leases_reports_lost_leases(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b")])
    now = store.now()
    make_due(store, "a", "b", at=now - timedelta(seconds=1))
    claims = {c.schedule: c for c in claim_all(store, now, lease=5)}
    lost = store.extend_leases([("a", claims["a"].lease_token), ("b", "not-the-token")], 120)
    assert lost == {"b"}
    assert store.get_schedule("a")["lease_until"] > store.now() + timedelta(seconds=100)


def test_release_makes_an_unpublished_occurrence_due_again(store: Store) -> None:
    store.sync([every_minute("a")])
    now = store.now()
    make_due(store, "a", at=now - timedelta(seconds=1))
    claims = claim_all(store, now)
    assert store.release(claims, "publish failed: broker down") == 1
    assert store.list_runs()[0]["state"] == RunState.PUBLISH_FAILED
    (again,) = claim_all(store, now)
    assert again.run_id == claims[0].run_id and again.attempt == 1


def test_a_missed_schedule_runs_once_then_advances_recording_the_drop(store: Store) -> None:
    store.sync([every_minute("a")])
    now = store.now()
    long_ago = (now - timedelta(hours=1)).replace(second=0, microsecond=0)
    make_due(store, "a", at=long_ago)
    (claim,) = claim_all(store, now)
    assert claim.occurrence == long_ago
    finish(store, claim, RunState.SUCCEEDED, 1)
    row = store.get_schedule("a")
    after = store.now()
    assert now < row["next_run_at"] <= after + timedelta(minutes=1)
    (run,) = store.list_runs()
    assert 59 <= run["missed_count"] <= 61
    assert claim_all(store, after) == []  # no catch-up storm


def test_probe_reports_the_clock_next_due_and_next_expiry(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b")])
    now = store.now()
    make_due(store, "a", at=now - timedelta(seconds=1))
    make_due(store, "b", at=now + timedelta(minutes=5))
    probe = store.probe()
    assert probe.next_due == now - timedelta(seconds=1)
    assert probe.next_expiry is None
    claim_all(store, probe.now, lease=30)
    probe = store.probe()
    assert probe.next_due == now + timedelta(minutes=5)
    assert probe.next_expiry is not None and probe.next_expiry > probe.now


def test_the_probe_reports_when_runs_in_flight_are_due_again_until_their_leases_go(store: Store) -> None:
    """``following_at`` wakes the other replicas when a schedule another one dispatched is due
    again; it is set once published and cleared with the lease, so the probe walks only the
    rows in flight."""
    yearly = [ScheduleDefinition(name=name, task="tasks.work", kind="cron", cron="0 0 1 1 *") for name in "abc"]
    every_7s = ScheduleDefinition(name="d", task="tasks.work", kind="interval", interval_seconds=7.0)
    store.sync([*yearly, every_7s])
    now = store.now()
    make_due(store, "a", "b", "c", "d", at=now - timedelta(seconds=1))
    claims = {claim.schedule: claim for claim in claim_all(store, now)}
    assert store.probe().next_following is None  # claimed, not yet published
    store.mark_dispatched(list(claims.values()))  # two different following occurrences: one statement
    for name, claim in claims.items():
        assert claim.following > now
        assert store.get_schedule(name)["following_at"] == claim.following
    assert claims["d"].following < claims["a"].following == claims["c"].following
    assert store.probe().next_following == claims["d"].following

    assert finish(store, claims["d"], RunState.SUCCEEDED, 5).applied
    store.give_up(claims["a"], now, "no outcome")
    store.release([claims["b"]], "publish failed")
    for name in ("a", "b", "d"):
        assert store.get_schedule(name)["following_at"] is None
    assert store.probe().next_following == claims["c"].following
    assert finish(store, claims["c"], RunState.FAILED, 5).applied
    assert store.probe().next_following is None


def test_lease_times_are_stored_in_utc_whatever_the_sessions_zone(table_prefix: str) -> None:
    """Aware datetimes in a CASE (mark_dispatched) must not reach PostgreSQL as timestamptz,
    which a session west of UTC would store hours early: leases expired at once."""
    require_server(POSTGRES_URL, "PostgreSQL")
    zone = {"connect_args": {"options": "-c timezone=America/New_York"}}
    store = Store(POSTGRES_URL, table_prefix=table_prefix, engine_options=zone)
    try:
        yearly = ScheduleDefinition(name="a", task="tasks.work", kind="cron", cron="0 0 1 1 *")
        every_7s = ScheduleDefinition(name="d", task="tasks.work", kind="interval", interval_seconds=7.0)
        store.sync([yearly, every_7s])
        now = store.now()
        make_due(store, "a", "d", at=now - timedelta(seconds=1))
        claims = claim_all(store, now, lease=60)
        store.mark_dispatched(claims)
        for claim in claims:
            row = store.get_schedule(claim.schedule)
            assert (row["lease_until"], row["following_at"]) == (claim.lease_until, claim.following)
    finally:
        drop_tables(store)


def test_give_up_records_lost_and_advances(store: Store) -> None:
    store.sync([every_minute("a")])
    now = store.now()
    make_due(store, "a", at=now - timedelta(seconds=1))
    (claim,) = claim_all(store, now)
    assert store.give_up(claim, now, "no outcome")
    row = store.get_schedule("a")
    assert row["last_outcome"] == RunState.LOST and row["lease_token"] is None
    assert row["next_run_at"] > now
    assert store.list_runs()[0]["state"] == RunState.LOST


# -- claim exclusivity under real concurrency -------------------------------------------------

SCHEDULES = 240


def _claim_worker(
    url: str, prefix: str, start: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue
) -> None:  # type: ignore[name-defined]
    store = Store(url, table_prefix=prefix)
    store.now()  # connected and ready: only then wait for the others
    start.wait()
    claimed: list[tuple[str, str]] = []
    idle = 0
    while idle < 5:
        try:
            now = store.probe().now
            batch = store.claim(now, limit=3, lease_seconds=600, owner=str(multiprocessing.current_process().pid))
        except DatabaseUnavailable:  # e.g. an InnoDB deadlock: beat retries the cycle, so does this
            continue
        if batch:
            idle = 0
            claimed.extend((c.schedule, c.occurrence.isoformat()) for c in batch)
        else:
            idle += 1
    store.dispose()
    out.put(claimed)


def test_concurrent_claimers_claim_each_occurrence_exactly_once(store: Store) -> None:
    names = [f"job{i:03d}" for i in range(SCHEDULES)]
    store.sync([every_minute(n) for n in names])
    now = store.now()
    make_due(store, *names, at=now - timedelta(seconds=1))
    store.dispose()

    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(6), context.Queue()
    url = store.url.render_as_string(hide_password=False)
    processes = [
        context.Process(target=_claim_worker, args=(url, store.tables.schedules.name[: -len("schedules")], start, out))
        for _ in range(6)
    ]
    for process in processes:
        process.start()
    results = [out.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)

    everything = [pair for result in results for pair in result]
    assert len(everything) == len(set(everything)), "an occurrence was claimed twice"
    assert sorted(name for name, _ in everything) == names
    assert sum(1 for result in results if result) >= 2, "the claimers did not actually compete"
    with store.engine.connect() as connection:
        ledger = connection.execute(select(store.tables.runs.c.schedule)).scalars().all()
    assert sorted(ledger) == names


def test_a_worker_on_another_database_is_told_so(store: Store) -> None:
    store.sync([every_minute("a")])
    decision = store.start_run(schedule="elsewhere", run_id="r", token="t", worker="w", lease_seconds=5)
    assert not decision.run and "leasebeat_database_url" in decision.reason


def _claimed(store: Store, name: str = "a", lease: float = 60.0):  # type: ignore[no-untyped-def]
    now = store.now()
    make_due(store, name, at=now - timedelta(seconds=1))
    (claim,) = [c for c in claim_all(store, now, lease=lease) if c.schedule == name]
    return claim


def test_a_task_retry_may_start_again_but_a_redelivery_may_not(store: Store) -> None:
    store.sync([every_minute("a")])
    claim = _claimed(store)
    start = dict(schedule="a", run_id=claim.run_id, token=claim.lease_token, worker="w", lease_seconds=60)
    assert store.start_run(**start, retries=0).run
    assert not store.start_run(**start, retries=0).run  # the same message again
    assert store.start_run(**start, retries=1).run  # the task's own retry
    assert not store.start_run(**start, retries=1).run
    assert store.hold_lease(schedule="a", token=claim.lease_token, seconds=3600)
    assert store.get_schedule("a")["lease_until"] > store.now() + timedelta(minutes=59)
    assert not store.hold_lease(schedule="a", token="other", seconds=3600)


def test_fail_run_only_touches_the_dying_delivery(store: Store) -> None:
    store.sync([every_minute("a")])
    claim = _claimed(store, lease=1)
    assert store.start_run(schedule="a", run_id=claim.run_id, token=claim.lease_token, worker="w1", lease_seconds=1).run
    # The lease ran out; another claim of the same occurrence (same run id) starts on w2.
    (newer,) = store.claim(store.now() + timedelta(seconds=5), limit=5, lease_seconds=60, owner="r2")
    assert store.start_run(
        schedule="a", run_id=newer.run_id, token=newer.lease_token, worker="w2", lease_seconds=60
    ).run

    assert not store.fail_run(run_id=claim.run_id, error="WorkerLostError", token=claim.lease_token)
    assert not store.fail_run(run_id=claim.run_id, error="TimeLimitExceeded", worker="w1")
    assert store.list_runs()[0]["state"] == RunState.STARTED
    assert store.fail_run(run_id=claim.run_id, error="WorkerLostError", token=newer.lease_token)
    (run,) = store.list_runs()
    assert run["state"] == RunState.FAILED and run["error"] == "WorkerLostError"


def test_unregistered_rows_in_flight_are_not_removed(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b")])
    _claimed(store, "b")
    assert store.sync([every_minute("a")], remove_missing=True).removed == []
    assert store.get_schedule("b")["lease_token"] is not None


def test_trigger_makes_a_schedule_due_unless_a_run_holds_its_lease(store: Store) -> None:
    store.sync([every_minute("a")])
    now, blocked = store.make_due("a")
    assert blocked is None and store.get_schedule("a")["next_run_at"] == now
    claim_all(store, store.now())
    _now, blocked = store.make_due("a")
    assert blocked is not None and blocked > now
    with pytest.raises(UnknownSchedule):
        store.make_due("nope")


def test_resume_runs_the_missed_occurrence_or_skips_it(store: Store) -> None:
    store.sync([every_minute("a"), every_minute("b")])
    past = store.now() - timedelta(minutes=10)
    make_due(store, "a", "b", at=past)
    store.set_enabled("a", False)
    store.set_enabled("b", False)
    assert store.resume("a") >= past + timedelta(minutes=9)  # due now: runs once, then advances
    assert store.get_schedule("a")["next_run_at"] <= store.now()
    skipped_to = store.resume("b", skip_missed=True)
    assert skipped_to > store.now() - timedelta(seconds=1)
    assert store.get_schedule("b")["enabled"] is True


def test_missed_run_detection_flags_late_starts_and_overruns_once(store: Store) -> None:
    store.sync(
        [
            every_minute("late", grace_seconds=1.0),
            every_minute("long", max_runtime_seconds=1.0),
            every_minute("relaxed"),
        ]
    )
    now = store.now()
    make_due(store, "late", "long", "relaxed", at=now - timedelta(seconds=1))
    claims = {c.schedule: c for c in claim_all(store, now)}
    store.start_run(
        schedule="long", run_id=claims["long"].run_id, token=claims["long"].lease_token, worker="w", lease_seconds=60
    )
    r = store.tables.runs
    earlier = now - timedelta(seconds=30)
    with store.engine.begin() as connection:
        connection.execute(r.update().values(dispatched_at=earlier, started_at=earlier))
    flagged = {run["schedule"]: reason for run, reason in store.flag_overdue()}
    assert set(flagged) == {"late", "long"}
    assert "not started within its grace of 1s" in flagged["late"]
    assert "past its maximum runtime of 1s" in flagged["long"]
    assert store.flag_overdue() == []  # flagged once
    alerts = {run["schedule"]: run["alert"] for run in store.list_runs()}
    assert alerts["late"] == flagged["late"] and alerts["relaxed"] is None


def test_replicas_heartbeat_rows(store: Store) -> None:
    store.heartbeat_replica(name="h:1", host="h", pid=1, version="0.1.0", claims=0)
    store.heartbeat_replica(name="h:1", host="h", pid=1, version="0.1.0", claims=7)
    store.heartbeat_replica(name="h:2", host="h", pid=2, version="0.1.0", claims=1)
    now, replicas = store.list_replicas()
    assert {r["name"]: r["claims"] for r in replicas} == {"h:1": 7, "h:2": 1}
    assert all(r["last_cycle_at"] <= now + timedelta(seconds=1) for r in replicas)
    store.remove_replica("h:2")
    assert [r["name"] for r in store.list_replicas()[1]] == ["h:1"]


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_an_idle_probe_is_one_round_trip_and_survives_a_dropped_connection(server: str, table_prefix: str) -> None:
    """Beat's statement when nothing is due: one request to the server (no pre-ping, BEGIN or
    ROLLBACK around it), and a pooled connection the server dropped is replaced, not an outage."""
    url = POSTGRES_URL if server == "postgresql" else MYSQL_URL
    require_server(url, server)
    target = urlparse(url.split("+", 1)[0] + "://" + url.split("://", 1)[1])
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 0)
    store = Store(url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}"), table_prefix=table_prefix)
    try:
        store.sync([every_minute("a")])
        store.probe()  # connects the probe's own connection (handshake, dialect set-up)
        before = proxy.requests
        for _ in range(3):
            assert store.probe().next_due is not None
        assert proxy.requests - before == 3

        proxy.cut()  # the server drops every connection
        time.sleep(0.5)  # the proxy's listener thread lets go of the port
        proxy.restore()
        assert store.probe().next_due is not None
    finally:
        drop_tables(store)
        proxy.close()


def test_the_probe_honours_a_pool_class_from_the_engine_options(table_prefix: str) -> None:
    """NullPool (behind PgBouncer, say) takes no pool size: the probe's engine must not add one."""
    from sqlalchemy.pool import NullPool

    require_server(POSTGRES_URL, "PostgreSQL")
    store = Store(POSTGRES_URL, table_prefix=table_prefix, engine_options={"poolclass": NullPool})
    try:
        store.sync([every_minute("a")])
        assert store.probe().next_due is not None
    finally:
        drop_tables(store)
