"""Adapter around Mooncake (master process, store clients, master metrics); never imports vLLM."""

from kvpolicy.mooncake.availability import MooncakeUnavailable
from kvpolicy.mooncake.client import (
    OBJECT_NOT_FOUND,
    ClientConfig,
    StoreSetupError,
    connect_store,
    store_client,
)
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.metrics import MasterCounters, delta, parse_metrics, read_metrics

__all__ = [
    "OBJECT_NOT_FOUND",
    "ClientConfig",
    "MasterCounters",
    "MooncakeMaster",
    "MooncakeUnavailable",
    "StoreSetupError",
    "connect_store",
    "delta",
    "parse_metrics",
    "read_metrics",
    "store_client",
]
