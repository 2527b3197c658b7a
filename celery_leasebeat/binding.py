"""The per-app, per-process objects: the validated config and the store, made on first use."""

from __future__ import annotations

import threading
from typing import Any

from .config import LeaseBeatConfig
from .store import Store

_lock = threading.Lock()


def store_for(app: Any) -> Store:
    """The app's store, created (without connecting) on first use and cached on the app."""
    store = getattr(app, "_leasebeat_store", None)
    if store is None:
        with _lock:
            store = getattr(app, "_leasebeat_store", None)
            if store is None:
                config = LeaseBeatConfig.from_app(app)
                store = Store(
                    config.database_url,
                    table_prefix=config.table_prefix,
                    schema=config.schema,
                    engine_options=config.engine_options,
                )
                app._leasebeat_store = store
    return store
