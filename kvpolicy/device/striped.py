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
   :class:`~kvpolicy.runtime.ports.PeerExchange`: gloo send/recv of raw bytes on an engine,
   :class:`~kvpolicy.runtime.collective.ThreadExchange` in the simulation);
4. copies what it received to the device in one copy and scatters it into its blocks, one
   ``index_copy_`` per KV-cache tensor.

A key is reported failed wherever its owner could not read it or the exchange failed: vLLM then
handles those blocks as any failed get (``kv_load_failure_policy``: ``recompute``, which ``kvpolicy
vllm-config`` sets, recomputes them; vLLM's default ``fail`` fails the request). No key is reported
loaded whose bytes did not arrive whole. A rank that cannot allocate a piece's staging fails nothing:
it tells its peers in the piece's headers, and it and they read those keys from the store themselves
(:attr:`StripedReadStore.broken`).

Everything here may run on vLLM's receive thread, whose current CUDA device is 0 on every rank: a load
runs with the KV cache's device current (:mod:`kvpolicy.device.guard`), and the NCCL exchange's
communicator is made on the main thread, at registration (:func:`nccl_exchange`).

Without vLLM (``scripts/gpu_check.py``, tests): build a :class:`StripedReadStore` over any store client
with ``batch_get_into_multi_buffers``, :class:`KVStorages` of the rank's tensors and
:func:`gloo_exchange` (after ``torch.distributed.init_process_group``), and call
``batch_get_into_multi_buffers(keys, addrs, sizes)`` on every rank.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kvpolicy.device.guard import TORCH_DEVICES
from kvpolicy.device.storages import KVStorages, as_words, word_for
from kvpolicy.runtime.ports import DeviceApi, PeerExchange, ReadStore, Transfer
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
    "allocate_staging",
    "exchange_group",
    "gloo_exchange",
    "nccl_exchange",
    "stripe_owner",
    "torchcomms_enabled",
]

EXCHANGE_FAILED = -1
"""The result code of a key whose bytes did not arrive from its owner (vLLM treats < 0 as failed)."""


