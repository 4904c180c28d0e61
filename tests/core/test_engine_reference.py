"""The engine against upstream's replication factors, upstream's key format, the fingerprint and its refusals."""

from __future__ import annotations

import pytest
from core_support import MODEL, full, layout, mamba, mla, policy, spec

from kvpolicy.documents.loader import load_policy, policies_dir
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.keys import KeyContext, parse_prefix
from kvpolicy.language.models import Schedule, Topology
from kvpolicy.planning.engine import make_plan

VLLM_COMPAT = load_policy("vllm-compat")
DEFAULT = load_policy("default")
NO_DEDUP = load_policy("no-dedup")


def ranks_of(namespace, the_plan):
    """The rank and group fields a lookup namespace of ``the_plan`` names."""
    parsed = parse_prefix(namespace, the_plan.key_template)
    return {name: getattr(parsed, name) for name in ("shard", "pcp_rank", "dcp_rank", "pp_rank", "group")}


def factors(policy, the_layout, **topology):
    return make_plan(policy, the_layout, Topology(**topology)).factors


# --- vLLM 0.32's factors for hand-picked layouts (pcp = pp = 1) --------------------------------


def test_mla_gqa_mamba_at_tp4_with_two_kv_heads():
    assert factors(VLLM_COMPAT, layout(mla(), full(), mamba(), heads=2), tp_size=4) == (4, 2, 1)


def test_uniform_mla_and_full_attention_group_at_tp4_with_two_kv_heads():
    assert factors(VLLM_COMPAT, layout([mla(), full()], heads=2), tp_size=4) == (2,)


def test_full_attention_and_mamba_at_tp2_with_one_kv_head():
    assert factors(VLLM_COMPAT, layout(full(), mamba(), heads=1), tp_size=2) == (2, 1)


@pytest.mark.parametrize("policy_", [VLLM_COMPAT, NO_DEDUP], ids=lambda p: p.name)
def test_vllm_compat_and_no_dedup_make_every_group_sharded_under_dcp(policy_):
    # Upstream's rule under decode-context parallelism (vllm#51386): every factor 1.
    the_layout = layout(mla(), full(), mamba(tp_replicated=True), [mla(), full()], heads=1)
    assert factors(policy_, the_layout, tp_size=4, dcp_size=2) == (1, 1, 1, 1)


def test_default_keeps_ranks_of_equal_dcp_rank_together_under_dcp():
    # tp 8, dcp 2: an MLA latent (or a head on every rank) is identical on the 4 ranks of each dcp rank.
    the_layout = layout(mla(), full(), mamba(tp_replicated=True), [mla(), full()], mamba(), heads=1)
    assert factors(DEFAULT, the_layout, tp_size=8, dcp_size=2) == (4, 4, 4, 4, 1)


@pytest.mark.parametrize("policy_", [VLLM_COMPAT, DEFAULT, NO_DEDUP], ids=lambda p: p.name)
def test_tp1_is_always_factor_one(policy_):
    assert factors(policy_, layout(mla(), full(), mamba(tp_replicated=True), heads=1), tp_size=1) == (1, 1, 1)


def test_vllm_compat_ignores_mamba_tp_replicated():
    assert factors(VLLM_COMPAT, layout(mamba(tp_replicated=True), heads=1), tp_size=4) == (1,)


def test_default_honours_mamba_tp_replicated():
    the_layout = layout(mamba(tp_replicated=True), mamba(tp_replicated=False), heads=1)
    assert factors(DEFAULT, the_layout, tp_size=4) == (4, 1)


def test_vllm_compat_ignores_max_tp_shards():
    # 8 KV heads at tp 8: upstream's head rule gives 1 whatever the spec declares
    assert factors(VLLM_COMPAT, layout(full(max_tp_shards=2), heads=8), tp_size=8) == (1,)


