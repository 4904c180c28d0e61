"""The striped-load schedule (``kvpolicy.runtime.striping``), without vLLM, torch or a store: who reads
which key, who sends what to whom, in which pieces, and where the bytes go, for a whole TP group of
ranks at once; then whole loads over the in-process exchange with byte arrays as KV caches."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.runtime.collective import ExchangeTimeout, ThreadExchange
from kvpolicy.runtime.striping import (
    FINGERPRINT_BYTES,
    IndexRun,
    StorageMap,
    StripeBlock,
    StripeSchedule,
    StripeUnit,
    index_runs,
    plan_stripes,
)


@dataclass(frozen=True)
class Group:
    factor: int
    """Replica-set size (1: every rank reads its own)."""
    keys: int
    regions: tuple[int, ...]
    """Bytes of each region of one key."""


@dataclass(frozen=True)
class Load:
    """One load as every TP rank of an instance sees it: a rank's keys of a group live in its replica
    set's namespace, so members share key names and other replica sets have names of their own."""

    tp: int
    groups: tuple[Group, ...]
    seed: int = 0

    def replica_set(self, group: int, rank: int) -> tuple[int, ...]:
        factor = self.groups[group].factor
        first = rank // factor * factor
        return tuple(range(first, first + factor))

    def keys(self, rank: int) -> tuple[list[str], list[list[int]]]:
        keys: list[str] = []
        sizes: list[list[int]] = []
        for index, group in enumerate(self.groups):
            shard = rank // group.factor
            for chunk in range(group.keys):
                keys.append(f"g{index}/s{shard}@{random.Random(f'{self.seed}/{chunk}').getrandbits(32):08x}")
                sizes.append(list(group.regions))
        order = list(range(len(keys)))
        random.Random(self.seed).shuffle(order)  # vLLM's order, the same on every rank
        return [keys[i] for i in order], [sizes[i] for i in order]

    def schedule(self, rank: int, budget: int = 1 << 30) -> StripeSchedule:
        keys, sizes = self.keys(rank)
        return plan_stripes(
            keys, sizes, tp_rank=rank, group_of_key=lambda key: int(key[1 : key.index("/")]),
            replica_set_of=lambda group: self.replica_set(group, rank), budget_bytes=budget,
        )


def loads(max_tp: int = 8) -> st.SearchStrategy[Load]:
    @st.composite
    def build(draw: st.DrawFn) -> Load:
        tp = draw(st.sampled_from([tp for tp in (1, 2, 4, 8) if tp <= max_tp]))
        groups = draw(
            st.lists(
                st.builds(
                    Group,
                    factor=st.sampled_from([f for f in (1, 2, 4, 8) if f <= tp]),
                    keys=st.integers(0, 13),
                    regions=st.lists(st.sampled_from([16, 48, 64, 256]), min_size=1, max_size=4).map(tuple),
                ),
                min_size=1,
                max_size=4,
            )
        )
        return Load(tp, tuple(groups), draw(st.integers(0, 1000)))

    return build()


def by_key(units: Sequence[StripeUnit]) -> dict[str, StripeUnit]:
    return {unit.key: unit for unit in units}


# --- who reads, who receives ------------------------------------------------------------------------


def test_the_jth_key_of_a_group_in_sorted_order_is_read_by_member_j_mod_f() -> None:
    load = Load(4, (Group(2, 5, (64,)),))
    keys, _ = load.keys(1)
    schedule = load.schedule(1)
    read = {unit.key for unit in schedule.units_read}
    assert read == set(sorted(keys)[1::2])  # rank 1 is member 1 of replica set (0, 1)
    assert {unit.owner for unit in schedule.units_received} == {0}


@settings(deadline=None)
@given(loads())
def test_every_key_is_read_exactly_once_per_replica_set_and_held_by_every_member(load: Load) -> None:
    schedules = [load.schedule(rank) for rank in range(load.tp)]
    for rank, schedule in enumerate(schedules):
        keys, _ = load.keys(rank)
        read = [unit.key for unit in schedule.units_read] + [keys[i] for i in schedule.local]
        received = [unit.key for unit in schedule.units_received]
        assert sorted(read + received) == sorted(keys)  # every key once: read or received
        for group in range(len(load.groups)):
            members = load.replica_set(group, rank)
            readers = [
                unit.key for member in members for unit in schedules[member].units_read if unit.group == group
            ]
            assert len(readers) == len(set(readers))  # no key read twice in a replica set


