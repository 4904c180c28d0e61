"""Striped loads, the part every rank computes alike: who reads which key, what each rank sends and
receives, in which pieces, and where each byte goes in the staging buffers.

Under ``load: striped`` a group whose plan gives a replica set of ``f`` ranks (byte-identical bytes,
one shared namespace) is read as ``f`` disjoint stripes: of the group's keys in one load, sorted, the
``j``-th is read from the store by member ``j % f`` of the replica set (:func:`stripe_owner`), which
then sends it to the other members of that replica set, and to no other rank. So a rank receives
``load − own stripe`` bytes: ``(f−1)/f`` of a replicated group's bytes when ``f`` divides its key
count, and at most one key more otherwise (keys are whole objects).

:func:`plan_stripes` turns one load (the keys and region sizes vLLM's receive thread hands the store)
into a :class:`StripeSchedule` of :class:`StripePiece`\\ s. The pieces cut the load's replicated keys,
in (group, position) order, into runs that stage at most ``budget_bytes`` per rank each (a key larger
than the budget travels alone): every rank of a replica set stages exactly one copy of each of its
keys (the owner to send, the others to receive), so the cut depends on key counts and sizes alone,
which every TP rank shares, and every rank derives the same pieces without talking.

In a piece, each owner's keys of a group form a :class:`StripeBlock` that travels as
``[fingerprint | one ok flag per key | padding to 8 bytes | payload]``: the fingerprint (of the keys and region sizes)
catches ranks out of step, the flags carry the owner's read results (a key its owner could not read
is a failed get on every member). An owner that could not stage its piece (no memory for the staging
buffers) still takes part in the exchange, with every flag :data:`QUIT_FLAG` and no payload
(:meth:`StripeBlock.quit_header`): its peers read those keys from the store themselves at once,
instead of waiting for a transfer that never comes. The payload is laid out slot-major (the first region of every key,
then the second, ...): on an engine a slot is one KV-cache tensor, so the gather and the scatter are
one indexed copy per tensor (:func:`index_runs`) instead of one copy per region. The header's padding
keeps a payload at an 8-byte offset, so those copies move rows as 8-byte words where the regions' sizes
allow (KV blocks' do), not as single bytes.

Nothing here imports vLLM or torch; :mod:`kvpolicy.device.striped` runs the schedule on tensors.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_PIECE_BUDGET_BYTES",
    "FINGERPRINT_BYTES",
    "HEADER_ALIGN",
    "QUIT_FLAG",
    "IndexRun",
    "StripeBlock",
    "StripeCounts",
    "StripePiece",
    "StripeSchedule",
    "StripeUnit",
    "StorageMap",
    "index_runs",
    "plan_stripes",
    "stripe_owner",
]

QUIT_FLAG = 2
"""The flag of every key in the header of an owner that stops exchanging (it could not stage the
piece): the receivers read its keys themselves, and stop striping after this load as it does."""
DEFAULT_PIECE_BUDGET_BYTES = 256 * 2**20
"""Bytes one rank stages per exchange, at most (payload and headers; send and receive together): far
below what gloo moves in its 120 s timeout, and a bounded transient in host (and device) memory."""
FINGERPRINT_BYTES = 8
HEADER_ALIGN = 8
"""A block's header is padded to a multiple of this many bytes: its payload starts word-aligned."""


def stripe_owner(position: int, replica_set: Sequence[int]) -> int:
    """The TP rank that reads the ``position``-th (in sorted key order) key of a group."""
    return replica_set[position % len(replica_set)]


