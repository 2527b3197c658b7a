"""The leasebeat CLI, with click's runner against real databases and as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.schedules import schedule
from click.testing import CliRunner, Result

from celery_leasebeat import register_schedule
from celery_leasebeat.cli import (
    EXIT_BUSY,
    EXIT_INVALID,
    EXIT_LINT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_PAUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    leasebeat,
)
from celery_leasebeat.registry import collect_definitions
from celery_leasebeat.store import RunState, ScheduleDefinition, Store

from .conftest import drop_tables

E2E_DIR = Path(__file__).parent / "e2e"
LEASEBEAT = str(Path(sys.executable).parent / "leasebeat")  # the console script of this environment


@pytest.fixture
def app(database_url: str, table_prefix: str) -> Iterator[Celery]:
    app = Celery(f"cli-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(leasebeat_database_url=database_url, leasebeat_table_prefix=table_prefix, result_expires=None)

    @app.task(name="proj.nightly", shared=False)
    def nightly() -> None: ...

    register_schedule(nightly, "30 2 * * *", name="nightly", timezone="Europe/Berlin", app=app)
    register_schedule(nightly, "*/10 * * * *", name="often", app=app)
    yield app
    store = getattr(app, "_leasebeat_store", None)
    if store is not None:
        drop_tables(store)


def synced(app: Celery) -> Store:
    from celery_leasebeat.binding import store_for
    from celery_leasebeat.config import LeaseBeatConfig

    store = store_for(app)
    store.sync(collect_definitions(app, LeaseBeatConfig.from_app(app)))
    return store


def run(app: Celery | None, *args: str) -> Result:
    return CliRunner().invoke(leasebeat, list(args), obj=SimpleNamespace(app=app) if app else None)


def run_once(store: Store, name: str, outcome: str = RunState.SUCCEEDED) -> None:
    now = store.now()
    s = store.tables.schedules
    with store.engine.begin() as connection:
        connection.execute(s.update().where(s.c.name == name).values(next_run_at=now - timedelta(seconds=1)))
    (claim,) = store.claim(now, limit=1, lease_seconds=60, owner="beat-test", names=[name])
    store.start_run(schedule=name, run_id=claim.run_id, token=claim.lease_token, worker="w@h", lease_seconds=60)
    store.finish_run(
        schedule=name,
        run_id=claim.run_id,
        token=claim.lease_token,
        occurrence=claim.occurrence,
        outcome=outcome,
        duration_ms=12,
        error="Boom: no" if outcome == RunState.FAILED else None,
    )


def test_list_show_and_history(app: Celery) -> None:
    store = synced(app)
    run_once(store, "often")
    run_once(store, "often", RunState.FAILED)

    listed = run(app, "list", "--json")
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.output)}
    assert rows["nightly"]["description"] == "At 02:30 (Europe/Berlin)"
    assert rows["nightly"]["next_run_local"].endswith(("+01:00", "+02:00"))
    assert rows["often"]["last_outcome"] == "failed in 12 ms" and rows["often"]["state"] == "enabled"
    table = run(app, "list")
    assert "NAME" in table.output and "At 02:30 (Europe/Berlin)" in table.output

    shown = json.loads(run(app, "show", "often", "--json").output)
    assert len(shown["next_occurrences"]) == 10 and len(shown["runs"]) == 2
    assert shown["runs"][-1]["error"] == "Boom: no"
    assert "next occurrences:" in run(app, "show", "nightly").output

    failed = json.loads(run(app, "history", "often", "--outcome", "failed", "--json").output)
    assert [r["state"] for r in failed] == ["failed"]
    assert len(json.loads(run(app, "history", "--since", "1h", "--json").output)) == 2
    assert json.loads(run(app, "history", "--limit", "1", "--json").output)[0]["state"] == "failed"


def test_unknown_schedule_is_one_line_and_exit_3(app: Celery) -> None:
    synced(app)
    for args in (
        ["show", "nope"],
        ["history", "nope"],
        ["trigger", "nope"],
        ["pause", "nope"],
        ["retime", "nope", "* * * * *"],
    ):
        result = run(app, *args)
        assert result.exit_code == EXIT_NOT_FOUND, (args, result.output)
        assert result.output.strip() == "leasebeat: no schedule named 'nope'"


def test_trigger_uses_the_claim_path_and_refuses_while_leased(app: Celery) -> None:
    store = synced(app)
    first = run(app, "trigger", "nightly")
    assert first.exit_code == 0, first.output
    assert "nightly: dispatched occurrence" in first.output
    (ledger,) = store.list_runs("nightly")
    assert ledger["state"] == RunState.DISPATCHED and ledger["replica"].startswith("cli:")
    assert ledger["id"] in first.output  # the deterministic task id

    again = run(app, "trigger", "nightly")
    assert again.exit_code == EXIT_BUSY
    assert "a run holds its lease until" in again.output and "nothing started" in again.output
    assert len(store.list_runs("nightly")) == 1


def test_pause_resume_and_retime(app: Celery) -> None:
    store = synced(app)
    assert run(app, "pause", "often").exit_code == 0
    assert store.get_schedule("often")["enabled"] is False
    assert "paused" in run(app, "list").output
    resumed = run(app, "resume", "often", "--skip-missed")
    assert resumed.exit_code == 0 and store.get_schedule("often")["enabled"] is True

    retimed = run(app, "retime", "nightly", "0 5 * * *")
    assert retimed.exit_code == 0, retimed.output
    assert store.get_schedule("nightly")["override_cron"] == "0 5 * * *"
    assert json.loads(run(app, "show", "nightly", "--json").output)["cron"] == "0 5 * * *"
    assert run(app, "retime", "nightly", "--clear").exit_code == 0
    assert store.get_schedule("nightly")["override_cron"] is None

    bad = run(app, "retime", "nightly", "0 25 * * *")
    assert bad.exit_code == EXIT_INVALID
    assert "'nightly'" in bad.output and "'0 25 * * *'" in bad.output
    assert run(app, "retime", "nightly").exit_code == EXIT_USAGE


def test_preview_follows_the_dst_rules(app: Celery) -> None:
    result = run(
        None, "preview", "30 2 * * *", "--tz", "Europe/Berlin", "--start", "2027-03-27T12:00", "--count", "2", "--json"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == ["2027-03-28T03:00:00+02:00", "2027-03-29T02:30:00+02:00"]
    assert run(None, "preview", "0 * * * *", "--tz", "Mars/Base").exit_code == EXIT_INVALID
    bad = run(None, "preview", "99 * * * *")
    assert bad.exit_code == EXIT_INVALID and "'99 * * * *'" in bad.output


def test_lint_warns_and_fails_on_errors(app: Celery) -> None:
    ok = run(app, "lint", "--json")
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.output)["report"]
    nightly = [item["message"] for item in report if item["name"] == "nightly" and item["level"] == "warning"]
    assert any("does not exist (DST starts)" in m for m in nightly)
    assert any("occurs twice (DST ends)" in m for m in nightly)

    app.conf.beat_schedule = {"custom": {"task": "proj.nightly", "schedule": type("Custom", (schedule,), {})(60)}}
    failing = run(app, "lint")
    assert failing.exit_code == EXIT_LINT_FAILED
    assert "ERROR" in failing.output and "'custom'" in failing.output


def test_status_lists_replicas(app: Celery) -> None:
    store = synced(app)
    store.heartbeat_replica(name="host-a:1", host="host-a", pid=1, version="0.1.0", claims=3)
    result = json.loads(run(app, "status", "--json").output)
    assert result[0]["name"] == "host-a:1" and result[0]["claims"] == 3 and result[0]["live"] is True
    assert "1 live replica(s)" in run(app, "status").output


def test_unreachable_database_is_one_line_and_exit_5() -> None:
    app = Celery("cli-down", broker="memory://", set_as_current=False)
    app.conf.leasebeat_database_url = "postgresql+psycopg://nobody@127.0.0.1:9/none"
    result = run(app, "list")
    assert result.exit_code == EXIT_UNAVAILABLE
    assert result.output.count("\n") == 1 and result.output.startswith("leasebeat: database ")


def test_trigger_refuses_a_paused_schedule(app: Celery) -> None:
    synced(app)
    run(app, "pause", "nightly")
    result = run(app, "trigger", "nightly")
    assert result.exit_code == EXIT_PAUSED and "is paused" in result.output
    assert app._leasebeat_store.get_schedule("nightly")["next_run_at"].year > 2000  # type: ignore[attr-defined]
    assert app._leasebeat_store.list_runs("nightly") == []  # type: ignore[attr-defined]


def test_bad_since_is_one_line_and_exit_4(app: Celery) -> None:
    synced(app)
    for since in ("99999999999d", "²h", "yesterday"):
        result = run(app, "history", "--since", since)
        assert result.exit_code == EXIT_INVALID and result.output.startswith("leasebeat: --since must be"), since


def test_read_commands_never_create_tables(database_url: str, table_prefix: str) -> None:
    app = Celery("cli-empty", broker="memory://", set_as_current=False)
    app.conf.update(leasebeat_database_url=database_url, leasebeat_table_prefix=table_prefix)
    result = run(app, "list")
    assert result.exit_code == EXIT_NOT_FOUND and "no leasebeat tables" in result.output
    store = Store(database_url, table_prefix=table_prefix)
    from sqlalchemy import inspect

    assert not inspect(store.engine).has_table(store.tables.schedules.name)
    store.dispose()


def test_history_of_a_removed_schedule_is_kept(app: Celery) -> None:
    store = synced(app)
    run_once(store, "often")
    store.sync([], remove_missing=True)  # the schedules are gone from the code
    assert [r["schedule"] for r in json.loads(run(app, "history", "often", "--json").output)] == ["often"]


def test_no_app_is_a_usage_error() -> None:
    result = CliRunner().invoke(leasebeat, ["list"])
    assert result.exit_code == EXIT_USAGE and "pass -A/--app" in result.output


def test_migrate_then_the_scheduler_finds_its_tables(app: Celery) -> None:
    from celery_leasebeat.binding import store_for
    from celery_leasebeat.migrations import head

    store = store_for(app)
    result = run(app, "migrate")
    assert result.exit_code == 0 and result.output.strip().endswith(f"empty -> {head()}"), result.output
    assert run(app, "migrate").output.strip().endswith(f"{head()} -> {head()}")
    synced(app)  # the scheduler's own create-on-first-use leaves migrated tables alone
    assert {row["name"] for row in store.list_schedules()} == {"nightly", "often"}


def test_real_processes_with_environment_variables(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(E2E_DIR), os.environ.get("PYTHONPATH", "")]),
        "E2E_BROKER": "memory://",
        "E2E_DATABASE": f"sqlite:///{tmp_path / 'cli.sqlite'}",
        "E2E_RECORD": str(tmp_path / "record.jsonl"),
        "E2E_EVERY_SECOND": "alpha",
        "LEASEBEAT_APP": "e2eapp",
    }
    migrate = subprocess.run([LEASEBEAT, "migrate"], env=env, capture_output=True, text=True, timeout=60)
    assert migrate.returncode == 0, migrate.stderr
    lint = subprocess.run([LEASEBEAT, "lint", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and json.loads(lint.stdout)["ok"] is True
    store = Store(env["E2E_DATABASE"])
    store.sync([ScheduleDefinition(name="alpha", task="e2eapp.record", kind="cron", cron="* * * * * *")])
    for _ in range(3):
        run_once(store, "alpha")
    store.dispose()
    history = subprocess.run(
        [LEASEBEAT, "history", "--json"],
        env={**env, "LEASEBEAT_HISTORY_LIMIT": "2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert history.returncode == 0 and len(json.loads(history.stdout)) == 2  # the variable was read
    via_celery = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "e2eapp", "leasebeat", "history", "--json"],
        env={**env, "LEASEBEAT_HISTORY_LIMIT": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert via_celery.returncode == 0 and len(json.loads(via_celery.stdout)) == 1, via_celery.stderr
    through_celery = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "e2eapp", "leasebeat", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert through_celery.returncode == 0, through_celery.stderr
    assert json.loads(through_celery.stdout) == []
    missing = subprocess.run([LEASEBEAT, "show", "nope"], env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == EXIT_NOT_FOUND and missing.stderr.strip() == "leasebeat: no schedule named 'nope'"
