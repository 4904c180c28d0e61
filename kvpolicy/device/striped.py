"""Striped loads on KV-cache tensors (torch, no vLLM, no Mooncake): each replicated object leaves the
store once per replica set, not once per rank.

What is read, sent and received, in which pieces and where each byte goes is computed by
:mod:`kvpolicy.runtime.striping` (no torch there); this module runs it on the KV-cache tensors.
:class:`StripedReadStore` does it inside a receive thread's ``batch_get_into_multi_buffers`` (vLLM's
``KVCacheStoreRecvingThread`` builds keys, addresses and sizes exactly as upstream does and sees one
result per key, as upstream does; :mod:`kvpolicy.vllm.striped` installs it). Per piece of a load (at
most ``piece_budget_bytes`` staged per rank) the wrapper

1. reads the keys this rank owns from the store (and, with the last piece, every key of a group
   without replicas), straight into its KV cache, as upstream would;
2. gathers its owned keys' regions into one staging buffer, one indexed copy per KV-cache tensor
   (``index_select`` on the tensors' device), and where the KV cache is on a GPU copies that buffer
   to pinned host memory in one copy;
3. exchanges blocks with the other members of its replica sets only (a
   :class:`~kvpolicy.runtime.collective.PeerExchange`: gloo send/recv of raw bytes on an engine,
   :class:`~kvpolicy.runtime.collective.ThreadExchange` in the simulation);
4. copies what it received to the device in one copy and scatters it into its blocks, one
   ``index_copy_`` per KV-cache tensor.

A key is reported failed wherever its owner could not read it or the exchange failed: vLLM then
handles those blocks as any failed get (``kv_load_failure_policy``: ``recompute`` recomputes them, the
default ``fail`` fails the request). No key is reported loaded whose bytes did not arrive whole.

Without vLLM (``scripts/gpu_check.py``, tests): build a :class:`StripedReadStore` over any store client
with ``batch_get_into_multi_buffers``, :class:`KVStorages` of the rank's tensors and
:func:`gloo_exchange` (after ``torch.distributed.init_process_group``), and call
``batch_get_into_multi_buffers(keys, addrs, sizes)`` on every rank.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kvpolicy.device.storages import KVStorages
from kvpolicy.runtime.collective import PeerExchange, Transfer
from kvpolicy.runtime.striping import (
    DEFAULT_PIECE_BUDGET_BYTES,
    IndexRun,
    StripeBlock,
    StripeCounts,
    StripePiece,
    index_runs,
    plan_stripes,
    stripe_owner,
)

# vLLM's init_logger is logging.getLogger under the "vllm" logger it configures; this name keeps that.
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = [
    "EXCHANGE_FAILED",
    "GlooExchange",
    "KVStorages",
    "NcclExchange",
    "StripeCounts",
    "StripedReadStore",
    "gloo_exchange",
    "stripe_owner",
]

EXCHANGE_FAILED = -1
"""The result code of a key whose bytes did not arrive from its owner (vLLM treats < 0 as failed)."""


class StripedReadStore:
    """A receive thread's store client that reads replicated groups striped over their replica sets.

    ``group_of_key(key)`` is the group a key of this rank belongs to (None: no plan namespace);
    ``replica_set_of(group)`` this rank's replica set in it, as the plan says now; ``exchange`` the
    point-to-point exchange among the TP ranks; ``storages`` this rank's KV-cache tensors.
    ``stage_through_host`` forces the device path (a device staging buffer, copied to and from host
    staging once per piece) on CPU tensors, where it is otherwise skipped: tests and the GPU check use
    it to run that path without a GPU.
    """

    def __init__(
        self,
        store: Any,
        *,
        tp_rank: int,
        group_of_key: Callable[[str], int | None],
        replica_set_of: Callable[[int], Sequence[int]],
        exchange: PeerExchange,
        storages: KVStorages,
        piece_budget_bytes: int = DEFAULT_PIECE_BUDGET_BYTES,
        stage_through_host: bool | None = None,
    ) -> None:
        self._store = store
        self._tp_rank = tp_rank
        self._group_of_key = group_of_key
        self._replica_set_of = replica_set_of
        self._exchange = exchange
        self._storages = storages
        self._budget = piece_budget_bytes
        device = storages.device
        self._through_host = (device.type != "cpu") if stage_through_host is None else stage_through_host
        self._pin = device.type == "cuda" and torch.cuda.is_available()
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

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> list[int]:
        if self.broken:
            return self._store.batch_get_into_multi_buffers(keys, addrs, sizes, *args)
        try:
            schedule = plan_stripes(
                keys, sizes, tp_rank=self._tp_rank, group_of_key=self._group_of_key,
                replica_set_of=self._replica_set_of, budget_bytes=self._budget,
            )
        except Exception:
            # Without a schedule this rank cannot meet its peers: they time out and stop striping too.
            logger.exception("kvpolicy striped load: tp rank %d could not schedule a load; it reads every chunk "
                             "itself now", self._tp_rank)
            self.broken = True
            return self._store.batch_get_into_multi_buffers(keys, addrs, sizes, *args)
        results = [EXCHANGE_FAILED] * len(keys)
        tally = _Tally(keys_loaded=len(keys), bytes_loaded=schedule.load_bytes)
        try:
            for number, piece in enumerate(schedule.pieces):
                reads = [unit.index for unit in piece.reads]
                if self.broken:  # an earlier piece's exchange failed: read the rest as a per-rank load would
                    reads += [unit.index for block in piece.incoming for unit in block.units]
                if number == len(schedule.pieces) - 1:
                    reads += schedule.local
                self._read(reads, keys, addrs, sizes, args, results, tally)
                if not self.broken:
                    self._exchange_piece(piece, addrs, results, tally)
            if not schedule.pieces:
                self._read(list(schedule.local), keys, addrs, sizes, args, results, tally)
        finally:
            with self._lock:
                self.counts = self.counts + tally.counts()
        return results

    # --- one piece ---

    def _read(
        self,
        indices: Sequence[int],
        keys: Sequence[str],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        args: Sequence[Any],
        results: list[int],
        tally: _Tally,
    ) -> None:
        if not indices:
            return
        tally.keys_read += len(indices)
        try:
            codes = self._store.batch_get_into_multi_buffers(
                [keys[i] for i in indices], [addrs[i] for i in indices], [sizes[i] for i in indices], *args
            )
        except Exception:
            # Still take part in the exchange: a rank that skipped it would leave its peers waiting.
            logger.exception("kvpolicy striped load: tp rank %d: the store read failed", self._tp_rank)
            return
        for index, code in zip(indices, codes, strict=False):
            results[index] = int(code)

    def _exchange_piece(
        self, piece: StripePiece, addrs: Sequence[Sequence[int]], results: list[int], tally: _Tally
    ) -> None:
        send_work, send_wire = self._buffers(piece.send_bytes)
        receive_work, receive_wire = self._buffers(piece.receive_bytes)
        staged = piece.send_bytes + piece.receive_bytes
        on_device = self._exchange.device_buffers or self._through_host
        tally.staged(host=0 if self._exchange.device_buffers else staged, device=staged if on_device else 0)
        flags = [[results[unit.index] >= 0 for unit in block.units] for block in piece.outgoing]
        try:
            if piece.outgoing:
                self._gather(index_runs(piece.outgoing, addrs, self._storages.map), send_work, tally)
                if send_wire is not send_work:
                    send_wire.copy_(send_work)  # one device→host copy of the whole piece
                    tally.device_to_host_copies += 1
        except Exception:
            logger.exception("kvpolicy striped load: tp rank %d could not stage its stripe", self._tp_rank)
            flags = [[False] * len(block.units) for block in piece.outgoing]
        try:
            for block, ok in zip(piece.outgoing, flags, strict=True):
                self._write(send_wire, block.offset, block.header(ok), tally)
        except Exception:  # the peers then find no header of theirs and use nothing of this piece
            logger.exception("kvpolicy striped load: tp rank %d could not write its block headers", self._tp_rank)
        tally.exchanges += 1
        try:
            sends: list[Transfer] = [(peer, send_wire[block.offset : block.end]) for peer, block in piece.sends()]
            receives: list[Transfer] = [
                (block.owner, receive_wire[block.offset : block.end]) for block in piece.incoming
            ]
            self._exchange(sends, receives)
        except Exception:
            logger.exception(
                "kvpolicy striped load: tp rank %d could not exchange its stripe; it reads every chunk itself now",
                self._tp_rank,
            )
            self.broken = True
            tally.keys_failed += sum(len(block.units) for block in piece.incoming)
            return
        tally.bytes_sent += sum(block.payload_bytes for _, block in piece.sends())
        arrived = self._arrived(piece.incoming, receive_wire, tally)
        try:
            if arrived:
                if receive_work is not receive_wire:
                    receive_work.copy_(receive_wire)  # one host→device copy of the whole piece
                    tally.host_to_device_copies += 1
                runs = index_runs(piece.incoming, addrs, self._storages.map, only=lambda unit: unit.index in arrived)
                self._scatter(runs, receive_work, tally)
                if self._storages.device.type == "cuda":
                    # vLLM uses the blocks once this call returns: the scatter must have landed.
                    torch.cuda.current_stream(self._storages.device).synchronize()
        except Exception:
            logger.exception("kvpolicy striped load: tp rank %d could not place what it received", self._tp_rank)
            arrived = {}
        received = [unit for block in piece.incoming for unit in block.units]
        for unit in received:
            if unit.index in arrived:
                results[unit.index] = 0
        tally.keys_received += len(arrived)
        tally.bytes_received += sum(arrived.values())
        if len(arrived) < len(received):
            tally.keys_failed += len(received) - len(arrived)
            logger.warning(
                "kvpolicy striped load: %d keys of tp rank %d did not arrive from their owners: failed gets",
                len(received) - len(arrived), self._tp_rank,
            )

    def _arrived(self, incoming: Sequence[StripeBlock], wire: torch.Tensor, tally: _Tally) -> dict[int, int]:
        """{key index: bytes} of the received keys whose owner read them, from the blocks' headers; a
        header of another block than expected means the ranks are out of step: none of it is used,
        and this rank stops exchanging."""
        arrived: dict[int, int] = {}
        for block in incoming:
            flags = block.read_header(self._read_bytes(wire, block.offset, block.header_bytes, tally))
            if flags is None:
                logger.error(
                    "kvpolicy striped load: tp rank %d received another block than it expected from rank %d "
                    "(the ranks are out of step); it reads every chunk itself now", self._tp_rank, block.owner,
                )
                self.broken = True
                continue
            arrived.update((unit.index, unit.nbytes) for unit, ok in zip(block.units, flags, strict=True) if ok)
        return arrived

    # --- tensors ---

    def _buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(where the indexed copies run, what the exchange sends or fills) for ``nbytes``."""
        device = self._storages.device
        if self._exchange.device_buffers:
            work = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return work, work
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        if not self._through_host:
            return host, host
        return torch.empty(nbytes, dtype=torch.uint8, device=device), host

    def _indices(self, runs: Sequence[IndexRun], tally: _Tally) -> list[torch.Tensor]:
        """Each run's row indices on the KV cache's device, built on the host and copied over at once."""
        parts = [
            (torch.tensor(run.firsts, dtype=torch.int64)[:, None] + torch.arange(run.rows_each)).reshape(-1)
            for run in runs
        ]
        index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        tally.index_bytes = max(tally.index_bytes, index.numel() * index.element_size())
        if self._storages.device.type != "cpu":
            index = index.to(self._storages.device)
            tally.index_uploads += 1
        return list(torch.split(index, [run.rows for run in runs]))

    def _gather(self, runs: Sequence[IndexRun], work: torch.Tensor, tally: _Tally) -> None:
        for run, index in zip(runs, self._indices(runs, tally), strict=True):
            target = work[run.start : run.start + run.nbytes].view(-1, run.row_bytes)
            torch.index_select(self._storages.rows(run.storage, run.row_bytes), 0, index, out=target)
            tally.gather_ops += 1

    def _scatter(self, runs: Sequence[IndexRun], work: torch.Tensor, tally: _Tally) -> None:
        for run, index in zip(runs, self._indices(runs, tally), strict=True):
            source = work[run.start : run.start + run.nbytes].view(-1, run.row_bytes)
            self._storages.rows(run.storage, run.row_bytes).index_copy_(0, index, source)
            tally.scatter_ops += 1

    def _write(self, wire: torch.Tensor, offset: int, data: bytes, tally: _Tally) -> None:
        wire[offset : offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if wire.device.type != "cpu":
            tally.header_copies += 1

    def _read_bytes(self, wire: torch.Tensor, offset: int, length: int, tally: _Tally) -> bytes:
        if wire.device.type != "cpu":
            tally.header_copies += 1
        return bytes(wire[offset : offset + length].cpu().numpy())


@dataclass
class _Tally:
    """One load's counts, gathered as it runs (folded into :class:`StripeCounts` at its end)."""

    keys_loaded: int = 0
    bytes_loaded: int = 0
    keys_read: int = 0
    exchanges: int = 0
    keys_received: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    keys_failed: int = 0
    device_to_host_copies: int = 0
    host_to_device_copies: int = 0
    index_uploads: int = 0
    header_copies: int = 0
    gather_ops: int = 0
    scatter_ops: int = 0
    host_staging: int = 0
    device_staging: int = 0
    index_bytes: int = 0

    def staged(self, *, host: int, device: int) -> None:
        self.host_staging = max(self.host_staging, host)
        self.device_staging = max(self.device_staging, device)

    def counts(self) -> StripeCounts:
        return StripeCounts(
            loads=1, exchanges=self.exchanges, keys_loaded=self.keys_loaded, bytes_loaded=self.bytes_loaded,
            keys_read=self.keys_read, keys_received=self.keys_received, bytes_received=self.bytes_received,
            bytes_sent=self.bytes_sent, keys_failed=self.keys_failed,
            device_to_host_copies=self.device_to_host_copies, host_to_device_copies=self.host_to_device_copies,
            index_uploads=self.index_uploads, header_copies=self.header_copies, gather_ops=self.gather_ops,
            scatter_ops=self.scatter_ops, peak_host_staging_bytes=self.host_staging,
            peak_device_staging_bytes=self.device_staging, peak_index_bytes=self.index_bytes,
        )


# --- the collective ------------------------------------------------------------------------------


class GlooExchange:
    """:class:`PeerExchange` over a gloo process group: ``isend``/``irecv`` of raw host tensors
    between the peers, each transfer waited on for at most ``timeout``. ``ranks[tp_rank]`` is the
    global rank of a TP rank."""

    device_buffers = False

    def __init__(self, group: Any, ranks: Sequence[int], timeout: timedelta) -> None:
        self._group = group
        self._ranks = list(ranks)
        self._timeout = timeout

    def __call__(self, sends: Sequence[Transfer], receives: Sequence[Transfer]) -> None:
        works = []
        for tag, peer, buffer in _tagged(receives):
            works.append(torch.distributed.irecv(buffer, src=self._ranks[peer], group=self._group, tag=tag))
        for tag, peer, buffer in _tagged(sends):
            works.append(torch.distributed.isend(buffer, dst=self._ranks[peer], group=self._group, tag=tag))
        for work in works:
            work.wait(self._timeout)


class NcclExchange:
    """:class:`PeerExchange` over an NCCL process group: device buffers, no host staging. Not yet run
    on a GPU: off unless ``kvpolicy_striped_exchange`` is ``nccl``. Its communicator runs beside the
    model's on another stream; NCCL does not order two communicators' kernels, which a GPU run must
    show harmless before this becomes a default."""

    device_buffers = True

    def __init__(self, group: Any, ranks: Sequence[int]) -> None:
        self._group = group
        self._ranks = list(ranks)

    def __call__(self, sends: Sequence[Transfer], receives: Sequence[Transfer]) -> None:
        distributed = torch.distributed
        operations = [
            distributed.P2POp(distributed.irecv, buffer, self._ranks[peer], self._group, tag)
            for tag, peer, buffer in _tagged(receives)
        ] + [
            distributed.P2POp(distributed.isend, buffer, self._ranks[peer], self._group, tag)
            for tag, peer, buffer in _tagged(sends)
        ]
        if not operations:
            return
        for work in distributed.batch_isend_irecv(operations):
            work.wait()
        torch.cuda.current_stream().synchronize()


def _tagged(transfers: Sequence[Transfer]) -> list[tuple[int, int, Any]]:
    """(tag, peer, buffer): the ``k``-th transfer with a peer gets tag ``k``, on both ends."""
    seen: dict[int, int] = {}
    tagged = []
    for peer, buffer in transfers:
        tag = seen.get(peer, 0)
        seen[peer] = tag + 1
        tagged.append((tag, peer, buffer))
    return tagged


def gloo_exchange(ranks: Sequence[int], timeout_s: float = 120.0) -> GlooExchange:
    """A :class:`GlooExchange` over a new gloo group of ``ranks`` (global ranks, TP order), made for
    striped loads alone: the receive thread must not share a communicator with the model's or the
    audit's collectives. Every process of ``ranks`` calls this, after ``torch.distributed`` is up."""
    timeout = timedelta(seconds=timeout_s)
    group = torch.distributed.new_group(
        ranks=list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True
    )
    return GlooExchange(group, ranks, timeout)
