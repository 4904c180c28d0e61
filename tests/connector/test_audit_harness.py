"""The replication audit on vLLM's real store worker objects and a real Mooncake master.

The simulation (:mod:`kvpolicy.sim`) runs ``KVPolicyStoreWorker`` on every rank, so the cold save
is the connector's audited step (:mod:`kvpolicy.vllm.audit`): the ranks digest the blocks they are
about to save, a disagreeing group is demoted and published, and a new warm instance starts with
the demotion and loads what the cold one saved.
The deliberately wrong policy calls attention replicated; on archetypes whose ranks hold distinct
heads it must be caught (warn) or stop the instance (enforce), and with the audit off it must
corrupt the warm load — proof that the simulation can see the difference.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from conftest import planning_worker, require

require("vllm")
require("mooncake.store")

import torch  # noqa: E402
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, get_kv_quant_mode  # noqa: E402

from kvpolicy.device.blocks import BlockReader, tensor_distance  # noqa: E402
from kvpolicy.documents.loader import load_layout, load_policy  # noqa: E402
from kvpolicy.evidence.audit import (  # noqa: E402
    DEMOTION_MESSAGE_LIMIT,
    FLOAT_MANTISSA_BITS,
    AuditState,
    AuditStatus,
    Digest,
    ReplicationAuditError,
    agreement_key,
    demotion_key,
    relative_distance,
    rounding_tolerance,
)
from kvpolicy.language.models import Audit, AuditMode, Policy, Topology  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.planning.engine import make_plan  # noqa: E402
from kvpolicy.runtime import markers  # noqa: E402
from kvpolicy.runtime.policy import status_document  # noqa: E402
from kvpolicy.sim import (  # noqa: E402
    ARCHETYPES,
    BLOCK_SIZE,
    ConsistencyReport,
    Fleet,
    build_model,
    content,
    run_consistency,
    scheduler,
)
from kvpolicy.sim.archetypes import Archetype  # noqa: E402
from kvpolicy.vllm import audit as online_audit  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WRONG = REPO / "examples" / "policies" / "wrong-attention-replicated.yaml"
PRE_FIX = REPO / "examples" / "policies" / "pre-fix-single-factor.yaml"
NUM_TOKENS = 256
EXPECTED_HIT = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
# Archetypes whose attention heads are distinct per rank at TP=2 (2 KV heads), so "replicated" is wrong.
DISTINCT_HEADS = ("sliding-window-full",)
HYBRIDS_WITH_STATE = ("kimi-linear", "gqa-mamba")

Run = Callable[..., ConsistencyReport]


def with_audit(policy: Policy, mode: AuditMode) -> Policy:
    """``policy`` with another audit mode, keeping the rules' file:line origins."""
    origins = tuple(policy.rule_origin(index) for index in range(len(policy.rules)))
    return policy.model_copy(update={"audit": Audit(mode=mode, steps=policy.audit.steps or 4)}).with_origins(origins)


@pytest.fixture(scope="module")
def run(mooncake_master: MooncakeMaster, clients: ClientPool) -> Run:
    policies = {"wrong": load_policy(WRONG), "pre-fix": load_policy(PRE_FIX)}
    policies["wrong-warn"] = with_audit(policies["wrong"], AuditMode.WARN)
    policies["wrong-enforce"] = with_audit(policies["wrong"], AuditMode.ENFORCE)
    reports: dict[tuple[str, str, int, bool | None], ConsistencyReport] = {}

    def run(policy: str, archetype: str, tp_size: int, *, audit: bool | None = None) -> ConsistencyReport:
        key = (policy, archetype, tp_size, audit)
        if key not in reports:
            source = policies.get(policy) or load_policy(policy)
            reports[key] = run_consistency(
                source, archetype, tp_size, master=mooncake_master, num_tokens=NUM_TOKENS, clients=clients, audit=audit
            )
        return reports[key]

    return run


def describe(report: ConsistencyReport) -> str:
    return "\n".join(
        f"  group {g.index} {g.name}: declared {g.declared_factor}, used {g.factor}, true {g.true_factor}, "
        f"audit {g.audit}, mismatched ranks {list(g.mismatched_ranks)}, {g.blocks_checked} blocks checked"
        for g in report.groups
    )


# --- a wrong policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("archetype", DISTINCT_HEADS)
def test_wrong_policy_with_audit_warn_loads_correct_bytes(run: Run, archetype: str) -> None:
    report = run("wrong-warn", archetype, 2)
    assert report.hit_tokens == EXPECTED_HIT and not report.warm_gated
    assert all(group.blocks_checked for group in report.groups), describe(report)
    assert report.consistent, describe(report)