@settings(deadline=None)
@given(loads())
def test_a_rank_receives_only_from_members_of_its_replica_set_in_that_group(load: Load) -> None:
    for rank in range(load.tp):
        for piece in load.schedule(rank).pieces:
            for block in piece.incoming:
                assert block.owner in load.replica_set(block.group, rank) and block.owner != rank
            for peer, block in piece.sends():
                assert peer in load.replica_set(block.group, rank) and peer != rank


@settings(deadline=None)
@given(loads())
def test_bytes_received_are_the_load_less_the_own_stripe_at_most_one_key_a_group_over_f_minus_1_over_f(
    load: Load,
) -> None:
    for rank in range(load.tp):
        schedule = load.schedule(rank)
        _, sizes = load.keys(rank)
        own = sum(unit.nbytes for unit in schedule.units_read)
        local = sum(sum(sizes[i]) for i in schedule.local)
        assert schedule.bytes_received == schedule.load_bytes - own - local
        # Whole keys: (f-1)/f of a group's bytes when f divides its keys, one key more at most otherwise.
        bound = sum(
            (group.factor - 1) / group.factor * group.keys * sum(group.regions)
            + (sum(group.regions) if group.keys % group.factor else 0)
            for group in load.groups
            if group.factor > 1
        )
        assert schedule.bytes_received <= bound + 1e-9


def test_when_f_divides_the_keys_each_rank_receives_exactly_f_minus_1_over_f_of_its_load() -> None:
    load = Load(8, (Group(8, 16, (64, 64)), Group(2, 6, (128,))))
    for rank in range(8):
        schedule = load.schedule(rank)
        assert schedule.bytes_received == 7 / 8 * 16 * 128 + 1 / 2 * 6 * 128


@settings(deadline=None)
@given(loads())
def test_summed_over_a_replica_set_the_members_receive_f_minus_1_times_the_groups_bytes(load: Load) -> None:
    for group_index, group in enumerate(load.groups):
        if group.factor < 2:
            continue
        for first in range(0, load.tp, group.factor):
            received = sum(
                unit.nbytes
                for rank in range(first, first + group.factor)
                for unit in load.schedule(rank).units_received
                if unit.group == group_index
            )
            assert received == (group.factor - 1) * group.keys * sum(group.regions)


# --- pieces -----------------------------------------------------------------------------------------


@settings(deadline=None)
@given(loads(), st.integers(1, 3000))
def test_no_piece_stages_more_than_the_budget_unless_one_key_alone_exceeds_it(load: Load, budget: int) -> None:
    for rank in range(load.tp):
        for piece in load.schedule(rank, budget).pieces:
            units = [unit for block in (*piece.outgoing, *piece.incoming) for unit in block.units]
            assert piece.staged_bytes <= budget or len(units) == 1


@settings(deadline=None)
@given(loads(), st.integers(1, 3000))
def test_every_rank_derives_the_same_pieces(load: Load, budget: int) -> None:
    def cut(rank: int) -> list[list[tuple[int, int]]]:
        return [
            sorted((unit.group, unit.position) for block in (*piece.outgoing, *piece.incoming) for unit in block.units)
            for piece in load.schedule(rank, budget).pieces
        ]

    assert all(cut(rank) == cut(0) for rank in range(load.tp))


@settings(deadline=None)
@given(loads(), st.integers(1, 3000))
def test_what_a_rank_sends_a_peer_is_what_the_peer_expects_from_it_in_the_same_order(load: Load, budget: int) -> None:
    schedules = [load.schedule(rank, budget) for rank in range(load.tp)]
    for rank, schedule in enumerate(schedules):
        for number, piece in enumerate(schedule.pieces):
            for peer in range(load.tp):
                sent = [block for to, block in piece.sends() if to == peer]
                expected = [block for block in schedules[peer].pieces[number].incoming if block.owner == rank]
                assert [(b.units, b.nbytes, b.fingerprint()) for b in sent] == [
                    (b.units, b.nbytes, b.fingerprint()) for b in expected
                ]


