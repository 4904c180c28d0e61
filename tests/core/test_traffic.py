"""What one prompt costs the store under a plan (:mod:`kvpolicy.planning.traffic`); the e2e tests check the
same numbers against a real Mooncake master's counters."""

from __future__ import annotations

import pytest
from core_support import full, layout, mamba, mla, policy

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.models import Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.traffic import Stores, prompt_traffic

BLOCK = 16
HYBRID = layout(mla(block_size=BLOCK), mamba(block_size=BLOCK), heads=1)
"""MLA (replicated on every rank) next to a sharded Mamba state."""
PRE_FIX = policy(
    """
    version: 1
    kind: ReplicationPolicy
    name: pre-fix
    rules:
      - name: everything-replicated
        reason: one model-wide factor, as before vLLM PR 49499
        replication: replicated
    """
)


def traffic(layout_, *, tp: int, tokens: int, policy_name: str = "default", pp: int = 1):
    chosen = load_policy(policy_name) if isinstance(policy_name, str) else policy_name
    return prompt_traffic(make_plan(chosen, layout_, Topology(tp_size=tp, pp_size=pp)), layout_, tokens)


def test_attention_writes_every_full_chunk_once_per_namespace() -> None:
    result = traffic(HYBRID, tp=4, tokens=3 * BLOCK + 5)
    mla_group = result.groups[0]
    assert (mla_group.stores, mla_group.objects_written) == (Stores.CHUNKS, 3 * 1)


def test_a_state_group_writes_one_boundary_state_per_namespace() -> None:
    result = traffic(HYBRID, tp=4, tokens=3 * BLOCK + 5)
    state = result.groups[1]
    assert (state.stores, state.objects_written) == (Stores.BOUNDARY_STATE, 4)


def test_every_rank_reads_its_own_namespace_for_each_hit_chunk() -> None:
    result = traffic(HYBRID, tp=4, tokens=3 * BLOCK + 5)
    assert [group.objects_read for group in result.groups] == [3 * 4, 4]


def test_the_hit_leaves_at_least_one_token_to_compute() -> None:
    assert traffic(HYBRID, tp=2, tokens=2 * BLOCK).hit_tokens == BLOCK
    assert traffic(HYBRID, tp=2, tokens=2 * BLOCK + 1).hit_tokens == 2 * BLOCK


def test_a_prompt_within_one_block_stores_chunks_but_no_state_and_hits_nothing() -> None:
    result = traffic(HYBRID, tp=2, tokens=BLOCK)
    assert [(group.objects_written, group.objects_read) for group in result.groups] == [(1, 0), (0, 0)]


def test_the_pre_fix_rule_writes_the_state_once_for_all_ranks() -> None:
    # The bug in numbers: one shared namespace for a sharded state.
    right = traffic(HYBRID, tp=4, tokens=3 * BLOCK + 5)
    wrong = traffic(HYBRID, tp=4, tokens=3 * BLOCK + 5, policy_name=PRE_FIX)
    assert (right.groups[1].objects_written, wrong.groups[1].objects_written) == (4, 1)
    assert right.objects_read == wrong.objects_read, "reads are per rank whatever the plan"


def test_pipeline_stages_multiply_namespaces_and_readers() -> None:
    one, two = (traffic(HYBRID, tp=2, tokens=2 * BLOCK + 1, pp=pp) for pp in (1, 2))
    assert (two.objects_written, two.objects_read) == (2 * one.objects_written, 2 * one.objects_read)


@pytest.mark.parametrize("name", ["llama-3.1-70b", "deepseek-v3", "kimi-linear-48b-a3b", "qwen3-next-80b-a3b"])
def test_no_dedup_writes_what_every_rank_reads(name: str) -> None:
    example = load_layout(name)
    result = traffic(example, tp=8, tokens=4 * 2048 + 1, policy_name="no-dedup")
    assert result.objects_written == result.objects_read


def test_groups_with_different_block_sizes_are_refused() -> None:
    mixed = layout(full(block_size=16), full(block_size=32), heads=8)
    with pytest.raises(ValueError, match="store chunks of different sizes"):
        traffic(mixed, tp=2, tokens=100)


def test_a_negative_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        traffic(HYBRID, tp=2, tokens=-1)


def test_a_plan_of_another_layout_is_refused() -> None:
    other = layout(full(block_size=BLOCK), heads=2)
    with pytest.raises(ValueError, match="groups"):
        prompt_traffic(make_plan(load_policy("default"), other, Topology(tp_size=2)), HYBRID, 100)


def test_under_dcp_a_chunk_spans_dcp_blocks_and_the_traffic_counts_them() -> None:
    example = load_layout("deepseek-v3")
    plan = make_plan(load_policy("default"), example, Topology(tp_size=8, dcp_size=2))
    result = prompt_traffic(plan, example, 64)
    # 64 tokens in chunks of 16 x 2: 2 chunks, each once per dcp rank's namespace; the hit leaves a token.
    assert (plan.groups[0].chunk_tokens, result.objects_written, result.hit_tokens) == (32, 4, 32)
