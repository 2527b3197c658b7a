"""Driving other services: a built-in task that triggers another service's
``POST /internal/jobs/{jobType}`` and waits for the outcome, so a leasebeat schedule can
stand where a workflow scheduler would.

    register_schedule("celery_leasebeat.call_job", "0 2 * * *", name="search-reindex",
                      args=["https://search.internal", "reindex"], app=app)

The bearer token comes from the ``token`` argument, else the environment variable named by
``token_env`` (``LEASEBEAT_OUTBOUND_TOKEN``), else the ``leasebeat_outbound_token`` setting.
On 200 the job ran inline and its count is returned; on 202 the job is polled until it is
terminal, for at most ``timeout`` seconds. What it returns lands in the ledger's result.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from celery import shared_task

CALL_JOB_TASK = "celery_leasebeat.call_job"
_TERMINAL = {"succeeded", "failed", "skipped", "missed", "lost"}


class RemoteJobFailed(Exception):
    """The remote service refused the trigger, or its job did not succeed in time."""


@shared_task(name=CALL_JOB_TASK, bind=True)
def call_job(
    self: Any,
    base_url: str,
    job_type: str,
    token: str | None = None,
    token_env: str = "LEASEBEAT_OUTBOUND_TOKEN",
    timeout: float = 600.0,
    poll_interval: float = 2.0,
) -> dict[str, Any]:
    """Trigger *job_type* on the service at *base_url* and return its outcome."""
    secret = token or os.environ.get(token_env) or self.app.conf.get("leasebeat_outbound_token")
    if not secret:
        raise RemoteJobFailed(f"no token to call {base_url}: pass token=, set {token_env} or leasebeat_outbound_token")
    url = f"{base_url.rstrip('/')}/internal/jobs/{urllib.parse.quote(job_type, safe='')}"
    status, body = _request("POST", url, secret, timeout=min(timeout, 60.0))
    if status == 200:
        return {"job_id": body.get("job_id"), "status": "succeeded", "count": body.get("count")}
    if status != 202:
        raise RemoteJobFailed(f"POST {url} answered {status}: {body.get('detail', body)}")
    status_url = urllib.parse.urljoin(url, body["status_url"])
    deadline = time.monotonic() + timeout
    while True:
        status, job = _request("GET", status_url, secret, timeout=min(timeout, 60.0))
        if status != 200:
            raise RemoteJobFailed(f"GET {status_url} answered {status}: {job.get('detail', job)}")
        if job.get("status") in _TERMINAL:
            break
        if time.monotonic() >= deadline:
            raise RemoteJobFailed(
                f"job {body['job_id']} of {url} not finished after {timeout:g}s ({job.get('status')})"
            )
        time.sleep(poll_interval)
    if job["status"] != "succeeded":
        raise RemoteJobFailed(f"job {job.get('job_id')} of {url} ended {job['status']}: {job.get('error')}")
    return {"job_id": job.get("job_id"), "status": "succeeded", "count": job.get("count")}


def _request(method: str, url: str, token: str, *, timeout: float) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), _json(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json(exc.read())


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {"detail": raw[:200].decode(errors="replace")}
    return value if isinstance(value, dict) else {"detail": value}
