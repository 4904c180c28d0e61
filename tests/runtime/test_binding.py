"""What a plan means for one rank (:mod:`kvpolicy.runtime.binding`): :class:`RankPlace` and
:class:`RankBinding`, on plans the engine makes from the shipped ``default`` policy.

The layout is a small GQA hybrid: a full-attention group with 2 KV heads in all and a Mamba group
whose state is split over TP. At TP 4 each KV head lands on 2 consecutive ranks (ranks 0 and 1 hold
head 0, ranks 2 and 3 head 1), so the attention group is replicated with factor 2; the Mamba group
is sharded (every rank holds bytes of its own, factor 1). Every expected value below follows from
that, not from a run of the code under test.
"""

from __future__ import annotations

import copy
import dataclasses
import textwrap
from pathlib import Path

import pytest

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.keys import chunk_key
from kvpolicy.language.models import Layout, LoadMode, Policy, Schedule, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.plan import Plan
from kvpolicy.runtime.binding import RankBinding, RankPlace

TP = 4
ATTENTION, STATE = 0, 1
"""The groups' indices, in the layout's order."""
HASH = "0123abcd"
"""A chunk hash: any hex string."""

GQA_HYBRID = textwrap.dedent(
    """\
    version: 1
    kind: ModelLayout
    model: org/gqa-hybrid
    total_num_kv_heads: 2
    groups:
      - name: attention
        spec:
          type: FullAttentionSpec
          bases: [AttentionSpec, KVCacheSpec]
          block_size: 16
          page_size_bytes: "2 * block_size * max(1, 2 // tp_size) * 128 * 2"
          fields:
            num_kv_heads: {expr: "max(1, 2 // tp_size)"}
            head_size: 128
            max_tp_shards: null
        layers: ["l.{0..1}.attn"]
      - name: state
        spec: {type: MambaSpec, bases: [KVCacheSpec], block_size: 16, page_size_bytes: 512, fields: {tp_replicated: false}}
        layers: [l.2.mixer]
    """
)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    path: Path = tmp_path_factory.mktemp("layouts") / "gqa-hybrid.yaml"
    path.write_text(GQA_HYBRID, encoding="utf-8")
    return load_layout(path)


@pytest.fixture(scope="module")
def default() -> Policy:
    return load_policy("default")


def plan_of(policy: Policy, layout: Layout, demoted: frozenset[int] = frozenset(), **topology: int) -> Plan:
    return make_plan(policy, layout, Topology(**{"tp_size": TP, **topology}), demoted=demoted)


@pytest.fixture(scope="module")
def plan(default: Policy, layout: Layout) -> Plan:
    return plan_of(default, layout)


def bound(plan: Plan, tp_rank: int, **place: int) -> RankBinding:
    return RankBinding.of(plan, RankPlace(tp_rank=tp_rank, tp_size=TP, **place))


def namespaces(binding: RankBinding, group: int) -> set[str]:
    return {prefix for prefix, of in binding.group_of_prefix.items() if of == group}


# --- RankPlace ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", ["tp", "pp", "pcp", "dcp"])
def test_a_place_refuses_a_rank_outside_its_group(axis: str) -> None:
    with pytest.raises(ValueError, match=f"{axis} rank 2 is outside a group of size 2"):
        RankPlace(**{f"{axis}_rank": 2, f"{axis}_size": 2})
    with pytest.raises(ValueError, match=f"{axis} rank 0 is outside a group of size 0"):
        RankPlace(**{f"{axis}_size": 0})
    RankPlace(**{f"{axis}_rank": 1, f"{axis}_size": 2})  # the last rank of the group is inside it


def test_is_first_is_rank_0_on_every_parallel_axis_whatever_the_data_parallel_replica() -> None:
    assert RankPlace(tp_size=2, pp_size=2, pcp_size=2, dcp_size=2).is_first
    assert RankPlace(dp_rank=3).is_first  # every DP replica is an instance with a first rank of its own
    for axis in ("tp", "pp", "pcp", "dcp"):
        assert not RankPlace(tp_size=2, pp_size=2, pcp_size=2, dcp_size=2, **{f"{axis}_rank": 1}).is_first, axis


def test_the_rank_that_speaks_is_tp_rank_0_of_each_stage() -> None:
    assert RankPlace(tp_size=2, pp_rank=1, pp_size=2, pcp_rank=1, pcp_size=2).speaks
    assert not RankPlace(tp_rank=1, tp_size=2).speaks


# --- RankBinding: groups, replica sets and namespaces ------------------------------------------------


