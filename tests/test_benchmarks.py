"""The smoke form of the benchmarks, so the suite cannot rot: a tiny burst for each
scheduler against real Redis and PostgreSQL, and the report files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import POSTGRES_URL, REDIS_URL, require_server

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.e2e


def test_burst_smoke_for_every_scheduler(tmp_path: Path) -> None:
    require_server(REDIS_URL, "Redis")
    require_server(POSTGRES_URL, "PostgreSQL")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--scenarios", "burst", "--sizes", "20", "--timeout", "60",
         "--output", str(tmp_path), "--redis", REDIS_URL, "--postgres", POSTGRES_URL],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "results.json").read_text())
    by_scheduler = {b["scheduler"]: b for b in report["bursts"]}
    assert set(by_scheduler) == {"celery", "django", "redbeat", "leasebeat"}
    for name, burst in by_scheduler.items():
        assert burst["complete"] and burst["delivered"] == 20, (name, burst, result.stdout)
    assert report["floor"]["20"] > 0
    assert (tmp_path / "burst.png").stat().st_size > 1000
    assert "| 20 | leasebeat |" in (tmp_path / "results.md").read_text()