@pytest.mark.parametrize(
    ("max_tp_shards", "expected"),
    [
        (2, 8 // 2),  # 2 distinct shards over 8 ranks: 4 ranks each hold the same bytes
        (1, 8),
        (16, 1),  # more shards declared than ranks: every rank distinct
        (None, 1),  # no declaration: the head rule, 8 // 8 heads
    ],
)
def test_default_honours_attention_max_tp_shards(max_tp_shards, expected):
    assert factors(DEFAULT, layout(full(max_tp_shards=max_tp_shards), heads=8), tp_size=8) == (expected,)


def test_default_matches_vllm_compat_on_the_reference_layout():
    the_layout = layout(mla(), full(), mamba(), heads=2)
    assert factors(DEFAULT, the_layout, tp_size=4) == (4, 2, 1)


def test_no_dedup_makes_every_group_factor_one():
    the_layout = layout(mla(), full(), mamba(tp_replicated=True), [mla(), full()], heads=1)
    assert factors(NO_DEDUP, the_layout, tp_size=8) == (1, 1, 1, 1)


def test_a_mamba_member_makes_a_uniform_group_sharded():
    assert factors(VLLM_COMPAT, layout([mla(), mamba()], heads=1), tp_size=4) == (1,)


def test_sliding_window_mla_counts_as_mla():
    the_layout = layout([mla(), spec("SlidingWindowMLASpec", max_tp_shards=1)], heads=2)
    assert factors(VLLM_COMPAT, the_layout, tp_size=4) == (4,)


def test_an_mla_subclass_counts_as_mla():
    assert factors(VLLM_COMPAT, layout(spec("HiddenStateCacheSpec", max_tp_shards=1), heads=4), tp_size=8) == (8,)


def test_an_unknown_plugin_class_follows_its_declared_bases():
    plugin = spec("PluginLatentSpec", bases=("MLAAttentionSpec", "FullAttentionSpec", "AttentionSpec", "KVCacheSpec"))
    assert factors(VLLM_COMPAT, layout(plugin, heads=4), tp_size=8) == (8,)


def test_specs_outside_attention_follow_the_head_rule_under_vllm_compat():
    # upstream's rule 5 applies to every spec that is neither Mamba nor MLA
    assert factors(VLLM_COMPAT, layout(spec("HiSparseHotSpec"), heads=2), tp_size=8) == (4,)


def test_specs_no_rule_matches_are_sharded_under_default():
    assert factors(DEFAULT, layout(spec("HiSparseHotSpec"), heads=2), tp_size=8) == (1,)


# --- keys: byte-identical to upstream under vllm-compat ----------------------------------------


def compat_plan(**topology):
    return make_plan(VLLM_COMPAT, layout(mla(), full(), mamba(), heads=2), Topology(**{"tp_size": 4, **topology}))


def test_key_prefix_without_cache_prefix_or_namespace():
    the_plan = compat_plan()
    # MLA group 0, factor 4: every rank is shard 0
    assert the_plan.key_prefix(0, 3) == "DeepSeek-V2-Lite@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
    # GQA group 1, factor 2: ranks 2 and 3 are shard 1
    assert the_plan.key_prefix(1, 2) == "DeepSeek-V2-Lite@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1"
    assert the_plan.key_prefix(1, 3) == "DeepSeek-V2-Lite@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1"
    # Mamba group 2, factor 1: every rank its own
    assert the_plan.key_prefix(2, 3) == "DeepSeek-V2-Lite@tp_rank:3@pcp0@dcp0@pp_rank:0@group:2"


def test_key_prefix_with_pcp_and_pp_ranks():
    the_plan = compat_plan(pp_size=2, pcp_size=2)
    assert the_plan.key_prefix(1, 1, pcp_rank=1, pp_rank=1) == (
        "DeepSeek-V2-Lite@tp_rank:0@pcp1@dcp0@pp_rank:1@group:1"
    )


def test_key_prefix_with_cache_prefix_and_store_namespace():
    context = KeyContext.for_model(
        "/models/deepseek-ai/DeepSeek-V2-Lite/", cache_prefix="tenant-a", store_namespace="@store_pp:1@store_format:x"
    )
    the_plan = make_plan(VLLM_COMPAT, layout(mla(), full(), mamba(), heads=2), Topology(tp_size=4), key_context=context)
    assert the_plan.key_prefix(1, 3) == (
        "tenant-a@DeepSeek-V2-Lite@store_pp:1@store_format:x@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1"
    )


def test_key_prefix_under_dcp_carries_the_dcp_rank():
    the_plan = compat_plan(dcp_size=2)
    assert the_plan.key_prefix(0, 3) == "DeepSeek-V2-Lite@tp_rank:3@pcp0@dcp1@pp_rank:0@group:0"
    assert the_plan.key_prefix(0, 2) == "DeepSeek-V2-Lite@tp_rank:2@pcp0@dcp0@pp_rank:0@group:0"


def test_lookup_namespaces_follow_upstream_order():
    the_plan = compat_plan(pp_size=2, pcp_size=2)
    # upstream: for pcp_rank, for shard in range(tp // factor), for pp_rank
    assert the_plan.groups[1].lookup_namespaces == (
        "DeepSeek-V2-Lite@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1",
        "DeepSeek-V2-Lite@tp_rank:0@pcp0@dcp0@pp_rank:1@group:1",
        "DeepSeek-V2-Lite@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1",
        "DeepSeek-V2-Lite@tp_rank:1@pcp0@dcp0@pp_rank:1@group:1",
        "DeepSeek-V2-Lite@tp_rank:0@pcp1@dcp0@pp_rank:0@group:1",
        "DeepSeek-V2-Lite@tp_rank:0@pcp1@dcp0@pp_rank:1@group:1",
        "DeepSeek-V2-Lite@tp_rank:1@pcp1@dcp0@pp_rank:0@group:1",
        "DeepSeek-V2-Lite@tp_rank:1@pcp1@dcp0@pp_rank:1@group:1",
    )
    assert the_plan.groups[0].lookup_namespaces[:2] == (
        "DeepSeek-V2-Lite@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",
        "DeepSeek-V2-Lite@tp_rank:0@pcp0@dcp0@pp_rank:1@group:0",
    )


def test_lookup_under_dcp_needs_every_tp_rank_with_its_dcp_rank():
    the_plan = compat_plan(dcp_size=2)
    assert the_plan.groups[0].lookup_namespaces == (
        "DeepSeek-V2-Lite@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",
        "DeepSeek-V2-Lite@tp_rank:1@pcp0@dcp1@pp_rank:0@group:0",
        "DeepSeek-V2-Lite@tp_rank:2@pcp0@dcp0@pp_rank:0@group:0",
        "DeepSeek-V2-Lite@tp_rank:3@pcp0@dcp1@pp_rank:0@group:0",
    )


def test_upstream_striped_schedule():
    the_plan = compat_plan()
    gqa = the_plan.groups[1]  # group index 1, factor 2: phase (tp_rank + 1) % 2
    assert [gqa.writers(chunk) for chunk in range(4)] == [(1, 3), (0, 2), (1, 3), (0, 2)]
    mla_group = the_plan.groups[0]  # group 0, factor 4: chunk i written by the rank whose phase is i % 4
    assert [mla_group.writers(chunk) for chunk in range(5)] == [(0,), (1,), (2,), (3,), (0,)]


def test_default_keys_carry_the_plan_fingerprint():
    the_plan = make_plan(DEFAULT, layout(mla(), heads=1), Topology(tp_size=2))
    assert the_plan.key_prefix(0, 1) == (
        f"DeepSeek-V2-Lite@plan:{the_plan.fingerprint}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
    )


# --- the fingerprint --------------------------------------------------------------------------

BASE_POLICY = """\
    version: 1
    kind: ReplicationPolicy
    name: base
    rules:
      - name: mla
        reason: r
        match:
          spec: MLAAttentionSpec
        replication: replicated
      - name: rest
        reason: r
        replication: sharded
"""


def fingerprint_of(text=BASE_POLICY, the_layout=None, **topology):
    the_layout = the_layout or layout(mla(), full(), heads=4)
    return make_plan(policy(text), the_layout, Topology(**{"tp_size": 4, **topology})).fingerprint


def test_fingerprint_is_deterministic():
    assert fingerprint_of() == fingerprint_of()


def test_fingerprint_changes_with_a_factor():
    changed = BASE_POLICY.replace("replication: replicated", "factor: 2")
    assert fingerprint_of(changed) != fingerprint_of()


def test_fingerprint_ignores_the_write_schedule():
    # Which rank writes a chunk does not change what the chunk holds or where it is stored.
    assert fingerprint_of(BASE_POLICY + "    schedule: leader\n") == fingerprint_of()


def test_fingerprint_changes_with_the_key_template():
    template = "{model}@v2@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"
    assert fingerprint_of(BASE_POLICY + f'    key:\n      template: "{template}"\n') != fingerprint_of()


def test_fingerprint_changes_with_a_spec_field():
    assert fingerprint_of(the_layout=layout(mla(), full(dtype="float16"), heads=4)) != fingerprint_of(
        the_layout=layout(mla(), full(dtype="bfloat16"), heads=4)
    )


def test_fingerprint_changes_with_the_page_size():
    assert fingerprint_of(the_layout=layout(mla(page_size_bytes=1), heads=4)) != fingerprint_of(
        the_layout=layout(mla(), heads=4)
    )


def test_fingerprint_changes_with_the_tp_size_when_the_shards_do():
    # The full-attention group is sharded: 2 shards at TP 2, 4 at TP 4, each holding other bytes.
    assert fingerprint_of(tp_size=2) != fingerprint_of(tp_size=4)


@pytest.mark.parametrize("tp_sizes", [(2, 4), (1, 8), (4, 16)])
def test_identical_stored_bytes_at_two_tp_sizes_share_the_fingerprint(tp_sizes):
    # An MQA model: one KV head, repeated on every rank, and an MLA latent: one shard at any TP size.
    mqa = layout(mla(), full(num_kv_heads=1), heads=1)
    default = load_policy("default")
    small, large = (make_plan(default, mqa, Topology(tp_size=tp)) for tp in tp_sizes)
    assert small.factors != large.factors and small.fingerprint == large.fingerprint


def test_plans_whose_keys_name_different_heads_never_share_a_fingerprint():
    # 2 KV heads at TP 4 + DCP 2: default repeats each head on 2 ranks, whose dcp ranks differ (sets of
    # 1), no-dedup on 1 rank; both have factor 1, but the key's shard field names a head run under
    # default and a rank under no-dedup.
    gqa = layout(full(num_kv_heads=1), heads=2)
    topology = Topology(tp_size=4, dcp_size=2)
    default, no_dedup = (make_plan(load_policy(name), gqa, topology) for name in ("default", "no-dedup"))
    assert default.groups[0].factor == no_dedup.groups[0].factor == 1
    assert default.fingerprint != no_dedup.fingerprint


def test_bytes_per_token_under_dcp_count_the_tokens_a_rank_holds():
    mla_layout = layout(mla(page_size_bytes=4096), heads=1)
    plain = make_plan(load_policy("default"), mla_layout, Topology(tp_size=8))
    split = make_plan(load_policy("default"), mla_layout, Topology(tp_size=8, dcp_size=2))
    # A rank's 16-token block holds every other token of a 32-token chunk under DCP 2.
    assert split.groups[0].bytes_per_token_per_rank == plain.groups[0].bytes_per_token_per_rank / 2
    assert split.groups[0].written_bytes_per_token == plain.groups[0].written_bytes_per_token


def test_the_dcp_size_changes_the_fingerprint():
    # Under DCP a rank's object holds every dcp_size-th token of a chunk, not all of them.
    mqa = layout(mla(), heads=1)
    default = load_policy("default")
    assert (
        make_plan(default, mqa, Topology(tp_size=4)).fingerprint
        != make_plan(default, mqa, Topology(tp_size=4, dcp_size=2)).fingerprint
    )


def test_a_kv_head_split_differently_at_two_tp_sizes_changes_the_fingerprint():
    gqa = layout(full(num_kv_heads=8), heads=8)
    default = load_policy("default")
    assert make_plan(default, gqa, Topology(tp_size=2)).fingerprint != make_plan(default, gqa, Topology(tp_size=4)).fingerprint


def test_a_head_repeated_over_more_ranks_keeps_the_fingerprint():
    # 2 KV heads: shard s holds head s at TP 2 (one rank each) and at TP 4 (ranks 2s and 2s + 1).
    gqa = layout(full(num_kv_heads=1), heads=2)
    default = load_policy("default")
    assert make_plan(default, gqa, Topology(tp_size=2)).fingerprint == make_plan(default, gqa, Topology(tp_size=4)).fingerprint


def test_fingerprint_ignores_policy_and_rule_names_reasons_and_descriptions():
    renamed = (
        BASE_POLICY.replace("name: base", "name: renamed\n    description: same plan, other words")
        .replace("name: mla", "name: latent")
        .replace("name: rest", "name: everything-else")
        .replace("reason: r", "reason: another reason")
    )
    assert fingerprint_of(renamed) == fingerprint_of()


def test_fingerprint_ignores_how_the_same_factor_is_spelled():
    spelled = BASE_POLICY.replace("replication: replicated", "factor: tp_size").replace(
        "replication: sharded", "shards: tp_size"
    )
    assert fingerprint_of(spelled) == fingerprint_of()


# --- refusals ----------------------------------------------------------------------------------


def refusal(text, the_layout, **topology) -> str:
    with pytest.raises(PlanError) as caught:
        make_plan(policy(text), the_layout, Topology(**{"tp_size": 4, **topology}))
    return str(caught.value)


ONE_RULE = """\
    version: 1
    kind: ReplicationPolicy
    name: one-rule
    rules:
      - name: the-rule
        reason: r
        {outcome}
"""


@pytest.mark.parametrize("outcome", ["factor: 3", "factor: tp_size + 1", "shards: 3"])
def test_factor_that_does_not_divide_tp_is_refused(outcome):
    message = refusal(ONE_RULE.format(outcome=outcome), layout(mamba(), full(), heads=1))
    assert "group 0" in message and "'the-rule'" in message
    assert "divisor" in message


@pytest.mark.parametrize("outcome", ["factor: 0", "factor: tp_size - 5", "shards: 0"])
def test_factor_below_one_is_refused(outcome):
    message = refusal(ONE_RULE.format(outcome=outcome), layout(full(), heads=1))
    assert "group 0" in message and "'the-rule'" in message


def test_non_integer_factor_is_refused():
    message = refusal(ONE_RULE.format(outcome="factor: tp_size > 1"), layout(full(), heads=1))
    assert "'the-rule'" in message and "not an integer" in message


def test_expression_error_is_refused_naming_group_and_rule():
    message = refusal(ONE_RULE.format(outcome="factor: tp_size // (dcp_size - 1)"), layout(mamba(), full(), heads=1))
    assert "group 0" in message and "'the-rule'" in message
    assert "division by zero" in message


def test_when_reading_a_field_the_spec_lacks_is_refused():
    text = ONE_RULE.format(outcome="when: max_tp_shards is None\n        replication: sharded")
    message = refusal(text, layout(mamba(), heads=1))
    assert "group 0" in message and "'the-rule'" in message and "max_tp_shards" in message


def test_error_names_the_later_group_that_fails():
    text = BASE_POLICY.replace("replication: sharded", "factor: max_tp_shards")  # Mamba has no max_tp_shards
    message = refusal(text, layout(mla(), full(max_tp_shards=1), mamba(), heads=1))
    assert "group 2" in message and "'rest'" in message


STRICT = """\
    version: 1
    kind: ReplicationPolicy
    name: strict
    strict: true
    rules:
      - name: mamba
        reason: r
        match:
          spec: MambaSpec
        replication: sharded
"""


def test_strict_policy_refuses_an_unmatched_spec():
    message = refusal(STRICT, layout(mamba(), full(), heads=1))
    assert "group 1" in message and "FullAttentionSpec" in message and "strict" in message


def test_strict_policy_plans_a_layout_it_covers():
    assert make_plan(policy(STRICT), layout(mamba(), heads=1), Topology(tp_size=4)).factors == (1,)


def test_non_strict_policy_applies_unmatched():
    replicated = STRICT.replace("strict: true", "unmatched: replicated")
    assert make_plan(policy(replicated), layout(mamba(), full(), heads=1), Topology(tp_size=4)).factors == (1, 4)


def test_replicated_under_dcp_makes_strided_replica_sets_one_namespace_each():
    the_plan = make_plan(policy(ONE_RULE.format(outcome="replication: replicated")), layout(mla(), heads=1),
                         Topology(tp_size=8, dcp_size=2))
    (group,) = the_plan.groups
    assert (group.factor, group.shards) == (4, 2)
    assert {rank.replica_set for rank in group.ranks} == {(0, 2, 4, 6), (1, 3, 5, 7)}
    assert [ranks_of(namespace, the_plan) for namespace in group.lookup_namespaces] == [
        {"shard": 0, "pcp_rank": 0, "dcp_rank": 0, "pp_rank": 0, "group": 0},
        {"shard": 0, "pcp_rank": 0, "dcp_rank": 1, "pp_rank": 0, "group": 0},
    ]


def test_striping_under_dcp_gives_every_chunk_one_writer_per_dcp_rank():
    the_plan = make_plan(policy(ONE_RULE.format(outcome="replication: replicated")), layout(mla(), heads=1),
                         Topology(tp_size=8, dcp_size=2))
    (group,) = the_plan.groups
    assert [group.writers(chunk) for chunk in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [rank.stripe_rank for rank in group.ranks] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_head_run_shorter_than_dcp_leaves_every_rank_its_own_set():
    # (vLLM allows this only for non-attention state: for GQA it caps dcp_size at tp_size // heads.)
    the_plan = make_plan(policy(ONE_RULE.format(outcome="factor: 2")), layout(mamba(), heads=0),
                         Topology(tp_size=8, dcp_size=4))
    (group,) = the_plan.groups
    assert (group.factor, group.shards) == (1, 8)
    assert len(set(group.lookup_namespaces)) == 8


@pytest.mark.parametrize("tp_size, dcp_size, heads", [(8, 2, 8), (8, 2, 16), (8, 4, 4)])
def test_a_topology_vllm_refuses_for_gqa_is_refused_naming_vllms_constraint(tp_size, dcp_size, heads):
    message = refusal(ONE_RULE.format(outcome="replication: sharded"), layout(full(), heads=heads),
                      tp_size=tp_size, dcp_size=dcp_size)
    assert f"vLLM refuses dcp_size {dcp_size} at tp_size {tp_size}" in message
    assert "tp_size > total_num_kv_heads and dcp_size <= tp_size // total_num_kv_heads" in message


def test_mla_under_dcp_needs_no_more_ranks_than_heads():
    the_plan = make_plan(load_policy("default"), layout(mla(), heads=128), Topology(tp_size=8, dcp_size=8))
    assert the_plan.factors == (1,)


@pytest.mark.parametrize("tp_size, pcp_size, dcp_size", [(4, 2, 2), (4, 2, 8), (2, 4, 4), (2, 2, 1)])
def test_pcp_with_dcp_over_the_pcp_axis_or_all_ranks_is_a_valid_topology(tp_size, pcp_size, dcp_size):
    assert Topology(tp_size=tp_size, pcp_size=pcp_size, dcp_size=dcp_size).dcp_size == dcp_size


@pytest.mark.parametrize("tp_size, pcp_size, dcp_size", [(4, 2, 4), (8, 2, 4), (4, 4, 2)])
def test_pcp_with_a_dcp_size_vllm_refuses_is_refused_naming_the_sizes_it_allows(tp_size, pcp_size, dcp_size):
    with pytest.raises(ValueError, match=rf"with pcp_size {pcp_size}, vLLM allows dcp_size 1, {pcp_size} .* or "
                                         rf"{tp_size * pcp_size} .*; got {dcp_size}"):
        Topology(tp_size=tp_size, pcp_size=pcp_size, dcp_size=dcp_size)


def test_dcp_over_the_pcp_axis_keeps_whole_head_runs_together_and_keys_the_pcp_rank_as_dcp_rank():
    the_plan = make_plan(load_policy("default"), layout(mla(), heads=1), Topology(tp_size=4, pcp_size=2, dcp_size=2))
    (group,) = the_plan.groups
    assert group.factor == 4 and {rank.replica_set for rank in group.ranks} == {(0, 1, 2, 3)}
    assert [ranks_of(namespace, the_plan) for namespace in group.lookup_namespaces] == [
        {"shard": 0, "pcp_rank": 0, "dcp_rank": 0, "pp_rank": 0, "group": 0},
        {"shard": 0, "pcp_rank": 1, "dcp_rank": 1, "pp_rank": 0, "group": 0},
    ]


def test_dcp_over_all_ranks_leaves_every_rank_its_own_tokens():
    the_plan = make_plan(load_policy("default"), layout(mla(), heads=1), Topology(tp_size=4, pcp_size=2, dcp_size=8))
    (group,) = the_plan.groups
    assert group.factor == 1
    assert sorted(ranks_of(namespace, the_plan)["dcp_rank"] for namespace in group.lookup_namespaces) == list(range(8))


def test_a_head_run_that_dcp_neither_divides_nor_is_divided_by_is_refused():
    message = refusal(ONE_RULE.format(outcome="factor: 6"), layout(mamba(), heads=0), tp_size=12, dcp_size=4)
    assert "group 0" in message and "'the-rule'" in message
    assert "6 consecutive TP ranks with dcp_size 4" in message and "different sizes" in message


# --- demotion (the audit's fallback) ------------------------------------------------------------


def test_demoted_group_gets_factor_one_and_the_others_keep_theirs():
    the_layout = layout(mla(), full(), mamba(), heads=2)
    demoted = make_plan(VLLM_COMPAT, the_layout, Topology(tp_size=4), demoted=[0])
    assert demoted.factors == (1, 2, 1)
    assert demoted.groups[0].demoted and not demoted.groups[1].demoted
    # every rank its own shard; with no {fingerprint} in the template the namespace is marked as demoted,
    # so it cannot collide with instances that trust the rule
    assert demoted.key_prefix(0, 3) == (
        f"DeepSeek-V2-Lite@tp_rank:3@pcp0@dcp0@pp_rank:0@group:0@demoted:{demoted.fingerprint}"
    )
    assert demoted.key_prefix(1, 3) == "DeepSeek-V2-Lite@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1"


def test_demoted_group_under_a_fingerprinted_template_needs_no_marker():
    demoted = make_plan(DEFAULT, layout(mla(), heads=1), Topology(tp_size=2), demoted=[0])
    assert demoted.key_prefix(0, 1) == (
        f"DeepSeek-V2-Lite@plan:{demoted.fingerprint}@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0"
    )


def test_demotion_changes_the_fingerprint():
    the_layout = layout(mla(), full(), mamba(), heads=2)
    assert (
        make_plan(DEFAULT, the_layout, Topology(tp_size=4), demoted=[0]).fingerprint
        != make_plan(DEFAULT, the_layout, Topology(tp_size=4)).fingerprint
    )


def test_demotion_lifts_the_dcp_refusal():
    text = ONE_RULE.format(outcome="replication: replicated")
    the_plan = make_plan(policy(text), layout(mla(), heads=1), Topology(tp_size=4, dcp_size=2), demoted=[0])
    assert the_plan.factors == (1,)


# --- what the plan reports ----------------------------------------------------------------------


def test_plan_reports_the_rule_and_its_origin_for_each_layer():
    the_plan = make_plan(VLLM_COMPAT, layout(mla(), full(), mamba(), heads=2), Topology(tp_size=4))
    assert [group.rules for group in the_plan.groups] == [("mla-latent",), ("kv-heads",), ("mamba-state",)]
    lines = (policies_dir() / "vllm-compat.yaml").read_text().splitlines()
    line = next(number for number, text in enumerate(lines, 1) if text.strip() == "- name: mla-latent")
    assert the_plan.groups[0].origins == (f"{policies_dir() / 'vllm-compat.yaml'}:{line}",)


def test_plan_reports_the_rules_passed_over():
    the_plan = make_plan(VLLM_COMPAT, layout(full(), heads=2), Topology(tp_size=4))
    passed = [name for name, _ in the_plan.groups[0].decisions[0].passed_over]
    assert passed == ["dcp-token-shards", "mamba-state", "mla-latent"]


def test_bytes_written_shrink_by_the_factor():
    the_layout = layout(mla(page_size_bytes=1000, block_size=10), heads=1)
    group = make_plan(VLLM_COMPAT, the_layout, Topology(tp_size=4)).groups[0]
    per_rank = 2 * 1000 / 10  # two layers, 100 bytes per token each
    assert group.bytes_per_token_per_rank == per_rank
    assert group.written_bytes_per_token == per_rank  # one shard, written once
    assert group.undeduplicated_bytes_per_token == 4 * per_rank


def test_all_schedule_writes_every_copy():
    every = VLLM_COMPAT.model_copy(update={"schedule": Schedule.ALL})
    group = make_plan(every, layout(mla(page_size_bytes=1000, block_size=10), heads=1), Topology(tp_size=4)).groups[0]
    assert group.written_bytes_per_token == group.undeduplicated_bytes_per_token


def test_model_basename_is_the_last_path_component():
    the_plan = make_plan(VLLM_COMPAT, layout(mamba(), heads=1, model="/srv/models/" + MODEL + "/"), Topology())
    assert the_plan.key_prefix(0, 0).startswith("DeepSeek-V2-Lite@tp_rank:0")
