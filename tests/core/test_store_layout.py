"""vLLM's TP-sharded store layouts (``store_tp_size`` / ``enable_store_tp_lcm``) in the pure core:
which layout a deployment gets, how the plan keys store shards, and what the fingerprint shares."""

from __future__ import annotations

import pytest
from core_support import full, layout, mamba, mla, policy

from kvpolicy.documents.loader import load_layout, load_policy, shipped_policy_names
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.keys import KeyContext
from kvpolicy.language.models import Layout, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.plan import Plan
from kvpolicy.planning.store_layout import StoreSharding, resolve_store_tp_size, select_store_layout
from kvpolicy.planning.traffic import prompt_traffic

LLAMA = load_layout("llama-3.1-70b")  # 8 KV heads, one FullAttentionSpec group
LBHNC = StoreSharding(8, "tp_shared_lbhnc")


def sharded_plan(policy_name: str, tp: int, *, store_tp: int = 8, kv_layout: str = "LBHNC", model: Layout = LLAMA) -> Plan:
    """The plan a deployment with ``store_tp_size`` gets, as the worker makes it."""
    topology = Topology(tp_size=tp)
    selection = select_store_layout(model, topology, {"store_tp_size": store_tp}, kv_cache_layout=kv_layout)
    context = KeyContext.for_model(model.model, "", selection.store_namespace)
    return make_plan(load_policy(policy_name), model, topology, key_context=context, store_sharding=selection.sharding)


# --- which layout vLLM picks ---------------------------------------------------------------------


def test_store_tp_dividing_the_heads_selects_the_sharded_layout_with_upstreams_namespace() -> None:
    selection = select_store_layout(LLAMA, Topology(tp_size=2), {"store_tp_size": 8}, kv_cache_layout="LBHNC")
    assert selection.sharding == LBHNC
    assert selection.store_namespace == "@store_tp:8@store_pp:1@store_format:tp_shared_lbhnc"


def test_without_store_options_the_layout_is_rank_local_with_no_namespace() -> None:
    selection = select_store_layout(LLAMA, Topology(tp_size=2), {}, kv_cache_layout="LBHNC")
    assert (selection.sharding, selection.store_namespace) == (None, "")


def test_a_single_kv_head_selects_the_shared_mqa_namespace() -> None:
    single = layout(full(num_kv_heads=1), heads=1)
    selection = select_store_layout(single, Topology(tp_size=4), {"store_tp_size": 4}, kv_cache_layout="LBNHC")
    assert (selection.sharding, selection.store_namespace) == (None, "@store_pp:1@store_format:tp_shared_mqa")


@pytest.mark.parametrize(
    "model, tp, extra, kv_layout, reason",
    [
        (LLAMA, 16, {"store_tp_size": 8}, "LBHNC", "not a multiple of tp_size 16"),
        (LLAMA, 2, {"store_tp_size": 8}, "BLHNC", "neither LBHNC nor LBNHC"),
        (LLAMA, 2, {"store_tp_size": "8"}, "LBHNC", "not a positive integer"),
        (LLAMA, 2, {"store_tp_size": 8, "enable_cross_layers_blocks": "True"}, "LBHNC", "enable_cross_layers_blocks"),
        (LLAMA, 2, {"store_tp_size": 6}, "LBHNC", "8 KV heads do not split into 6"),
        (layout(mla(), heads=1), 2, {"store_tp_size": 2}, "LBHNC", "shards only FullAttentionSpec"),
        (layout(full(), mamba(), heads=2), 2, {"store_tp_size": 2}, "LBHNC", "2 KV-cache groups"),
    ],
    ids=["tp-above-store-tp", "other-cache-layout", "not-an-int", "cross-layer-blocks", "heads-not-divisible", "mla", "hybrid"],
)
def test_a_deployment_vllm_cannot_shard_falls_back_to_a_tp_sized_namespace_saying_why(
    model: Layout, tp: int, extra: dict[str, object], kv_layout: str, reason: str
) -> None:
    selection = select_store_layout(model, Topology(tp_size=tp), extra, kv_cache_layout=kv_layout)
    assert selection.sharding is None
    assert selection.store_namespace == f"@store_pp:1@store_format:rank_local_tp{tp}_layout_{kv_layout}"
    assert reason in selection.reason


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"enable_store_tp_lcm": True, "prefill_tp_sizes": [4, 6]}, 12),
        ({"enable_store_tp_lcm": True, "prefill_tp_sizes": []}, None),
        ({"enable_store_tp_lcm": True, "prefill_tp_sizes": [4, True]}, None),
        ({"enable_store_tp_lcm": True, "store_tp_size": 4}, None),
        ({"store_tp_size": 4}, 4),
        ({"store_tp_size": 0}, None),
        ({"store_tp_size": True}, None),
    ],
)
def test_the_store_tp_size_resolves_as_vllm_resolves_it(extra: dict[str, object], expected: int | None) -> None:
    assert resolve_store_tp_size(extra) == expected


