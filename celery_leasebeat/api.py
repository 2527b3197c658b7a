"""The HTTP trigger API: ``POST /internal/jobs/{jobType}`` and ``GET /internal/jobs/{jobId}``.

A workflow scheduler (or anything holding the token) triggers a registered schedule. Slow
work is queued: the trigger takes the same claim and ledger path as a scheduled occurrence,
publishes the run and answers 202 with a job id to poll. A schedule declared with an
``inline_cap`` runs in the request and answers 200 with its count. See docs/http-api.md.

``create_api(celery_app)`` returns an ASGI app to mount or to serve with
``leasebeat -A proj serve``. It refuses to be created when authentication is misconfigured.
"""

from __future__ import annotations

import hmac
import os
import socket
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from . import __version__
from .binding import store_for
from .config import LeaseBeatConfig
from .dispatcher import BrokerUnavailable, Dispatcher
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    SchedulePaused,
    SpendCapExceeded,
    UnknownJob,
    UnknownSchedule,
)
from .metrics import metrics
from .recorder import HEADER_INLINE_CAP, HEADER_OCCURRENCE, HEADER_SCHEDULE, HEADER_TOKEN, wrap_tasks
from .store import ClaimedRun, RunState

PREFIX = "/internal/jobs"
#: Environments where DEV_AUTH=1 may switch authentication off.
DEV_ENVIRONMENTS = ("local", "dev")
#: How a ledger state reads to a caller polling a job.
STATUS = {
    RunState.CLAIMED: "queued",
    RunState.DISPATCHED: "queued",
    RunState.PUBLISH_FAILED: "queued",
    RunState.STARTED: "started",
    RunState.SUCCEEDED: "succeeded",
    RunState.FAILED: "failed",
    RunState.SKIPPED: "skipped",
    RunState.MISSED: "missed",
    RunState.LOST: "lost",
}
TERMINAL = ("succeeded", "failed", "skipped", "missed", "lost")


class Accepted(BaseModel):
    job_id: str
    status_url: str
    status: str


class Counted(BaseModel):
    job_id: str
    count: int


class Job(BaseModel):
    job_id: str
    job_type: str
    status: str
    occurrence: str
    queued_at: str | None
    started_at: str | None
    finished_at: str | None
    duration_ms: int | None
    attempts: int
    count: int | None
    result: Any = None
    error: str | None


class Problem(BaseModel):
    detail: str


def bearer_tokens(config: LeaseBeatConfig) -> tuple[str, ...] | None:
    """The accepted tokens, or None when DEV_AUTH switches authentication off.

    Raises :class:`ConfigurationError` (the server must not start) when DEV_AUTH=1 is set
    outside a local or dev environment, or when no token is configured.
    """
    if os.environ.get("DEV_AUTH") == "1":
        if config.environment not in DEV_ENVIRONMENTS:
            raise ConfigurationError(
                f"DEV_AUTH=1 is set but the environment is {config.environment!r}: it is honoured only in "
                f"{' or '.join(DEV_ENVIRONMENTS)} (leasebeat_environment / LEASEBEAT_ENVIRONMENT); refusing to start"
            )
        return None
    tokens = tuple(t for t in (config.api_token, config.api_previous_token) if t)
    if not tokens:
        raise ConfigurationError(
            "no API token: set leasebeat_api_token (or LEASEBEAT_API_TOKEN); refusing to start without authentication"
        )
    return tokens


def token_matches(presented: str, tokens: tuple[str, ...]) -> bool:
    """Constant time, and the same work whichever token (if any) matches."""
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(presented.encode(), token.encode())
    return matched


