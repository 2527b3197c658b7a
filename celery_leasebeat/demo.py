"""``python -m celery_leasebeat.demo``: two beat replicas and a worker, no server needed.

It starts real ``celery beat -S leasebeat`` and ``celery worker`` processes on the embedded
default (a SQLite schedule table and the ``filesystem://`` broker, see ``demo_app``), prints
every run as it finishes (schedule, occurrence, the replica that dispatched it, outcome,
duration) and ends by checking that no occurrence ran twice.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .store import Store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_leasebeat.demo", description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to run (default 20)")
    parser.add_argument("--keep", action="store_true", help="keep the demo folder (logs, database)")
    options = parser.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="leasebeat-demo-"))
    env = {**os.environ, "LEASEBEAT_DEMO_DIR": str(folder)}
    celery = [sys.executable, "-m", "celery", "-A", "celery_leasebeat.demo_app"]
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, *args: str) -> None:
        log = open(folder / f"{name}.log", "wb")
        processes[name] = subprocess.Popen([*celery, *args], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)

    print(f"celery-leasebeat demo: 2 beat replicas + 1 worker for {options.seconds:.0f}s in {folder}")
    print("(SQLite schedule table, filesystem:// broker: no server needed)\n")
    start("worker", "worker", "-l", "info", "-c", "2", "--without-gossip", "--without-mingle", "--without-heartbeat")
    for replica in ("beat-1", "beat-2"):
        start(replica, "beat", "-S", "leasebeat", "-l", "info", "-s", str(folder / f"{replica}.schedule"))
    replica_names = {str(process.pid): name for name, process in processes.items()}

    store = Store(f"sqlite:///{folder / 'schedules.sqlite'}")
    shown: set[str] = set()
    header = f"{'finished':8}  {'schedule':19} {'occurrence (UTC)':20} {'dispatched by':14} {'outcome':10} duration"
    print(header)
    print("-" * len(header))
    deadline = time.monotonic() + options.seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(0.5)
            for name, process in processes.items():
                if process.poll() is not None:
                    print(f"\n{name} exited with {process.returncode}; its log:\n")
                    print((folder / f"{name}.log").read_text(errors="replace")[-3000:])
                    return 1
            _print_new_runs(store, shown, replica_names)
    except KeyboardInterrupt:
        pass
    finally:
        for name in ("beat-1", "beat-2", "worker"):
            if name in processes and processes[name].poll() is None:
                processes[name].send_signal(signal.SIGTERM)
                if name == "beat-2":
                    time.sleep(1.0)  # let the worker finish what beat sent last
        for process in processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
    _print_new_runs(store, shown, replica_names)
    ok = _summary(store, replica_names)
    store.dispose()
    if options.keep:
        print(f"\nlogs and database kept in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


def _replica(owner: str | None, replica_names: dict[str, str]) -> str:
    pid = (owner or "").rsplit(":", 1)[-1]
    return replica_names.get(pid, owner or "?")


def _print_new_runs(store: Store, shown: set[str], replica_names: dict[str, str]) -> None:
    try:
        runs = store.list_runs()
    except Exception:  # the first beat has not created the tables yet
        return
    for run in runs:
        if run["finished_at"] is None or run["id"] in shown:
            continue
        shown.add(run["id"])
        duration = f"{run['duration_ms']} ms" if run["duration_ms"] is not None else "-"
        error = f"  ({run['error']})" if run["error"] else ""
        print(
            f"{run['finished_at']:%H:%M:%S}  {run['schedule']:19} {run['occurrence']:%Y-%m-%d %H:%M:%S} "
            f"{_replica(run['replica'], replica_names):14} {run['state']:10} {duration}{error}",
            flush=True,
        )


def _summary(store: Store, replica_names: dict[str, str]) -> bool:
    try:
        runs = store.list_runs()
    except Exception as exc:
        print(f"\nno run was recorded: {exc}")
        return False
    finished = [r for r in runs if r["finished_at"] is not None]
    keys = Counter((r["schedule"], r["occurrence"]) for r in runs)
    twice = [key for key, count in keys.items() if count > 1]
    retried = [r for r in runs if r["attempts"] > 1]
    by_replica = Counter(_replica(r["replica"], replica_names) for r in runs)
    by_outcome = Counter(r["state"] for r in finished)
    print(
        f"\n{len(runs)} occurrences dispatched, {len(finished)} finished "
        f"({', '.join(f'{n} {state}' for state, n in sorted(by_outcome.items()))}); "
        f"by replica: {', '.join(f'{name} {n}' for name, n in sorted(by_replica.items()))}"
    )
    if twice or retried:
        print(f"an occurrence was dispatched more than once: {twice or [r['id'] for r in retried]}")
        return False
    print("every occurrence was dispatched exactly once, by one of the two replicas.")
    return bool(finished)


if __name__ == "__main__":
    sys.exit(main())