def test_the_binding_carries_the_plan_and_the_place_it_was_made_for(plan: Plan) -> None:
    place = RankPlace(tp_rank=2, tp_size=TP)
    binding = RankBinding.of(plan, place)
    assert binding.plan is plan and binding.place == place
    assert binding.factors == (2, 1)  # 2 KV heads over 4 ranks: each on 2; the Mamba state split over all 4


def test_a_replicated_groups_replica_set_holds_the_ranks_that_share_its_bytes(plan: Plan) -> None:
    # Ranks 0 and 1 hold KV head 0, ranks 2 and 3 head 1.
    assert [bound(plan, rank).replica_set_of(ATTENTION) for rank in range(TP)] == [(0, 1), (0, 1), (2, 3), (2, 3)]


def test_a_sharded_groups_replica_set_is_the_rank_alone(plan: Plan) -> None:
    assert [bound(plan, rank).replica_set_of(STATE) for rank in range(TP)] == [(0,), (1,), (2,), (3,)]


def test_the_members_of_a_replica_set_write_one_namespace_and_other_sets_another(plan: Plan) -> None:
    first, second, third, fourth = (namespaces(bound(plan, rank), ATTENTION) for rank in range(TP))
    assert len(first) == 1 and first == second and third == fourth and first != third


def test_a_sharded_groups_key_namespace_differs_per_rank(plan: Plan) -> None:
    written = [namespaces(bound(plan, rank), STATE) for rank in range(TP)]
    assert all(len(one) == 1 for one in written)
    assert len(set().union(*written)) == TP


def test_a_ranks_namespaces_are_the_plans_key_prefixes_for_its_rank_and_stage(default: Policy, layout: Layout) -> None:
    staged = plan_of(default, layout, pp_size=2)
    binding = bound(staged, 3, pp_rank=1, pp_size=2)
    assert dict(binding.group_of_prefix) == {
        staged.key_prefix(ATTENTION, 3, pp_rank=1): ATTENTION,
        staged.key_prefix(STATE, 3, pp_rank=1): STATE,
    }
    # Another pipeline stage writes other objects: none of its namespaces is shared.
    assert not set(binding.group_of_prefix) & set(bound(staged, 3, pp_rank=0, pp_size=2).group_of_prefix)


def test_a_lookup_needs_one_namespace_per_replica_set(plan: Plan) -> None:
    binding = bound(plan, 0)
    # 4 ranks / factor 2 = 2 distinct byte sets for the attention group, 4 for the sharded state.
    assert [len(prefixes) for prefixes in binding.lookup_key_prefixes] == [2, 4]
    # A hit needs every rank's bytes, its own included, and the lookup is the same on every rank.
    assert namespaces(binding, ATTENTION) <= set(binding.lookup_key_prefixes[ATTENTION])
    assert binding.lookup_key_prefixes == bound(plan, 3).lookup_key_prefixes


# --- RankBinding: the key lookups ----------------------------------------------------------------------


def test_group_of_key_maps_a_key_of_the_ranks_namespaces_back_to_its_group(plan: Plan) -> None:
    binding = bound(plan, 1)
    for group in (ATTENTION, STATE):
        (namespace,) = namespaces(binding, group)
        assert binding.group_of_key(chunk_key(namespace, HASH)) == group


def test_group_of_key_maps_a_replicas_key_of_the_shared_group_to_that_group(plan: Plan) -> None:
    (replicas,) = namespaces(bound(plan, 1), ATTENTION)
    assert bound(plan, 0).group_of_key(chunk_key(replicas, HASH)) == ATTENTION


def test_group_of_key_returns_none_for_a_foreign_key(plan: Plan) -> None:
    binding = bound(plan, 0)
    (other_set,) = namespaces(bound(plan, 2), ATTENTION)  # the other replica set's head
    (other_rank,) = namespaces(bound(plan, 1), STATE)  # another rank's slice of the state
    assert binding.group_of_key(chunk_key(other_set, HASH)) is None
    assert binding.group_of_key(chunk_key(other_rank, HASH)) is None
    assert binding.group_of_key(chunk_key("someone-else@plan:0", HASH)) is None


def test_group_of_key_returns_none_for_a_string_that_is_no_chunk_key(plan: Plan) -> None:
    binding = bound(plan, 0)
    (namespace,) = namespaces(binding, ATTENTION)
    assert binding.group_of_key(namespace.replace("@", "_")) is None


# --- RankBinding: what vLLM's send thread runs with ------------------------------------------------