def test_a_budget_of_one_key_makes_one_piece_per_key() -> None:
    load = Load(2, (Group(2, 5, (100,)),))
    schedule = load.schedule(0, budget=100 + 1 + 2 * FINGERPRINT_BYTES)
    assert len(schedule.pieces) == 5


def test_a_budget_below_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 byte"):
        Load(2, (Group(2, 1, (8,)),)).schedule(0, budget=0)


# --- blocks -----------------------------------------------------------------------------------------


def unit(key: str, sizes: tuple[int, ...], index: int = 0) -> StripeUnit:
    return StripeUnit(index, key, 0, index, 0, sizes)


def test_a_block_lays_its_keys_out_slot_major_when_they_share_region_sizes() -> None:
    block = StripeBlock(0, 0, (0, 1), (unit("a", (10, 20)), unit("b", (10, 20), 1)), offset=0)
    header = 16  # the fingerprint and two flags, padded to 8 bytes
    assert block.region_offsets() == ((header, header + 20), (header + 10, header + 40))


def test_a_block_of_keys_with_different_region_sizes_lays_them_out_one_key_after_another() -> None:
    block = StripeBlock(0, 0, (0, 1), (unit("a", (10, 20)), unit("b", (5,), 1)), offset=100)
    start = 100 + 16
    assert block.region_offsets() == ((start, start + 10), (start + 30,))


def test_a_header_carries_the_owners_read_results_and_is_refused_for_another_block() -> None:
    block = StripeBlock(0, 0, (0, 1), (unit("a", (8,)), unit("b", (8,), 1)), offset=0)
    assert block.read_header(block.header([True, False])) == (True, False)
    other = StripeBlock(0, 0, (0, 1), (unit("a", (8,)), unit("c", (8,), 1)), offset=0)
    resized = StripeBlock(0, 0, (0, 1), (unit("a", (8,)), unit("b", (4, 4), 1)), offset=0)
    assert other.read_header(block.header([True, True])) is None
    assert resized.read_header(block.header([True, True])) is None


@pytest.mark.parametrize("keys", [1, 7, 8, 9, 100])
def test_a_blocks_payload_starts_eight_byte_aligned_whatever_its_key_count(keys: int) -> None:
    block = StripeBlock(0, 0, (0, 1), tuple(unit(f"k{i}", (64,), i) for i in range(keys)), offset=64)
    assert block.payload_offset % 8 == 0
    assert block.header_bytes - FINGERPRINT_BYTES - keys < 8  # no more padding than alignment needs
    assert len(block.header([True] * keys)) == len(block.quit_header()) == block.header_bytes


def test_a_quit_header_reads_as_nothing_read_and_as_its_owner_quitting() -> None:
    block = StripeBlock(0, 0, (0, 1), (unit("a", (8,)), unit("b", (8,), 1)), offset=0)
    assert block.read_header(block.quit_header()) == (False, False)
    assert block.quits(block.quit_header())
    assert not block.quits(block.header([False, False])) and not block.quits(block.header([True, True]))
    other = StripeBlock(0, 0, (0, 1), (unit("a", (8,)), unit("c", (8,), 1)), offset=0)
    assert not other.quits(block.quit_header())


# --- index runs -------------------------------------------------------------------------------------


def layered_memory(layers: int, blocks: int, block_bytes: int, base: int) -> StorageMap:
    """One tensor per layer, ``blocks`` blocks each, placed apart in an address space."""
    starts = [base + layer * (blocks * block_bytes + 4096) for layer in range(layers)]
    return StorageMap(starts, [blocks * block_bytes] * layers)