class StripedReadStore:
    """A receive thread's store client that reads replicated groups striped over their replica sets.

    ``group_of_key(key)`` is the group a key of this rank belongs to (None: no plan namespace);
    ``replica_set_of(group)`` this rank's replica set in it, as the plan says now; ``exchange`` the
    point-to-point exchange among the TP ranks; ``storages`` this rank's KV-cache tensors (on one
    device). ``stage_through_host`` forces the device path (a device staging buffer, copied to and from
    host staging once per piece) on CPU tensors, where it is otherwise skipped: tests and the GPU check
    use it to run that path without a GPU. ``devices`` is the device API (:mod:`kvpolicy.device.guard`):
    each load runs with the KV cache's device current, on whatever thread calls it. ``allocate`` makes
    staging buffers (:func:`allocate_staging`'s signature; tests hand one that runs out of memory).

    With an exchange on device buffers (NCCL) the staging of a piece within the budget is reserved
    here, once, at construction (on an engine: in ``register_kv_caches``, on the main thread): a load
    allocates no device memory, so it cannot fail to stage halfway through an exchange its peers are
    waiting in. With host buffers (gloo) a piece's staging is allocated per piece; a failure there
    (device memory, pinned memory) is survived: see :attr:`broken`.
    """

    def __init__(
        self,
        store: ReadStore,
        *,
        tp_rank: int,
        group_of_key: Callable[[str], int | None],
        replica_set_of: Callable[[int], Sequence[int]],
        exchange: PeerExchange,
        storages: KVStorages,
        piece_budget_bytes: int = DEFAULT_PIECE_BUDGET_BYTES,
        stage_through_host: bool | None = None,
        devices: DeviceApi[torch.device] = TORCH_DEVICES,
        allocate: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self._store = store
        self._allocate = allocate_staging if allocate is None else allocate
        self._tp_rank = tp_rank
        self._group_of_key = group_of_key
        self._replica_set_of = replica_set_of
        self._exchange = exchange
        self._storages = storages
        self._device = storages.device  # ValueError on tensors of several devices: striping needs one
        self._devices = devices
        self._budget = piece_budget_bytes
        device = self._device
        self._through_host = (device.type != "cpu") if stage_through_host is None else stage_through_host
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self._lock = threading.Lock()
        self._reserved: torch.Tensor | None = None
        if exchange.device_buffers:
            with devices.on(device):
                self._reserved = self._allocate(piece_budget_bytes, device=device)
        self.counts = StripeCounts()
        self.broken = False
        """This rank reads per rank from now on, exchanging nothing. Set when an exchange failed (its
        peers stop once their own exchange fails in turn) and after a load in which this rank could
        not stage a piece or a peer quit: such a rank still takes part in the rest of that load's
        exchanges, with quit headers (:data:`~kvpolicy.runtime.striping.QUIT_FLAG`) and no payload,
        reading the keys itself, so that its peers see it at once and nobody waits out a timeout."""

    @property
    def inner(self) -> ReadStore:
        """The client this wraps."""
        return self._store

    def batch_get_replica_desc(self, keys: list[str]) -> Any:
        return self._store.batch_get_replica_desc(keys)

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> list[int]:
        if self.broken:
            return self._store.batch_get_into_multi_buffers(keys, addrs, sizes, *args)
        with self._devices.on(self._device):
            return self._load(keys, addrs, sizes, args)

    def _load(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], args: Sequence[Any]
    ) -> list[int]:
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
        load = _Load(keys, addrs, sizes, args, results, tally)
        quitting = False
        try:
            for number, piece in enumerate(schedule.pieces):
                reads = [unit.index for unit in piece.reads]
                if self.broken or quitting:  # read the rest as a per-rank load would
                    reads += [unit.index for block in piece.incoming for unit in block.units]
                if number == len(schedule.pieces) - 1:
                    reads += schedule.local
                self._read(reads, load)
                if not self.broken:
                    quitting = self._exchange_piece(piece, load, quitting=quitting)
            if not schedule.pieces:
                self._read(list(schedule.local), load)
        finally:
            if quitting:
                self.broken = True
            with self._lock:
                self.counts = self.counts + tally.counts()
        return results

    # --- one piece ---

    def _read(self, indices: Sequence[int], load: _Load) -> None:
        if not indices:
            return
        load.tally.keys_read += len(indices)
        try:
            codes = self._store.batch_get_into_multi_buffers(
                [load.keys[i] for i in indices], [load.addrs[i] for i in indices], [load.sizes[i] for i in indices],
                *load.args,
            )
        except Exception:
            # Still take part in the exchange: a rank that skipped it would leave its peers waiting.
            logger.exception("kvpolicy striped load: tp rank %d: the store read failed", self._tp_rank)
            return
        for index, code in zip(indices, codes, strict=False):
            load.results[index] = int(code)

    def _exchange_piece(self, piece: StripePiece, load: _Load, *, quitting: bool) -> bool:
        """Stage, exchange and place one piece; whether this rank quits the exchange for the rest of
        the load (it could not stage, or a peer quit). A quitting rank sends quit headers and reads
        what it would have received; on entry with ``quitting`` it has read it already."""
        tally = load.tally
        quit_here = False
        staging = None
        if not quitting:
            try:
                staging = self._stage(piece, tally)
            except Exception:
                logger.exception(
                    "kvpolicy striped load: tp rank %d could not allocate the staging of a piece (%d bytes); it "
                    "reads the rest of this load itself, tells its peers, and reads per rank after it",
                    self._tp_rank, piece.staged_bytes,
                )
                tally.staging_failures += 1
                quit_here = True
        if staging is None:
            try:
                send_wire, receive_wire = self._quit_wires(piece)
                for block in piece.outgoing:
                    self._write(send_wire, block.offset, block.quit_header(), tally)
            except Exception:
                logger.exception("kvpolicy striped load: tp rank %d cannot take part in the exchange; it reads "
                                 "every chunk itself now", self._tp_rank)
                self.broken = True
                if quit_here:
                    self._read([unit.index for block in piece.incoming for unit in block.units], load)
                return True
        else:
            send_work, send_wire, receive_work, receive_wire = staging
            flags = [[load.results[unit.index] >= 0 for unit in block.units] for block in piece.outgoing]
            try:
                if piece.outgoing:
                    self._gather(index_runs(piece.outgoing, load.addrs, self._storages.map), send_work, tally)
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
            if quit_here:
                self._read([unit.index for block in piece.incoming for unit in block.units], load)
            elif not quitting:
                tally.keys_failed += sum(len(block.units) for block in piece.incoming)
            return quitting or quit_here
        if staging is None:
            if quit_here:  # what this rank would have received: read it from the store instead
                self._read([unit.index for block in piece.incoming for unit in block.units], load)
            return True
        tally.bytes_sent += sum(block.payload_bytes for _, block in piece.sends())
        arrived, quitters = self._arrived(piece.incoming, receive_wire, tally)
        try:
            if arrived:
                if receive_work is not receive_wire:
                    receive_work.copy_(receive_wire)  # one host→device copy of the whole piece
                    tally.host_to_device_copies += 1
                runs = index_runs(piece.incoming, load.addrs, self._storages.map, only=lambda unit: unit.index in arrived)
                self._scatter(runs, receive_work, tally)
                # vLLM uses the blocks once this call returns: the scatter must have landed.
                self._devices.synchronize(self._device)
        except Exception:
            logger.exception("kvpolicy striped load: tp rank %d could not place what it received", self._tp_rank)
            arrived = {}
        quit_blocks = {id(block) for block in quitters}
        received = [unit for block in piece.incoming if id(block) not in quit_blocks for unit in block.units]
        for unit in received:
            if unit.index in arrived:
                load.results[unit.index] = 0
        tally.keys_received += len(arrived)
        tally.bytes_received += sum(arrived.values())
        if len(arrived) < len(received):
            tally.keys_failed += len(received) - len(arrived)
            logger.warning(
                "kvpolicy striped load: %d keys of tp rank %d did not arrive from their owners: failed gets",
                len(received) - len(arrived), self._tp_rank,
            )
        if quitters:
            logger.warning(
                "kvpolicy striped load: tp rank %d: tp ranks %s quit the exchange (they could not stage); it reads "
                "their keys itself, and per rank after this load",
                self._tp_rank, sorted({block.owner for block in quitters}),
            )
            tally.peer_quits += len(quitters)
            self._read([unit.index for block in quitters for unit in block.units], load)
            return True
        return False

    def _arrived(
        self, incoming: Sequence[StripeBlock], wire: torch.Tensor, tally: _Tally
    ) -> tuple[dict[int, int], list[StripeBlock]]:
        """({key index: bytes} of the received keys whose owner read them, the blocks whose owner quit),
        from the blocks' headers; a header of another block than expected means the ranks are out of
        step: none of it is used, and this rank stops exchanging."""
        arrived: dict[int, int] = {}
        quitters: list[StripeBlock] = []
        for block in incoming:
            header = self._read_bytes(wire, block.offset, block.header_bytes, tally)
            if block.quits(header):
                quitters.append(block)
                continue
            flags = block.read_header(header)
            if flags is None:
                logger.error(
                    "kvpolicy striped load: tp rank %d received another block than it expected from rank %d "
                    "(the ranks are out of step); it reads every chunk itself now", self._tp_rank, block.owner,
                )
                self.broken = True
                continue
            arrived.update((unit.index, unit.nbytes) for unit, ok in zip(block.units, flags, strict=True) if ok)
        return arrived, quitters

    # --- tensors ---

    def _stage(self, piece: StripePiece, tally: _Tally) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(send work, send wire, receive work, receive wire) of ``piece``: the indexed copies run on the
        work buffers, the exchange sends and fills the wires. Raises when memory is short."""
        send_bytes, receive_bytes = piece.send_bytes, piece.receive_bytes
        staged = send_bytes + receive_bytes
        device = self._device
        if self._exchange.device_buffers:
            reserved = self._reserved
            both = reserved[:staged] if reserved is not None and staged <= reserved.numel() else self._allocate(
                staged, device=device
            )
            send, receive = both[:send_bytes], both[send_bytes:staged]
            tally.staged(host=0, device=staged)
            return send, send, receive, receive
        wires = self._host(staged)
        send_wire, receive_wire = wires[:send_bytes], wires[send_bytes:staged]
        if not self._through_host:
            tally.staged(host=staged, device=0)
            return send_wire, send_wire, receive_wire, receive_wire
        work = self._allocate(staged, device=device)
        tally.staged(host=staged, device=staged)
        return work[:send_bytes], send_wire, work[send_bytes:staged], receive_wire

    def _host(self, nbytes: int) -> torch.Tensor:
        """Host staging, pinned where the KV cache is on a GPU; pageable when pinning fails (slower
        copies, the same bytes). torch reports a failed pin (no accelerator, driver or pinned memory
        left: ``torch.OutOfMemoryError``, ``torch.AcceleratorError``) as a ``RuntimeError``."""
        if self._pin:
            try:
                return self._allocate(nbytes, pin=True)
            except RuntimeError as error:
                logger.warning("kvpolicy striped load: tp rank %d could not pin %d bytes of host staging (%s); "
                               "using pageable memory", self._tp_rank, nbytes, error)
        return self._allocate(nbytes)

    def _quit_wires(self, piece: StripePiece) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers to take part in ``piece``'s exchange without staging its payload: zeroed pageable host
        memory (or, for device buffers, the reservation) of the piece's sizes."""
        send_bytes, staged = piece.send_bytes, piece.staged_bytes
        if self._exchange.device_buffers:
            reserved = self._reserved
            both = reserved[:staged] if reserved is not None and staged <= reserved.numel() else self._allocate(
                staged, device=self._device
            )
            both.zero_()
        else:
            both = torch.zeros(staged, dtype=torch.uint8)
        return both[:send_bytes], both[send_bytes:staged]

    def _indices(self, runs: Sequence[IndexRun], tally: _Tally) -> list[torch.Tensor]:
        """Each run's row indices on the KV cache's device, built on the host and copied over at once."""
        parts = [
            (torch.tensor(run.firsts, dtype=torch.int64)[:, None] + torch.arange(run.rows_each)).reshape(-1)
            for run in runs
        ]
        index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        tally.peak_index_bytes = max(tally.peak_index_bytes, index.numel() * index.element_size())
        if self._device.type != "cpu":
            index = index.to(self._device)
            tally.index_uploads += 1
        return list(torch.split(index, [run.rows for run in runs]))

    def _gather(self, runs: Sequence[IndexRun], work: torch.Tensor, tally: _Tally) -> None:
        for run, index in zip(runs, self._indices(runs, tally), strict=True):
            rows, staged = self._rows(run, work)
            torch.index_select(rows, 0, index, out=staged)
            tally.gather_ops += 1

    def _scatter(self, runs: Sequence[IndexRun], work: torch.Tensor, tally: _Tally) -> None:
        for run, index in zip(runs, self._indices(runs, tally), strict=True):
            rows, staged = self._rows(run, work)
            rows.index_copy_(0, index, staged)
            tally.scatter_ops += 1

    def _rows(self, run: IndexRun, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the KV tensor's rows, the run's stretch of staging), both as rows of the widest word that
        divides the row and both addresses: int64 for KV blocks at a header-padded offset, 8 times fewer
        elements for the indexed copy than bytes."""
        staged = work[run.start : run.start + run.nbytes]
        word = word_for(run.row_bytes, self._storages.address(run.storage), staged.data_ptr())
        return self._storages.rows(run.storage, run.row_bytes, word), as_words(staged, run.row_bytes, word)

    def _write(self, wire: torch.Tensor, offset: int, data: bytes, tally: _Tally) -> None:
        wire[offset : offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if wire.device.type != "cpu":
            tally.header_copies += 1

    def _read_bytes(self, wire: torch.Tensor, offset: int, length: int, tally: _Tally) -> bytes:
        if wire.device.type != "cpu":
            tally.header_copies += 1
        return bytes(wire[offset : offset + length].cpu().numpy())


def allocate_staging(nbytes: int, *, device: torch.device | None = None, pin: bool = False) -> torch.Tensor:
    """``nbytes`` of staging (uninitialised) on ``device``, or in host memory (pinned with ``pin``) when None."""
    if device is not None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


@dataclass
class _Load:
    """One ``batch_get_into_multi_buffers`` call: its arguments and what it reports."""

    keys: Sequence[str]
    addrs: Sequence[Sequence[int]]
    sizes: Sequence[Sequence[int]]
    args: Sequence[Any]
    results: list[int]
    tally: _Tally


class _Tally:
    """One load's counts, gathered as it runs: :class:`StripeCounts`' fields (each ``peak_*`` field kept
    as the most any piece held), folded into one :class:`StripeCounts` at its end."""

    def __init__(self, **start: int) -> None:
        self.__dict__.update(dict.fromkeys(StripeCounts.__dataclass_fields__, 0), **start)

    def staged(self, *, host: int, device: int) -> None:
        self.peak_host_staging_bytes = max(self.peak_host_staging_bytes, host)
        self.peak_device_staging_bytes = max(self.peak_device_staging_bytes, device)

    def counts(self) -> StripeCounts:
        return StripeCounts(**{**self.__dict__, "loads": 1})


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
    show harmless before this becomes a default.

    It runs on vLLM's receive thread, whose current device is 0 on every rank: each call enters
    ``device`` (this rank's KV-cache device) for the transfers and the wait, synchronizes that device's
    stream, and leaves the thread's device as it found it (``devices``: :mod:`kvpolicy.device.guard`).
    Build its group with :func:`exchange_group` and ``device`` given, so that the communicator is made
    at once, on the calling (main) thread, not lazily on the receive thread."""

    device_buffers = True

    def __init__(self, group: Any, ranks: Sequence[int], device: torch.device, devices: DeviceApi[torch.device] = TORCH_DEVICES) -> None:
        self._group = group
        self._ranks = list(ranks)
        self._device = device
        self._devices = devices

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
        with self._devices.on(self._device):
            for work in distributed.batch_isend_irecv(operations):
                work.wait()
            self._devices.synchronize(self._device)


