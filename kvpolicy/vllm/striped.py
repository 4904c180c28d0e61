"""``load: striped`` in vLLM's worker: the connector's options, when striping can run, and the exchange
over vLLM's TP group. The striped store itself is :mod:`kvpolicy.device.striped` (torch only), its
schedule :mod:`kvpolicy.runtime.striping` (neither).

Every TP rank must make the same exchanges in the same order: one series of pieces per
``batch_get_into_multi_buffers`` call, which holds while a rank has one receive thread and no
disk-offload staging budget (one get per request). :func:`striping_possible` says when it does not
hold; the worker then reads per rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kvpolicy.device.striped import (
    EXCHANGE_FAILED,
    GlooExchange,
    KVStorages,
    NcclExchange,
    StripeCounts,
    StripedReadStore,
    gloo_exchange,
    stripe_owner,
)
from kvpolicy.runtime.collective import PeerExchange
from kvpolicy.runtime.striping import DEFAULT_PIECE_BUDGET_BYTES

__all__ = [
    "EXCHANGE_FAILED",
    "EXCHANGE_KEY",
    "PIECE_MIB_KEY",
    "GlooExchange",
    "KVStorages",
    "NcclExchange",
    "StripeCounts",
    "StripedReadStore",
    "StripedSettings",
    "exchange_over_tp",
    "gloo_exchange",
    "stripe_owner",
    "striping_possible",
]

PIECE_MIB_KEY = "kvpolicy_striped_piece_mib"
"""``kv_connector_extra_config`` key: MiB one rank stages per exchange of a striped load, at most."""
EXCHANGE_KEY = "kvpolicy_striped_exchange"
"""``kv_connector_extra_config`` key: ``gloo`` (host staging; the default) or ``nccl`` (device buffers;
not yet run on a GPU)."""
EXCHANGES = ("gloo", "nccl")


@dataclass(frozen=True)
class StripedSettings:
    """The connector's options for striped loads."""

    piece_budget_bytes: int = DEFAULT_PIECE_BUDGET_BYTES
    """Bytes one rank stages per exchange, at most (``kvpolicy_striped_piece_mib``, default 256)."""
    exchange: str = "gloo"
    """The collective the stripes travel over (``kvpolicy_striped_exchange``)."""

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any]) -> StripedSettings:
        """The settings ``extra_config`` makes; ``ValueError`` naming every bad key and what to write."""
        errors = []
        mib = extra_config.get(PIECE_MIB_KEY, DEFAULT_PIECE_BUDGET_BYTES / 2**20)
        if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not math.isfinite(mib) or mib * 2**20 < 1:
            errors.append(
                f"kv_connector_extra_config['{PIECE_MIB_KEY}'] must be a number of MiB > 0 (default 256), got {mib!r}"
            )
        exchange = extra_config.get(EXCHANGE_KEY, "gloo")
        if exchange not in EXCHANGES:
            errors.append(
                f"kv_connector_extra_config['{EXCHANGE_KEY}'] must be one of {', '.join(EXCHANGES)}, got {exchange!r}"
            )
        if errors:
            raise ValueError("; ".join(errors))
        return cls(piece_budget_bytes=int(mib * 2**20), exchange=str(exchange))


def striping_possible(*, recv_threads: int, disk_offload_budget: int | None) -> str | None:
    """Why striped loads cannot run on this worker, or None: they need every rank to make the same
    exchanges per request, in the same order."""
    if recv_threads != 1:
        return f"VLLM_MOONCAKE_LOAD_RECV_THREADS is {recv_threads}: ranks would process loads in different orders"
    if disk_offload_budget is not None:
        return "a disk-offload buffer budget splits a load into a varying number of gets per rank"
    return None


def exchange_over_tp(settings: StripedSettings | None = None, *, timeout_s: float = 120.0) -> PeerExchange:
    """The exchange on an engine, over this rank's TP group as vLLM has it. Every TP rank calls this
    while registering its KV caches."""
    from vllm.distributed.parallel_state import get_tp_group

    ranks = list(get_tp_group().ranks)
    if settings is not None and settings.exchange == "nccl":
        group = torch.distributed.new_group(
            ranks=ranks, backend="nccl", timeout=timedelta(seconds=timeout_s), use_local_synchronization=True
        )
        return NcclExchange(group, ranks)
    return gloo_exchange(ranks, timeout_s)
