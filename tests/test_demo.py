"""The README's first command runs this demo: it must keep working."""

from __future__ import annotations

import subprocess
import sys


def test_the_demo_runs_two_replicas_and_reports_exactly_once() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "celery_leasebeat.demo", "--seconds", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every occurrence was dispatched exactly once" in result.stdout
    assert "greet-every-2s" in result.stdout and "heartbeat-every-3s" in result.stdout
