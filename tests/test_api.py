"""The HTTP trigger API in process (FastAPI's test client) against a real database:
authentication, refusals, dedupe and caps. tests/test_api_e2e.py runs it for real."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from fastapi.testclient import TestClient

from celery_leasebeat import register_schedule
from celery_leasebeat.api import create_api
from celery_leasebeat.errors import ConfigurationError
from celery_leasebeat.registry import collect_definitions
from celery_leasebeat.store import RunState

from .conftest import drop_tables

TOKEN, PREVIOUS = "current-secret-token", "previous-secret-token"


def make_app(database_url: str, prefix: str, **settings: object) -> Celery:
    app = Celery(f"api-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(
        {
            "leasebeat_database_url": database_url,
            "leasebeat_table_prefix": prefix,
            "result_expires": None,
            "leasebeat_api_token": TOKEN,
            "leasebeat_api_previous_token": PREVIOUS,
            **settings,
        }
    )

    @app.task(name="proj.reindex", shared=False)
    def reindex() -> str:
        return "done"

    @app.task(name="proj.sweep", shared=False)
    def sweep(cap: int) -> int:
        return min(cap, 7)

    @app.task(name="proj.greedy", shared=False)
    def greedy(cap: int) -> int:
        return cap + 1

    register_schedule(reindex, None, name="reindex", triggered=True, app=app)
    register_schedule(reindex, None, name="capped", triggered=True, daily_cap=2, app=app)
    register_schedule(reindex, None, name="windowed", triggered=True, dedupe_window=3600, app=app)
    register_schedule(sweep, None, name="sweep", triggered=True, inline_cap=5, app=app)
    register_schedule(greedy, None, name="greedy", triggered=True, inline_cap=5, app=app)
    return app


@pytest.fixture
def app(database_url: str, table_prefix: str) -> Iterator[Celery]:
    app = make_app(database_url, table_prefix)
    yield app
    store = getattr(app, "_leasebeat_store", None)
    if store is not None:
        drop_tables(store)


def client_for(app: Celery) -> TestClient:
    from celery_leasebeat.binding import store_for
    from celery_leasebeat.config import LeaseBeatConfig

    store_for(app).sync(collect_definitions(app, LeaseBeatConfig.from_app(app)))
    return TestClient(create_api(app))


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_current_and_previous_tokens_are_accepted_others_refused_alike(app: Celery) -> None:
    client = client_for(app)
    assert client.post("/internal/jobs/reindex", headers=auth()).status_code == 202
    assert client.get("/internal/jobs/nope", headers=auth(PREVIOUS)).status_code == 404
    refusals = [
        client.post("/internal/jobs/reindex"),
        client.post("/internal/jobs/reindex", headers=auth("wrong")),
        client.post("/internal/jobs/reindex", headers={"Authorization": f"Basic {TOKEN}"}),
        client.get("/internal/jobs/x", headers=auth(TOKEN + "x")),
    ]
    assert {r.status_code for r in refusals} == {401}
    assert {r.text for r in refusals} == {'{"detail":"unauthorized"}'}  # nothing says which part was wrong


def test_tokens_are_compared_in_constant_time_against_both(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_for(app)
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("celery_leasebeat.api.hmac.compare_digest", spy)
    client.get("/internal/jobs/x", headers=auth())
    # Both configured tokens are always compared, so timing says nothing about which matched.
    assert [b for _, b in calls] == [TOKEN.encode(), PREVIOUS.encode()]


def test_dev_auth_only_in_local_or_dev(database_url: str, table_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEV_AUTH", "1")
    dev = make_app(database_url, table_prefix, leasebeat_environment="dev", leasebeat_api_token=None)
    client = client_for(dev)
    assert client.post("/internal/jobs/reindex").status_code == 202
    drop_tables(dev._leasebeat_store)  # type: ignore[attr-defined]
    for environment in ("production", "staging"):
        prod = make_app(database_url, table_prefix, leasebeat_environment=environment)
        with pytest.raises(ConfigurationError, match="DEV_AUTH=1 is set but the environment is"):
            create_api(prod)


def test_no_token_and_no_dev_auth_refuses_to_start(database_url: str, table_prefix: str) -> None:
    app = make_app(database_url, table_prefix, leasebeat_api_token=None, leasebeat_api_previous_token=None)
    with pytest.raises(ConfigurationError, match="no API token"):
        create_api(app)


def test_a_body_unknown_types_and_unknown_jobs(app: Celery) -> None:
    client = client_for(app)
    with_body = client.post("/internal/jobs/reindex", headers=auth(), content=b'{"x": 1}')
    assert with_body.status_code == 400 and "no request body" in with_body.json()["detail"]
    assert client.post("/internal/jobs/nope", headers=auth()).status_code == 404
    assert client.get(f"/internal/jobs/{uuid.uuid4()}", headers=auth()).status_code == 404


def test_a_paused_job_type_is_409(app: Celery) -> None:
    client = client_for(app)
    app._leasebeat_store.set_enabled("reindex", False)  # type: ignore[attr-defined]
    assert client.post("/internal/jobs/reindex", headers=auth()).status_code == 409


def test_queued_job_then_its_status(app: Celery) -> None:
    client = client_for(app)
    response = client.post("/internal/jobs/reindex", headers=auth())
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "queued" and body["status_url"].endswith(f"/internal/jobs/{body['job_id']}")
    status = client.get(body["status_url"], headers=auth()).json()
    assert status["job_type"] == "reindex" and status["status"] == "queued"
    run = app._leasebeat_store.get_run(body["job_id"])  # type: ignore[attr-defined]
    assert run["source"] == "api" and run["state"] == RunState.DISPATCHED


def test_idempotency_key_and_dedupe_window_collapse_triggers(app: Celery) -> None:
    client = client_for(app)
    first = client.post("/internal/jobs/reindex", headers={**auth(), "Idempotency-Key": "nightly-42"}).json()
    again = client.post("/internal/jobs/reindex", headers={**auth(), "Idempotency-Key": "nightly-42"}).json()
    assert again["job_id"] == first["job_id"]
    one = client.post("/internal/jobs/windowed", headers=auth()).json()
    two = client.post("/internal/jobs/windowed", headers=auth()).json()
    assert one["job_id"] == two["job_id"]
    # A run in flight also collapses repeats: one run per schedule at a time.
    assert client.post("/internal/jobs/reindex", headers=auth()).json()["job_id"] == first["job_id"]


def test_daily_cap_answers_429_with_retry_after(app: Celery) -> None:
    client = client_for(app)
    store = app._leasebeat_store  # type: ignore[attr-defined]
    for _ in range(2):
        job = client.post("/internal/jobs/capped", headers=auth()).json()
        run = store.get_run(job["job_id"])
        store.finish_run(
            schedule="capped", run_id=run["id"], token=run["lease_token"], occurrence=run["occurrence"],
            outcome=RunState.SUCCEEDED, duration_ms=1,
        )  # fmt: skip
    refused = client.post("/internal/jobs/capped", headers=auth())
    assert refused.status_code == 429
    assert 0 < int(refused.headers["Retry-After"]) <= 86400 + 1
    assert "daily cap of 2" in refused.json()["detail"]


def test_overall_daily_cap(database_url: str, table_prefix: str) -> None:
    app = make_app(database_url, table_prefix, leasebeat_api_daily_cap=1)
    try:
        client = client_for(app)
        assert client.post("/internal/jobs/reindex", headers=auth()).status_code == 202
        assert client.post("/internal/jobs/windowed", headers=auth()).status_code == 429
    finally:
        drop_tables(app._leasebeat_store)  # type: ignore[attr-defined]


def test_inline_jobs_run_in_the_request_and_their_cap_is_enforced(app: Celery) -> None:
    client = client_for(app)
    swept = client.post("/internal/jobs/sweep", headers=auth())
    assert swept.status_code == 200 and swept.json()["count"] == 5
    status = client.get(f"/internal/jobs/{swept.json()['job_id']}", headers=auth()).json()
    assert status["status"] == "succeeded" and status["count"] == 5
    greedy = client.post("/internal/jobs/greedy", headers=auth())
    assert greedy.status_code == 500
    run = app._leasebeat_store.get_run(greedy.json()["job_id"])  # type: ignore[attr-defined]
    assert run["state"] == RunState.FAILED and "at most its cap of 5" in run["error"]


def test_openapi_document_has_no_5xx_under_property_testing(tmp_path: Path) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    app = make_app(f"sqlite:///{tmp_path / 'api.sqlite'}", "p_")
    client_for(app)
    schema = schemathesis.openapi.from_asgi("/internal/jobs/openapi.json", create_api(app))
    server_errors: list[tuple[str, str, int]] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.method.upper() for operation in operations} == {"GET", "POST"}
    for operation in operations:

        @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy())
        def check(case: Any) -> None:
            response = case.call(headers=auth())
            if response.status_code >= 500:
                server_errors.append((case.method, case.formatted_path, response.status_code))

        check()
    assert server_errors == []
