"""Instances of different TP sizes sharing one store: with vLLM's TP-sharded store layout
(``store_tp_size``) a TP 4 prefill instance and a TP 2 decode instance read each other's chunks and
every rank gets its own heads' bytes; without it, ``default`` misses and stock keys collide.

Real vLLM store workers (``KVPolicyStoreWorker``) with vLLM's own send and receive threads and
payload layouts (``LBHNCStoreLayout`` / ``LBNHCStoreLayout``), a real Mooncake master; the bytes
are checked per KV head against :mod:`kvpolicy.sim.content`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.language.keys import parse_key  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import BLOCK_SIZE, Fleet, MixedReport, run_mixed  # noqa: E402

NUM_TOKENS = 128
FULL_HIT = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
CHUNKS = NUM_TOKENS // BLOCK_SIZE
STORE_TP = {"store_tp_size": 4}

Run = Callable[..., MixedReport]


@pytest.fixture(scope="module")
def run(mooncake_master: MooncakeMaster, clients: ClientPool) -> Run:
    reports: dict[tuple[object, ...], MixedReport] = {}

    def run(policy: str, saver_tp: int, loader_tp: int, *, store_tp: bool = True, kv_layout: str = "LBHNC") -> MixedReport:
        key = (policy, saver_tp, loader_tp, store_tp, kv_layout)
        if key not in reports:
            reports[key] = run_mixed(
                load_policy(policy), saver_tp, load_policy(policy), loader_tp, "gqa-8kv",
                master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS,
                extra_config=STORE_TP if store_tp else {}, kv_cache_layout=kv_layout,
            )
        return reports[key]

    return run


SHARING = [
    pytest.param(policy, saver, loader, kv_layout, id=f"{policy}-tp{saver}-to-tp{loader}-{kv_layout}")
    for policy in ("default", "vllm-compat")
    for saver, loader in ((4, 2), (2, 4))
    for kv_layout in ("LBHNC", "LBNHC")
]


@pytest.mark.parametrize("policy, saver, loader, kv_layout", SHARING)
def test_a_store_tp_instance_loads_another_tp_sizes_store_shards_with_every_head_right(
    run: Run, policy: str, saver: int, loader: int, kv_layout: str
) -> None:
    report = run(policy, saver, loader, kv_layout=kv_layout)
    verdict = report.verdict
    assert report.save.put_failures == 0
    assert len(report.save.keys_written) == CHUNKS * STORE_TP["store_tp_size"]  # one object per store shard
    assert verdict.hit_tokens == verdict.used_tokens == FULL_HIT
    assert verdict.blocks_checked == (FULL_HIT // BLOCK_SIZE) * loader
    assert verdict.correct and not verdict.crashed and not verdict.reported_errors


def test_default_shares_store_shards_under_one_fingerprint_across_tp_sizes(run: Run) -> None:
    report = run("default", 4, 2)
    assert report.saver_fingerprint == report.loader_fingerprint


def test_store_shards_of_another_payload_format_are_not_loaded(mooncake_master: MooncakeMaster, clients: ClientPool) -> None:
    with Fleet("gqa-8kv", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(load_policy("default"), 4, extra_config=STORE_TP, kv_cache_layout="LBHNC").save()
        loader = fleet.instance(load_policy("default"), 2, extra_config=STORE_TP, kv_cache_layout="LBNHC")
        assert loader.lookup().hit_length == 0


def test_a_store_shard_holding_other_heads_is_loaded_as_wrong_bytes_on_the_rank_that_owns_it(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """The byte check has teeth: store shard 1's objects are replaced by shard 2's, so the TP 2 rank
    owning shard 1 (rank 0) loads another rank's heads, and the check names that rank only."""
    policy = load_policy("default")
    with Fleet("gqa-8kv", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        saved = fleet.instance(policy, 4, name="prefill", extra_config=STORE_TP, kv_cache_layout="LBHNC").save()
        by_shard: dict[int, dict[str, str]] = {}
        for key in saved.keys_written:
            parsed = parse_key(key, policy.key.template)
            assert parsed.chunk_hash is not None
            by_shard.setdefault(parsed.prefix.shard, {})[parsed.chunk_hash] = key
        client = fleet.client
        for chunk_hash, key in by_shard[1].items():
            other = client.get(by_shard[2][chunk_hash])
            assert client.remove(key) == 0 and client.put(key, other) == 0
        decode = fleet.instance(policy, 2, name="decode", extra_config=STORE_TP, kv_cache_layout="LBHNC")
        lookup = decode.lookup()
        decode.load(lookup)
        verdict = decode.verdict(lookup)
    assert verdict.hit_tokens == FULL_HIT
    assert {block.tp_rank for block in verdict.wrong} == {0}
    assert {block.chunk for block in verdict.wrong} == set(range(FULL_HIT // BLOCK_SIZE))


def test_without_store_tp_default_never_shares_across_tp_sizes(run: Run) -> None:
    report = run("default", 4, 2, store_tp=False)
    assert report.saver_fingerprint != report.loader_fingerprint
    assert report.hit_tokens == 0 and report.verdict.correct


def test_without_store_tp_stock_keys_collide_across_tp_sizes_and_every_block_fails_to_load(run: Run) -> None:
    """What ``store_tp_size`` exists for: vLLM's rank-local keys do not carry the TP size, so a TP 2
    instance finds the TP 4 instance's objects under its own keys (a false hit), and every block
    fails to load (the objects are half its block size); vLLM recomputes them."""
    report = run("vllm-compat", 4, 2, store_tp=False)
    verdict = report.verdict
    assert verdict.hit_tokens == FULL_HIT and verdict.used_tokens == 0
    assert all(len(blocks) == FULL_HIT // BLOCK_SIZE for _, blocks in verdict.invalid_block_ids)
    assert verdict.correct


def test_rank_local_objects_of_another_kv_cache_layout_are_not_loaded(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """A rank-local object is a block's bytes in memory order: the same heads in LBHNC and LBNHC are
    other bytes, so the fingerprint tells the layouts apart (the same TP size, no store_tp)."""
    with Fleet("gqa-8kv", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        saver = fleet.instance(load_policy("default"), 2, kv_cache_layout="LBHNC")
        saver.save()
        loader = fleet.instance(load_policy("default"), 2, kv_cache_layout="LBNHC")
        assert loader.fingerprint != saver.fingerprint and loader.lookup().hit_length == 0