@pytest.mark.parametrize("archetype", DISTINCT_HEADS)
def test_wrong_policy_with_audit_warn_demotes_every_wrongly_replicated_group(run: Run, archetype: str) -> None:
    report = run("wrong-warn", archetype, 2)
    assert [(g.audit, g.declared_factor, g.factor) for g in report.groups] == [("demoted", 2, 1)] * len(report.groups)


@pytest.mark.parametrize("archetype", DISTINCT_HEADS)
def test_the_mismatch_report_names_group_rule_location_and_ranks(run: Run, archetype: str) -> None:
    report = run("wrong-warn", archetype, 2)
    for group in report.groups:
        assert f"group {group.index} ({group.name})" in group.audit_message
        assert f"'attention-replicated' ({WRONG}:" in group.audit_message
        assert "ranks 0,1" in group.audit_message


@pytest.mark.parametrize("archetype", DISTINCT_HEADS)
def test_the_connector_stats_count_the_audited_step_and_the_demoted_groups(run: Run, archetype: str) -> None:
    stats = run("wrong-warn", archetype, 2).audit_stats
    assert stats["kvpolicy_audit_count"] == 1
    assert stats["kvpolicy_audit_failed_keys"] == stats["kvpolicy_audit_demoted_count"] == 2


@pytest.mark.parametrize("archetype", DISTINCT_HEADS)
def test_wrong_policy_with_audit_off_loads_wrong_bytes(run: Run, archetype: str) -> None:
    report = run("wrong", archetype, 2)  # the file says audit: off
    assert not report.audited and report.hit_tokens == EXPECTED_HIT
    assert not report.consistent, describe(report)
    assert {group.audit for group in report.groups} == {"off"}


@pytest.mark.parametrize("archetype", DISTINCT_HEADS)
def test_audit_false_skips_the_audit_of_a_warn_policy(run: Run, archetype: str) -> None:
    report = run("wrong-warn", archetype, 2, audit=False)
    assert not report.audited and not report.consistent


@pytest.mark.parametrize("archetype", DISTINCT_HEADS)
def test_audit_enforce_stops_with_the_mismatch_error(run: Run, archetype: str) -> None:
    with pytest.raises(ReplicationAuditError) as stopped:
        run("wrong-enforce", archetype, 2)
    message = str(stopped.value)
    assert "replication audit: group 0" in message and f"({WRONG}:" in message and "ranks 0,1" in message


@pytest.mark.parametrize("tp_size", (2, 4))
@pytest.mark.parametrize("archetype", HYBRIDS_WITH_STATE)
def test_pre_fix_policy_with_audit_demotes_only_the_state_group(run: Run, archetype: str, tp_size: int) -> None:
    report = run("pre-fix", archetype, tp_size, audit=True)
    assert [group.name for group in report.groups if group.audit == "demoted"] == ["mamba"], describe(report)
    assert report.consistent, describe(report)


# --- correct policies: no false alarm ------------------------------------------------------------


@pytest.mark.parametrize("tp_size", (2, 4))
@pytest.mark.parametrize("archetype", ARCHETYPES)
@pytest.mark.parametrize("policy", ["default", "vllm-compat"])
def test_a_correct_policy_never_triggers_the_audit(run: Run, policy: str, archetype: str, tp_size: int) -> None:
    report = run(policy, archetype, tp_size, audit=True)
    assert report.audited
    assert [group.audit for group in report.groups] == [
        "agreed" if group.factor > 1 else "-" for group in report.groups
    ], describe(report)
    assert [group.factor for group in report.groups] == [group.declared_factor for group in report.groups]
    assert report.audit_stats.get("kvpolicy_audit_failed_keys", 0) == 0
    assert "kvpolicy_audit_demoted_count" not in report.audit_stats


@pytest.mark.parametrize("archetype", ARCHETYPES)
def test_after_an_agreeing_audit_a_fresh_instance_hits(run: Run, archetype: str) -> None:
    report = run("default", archetype, 4)
    assert not report.warm_gated and report.hit_tokens == EXPECTED_HIT and report.consistent


# --- the lookup gate, on a real store ------------------------------------------------------------


@pytest.fixture
def kimi_plan():
    return make_plan(load_policy("default"), load_layout("kimi-linear-48b-a3b"), Topology(tp_size=4))


def test_the_gate_refuses_a_shared_namespace_no_audit_vouched_for(kimi_plan, clients: ClientPool) -> None:
    state = AuditState(kimi_plan, replan=lambda demoted: kimi_plan)
    (client,) = clients.acquire(1)
    try:
        client.remove(agreement_key(kimi_plan, 3), True)
        assert state.untrusted_groups() == (3,)
        assert not markers.LookupGate().open(state, client)
    finally:
        clients.release([client])


