"""``load: striped``: each replicated object leaves the store once per replica set, every rank still
ends with every block byte for byte, and a failed read anywhere makes vLLM recompute instead of using
wrong bytes.

Ranks are the production ``KVPolicyStoreWorker`` (the simulation), reading through vLLM's own receive
threads from a real Mooncake master; objects read are the master's own counters."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.loader import load_policy  # noqa: E402
from kvpolicy.models import LoadMode, Policy  # noqa: E402
from kvpolicy.mooncake import MasterCounters  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import ARCHETYPES, Fleet, Instance  # noqa: E402
from kvpolicy.vllm.read_failures import RecordingReadStore  # noqa: E402
from kvpolicy.vllm.striped import StripedReadStore  # noqa: E402

pytestmark = pytest.mark.integration

NUM_TOKENS = 256
CASES = [
    pytest.param(name, tp, id=f"{name}-tp{tp}")
    for name in ARCHETYPES
    for tp in (2, 4)
]


def striped(name: str = "default") -> Policy:
    return load_policy(name).model_copy(update={"load": LoadMode.STRIPED})


def objects_read(master: MooncakeMaster, instance: Instance, lookup: Any) -> int:
    before = MasterCounters.read(master.metrics_url)
    instance.load(lookup)
    return MasterCounters.read(master.metrics_url).objects_read - before.objects_read


def loaded(fleet: Fleet, policy: Policy, tp_size: int, master: MooncakeMaster) -> tuple[Instance, Any, int]:
    """A cold save under ``policy``, then a warm instance's lookup and load: (warm, lookup, objects read)."""
    fleet.instance(policy, tp_size, name=f"cold-{policy.load.value}").save()
    warm = fleet.instance(policy, tp_size, name=f"warm-{policy.load.value}")
    lookup = warm.lookup()
    assert lookup.hit_length > 0 and not warm.last_lookup_gated
    return warm, lookup, objects_read(master, warm, lookup)


def receive_store(thread: Any) -> Any:
    """The receive thread's striping view of the store if it has one, else its store as the worker left
    it, under the read-failure recorder every receive thread gets."""
    store = thread.store
    return store.inner if isinstance(store, RecordingReadStore) else store


@pytest.mark.parametrize(("archetype", "tp_size"), CASES)
def test_a_striped_load_reads_each_object_once_and_every_rank_gets_every_block(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, tp_size: int
) -> None:
    with Fleet(archetype, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        per_rank, per_rank_lookup, read_per_rank = loaded(fleet, load_policy("default"), tp_size, mooncake_master)
        assert per_rank.verdict(per_rank_lookup).correct
        fleet.remove_objects()
        warm, lookup, read_striped = loaded(fleet, striped(), tp_size, mooncake_master)
        verdict = warm.verdict(lookup)
        assert verdict.correct and verdict.used_tokens == lookup.hit_length
        # Per rank, a group replicated over f ranks is read f times; striped, once: the unique objects.
        factors = warm.plan.factors
        assert lookup.hit_length == per_rank_lookup.hit_length
        stores = [receive_store(thread) for rank in warm.ranks for thread in rank.worker.kv_recv_threads]
        # Without a replica set there is nothing to stripe: the receive threads keep their store as it was.
        assert all(isinstance(store, StripedReadStore) for store in stores) == (max(factors) > 1)
        received = sum(store.counts.keys_received for store in stores if isinstance(store, StripedReadStore))
        assert read_striped == read_per_rank - received
        if max(factors) > 1:
            assert received > 0 and read_striped < read_per_rank
        else:
            assert received == 0 and read_striped == read_per_rank


def test_objects_read_striped_equal_the_unique_objects_of_the_plan(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """MLA at tp 4: one namespace, 15 chunks loaded (a 256-token hit of 240 tokens): 15 objects, not 60."""
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        _, lookup, read = loaded(fleet, striped(), 4, mooncake_master)
        assert lookup.hit_length == 240
        assert read == 240 // 16
        fleet.remove_objects()
        _, _, read_per_rank = loaded(fleet, load_policy("default"), 4, mooncake_master)
        assert read_per_rank == 4 * 240 // 16


def test_a_read_that_fails_on_one_rank_makes_the_ranks_it_was_read_for_recompute(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """The objects of rank 1's stripe vanish between lookup and load (evicted, their segment lost):
    rank 1's gets fail, and so do rank 0's chunks that rank 1 was to send it."""
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(striped(), 2, name="cold").save()
        warm = fleet.instance(striped(), 2, name="warm")
        lookup = warm.lookup()
        loaded_keys = sorted(warm.key(0, 0, chunk) for chunk in range(lookup.hit_length // 16))
        for key in loaded_keys[1::2]:  # rank 1's stripe: odd positions in key order
            assert fleet.client.remove(key, True) == 0
        loads = warm.load(lookup)
        verdict = warm.verdict(lookup)
        assert verdict.correct  # no wrong byte is used
        assert all(load.failed or load.invalid_block_ids for load in loads)  # both ranks report it
        assert verdict.used_tokens < lookup.hit_length


def test_a_dead_exchange_fails_the_load_instead_of_hanging(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(striped(), 2, name="cold").save()
        warm = fleet.instance(striped(), 2, name="warm", timeout=5.0)
        lookup = warm.lookup()
        # Only rank 0 loads: its exchange partner never arrives.
        (load,) = warm.load(lookup, ranks=[0])
        assert load.drained and (load.failed or load.invalid_block_ids)
        # After a failed exchange a rank reads every chunk itself; its peer's next exchange fails in turn
        # (it finds no partner), and from then on every load is whole instead of failing its stripes.
        warm.load(lookup)
        assert warm.verdict(lookup).correct
        warm.load(lookup)
        verdict = warm.verdict(lookup)
        assert verdict.correct and verdict.used_tokens == lookup.hit_length
        stores = [receive_store(thread) for rank in warm.ranks for thread in rank.worker.kv_recv_threads]
        assert all(isinstance(store, StripedReadStore) and store.broken for store in stores)


def test_more_than_one_receive_thread_falls_back_to_reads_on_every_rank(
    mooncake_master: MooncakeMaster, clients: ClientPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_MOONCAKE_LOAD_RECV_THREADS", "2")
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        warm, lookup, read = loaded(fleet, striped(), 2, mooncake_master)
        assert not any(isinstance(receive_store(t), StripedReadStore) for r in warm.ranks for t in r.worker.kv_recv_threads)
        assert read == 2 * lookup.hit_length // 16
        assert warm.verdict(lookup).correct


def test_a_plan_carries_the_policys_load_mode_into_its_json(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    from kvpolicy.report import plan_to_json

    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        assert plan_to_json(fleet.instance(striped(), 2).plan)["load"] == "striped"
        assert plan_to_json(fleet.instance(load_policy("default"), 2).plan)["load"] == "per-rank"


def test_striping_does_not_change_the_fingerprint(mooncake_master: MooncakeMaster, clients: ClientPool) -> None:
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        assert fleet.instance(striped(), 2).fingerprint == fleet.instance(load_policy("default"), 2).fingerprint
