"""A hybrid store job makes one existence check and one batched put (kvpolicy.vllm.send), and stores
exactly what vLLM's own send path stores: the same keys, the same bytes, a byte-exact warm load.

Every rank is the production ``KVPolicyStoreWorker`` on a real Mooncake master; the baseline is vLLM's
own ``MooncakeStoreWorker`` (``Fleet.instance(None, ...)``) saving the same prompt under the same keys
(``vllm-compat`` keys are upstream's)."""

from __future__ import annotations

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.language.keys import split_chunk_key  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import HYBRIDS, Fleet, Instance  # noqa: E402
from kvpolicy.vllm.send import MergedSaveSendingThread  # noqa: E402

NUM_TOKENS = 128
DATA_CALLS = ("batch_is_exist", "batch_put_from_multi_buffers")
CASES = [pytest.param(archetype, tp, id=f"{archetype}-tp{tp}") for archetype in HYBRIDS for tp in (2, 4)]


def saved_objects(fleet: Fleet, instance: Instance) -> dict[str, bytes]:
    """Every KV object the instance's save wrote, read back from the store."""
    saved = instance.save()
    assert saved.put_failures == 0 and len(saved.completed_ranks) == instance.model.tp_size
    client = fleet.client
    return {key: bytes(client.get(key)) for key in saved.keys_written}


def state_keys(instance: Instance, keys: set[str] | dict[str, bytes]) -> set[str]:
    """The keys among ``keys`` of the instance's Mamba groups (boundary states)."""
    plan, worker = instance.plan, instance.ranks[0].worker
    prefixes = {
        prefix
        for group in worker.coord.mamba_group_ids
        for tp_rank in range(instance.model.tp_size)
        for prefix in plan.key_prefixes(group, tp_rank, 0, 0)
    }
    return {key for key in keys if split_chunk_key(key)[0] in prefixes}


def data_calls(instance: Instance, rank: int) -> list[tuple[str, list[str]]]:
    return [(name, arguments[0]) for name, arguments in instance.ranks[rank].store.calls if name in DATA_CALLS]


@pytest.mark.parametrize(("archetype", "tp_size"), CASES)
def test_a_hybrid_job_makes_one_exists_check_and_one_put_per_rank(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, tp_size: int
) -> None:
    with Fleet(archetype, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        merged = fleet.instance(load_policy("vllm-compat"), tp_size, name="merged")
        merged.capture(True)
        merged.save()
        merged.capture(False)
        fleet.remove_objects()
        stock = fleet.instance(None, tp_size, name="stock")
        stock.capture(True)
        stock.save()
        for rank in range(tp_size):
            ours, theirs = data_calls(merged, rank), data_calls(stock, rank)
            # The stock send path: exists + put for the boundary states, exists + put for the chunks.
            assert [name for name, _ in theirs] == list(DATA_CALLS) * 2
            assert [name for name, _ in ours] == list(DATA_CALLS)
            # The one put carries every key the two stock puts carried.
            assert sorted(ours[1][1]) == sorted(theirs[1][1] + theirs[3][1])


@pytest.mark.parametrize(("archetype", "tp_size"), CASES)
def test_merged_saves_store_the_same_objects_as_vllms_send_path(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, tp_size: int
) -> None:
    with Fleet(archetype, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        merged = fleet.instance(load_policy("vllm-compat"), tp_size, name="merged")
        assert all(isinstance(rank.worker.kv_send_thread, MergedSaveSendingThread) for rank in merged.ranks)
        ours = saved_objects(fleet, merged)
        fleet.remove_objects()
        theirs = saved_objects(fleet, fleet.instance(None, tp_size, name="stock"))
        assert ours.keys() == theirs.keys()
        assert state_keys(merged, ours) and set(ours) - state_keys(merged, ours)  # states and chunks alike
        assert {key for key in ours if ours[key] != theirs[key]} == set()
        warm = fleet.instance(load_policy("vllm-compat"), tp_size, name="warm")
        lookup = warm.lookup()
        assert lookup.hit_length > 0
        warm.load(lookup)
        assert warm.verdict(lookup).correct


def test_a_second_save_of_stored_objects_makes_one_exists_check_and_no_put(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    with Fleet("kimi-linear", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        first = fleet.instance(load_policy("vllm-compat"), 2, name="first")
        first.save()
        again = fleet.instance(load_policy("vllm-compat"), 2, name="again")
        again.capture(True)
        saved = again.save()
        assert saved.keys_written == frozenset()
        for rank in range(2):
            assert [name for name, _ in data_calls(again, rank)] == ["batch_is_exist"]


def test_boundary_states_missing_while_every_chunk_is_stored_are_put_before_the_job_ends(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """The chunk save makes no put then; the boundary states go out through upstream's own path."""
    with Fleet("gqa-gdn", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        first = fleet.instance(load_policy("vllm-compat"), 2, name="first")
        everything = saved_objects(fleet, first)
        states = state_keys(first, everything)
        assert states
        for key in states:
            assert fleet.client.remove(key, True) == 0  # force: the fresh objects still hold a lease
        again = fleet.instance(load_policy("vllm-compat"), 2, name="again")
        assert again.save().keys_written == frozenset(states)
        warm = fleet.instance(load_policy("vllm-compat"), 2, name="warm")
        lookup = warm.lookup()
        assert lookup.hit_length > 0
        warm.load(lookup)
        assert warm.verdict(lookup).correct


def test_vllms_save_telemetry_counts_the_boundary_keys_that_rode_on_the_chunk_calls(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    def totals(instance: Instance) -> list[tuple[int, int, int]]:
        instance.save()
        reduced = []
        for rank in instance.ranks:
            stats = rank.worker.get_kv_connector_stats()
            data = stats.data.get("mooncake", stats.data) if stats is not None else {}
            records = {operation: records for operation, records in data.items() if operation.startswith("save_")}
            reduced.append(
                (
                    sum(int(record["num_keys"]) for record in records.get("save_exists", [])),
                    sum(int(record["num_keys"]) for record in records.get("save_put", [])),
                    sum(int(record["num_bytes"]) for record in records.get("save_put", [])),
                )
            )
        return reduced

    with Fleet("kimi-linear", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        ours = totals(fleet.instance(load_policy("vllm-compat"), 2, name="merged"))
        fleet.remove_objects()
        theirs = totals(fleet.instance(None, 2, name="stock"))
        assert ours == theirs
        assert all(keys > 0 for keys, _, _ in ours)