@dataclass(frozen=True)
class StripeUnit:
    """One key of a replicated group in one load."""

    index: int
    """Position of the key in the load's key list (what the result list is indexed by)."""
    key: str
    group: int
    position: int
    """Position among the load's keys of the group, in sorted key order: decides owner and piece."""
    owner: int
    """The TP rank that reads it from the store."""
    sizes: tuple[int, ...]
    """Bytes of each region the key's object fills, in the order the store call lists them."""

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True)
class StripeBlock:
    """One owner's keys of one group in one piece, as they travel and sit in a staging buffer:
    ``[fingerprint | one ok flag per key | payload]`` from :attr:`offset`."""

    group: int
    owner: int
    replica_set: tuple[int, ...]
    units: tuple[StripeUnit, ...]
    offset: int
    """Where the block starts in the staging buffer of its direction (send or receive)."""

    @property
    def receivers(self) -> tuple[int, ...]:
        """The ranks it goes to: the owner's replica set but the owner."""
        return tuple(rank for rank in self.replica_set if rank != self.owner)

    @property
    def header_bytes(self) -> int:
        """The fingerprint and one flag per key, padded to :data:`HEADER_ALIGN` bytes."""
        return -(-(FINGERPRINT_BYTES + len(self.units)) // HEADER_ALIGN) * HEADER_ALIGN

    def _padding(self) -> bytes:
        return bytes(self.header_bytes - FINGERPRINT_BYTES - len(self.units))

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_bytes

    @property
    def payload_bytes(self) -> int:
        return sum(unit.nbytes for unit in self.units)

    @property
    def nbytes(self) -> int:
        return self.header_bytes + self.payload_bytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def fingerprint(self) -> bytes:
        """A digest of the keys and their region sizes, the same on the owner and every receiver."""
        digest = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
        for unit in self.units:
            digest.update(f"{unit.key}\x1f{','.join(map(str, unit.sizes))}\x1e".encode())
        return digest.digest()

    def header(self, ok: Sequence[bool]) -> bytes:
        """The header the owner writes: the fingerprint, then 1 for each key it read, 0 for each it did not."""
        if len(ok) != len(self.units):
            raise ValueError(f"{len(ok)} flags for a block of {len(self.units)} keys")
        return self.fingerprint() + bytes(1 if flag else 0 for flag in ok) + self._padding()

    def quit_header(self) -> bytes:
        """The header of an owner that stops exchanging: the fingerprint, then :data:`QUIT_FLAG` for every key."""
        return self.fingerprint() + bytes([QUIT_FLAG] * len(self.units)) + self._padding()

    def read_header(self, header: bytes) -> tuple[bool, ...] | None:
        """The owner's flags, or None when the header is not this block's (the ranks are out of step).
        A quitting owner's flags are all False (:meth:`quits` tells it apart)."""
        if len(header) != self.header_bytes or header[:FINGERPRINT_BYTES] != self.fingerprint():
            return None
        return tuple(flag == 1 for flag in header[FINGERPRINT_BYTES : FINGERPRINT_BYTES + len(self.units)])

    def quits(self, header: bytes) -> bool:
        """``header`` is this block's and its owner stops exchanging (:meth:`quit_header`)."""
        flags = header[FINGERPRINT_BYTES : FINGERPRINT_BYTES + len(self.units)]
        return (
            len(header) == self.header_bytes and header[:FINGERPRINT_BYTES] == self.fingerprint()
            and bool(flags) and all(flag == QUIT_FLAG for flag in flags)
        )

    def region_offsets(self) -> tuple[tuple[int, ...], ...]:
        """Where each region of each unit sits in the staging buffer: slot-major (region 0 of every
        unit, then region 1, ...) when all units have the same region sizes, key-major otherwise."""
        offset = self.payload_offset
        shapes = {unit.sizes for unit in self.units}
        if len(shapes) == 1:
            (sizes,) = shapes
            columns: list[list[int]] = [[] for _ in self.units]
            for size in sizes:
                for column in columns:
                    column.append(offset)
                    offset += size
            return tuple(tuple(column) for column in columns)
        rows = []
        for unit in self.units:
            row = []
            for size in unit.sizes:
                row.append(offset)
                offset += size
            rows.append(tuple(row))
        return tuple(rows)


@dataclass(frozen=True)
class StripePiece:
    """One exchange: the keys this rank reads for it, the blocks it sends and those it receives."""

    reads: tuple[StripeUnit, ...]
    """This rank's own keys of the piece, to read from the store before the exchange."""
    outgoing: tuple[StripeBlock, ...]
    """This rank's blocks (one per group it owns keys of), in the send staging buffer."""
    incoming: tuple[StripeBlock, ...]
    """Its peers' blocks, in the receive staging buffer; groups ascending, then owners ascending."""

    @property
    def send_bytes(self) -> int:
        return self.outgoing[-1].end if self.outgoing else 0

    @property
    def receive_bytes(self) -> int:
        return self.incoming[-1].end if self.incoming else 0

    @property
    def staged_bytes(self) -> int:
        """Bytes this rank stages for the piece, send and receive together."""
        return self.send_bytes + self.receive_bytes

    def sends(self) -> tuple[tuple[int, StripeBlock], ...]:
        """(peer, block) of every transfer out, in the order each peer lists its receives from this rank."""
        return tuple((peer, block) for block in self.outgoing for peer in block.receivers)


@dataclass(frozen=True)
class StripeSchedule:
    """What one rank does for one load."""

    tp_rank: int
    budget_bytes: int
    local: tuple[int, ...]
    """Indices of the keys this rank reads for itself alone (no replica set: nothing to exchange)."""
    pieces: tuple[StripePiece, ...]
    load_bytes: int
    """Bytes of every key of the load on this rank: what it ends with when all goes well."""

    @property
    def units_read(self) -> tuple[StripeUnit, ...]:
        return tuple(unit for piece in self.pieces for unit in piece.reads)

    @property
    def units_received(self) -> tuple[StripeUnit, ...]:
        return tuple(unit for piece in self.pieces for block in piece.incoming for unit in block.units)

    @property
    def bytes_received(self) -> int:
        """Payload bytes this rank receives when every transfer arrives."""
        return sum(unit.nbytes for unit in self.units_received)

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank sends, counted once per receiver."""
        return sum(block.payload_bytes for piece in self.pieces for _, block in piece.sends())

    @property
    def peak_staged_bytes(self) -> int:
        return max((piece.staged_bytes for piece in self.pieces), default=0)


def plan_stripes(
    keys: Sequence[str],
    sizes: Sequence[Sequence[int]],
    *,
    tp_rank: int,
    group_of_key: Callable[[str], int | None],
    replica_set_of: Callable[[int], Sequence[int]],
    budget_bytes: int = DEFAULT_PIECE_BUDGET_BYTES,
) -> StripeSchedule:
    """This rank's schedule for a load of ``keys`` (``sizes``: each key's region sizes).

    ``group_of_key(key)`` is the group a key belongs to (None: no plan namespace; read alone);
    ``replica_set_of(group)`` this rank's replica set in that group (it includes ``tp_rank``).
    Every rank of a replica set holds the same keys of the group, so each derives the same owners,
    pieces and layouts as its peers.
    """
    if budget_bytes < 1:
        raise ValueError(f"the piece budget must be at least 1 byte, got {budget_bytes}")
    if len(keys) != len(sizes):
        raise ValueError(f"{len(keys)} keys but {len(sizes)} size lists")
    members: dict[int, tuple[int, ...]] = {}
    by_group: dict[int, list[int]] = {}
    local: list[int] = []
    for index, key in enumerate(keys):
        group = group_of_key(key)
        if group is not None and group not in members:
            replica_set = tuple(replica_set_of(group))
            if len(replica_set) > 1 and tp_rank not in replica_set:
                raise ValueError(f"tp rank {tp_rank} is not in its own replica set {replica_set} of group {group}")
            members[group] = replica_set
        if group is None or len(members[group]) < 2:
            local.append(index)
        else:
            by_group.setdefault(group, []).append(index)
    units = [
        StripeUnit(index, keys[index], group, position, stripe_owner(position, members[group]), tuple(sizes[index]))
        for group in sorted(by_group)
        for position, index in enumerate(sorted(by_group[group], key=lambda index: keys[index]))
    ]
    factors = {group: len(members[group]) for group in by_group}
    pieces = tuple(_piece(run, members, tp_rank) for run in _cut(units, factors, budget_bytes))
    load_bytes = sum(sum(region_sizes) for region_sizes in sizes)
    return StripeSchedule(tp_rank, budget_bytes, tuple(local), pieces, load_bytes)


def _cut(units: Sequence[StripeUnit], factors: dict[int, int], budget_bytes: int) -> list[list[StripeUnit]]:
    """Runs of ``units`` (in order) staging at most ``budget_bytes`` each on any rank: a key costs its
    bytes and its flag on every member, a group present in a piece ``f`` fingerprints and paddings
    (the owner's block and ``f − 1`` received ones)."""
    runs: list[list[StripeUnit]] = []
    run: list[StripeUnit] = []
    cost = 0
    per_block = FINGERPRINT_BYTES + HEADER_ALIGN - 1  # a header's fingerprint and, at most, its padding
    for unit in units:
        opens_group = not run or run[-1].group != unit.group
        added = unit.nbytes + 1 + (per_block * factors[unit.group] if opens_group else 0)
        if run and cost + added > budget_bytes:
            runs.append(run)
            run, cost = [], 0
            added = unit.nbytes + 1 + per_block * factors[unit.group]
        run.append(unit)
        cost += added
    if run:
        runs.append(run)
    return runs


def _piece(units: Sequence[StripeUnit], members: dict[int, tuple[int, ...]], tp_rank: int) -> StripePiece:
    by_group: dict[int, list[StripeUnit]] = {}
    for unit in units:
        by_group.setdefault(unit.group, []).append(unit)
    outgoing: list[StripeBlock] = []
    incoming: list[StripeBlock] = []
    send_offset = receive_offset = 0
    for group in sorted(by_group):
        replica_set = members[group]
        for owner in sorted(replica_set):
            owned = tuple(unit for unit in by_group[group] if unit.owner == owner)
            if not owned:
                continue
            if owner == tp_rank:
                block = StripeBlock(group, owner, replica_set, owned, send_offset)
                outgoing.append(block)
                send_offset = block.end
            else:
                block = StripeBlock(group, owner, replica_set, owned, receive_offset)
                incoming.append(block)
                receive_offset = block.end
    reads = tuple(unit for block in outgoing for unit in block.units)
    return StripePiece(reads, tuple(outgoing), tuple(incoming))


# --- where the bytes go --------------------------------------------------------------------------


class StorageMap:
    """Where a rank's KV-cache tensors lie: tensor ``i`` holds ``lengths[i]`` bytes from ``starts[i]``
    (ascending, disjoint). Addresses are the integers the store call lists."""

    def __init__(self, starts: Sequence[int], lengths: Sequence[int]) -> None:
        if list(starts) != sorted(starts):
            raise ValueError("tensor starts must ascend")
        self.starts = tuple(starts)
        self.lengths = tuple(lengths)

    def locate(self, address: int, size: int) -> tuple[int, int]:
        """(tensor, offset in it) of ``size`` bytes at ``address``; ``ValueError`` when they do not lie
        inside one tensor (so that no copy ever reaches past a tensor)."""
        where = bisect.bisect_right(self.starts, address) - 1
        if where < 0 or address + size > self.starts[where] + self.lengths[where]:
            raise ValueError(f"bytes {address:#x}+{size} are not inside one registered KV-cache tensor")
        return where, address - self.starts[where]

    def column(self, addresses: Sequence[int], size: int) -> tuple[int, list[int]] | None:
        """(tensor, offsets) when every one of ``addresses`` (``size`` bytes each) lies in one tensor, else None."""
        where, _ = self.locate(addresses[0], size)
        start = self.starts[where]
        if min(addresses) < start or max(addresses) + size > start + self.lengths[where]:
            return None
        return where, [address - start for address in addresses]


@dataclass(frozen=True)
class IndexRun:
    """A stretch of a staging buffer whose bytes all come from (or go to) one KV-cache tensor: one
    indexed copy. The tensor is viewed as rows of ``row_bytes``; the stretch is ``rows_each`` rows from
    each of ``firsts``, in order."""

    storage: int
    """Which KV-cache tensor (:class:`StorageMap` numbering)."""
    start: int
    """Byte offset in the staging buffer."""
    row_bytes: int
    firsts: tuple[int, ...]
    rows_each: int

    @property
    def rows(self) -> int:
        return len(self.firsts) * self.rows_each

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def row_indices(self) -> list[int]:
        """Every row, in staging order (the index an indexed copy takes)."""
        return [first + row for first in self.firsts for row in range(self.rows_each)]


def index_runs(
    blocks: Iterable[StripeBlock],
    addresses: Sequence[Sequence[int]],
    storages: StorageMap,
    *,
    only: Callable[[StripeUnit], bool] | None = None,
) -> tuple[IndexRun, ...]:
    """The indexed copies that move the blocks' payloads between staging and the KV-cache tensors
    (``addresses[unit.index]``: the unit's region addresses on this rank), for the units ``only``
    keeps. A slot of a slot-major block (one region of each of its keys: on an engine, one layer's
    tensor) is one copy; anything else (mixed region sizes, a slot across tensors) falls back to
    runs of consecutive regions of one tensor and size."""
    runs: list[IndexRun] = []
    for block in blocks:
        kept = [only is None or only(unit) for unit in block.units]
        for unit in block.units:
            if len(addresses[unit.index]) != len(unit.sizes):
                raise ValueError(
                    f"key {unit.key}: {len(addresses[unit.index])} addresses for {len(unit.sizes)} regions"
                )
        shapes = {unit.sizes for unit in block.units}
        if len(shapes) == 1:
            runs += _slot_runs(block, next(iter(shapes)), kept, addresses, storages)
        else:
            regions = [
                (offset, address, size)
                for unit, offsets, keep in zip(block.units, block.region_offsets(), kept, strict=True)
                if keep
                for offset, address, size in zip(offsets, addresses[unit.index], unit.sizes, strict=True)
            ]
            runs += _region_runs(regions, storages)
    return tuple(runs)


def _slot_runs(
    block: StripeBlock,
    sizes: tuple[int, ...],
    kept: Sequence[bool],
    addresses: Sequence[Sequence[int]],
    storages: StorageMap,
) -> list[IndexRun]:
    stretches: list[tuple[int, int]] = []  # (first unit, end unit) of consecutive kept units
    for number, keep in enumerate(kept):
        if keep and stretches and stretches[-1][1] == number:
            stretches[-1] = (stretches[-1][0], number + 1)
        elif keep:
            stretches.append((number, number + 1))
    runs: list[IndexRun] = []
    slot_start = block.payload_offset
    for slot, size in enumerate(sizes):
        for first, end in stretches:
            column = [addresses[unit.index][slot] for unit in block.units[first:end]]
            start = slot_start + first * size
            found = storages.column(column, size)
            if found is None:
                runs += _region_runs([(start + i * size, a, size) for i, a in enumerate(column)], storages)
                continue
            where, offsets = found
            row_bytes = max(math.gcd(size, *offsets), 1)
            runs.append(IndexRun(where, start, row_bytes, tuple(o // row_bytes for o in offsets), size // row_bytes))
        slot_start += size * len(block.units)
    return runs


def _region_runs(regions: Sequence[tuple[int, int, int]], storages: StorageMap) -> list[IndexRun]:
    """Runs of (staging offset, address, size) regions: consecutive ones of one tensor and one size,
    back to back in staging, share a run."""
    runs: list[IndexRun] = []
    current: list[int] = []  # offsets in the tensor
    where = start = end = size = -1
    for staging_offset, address, region_size in regions:
        tensor, offset = storages.locate(address, region_size)
        if current and (tensor != where or staging_offset != end or region_size != size):
            runs.append(_run(where, start, size, current))
            current = []
        if not current:
            where, start, end, size = tensor, staging_offset, staging_offset, region_size
        current.append(offset)
        end += region_size
    if current:
        runs.append(_run(where, start, size, current))
    return runs


def _run(storage: int, start: int, size: int, offsets: Sequence[int]) -> IndexRun:
    row_bytes = max(math.gcd(size, *offsets), 1)
    return IndexRun(storage, start, row_bytes, tuple(offset // row_bytes for offset in offsets), size // row_bytes)


# --- what a rank moved ---------------------------------------------------------------------------

_PEAKS = frozenset({"peak_host_staging_bytes", "peak_device_staging_bytes", "peak_index_bytes"})


@dataclass(frozen=True)
class StripeCounts:
    """What striped loads moved on one rank, cumulative (tests and the benchmark read it). Sums,
    except the ``peak_*`` fields: the most any one piece held."""

    loads: int = 0
    """Loads that ran the striped schedule (not those read per rank after a failed exchange)."""
    exchanges: int = 0
    """Exchange calls made (one per piece while the exchange works)."""
    keys_loaded: int = 0
    bytes_loaded: int = 0
    """Bytes of every key the loads asked for on this rank: the denominator of the ratios."""
    keys_read: int = 0
    """Keys this rank read from the store."""
    keys_received: int = 0
    """Keys whose bytes came whole from another member of the replica set."""
    bytes_received: int = 0
    """Payload bytes of those keys (headers not counted: 8 bytes a block and 1 a key, padded to 8)."""
    bytes_sent: int = 0
    """Payload bytes sent, once per receiver."""
    keys_failed: int = 0
    """Keys reported failed because their owner could not read them or the exchange failed."""
    device_to_host_copies: int = 0
    """Bulk copies of a piece's send staging from the device to host memory (0 on CPU tensors)."""
    host_to_device_copies: int = 0
    """Bulk copies of a piece's receive staging from host memory to the device (0 on CPU tensors)."""
    index_uploads: int = 0
    """Copies of a piece's row indices to the device (0 on CPU tensors)."""
    header_copies: int = 0
    """Block headers written to or read from device buffers (an NCCL exchange only)."""
    gather_ops: int = 0
    """Indexed copies from the KV cache into send staging: one per KV-cache tensor a piece touches."""
    scatter_ops: int = 0
    """Indexed copies from receive staging into the KV cache."""
    peak_host_staging_bytes: int = 0
    """Host staging buffers of one piece (send and receive), at most."""
    peak_device_staging_bytes: int = 0
    """Device staging buffers of one piece, at most (0 where the KV cache is host memory)."""
    peak_index_bytes: int = 0
    """Row indices (int64) built for one piece, at most."""
    staging_failures: int = 0
    """Pieces whose staging buffers this rank could not allocate: it quit the exchange for the rest of
    the load (read those keys itself, told its peers in the headers) and stopped striping after it."""
    peer_quits: int = 0
    """Blocks received from an owner that quit: their keys this rank read from the store itself."""

    def __add__(self, other: StripeCounts) -> StripeCounts:
        return StripeCounts(
            **{
                name: (max if name in _PEAKS else int.__add__)(getattr(self, name), getattr(other, name))
                for name in self.__dataclass_fields__
            }
        )

    @property
    def copies(self) -> int:
        """Bulk and index copies across the host–device boundary."""
        return self.device_to_host_copies + self.host_to_device_copies + self.index_uploads + self.header_copies