def _tagged(transfers: Sequence[Transfer]) -> list[tuple[int, int, Any]]:
    """(tag, peer, buffer): the ``k``-th transfer with a peer gets tag ``k``, on both ends."""
    seen: dict[int, int] = {}
    tagged = []
    for peer, buffer in transfers:
        tag = seen.get(peer, 0)
        seen[peer] = tag + 1
        tagged.append((tag, peer, buffer))
    return tagged


TORCHCOMMS_ENV = "TORCH_DISTRIBUTED_USE_TORCHCOMMS"


def torchcomms_enabled() -> bool:
    """torch routes process-group creation through TorchComms (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``):
    a new group is then a split of the world's, which every rank of the world must enter, with no
    local synchronization. Striped loads make a group of the TP ranks alone, so they do not run then."""
    # The environment as torch reads it at import ("1"), read now: torch's config values set in code are
    # per thread, and vLLM's threads would not see one set on another.
    if os.environ.get(TORCHCOMMS_ENV) == "1":
        return True
    try:
        from torch.distributed import config
    except ImportError:  # a torch without the setting has no TorchComms either
        return False
    return bool(getattr(config, "use_torchcomms", False))


def exchange_group(
    ranks: Sequence[int], backend: str, timeout: timedelta, *, device: torch.device | None = None
) -> Any:
    """A new process group of ``ranks`` (global ranks, TP order) for striped loads alone: the receive
    thread must not share a communicator with the model's or the audit's collectives. Every process of
    ``ranks`` calls this, after ``torch.distributed`` is up; only they (``use_local_synchronization``:
    another TP group's or pipeline stage's ranks need not, and may plan otherwise). Given ``device``
    (NCCL), the communicator is made at once, on this thread, for that device.

    Raises ``RuntimeError`` under TorchComms, which cannot make a group of some ranks alone
    (:func:`torchcomms_enabled`): ``kvpolicy.vllm.striped.striping_possible`` says so before."""
    if torchcomms_enabled():
        raise RuntimeError(
            "striped loads need a process group of the TP ranks alone, which TorchComms "
            "(TORCH_DISTRIBUTED_USE_TORCHCOMMS=1) cannot make without every rank of the world"
        )
    return torch.distributed.new_group(
        ranks=list(ranks), backend=backend, timeout=timeout, use_local_synchronization=True,
        **({"device_id": device} if device is not None else {}),
    )


def gloo_exchange(ranks: Sequence[int], timeout_s: float = 120.0) -> GlooExchange:
    """A :class:`GlooExchange` over a new gloo group of ``ranks`` (:func:`exchange_group`)."""
    timeout = timedelta(seconds=timeout_s)
    return GlooExchange(exchange_group(ranks, "gloo", timeout), ranks, timeout)


def nccl_exchange(
    ranks: Sequence[int], device: torch.device, timeout_s: float = 120.0, devices: DeviceApi[torch.device] = TORCH_DEVICES
) -> NcclExchange:
    """An :class:`NcclExchange` over a new NCCL group of ``ranks`` whose communicator is made now, for
    ``device`` (this rank's KV-cache device), on the calling thread (:func:`exchange_group`)."""
    group = exchange_group(ranks, "nccl", timedelta(seconds=timeout_s), device=device)
    return NcclExchange(group, ranks, device, devices)
