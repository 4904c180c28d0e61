"""The example layouts validate, and the shipped vllm-compat policy gives upstream's factors on every one of them."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from core_support import upstream_factor

from kvpolicy.documents.loader import check_file, layouts_dir, load_layout, load_policy, shipped_policy_names
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.models import Layout, Topology
from kvpolicy.planning.engine import make_plan

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "layouts"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
TP_SIZES = (1, 2, 4, 8)

layout_at = functools.cache(load_layout)
policy_named = functools.cache(load_policy)


def test_example_layouts_exist():
    # a glob over an empty directory would make every test below pass vacuously
    assert EXAMPLES, f"no example layouts in {EXAMPLES_DIR}"


def test_the_loader_finds_the_same_example_layouts():
    assert sorted(path.name for path in layouts_dir().glob("*.yaml")) == [path.name for path in EXAMPLES]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_example_layout_validates(path):
    document, problems = check_file(path)
    assert [str(d) for d in problems if d.severity == "error"] == []
    assert isinstance(document, Layout)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_example_layout_has_no_warnings(path):
    _, problems = check_file(path)
    assert [str(d) for d in problems] == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_example_layout_loads_by_name(path):
    assert load_layout(path.stem) == layout_at(path)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_vllm_compat_gives_upstream_factors(path, tp_size):
    the_layout = layout_at(path)
    expected = tuple(
        upstream_factor(group, tp_size=tp_size, dcp_size=1, total_num_kv_heads=the_layout.total_num_kv_heads)
        for group in the_layout.groups
    )
    compat = policy_named("vllm-compat")
    if any(tp_size % factor for factor in expected):
        # upstream would use a factor whose replica sets do not tile TP; the engine must refuse instead
        with pytest.raises(PlanError):
            make_plan(compat, the_layout, Topology(tp_size=tp_size))
        return
    assert make_plan(compat, the_layout, Topology(tp_size=tp_size)).factors == expected


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_vllm_compat_gives_factor_one_under_dcp(path):
    the_layout = layout_at(path)
    # vLLM needs more TP ranks than GQA KV heads for DCP (the 8-head layouts: tp 16); MLA has no such limit.
    gqa = any(
        "AttentionSpec" in member.spec.classes and "MLAAttentionSpec" not in member.spec.classes
        for group in the_layout.groups
        for member in group.members
    )
    tp_size = 16 if gqa and the_layout.total_num_kv_heads >= 8 else 8
    the_plan = make_plan(policy_named("vllm-compat"), the_layout, Topology(tp_size=tp_size, dcp_size=2))
    assert the_plan.factors == (1,) * len(the_layout.groups)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("policy_name", ["default", "no-dedup", "vllm-compat"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_every_shipped_policy_plans_every_example_layout(path, policy_name, tp_size):
    the_plan = make_plan(policy_named(policy_name), layout_at(path), Topology(tp_size=tp_size, pp_size=2))
    assert all(tp_size % factor == 0 for factor in the_plan.factors)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_default_never_shares_a_mamba_group_unless_it_is_declared_replicated(path):
    the_layout = layout_at(path)
    the_plan = make_plan(policy_named("default"), the_layout, Topology(tp_size=8))
    for group, factor in zip(the_layout.groups, the_plan.factors, strict=True):
        mamba = [m.spec for m in group.members if "MambaSpec" in m.spec.classes]
        if mamba and not all(spec.fields.get("tp_replicated") is True for spec in mamba):
            assert factor == 1, group.name


def test_shipped_policy_names():
    assert set(shipped_policy_names()) >= {"default", "no-dedup", "vllm-compat"}


def vllm_topologies(max_tp: int = 16):
    """Every (tp, pcp, dcp) vLLM 0.32's ParallelConfig accepts up to ``max_tp``: without PCP, DCP divides
    TP; with PCP, DCP is 1, the PCP size or TP x PCP."""
    for tp in (1, 2, 4, 8, 16):
        if tp > max_tp:
            continue
        for pcp in (1, 2, 4):
            dcps = [dcp for dcp in range(1, tp + 1) if tp % dcp == 0] if pcp == 1 else sorted({1, pcp, tp * pcp})
            for dcp in dcps:
                yield tp, pcp, dcp


@pytest.mark.parametrize("tp_size, pcp_size, dcp_size", list(vllm_topologies()))
@pytest.mark.parametrize("policy_name", ["default", "no-dedup", "vllm-compat"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_every_example_layout_plans_at_every_topology_vllm_accepts_or_names_vllms_constraint(
    path, policy_name, tp_size, pcp_size, dcp_size
):
    topology = Topology(tp_size=tp_size, pcp_size=pcp_size, dcp_size=dcp_size)
    try:
        the_plan = make_plan(policy_named(policy_name), layout_at(path), topology)
    except PlanError as error:
        # vLLM's ModelConfig refuses DCP on GQA/MQA with no more TP ranks than KV heads.
        assert dcp_size > 1 and "vLLM refuses dcp_size" in str(error), str(error)
        return
    for group in the_plan.groups:
        assert sorted(rank for replica_set in {r.replica_set for r in group.ranks} for rank in replica_set) == list(
            range(tp_size)
        )
        assert len(group.lookup_namespaces) == group.shards * pcp_size
