"""The policy is read once, at start-up: editing or deleting the file afterwards changes nothing.

What this proves, and what it does not: ``KVPolicyConnector.__init__`` calls ``resolve_policy``
once and hands the resulting ``Policy`` object to its worker, which plans from that object. These
tests resolve a policy file the way the connector does, then edit or delete the file, and show
that the resolved policy, a plan already built from it, and a plan the store worker builds from it
afterwards are all unchanged — nothing on those paths goes back to the file. They do not run a
vLLM engine for hours; they check the objects that engine would hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import NoPublishedDemotions, planning_worker, require

require("vllm")

from pydantic import ValidationError  # noqa: E402

from kvpolicy.documents.loader import load_layout, policies_dir  # noqa: E402
from kvpolicy.language.models import Topology  # noqa: E402
from kvpolicy.planning.engine import make_plan  # noqa: E402
from kvpolicy.planning.plan import Plan  # noqa: E402
from kvpolicy.sim import build_model  # noqa: E402
from kvpolicy.vllm.connector import POLICY_KEY, resolve_policy  # noqa: E402

LAYOUT = "kimi-linear-48b-a3b"
TOPOLOGY = Topology(tp_size=4)


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text((policies_dir() / "default.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    return path


def no_dedup_under_the_same_name() -> str:
    # Every group sharded: a plan from this file differs from default's in every replicated group.
    text = (policies_dir() / "no-dedup.yaml").read_text(encoding="utf-8")
    return text.replace("name: no-dedup", "name: default")


def test_a_resolved_policy_keeps_its_rules_when_the_file_is_rewritten(policy_file: Path) -> None:
    policy = resolve_policy({POLICY_KEY: str(policy_file)})
    before = policy.model_dump(mode="json")
    policy_file.write_text(no_dedup_under_the_same_name(), encoding="utf-8")
    assert policy.model_dump(mode="json") == before
    # The rewrite is real: resolving the file again now gives other rules.
    assert resolve_policy({POLICY_KEY: str(policy_file)}).model_dump(mode="json") != before


def test_a_plan_built_before_the_file_changes_stays_the_same(policy_file: Path) -> None:
    policy = resolve_policy({POLICY_KEY: str(policy_file)})
    layout = load_layout(LAYOUT)
    built = make_plan(policy, layout, TOPOLOGY)
    factors = built.factors
    policy_file.write_text(no_dedup_under_the_same_name(), encoding="utf-8")
    assert built.factors == factors and max(factors) == 4  # the MLA group is replicated over TP 4
    assert make_plan(policy, layout, TOPOLOGY) == built
    policy_file.unlink()
    assert make_plan(policy, layout, TOPOLOGY) == built


def test_plans_and_policies_cannot_be_changed_in_place(policy_file: Path) -> None:
    policy = resolve_policy({POLICY_KEY: str(policy_file)})
    built: Plan = make_plan(policy, load_layout(LAYOUT), TOPOLOGY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.groups[0].factor = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.groups[0].ranks[1].schedule.step = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        policy.rules[0].replication = None  # type: ignore[misc]
    assert isinstance(built.groups, tuple) and isinstance(policy.rules, tuple)


def test_the_store_worker_plans_from_the_policy_it_was_given_after_the_file_is_gone(policy_file: Path) -> None:
    # The connector resolves the policy once and passes the object to KVPolicyStoreWorker, which
    # plans from it on a real KVCacheConfig.
    policy = resolve_policy({POLICY_KEY: str(policy_file)})
    model = build_model("kimi-linear", 4, model_name="moonshotai/Kimi-Linear-48B-A3B", blocks_needed=8)
    worker = planning_worker(policy, model, NoPublishedDemotions())  # rank 0 of TP 4
    first = worker._group_tp_replication_factors
    planned = worker.plan
    policy_file.unlink()
    assert worker._compute_group_tp_replication_factors() == first == (1, 4)  # KDA state, MLA
    assert worker.plan == planned and worker.plan.policy == "default"
