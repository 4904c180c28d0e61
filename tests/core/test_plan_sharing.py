"""What one plan works out once and shares between its groups (each distinct spec's values and rule
outcomes, each factor's rank assignments, each namespace's rendered key prefix) gives every group
what planning it alone gives; specs that ``==`` calls equal but a plan tells apart are not shared."""

from __future__ import annotations

from core_support import full, layout, mamba, mla, policy
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpolicy.documents.loader import load_policy
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.models import KeyFormat, Layout, Schedule, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.plan import GroupPlan, Plan

GLOBS = policy(
    """\
    version: 1
    kind: ReplicationPolicy
    name: globs
    rules:
      - name: first-layers
        reason: layer globs split the layers of one spec
        match: {layers: ["g0.*", "g2.l1", "g*.m0.*"]}
        replication: replicated
      - name: flagged
        reason: a field condition that true and 1 both meet
        match: {fields: {tp_replicated: 1}}
        replication: replicated
      - name: declared
        reason: an expression over a field
        match: {spec: AttentionSpec}
        when: max_tp_shards is not None
        shards: min(tp_size, max_tp_shards)
    """
)
POLICIES = [load_policy(name) for name in ("default", "no-dedup", "vllm-compat")] + [GLOBS]
SPECS = [
    mla(), full(), full(max_tp_shards=2), full(max_tp_shards=None, num_kv_heads=2),
    mamba(tp_replicated=True), mamba(tp_replicated=1), mamba(tp_replicated=False),
    mamba(shapes=[[1.0, 2]]), mamba(shapes=[[1, 2]]), mamba(shapes=[[-0.0]]), mamba(shapes=[[0.0]]),
    mamba(tp_replicated=False, mamba_type="mamba2"), mamba(mamba_type="mamba2", tp_replicated=False),
]
"""Specs that repeat, and pairs that ``==`` takes for one another (true and 1, 1.0 and 1, -0.0 and 0.0, field order)."""

groups = st.one_of(st.sampled_from(SPECS), st.lists(st.sampled_from(SPECS), min_size=1, max_size=3))
layouts = st.builds(lambda groups_, heads: layout(*groups_, heads=heads), st.lists(groups, min_size=1, max_size=7),
                    st.sampled_from([1, 2, 8]))
topologies = st.builds(
    lambda tp, pp, dcp: Topology(tp_size=tp, pp_size=pp, dcp_size=dcp if tp % dcp == 0 else 1),
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.sampled_from([1, 1, 2]),
)
policies = st.builds(lambda p, schedule: p.model_copy(update={"schedule": schedule}), st.sampled_from(POLICIES),
                     st.sampled_from(list(Schedule)))


def alone(the_layout: Layout, index: int) -> Layout:
    return the_layout.model_copy(update={"groups": (the_layout.groups[index],)})


def upstream_lookup(plan: Plan, group: GroupPlan) -> tuple[str, ...]:
    """The lookup prefixes rendered one by one (``Plan.key_prefix``), in upstream's order."""
    topology = plan.topology
    leaders = sorted({rank.replica_set[0] for rank in group.ranks})
    return tuple(
        plan.key_prefix(group.index, leader, pcp_rank, pp_rank)
        for pcp_rank in range(topology.pcp_size)
        for leader in leaders
        for pp_rank in range(topology.pp_size)
    )


def assert_same_group(shared: GroupPlan, own: GroupPlan, index: int) -> None:
    """``shared`` (group ``index`` of a plan of many) is ``own`` (the group planned alone, as group 0)
    in everything but the index, which only the write phase and the keys carry."""
    for field in ("decisions", "factor", "shards", "bytes_per_token_per_rank", "written_bytes_per_token",
                  "undeduplicated_bytes_per_token", "chunk_tokens", "spec_types", "uniform", "demoted"):
        assert getattr(shared, field) == getattr(own, field), field
    for ours, theirs in zip(shared.ranks, own.ranks, strict=True):
        assert (ours.tp_rank, ours.shard, ours.replica_set, ours.stripe_rank, ours.store_shards) == (
            theirs.tp_rank, theirs.shard, theirs.replica_set, theirs.stripe_rank, theirs.store_shards
        )
        assert (ours.schedule.kind, ours.schedule.step, ours.schedule.active) == (
            theirs.schedule.kind, theirs.schedule.step, theirs.schedule.active
        )
        expected_phase = (ours.stripe_rank + index) % shared.factor if ours.schedule.kind is Schedule.STRIPED else 0
        assert ours.schedule.phase == expected_phase


@settings(deadline=None)
@given(layouts, topologies, policies, st.sets(st.integers(0, 6), max_size=2))
def test_every_group_of_a_plan_is_the_group_planned_alone(the_layout, topology, the_policy, demoted):
    try:
        plan = make_plan(the_policy, the_layout, topology, demoted=demoted)
    except PlanError:
        assume(False)
        raise
    for group in plan.groups:
        own = make_plan(the_policy, alone(the_layout, group.index), topology, demoted={0} if group.index in demoted else ())
        assert_same_group(group, own.groups[0], group.index)
        assert group.lookup_namespaces == upstream_lookup(plan, group)


def fingerprint(*specs: dict[str, object]) -> str:
    return make_plan(load_policy("default"), layout(*specs, heads=1), Topology(tp_size=4)).fingerprint


def test_specs_equal_by_eq_are_not_shared_when_a_plan_tells_them_apart() -> None:
    # The fingerprint covers each spec's fields as written; sharing one spec's work with the other
    # would make the pair plan as two of the same.
    for first, second in [
        (mamba(tp_replicated=True), mamba(tp_replicated=1)),
        (mamba(shapes=[[1.0]]), mamba(shapes=[[1]])),
        (mamba(shapes=[[-0.0]]), mamba(shapes=[[0.0]])),
    ]:
        pair = fingerprint(first, second)
        assert pair not in (fingerprint(first, first), fingerprint(second, second))
        assert pair == fingerprint(dict(first), dict(second))


def test_keys_are_rendered_one_by_one_where_the_template_is_not_plain_fields() -> None:
    # Shipped templates have plain fields only; a template with a format spec (which validation
    # refuses, but a program may build) or a model name holding the group mark is rendered one by one.
    padded = load_policy("vllm-compat").model_copy(
        update={"key": KeyFormat.model_construct(template="{model}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}"
                                                          "@pp_rank:{pp_rank}@group:{group:03}")}
    )
    plan = make_plan(padded, layout(full(), mla(), heads=2), Topology(tp_size=4))
    assert plan.groups[1].lookup_namespaces[0].endswith("@group:001")
    marked = layout(full(), mla(), heads=2, model="org/a\x00group\x00b")
    for the_plan in (plan, make_plan(load_policy("default"), marked, Topology(tp_size=4))):
        for group in the_plan.groups:
            assert group.lookup_namespaces == upstream_lookup(the_plan, group)
