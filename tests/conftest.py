"""Fixtures for real services.

Each server-backed fixture skips when its server cannot be reached on a laptop, and fails
in CI (``CI`` set), where ``.ci/run`` has started every service: a missing service must never
pass as a skip there.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import pytest
from sqlalchemy import inspect

from celery_leasebeat.store import Store

pytest_plugins = ["celery.contrib.pytest"]

POSTGRES_URL = os.environ.get("LEASEBEAT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("LEASEBEAT_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("LEASEBEAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("LEASEBEAT_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

IN_CI = bool(os.environ.get("CI"))


def require_server(url: str, name: str) -> None:
    """Skip (locally) or fail (in CI) unless something listens at *url*'s host and port."""
    parsed = urlparse(url.replace("+psycopg", "").replace("+pymysql", ""))
    default_ports = {"postgresql": 5432, "mysql": 3306, "redis": 6379, "amqp": 5672}
    host, port = parsed.hostname or "127.0.0.1", parsed.port or default_ports[parsed.scheme]
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        message = f"{name} is not reachable at {host}:{port} ({exc})"
        if IN_CI:
            pytest.fail(f"{message}; CI must start it (see .ci/run)")
        pytest.skip(message)


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'leasebeat.sqlite'}"


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One URL per backend: the store's contract runs on all three."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
    if request.param == "postgresql":
        require_server(POSTGRES_URL, "PostgreSQL")
        return POSTGRES_URL
    require_server(MYSQL_URL, "MariaDB/MySQL")
    return MYSQL_URL


@pytest.fixture
def table_prefix() -> str:
    """A fresh prefix per test, so tests share a database server but never rows."""
    return f"t{uuid.uuid4().hex[:10]}_"


@pytest.fixture
def store(database_url: str, table_prefix: str) -> Iterator[Store]:
    store = Store(database_url, table_prefix=table_prefix)
    yield store
    drop_tables(store)


def make_all_due(store: Store, ago: timedelta = timedelta(seconds=1)) -> None:
    """Set every schedule's next run *ago* in the past (database clock)."""
    due = store.now() - ago
    with store.engine.begin() as connection:
        connection.execute(store.tables.schedules.update().values(next_run_at=due))


def drop_tables(store: Store) -> None:
    pool = store.engine.pool
    checked_out = pool.checkedout() if hasattr(pool, "checkedout") else 0
    store.tables.metadata.drop_all(store.engine, checkfirst=True)
    assert not inspect(store.engine).has_table(store.tables.schedules.name)
    store.dispose()
    assert checked_out == 0, f"{checked_out} connection(s) left checked out"


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """Start real beat and worker processes (tests/cluster.py); stop them and drop their
    tables afterwards."""
    from .cluster import Cluster

    clusters: list[Cluster] = []

    def make(broker: str, database: str, **env: str) -> Cluster:
        cluster = Cluster(tmp_path, broker, database, **env)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()
        drop_tables(cluster.store)
