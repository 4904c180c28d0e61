"""The audit's per-instance state machine (:class:`kvpolicy.evidence.audit.AuditState`) and its report column.

Every TP rank runs one of these and feeds it the same gathered digests, so what is tested here is
also what keeps the ranks in lockstep: the schedule of audited steps depends on nothing else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from core_support import HYBRID_AUDIT_LAYOUT as LAYOUT
from core_support import full, mla
from core_support import layout as inline_layout

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.documents.report import format_plan_table, plan_to_json
from kvpolicy.evidence.audit import (
    REPLICA_TOLERANCE,
    AuditState,
    AuditStatus,
    Digest,
    ReplicationAuditError,
    Verdict,
    agreement_key,
    demotion_key,
    digest_blocks,
    distances_to_reference,
    relative_distance,
    rounding_tolerance,
    value_comparison,
)
from kvpolicy.language.models import Audit, AuditMode, Topology
from kvpolicy.planning.engine import make_plan

TP = 4
SAME = Digest("d1", all_zero=False)
OTHER = Digest("d2", all_zero=False)
ZERO = digest_blocks([bytes(64)])


@pytest.fixture
def layout(tmp_path: Path):
    path = tmp_path / "layout.yaml"
    path.write_text(LAYOUT)
    return load_layout(path)


def state_for(
    layout, *, mode: AuditMode = AuditMode.WARN, steps: int = 4, inherited: dict[int, str] | None = None
) -> AuditState:
    policy = load_policy("default")
    origins = tuple(policy.rule_origin(index) for index in range(len(policy.rules)))
    policy = policy.model_copy(update={"audit": Audit(mode=mode, steps=steps)}).with_origins(origins)
    first = make_plan(policy, layout, Topology(tp_size=TP))
    return AuditState(
        first,
        replan=lambda demoted: make_plan(policy, layout, Topology(tp_size=TP), demoted=demoted),
        inherited=inherited,
    )


def reports(*digests: Digest) -> list[dict[int, Digest]]:
    return [{0: digest} for digest in digests]


def test_a_fresh_instance_audits_its_replicated_groups_and_does_not_trust_them_yet(layout) -> None:
    state = state_for(layout)
    assert state.statuses == {0: AuditStatus.PENDING, 1: AuditStatus.NOT_NEEDED}
    assert state.groups_to_audit() == (0,) and state.untrusted_groups() == (0,)


def test_agreement_confirms_the_group_and_keeps_the_plan(layout) -> None:
    state = state_for(layout)
    before = state.plan
    outcome = state.conclude(reports(SAME, SAME, SAME, SAME))
    assert outcome.agreed == (0,) and not outcome.plan_changed and state.plan is before
    assert state.statuses[0] is AuditStatus.AGREED and state.untrusted_groups() == ()


def test_disagreement_demotes_the_group_to_factor_one_under_a_new_fingerprint(layout) -> None:
    state = state_for(layout)
    before = state.plan
    outcome = state.conclude(reports(SAME, SAME, OTHER, SAME))
    assert outcome.demoted == (0,) and outcome.plan_changed
    assert state.plan.factors == (1, 1) and state.plan.groups[0].demoted
    assert state.plan.fingerprint != before.fingerprint
    assert state.statuses[0] is AuditStatus.DEMOTED and state.groups_to_audit() == ()


def test_the_demotion_message_names_group_rule_and_ranks(layout) -> None:
    outcome = state_for(layout).conclude(reports(SAME, OTHER, SAME, SAME))
    (message,) = outcome.messages
    assert "group 0 (mla)" in message and "'mla-latent'" in message and "default.yaml:" in message
    assert "ranks 0,1,2,3" in message


def test_enforce_raises_the_message_and_keeps_the_plan(layout) -> None:
    state = state_for(layout, mode=AuditMode.ENFORCE)
    before = state.plan
    with pytest.raises(ReplicationAuditError, match=r"group 0 \(mla\).*ranks 0,1,2,3"):
        state.conclude(reports(SAME, OTHER, SAME, SAME))
    assert state.plan is before


def test_all_zero_blocks_leave_the_group_pending(layout) -> None:
    state = state_for(layout)
    outcome = state.conclude(reports(ZERO, ZERO, ZERO, ZERO))
    assert outcome.agreed == () and outcome.demoted == ()
    assert state.statuses[0] is AuditStatus.PENDING and state.untrusted_groups() == (0,)


def test_a_group_without_evidence_after_the_last_step_is_unverified_and_stays_untrusted(layout) -> None:
    state = state_for(layout, steps=2)
    state.conclude(reports(ZERO, ZERO, ZERO, ZERO))
    outcome = state.conclude(reports(ZERO, ZERO, ZERO, ZERO))
    assert outcome.unverified == (0,) and state.statuses[0] is AuditStatus.UNVERIFIED
    assert state.groups_to_audit() == () and state.untrusted_groups() == (0,)


def test_the_audit_ends_after_the_policys_steps(layout) -> None:
    state = state_for(layout, steps=2)
    state.conclude(reports(SAME, SAME, SAME, SAME))
    assert state.groups_to_audit() == (0,)
    state.conclude(reports(SAME, SAME, SAME, SAME))
    assert state.groups_to_audit() == () and state.steps_done == 2


def test_a_rank_that_could_not_digest_makes_the_step_judge_nothing(layout) -> None:
    state = state_for(layout)
    outcome = state.conclude([{0: SAME}, None, {0: OTHER}, {0: SAME}])
    assert outcome.failed_ranks == (1,) and outcome.audits == () and outcome.demoted == ()
    assert state.statuses[0] is AuditStatus.PENDING and state.steps_done == 1


def test_a_step_needs_every_ranks_report(layout) -> None:
    with pytest.raises(ValueError, match="4 ranks"):
        state_for(layout).conclude(reports(SAME, SAME))


@pytest.mark.parametrize("mode, steps", [(AuditMode.OFF, 4), (AuditMode.WARN, 0)])
def test_audit_off_or_zero_steps_audits_and_gates_nothing(layout, mode: AuditMode, steps: int) -> None:
    state = state_for(layout, mode=mode, steps=steps)
    assert state.groups_to_audit() == () and state.untrusted_groups() == ()
    assert state.statuses[0] is AuditStatus.OFF


def test_an_agreement_marker_vouches_for_one_plan_only(layout) -> None:
    state = state_for(layout)
    trusting = state.plan
    state.conclude(reports(SAME, OTHER, SAME, SAME))
    assert agreement_key(trusting, 0) != agreement_key(state.plan, 0)
    assert trusting.fingerprint in agreement_key(trusting, 0)


def test_the_plan_table_has_an_audit_column(layout) -> None:
    state = state_for(layout)
    assert format_plan_table(state.plan).splitlines()[1].split()[-1] == "audit"
    state.conclude(reports(SAME, OTHER, SAME, SAME))
    rows = format_plan_table(state.plan, audit=state.statuses).splitlines()[3:5]
    assert [row.split()[-1] for row in rows] == ["demoted", "-"]


def test_the_plan_json_carries_each_groups_audit_status(layout) -> None:
    state = state_for(layout)
    state.conclude(reports(SAME, SAME, SAME, SAME))
    payload = json.loads(json.dumps(plan_to_json(state.plan, audit=state.statuses)))
    assert [group["audit"] for group in payload["groups"]] == ["agreed", "-"]


# --- published demotions: a fresh instance starts where the last one fell back ------------------

TWO_REPLICATED = inline_layout(mla(), mla(), full(), heads=4)
"""Groups 0 and 1 replicated over TP (MLA), group 2 sharded."""


def test_an_inherited_demotion_starts_the_group_demoted_and_unaudited(layout) -> None:
    state = state_for(layout, inherited={0: "replication audit: group 0 (mla) ..."})
    assert state.statuses == {0: AuditStatus.DEMOTED, 1: AuditStatus.NOT_NEEDED}
    assert state.plan.factors == (1, 1) and state.plan.groups[0].demoted
    assert state.groups_to_audit() == () and state.untrusted_groups() == () and state.finished
    assert state.inherited == {0: "replication audit: group 0 (mla) ..."}


def test_an_inherited_demotion_leaves_the_other_groups_under_audit() -> None:
    state = state_for(TWO_REPLICATED, inherited={1: "bytes differ"})
    assert state.statuses == {0: AuditStatus.PENDING, 1: AuditStatus.DEMOTED, 2: AuditStatus.NOT_NEEDED}
    assert state.groups_to_audit() == (0,) and state.plan.factors == (4, 1, 1)


def test_inheriting_every_demotion_at_once_reaches_the_plan_of_step_by_step_demotions() -> None:
    # The publishing instance demoted group 0, then group 1, in different steps.
    previous = state_for(TWO_REPLICATED)
    previous.conclude([{0: SAME, 1: SAME}, {0: OTHER, 1: SAME}, {0: SAME, 1: SAME}, {0: SAME, 1: SAME}])
    second = previous.conclude([{1: SAME}, {1: SAME}, {1: OTHER}, {1: SAME}])
    published = {group: message for step in previous.history for group, message in step.demotions.items()}
    assert second.demoted == (1,) and set(published) == {0, 1}
    fresh = state_for(TWO_REPLICATED, inherited=published)
    assert fresh.plan.fingerprint == previous.plan.fingerprint != fresh.initial_plan.fingerprint
    assert fresh.plan == previous.plan


def test_the_initial_plan_is_the_plan_before_any_demotion(layout) -> None:
    state = state_for(layout)
    declared = state.plan
    state.conclude(reports(SAME, OTHER, SAME, SAME))
    assert state.initial_plan is declared and state.plan is not declared
    assert state_for(layout, inherited={0: "x"}).initial_plan.fingerprint == declared.fingerprint


def test_enforce_refuses_to_start_on_an_inherited_demotion_naming_its_source(layout) -> None:
    declared = state_for(layout).plan
    with pytest.raises(ReplicationAuditError) as stopped:
        state_for(layout, mode=AuditMode.ENFORCE, inherited={0: "replication audit: group 0 (mla) differs"})
    assert str(stopped.value) == (
        f"another instance of plan {declared.fingerprint} found: replication audit: group 0 (mla) differs"
    )


@pytest.mark.parametrize("mode, steps", [(AuditMode.OFF, 4), (AuditMode.WARN, 0)])
def test_audit_off_ignores_inherited_demotions_and_keeps_trusting_the_rule(layout, mode: AuditMode, steps: int) -> None:
    state = state_for(layout, mode=mode, steps=steps, inherited={0: "bytes differ"})
    assert state.plan.factors == (4, 1) and state.statuses[0] is AuditStatus.OFF and state.inherited == {}


def test_inherited_demotions_of_groups_that_are_not_audited_are_ignored(layout) -> None:
    state = state_for(layout, inherited={1: "factor 1 already", 7: "no such group"})
    assert state.inherited == {} and state.plan.factors == (4, 1) and state.statuses[0] is AuditStatus.PENDING


def test_the_demotion_key_is_named_for_the_initial_plan_not_the_fallback(layout) -> None:
    state = state_for(layout)
    declared = state.plan
    state.conclude(reports(SAME, OTHER, SAME, SAME))
    key = demotion_key(state.initial_plan, 0)
    assert key == demotion_key(declared, 0) != demotion_key(state.plan, 0)
    assert key.startswith(declared.key_prefix(0, 0)) and key.endswith(f"@{declared.fingerprint}")
    assert key != agreement_key(declared, 0)


def test_demotion_keys_differ_per_group_pcp_pp_and_fingerprint() -> None:
    topology = Topology(tp_size=TP, pcp_size=2, pp_size=2)
    policy = load_policy("default")
    declared = make_plan(policy, TWO_REPLICATED, topology)
    other = make_plan(policy, TWO_REPLICATED, topology, demoted=[1])
    keys = [
        demotion_key(plan, group, pcp_rank=pcp, pp_rank=pp)
        for plan in (declared, other)
        for group in (0, 1)
        for pcp in (0, 1)
        for pp in (0, 1)
    ]
    assert len(set(keys)) == len(keys) == 16


# --- rounding: replicas equal up to the last bits ------------------------------------------------


def test_relative_distance_is_zero_for_equal_values_and_large_for_unrelated_ones() -> None:
    values = [0.5, -1.25, 3.0, 0.0]
    assert relative_distance(values, list(values)) == 0.0
    assert relative_distance(values, [-0.5, 1.25, -3.0, 0.0]) == pytest.approx(2.0)
    assert relative_distance(values, [0.0] * 4) == pytest.approx(1.0)


def test_relative_distance_of_last_bit_rounding_is_far_below_the_tolerance() -> None:
    values = [1.0 + index / 7 for index in range(1000)]
    rounded = [math.nextafter(value, math.inf) if index % 3 else value for index, value in enumerate(values)]
    assert 0 < relative_distance(values, rounded) < 1e-12 < REPLICA_TOLERANCE


def test_nan_against_a_number_is_never_within_tolerance_but_shared_nans_are_ignored() -> None:
    nan = float("nan")
    assert not relative_distance([1.0, nan], [1.0, 2.0]) <= REPLICA_TOLERANCE
    assert relative_distance([1.0, nan], [1.0, nan]) == 0.0


def test_only_groups_whose_digests_differ_need_their_values_compared(layout) -> None:
    state = state_for(layout)
    assert state.groups_needing_values(reports(SAME, SAME, SAME, SAME)) == ()
    assert state.groups_needing_values(reports(SAME, OTHER, SAME, SAME)) == (0,)
    assert state.groups_needing_values([{0: SAME}, None, {0: OTHER}, {0: SAME}]) == ()


def test_values_within_tolerance_agree_despite_different_digests(layout) -> None:
    state = state_for(layout)
    outcome = state.conclude(reports(SAME, OTHER, OTHER, SAME), distances={0: {1: 1e-7, 2: 2e-7, 3: 0.0}})
    (audit,) = outcome.audits
    assert audit.verdict is Verdict.AGREED and audit.distance == pytest.approx(2e-7)
    assert not outcome.plan_changed and state.statuses[0] is AuditStatus.AGREED


def test_values_beyond_tolerance_disagree(layout) -> None:
    outcome = state_for(layout).conclude(reports(SAME, OTHER, SAME, SAME), distances={0: {1: 1.4}})
    assert outcome.demoted == (0,)


def test_a_rank_whose_values_are_missing_cannot_pass_on_closeness(layout) -> None:
    outcome = state_for(layout).conclude(reports(SAME, OTHER, SAME, SAME), distances={0: {}})
    assert outcome.demoted == (0,)


def test_distances_are_measured_against_the_first_rank_of_each_replica_set(layout) -> None:
    state = state_for(layout)
    samples = [{0: [1.0, 2.0]}, {0: [1.0, 2.0]}, {0: [-1.0, -2.0]}, None]
    distances = distances_to_reference(state.plan, samples, [0])
    assert distances == {0: {1: 0.0, 2: pytest.approx(2.0)}}


# --- quantized caches: what the values are, and when only exact digests count ----------------------

E5M2 = value_comparison("fp8_e5m2", stored="uint8", element="float8_e5m2")
PER_TOKEN_HEAD = value_comparison("fp8_per_token_head", stored="uint8", scales_in_block=True)


def test_the_rounding_tolerance_is_one_ulp_of_an_fp8_type_and_the_default_for_wider_types() -> None:
    # 3 and 2 stored mantissa bits: one unit in the last place is 2**-3 and 2**-2 of a value.
    assert rounding_tolerance("float8_e4m3fn") == rounding_tolerance("float8_e4m3fnuz") == 2.0**-3
    assert rounding_tolerance("float8_e5m2") == 2.0**-2
    assert rounding_tolerance("bfloat16") == rounding_tolerance("float32") == REPLICA_TOLERANCE


def test_bytes_vllm_names_an_fp8_type_for_are_compared_in_it() -> None:
    assert (E5M2.element, E5M2.exact, E5M2.tolerance) == ("float8_e5m2", False, 2.0**-2)


def test_a_cache_stored_in_a_float_type_is_compared_in_it() -> None:
    found = value_comparison("auto", stored="bfloat16")
    assert (found.element, found.exact, found.tolerance) == ("bfloat16", False, REPLICA_TOLERANCE)


def test_codes_of_no_known_number_type_are_compared_by_exact_digests() -> None:
    found = value_comparison("fp8", stored="uint8")
    assert found.exact and found.element is None and "uint8 codes" in found.reason


def test_scales_in_the_block_require_exact_digests_whatever_the_stored_type() -> None:
    assert PER_TOKEN_HEAD.exact and "scales inside its blocks" in PER_TOKEN_HEAD.reason
    assert value_comparison("custom", stored="float16", scales_in_block=True).exact


def test_a_group_compared_by_exact_digests_is_never_sampled(layout) -> None:
    state = state_for(layout)
    assert state.groups_needing_values(reports(SAME, OTHER, SAME, SAME), {0: PER_TOKEN_HEAD}) == ()
    assert state.groups_needing_values(reports(SAME, OTHER, SAME, SAME), {0: E5M2}) == (0,)


def test_a_group_compared_by_exact_digests_is_demoted_however_close_its_values_and_the_error_says_why(layout) -> None:
    outcome = state_for(layout).conclude(
        reports(SAME, OTHER, SAME, SAME), distances={0: {1: 0.0}}, comparisons={0: PER_TOKEN_HEAD}
    )
    assert outcome.demoted == (0,)
    (message,) = outcome.messages
    assert "compared by exact digests only" in message and PER_TOKEN_HEAD.reason in message


def test_equal_digests_agree_under_exact_comparison(layout) -> None:
    outcome = state_for(layout).conclude(reports(SAME, SAME, SAME, SAME), comparisons={0: PER_TOKEN_HEAD})
    assert [audit.verdict for audit in outcome.audits] == [Verdict.AGREED]


def test_each_group_is_judged_within_its_own_types_tolerance(layout) -> None:
    # 0.2 is beyond the default 0.1 but within one ulp of e5m2 (0.25); 0.3 is beyond both.
    within = state_for(layout).conclude(reports(SAME, OTHER, SAME, SAME), distances={0: {1: 0.2}}, comparisons={0: E5M2})
    assert within.audits[0].verdict is Verdict.AGREED and within.audits[0].distance == 0.2
    beyond = state_for(layout).conclude(reports(SAME, OTHER, SAME, SAME), distances={0: {1: 0.3}}, comparisons={0: E5M2})
    assert beyond.demoted == (0,) and "exact digests" not in beyond.messages[0]
    default = state_for(layout).conclude(reports(SAME, OTHER, SAME, SAME), distances={0: {1: 0.2}})
    assert default.demoted == (0,)