def test_the_gate_opens_on_another_instances_agreement(kimi_plan, clients: ClientPool) -> None:
    state = AuditState(kimi_plan, replan=lambda demoted: kimi_plan)
    (client,) = clients.acquire(1)
    try:
        assert markers.write_agreements(client, kimi_plan, [3]) in (0, 1)
        assert markers.LookupGate().open(state, client)
    finally:
        client.remove(agreement_key(kimi_plan, 3), True)
        clients.release([client])


@pytest.mark.parametrize("verified, opens", [(8, True), (16, True), (2, False)])
def test_the_gate_takes_agreements_over_replica_sets_at_least_as_large_as_its_own(
    kimi_plan, clients: ClientPool, verified: int, opens: bool
) -> None:
    # kimi_plan's MLA group (3) has factor 4: a verified set of 8 ranks contains two sets of 4; a
    # verified pair says nothing about the other two ranks of a set of 4.
    state = AuditState(kimi_plan, replan=lambda demoted: kimi_plan)
    key = agreement_key(kimi_plan, 3, replicas=verified)
    (client,) = clients.acquire(1)
    try:
        client.remove(agreement_key(kimi_plan, 3), True)
        assert client.put(key, b"agreed") == 0
        assert markers.LookupGate().open(state, client) is opens
    finally:
        client.remove(key, True)
        clients.release([client])


def test_the_gate_stays_open_under_audit_off(clients: ClientPool) -> None:
    compat = make_plan(load_policy("vllm-compat"), load_layout("kimi-linear-48b-a3b"), Topology(tp_size=4))
    (client,) = clients.acquire(1)
    try:
        assert markers.LookupGate().open(AuditState(compat, replan=lambda demoted: compat), client)
    finally:
        clients.release([client])


# --- published demotions, on a real store --------------------------------------------------------


def test_written_demotions_are_read_back_with_their_messages(kimi_plan, clients: ClientPool) -> None:
    (client,) = clients.acquire(1)
    long = "replication audit: group 3 (mla) " + "x" * (2 * DEMOTION_MESSAGE_LIMIT)
    try:
        assert markers.write_demotions(client, kimi_plan, {1: "group 1 differs", 3: long}, pp_rank=1) == 2
        found = markers.read_demotions(client, kimi_plan, range(4), pp_rank=1)
        assert found == {1: "group 1 differs", 3: long[:DEMOTION_MESSAGE_LIMIT]}
        assert markers.read_demotions(client, kimi_plan, range(4)) == {}  # another pp rank's namespace
    finally:
        for group in (1, 3):
            client.remove(demotion_key(kimi_plan, group, pp_rank=1), True)
        clients.release([client])


def test_a_demotion_of_one_plan_is_not_read_by_another(kimi_plan, clients: ClientPool) -> None:
    other = make_plan(load_policy("default"), load_layout("kimi-linear-48b-a3b"), Topology(tp_size=4), demoted=[3])
    (client,) = clients.acquire(1)
    try:
        markers.write_demotions(client, kimi_plan, {3: "group 3 differs"})
        assert markers.read_demotions(client, other, [3]) == {}
        assert markers.read_demotions(client, kimi_plan, [3]) == {3: "group 3 differs"}
    finally:
        client.remove(demotion_key(kimi_plan, 3), True)
        clients.release([client])


