"""Layers with their own KV-head count (``layer_kv_heads``): rules read a layer's own count as
``total_num_kv_heads`` and the model-wide one as ``model_total_num_kv_heads``, and a group's factor
holds for every layer in it."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
from core_support import full, policy, spec

from kvpolicy.documents.loader import check_text, load_policy, policies_dir
from kvpolicy.documents.report import format_explanation, format_plan_table, plan_to_json
from kvpolicy.language.models import Layout, Topology
from kvpolicy.planning.engine import make_plan

SLIDING = spec("SlidingWindowSpec", sliding_window=512, num_kv_heads=1, max_tp_shards=None)


def gemma_like(*, sliding_heads: int | None = 1, full_heads: int | None = None, model_wide: int = 2) -> Layout:
    """Gemma-4's shape: sliding layers of ``num_key_value_heads``, full-attention layers of
    ``num_global_key_value_heads``; vLLM reports the larger as the model-wide count."""
    entries = []
    if sliding_heads is not None:
        entries.append({"total_num_kv_heads": sliding_heads, "layers": "layers.{0..4}.sliding"})
    if full_heads is not None:
        entries.append({"total_num_kv_heads": full_heads, "layers": "layers.5.full"})
    return Layout.model_validate({
        "version": 1, "kind": "ModelLayout", "model": "org/gemma-like", "total_num_kv_heads": model_wide,
        "layer_kv_heads": entries,
        "groups": [
            {"name": "full", "spec": full(), "layers": "layers.5.full"},
            {"name": "sliding", "spec": SLIDING, "layers": "layers.{0..4}.sliding"},
        ],
    })


def mixed_group(heads: dict[str, int], model_wide: int) -> Layout:
    """One full-attention group whose layers have the KV heads ``heads`` gives them."""
    return Layout.model_validate({
        "version": 1, "kind": "ModelLayout", "model": "org/nas-like", "total_num_kv_heads": model_wide,
        "layer_kv_heads": [{"total_num_kv_heads": count, "layers": layer} for layer, count in heads.items()],
        "groups": [{"name": "full", "spec": full(), "layers": list(heads)}],
    })


def shipped(name: str) -> Any:
    return load_policy(policies_dir() / f"{name}.yaml")


def test_default_gives_each_group_the_factor_of_its_own_layers_heads() -> None:
    plan = make_plan(shipped("default"), gemma_like(), Topology(tp_size=2))
    # 2 full-attention heads over 2 ranks: one each; the sliding layers' one head is on both ranks.
    assert plan.factors == (1, 2)


def test_vllm_compat_keeps_the_model_wide_count_for_every_layer() -> None:
    plan = make_plan(shipped("vllm-compat"), gemma_like(), Topology(tp_size=2))
    assert plan.factors == (1, 1)


def test_vllm_compat_keys_and_factors_do_not_depend_on_layer_kv_heads() -> None:
    compat = shipped("vllm-compat")
    topology = Topology(tp_size=4)
    with_heads = make_plan(compat, gemma_like(), topology)
    without = make_plan(compat, gemma_like(sliding_heads=None), topology)
    assert with_heads.factors == without.factors
    assert [with_heads.key_prefix(g, r) for g in (0, 1) for r in range(4)] == [
        without.key_prefix(g, r) for g in (0, 1) for r in range(4)
    ]


def test_an_entry_equal_to_the_model_wide_count_changes_nothing() -> None:
    topology = Topology(tp_size=4)
    plain = make_plan(shipped("default"), gemma_like(sliding_heads=None), topology)
    restated = make_plan(shipped("default"), gemma_like(sliding_heads=2, full_heads=2), topology)
    assert restated.fingerprint == plain.fingerprint
    assert all(decision.kv_heads is None for group in restated.groups for decision in group.decisions)


def test_own_heads_reach_the_fingerprint() -> None:
    topology = Topology(tp_size=4)
    one = make_plan(shipped("default"), mixed_group({"l.0": 8, "l.1": 4}, 8), topology)
    other = make_plan(shipped("default"), mixed_group({"l.0": 8, "l.1": 8}, 8), topology)
    assert one.fingerprint != other.fingerprint


def test_a_group_of_layers_with_different_heads_takes_the_gcd_of_their_factors() -> None:
    # At TP 8, 8 heads give one per rank (factor 1) and 4 heads one per two ranks (factor 2): vLLM can
    # put both in one group (equal per-rank specs), and only factor 1 holds for both.
    plan = make_plan(shipped("default"), mixed_group({"l.0": 8, "l.1": 4, "l.2": 2}, 8), Topology(tp_size=8))
    decisions = plan.groups[0].decisions
    assert [(d.layer, d.factor) for d in decisions] == [("l.0", 1), ("l.1", 2), ("l.2", 4)]
    assert plan.groups[0].factor == 1


def test_a_group_whose_layers_all_repeat_keeps_the_common_factor() -> None:
    plan = make_plan(shipped("default"), mixed_group({"l.0": 2, "l.1": 4}, 8), Topology(tp_size=8))
    assert plan.groups[0].factor == 2  # gcd(8 // 2, 8 // 4)


def test_decisions_keep_the_groups_layer_order_when_heads_alternate() -> None:
    heads = {f"l.{index}": 2 if index % 2 else 4 for index in range(6)}
    plan = make_plan(shipped("default"), mixed_group(heads, 4), Topology(tp_size=4))
    assert [d.layer for d in plan.groups[0].decisions] == list(heads)
    assert [d.kv_heads for d in plan.groups[0].decisions] == [None, 2, None, 2, None, 2]


def test_a_rule_can_read_the_model_wide_count_beside_the_layers_own() -> None:
    both = policy("""
        version: 1
        kind: ReplicationPolicy
        name: both
        description: reads both counts
        rules:
          - name: own-below-model
            reason: test
            match: {spec: AttentionSpec}
            when: total_num_kv_heads < model_total_num_kv_heads
            factor: tp_size
        unmatched: sharded
    """)
    plan = make_plan(both, gemma_like(), Topology(tp_size=2))
    assert plan.factors == (1, 2)


def test_spec_field_expressions_read_the_layers_own_count() -> None:
    layout = Layout.model_validate({
        "version": 1, "kind": "ModelLayout", "model": "org/x", "total_num_kv_heads": 8,
        "layer_kv_heads": [{"total_num_kv_heads": 2, "layers": "a.1"}],
        "groups": [
            {"spec": full(num_kv_heads={"expr": "max(1, total_num_kv_heads // tp_size)"}), "layers": "a.0"},
            {"spec": full(num_kv_heads={"expr": "max(1, total_num_kv_heads // tp_size)"}), "layers": "a.1"},
        ],
    })
    reads = policy("""
        version: 1
        kind: ReplicationPolicy
        name: reads-field
        description: replicates where a rank holds one head
        rules:
          - name: one-head
            reason: test
            match: {spec: AttentionSpec, fields: {num_kv_heads: 1}}
            replication: replicated
        unmatched: sharded
    """)
    assert make_plan(reads, layout, Topology(tp_size=2)).factors == (1, 2)


def test_the_plan_table_explanation_and_json_say_which_layers_have_their_own_heads() -> None:
    plan = make_plan(shipped("default"), gemma_like(), Topology(tp_size=2))
    assert "group 1 sliding: 5 layers with 1 KV heads (model-wide: 2)" in format_plan_table(plan)
    assert "layers.0.sliding (+4 more layers alike): SlidingWindowSpec, 1 KV heads of its own (model-wide: 2)" in (
        format_explanation(plan)
    )
    groups = plan_to_json(plan)["groups"]
    assert [group["own_kv_heads"] for group in groups] == [[], [{"total_num_kv_heads": 1, "layers": 5}]]


def test_a_plan_without_own_heads_shows_no_heads_line() -> None:
    plan = make_plan(shipped("default"), gemma_like(sliding_heads=None), Topology(tp_size=2))
    assert "KV heads" not in format_plan_table(plan)
    assert "KV heads" not in format_explanation(plan)


LAYOUT_HEAD = """\
version: 1
kind: ModelLayout
model: org/x
total_num_kv_heads: 2
groups:
  - spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 1024}
    layers: "attn.{0..1}"
  - spec: {type: MambaSpec, bases: [KVCacheSpec], block_size: 16, page_size_bytes: 1024}
    layers: mamba.0