def test_the_send_thread_rank_is_the_tp_rank_without_decode_context_parallelism(plan: Plan) -> None:
    assert [bound(plan, rank).send_rank for rank in range(TP)] == [0, 1, 2, 3]


def test_the_send_thread_rank_is_the_tp_rank_over_the_dcp_size_under_decode_context_parallelism(
    default: Policy, layout: Layout
) -> None:
    dcp = plan_of(default, layout, dcp_size=2)
    ranks = [bound(dcp, rank, dcp_rank=rank % 2, dcp_size=2).send_rank for rank in range(TP)]
    assert ranks == [0, 0, 1, 1]


def test_under_striped_writes_a_groups_put_step_is_its_factor(plan: Plan) -> None:
    assert plan.schedule is Schedule.STRIPED
    assert bound(plan, 0).put_steps == (2, 1)


def test_under_leader_writes_every_put_step_is_1_and_only_replica_set_leaders_take_part(
    default: Policy, layout: Layout
) -> None:
    leader = plan_of(default.model_copy(update={"schedule": Schedule.LEADER}), layout)
    assert bound(leader, 0).put_steps == (1, 1)
    # The attention group's replica sets are led by ranks 0 and 2; the sharded state has a set per rank.
    assert [bound(leader, rank).participates for rank in range(TP)] == [
        (True, True), (False, True), (True, True), (False, True)
    ]


def test_a_group_vllm_does_not_cache_takes_no_part_in_writes(plan: Plan) -> None:
    binding = RankBinding.of(plan, RankPlace(tp_rank=1, tp_size=TP), prefix_cacheable=[True, False])
    assert binding.prefix_cacheable == (True, False)
    assert binding.participates == (True, False)
    assert bound(plan, 1).participates == (True, True)  # none given: every group is cached


def test_a_prefix_cacheable_flag_per_group_is_required(plan: Plan) -> None:
    with pytest.raises(RuntimeError, match="kvpolicy planned 2 groups but the store coordinator has 3"):
        RankBinding.of(plan, RankPlace(tp_size=TP), prefix_cacheable=[True, True, True])


def test_the_dedup_multiplier_is_the_factor_when_a_replica_set_writes_each_chunk_once(plan: Plan) -> None:
    assert bound(plan, 0).dedup_multipliers == (2, 1)


def test_the_dedup_multiplier_is_1_when_every_replica_writes_its_copy(default: Policy, layout: Layout) -> None:
    every = plan_of(default.model_copy(update={"schedule": Schedule.ALL}), layout)
    assert every.factors == (2, 1)  # still replicated: only who writes changed
    assert bound(every, 0).dedup_multipliers == (1, 1)


def test_loads_stripe_only_when_the_policy_says_striped_and_a_group_is_replicated(
    default: Policy, layout: Layout
) -> None:
    striped = default.model_copy(update={"load": LoadMode.STRIPED})
    assert bound(plan_of(striped, layout), 2).stripes_loads
    assert not bound(plan_of(default, layout), 2).stripes_loads  # per-rank loads
    assert not bound(plan_of(striped, layout, demoted=frozenset({ATTENTION})), 2).stripes_loads  # nothing replicated


# --- RankBinding: a re-plan --------------------------------------------------------------------------


def test_for_plan_on_a_new_plan_gives_a_new_binding_and_leaves_the_old_one_unchanged(
    default: Policy, layout: Layout, plan: Plan
) -> None:
    place = RankPlace(tp_rank=1, tp_size=TP)
    old = RankBinding.of(plan, place, prefix_cacheable=[True, False])
    before = {field.name: copy.deepcopy(getattr(old, field.name)) for field in dataclasses.fields(old)}
    demoted = plan_of(default, layout, demoted=frozenset({ATTENTION}))
    new = old.for_plan(demoted)
    assert new is not old and new.plan is demoted
    assert new.place == place and new.prefix_cacheable == (True, False)  # the same rank and groups
    assert new.replica_set_of(ATTENTION) == (1,) and new.factors == (1, 1)  # demoted: every rank its own copy
    assert {field.name: getattr(old, field.name) for field in dataclasses.fields(old)} == before
    assert old.plan is plan and old.replica_set_of(ATTENTION) == (0, 1)
    assert not set(new.group_of_prefix) & set(old.group_of_prefix)  # the new plan's objects are other objects


def test_a_binding_cannot_be_changed_in_place(plan: Plan) -> None:
    binding = bound(plan, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        binding.plan = plan  # type: ignore[misc]
