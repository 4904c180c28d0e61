"""Layers with KV heads of their own, on simulated instances of the production worker and a real
Mooncake master.

vLLM's store derives every layer's replication from one model-wide KV-head count. For a
Nemotron-NAS-like model (``nas-like``: vLLM reports the first block's 2 heads, later blocks have 8
and 4) that treats the later blocks' distinct heads as copies, so a warm hit loads other ranks'
heads; ``vllm-compat`` reproduces it and ``default``, which reads each layer's own count, does not.
For a Gemma-4-like model (``gemma4-like``: sliding layers 1 head, full layers 2, vLLM reports 2)
both are consistent and only the writes differ. The ground truth repeats each layer's heads over
``tp // its own heads`` ranks (:func:`kvpolicy.sim.physical_factor`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import BLOCK_SIZE, ConsistencyReport, Fleet, LoadVerdict, get_archetype, run_consistency  # noqa: E402
from kvpolicy.sim.instance import Instance  # noqa: E402

NUM_TOKENS = 128
# The lookup keeps the last token for sampling: the longest block-aligned prefix below the prompt.
EXPECTED_HIT = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
NAS = get_archetype("nas-like")
GEMMA = get_archetype("gemma4-like")
SLIDING, FULL = "sliding-window", "full-attention"

Run = Callable[..., ConsistencyReport]


@pytest.fixture(scope="module")
def run(mooncake_master: MooncakeMaster, clients: ClientPool) -> Run:
    reports: dict[tuple[str, str, int, bool | None], ConsistencyReport] = {}

    def run(policy: str, archetype: str, tp_size: int, *, audit: bool | None = False) -> ConsistencyReport:
        key = (policy, archetype, tp_size, audit)
        if key not in reports:
            reports[key] = run_consistency(
                load_policy(policy), archetype, tp_size, master=mooncake_master, clients=clients,
                num_tokens=NUM_TOKENS, audit=audit,
            )
        return reports[key]

    return run


@pytest.fixture(scope="module")
def nas_compat_load(mooncake_master: MooncakeMaster, clients: ClientPool) -> tuple[Instance, LoadVerdict]:
    """A cold TP 8 ``nas-like`` save and a warm load under ``vllm-compat``: the warm instance and its verdict."""
    policy = load_policy("vllm-compat")
    with Fleet(NAS, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(policy, 8, name="cold").save()
        warm = fleet.instance(policy, 8, name="warm")
        lookup = warm.lookup()
        warm.load(lookup)
        return warm, warm.verdict(lookup)


def describe(report: ConsistencyReport) -> str:
    return "\n".join(
        f"  group {g.index} {g.name}: factor {g.factor}, true factor {g.true_factor}, "
        f"mismatched ranks {list(g.mismatched_ranks)}, {g.bytes_written} of {g.unique_bytes} unique bytes written"
        for g in report.groups
    )


# --- nas-like: the first block's heads for every layer --------------------------------------------


def test_the_simulated_worker_plans_each_nas_like_layer_with_its_own_kv_heads(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    with Fleet(NAS, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        plan = fleet.instance(load_policy("default"), 8).plan
    (group,) = plan.groups
    assert {decision.layer: decision.kv_heads for decision in group.decisions if decision.kv_heads} == dict(
        NAS.layer_kv_heads
    )


def test_vllm_compat_gives_every_nas_like_layer_the_first_blocks_factor(run: Run) -> None:
    report = run("vllm-compat", "nas-like", 8)
    # One group (one KV head per rank in every block at TP 8): vLLM's max(1, 8 // 2) for all of it,
    # while the 8-head blocks hold a distinct head on every rank.
    assert [(group.factor, group.true_factor) for group in report.groups] == [(4, 1)], describe(report)


def test_vllm_compat_loads_other_ranks_heads_on_a_warm_nas_like_hit(run: Run) -> None:
    report = run("vllm-compat", "nas-like", 8)
    assert report.hit_tokens == EXPECTED_HIT and not report.consistent, describe(report)
    # Each rank of a set of 4 writes every 4th chunk and reads the others' chunks of the hit.
    assert report.groups[0].mismatched_ranks == tuple(range(8)), describe(report)


def test_vllm_compat_corrupts_exactly_the_nas_like_layers_of_more_heads_than_the_first_block(
    nas_compat_load: tuple[Instance, LoadVerdict],
) -> None:
    _, verdict = nas_compat_load
    more_heads = {layer for layer, heads in NAS.layer_kv_heads.items() if heads > NAS.kv_heads(8)}
    assert verdict.wrong and {block.layer for block in verdict.wrong} == more_heads


def test_vllm_compat_stores_a_quarter_of_the_distinct_nas_like_shards(run: Run) -> None:
    report = run("vllm-compat", "nas-like", 8)
    # Two replica sets' objects per chunk where eight ranks hold distinct heads.
    assert report.bytes_written * 4 == report.unique_bytes, describe(report)


def test_default_loads_every_nas_like_rank_its_own_bytes_with_the_audit_off(run: Run) -> None:
    report = run("default", "nas-like", 8)
    assert report.hit_tokens == EXPECTED_HIT and report.consistent, describe(report)
    assert all(group.blocks_checked for group in report.groups) and not report.load_failed_ranks


def test_default_writes_each_distinct_nas_like_head_once(run: Run) -> None:
    report = run("default", "nas-like", 8)
    assert [group.factor for group in report.groups] == [group.true_factor for group in report.groups]
    assert report.bytes_written == report.unique_bytes > 0, describe(report)


def test_the_audit_demotes_vllm_compats_nas_like_group_to_the_bytes_the_ranks_hold(run: Run) -> None:
    report = run("vllm-compat", "nas-like", 8, audit=True)
    (group,) = report.groups
    assert (group.declared_factor, group.audit, group.factor) == (4, "demoted", 1), describe(report)
    assert report.consistent and report.hit_tokens == EXPECTED_HIT, describe(report)


# --- gemma4-like: the largest count for every layer ------------------------------------------------


@pytest.mark.parametrize("policy", ["default", "vllm-compat"])
def test_gemma_like_loads_its_own_bytes_under_both_policies(run: Run, policy: str) -> None:
    report = run(policy, "gemma4-like", 2)
    assert report.hit_tokens == EXPECTED_HIT and report.consistent, describe(report)
    assert all(group.blocks_checked for group in report.groups)


def test_default_writes_the_gemma_like_sliding_group_once_at_tp_2(run: Run) -> None:
    sliding = run("default", "gemma4-like", 2).group(SLIDING)
    # One KV head on both ranks: one replica set, one object per chunk.
    assert (sliding.factor, sliding.true_factor) == (2, 2)
    assert sliding.bytes_written == sliding.unique_bytes > 0


def test_vllm_compat_writes_the_gemma_like_sliding_group_on_both_ranks_at_tp_2(run: Run) -> None:
    report = run("vllm-compat", "gemma4-like", 2)
    sliding, full = report.group(SLIDING), report.group(FULL)
    assert sliding.bytes_written == 2 * sliding.unique_bytes > 0, describe(report)
    assert full.bytes_written == full.unique_bytes, describe(report)
    assert report.write_amplification > 1.0


def test_the_audit_agrees_that_both_gemma_like_ranks_hold_the_sliding_heads(run: Run) -> None:
    report = run("default", "gemma4-like", 2, audit=None)
    assert [(group.name, group.audit) for group in report.groups] == [(SLIDING, "agreed"), (FULL, "-")]
    assert report.consistent and not report.warm_gated, describe(report)
