"""Striped loads: each replicated object leaves the store once per replica set, not once per rank.

Under ``load: striped`` a group whose plan gives a replica set of ``f`` ranks (byte-identical bytes, one
shared namespace) is read as ``f`` disjoint stripes: of the group's keys in one load, sorted, the
``j``-th is read from Mooncake by member ``j % f`` of the replica set, and the members then exchange
what they read over the TP group, so that every member ends with every chunk, as if it had read them
all itself.

:class:`StripedReadStore` does this inside the receive thread's ``batch_get_into_multi_buffers``:
vLLM's ``KVCacheStoreRecvingThread`` builds keys, addresses and sizes exactly as upstream does and sees
one result per key, as upstream does. The wrapper reads the keys this rank owns (and every key of a
group without replicas), gathers every TP rank's stripe (``exchange``, an ``all_gather_object`` of the
TP ranks: a dedicated gloo group on an engine, :class:`~kvpolicy.sim.collective.ThreadGather` in the
simulation), copies the other members' stripes into its own blocks, and reports a key as failed
wherever its owner could not read it, or the exchange failed: vLLM then handles those blocks as any failed
get (``kv_load_failure_policy``: ``recompute`` recomputes them, the default ``fail`` fails the request). No key
is reported loaded whose bytes did not arrive whole.

Every TP rank must make the same exchanges in the same order: one per ``batch_get_into_multi_buffers``
call, which holds while a rank has one receive thread and no disk-offload staging budget (one get per
request). :func:`striping_possible` says when it does not hold; the worker then reads per rank.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from vllm.logger import init_logger

from kvpolicy.plan import Plan

logger = init_logger(f"vllm.{__name__}")

__all__ = ["StripeCounts", "StripedReadStore", "exchange_over_tp", "stripe_owner", "striping_possible"]

EXCHANGE_FAILED = -1
"""The result code of a key whose bytes did not arrive from its owner (vLLM treats < 0 as failed)."""


def striping_possible(*, recv_threads: int, disk_offload_budget: int | None) -> str | None:
    """Why striped loads cannot run on this worker, or None: they need every rank to make one
    exchange per request, in the same order."""
    if recv_threads != 1:
        return f"VLLM_MOONCAKE_LOAD_RECV_THREADS is {recv_threads}: ranks would process loads in different orders"
    if disk_offload_budget is not None:
        return "a disk-offload buffer budget splits a load into a varying number of gets per rank"
    return None


def stripe_owner(position: int, replica_set: Sequence[int]) -> int:
    """The TP rank that reads the ``position``-th (in sorted key order) key of a group."""
    return replica_set[position % len(replica_set)]


@dataclasses.dataclass
class StripeCounts:
    """What striped loads moved on one rank, cumulative (for tests and the benchmark)."""

    exchanges: int = 0
    keys_read: int = 0
    """Keys this rank read from the store."""
    keys_received: int = 0
    """Keys whose bytes came from another member of the replica set."""
    bytes_received: int = 0
    keys_failed: int = 0
    """Keys reported failed because their owner could not read them or the exchange failed."""


class StripedReadStore:
    """A receive thread's store client that reads replicated groups striped over their replica sets.

    ``plan()`` is the plan the worker runs now; ``group_of_key(key)`` the group a key of this rank
    belongs to (None: no plan namespace); ``exchange(payload)`` every TP rank's payload, indexed by TP
    rank; ``region(address, size)`` a writable uint8 view of this rank's KV-cache bytes there.
    """

    def __init__(
        self,
        store: Any,
        *,
        tp_rank: int,
        plan: Callable[[], Plan],
        group_of_key: Callable[[str], int | None],
        exchange: Callable[[Any], Sequence[Any]],
        region: Callable[[int, int], torch.Tensor],
    ) -> None:
        self._store = store
        self._tp_rank = tp_rank
        self._plan = plan
        self._group_of_key = group_of_key
        self._exchange = exchange
        self._region = region
        self._lock = threading.Lock()
        self.counts = StripeCounts()
        self.broken = False
        """An exchange failed: this rank reads per rank from then on (its peers stop once their own
        exchange fails in turn), rather than failing every striped chunk of every later load."""

    @property
    def inner(self) -> Any:
        """The client this wraps."""
        return self._store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _owners(self, plan: Plan, keys: Sequence[str]) -> dict[int, int]:
        """Index in ``keys`` -> owning TP rank, for the keys of groups with a replica set > 1."""
        by_group: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            group = self._group_of_key(key)
            if group is not None and len(plan.groups[group].ranks[self._tp_rank].replica_set) > 1:
                by_group.setdefault(group, []).append(index)
        owners: dict[int, int] = {}
        for group, indices in by_group.items():
            replica_set = plan.groups[group].ranks[self._tp_rank].replica_set
            for position, index in enumerate(sorted(indices, key=lambda index: keys[index])):
                owners[index] = stripe_owner(position, replica_set)
        return owners

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> list[int]:
        if self.broken:
            return self._store.batch_get_into_multi_buffers(keys, addrs, sizes, *args)
        plan = self._plan()
        owners = self._owners(plan, keys)
        mine = [index for index in range(len(keys)) if owners.get(index, self._tp_rank) == self._tp_rank]
        results = [EXCHANGE_FAILED] * len(keys)
        read: Sequence[int] = []
        try:
            if mine:
                read = self._store.batch_get_into_multi_buffers(
                    [keys[index] for index in mine], [addrs[index] for index in mine],
                    [sizes[index] for index in mine], *args,
                )
        finally:
            for index, code in zip(mine, read, strict=False):
                results[index] = int(code)
            # Always take part in the exchange, even after a failed get or pack: a rank that skipped it
            # would leave every other rank of the TP group waiting for it.
            stripe: dict[str, bytes] = {}
            try:
                for index in mine:
                    if index in owners and results[index] >= 0:
                        stripe[keys[index]] = self._pack(addrs[index], sizes[index])
            except Exception:
                logger.exception("kvpolicy striped load: tp rank %d could not pack its stripe", self._tp_rank)
                stripe = {}
            self._receive(keys, addrs, sizes, owners, results, stripe)
        with self._lock:
            self.counts.keys_read += len(mine)
        return results

    def _pack(self, addrs: Sequence[int], sizes: Sequence[int]) -> bytes:
        regions = (self._region(address, size) for address, size in zip(addrs, sizes, strict=True))
        return b"".join(region.cpu().numpy().tobytes() for region in regions)

    def _receive(
        self,
        keys: Sequence[str],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        owners: Mapping[int, int],
        results: list[int],
        stripe: dict[str, bytes],
    ) -> None:
        """Exchange stripes with every TP rank and write the other members' into this rank's blocks."""
        try:
            stripes = list(self._exchange(stripe))
        except Exception:
            logger.exception(
                "kvpolicy striped load: tp rank %d could not exchange its stripe; it reads every chunk itself now",
                self._tp_rank,
            )
            stripes = None
            self.broken = True
        received = failed = received_bytes = 0
        for index, owner in owners.items():
            if owner == self._tp_rank:
                continue
            data = None if stripes is None else stripes[owner].get(keys[index])
            expected = sum(sizes[index])
            if data is None or len(data) != expected:
                results[index] = EXCHANGE_FAILED
                failed += 1
                continue
            source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            offset = 0
            for address, size in zip(addrs[index], sizes[index], strict=True):
                self._region(address, size).copy_(source[offset : offset + size])
                offset += size
            results[index] = 0
            received += 1
            received_bytes += expected
        with self._lock:
            self.counts.exchanges += 1
            self.counts.keys_received += received
            self.counts.bytes_received += received_bytes
            self.counts.keys_failed += failed
        if failed:
            logger.warning(
                "kvpolicy striped load: %d keys of tp rank %d did not arrive from their owners: failed gets",
                failed, self._tp_rank,
            )


def exchange_over_tp(timeout_s: float = 120.0) -> Callable[[Any], list[Any]]:
    """``exchange`` on an engine: ``all_gather_object`` over a gloo group of this rank's TP group made
    for striped loads alone (the receive thread must not share a communicator with the model's or the
    audit's collectives). Every TP rank calls this while registering its KV caches."""
    from datetime import timedelta

    from vllm.distributed.parallel_state import get_tp_group

    tp_group = get_tp_group()
    group = torch.distributed.new_group(
        ranks=list(tp_group.ranks), backend="gloo", timeout=timedelta(seconds=timeout_s),
        use_local_synchronization=True,
    )

    def exchange(payload: Any) -> list[Any]:
        gathered: list[Any] = [None] * tp_group.world_size
        torch.distributed.all_gather_object(gathered, payload, group=group)
        return gathered

    return exchange
