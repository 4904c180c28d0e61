"""Decode-context parallelism on the production worker: ranks of equal dcp rank hold the same tokens,
so a replicated group is written once per dcp rank, and every rank still loads its own bytes.

vLLM's CPU platform refuses DCP when it validates a config, so the simulation sets the DCP size on
the parallel config afterwards (:func:`kvpolicy.sim.build_model`); the coordinator, the block-size
resolution and every worker read it from there, as on a GPU engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import ConsistencyReport, run_consistency  # noqa: E402

WRONG = Path(__file__).resolve().parents[2] / "examples" / "policies" / "wrong-attention-replicated.yaml"
NUM_TOKENS = 256
def hit(dcp: int) -> int:
    """The longest prefix below the prompt in whole scheduler blocks of 16 * dcp tokens."""
    return (NUM_TOKENS - 1) // (16 * dcp) * (16 * dcp)


TOPOLOGIES = [pytest.param(tp, dcp, id=f"tp{tp}-dcp{dcp}") for tp, dcp in ((4, 2), (8, 2), (8, 4))]

Run = Callable[..., ConsistencyReport]


@pytest.fixture(scope="module")
def run(mooncake_master: MooncakeMaster, clients: ClientPool) -> Run:
    reports: dict[tuple[object, ...], ConsistencyReport] = {}

    def run(policy: str, archetype: str, tp: int, dcp: int, audit: bool | None = None) -> ConsistencyReport:
        key = (policy, archetype, tp, dcp, audit)
        if key not in reports:
            reports[key] = run_consistency(
                load_policy(policy), archetype, tp, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS,
                dcp_size=dcp, audit=audit,
            )
        return reports[key]

    return run


@pytest.mark.parametrize("tp, dcp", TOPOLOGIES)
def test_default_writes_mla_once_per_dcp_rank_and_loads_every_ranks_own_bytes(run: Run, tp: int, dcp: int) -> None:
    report = run("default", "mla", tp, dcp)
    (group,) = report.groups
    assert (group.factor, group.true_factor, group.audit) == (tp // dcp, tp // dcp, "agreed")
    assert report.hit_tokens == hit(dcp) and report.consistent and report.write_amplification == 1.0


@pytest.mark.parametrize("tp, dcp", TOPOLOGIES)
def test_vllm_compat_writes_mla_on_every_rank_under_dcp_as_upstream_does(run: Run, tp: int, dcp: int) -> None:
    report = run("vllm-compat", "mla", tp, dcp)
    assert report.consistent and report.write_amplification == tp // dcp  # vllm#51386


def test_a_rule_replicating_distinct_heads_loads_wrong_bytes_under_dcp_without_the_audit(run: Run) -> None:
    # 2 KV heads at TP 4: ranks 0 and 2 hold different heads, yet the wrong rule puts them in one set.
    report = run(str(WRONG), "sliding-window-full", 4, 2)  # the file says audit: off
    assert report.hit_tokens == hit(2) and not report.consistent


def test_the_audit_demotes_a_rule_replicating_distinct_heads_under_dcp(run: Run) -> None:
    report = run(str(WRONG), "sliding-window-full", 4, 2, audit=True)
    assert {(group.audit, group.factor) for group in report.groups} == {("demoted", 1)}
    assert report.hit_tokens == hit(2) and report.consistent


@pytest.mark.parametrize(
    "archetype, tp, dcp",
    [*(("mla", *param.values) for param in TOPOLOGIES), ("gqa-kv-lt-tp", 4, 2), ("gqa-kv-lt-tp", 8, 2)],
)
def test_the_plans_chunk_is_the_store_coordinators_under_dcp(archetype: str, tp: int, dcp: int) -> None:
    # vLLM resolves specs for DCP before it cuts chunks: a DCP-sharded spec's chunk spans dcp_size blocks.
    from kvpolicy.language.models import Topology
    from kvpolicy.planning.engine import make_plan
    from kvpolicy.sim import build_model

    model = build_model(archetype, tp, model_name="m", blocks_needed=8, dcp_size=dcp)
    plan = make_plan(load_policy("default"), model.layout, Topology(tp_size=tp, dcp_size=dcp))
    expected = [model.group_block_size(group.index) for group in plan.groups]
    assert [group.chunk_tokens for group in plan.groups] == expected and expected[0] == 16 * dcp
