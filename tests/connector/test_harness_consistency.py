"""Multi-rank byte consistency, on vLLM's real store worker objects and a real Mooncake master.

Each case saves a 256-token prompt from a cold TP instance and loads it into a new warm one
(:func:`kvpolicy.sim.run_consistency`, every rank a ``KVPolicyStoreWorker``); the master's counters
measure what was written.
Runs are memoised per module, so tests that look at the same run from different angles share it.
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
from kvpolicy.sim import ARCHETYPES, BLOCK_SIZE, ConsistencyReport, run_consistency  # noqa: E402

TP_SIZES = (2, 4)
NUM_TOKENS = 256
# The lookup keeps the last token for sampling: the longest block-aligned prefix below the prompt.
EXPECTED_HIT = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
PRE_FIX = Path(__file__).resolve().parents[2] / "examples" / "policies" / "pre-fix-single-factor.yaml"
POLICIES = {
    "default": "default",
    "vllm-compat": "vllm-compat",
    "no-dedup": "no-dedup",
    "pre-fix": str(PRE_FIX),
}
HYBRIDS_WITH_STATE = ("kimi-linear", "gqa-mamba")

Run = Callable[..., ConsistencyReport]


@pytest.fixture(scope="module")
def run(mooncake_master: MooncakeMaster, clients: ClientPool) -> Run:
    policies = {name: load_policy(source) for name, source in POLICIES.items()}
    reports: dict[tuple[str, str, int, bool], ConsistencyReport] = {}

    def run(policy: str, archetype: str, tp_size: int, *, save: bool = True) -> ConsistencyReport:
        key = (policy, archetype, tp_size, save)
        if key not in reports:
            reports[key] = run_consistency(
                policies[policy], archetype, tp_size, master=mooncake_master, num_tokens=NUM_TOKENS,
                clients=clients, save=save,
            )
        return reports[key]

    return run


def describe(report: ConsistencyReport) -> str:
    return "\n".join(
        f"  group {g.index} {g.name}: factor {g.factor}, true factor {g.true_factor}, "
        f"mismatched ranks {list(g.mismatched_ranks)}, {g.blocks_checked} blocks checked"
        for g in report.groups
    )


def checkpoint_writer(report: ConsistencyReport, group: int) -> int:
    """The rank that wrote the state the warm instance loads: the striped schedule gives chunk ``i``
    of group ``g`` to the rank whose phase ``(rank + g) % factor`` is ``i % factor``."""
    factor = report.groups[group].factor
    chunk = report.hit_tokens // BLOCK_SIZE - 1
    (writer,) = [rank for rank in range(report.tp_size) if (rank + group) % factor == chunk % factor]
    return writer


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("archetype", ARCHETYPES)
@pytest.mark.parametrize("policy", ["default", "vllm-compat"])
def test_every_rank_loads_its_own_bytes(run: Run, policy: str, archetype: str, tp_size: int) -> None:
    report = run(policy, archetype, tp_size)
    assert all(group.blocks_checked for group in report.groups), f"nothing was loaded:\n{describe(report)}"
    assert report.consistent, f"{policy} on {archetype} at tp {tp_size}:\n{describe(report)}"


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("archetype", HYBRIDS_WITH_STATE)
def test_pre_fix_policy_corrupts_only_the_recurrent_state(run: Run, archetype: str, tp_size: int) -> None:
    report = run("pre-fix", archetype, tp_size)
    assert [group.name for group in report.groups if not group.consistent] == ["mamba"], describe(report)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("archetype", HYBRIDS_WITH_STATE)
def test_pre_fix_state_mismatch_names_every_rank_but_the_writer(run: Run, archetype: str, tp_size: int) -> None:
    report = run("pre-fix", archetype, tp_size)
    state = report.group("mamba")
    writer = checkpoint_writer(report, state.index)
    assert state.mismatched_ranks == tuple(rank for rank in range(tp_size) if rank != writer), describe(report)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("archetype", ARCHETYPES)
def test_default_writes_each_unique_byte_once(run: Run, archetype: str, tp_size: int) -> None:
    report = run("default", archetype, tp_size)
    assert (report.bytes_written, report.write_amplification) == (report.unique_bytes, 1.0)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("archetype", ARCHETYPES)
def test_master_object_count_matches_the_keys_the_ranks_put(run: Run, archetype: str, tp_size: int) -> None:
    report = run("default", archetype, tp_size)
    assert report.objects_written == sum(group.objects_written for group in report.groups) > 0


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("archetype", ARCHETYPES)
def test_no_dedup_writes_true_factor_times_the_default(run: Run, archetype: str, tp_size: int) -> None:
    default, no_dedup = run("default", archetype, tp_size), run("no-dedup", archetype, tp_size)
    assert [group.bytes_written for group in no_dedup.groups] == [
        group.true_factor * group.bytes_written for group in default.groups
    ]


@pytest.mark.parametrize("archetype", ARCHETYPES)
def test_no_dedup_amplification_is_the_true_factor_per_group(run: Run, archetype: str) -> None:
    report = run("no-dedup", archetype, 4)
    assert [group.bytes_written / group.unique_bytes for group in report.groups] == [
        float(group.true_factor) for group in report.groups
    ]


@pytest.mark.parametrize("archetype", ARCHETYPES)
def test_warm_instance_reports_a_hit(run: Run, archetype: str) -> None:
    assert run("default", archetype, 2).hit_tokens == EXPECTED_HIT


def test_cold_store_reports_no_hit(run: Run) -> None:
    report = run("default", "kimi-linear", 2, save=False)
    assert (report.hit_tokens, report.objects_written) == (0, 0)


def test_fresh_clients_without_a_pool_are_consistent(mooncake_master: MooncakeMaster) -> None:
    # The CLI's path: the run opens its own 2 * tp clients and closes them (~2 s each).
    report = run_consistency(load_policy("default"), "kimi-linear", 2, master=mooncake_master, num_tokens=NUM_TOKENS)
    assert report.consistent and report.hit_tokens == EXPECTED_HIT