@pytest.mark.parametrize("keys", [1, 7, 64])
@pytest.mark.parametrize("layers", [1, 5, 61])
def test_a_block_moves_in_one_indexed_copy_per_tensor_whatever_its_keys_and_regions(keys: int, layers: int) -> None:
    block_bytes = 576
    memory = layered_memory(layers, 200, block_bytes, 1 << 20)
    units = tuple(unit(f"k{i:03}", (block_bytes,) * layers, i) for i in range(keys))
    block = StripeBlock(0, 0, (0, 1), units, offset=0)
    addresses = [[memory.starts[layer] + (3 * i + 1) * block_bytes for layer in range(layers)] for i in range(keys)]
    runs = index_runs([block], addresses, memory)
    assert len(runs) == layers
    assert all(run.row_bytes == block_bytes and run.rows == keys for run in runs)


def move(runs: Sequence[IndexRun], memory: StorageMap, source: bytearray, target: bytearray, *, gather: bool) -> None:
    """What the indexed copies do, in bytes: staging ``target`` from memory ``source`` (gather) or back."""
    for run in runs:
        position, width = run.start, run.row_bytes
        for row in run.row_indices():
            at = memory.starts[run.storage] + row * width
            if gather:
                target[position : position + width] = source[at : at + width]
            else:
                target[at : at + width] = source[position : position + width]
            position += width