class _BrokenStore:
    """A store whose every call fails, as a client that lost its master."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def fail(*args: Any) -> Any:
            raise RuntimeError(f"store {name} failed")

        return fail


class _UncertainStore:
    """A store that cannot tell whether keys exist (Mooncake's negative error codes)."""

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [-1] * len(keys)


@pytest.mark.parametrize("store", [_BrokenStore(), _UncertainStore()], ids=["raises", "error-codes"])
def test_a_failing_store_reads_as_no_demotion(kimi_plan, store: Any) -> None:
    assert markers.read_demotions(store, kimi_plan, [3]) == {}


def test_ranks_agree_on_the_union_of_the_demotions_they_read() -> None:
    by_rank = [{0: "rank 0 saw it"}, {}, {0: "rank 2 saw it", 1: "only rank 2"}, None]
    agreed = markers.agree_on_demotions({}, gather=lambda payload: by_rank)
    assert agreed == {0: "rank 0 saw it", 1: "only rank 2"}


# --- a fresh worker starts with the demotions another instance published --------------------------


@pytest.fixture
def wrong_model() -> Iterator[Any]:
    """Two attention groups with distinct heads at TP 2, in a key space of their own."""
    yield build_model(
        "sliding-window-full", 2, model_name=f"kvpolicy-test/inherit-{uuid.uuid4().hex[:12]}", blocks_needed=8
    )


@pytest.fixture
def store_client(clients: ClientPool, wrong_model: Any) -> Iterator[Any]:
    (client,) = clients.acquire(1)
    try:
        yield client
    finally:
        client.remove_by_regex(f".*{wrong_model.name.rsplit('/', 1)[1]}.*", True)
        clients.release([client])


@pytest.fixture
def one_rank_gather() -> list[Any]:
    """What the other TP ranks report in the collective (the test appends to it); rank 0's own
    payload comes first (:func:`gather_with`)."""
    return []


def gather_with(others: list[Any]) -> Callable[[Any], list[Any]]:
    return lambda payload: [payload, *others]


def _demote(worker: Any, group: int) -> None:
    """One audited step of ``worker`` in which ``group``'s two ranks disagree, and rank 0's publishing."""
    state = worker.audit
    outcome = state.conclude([{group: Digest("a", False)}, {group: Digest("b", False)}])
    assert outcome.demoted == (group,)
    worker.runtime.publish_demotions(outcome)


def test_a_fresh_instance_starts_with_every_demotion_the_previous_one_published(
    wrong_model: Any, store_client: Any, one_rank_gather: list[Any], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    policy = with_audit(load_policy(WRONG), AuditMode.WARN)
    previous = planning_worker(policy, wrong_model, store_client, gather=gather_with(one_rank_gather))
    declared = previous.plan
    assert declared.factors == (2, 2) and previous.audit.inherited == {}
    _demote(previous, 0)
    _demote(previous, 1)  # in a later step, under the plan the first demotion produced
    assert previous.audit.plan.factors == (1, 1)

    with caplog.at_level(logging.WARNING, logger="vllm.kvpolicy.runtime.policy"):
        fresh = planning_worker(policy, wrong_model, store_client, gather=gather_with(one_rank_gather))
    assert fresh.plan.fingerprint == previous.audit.plan.fingerprint != declared.fingerprint
    assert fresh.audit.initial_plan.fingerprint == declared.fingerprint
    assert fresh.audit.statuses == {0: AuditStatus.DEMOTED, 1: AuditStatus.DEMOTED}
    assert fresh.audit.groups_to_audit() == ()
    assert fresh._group_tp_replication_factors == (1, 1)  # what upstream's __init__ keys the store with
    messages = previous.audit.history[0].messages + previous.audit.history[1].messages
    assert fresh.audit.inherited == {0: messages[0], 1: messages[1]}
    (line,) = [record.getMessage() for record in caplog.records if "inherited" in record.getMessage()]
    assert "inherited demotion of groups 0,1" in line
    assert f"{declared.fingerprint} -> {fresh.plan.fingerprint}" in line and messages[1] in line

    payload = status_document(fresh.plan, fresh.audit)
    assert payload["audit"]["inherited"] == [
        {"group": 0, "plan": declared.fingerprint, "message": messages[0]},
        {"group": 1, "plan": declared.fingerprint, "message": messages[1]},
    ]
    assert [group["audit"] for group in payload["groups"]] == ["demoted", "demoted"]


def test_a_demotion_only_another_rank_read_is_inherited_by_every_rank(
    wrong_model: Any, store_client: Any, one_rank_gather: list[Any]
) -> None:
    one_rank_gather.append({1: "rank 1 read it"})
    fresh = planning_worker(with_audit(load_policy(WRONG), AuditMode.WARN), wrong_model, store_client, gather=gather_with(one_rank_gather))
    assert fresh.audit.inherited == {1: "rank 1 read it"} and fresh.plan.factors == (2, 1)
    assert fresh.audit.groups_to_audit() == (0,)


def test_enforce_refuses_to_start_after_another_instance_demoted(
    wrong_model: Any, store_client: Any, one_rank_gather: list[Any]
) -> None:
    previous = planning_worker(
        with_audit(load_policy(WRONG), AuditMode.WARN), wrong_model, store_client, gather=gather_with(one_rank_gather)
    )
    _demote(previous, 1)
    with pytest.raises(ReplicationAuditError) as stopped:
        planning_worker(
            with_audit(load_policy(WRONG), AuditMode.ENFORCE), wrong_model, store_client, gather=gather_with(one_rank_gather)
        )
    assert str(stopped.value).startswith(f"another instance of plan {previous.audit.initial_plan.fingerprint} found:")
    assert previous.audit.history[0].messages[0] in str(stopped.value)


def test_audit_off_neither_reads_markers_nor_gathers(wrong_model: Any) -> None:
    def no_gather(payload: Any) -> list[Any]:
        raise AssertionError("audit: off must not gather")

    trusting = planning_worker(load_policy(WRONG), wrong_model, _BrokenStore(), gather=no_gather)  # audit: off
    assert trusting.plan.factors == (2, 2) and trusting.audit.inherited == {}


# --- which blocks, and reading them (real vLLM objects, no store) --------------------------------


def _instance(archetype: str, tp_size: int, num_tokens: int, *, requests: int = 1):
    """A simulated model with ``requests`` prompts' save metadata and a coordinator."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator

    chunks = math.ceil(num_tokens / BLOCK_SIZE)
    model = build_model(archetype, tp_size, model_name="audit-blocks", blocks_needed=1 + 2 * requests * chunks)
    coord = MooncakeStoreCoordinator.from_kv_cache_config(
        model.kv_cache_config, model.vllm_config, model.block_size, model.hash_block_size
    )
    metadata = None
    for index in range(requests):
        tokens = list(range(index * 100_000, index * 100_000 + num_tokens))
        tables = scheduler.block_tables(model, num_tokens, seed=index, salt=f"r{index}", mamba_nulls=True)
        hashes = scheduler.block_hashes(tokens, model.hash_block_size)
        one = scheduler.save_metadata(
            model, tables, hashes, num_tokens, req_id=f"r{index}", store_job_id=index, coord=coord
        )
        if metadata is None:
            metadata = one
        else:
            metadata.add_request(one.requests[0])
    return model, coord, metadata


def test_a_long_prompt_audits_only_its_last_blocks() -> None:
    model, coord, metadata = _instance("mla", 2, 4096)
    blocks = online_audit.blocks_to_audit(metadata, coord, [0])
    (request,) = metadata.requests
    assert blocks == {0: request.block_ids[0][-online_audit.AUDIT_BLOCKS_PER_REQUEST :]}


def test_the_audited_blocks_per_step_are_capped() -> None:
    model, coord, metadata = _instance("mla", 2, 256, requests=online_audit.AUDIT_REQUESTS_PER_STEP + 2)
    blocks = online_audit.blocks_to_audit(metadata, coord, [0])
    assert len(blocks[0]) == online_audit.AUDIT_REQUESTS_PER_STEP * online_audit.AUDIT_BLOCKS_PER_REQUEST


def test_a_state_group_is_audited_through_its_boundary_puts() -> None:
    model, coord, metadata = _instance("kimi-linear", 2, 256)
    (request,) = metadata.requests
    mamba = next(index for index, group in enumerate(coord.kv_cache_groups) if index in coord.mamba_group_ids)
    expected = [put.block_id for put in request.boundary_puts if put.group_id == mamba]
    assert expected and online_audit.blocks_to_audit(metadata, coord, [mamba]) == {mamba: expected[-2:]}


def test_a_step_that_saves_nothing_for_an_audited_group_is_not_audited() -> None:
    model, coord, metadata = _instance("mla", 2, 256)
    (request,) = metadata.requests
    request.can_save = False
    assert online_audit.blocks_to_audit(metadata, coord, [0]) == {}


# --- kvpolicy audit (its own embedded master) ----------------------------------------------------


def test_the_audit_command_fails_a_wrong_policy_naming_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy.app.cli import main

    code = main(["audit", "--policy", str(WRONG), "--archetype", "sliding-window-full", "--tp", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "group 0 full-attention: DEMOTED: factor 2 -> 1" in out
    assert f"'attention-replicated' ({WRONG}:" in out


def test_the_audit_command_passes_a_correct_policy_on_a_layout(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy.app.cli import main

    code = main(["audit", "--policy", "default", "--layout", "deepseek-v3", "--tp", "2", "--format", "json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["passed"]
    assert [group["audit"] for group in payload["groups"]] == ["agreed"]


def test_the_audit_command_demotes_vllm_compat_on_a_model_whose_first_block_has_fewest_heads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # nas-like: blocks of 2, 8, 4 and 8 KV heads, 2 model-wide; at TP 4 vLLM's rule repeats every
    # layer over 2 ranks, though only the first block's heads repeat.
    from kvpolicy.app.cli import main

    code = main(["audit", "--policy", "vllm-compat", "--archetype", "nas-like", "--tp", "4"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DEMOTED: factor 2 -> 1" in out


def test_the_audit_command_names_every_archetype_when_one_is_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy.app.cli import main

    with pytest.raises(SystemExit) as exited:  # a usage error, judged when the command line is parsed
        main(["audit", "--policy", "default", "--archetype", "nas-lik", "--tp", "2"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "unknown archetype 'nas-lik'" in err and "nas-like" in err and "gemma4-like" in err and "mla" in err


# --- replicas equal up to rounding (vLLM's CPU all-reduce at TP=4), on real worker objects ------


def _random_floats(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(tensor.shape, generator=generator).to(tensor.dtype)


def _replicated_ranks(
    master: MooncakeMaster,
    clients: ClientPool,
    archetype: str | Archetype,
    policy_source: str,
    tp_size: int,
    perturb: Callable[[int, torch.Tensor], None],
    *,
    values: Callable[[torch.Tensor, torch.Generator], torch.Tensor] = _random_floats,
    cache_dtype: str | None = None,
):
    """A ``tp_size`` instance of ``archetype`` under a policy, whose KV tensors hold the same
    ``values(tensor, generator)`` on every rank (random floats in the tensor's dtype), then
    ``perturb(rank, tensor)`` per layer tensor; saves once (the audited step of every rank's
    ``KVPolicyStoreWorker.wait_for_save``) and returns the audit's step outcome. ``cache_dtype`` is
    vLLM's cache dtype setting the workers read (``cache_config.cache_dtype``)."""
    policy = with_audit(load_policy(policy_source), AuditMode.WARN)
    with Fleet(archetype, master=master, clients=clients, num_tokens=256) as fleet:
        instance = fleet.instance(policy, tp_size, name="rounding")
        if cache_dtype is not None:
            # The workers' own CacheConfig object, set as a GPU engine's would be; vLLM's CPU platform takes no
            # fp8 setting when the config is built.
            instance.model.vllm_config.cache_config.cache_dtype = cache_dtype
        for rank in instance.ranks:
            generator = torch.Generator().manual_seed(7)  # the same values on every rank
            for value in rank.kv_caches.values():
                for tensor in content.layer_tensors(value):
                    tensor.copy_(values(tensor, generator))
                    perturb(rank.tp_rank, tensor)
        instance.save(fill=False)
        assert instance.audit is not None
        (outcome,) = instance.audit.history
        return outcome


def _last_bit(rank: int, tensor: torch.Tensor) -> None:
    # What a rank-dependent summation order does to a replica: the last mantissa bit of some values.
    if rank % 2:
        bits = tensor.view(torch.int16)
        bits[..., ::3] ^= 1


def _other_values(rank: int, tensor: torch.Tensor) -> None:
    if rank == 2:
        tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(99)).to(tensor.dtype))


# Under the pre-fix rule the KDA state group is audited too (vLLM registers its pages as raw
# int8, so its values are compared per byte).
ROUNDING_CASES = [("mla", "default"), ("kimi-linear", str(PRE_FIX))]


@pytest.mark.parametrize("archetype, policy", ROUNDING_CASES)
def test_replicas_that_differ_only_by_rounding_agree(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, policy: str
) -> None:
    outcome = _replicated_ranks(mooncake_master, clients, archetype, policy, 4, _last_bit)
    assert outcome.audits and all(
        audit.verdict.value == "agreed" and 0 < audit.distance < 0.02 for audit in outcome.audits
    ), outcome.audits
    assert not outcome.plan_changed


@pytest.mark.parametrize("archetype, policy", ROUNDING_CASES)
def test_replicas_with_other_values_disagree_despite_the_tolerance(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, policy: str
) -> None:
    outcome = _replicated_ranks(mooncake_master, clients, archetype, policy, 4, _other_values)
    assert outcome.audits and outcome.demoted == tuple(audit.group for audit in outcome.audits)


def test_a_layer_with_states_of_several_dtypes_is_read_per_state() -> None:
    # vLLM hands a Mamba layer over as typed views of one raw page per block (conv bf16, ssm float32).
    blocks, page = 4, 64
    raw = torch.zeros(blocks * page, dtype=torch.int8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (blocks, 4), (page // 2, 1), 0)
    ssm = torch.as_strided(raw.view(torch.float32), (blocks, 8), (page // 4, 1), 2)
    conv.copy_(torch.arange(16, dtype=torch.float32).view(blocks, 4))
    ssm.copy_(-torch.arange(32, dtype=torch.float32).view(blocks, 8) / 8)
    reader = BlockReader({"layer.0": [conv, ssm]})
    values = reader.values(None, [2, 1], reader.tensors(["layer.0"]))  # type: ignore[arg-type]
    expected = torch.cat([conv[[2, 1]].float().reshape(-1), ssm[[2, 1]].reshape(-1)])
    assert torch.equal(values, expected)


def test_the_vectorised_distance_is_the_pure_one() -> None:
    from array import array

    from kvpolicy.evidence.audit import relative_distance

    generator = torch.Generator().manual_seed(3)
    a = array("f", torch.randn(1000, generator=generator).tolist())
    b = array("f", (torch.tensor(a) + 1e-3 * torch.randn(1000, generator=generator)).tolist())
    b[5] = a[5] = float("nan")
    assert tensor_distance(a, b) == pytest.approx(relative_distance(a, b), rel=1e-9)
    assert tensor_distance(array("f", [2.0] * 10), array("f", [0.0] * 10)) == 1.0
    assert math.isnan(tensor_distance(a, array("f", [0.0] * 1000)))  # NaN against a number


# --- fp8 caches, stored as uint8 as vLLM allocates them, on real worker objects --------------------

FP8 = [("fp8_e4m3", "float8_e4m3fn", 0x7E), ("fp8_e5m2", "float8_e5m2", 0x7B)]
"""(cache dtype, the fp8 type its bytes are, the largest finite magnitude code of that type)."""
DS_MLA_BYTES_PER_TOKEN = 656


def _mla_archetype(cache_dtype: str) -> Archetype:
    """The ``mla`` archetype (its latent replicated on every rank) with its layers' specs as vLLM's
    ``MLAAttention.get_kv_cache_spec`` builds them under ``cache_dtype``."""
    packed = cache_dtype == "fp8_ds_mla"

    def spec(tp_size: int) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=576 if packed else 96,
            dtype=STR_DTYPE_TO_TORCH_DTYPE[cache_dtype],
            cache_dtype_str=cache_dtype,
            kv_quant_mode=get_kv_quant_mode(cache_dtype),
            state_content_bytes=DS_MLA_BYTES_PER_TOKEN if packed else None,
        )

    return dataclasses.replace(ARCHETYPES["mla"], name=f"mla-{cache_dtype}", kinds=MappingProxyType({"mla": spec}))


def _per_token_head_archetype() -> Archetype:
    """GQA whose single KV head every rank repeats (``gqa-kv-lt-tp`` at TP 2), its layers' specs as
    vLLM's ``Attention.get_kv_cache_spec`` builds them under ``fp8_per_token_head``."""

    def spec(tp_size: int) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=64,
            dtype=STR_DTYPE_TO_TORCH_DTYPE["fp8_per_token_head"],
            kv_quant_mode=get_kv_quant_mode("fp8_per_token_head"),
        )

    base = ARCHETYPES["gqa-kv-lt-tp"]
    return dataclasses.replace(base, name="gqa-fp8_per_token_head", kinds=MappingProxyType({"attn": spec}))


def _fp8_codes(element: str) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """Random normal values rounded to ``element``, as the uint8 codes vLLM stores."""
    dtype = getattr(torch, element)
    return lambda tensor, generator: torch.randn(tensor.shape, generator=generator).to(dtype).view(torch.uint8)


def _fp8_codes_with_tiny_values(element: str) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """:func:`_fp8_codes`, with every 4th value +0 (code 0x00) and every 8th the smallest subnormal (0x01)."""
    random = _fp8_codes(element)

    def values(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        codes = random(tensor, generator).reshape(-1)
        codes[::4] = 0x00
        codes[1::8] = 0x01
        return codes.reshape(tensor.shape)

    return values


def _nothing(rank: int, tensor: torch.Tensor) -> None:
    pass


def _ulps_away_from_zero(steps: int, largest: int) -> Callable[[int, torch.Tensor], None]:
    """Rank 1's values moved ``steps`` representable values away from zero, all that stay finite
    (fp8 is sign-magnitude: the code plus ``steps`` for either sign)."""

    def perturb(rank: int, tensor: torch.Tensor) -> None:
        if rank == 1:
            tensor[(tensor & 0x7F) + steps <= largest] += steps

    return perturb


def _other_fp8_values(element: str) -> Callable[[int, torch.Tensor], None]:
    codes = _fp8_codes(element)

    def perturb(rank: int, tensor: torch.Tensor) -> None:
        if rank == 1:
            tensor.copy_(codes(tensor, torch.Generator().manual_seed(99)))

    return perturb


def _flip_tiny_signs(rank: int, tensor: torch.Tensor) -> None:
    # +0 becomes -0 (0x80) and the smallest subnormal its negative (0x81) on rank 1: codes 128 apart.
    if rank == 1:
        tensor[(tensor & 0x7F) <= 0x01] ^= 0x80


@pytest.mark.parametrize("cache_dtype, element, largest", FP8)
def test_fp8_replicas_with_equal_bytes_agree(
    mooncake_master: MooncakeMaster, clients: ClientPool, cache_dtype: str, element: str, largest: int
) -> None:
    outcome = _replicated_ranks(
        mooncake_master, clients, _mla_archetype(cache_dtype), "default", 2, _nothing, values=_fp8_codes(element)
    )
    assert [(audit.verdict.value, audit.distance) for audit in outcome.audits] == [("agreed", 0.0)]


@pytest.mark.parametrize("cache_dtype, element, largest", FP8)
def test_fp8_replicas_holding_distinct_shards_are_told_apart(
    mooncake_master: MooncakeMaster, clients: ClientPool, cache_dtype: str, element: str, largest: int
) -> None:
    outcome = _replicated_ranks(
        mooncake_master, clients, _mla_archetype(cache_dtype), "default", 2, _other_fp8_values(element),
        values=_fp8_codes(element),
    )
    assert outcome.audits and outcome.demoted == tuple(audit.group for audit in outcome.audits)
    assert "exact digests" not in outcome.messages[0]  # values were compared, and were too far apart


@pytest.mark.parametrize("cache_dtype, element, largest", FP8)
def test_fp8_replicas_one_ulp_apart_everywhere_agree_within_one_ulp(
    mooncake_master: MooncakeMaster, clients: ClientPool, cache_dtype: str, element: str, largest: int
) -> None:
    outcome = _replicated_ranks(
        mooncake_master, clients, _mla_archetype(cache_dtype), "default", 2, _ulps_away_from_zero(1, largest),
        values=_fp8_codes(element),
    )
    (audit,) = outcome.audits
    # Each value moved by one ulp, 2**-(m+1) to 2**-m of it (m mantissa bits): so is their relative distance.
    # (As byte codes they would be 0.008 apart.)
    ulp = 2.0 ** -FLOAT_MANTISSA_BITS[element]
    assert audit.verdict.value == "agreed" and ulp / 2 <= audit.distance <= ulp == rounding_tolerance(element)
    assert not outcome.plan_changed


@pytest.mark.parametrize("cache_dtype, element, largest", FP8)
def test_fp8_replicas_two_ulps_apart_everywhere_disagree(
    mooncake_master: MooncakeMaster, clients: ClientPool, cache_dtype: str, element: str, largest: int
) -> None:
    # Read as byte codes these would be 0.015 apart and pass the 0.1 tolerance: they are compared as fp8 values.
    outcome = _replicated_ranks(
        mooncake_master, clients, _mla_archetype(cache_dtype), "default", 2, _ulps_away_from_zero(2, largest),
        values=_fp8_codes(element),
    )
    assert outcome.audits and outcome.demoted == tuple(audit.group for audit in outcome.audits)


@pytest.mark.parametrize("cache_dtype, element, largest", FP8)
def test_fp8_sign_flips_of_zero_and_tiny_values_are_compared_as_the_numbers_they_are(
    mooncake_master: MooncakeMaster, clients: ClientPool, cache_dtype: str, element: str, largest: int
) -> None:
    values = _fp8_codes_with_tiny_values(element)
    codes = values(torch.empty(4096, dtype=torch.uint8), torch.Generator().manual_seed(7))
    flipped = codes.clone()
    _flip_tiny_signs(1, flipped)
    # As byte codes, 3 in 8 values jump by 128: far beyond any tolerance.
    assert relative_distance(codes.float().tolist(), flipped.float().tolist()) > 0.5
    outcome = _replicated_ranks(
        mooncake_master, clients, _mla_archetype(cache_dtype), "default", 2, _flip_tiny_signs, values=values
    )
    (audit,) = outcome.audits
    assert audit.verdict.value == "agreed" and 0 < audit.distance < 0.01


@pytest.mark.parametrize(
    "archetype, cache_dtype",
    [(_mla_archetype("fp8_ds_mla"), "fp8_ds_mla"), (_per_token_head_archetype(), "fp8_per_token_head")],
    ids=["fp8_ds_mla", "fp8_per_token_head"],
)
def test_caches_with_scales_in_their_blocks_agree_only_on_identical_bytes(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: Archetype, cache_dtype: str
) -> None:
    values = _fp8_codes("float8_e4m3fn")
    same = _replicated_ranks(mooncake_master, clients, archetype, "default", 2, _nothing, values=values, cache_dtype=cache_dtype)
    assert [audit.verdict.value for audit in same.audits] == ["agreed"]
    one_ulp = _replicated_ranks(
        mooncake_master, clients, archetype, "default", 2, _ulps_away_from_zero(1, 0x7E), values=values,
        cache_dtype=cache_dtype,
    )
    assert one_ulp.audits and one_ulp.demoted == tuple(audit.group for audit in one_ulp.audits)
    (message,) = one_ulp.messages
    assert f"compared by exact digests only: the '{cache_dtype}' KV cache keeps quantization scales" in message
