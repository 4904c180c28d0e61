"""Mooncake failures under vLLM's real store threads: no crash, and never a wrong byte used.

Every scenario runs on a *fresh* master: one ``mooncake_master`` process for this module, killed
and started again (empty, same ports) before each scenario, so the module's store clients survive
it (a client whose master is gone blocks ~15 s on ``close``). Scenarios save a 256-token prompt
from a 2-rank instance under the ``default`` policy and load it into a new 2-rank instance
(:class:`kvpolicy.sim.Fleet`, every rank a ``KVPolicyStoreWorker``); a fault is injected between or
inside those steps. The policy's audit is off: these scenarios break Mooncake, not replication, and a
save on a subset of ranks cannot take an audited step (the other ranks would hang in the collective).

"No wrong bytes" is judged as vLLM's scheduler uses a load (:meth:`Instance.verdict`): a load
error must surface as ``failed_recving`` (multi-group models) or as
``get_block_ids_with_load_errors`` (single-group models), and every block the scheduler would
still use must hold the loading rank's own bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import require, unavailable

require("vllm")
require("mooncake.store")

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.mooncake.client import MiB  # noqa: E402
from kvpolicy.mooncake.faults import (  # noqa: E402
    NO_AVAILABLE_HANDLE,
    FaultyStore,
    KillSwitch,
    RestartableMaster,
    fill_store,
)
from kvpolicy.mooncake.master import MooncakeUnavailable  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import BLOCK_SIZE, Fleet, LoadVerdict, SaveOutcome, audited_policy  # noqa: E402

SEGMENT_MIB = 16  # Mooncake's smallest segment: the "tiny" store the full-segment scenario fills
NUM_TOKENS = 256
FULL_HIT = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE  # the lookup keeps the last token: 240
DEFAULT = audited_policy(load_policy("default"), audit=False)


@pytest.fixture(scope="module")
def master() -> Iterator[RestartableMaster]:
    try:
        master = RestartableMaster().start()
    except MooncakeUnavailable as error:
        unavailable(f"no Mooncake master: {error}")
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="module")
def clients(master: RestartableMaster) -> Iterator[ClientPool]:
    pool = ClientPool(master, segment_mib=SEGMENT_MIB)
    try:
        yield pool
    finally:
        if not master.serving:
            fresh_master(master, pool)  # closing clients of a dead master takes ~15 s each
        pool.close()


def fresh_master(master: RestartableMaster, pool: ClientPool) -> None:
    """A new, empty master process on the same ports, with every pooled client re-registered."""
    master.restart()
    master.wait_for_capacity(pool.size * SEGMENT_MIB * MiB)


def on_rank(tp_rank: int, method: str, hook: Callable[[], None]) -> Callable[[int, Any], Any]:
    """``wrap_store`` for an instance: rank ``tp_rank`` runs ``hook`` just before each ``method``."""

    def wrap(rank: int, client: Any) -> Any:
        return FaultyStore(client, before={method: hook}) if rank == tp_rank else client

    return wrap


def transfer_threads_alive(*instances: Any) -> bool:
    return all(
        thread.is_alive()
        for instance in instances
        for rank in instance.ranks
        for thread in (rank.worker.kv_send_thread, *rank.worker.kv_recv_threads)
    )


# --- the master dies mid-save --------------------------------------------------------------------


@dataclass(frozen=True)
class CrashMidSave:
    rank0: SaveOutcome
    rank1: SaveOutcome
    killed: bool
    lookup_while_down: int
    lookup_after_restart: int
    threads_alive: bool
    thread_errors: tuple[str, ...]
    resaved: SaveOutcome
    reloaded: LoadVerdict


@pytest.fixture(scope="module")
def crash_mid_save(master: RestartableMaster, clients: ClientPool) -> CrashMidSave:
    """Kimi-Linear (KDA state + MLA): rank 0 saves; the master is SIGKILLed inside rank 1's save,
    after its existence check and before its put; a new instance looks the prompt up while the
    master is down, then after it restarts (empty), then after the prompt is saved again."""
    fresh_master(master, clients)
    switch = KillSwitch(master)
    with Fleet("kimi-linear", master=master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        saver = fleet.instance(DEFAULT, 2, name="saver", wrap_store=on_rank(1, "batch_put_from_multi_buffers", switch))
        loader = fleet.instance(DEFAULT, 2, name="loader")  # clients connect before the master dies
        rank0 = saver.save(ranks=[0])
        rank1 = saver.save(ranks=[1])
        while_down = loader.lookup().hit_length
        alive = transfer_threads_alive(saver, loader)
        fresh_master(master, clients)
        after_restart = loader.lookup().hit_length
        resaved = saver.save(request="retry")
        lookup = loader.lookup()
        loader.load(lookup)
        return CrashMidSave(
            rank0, rank1, switch.fired, while_down, after_restart, alive, fleet.thread_errors, resaved,
            loader.verdict(lookup),
        )


def test_a_master_crash_mid_save_still_ends_the_store_job_on_every_rank(crash_mid_save: CrashMidSave) -> None:
    outcome = crash_mid_save
    assert outcome.killed
    assert (outcome.rank0.completed_ranks, outcome.rank1.completed_ranks) == ((0,), (1,))
    assert (outcome.rank0.drained_ranks, outcome.rank1.drained_ranks) == ((0,), (1,))


def test_puts_after_a_master_crash_are_reported_as_failed(crash_mid_save: CrashMidSave) -> None:
    before, after = crash_mid_save.rank0.codes(), crash_mid_save.rank1.codes()
    assert before and all(code >= 0 for code in before), before
    assert after and all(code < 0 for code in after), after


def test_a_master_crash_mid_save_raises_nothing_in_the_transfer_threads(crash_mid_save: CrashMidSave) -> None:
    assert crash_mid_save.threads_alive
    assert crash_mid_save.thread_errors == ()


def test_a_lookup_while_the_master_is_down_is_a_miss(crash_mid_save: CrashMidSave) -> None:
    assert crash_mid_save.lookup_while_down == 0


def test_objects_saved_before_a_master_restart_are_a_miss_after_it(crash_mid_save: CrashMidSave) -> None:
    # The master keeps the object index in memory: rank 0's chunks are gone with it.
    assert crash_mid_save.lookup_after_restart == 0


def test_after_a_master_restart_a_new_save_is_loaded_with_the_right_bytes(crash_mid_save: CrashMidSave) -> None:
    verdict = crash_mid_save.reloaded
    assert crash_mid_save.resaved.put_failures == 0
    assert (verdict.hit_tokens, verdict.used_tokens) == (FULL_HIT, FULL_HIT)
    assert verdict.correct and verdict.blocks_checked > 0, verdict.wrong


# --- the master dies mid-load --------------------------------------------------------------------


@dataclass(frozen=True)
class CrashMidLoad:
    multi_group: bool
    killed: bool
    verdict: LoadVerdict
    blind: LoadVerdict
    """The same load judged as if the errors had not been reported."""
    threads_alive: bool


LOAD_ARCHETYPES = ("kimi-linear", "mla")  # two groups (failed_recving) and one group (block ids)


@pytest.fixture(scope="module")
def crash_mid_load(master: RestartableMaster, clients: ClientPool) -> Callable[[str], CrashMidLoad]:
    """The prompt is saved; a new instance finds the hit; rank 0 loads it; the master is SIGKILLed
    inside rank 1's load, just before its ``batch_get_into_multi_buffers``."""
    cache: dict[str, CrashMidLoad] = {}

    def run(archetype: str) -> CrashMidLoad:
        if archetype in cache:
            return cache[archetype]
        fresh_master(master, clients)
        switch = KillSwitch(master)
        with Fleet(archetype, master=master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
            fleet.instance(DEFAULT, 2, name="saver").save()
            loader = fleet.instance(
                DEFAULT, 2, name="loader", wrap_store=on_rank(1, "batch_get_into_multi_buffers", switch)
            )
            lookup = loader.lookup()
            loader.load(lookup, ranks=[0])
            loader.load(lookup, ranks=[1])
            result = CrashMidLoad(
                loader.multi_group,
                switch.fired,
                loader.verdict(lookup),
                loader.verdict(lookup, honour_errors=False),
                transfer_threads_alive(loader),
            )
            fresh_master(master, clients)  # so the fleet can clean up
        cache[archetype] = result
        return result

    return run


@pytest.mark.parametrize("archetype", LOAD_ARCHETYPES)
def test_a_master_crash_mid_load_is_reported_as_a_load_error(
    crash_mid_load: Callable[[str], CrashMidLoad], archetype: str
) -> None:
    outcome = crash_mid_load(archetype)
    verdict = outcome.verdict
    assert outcome.killed and verdict.hit_tokens == FULL_HIT
    if outcome.multi_group:
        # Block ids are only unique per group: vLLM fails the request instead.
        assert verdict.failed_ranks == (1,)
    else:
        assert [rank for rank, ids in verdict.invalid_block_ids if ids] == [1]


@pytest.mark.parametrize("archetype", LOAD_ARCHETYPES)
def test_a_master_crash_mid_load_leaves_the_whole_prompt_to_recompute(
    crash_mid_load: Callable[[str], CrashMidLoad], archetype: str
) -> None:
    # Rank 1 lost every key of its one batch: nothing of the hit is usable on all ranks.
    assert crash_mid_load(archetype).verdict.used_tokens == 0


@pytest.mark.parametrize("archetype", LOAD_ARCHETYPES)
def test_a_master_crash_mid_load_uses_no_wrong_bytes(
    crash_mid_load: Callable[[str], CrashMidLoad], archetype: str
) -> None:
    verdict = crash_mid_load(archetype).verdict
    assert verdict.correct, (verdict.wrong, verdict.stray)


@pytest.mark.parametrize("archetype", LOAD_ARCHETYPES)
def test_a_master_crash_mid_load_would_feed_rank_1_zeros_if_the_error_were_ignored(
    crash_mid_load: Callable[[str], CrashMidLoad], archetype: str
) -> None:
    # The check has teeth: used regardless of the error, rank 1's blocks are wrong (still zero).
    blind = crash_mid_load(archetype).blind
    assert blind.wrong and {block.tp_rank for block in blind.wrong} == {1}


@pytest.mark.parametrize("archetype", LOAD_ARCHETYPES)
def test_a_master_crash_mid_load_neither_hangs_nor_kills_the_receive_threads(
    crash_mid_load: Callable[[str], CrashMidLoad], archetype: str
) -> None:
    outcome = crash_mid_load(archetype)
    assert outcome.threads_alive
    assert (outcome.verdict.problems, outcome.verdict.thread_errors) == ((), ())


# --- a full store --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FullStore:
    prefix: SaveOutcome
    hit_before_fill: int
    junk_objects: int
    full: SaveOutcome
    verdict: LoadVerdict


PREFIX_TOKENS = 128


@pytest.fixture(scope="module")
def full_store(master: RestartableMaster, clients: ClientPool) -> FullStore:
    """MLA at TP 2 on four 16 MiB segments: the first 128 tokens are saved and looked up, then every
    segment is filled with hard-pinned objects, then the whole 256-token prompt is saved.

    Mooncake evicts objects nobody holds a lease on once a segment passes its high watermark (90%),
    so without the lookup the fill would evict the prefix too; ``batch_is_exist`` leases what it
    finds for 10 s (the master's default), as a warm instance's lookup would.
    """
    fresh_master(master, clients)
    with Fleet("mla", master=master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        saver = fleet.instance(DEFAULT, 2, name="saver")
        loader = fleet.instance(DEFAULT, 2, name="loader")  # mounts its segments before the fill
        prefix = saver.save(PREFIX_TOKENS)
        hit_before_fill = loader.lookup().hit_length
        junk = fill_store(fleet.client, fleet.run_id)
        full = saver.save()
        lookup = loader.lookup()
        loader.load(lookup)
        return FullStore(prefix, hit_before_fill, junk, full, loader.verdict(lookup))


def test_a_full_store_refuses_every_new_chunk_with_no_available_handle(full_store: FullStore) -> None:
    # MLA at TP 2 has one namespace; chunks 0-7 exist already, so only chunks 8-15 are offered.
    assert full_store.prefix.put_failures == 0 and full_store.junk_objects > 0
    assert full_store.hit_before_fill == PREFIX_TOKENS
    assert full_store.full.codes() == (NO_AVAILABLE_HANDLE,) * ((NUM_TOKENS - PREFIX_TOKENS) // BLOCK_SIZE)


def test_a_full_store_still_ends_the_store_job_on_every_rank(full_store: FullStore) -> None:
    assert full_store.full.completed_ranks == full_store.full.drained_ranks == (0, 1)


def test_a_full_store_reports_a_hit_only_for_what_was_stored(full_store: FullStore) -> None:
    assert full_store.verdict.hit_tokens == PREFIX_TOKENS


def test_a_full_store_hit_loads_the_right_bytes(full_store: FullStore) -> None:
    verdict = full_store.verdict
    assert verdict.used_tokens == PREFIX_TOKENS and verdict.blocks_checked > 0
    assert verdict.correct, (verdict.wrong, verdict.stray)


# --- one namespace of a sharded group is missing -------------------------------------------------


@dataclass(frozen=True)
class MissingShard:
    hit_before: int
    removed: list[int]
    verdict: LoadVerdict


# (archetype, group, shard, chunk, expected hit): the one (uniform) group of MLA + 2-KV-head
# attention layers at TP 2 has factor 1, so two namespaces; without shard 1's chunk 5 the hit
# stops before that chunk. The KDA state of Kimi-Linear is per rank; its only state below the
# prompt end is the checkpoint at chunk 14 (token 240), so without rank 1's shard of it there is
# no hit at all.
MISSING = {
    "uniform-group-chunk-5": ("uniform-mla-full", "uniform", 1, 5, 5 * BLOCK_SIZE),
    "kda-state-checkpoint": ("kimi-linear", "mamba", 1, FULL_HIT // BLOCK_SIZE - 1, 0),
}


@pytest.fixture(scope="module")
def missing_shard(master: RestartableMaster, clients: ClientPool) -> Callable[[str], MissingShard]:
    cache: dict[str, MissingShard] = {}

    def run(case: str) -> MissingShard:
        if case in cache:
            return cache[case]
        archetype, group_name, shard, chunk, _ = MISSING[case]
        fresh_master(master, clients)
        with Fleet(archetype, master=master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
            saver = fleet.instance(DEFAULT, 2, name="saver")
            saver.save()
            loader = fleet.instance(DEFAULT, 2, name="loader")
            hit_before = loader.lookup().hit_length
            key = saver.key(saver.group_index(group_name), shard, chunk)
            removed = fleet.client.batch_remove([key], True)
            lookup = loader.lookup()
            loader.load(lookup)
            cache[case] = MissingShard(hit_before, removed, loader.verdict(lookup))
        return cache[case]

    return run


@pytest.mark.parametrize("case", MISSING)
def test_a_chunk_missing_from_one_namespace_of_a_sharded_group_ends_the_hit_before_it(
    missing_shard: Callable[[str], MissingShard], case: str
) -> None:
    outcome = missing_shard(case)
    assert outcome.removed == [0]
    assert (outcome.hit_before, outcome.verdict.hit_tokens) == (FULL_HIT, MISSING[case][-1])


@pytest.mark.parametrize("case", MISSING)
def test_a_chunk_missing_from_one_namespace_leaves_the_rest_of_the_hit_correct(
    missing_shard: Callable[[str], MissingShard], case: str
) -> None:
    verdict = missing_shard(case).verdict
    assert verdict.used_tokens == verdict.hit_tokens and not verdict.reported_errors
    assert verdict.correct, (verdict.wrong, verdict.stray)


# --- an object disappears between lookup and load ------------------------------------------------


@dataclass(frozen=True)
class VanishedObject:
    lost_block: int
    verdict: LoadVerdict


VANISHED_CHUNK = 7


@pytest.fixture(scope="module")
def vanished_object(master: RestartableMaster, clients: ClientPool) -> VanishedObject:
    """MLA at TP 2 (one group, one namespace both ranks read): after the lookup found 240 tokens,
    chunk 7's object is removed (as an eviction would), then both ranks load."""
    fresh_master(master, clients)
    with Fleet("mla", master=master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        saver = fleet.instance(DEFAULT, 2, name="saver")
        saver.save()
        loader = fleet.instance(DEFAULT, 2, name="loader")
        lookup = loader.lookup()
        # force: the lookup's batch_is_exist may hold a lease on the key.
        assert fleet.client.batch_remove([saver.key(0, 0, VANISHED_CHUNK)], True) == [0]
        loader.load(lookup)
        return VanishedObject(loader.load_tables[0][VANISHED_CHUNK], loader.verdict(lookup))


def test_an_object_removed_after_the_lookup_is_a_load_error_on_every_rank_that_reads_it(
    vanished_object: VanishedObject,
) -> None:
    lost = (vanished_object.lost_block,)
    assert vanished_object.verdict.invalid_block_ids == ((0, lost), (1, lost))


def test_an_object_removed_after_the_lookup_cuts_the_used_prefix_before_its_chunk(
    vanished_object: VanishedObject,
) -> None:
    verdict = vanished_object.verdict
    assert (verdict.hit_tokens, verdict.used_tokens) == (FULL_HIT, VANISHED_CHUNK * BLOCK_SIZE)


def test_an_object_removed_after_the_lookup_leaves_the_chunks_before_it_correct(
    vanished_object: VanishedObject,
) -> None:
    verdict = vanished_object.verdict
    assert verdict.blocks_checked > 0 and verdict.correct, (verdict.wrong, verdict.stray)


# --- a read that failed --------------------------------------------------------------------------


@dataclass(frozen=True)
class FailedRead:
    hit_before: int
    load_failed_on_rank0: bool
    hit_right_after: int
    hit_after_ttl: int


def fail_first_get() -> Callable[[], None]:
    """A ``FaultyStore`` hook: the first get raises (its objects' segment is gone), later ones run."""
    failed: list[bool] = []

    def hook() -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("the segment holding these objects is gone")

    return hook


def failed_read(master: RestartableMaster, clients: ClientPool, *, ttl_s: float) -> FailedRead:
    """MLA at TP 2 (both ranks read the same objects): the prompt is saved; the loader's rank 0 fails
    to read its hit; the loader looks the prompt up again at once, and again once ``ttl_s`` has passed."""
    fresh_master(master, clients)
    with Fleet("mla", master=master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(DEFAULT, 2, name="saver").save()
        loader = fleet.instance(
            DEFAULT, 2, name="loader", wrap_store=on_rank(0, "batch_get_into_multi_buffers", fail_first_get()),
            extra_config={"kvpolicy_read_failure_ttl_s": ttl_s},
        )
        lookup = loader.lookup()
        (rank0,) = loader.load(lookup, ranks=[0])
        right_after = loader.lookup().hit_length
        time.sleep(ttl_s + 0.2)
        return FailedRead(
            lookup.hit_length, rank0.failed or bool(rank0.invalid_block_ids), right_after, loader.lookup().hit_length
        )


def test_a_chunk_whose_read_failed_is_missing_to_the_next_lookup_until_its_ttl_passes(
    master: RestartableMaster, clients: ClientPool
) -> None:
    read = failed_read(master, clients, ttl_s=2.0)
    assert (read.hit_before, read.load_failed_on_rank0) == (FULL_HIT, True)
    # Recomputed at once, instead of the same hit, the same dead objects, the same failure again.
    assert read.hit_right_after == 0
    assert read.hit_after_ttl == FULL_HIT


def test_without_the_read_failure_memory_the_next_lookup_finds_the_same_hit_again(
    master: RestartableMaster, clients: ClientPool
) -> None:
    read = failed_read(master, clients, ttl_s=0)
    assert (read.hit_before, read.load_failed_on_rank0, read.hit_right_after) == (FULL_HIT, True, FULL_HIT)
