"""``load: striped`` in vLLM's worker: the connector's options, when striping can run, and the exchange
over vLLM's TP group. The striped store itself is :mod:`kvpolicy.device.striped` (torch only), its
schedule :mod:`kvpolicy.runtime.striping` (neither).

Every TP rank must make the same exchanges in the same order: one series of pieces per
``batch_get_into_multi_buffers`` call, which holds while a rank has one receive thread and no
disk-offload staging budget (one get per request). :func:`striping_possible` says when it does not
hold; the worker then reads per rank.
"""

from __future__ import annotations

from datetime import timedelta
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

__all__ = [
    "EXCHANGE_FAILED",
    "EXCHANGE_KEY",
    "PIECE_MIB_KEY",
    "GlooExchange",
    "KVStorages",
    "NcclExchange",
    "StripeCounts",
    "StripedReadStore",
    "exchange_over_tp",
    "gloo_exchange",
    "stripe_owner",
    "striping_possible",
]

PIECE_MIB_KEY = "kvpolicy_striped_piece_mib"
"""The ``kv_connector_extra_config`` key of :attr:`kvpolicy.settings.KVPolicySettings.kvpolicy_striped_piece_mib`."""
EXCHANGE_KEY = "kvpolicy_striped_exchange"
"""The ``kv_connector_extra_config`` key of :attr:`kvpolicy.settings.KVPolicySettings.kvpolicy_striped_exchange`."""


def striping_possible(*, recv_threads: int, disk_offload_budget: int | None) -> str | None:
    """Why striped loads cannot run on this worker, or None: they need every rank to make the same
    exchanges per request, in the same order."""
    if recv_threads != 1:
        return f"VLLM_MOONCAKE_LOAD_RECV_THREADS is {recv_threads}: ranks would process loads in different orders"
    if disk_offload_budget is not None:
        return "a disk-offload buffer budget splits a load into a varying number of gets per rank"
    return None


def exchange_over_tp(exchange: str = "gloo", *, timeout_s: float = 120.0) -> PeerExchange:
    """The exchange on an engine (``kvpolicy_striped_exchange``: ``gloo`` or ``nccl``), over this
    rank's TP group as vLLM has it. Every TP rank calls this while registering its KV caches."""
    from vllm.distributed.parallel_state import get_tp_group

    ranks = list(get_tp_group().ranks)
    if exchange == "nccl":
        group = torch.distributed.new_group(
            ranks=ranks, backend="nccl", timeout=timedelta(seconds=timeout_s), use_local_synchronization=True
        )
        return NcclExchange(group, ranks)
    return gloo_exchange(ranks, timeout_s)
