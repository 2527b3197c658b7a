"""``python -m benchmarks``: leasebeat side by side with Celery's PersistentScheduler,
django-celery-beat and RedBeat, each as real ``celery beat`` processes against the same
Redis and PostgreSQL, in one run. Scenarios (``--scenarios``):

- burst: N crontab schedules due at the same minute boundary, no worker (benchmarks/burst.py),
  with the publishing floor measured in the same run;
- leasebeat-replicas: the largest burst with 1, 2 and 3 leasebeat replicas on one database;
- steady: schedules every second with a worker: dispatch and start lag, runs per occurrence,
  for each scheduler and for 3 leasebeat replicas (benchmarks/steady.py);
- failover: 3 replicas of each scheduler, one killed with SIGKILL mid-run: duplicates,
  losses and the longest gap (benchmarks/steady.py);
- scale: 100,000 schedules none of which is due: start-up time, memory and what an idle cycle
  costs, for each scheduler, a leasebeat restart and leasebeat at 1,000 (benchmarks/scale.py).

Results go to docs/benchmarks/ (results.json, results.md and a chart per scenario). Absolute
numbers depend on the machine; compare the ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import burst, report, scale, steady
from .harness import ROOT, SCHEDULER_CLASSES, Settings, machine

SCENARIOS = ["burst", "leasebeat-replicas", "steady", "failover", "scale"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 20000], help="burst sizes")
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULER_CLASSES), choices=list(SCHEDULER_CLASSES))
    parser.add_argument("--redis", default=os.environ.get("LEASEBEAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument(
        "--postgres",
        default=os.environ.get("LEASEBEAT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1/test"),
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="longest wait for one burst, in seconds")
    parser.add_argument("--every-second", type=int, default=10, help="schedules in the steady and failover runs")
    parser.add_argument("--steady-seconds", type=float, default=60.0, help="measured window of a steady run")
    parser.add_argument("--kill-after", type=float, default=20.0, help="failover: seconds before the kill")
    parser.add_argument("--run-after-kill", type=float, default=45.0, help="failover: seconds measured after it")
    parser.add_argument("--scale", type=int, default=100_000, help="schedules in the scale runs")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="scale: the idle window measured")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks")
    options = parser.parse_args(argv)
    settings = Settings(redis=options.redis, postgres=options.postgres)
    results: dict[str, Any] = {
        "started": datetime.now(timezone.utc).isoformat(),
        "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
        "timeout": options.timeout,
        "machine": machine(),
    }
    if "burst" in options.scenarios:
        results["floor"] = {n: burst.publishing_floor(settings, n) for n in options.sizes}
        results["bursts"] = []
        for n in options.sizes:
            for scheduler in options.schedulers:
                outcome = burst.burst(settings, scheduler, n, options.timeout)
                print(json.dumps(asdict(outcome)), flush=True)
                results["bursts"].append(asdict(outcome))
        report.write(results, options.output)  # after each scenario: a late failure keeps the rest
    if "leasebeat-replicas" in options.scenarios:
        size = max(options.sizes)
        results["leasebeat_replicas"] = []
        for replicas in (1, 2, 3):
            outcome = burst.burst(settings, "leasebeat", size, options.timeout, replicas=replicas)
            print(json.dumps(asdict(outcome)), flush=True)
            results["leasebeat_replicas"].append(asdict(outcome))
        report.write(results, options.output)
    if "steady" in options.scenarios:
        results["steady"] = []
        runs = [(scheduler, 1) for scheduler in options.schedulers]
        runs += [("leasebeat", 3)] if "leasebeat" in options.schedulers else []
        for scheduler, replicas in runs:
            measured = steady.steady(settings, scheduler, options.every_second, options.steady_seconds, replicas)
            print(json.dumps(asdict(measured)), flush=True)
            results["steady"].append(asdict(measured))
        report.write(results, options.output)
    if "failover" in options.scenarios:
        results["failover"] = []
        for scheduler in options.schedulers:
            outcome = steady.failover(
                settings, scheduler, options.every_second, options.kill_after, options.run_after_kill
            )
            print(json.dumps(asdict(outcome)), flush=True)
            results["failover"].append(asdict(outcome))
        report.write(results, options.output)
    if "scale" in options.scenarios:
        results["scale"] = []
        runs = [(scheduler, options.scale, False) for scheduler in options.schedulers]
        if "leasebeat" in options.schedulers:
            runs += [("leasebeat", options.scale, True), ("leasebeat", max(options.scale // 100, 1), True)]
        for scheduler, size, restart in runs:
            measured = scale.scale(settings, scheduler, size, options.idle_seconds, restart=restart)
            print(json.dumps(asdict(measured)), flush=True)
            results["scale"].append(asdict(measured))
    report.write(results, options.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
