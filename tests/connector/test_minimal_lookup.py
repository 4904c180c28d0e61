"""The connector's lookup (kvpolicy.vllm.lookup) finds what vLLM's own lookup finds, on the same stored
objects, and probes only the keys vLLM's hit search reads.

Every archetype of the simulation at tp 2 and 4, ranks of the production ``KVPolicyStoreWorker`` on a
real Mooncake master: a prompt is saved, then objects are removed at random (seeded), and prompts that
are the saved one, a prefix of it, an extension of it and an unrelated one are looked up twice, by
``KVPolicyStoreWorker.lookup`` and by vLLM's ``MooncakeStoreWorker.lookup`` called on the same worker
(same lookup prefixes, same coordinator): hit lengths and tail boundaries must be equal."""

from __future__ import annotations

import random

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker  # noqa: E402

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import ARCHETYPES, Fleet, Instance  # noqa: E402
from kvpolicy.sim.scheduler import Prompt, block_hashes  # noqa: E402
from kvpolicy.vllm.lookup import search_reads  # noqa: E402

NUM_TOKENS = 256
ROUNDS = 4
CASES = [
    pytest.param(name, tp, id=f"{name}-tp{tp}")
    for name in ARCHETYPES
    for tp in (2, 4)
]


def prompts(instance: Instance, seed: int) -> dict[str, Prompt]:
    saved = instance.prompt
    hash_block_size = instance.ranks[0].worker.hash_block_size
    generator = random.Random(seed)
    extra = tuple(generator.randrange(32_000) for _ in range(72))
    unrelated = tuple(generator.randrange(32_000) for _ in range(NUM_TOKENS))

    def of(tokens: tuple[int, ...]) -> Prompt:
        return Prompt(tokens, tuple(block_hashes(tokens, hash_block_size)))

    return {
        "saved": saved,
        "prefix": of(saved.token_ids[: NUM_TOKENS // 2 + 8]),
        "extension": of(saved.token_ids + extra),
        "unrelated": of(unrelated),
    }


def both_lookups(instance: Instance, prompt: Prompt) -> tuple[object, object]:
    worker = instance.ranks[0].worker
    ours = worker.lookup(prompt.num_tokens, list(prompt.hashes))
    theirs = MooncakeStoreWorker.lookup(worker, prompt.num_tokens, list(prompt.hashes))
    return ours, theirs


@pytest.mark.parametrize(("archetype", "tp_size"), CASES)
def test_the_lookup_finds_what_vllms_lookup_finds_whatever_objects_are_missing(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, tp_size: int
) -> None:
    with Fleet(archetype, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        cold = fleet.instance(load_policy("vllm-compat"), tp_size, name="cold")
        warm = fleet.instance(load_policy("vllm-compat"), tp_size, name="warm")
        generator = random.Random(f"{archetype}-{tp_size}")
        compared = 0
        stored: list[str] = []
        for round_number in range(ROUNDS):
            # Every round starts from the whole prompt stored: a new request puts what is missing.
            written = cold.save(request=f"round{round_number}").keys_written
            stored = stored or sorted(written)
            # Round 0 keeps everything; later rounds remove a growing random share of the objects.
            removed = generator.sample(stored, k=len(stored) * round_number // (ROUNDS + 1))
            for key in removed:
                fleet.client.remove(key, True)
            for name, prompt in prompts(warm, seed=round_number).items():
                ours, theirs = both_lookups(warm, prompt)
                assert (ours.hit_length, ours.tail_key_boundaries) == (theirs.hit_length, theirs.tail_key_boundaries), (
                    f"round {round_number}, {name} prompt, {len(removed)} of {len(stored)} objects removed"
                )
                compared += 1
            if round_number == 0:
                assert both_lookups(warm, warm.prompt)[0].hit_length > 0
        assert compared == ROUNDS * 4


@pytest.mark.parametrize(("archetype", "tp_size"), CASES)
def test_a_stored_prompt_is_found_probing_exactly_the_keys_the_hit_search_reads(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, tp_size: int
) -> None:
    with Fleet(archetype, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(load_policy("vllm-compat"), tp_size, name="cold").save()
        warm = fleet.instance(load_policy("vllm-compat"), tp_size, name="warm")
        worker = warm.ranks[0].worker
        result = warm.lookup()
        assert result.hit_length > 0
        reads = search_reads(worker, NUM_TOKENS, list(warm.prompt.hashes))
        assert worker.last_lookup_probes.keys == reads.keys_read
        assert reads.keys_read <= reads.keys_vllm_probes


def test_a_prompt_nobody_stored_costs_a_few_keys_not_every_chunk(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    with Fleet("kimi-linear", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        warm = fleet.instance(load_policy("vllm-compat"), 4, name="warm")
        worker = warm.ranks[0].worker
        assert warm.lookup().hit_length == 0
        probed_by_vllm = search_reads(worker, NUM_TOKENS, list(warm.prompt.hashes)).keys_vllm_probes
        # The MLA group's first 8 chunks (one namespace), and nothing else: no hit, no state to look for.
        assert worker.last_lookup_probes.keys == 8
        # vLLM: every chunk of every group in every namespace.
        assert probed_by_vllm == NUM_TOKENS // 16 * sum(len(group.lookup_namespaces) for group in warm.plan.groups)


def test_a_search_walk_not_known_here_probes_every_candidate_at_once() -> None:
    """Chunked local attention's manager walks its own way: one batch, as vLLM's lookup, not a call per chunk."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    from kvpolicy.vllm.lookup import EVERYTHING, Walk, walks

    def attention(cls: type, **fields: object) -> object:
        return cls(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float16, **fields)

    coord = MooncakeStoreCoordinator(
        [
            KVCacheGroupSpec(["full"], attention(FullAttentionSpec)),
            KVCacheGroupSpec(["local"], attention(ChunkedLocalAttentionSpec, attention_chunk_size=64)),
            KVCacheGroupSpec(["state"], MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))),
        ],
        16,
        16,
    )
    assert walks(coord) == {0: Walk(ascending=True), 1: EVERYTHING, 2: Walk(ascending=False)}
    assert walks(coord)[1] is EVERYTHING


def lookup_operations(worker: object) -> list[dict[str, object]]:
    """The ``lookup_exists`` operations vLLM's connector telemetry got since the last drain."""
    stats = worker.get_kv_connector_stats()  # type: ignore[attr-defined]
    return [] if stats is None else list(stats.data["mooncake"].get("lookup_exists", []))


def test_a_lookup_is_one_lookup_exists_operation_in_vllms_telemetry_however_many_batches_it_probes(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """Dashboards on ``vllm:mooncake_store_operation_*`` count lookups by ``lookup_exists``, one per lookup
    from vLLM's own lookup; the connector's lookup probes in a few batches and still records one."""
    with Fleet("kimi-linear", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(load_policy("vllm-compat"), 2, name="cold").save()
        warm = fleet.instance(load_policy("vllm-compat"), 2, name="warm")
        worker = warm.ranks[0].worker
        lookup_operations(worker)  # drain
        assert warm.lookup().hit_length > 0
        probes = worker.last_lookup_probes
        assert probes.calls > 1  # the hit search asked in several batches
        (operation,) = lookup_operations(worker)
        assert (operation["num_keys"], operation["status"], operation["num_failed_keys"]) == (probes.keys, "ok", 0)
        MooncakeStoreWorker.lookup(worker, warm.prompt.num_tokens, list(warm.prompt.hashes))
        assert len(lookup_operations(worker)) == 1  # vLLM's own lookup: one as well
