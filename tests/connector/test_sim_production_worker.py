"""The simulation runs the production connector: every rank is a ``KVPolicyStoreWorker``, so the
replication audit, the lookup gate and the put schedule the engine runs are what is judged here,
on every hybrid archetype (MLA+KDA, GQA+GDN, GQA+Mamba2) and an attention-free Mamba2 model (0 KV
heads) at TP 2 and 4."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import BLOCK_SIZE, HYBRIDS, ConsistencyReport, Fleet, run_consistency  # noqa: E402
from kvpolicy.vllm.worker import KVPolicyStoreWorker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WRONG_STATE = REPO / "examples" / "policies" / "wrong-recurrent-replicated.yaml"
NUM_TOKENS = 128
EXPECTED_HIT = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
STATE_MODELS = (*HYBRIDS, "mamba2")
CASES = [pytest.param(archetype, tp, id=f"{archetype}-tp{tp}") for archetype in STATE_MODELS for tp in (2, 4)]

Run = Callable[..., ConsistencyReport]


@pytest.fixture(scope="module")
def run(mooncake_master: MooncakeMaster, clients: ClientPool) -> Run:
    reports: dict[tuple[str, str, int, bool], ConsistencyReport] = {}

    def run(policy: str, archetype: str, tp_size: int, *, save: bool = True) -> ConsistencyReport:
        key = (policy, archetype, tp_size, save)
        if key not in reports:
            reports[key] = run_consistency(
                load_policy(policy), archetype, tp_size, master=mooncake_master, clients=clients,
                num_tokens=NUM_TOKENS, save=save,
            )
        return reports[key]

    return run


def test_every_rank_of_a_simulated_instance_is_the_production_worker(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    with Fleet("kimi-linear", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        instance = fleet.instance(load_policy("default"), 2)
        assert [type(rank.worker) for rank in instance.ranks] == [KVPolicyStoreWorker] * 2
        assert instance.plan is instance.ranks[0].worker.plan


def test_the_consistency_run_and_the_audit_command_build_ranks_through_the_standalone_worker(
    run: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[int] = []
    original = KVPolicyStoreWorker.standalone.__func__  # type: ignore[attr-defined]

    def counted(cls: type[KVPolicyStoreWorker], *args: Any, **kwargs: Any) -> KVPolicyStoreWorker:
        built.append(kwargs["place"].tp_rank)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(KVPolicyStoreWorker, "standalone", classmethod(counted))
    from kvpolicy.app.cli import main

    assert main(["audit", "--policy", "default", "--archetype", "gqa-mamba", "--tp", "2", "--tokens", "64"]) == 0
    capsys.readouterr()
    assert sorted(built) == [0, 0, 1, 1]  # a cold and a warm instance of two ranks


@pytest.mark.parametrize("archetype, tp_size", CASES)
def test_a_hybrid_loads_its_own_bytes_back_under_the_default_policy(run: Run, archetype: str, tp_size: int) -> None:
    report = run("default", archetype, tp_size)
    assert report.hit_tokens == EXPECTED_HIT and report.consistent and not report.warm_gated
    assert all(group.blocks_checked for group in report.groups)


@pytest.mark.parametrize("archetype, tp_size", CASES)
def test_the_audit_agrees_on_every_replicated_group_of_a_hybrid(run: Run, archetype: str, tp_size: int) -> None:
    report = run("default", archetype, tp_size)
    assert [group.audit for group in report.groups] == [
        "agreed" if group.true_factor > 1 else "-" for group in report.groups
    ]
    assert [group.factor for group in report.groups] == [group.true_factor for group in report.groups]


@pytest.mark.parametrize("archetype, tp_size", CASES)
def test_the_put_schedule_writes_each_distinct_shard_once(run: Run, archetype: str, tp_size: int) -> None:
    report = run("default", archetype, tp_size)
    assert report.write_amplification == 1.0 and report.put_failures == 0
    assert [group.bytes_written for group in report.groups] == [group.unique_bytes for group in report.groups]


@pytest.mark.parametrize("archetype, tp_size", CASES)
def test_the_lookup_gate_refuses_replicated_groups_nobody_vouched_for(run: Run, archetype: str, tp_size: int) -> None:
    report = run("default", archetype, tp_size, save=False)
    replicated = any(group.factor > 1 for group in report.groups)
    assert (report.warm_gated, report.hit_tokens) == (replicated, 0)


@pytest.mark.parametrize("archetype, tp_size", CASES)
def test_the_audit_demotes_recurrent_state_declared_replicated(run: Run, archetype: str, tp_size: int) -> None:
    report = run(str(WRONG_STATE), archetype, tp_size)
    states = [group for group in report.groups if group.true_factor == 1 and group.declared_factor > 1]
    assert states and {(group.audit, group.factor) for group in states} == {("demoted", 1)}
    assert report.consistent and report.hit_tokens == EXPECTED_HIT