# --- the plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_each_rank_writes_the_store_shards_of_its_heads(tp: int) -> None:
    plan = sharded_plan("default", tp)
    owned = [rank.store_shards for rank in plan.groups[0].ranks]
    assert [shard for shards in owned for shard in shards] == list(range(8))
    assert all(len(shards) == 8 // tp for shards in owned)


@pytest.mark.parametrize("policy_name", shipped_policy_names())
def test_a_lookup_needs_every_store_shard(policy_name: str) -> None:
    plan = sharded_plan(policy_name, 2)
    (group,) = plan.groups
    assert len(group.lookup_namespaces) == 8
    assert {key for rank in group.ranks for key in plan.key_prefixes(0, rank.tp_rank)} == set(group.lookup_namespaces)


def test_compat_keys_a_store_shard_by_its_id_in_the_tp_rank_field() -> None:
    plan = sharded_plan("vllm-compat", 4)
    assert plan.key_prefixes(0, 1) == tuple(
        f"Llama-3.1-70B-Instruct@store_tp:8@store_pp:1@store_format:tp_shared_lbhnc@tp_rank:{shard}"
        "@pcp0@dcp0@pp_rank:0@group:0"
        for shard in (2, 3)
    )


def test_sharded_writes_are_not_amplified() -> None:
    (group,) = sharded_plan("default", 4).groups
    assert group.written_bytes_per_token == group.undeduplicated_bytes_per_token


def test_a_prompt_writes_each_store_shard_once_and_every_rank_reads_its_shards() -> None:
    traffic = prompt_traffic(sharded_plan("default", 2), LLAMA, prompt_tokens=100)  # 6 full blocks of 16
    assert (traffic.objects_written, traffic.objects_read) == (6 * 8, 6 * 2 * 4)


# --- the fingerprint ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["default", "no-dedup"])
def test_instances_of_different_tp_sizes_share_store_shards_under_one_store_tp(policy_name: str) -> None:
    tp2, tp8 = sharded_plan(policy_name, 2), sharded_plan(policy_name, 8)
    assert tp2.fingerprint == tp8.fingerprint
    assert tp2.key_prefixes(0, 0)[3] == tp8.key_prefixes(0, 3)[0]  # store shard 3 on either side


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: sharded_plan("default", 2, store_tp=4), id="other-store-tp"),
        pytest.param(lambda: sharded_plan("default", 2, kv_layout="LBNHC"), id="other-format"),
        pytest.param(lambda: make_plan(load_policy("default"), LLAMA, Topology(tp_size=2)), id="rank-local"),
    ],
)
def test_a_different_store_layout_never_shares_keys(other: object) -> None:
    plan = sharded_plan("default", 2)
    assert callable(other)
    different = other()
    assert different.fingerprint != plan.fingerprint
    assert not set(different.groups[0].lookup_namespaces) & set(plan.groups[0].lookup_namespaces)


def test_a_different_head_size_under_one_store_tp_never_shares() -> None:
    small = layout(full(num_kv_heads=4, head_size=64), heads=8)
    large = layout(full(num_kv_heads=4, head_size=128), heads=8)
    sharding = StoreSharding(8, "tp_shared_lbhnc")
    plans = [make_plan(load_policy("default"), model, Topology(tp_size=2), store_sharding=sharding) for model in (small, large)]
    assert plans[0].fingerprint != plans[1].fingerprint


# --- refusals -------------------------------------------------------------------------------------