@pytest.mark.parametrize("mixed_sizes", [False, True], ids=["slot-major", "key-major"])
def test_index_runs_move_every_kept_byte_to_its_place_and_no_other(mixed_sizes: bool) -> None:
    """Gather from one memory through the runs, scatter into another: every region of every kept
    unit arrives intact, and nothing else is written."""
    rng = random.Random(7)
    layers, block_bytes, blocks = 3, 48, 20
    memory = layered_memory(layers, blocks, block_bytes, 0)
    source = bytearray(rng.randbytes(memory.starts[-1] + memory.lengths[-1]))
    target = bytearray(len(source))
    ids = rng.sample(range(blocks), 6)
    sizes = [(block_bytes,) * layers] * len(ids)
    if mixed_sizes:
        sizes[2] = (block_bytes, block_bytes // 2, block_bytes)
    units = tuple(unit(f"k{i}", sizes[i], i) for i in range(len(ids)))
    block = StripeBlock(0, 0, (0, 1), units, offset=5)
    addresses = [[memory.starts[layer] + bid * block_bytes for layer in range(layers)] for bid in ids]
    dropped = {1, 4}
    staging = bytearray(block.end)
    move(index_runs([block], addresses, memory), memory, source, staging, gather=True)
    kept = index_runs([block], addresses, memory, only=lambda u: u.index not in dropped)
    move(kept, memory, staging, target, gather=False)
    expected = bytearray(len(source))  # the kept regions, and not a byte elsewhere
    for u in units:
        if u.index in dropped:
            continue
        for address, size in zip(addresses[u.index], u.sizes, strict=True):
            expected[address : address + size] = source[address : address + size]
    assert target == expected


def test_a_region_outside_every_tensor_is_refused() -> None:
    memory = StorageMap([1000], [100])
    with pytest.raises(ValueError, match="not inside one registered"):
        memory.locate(1090, 20)
    with pytest.raises(ValueError, match="not inside one registered"):
        memory.locate(10, 4)
    block = StripeBlock(0, 0, (0, 1), (unit("a", (20,)),), offset=0)
    with pytest.raises(ValueError, match="not inside one registered"):
        index_runs([block], [[1090]], memory)


# --- whole loads over the thread exchange ------------------------------------------------------------


def run_load(load: Load, budget: int, *, fail_reads: frozenset[str] = frozenset()) -> list[dict[str, bytes | None]]:
    """Every rank runs its schedule over a :class:`ThreadExchange` with byte arrays as its KV memory;
    the store is a dict of the true bytes (keys in ``fail_reads`` cannot be read). Returns, per rank,
    each key's bytes if reported loaded, else None."""
    exchange = ThreadExchange(load.tp, timeout=10)
    truth = {
        key: random.Random(key).randbytes(sum(sizes))
        for rank in range(load.tp)
        for key, sizes in zip(*load.keys(rank), strict=True)
    }
    outcome: list[dict[str, bytes | None]] = [{} for _ in range(load.tp)]

    def rank_main(rank: int) -> None:
        keys, sizes = load.keys(rank)
        schedule = load.schedule(rank, budget)
        memory: dict[str, bytearray] = {key: bytearray(sum(s)) for key, s in zip(keys, sizes, strict=True)}
        ok = [False] * len(keys)
        for index in schedule.local:
            ok[index] = keys[index] not in fail_reads
            memory[keys[index]][:] = truth[keys[index]] if ok[index] else bytes(len(memory[keys[index]]))
        for piece in schedule.pieces:
            send = bytearray(piece.send_bytes)
            for block in piece.outgoing:
                flags = []
                for unit in block.units:
                    read = unit.key not in fail_reads
                    if read:
                        memory[unit.key][:] = truth[unit.key]
                    ok[unit.index] = read
                    flags.append(read)
                send[block.offset : block.payload_offset] = block.header(flags)
                for unit, offsets in zip(block.units, block.region_offsets(), strict=True):
                    at = 0
                    for offset, size in zip(offsets, unit.sizes, strict=True):
                        send[offset : offset + size] = memory[unit.key][at : at + size]
                        at += size
            receive = bytearray(piece.receive_bytes)
            exchange.member(rank)(
                [(peer, memoryview(send)[b.offset : b.end]) for peer, b in piece.sends()],
                [(b.owner, memoryview(receive)[b.offset : b.end]) for b in piece.incoming],
            )
            for block in piece.incoming:
                flags = block.read_header(bytes(receive[block.offset : block.payload_offset]))
                assert flags is not None
                for unit, offsets, flag in zip(block.units, block.region_offsets(), flags, strict=True):
                    if flag:
                        memory[unit.key][:] = b"".join(
                            receive[offset : offset + size] for offset, size in zip(offsets, unit.sizes, strict=True)
                        )
                    ok[unit.index] = flag
        outcome[rank] = {key: bytes(memory[key]) if ok[i] else None for i, key in enumerate(keys)}

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(load.tp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    outcome.append(truth)  # type: ignore[arg-type]
    return outcome


@settings(deadline=None)
@given(loads(max_tp=4), st.integers(40, 2000))
def test_over_the_thread_exchange_every_rank_ends_with_every_keys_bytes(load: Load, budget: int) -> None:
    *ranks, truth = run_load(load, budget)
    for rank, got in enumerate(ranks):
        assert got == {key: truth[key] for key in load.keys(rank)[0]}


def test_a_key_its_owner_could_not_read_is_failed_on_every_member_and_no_other_is() -> None:
    load = Load(4, (Group(4, 8, (32, 32)), Group(1, 2, (16,))))
    keys = sorted(load.keys(0)[0])
    lost = keys[2]  # a g0 key, owned by member 2 of (0, 1, 2, 3)
    assert lost.startswith("g0/")
    *ranks, truth = run_load(load, budget=150, fail_reads=frozenset({lost}))
    for got in ranks:
        assert got[lost] is None
        assert all(value == truth[key] for key, value in got.items() if key != lost)


# --- the thread exchange ------------------------------------------------------------------------------


def test_a_rank_alone_in_an_exchange_times_out_and_the_exchange_stays_broken() -> None:
    exchange = ThreadExchange(2, timeout=0.2)
    with pytest.raises(ExchangeTimeout):
        exchange.member(0)([(1, bytearray(4))], [(1, bytearray(4))])
    with pytest.raises(ExchangeTimeout, match="broken"):
        exchange.member(1)([(0, bytearray(4))], [(0, bytearray(4))])


def test_the_thread_exchange_matches_transfers_between_two_ranks_in_order() -> None:
    exchange = ThreadExchange(2, timeout=5)
    got: list[bytearray] = [bytearray(3), bytearray(2)]

    def zero() -> None:
        exchange.member(0)([(1, b"abc"), (1, b"de")], [])  # type: ignore[list-item]

    thread = threading.Thread(target=zero)
    thread.start()
    exchange.member(1)([], [(0, got[0]), (0, got[1])])
    thread.join(5)
    assert got == [bytearray(b"abc"), bytearray(b"de")]
