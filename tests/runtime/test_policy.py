"""One rank's run-time policy (:class:`kvpolicy.runtime.policy.RankPolicy`) without vLLM, torch or
Mooncake: start-up with inherited demotions, audited steps and what follows from them, the lookup
gate, read failures on a hand clock, the tally and the status documents."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
from runtime_support import TP, HandClock, ListGather, MemoryStore, audited_policy, hybrid_layout, logged, planner

from kvpolicy.evidence.audit import AuditStatus, Digest, ReplicationAuditError, agreement_key, demotion_key
from kvpolicy.language.models import AuditMode, Policy
from kvpolicy.runtime.audit_step import encode_report
from kvpolicy.runtime.binding import RankPlace
from kvpolicy.runtime.policy import RankPolicy

SAME = Digest("d1", all_zero=False)
OTHER = Digest("d2", all_zero=False)


@pytest.fixture
def layout(tmp_path: Path):
    return hybrid_layout(tmp_path)


def rank_policy(policy: Policy, store: MemoryStore, gather: ListGather, **kwargs) -> RankPolicy:
    return RankPolicy(policy, store=store, gather=gather, **kwargs)


def started(layout, *, policy: Policy | None = None, store: MemoryStore | None = None,
            gather: ListGather | None = None, **kwargs) -> RankPolicy:
    policy = policy or audited_policy()
    declared, replan = planner(policy, layout)
    runtime = rank_policy(policy, store or MemoryStore(), gather or ListGather(), **kwargs)
    runtime.start(declared, replan, layout=layout)
    return runtime


def reports_of(*digests: Digest):
    """collect_reports for a step where rank r reported ``digests[r]`` for group 0."""
    return lambda: [encode_report({0: digest}) for digest in digests]


def no_samples(groups):
    raise AssertionError("equal digests need no samples")


def differing(groups):
    """collect_samples for a step whose sampled values differ (with :func:`far`)."""
    return [{group: bytes(8) for group in groups} for _ in range(TP)]


def far(a, b) -> float:
    return 1.0


# --- start-up ------------------------------------------------------------------------------------------


def test_a_fresh_instance_runs_the_declared_plan_after_one_gather_of_what_it_found(layout) -> None:
    gather = ListGather()
    runtime = started(layout, gather=gather)
    declared, _ = planner(audited_policy(), layout)
    assert runtime.decided_plan == declared and runtime.audit is not None and not runtime.audit.inherited
    assert gather.sent == [{}]


def test_an_instance_starts_demoted_where_another_instance_of_its_plan_published_a_demotion(layout) -> None:
    declared, _ = planner(audited_policy(), layout)
    store = MemoryStore()
    store.put(demotion_key(declared, 0), b"group 0 differs on rank 2")
    runtime = started(layout, store=store)
    assert runtime.decided_plan is not None and runtime.decided_plan.factors == (1, 1)
    assert runtime.audit is not None and runtime.audit.inherited == {0: "group 0 differs on rank 2"}
    assert runtime.decided_plan.fingerprint != declared.fingerprint


def test_a_demotion_only_another_rank_saw_demotes_this_rank_too(layout) -> None:
    # Rank 0's store read finds nothing; rank 3 found the marker: both start demoted, so neither
    # waits in an audit collective the other skips.
    runtime = started(layout, gather=ListGather(rank=0, others={3: {0: "seen by rank 3 only"}}))
    assert runtime.decided_plan is not None and runtime.decided_plan.factors == (1, 1)
    assert runtime.groups_to_audit() == ()


def test_a_store_that_cannot_answer_at_start_up_leaves_the_groups_to_the_audit(layout) -> None:
    store = MemoryStore()
    store.fail = True
    gather = ListGather()
    runtime = started(layout, store=store, gather=gather)
    assert runtime.groups_to_audit() == (0,) and gather.sent == [{}]  # still joins the collective


def test_audit_off_trusts_the_rule_and_neither_reads_markers_nor_gathers(layout) -> None:
    declared, _ = planner(audited_policy(), layout)
    store, gather = MemoryStore(), ListGather()
    store.put(demotion_key(declared, 0), b"differs")
    store.calls.clear()
    runtime = started(layout, policy=audited_policy(AuditMode.OFF), store=store, gather=gather)
    assert runtime.decided_plan is not None and runtime.decided_plan.factors == (TP, 1)
    assert (store.calls, gather.sent) == ([], [])


def test_an_inherited_demotion_under_enforce_stops_start_up(layout) -> None:
    with pytest.raises(ReplicationAuditError):
        started(layout, policy=audited_policy(AuditMode.ENFORCE), gather=ListGather(others={1: {0: "differs"}}))


def test_nothing_runs_before_start(layout) -> None:
    runtime = rank_policy(audited_policy(), MemoryStore(), ListGather())
    assert (runtime.decided_plan, runtime.groups_to_audit(), runtime.lookup_allowed()) == (None, (), True)


# --- audited steps --------------------------------------------------------------------------------------


def test_agreement_vouches_for_the_group_in_the_store(layout) -> None:
    store = MemoryStore()
    runtime = started(layout, store=store)
    outcome = runtime.conclude_step(reports_of(SAME, SAME, SAME, SAME), no_samples)
    assert outcome.agreed == (0,) and not outcome.plan_changed
    assert agreement_key(runtime.decided_plan, 0) in store.objects


def test_a_mismatch_re_plans_binds_before_publishing_and_the_next_instance_inherits_it(layout) -> None:
    store = MemoryStore()
    runtime = started(layout, store=store)
    declared = runtime.decided_plan
    bound = []

    def bind(binding) -> None:
        bound.append((binding.factors, runtime.bound_plan.factors, dict(store.objects)))

    outcome = runtime.conclude_step(reports_of(SAME, SAME, OTHER, SAME), differing, distance=far, bind=bind)
    assert outcome.demoted == (0,) and runtime.decided_plan.factors == (1, 1) == runtime.bound_plan.factors
    # Bound first (the decided plan changed, the bound one follows once bind returns), markers after.
    assert bound == [((1, 1), declared.factors, {})]
    assert demotion_key(declared, 0) in store.objects
    assert started(layout, store=store).decided_plan.factors == (1, 1)


def test_a_mismatch_withdraws_the_agreement_it_had_given(layout) -> None:
    store = MemoryStore()
    runtime = started(layout, store=store)
    declared = runtime.decided_plan
    runtime.conclude_step(reports_of(SAME, SAME, SAME, SAME), no_samples)
    assert agreement_key(declared, 0) in store.objects
    runtime.conclude_step(reports_of(SAME, OTHER, SAME, SAME), differing, distance=far)
    assert runtime.audit is not None and runtime.audit.statuses[0] is AuditStatus.DEMOTED
    assert agreement_key(declared, 0) not in store.objects


def test_a_rank_that_could_not_digest_makes_the_step_judge_nothing(layout) -> None:
    runtime = started(layout)
    outcome = runtime.conclude_step(
        lambda: [encode_report({0: SAME}), None, encode_report({0: OTHER}), encode_report({0: SAME})], no_samples
    )
    assert outcome.failed_ranks == (1,) and outcome.demoted == () and runtime.decided_plan.factors == (TP, 1)


def test_a_failed_collective_raises_and_changes_nothing(layout) -> None:
    runtime = started(layout)
    before = runtime.decided_plan

    def broken():
        raise TimeoutError("collective timed out")

    with pytest.raises(TimeoutError):
        runtime.conclude_step(broken, no_samples)
    assert runtime.decided_plan is before and runtime.audit.steps_done == 0


def test_digests_that_differ_within_rounding_are_judged_on_sampled_values(layout) -> None:
    runtime = started(layout)
    asked = []

    def samples(groups):
        asked.append(groups)
        return [{0: b"\x00" * 8} for _ in range(TP)]

    outcome = runtime.conclude_step(reports_of(SAME, OTHER, SAME, SAME), samples, distance=lambda a, b: 0.0)
    assert asked == [(0,)] and outcome.demoted == () and outcome.agreed == (0,)


def test_a_store_error_while_publishing_still_re_plans(layout) -> None:
    store = MemoryStore()
    runtime = started(layout, store=store)
    store.fail = True
    outcome = runtime.conclude_step(reports_of(SAME, SAME, OTHER, SAME), differing, distance=far)
    assert outcome.demoted == (0,) and runtime.decided_plan.factors == (1, 1)


def test_only_the_rank_that_speaks_for_its_stage_writes_markers(layout) -> None:
    store = MemoryStore()
    runtime = started(layout, store=store, gather=ListGather(rank=1), place=RankPlace(tp_rank=1, tp_size=TP))
    store.calls.clear()
    runtime.conclude_step(reports_of(SAME, SAME, OTHER, SAME), differing, distance=far)
    assert store.calls == [] and runtime.decided_plan.factors == (1, 1)


def test_enforce_raises_on_a_mismatch_and_counts_it(layout) -> None:
    runtime = started(layout, policy=audited_policy(AuditMode.ENFORCE))
    with pytest.raises(ReplicationAuditError):
        runtime.conclude_step(reports_of(SAME, OTHER, SAME, SAME), differing, distance=far)
    assert runtime.tally.drain()["audit"] == {"mismatch": 1}


# --- the lookup gate ---------------------------------------------------------------------------------


def test_lookups_miss_until_the_group_is_verified_and_each_miss_is_counted(layout) -> None:
    runtime = started(layout)
    assert not runtime.lookup_allowed() and not runtime.lookup_allowed()
    runtime.conclude_step(reports_of(SAME, SAME, SAME, SAME), no_samples)
    assert runtime.lookup_allowed()
    assert runtime.tally.drain()["lookups_gated"] == 2


def test_a_store_that_cannot_answer_the_gate_makes_lookups_miss(layout) -> None:
    store = MemoryStore()
    runtime = started(layout, store=store)
    store.fail = True
    assert not runtime.lookup_allowed()


def test_an_inherited_demotion_leaves_nothing_to_gate(layout) -> None:
    runtime = started(layout, gather=ListGather(others={2: {0: "differs"}}))
    assert runtime.lookup_allowed()


# --- read failures -------------------------------------------------------------------------------


def test_a_failed_read_is_missing_to_lookups_until_the_ttl_expires(layout) -> None:
    clock = HandClock()
    runtime = started(layout, read_failure_ttl_s=30, clock=clock)
    runtime.read_failures.record(["k1"])
    assert runtime.read_failures.mask(["k1", "k2"], [1, 1]) == [0, 1]
    clock.now += 30
    assert runtime.read_failures.mask(["k1", "k2"], [1, 1]) == [1, 1]


def test_a_ttl_of_zero_remembers_nothing(layout) -> None:
    runtime = started(layout, read_failure_ttl_s=0, clock=HandClock())
    runtime.read_failures.record(["k1"])
    assert runtime.read_failures.mask(["k1"], [1]) == [1]


# --- the tally and the status documents ---------------------------------------------------------------


def test_the_first_rank_counts_steps_and_publishes_the_plan_again_after_a_demotion(layout) -> None:
    runtime = started(layout)
    runtime.conclude_step(reports_of(SAME, SAME, OTHER, SAME), differing, distance=far)
    counts = runtime.tally.drain()
    assert counts["audit"] == {"mismatch": 1} and counts["demotions"] == {"0": 1}
    assert {entry["factor"] for entry in counts["plan"]} == {"1"}


def test_another_stage_counts_no_instance_wide_stats(layout) -> None:
    runtime = started(layout, place=RankPlace(pp_rank=1, pp_size=2))
    runtime.conclude_step(reports_of(SAME, SAME, SAME, SAME), no_samples)
    assert runtime.tally.drain() is None


def test_the_status_documents_follow_the_plan(layout, tmp_path: Path) -> None:
    plan_json, keys_json = tmp_path / "plan.json", tmp_path / "plan.keys.json"
    runtime = started(layout, plan_json=plan_json, keys_json=keys_json)
    runtime.report_plan()
    first = json.loads(plan_json.read_text())
    assert (first["kind"], first["fingerprint"]) == ("ReplicationPlan", runtime.decided_plan.fingerprint)
    assert json.loads(keys_json.read_text())["fingerprint"] == runtime.decided_plan.fingerprint
    runtime.conclude_step(reports_of(SAME, SAME, OTHER, SAME), differing, distance=far)
    after = json.loads(plan_json.read_text())
    assert after["fingerprint"] == runtime.decided_plan.fingerprint != first["fingerprint"]
    assert after["audit"]["steps_done"] == 1 and len(after["audit"]["errors"]) == 1
    assert json.loads(keys_json.read_text())["fingerprint"] == runtime.decided_plan.fingerprint


def test_an_inherited_demotion_is_in_the_plan_file(layout, tmp_path: Path) -> None:
    plan_json = tmp_path / "plan.json"
    runtime = started(layout, gather=ListGather(others={1: {0: "differs"}}), plan_json=plan_json)
    runtime.report_plan()
    (entry,) = json.loads(plan_json.read_text())["audit"]["inherited"]
    assert (entry["group"], entry["message"], entry["plan"]) == (0, "differs", runtime.audit.initial_plan.fingerprint)


def test_only_the_first_rank_writes_status_documents(layout, tmp_path: Path) -> None:
    runtime = started(
        layout, gather=ListGather(rank=1), place=RankPlace(tp_rank=1, tp_size=TP), plan_json=tmp_path / "p.json"
    )
    runtime.report_plan()
    assert list(tmp_path.iterdir()) == [tmp_path / "org_hybrid.yaml"]


# --- planning and the captured layout -------------------------------------------------------------


def test_replanning_demotes_only_the_groups_named(layout) -> None:
    from kvpolicy.language.models import Topology
    from kvpolicy.runtime.policy import plan_and_replan

    declared, replan = plan_and_replan(audited_policy(), layout, Topology(tp_size=TP))
    assert declared.factors == (TP, 1) and replan(frozenset({0})).factors == (1, 1)
    assert replan(frozenset()) == declared


def test_a_captured_layout_reads_back_as_the_layout(layout, tmp_path: Path) -> None:
    from kvpolicy.documents.loader import load_layout
    from kvpolicy.language.models import Topology
    from kvpolicy.runtime.policy import capture_layout

    path = tmp_path / "captured.yaml"
    capture_layout(path, layout, Topology(tp_size=TP))
    assert load_layout(path) == layout


def test_a_layout_that_cannot_be_written_is_one_error_line_naming_the_key(layout, tmp_path: Path) -> None:
    from kvpolicy.language.models import Topology
    from kvpolicy.runtime.policy import capture_layout

    path = tmp_path / "missing" / "captured.yaml"
    with logged() as records:
        assert capture_layout(path, layout, Topology(tp_size=TP)) is False
    assert lines(records) == [
        ("ERROR", f"kvpolicy: cannot write the layout to {path} (kvpolicy_layout_out): No such file or directory; "
                  "serving on without it")
    ]


# --- status documents that cannot be written: one line each, and the rank serves on -----------------


def lines(records: list[logging.LogRecord], level: int = logging.WARNING) -> list[tuple[str, str]]:
    """(level, message) of the records at ``level`` or above; none carries a traceback."""
    assert not any(record.exc_info for record in records)
    return [(record.levelname, record.getMessage()) for record in records if record.levelno >= level]


def test_a_plan_file_whose_directory_was_removed_is_one_error_line_and_the_rank_serves_on(layout, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    runtime = started(layout, plan_json=run / "plan.json")
    run.rmdir()  # removed between the settings' check and the write
    with logged() as records:
        runtime.report_plan()
    assert lines(records) == [
        ("ERROR", f"kvpolicy: cannot write the plan to {run / 'plan.json'} (kvpolicy_plan_json): No such file or directory; "
                  "serving on without it")
    ]
    assert runtime.tally.drain()["plan"]  # the start-up report went on past the file
    assert runtime.conclude_step(reports_of(SAME, SAME, SAME, SAME), no_samples).agreed == (0,)


def test_a_directory_standing_at_the_plan_path_is_left_as_it_is_and_logged(layout, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.mkdir()
    with logged() as records:
        started(layout, plan_json=path).report_plan()
    assert path.is_dir()
    assert lines(records) == [
        ("ERROR", f"kvpolicy: cannot write the plan to {path} (kvpolicy_plan_json): it is a directory, not a regular "
                  "file; it is left as it is; serving on without it")
    ]


def test_a_fifo_standing_at_the_key_contract_path_is_not_replaced(layout, tmp_path: Path) -> None:
    """As a device would not be: a rename over ``/dev/null`` as root replaces it for every program."""
    path = tmp_path / "keys.json"
    os.mkfifo(path)
    with logged() as records:
        started(layout, keys_json=path).report_plan()
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert [message for _, message in lines(records)] == [
        f"kvpolicy: cannot write the key contract to {path} (kvpolicy_keys_json): it is a FIFO, not a regular file; "
        "it is left as it is; serving on without it"
    ]


def test_a_status_path_holding_a_nul_is_one_error_line(layout, tmp_path: Path) -> None:
    path = tmp_path / "plan\0.json"
    with logged() as records:
        started(layout, plan_json=path).report_plan()
    assert lines(records) == [
        ("ERROR", f"kvpolicy: cannot write the plan to {tmp_path}/plan\\x00.json (kvpolicy_plan_json): the path contains "
                  "a NUL character; serving on without it")
    ]


def test_only_the_files_written_are_logged_as_written(layout, tmp_path: Path) -> None:
    (tmp_path / "gone").mkdir()
    runtime = started(layout, plan_json=tmp_path / "plan.json", keys_json=tmp_path / "gone" / "keys.json")
    (tmp_path / "gone").rmdir()
    with logged() as records:
        runtime.report_plan()
    written = [message for level, message in lines(records, logging.INFO) if "written to" in message]
    assert written == [f"kvpolicy plan written to {tmp_path / 'plan.json'}"]


def test_an_audited_step_whose_status_documents_cannot_be_rewritten_still_concludes(layout, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    runtime = started(layout, plan_json=run / "plan.json", keys_json=run / "keys.json")
    runtime.report_plan()
    shutil.rmtree(run)
    with logged() as records:
        outcome = runtime.conclude_step(reports_of(SAME, SAME, OTHER, SAME), differing, distance=far)
    assert outcome.plan_changed and runtime.decided_plan is not None and runtime.decided_plan.factors == (1, 1)
    failed = [message for level, message in lines(records) if level == "ERROR" and "cannot write" in message]
    assert failed == [
        f"kvpolicy: cannot write the key contract to {run / 'keys.json'} (kvpolicy_keys_json): No such file or directory; "
        "serving on without it",
        f"kvpolicy: cannot write the plan to {run / 'plan.json'} (kvpolicy_plan_json): No such file or directory; "
        "serving on without it",
    ]