def create_api(celery_app: Any) -> FastAPI:
    config = LeaseBeatConfig.from_app(celery_app)
    tokens = bearer_tokens(config)
    store = store_for(celery_app)
    wrap_tasks(celery_app)  # inline jobs run in this process: fence and record them like a worker
    owner = f"api:{socket.gethostname()}:{os.getpid()}"

    def authenticate(authorization: str | None = Header(default=None)) -> None:
        if tokens is None:
            return
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token_matches(presented.strip(), tokens):
            metrics().api_refusals.labels("-", "unauthorized").inc()
            raise HTTPException(401, "unauthorized", headers={"WWW-Authenticate": "Bearer"})

    api = FastAPI(
        title="celery-leasebeat jobs",
        version=__version__,
        openapi_url=f"{PREFIX}/openapi.json",
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(authenticate)],
    )

    @api.exception_handler(DatabaseUnavailable)
    async def _unavailable(request: Request, exc: DatabaseUnavailable) -> JSONResponse:
        return JSONResponse({"detail": "the schedule database is unavailable"}, status_code=503)

    @api.exception_handler(BrokerUnavailable)
    async def _broker(request: Request, exc: BrokerUnavailable) -> JSONResponse:
        return JSONResponse({"detail": "the broker is unavailable; the job was not queued"}, status_code=503)

    @api.post(
        f"{PREFIX}/{{job_type}}",
        status_code=202,
        response_model=Accepted,
        responses={
            200: {"model": Counted, "description": "An inline job ran and did `count` units of work."},
            400: {"model": Problem, "description": "The request had a body."},
            401: {"model": Problem},
            404: {"model": Problem, "description": "No schedule of that name."},
            409: {"model": Problem, "description": "The schedule is paused."},
            429: {"model": Problem, "description": "A daily cap is reached; see Retry-After."},
        },
    )
    async def trigger(
        job_type: str,
        request: Request,
        idempotency_key: str | None = Header(default=None, max_length=200),
    ) -> Any:
        """Trigger a registered schedule. Slow work is queued (202); inline work runs now (200)."""
        if await request.body():
            raise HTTPException(400, "this endpoint accepts no request body")
        try:
            run_id, claim = await run_in_threadpool(_trigger, job_type, idempotency_key)
        except UnknownSchedule:
            raise HTTPException(404, f"no job type {job_type!r}") from None
        except SchedulePaused:
            raise HTTPException(409, f"job type {job_type!r} is paused") from None
        except SpendCapExceeded as exc:
            metrics().api_refusals.labels(job_type, f"cap_{exc.scope}").inc()
            return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)})
        if claim is not None and claim.inline_cap is not None:
            return await run_in_threadpool(_run_inline, claim)
        if claim is None:  # collapsed into an existing job
            run = await run_in_threadpool(store.get_run, run_id)
            if run["result"] is not None and run["state"] == RunState.SUCCEEDED and _count(run) is not None:
                return JSONResponse({"job_id": run_id, "count": _count(run)}, status_code=200)
        status_url = str(request.url_for("job_status", job_id=run_id))
        return Accepted(job_id=run_id, status_url=status_url, status="queued")

    def _trigger(job_type: str, dedupe_key: str | None) -> tuple[str, ClaimedRun | None]:
        now, existing = store.begin_trigger(job_type, dedupe_key=dedupe_key, overall_daily_cap=config.api_daily_cap)
        if existing is not None:
            return existing, None
        try:
            claims = store.claim(
                now,
                limit=1,
                lease_seconds=config.lease_seconds,
                owner=owner,
                names=[job_type],
                source="api",
                dedupe_key=dedupe_key,
            )
        except IntegrityError:  # the same Idempotency-Key won a race a moment ago
            claims = []
        if not claims:  # another trigger or a beat replica claimed it in between: join that job
            existing = store.existing_job(job_type, dedupe_key)
            if existing is None:
                raise DatabaseUnavailable("the triggered run could not be claimed; try again")
            return existing, None
        (claim,) = claims
        if claim.inline_cap is None:
            dispatcher = Dispatcher(celery_app, store, config)
            try:
                dispatcher.dispatch(claims, now)
            finally:
                dispatcher.close()
        return claim.run_id, claim

    def _run_inline(claim: ClaimedRun) -> JSONResponse:
        task = celery_app.tasks.get(claim.task)
        if task is None:
            store.give_up(claim, store.now(), f"unknown task {claim.task!r}", outcome=RunState.FAILED)
            raise HTTPException(500, f"job type {claim.schedule!r} names an unknown task")
        result = task.apply(
            claim.args,
            {**claim.kwargs, "cap": claim.inline_cap},
            task_id=claim.run_id,
            headers={
                HEADER_SCHEDULE: claim.schedule,
                HEADER_OCCURRENCE: claim.occurrence.isoformat(),
                HEADER_TOKEN: claim.lease_token,
                HEADER_INLINE_CAP: claim.inline_cap,
            },
        )
        if result.failed():
            return JSONResponse({"job_id": claim.run_id, "detail": f"the job failed: {result.result!r}"}, 500)
        return JSONResponse({"job_id": claim.run_id, "count": result.result}, status_code=200)

    @api.get(
        f"{PREFIX}/{{job_id}}",
        response_model=Job,
        name="job_status",
        responses={401: {"model": Problem}, 404: {"model": Problem, "description": "No job with that id."}},
    )
    async def job_status(job_id: str) -> Job:
        """A job's status, timestamps, duration and count or result summary."""
        try:
            run = await run_in_threadpool(store.get_run, job_id)
        except UnknownJob:
            raise HTTPException(404, f"no job {job_id!r}") from None
        return Job(
            job_id=run["id"],
            job_type=run["schedule"],
            status=STATUS.get(run["state"], run["state"]),
            occurrence=run["occurrence"].isoformat(),
            queued_at=_iso(run["dispatched_at"] or run["claimed_at"]),
            started_at=_iso(run["started_at"]),
            finished_at=_iso(run["finished_at"]),
            duration_ms=run["duration_ms"],
            attempts=run["attempts"],
            count=_count(run),
            result=_result(run),
            error=run["error"] or run["alert"],
        )

    return api


def _iso(moment: Any) -> str | None:
    return moment.isoformat() if moment is not None else None


def _result(run: dict[str, Any]) -> Any:
    import json

    if run["result"] is None:
        return None
    try:
        return json.loads(run["result"])
    except ValueError:
        return run["result"]


def _count(run: dict[str, Any]) -> int | None:
    value = _result(run)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, dict) and isinstance(value.get("count"), int):
        return int(value["count"])
    return None