"""


def layout_errors(entries: str) -> list[str]:
    document, problems = check_text(LAYOUT_HEAD + "layer_kv_heads:\n" + textwrap.indent(textwrap.dedent(entries), "  "), "l.yaml")
    assert document is None
    return [str(problem) for problem in problems]


def test_a_layer_in_no_group_is_refused_with_the_closest_name() -> None:
    (error,) = layout_errors("""
        - total_num_kv_heads: 1
          layers: attn.7
    """)
    assert error.startswith("l.yaml:13:13: error:")  # at the entry's layers
    assert "layer 'attn.7' is in no group; did you mean 'attn.1'?" in error


def test_a_layer_with_two_counts_is_refused() -> None:
    (error,) = layout_errors("""
        - total_num_kv_heads: 1
          layers: attn.0
        - total_num_kv_heads: 4
          layers: attn.0
    """)
    assert "layer 'attn.0' already has its KV heads in layer_kv_heads entry 0" in error


def test_a_layer_without_heads_is_refused() -> None:
    (error,) = layout_errors("""
        - total_num_kv_heads: 1
          layers: mamba.0
    """)
    assert "layer 'mamba.0' holds MambaSpec, which has no KV heads; remove it from layer_kv_heads" in error


@pytest.mark.parametrize("count", [0, -1, "2", True])
def test_a_count_that_is_not_a_positive_integer_is_refused(count: object) -> None:
    errors = layout_errors(f"""
        - total_num_kv_heads: {count!r}
          layers: attn.0
    """.replace("'", '"') if isinstance(count, str) else f"""
        - total_num_kv_heads: {str(count).lower()}
          layers: attn.0
    """)
    assert len(errors) == 1 and "total_num_kv_heads" in errors[0]


def test_every_problem_of_the_entries_is_reported_at_once() -> None:
    errors = layout_errors("""
        - total_num_kv_heads: 1
          layers: [attn.9, mamba.0]
    """)
    assert len(errors) == 2


def test_only_the_first_few_unknown_layers_get_a_did_you_mean() -> None:
    # A hint compares a name with the layout's names; thousands of unknown layers must not each pay that.
    errors = layout_errors("""
        - total_num_kv_heads: 1
          layers: "attn.{2..11}"
    """)
    hinted = [error for error in errors if "did you mean" in error]
    assert len(errors) == 10 and len(hinted) == 5
