"""Invariants of every plan: random layouts × topologies × the shipped policies × the three schedules."""

from __future__ import annotations

from core_support import layout, spec, upstream_factor
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpolicy.documents.loader import load_policy
from kvpolicy.language.catalog import SPEC_CLASSES
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.models import Schedule, Topology
from kvpolicy.planning.engine import make_plan

POLICIES = {name: load_policy(name) for name in ("default", "no-dedup", "vllm-compat")}
MEMBER_CLASSES = sorted(name for name in SPEC_CLASSES if name != "UniformTypeKVCacheSpecs")
POWERS_OF_TWO = [1, 2, 4, 8, 16, 32]


def is_attention(name: str) -> bool:
    return name == "AttentionSpec" or "AttentionSpec" in SPEC_CLASSES[name]


@st.composite
def specs(draw):
    name = draw(st.sampled_from(MEMBER_CLASSES))
    fields = {}
    if is_attention(name):
        # vLLM always states max_tp_shards on attention specs (None unless the backend declares it)
        fields["max_tp_shards"] = draw(st.sampled_from([None, *POWERS_OF_TWO]))
    if name == "MambaSpec":
        fields["tp_replicated"] = draw(st.booleans())
    return spec(name, page_size_bytes=draw(st.sampled_from([512, 4096, "4096 // tp_size + 1"])), **fields)


groups = st.one_of(specs(), st.lists(specs(), min_size=1, max_size=3))
layouts = st.builds(
    lambda groups_, heads: layout(*groups_, heads=heads),
    st.lists(groups, min_size=1, max_size=6),
    st.sampled_from(POWERS_OF_TWO),
)


@st.composite
def topologies(draw):
    """Topologies vLLM's ParallelConfig accepts: DCP divides TP, or with PCP spans PCP or all of TP x PCP."""
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    pcp = draw(st.sampled_from([1, 1, 2]))
    if pcp == 1:
        dcp = draw(st.sampled_from([dcp for dcp in (1, 1, 1, 2, 4) if tp % dcp == 0]))
    else:
        dcp = draw(st.sampled_from([1, 1, pcp, tp * pcp]))
    return Topology(tp_size=tp, pp_size=draw(st.sampled_from([1, 2])), pcp_size=pcp, dcp_size=dcp)


policies = st.builds(
    lambda name, schedule: POLICIES[name].model_copy(update={"schedule": schedule}),
    st.sampled_from(sorted(POLICIES)),
    st.sampled_from(list(Schedule)),
)

SETTINGS = settings(deadline=None)


def plan_of(policy, the_layout, topology, **kwargs):
    """The plan, for topologies vLLM accepts; the others are refused (see the refusal tests) and skipped."""
    try:
        return make_plan(policy, the_layout, topology, **kwargs)
    except PlanError as error:
        assume("vLLM refuses dcp_size" not in str(error))
        raise


def chunks(factor: int) -> range:
    return range(2 * factor + 1)  # every phase, twice, and one more


@SETTINGS
@given(layouts, topologies(), policies, st.sets(st.integers(0, 5), max_size=2))
def test_replica_sets_tile_tp_in_equal_sets_that_share_heads_tokens_and_one_namespace(
    the_layout, topology, policy, demoted
):
    the_plan = plan_of(policy, the_layout, topology, demoted=demoted)
    tp = topology.tp_size
    for group in the_plan.groups:
        f = group.factor
        assert f >= 1 and tp % f == 0 and group.shards * f == tp
        if group.index in demoted:
            assert f == 1 and group.demoted
        sets = {rank.replica_set for rank in group.ranks}
        assert sorted(r for replica_set in sets for r in replica_set) == list(range(tp))  # a partition
        assert {len(replica_set) for replica_set in sets} == {f}
        prefixes = [the_plan.key_prefix(group.index, rank) for rank in range(tp)]
        for a in range(tp):
            for b in range(tp):
                same_set = b in group.ranks[a].replica_set
                if same_set:  # a replica set never mixes DCP token shards, at any PCP rank
                    for pcp_rank in range(topology.pcp_size):
                        assert topology.dcp_rank(a, pcp_rank) == topology.dcp_rank(b, pcp_rank)
                    assert group.ranks[a].shard == group.ranks[b].shard
                assert (prefixes[a] == prefixes[b]) is same_set


@SETTINGS
@given(layouts, topologies(), policies)
def test_schedule_decides_who_writes_each_chunk(the_layout, topology, policy):
    the_plan = plan_of(policy, the_layout, topology)
    tp = topology.tp_size
    for group in the_plan.groups:
        f = group.factor
        sets = {rank.replica_set for rank in group.ranks}
        for chunk in chunks(f):
            writers = set(group.writers(chunk))
            if policy.schedule is Schedule.STRIPED:
                # each (group, replica set, chunk) is written by exactly one member of the set
                for replica_set in sets:
                    assert len(writers & set(replica_set)) == 1, (group.index, replica_set, chunk)
            elif policy.schedule is Schedule.LEADER:
                assert writers == {replica_set[0] for replica_set in sets}
            else:
                assert writers == set(range(tp))
        if policy.schedule is Schedule.STRIPED:
            # and over f consecutive chunks every member of a set takes its turn once
            written = sorted(w for chunk in range(f) for w in group.writers(chunk))
            assert written == list(range(tp))


@SETTINGS
@given(layouts, topologies(), policies, st.sets(st.integers(0, 5), max_size=2))
def test_lookup_set_is_exactly_the_namespaces_writers_use(the_layout, topology, policy, demoted):
    the_plan = plan_of(policy, the_layout, topology, demoted=demoted)
    for group in the_plan.groups:
        written = {
            the_plan.key_prefix(group.index, rank, pcp_rank, pp_rank)
            for chunk in chunks(group.factor)
            for rank in group.writers(chunk)
            for pcp_rank in range(topology.pcp_size)
            for pp_rank in range(topology.pp_size)
        }
        assert set(group.lookup_namespaces) == written
        assert len(group.lookup_namespaces) == group.shards * topology.pcp_size * topology.pp_size
    # and no two groups share a namespace
    every = [prefix for group in the_plan.groups for prefix in group.lookup_namespaces]
    assert len(every) == len(set(every))


@SETTINGS
@given(layouts, topologies())
def test_vllm_compat_reproduces_upstream_factors(the_layout, topology):
    expected = tuple(
        upstream_factor(group, tp_size=topology.tp_size, dcp_size=topology.dcp_size,
                        total_num_kv_heads=the_layout.total_num_kv_heads)
        for group in the_layout.groups
    )
    assert plan_of(POLICIES["vllm-compat"], the_layout, topology).factors == expected


@settings(deadline=None)
@given(layouts, topologies(), policies)
def test_no_dedup_always_and_vllm_compat_under_dcp_give_factor_one(the_layout, topology, policy):
    factors = set(plan_of(policy, the_layout, topology).factors)
    if policy.name == "no-dedup" or (policy.name == "vllm-compat" and topology.dcp_size > 1):
        assert factors == {1}
