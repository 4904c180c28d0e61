"""The store clients of vLLM's transfer threads, wrapped in one order, built here.

Every wrapper offers the port its thread calls (:class:`~kvpolicy.runtime.ports.SendStore`,
:class:`~kvpolicy.runtime.ports.ReadStore`) and forwards exactly that; :func:`wrap_transfer_stores`
stacks them, innermost first, as :data:`SEND_STACK` and :data:`RECEIVE_STACK` name them. The order
matters: the riding view sits outside the counting view, so that the boundary keys riding on the chunk
calls are counted; the read-failure recorder sits outside the striped reads, so that it sees every
failure vLLM sees (striped loads report their own)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpolicy.device.striped import KVStorages, StripedReadStore, torchcomms_enabled
from kvpolicy.documents.settings import EXTRA_CONFIG, KVPolicySettings
from kvpolicy.runtime.policy import RankPolicy
from kvpolicy.runtime.ports import PeerExchange, ReadStore, SendStore
from kvpolicy.runtime.read_failures import RecordingReadStore
from kvpolicy.runtime.trust import ProtectedStore
from kvpolicy.vllm import internals
from kvpolicy.vllm.config import KVPolicyConfigError
from kvpolicy.vllm.internals import StoreWorker
from kvpolicy.vllm.metrics import CountingStore
from kvpolicy.vllm.send import MergedSaveSendingThread
from kvpolicy.vllm.striped import exchange_over_tp, striping_possible

# vLLM's init_logger is logging.getLogger under the "vllm" logger it configures; the worker's name keeps
# the warning where it always was.
logger = logging.getLogger("vllm.kvpolicy.vllm.worker")

__all__ = ["RECEIVE_STACK", "SEND_STACK", "StripedReads", "wrap_transfer_stores"]

SEND_STACK = (
    "mooncake", "ProtectedStore, current secret only (kvpolicy_secret)", "CountingStore", "MergedSaveSendingThread's riding view"
)
"""The send thread's client, innermost first."""
RECEIVE_STACK = (
    "mooncake", "ProtectedStore (kvpolicy_secret)", "StripedReadStore (load: striped)",
    "RecordingReadStore (kvpolicy_read_failure_ttl_s > 0)",
)
"""Each receive thread's client, innermost first."""


@dataclass(frozen=True)
class StripedReads:
    """How a receive thread's client becomes a :class:`StripedReadStore` (reading the bound plan live)."""

    runtime: RankPolicy
    exchange: PeerExchange
    storages: KVStorages
    piece_budget_bytes: int

    def __call__(self, inner: ReadStore) -> ReadStore:
        runtime = self.runtime
        return StripedReadStore(
            inner, tp_rank=runtime.place.tp_rank, group_of_key=runtime.group_of_key,
            replica_set_of=runtime.replica_set_of, exchange=self.exchange, storages=self.storages,
            piece_budget_bytes=self.piece_budget_bytes,
        )


def wrap_transfer_stores(
    worker: StoreWorker, runtime: RankPolicy, kv_caches: dict[str, torch.Tensor], *, settings: KVPolicySettings,
    exchange: PeerExchange | None,
) -> None:
    """Wrap ``worker``'s transfer threads' clients in the order of :data:`SEND_STACK` and
    :data:`RECEIVE_STACK`. ``exchange`` is the striped loads' (None: over vLLM's TP group)."""
    protected = runtime.store if isinstance(runtime.store, ProtectedStore) else None
    if protected is not None and protected.keyring.current.sealed:
        devices = sorted({str(tensor.device) for tensor in kv_caches.values() if tensor.device.type != "cpu"})
        if devices:
            raise KVPolicyConfigError(
                f"{EXTRA_CONFIG}.kvpolicy_verify_objects: error: the KV caches are on {', '.join(devices)}; objects are "
                "sealed and verified in host memory only (the CPU path; see the trust-boundary guide); unset it here"
            )
    send_layers: list[Callable[[SendStore], SendStore]] = []
    if protected is not None:
        # Each thread its own seal buffers; the send thread's existence checks ask the current namespace only.
        send_layers.append(lambda _: protected.sibling(writes_only=True))
    send_layers.append(lambda inner: CountingStore(inner, runtime.tally, runtime.group_of_key, runtime.dedup_multiplier))
    for layer in send_layers:
        internals.decorate_send_store(worker, layer)
    if worker.kv_send_thread is not None:
        MergedSaveSendingThread.adopt(worker.kv_send_thread)  # type: ignore[arg-type]
    receive_layers: list[Callable[[ReadStore], ReadStore]] = []
    if protected is not None:
        receive_layers.append(lambda _: protected.sibling())
    striped = striped_reads(worker, runtime, kv_caches, settings=settings, exchange=exchange)
    if striped is not None:
        receive_layers.append(striped)
    if runtime.read_failures.ttl_s > 0:
        receive_layers.append(lambda inner: RecordingReadStore(inner, runtime.read_failures))
    for layer in receive_layers:
        internals.decorate_recv_stores(worker, layer)


def striped_reads(
    worker: StoreWorker, runtime: RankPolicy, kv_caches: dict[str, torch.Tensor], *, settings: KVPolicySettings,
    exchange: PeerExchange | None,
) -> StripedReads | None:
    """Under ``load: striped`` where it can run, the receive threads' striping view of the store."""
    binding = runtime.binding
    if binding is None or not binding.stripes_loads or not worker.kv_recv_threads:
        return None  # the same decision on every rank: it depends on the plan alone
    storages = KVStorages.of_kv_caches(kv_caches)
    why = striping_possible(
        recv_threads=len(worker.kv_recv_threads), disk_offload_budget=worker.disk_offload_buffer_budget_bytes,
        kv_devices=storages.devices, torchcomms=torchcomms_enabled(),
    )
    if why is not None:
        if worker.tp_rank == 0:
            logger.warning("kvpolicy: load: striped falls back to reads on every rank: %s", why)
        return None
    if exchange is None:
        exchange = exchange_over_tp(settings.kvpolicy_striped_exchange, device=storages.device)
    return StripedReads(runtime, exchange, storages, settings.striped_piece_budget_bytes)