def test_a_rule_repeating_heads_under_a_sharded_store_is_refused_naming_the_rule() -> None:
    wrong = policy(
        """\
        version: 1
        kind: ReplicationPolicy
        name: wrong
        rules:
          - name: attention-replicated
            reason: a wrong claim
            match: {spec: AttentionSpec}
            replication: replicated
        """
    )
    with pytest.raises(PlanError, match=r"rule 'attention-replicated' \(inline.yaml:\d+\) says 2 TP ranks repeat"):
        make_plan(wrong, LLAMA, Topology(tp_size=2), store_sharding=LBHNC)


@pytest.mark.parametrize(
    "model, topology, sharding, message",
    [
        (LLAMA, Topology(tp_size=16), LBHNC, "store_tp_size 8 is not a multiple of tp_size 16"),
        (LLAMA, Topology(tp_size=2, pcp_size=2), LBHNC, "pcp_size and dcp_size must be 1"),
        (LLAMA, Topology(tp_size=2), StoreSharding(16, "tp_shared_lbhnc"), "8 KV heads do not split into store_tp_size 16"),
        (layout(full(), mamba(), heads=2), Topology(tp_size=2), StoreSharding(2, "tp_shared_lbhnc"), "MambaSpec is not"),
    ],
    ids=["store-tp-below-tp", "pcp", "heads", "state-group"],
)
def test_a_sharded_store_the_bytes_cannot_form_is_refused(
    model: Layout, topology: Topology, sharding: StoreSharding, message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(load_policy("default"), model, topology, store_sharding=sharding)


def test_an_unknown_store_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown TP-sharded store format 'tp_shared_blhnc'"):
        StoreSharding(8, "tp_shared_blhnc")


# --- review findings: what the fingerprint alone must separate ------------------------------------

FINGERPRINT_ONLY = policy(
    """\
    version: 1
    kind: ReplicationPolicy
    name: fingerprint-only
    key:
      template: "{cache_prefix}{model}@plan:{fingerprint}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"
    rules:
      - name: kv-heads
        reason: GQA heads
        match: {spec: AttentionSpec}
        factor: max(1, tp_size // total_num_kv_heads)
    """
)


@pytest.mark.parametrize(
    "other",
    [StoreSharding(4, "tp_shared_lbhnc"), StoreSharding(8, "tp_shared_lbnhc"), None],
    ids=["other-store-tp", "other-format", "rank-local"],
)
def test_the_fingerprint_alone_separates_store_layouts(other: StoreSharding | None) -> None:
    """Without {store_namespace} in the template only the fingerprint keeps these apart."""
    plan = make_plan(FINGERPRINT_ONLY, LLAMA, Topology(tp_size=2), store_sharding=LBHNC)
    different = make_plan(FINGERPRINT_ONLY, LLAMA, Topology(tp_size=2), store_sharding=other)
    assert plan.fingerprint != different.fingerprint


def test_a_sharded_store_needs_the_store_namespace_or_the_fingerprint_in_keys() -> None:
    with pytest.raises(PlanError, match=r"has neither \{store_namespace\} nor \{fingerprint\}"):
        make_plan(load_policy("vllm-compat").model_copy(update={"key": FINGERPRINT_ONLY.key.model_copy(
            update={"template": "{cache_prefix}{model}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"}
        )}), LLAMA, Topology(tp_size=2), store_sharding=LBHNC)


def test_rank_local_objects_in_another_kv_cache_layout_never_share_keys() -> None:
    plans = [
        make_plan(load_policy("default"), LLAMA.model_copy(update={"kv_cache_layout": name}), Topology(tp_size=2))
        for name in ("LBHNC", "LBNHC")
    ]
    assert plans[0].fingerprint != plans[1].fingerprint


def test_pipeline_stages_with_different_layer_counts_share_one_fingerprint() -> None:
    """An uneven split (80 layers over 3 stages: 27, 27, 26) must not give stages different
    fingerprints: rank 0 looks every stage up under its own."""
    stages = [
        layout(full(num_kv_heads=1), heads=8).model_copy(
            update={"groups": (
                layout(full(num_kv_heads=1), heads=8).groups[0].model_copy(update={"layers": tuple(f"l{i}" for i in range(count))}),
            )}
        )
        for count in (27, 26)
    ]
    fingerprints = {make_plan(load_policy("default"), stage, Topology(tp_size=2, pp_size=3)).fingerprint for stage in stages}
    assert len(fingerprints) == 1
