"""Agreement and demotion markers in the store, the lookup gate, and the TP ranks' agreement on
published demotions: pure, over an in-memory store and a list collective."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_support import ListGather, MemoryStore, audited_policy, hybrid_layout, planner

from kvpolicy.evidence.audit import DEMOTION_MESSAGE_LIMIT, AuditState, agreement_key, demotion_key
from kvpolicy.language.models import AuditMode
from kvpolicy.runtime.markers import (
    LookupGate,
    agree_on_demotions,
    read_demotions,
    revoke_agreements,
    write_agreements,
    write_demotions,
)


@pytest.fixture
def plans(tmp_path: Path):
    return planner(audited_policy(), hybrid_layout(tmp_path))


# --- the lookup gate ----------------------------------------------------------------------------------


def test_the_gate_is_closed_while_no_instance_vouched_for_a_replicated_group(plans) -> None:
    declared, replan = plans
    assert not LookupGate().open(AuditState(declared, replan=replan), MemoryStore())


def test_another_instances_agreement_marker_opens_the_gate(plans) -> None:
    declared, replan = plans
    store = MemoryStore()
    assert write_agreements(store, declared, [0]) == 1
    assert LookupGate().open(AuditState(declared, replan=replan), store)


def test_an_agreement_for_another_plan_does_not_open_the_gate(plans, tmp_path: Path) -> None:
    declared, replan = plans
    other, _ = planner(audited_policy(), hybrid_layout(tmp_path), tp_size=2)
    store = MemoryStore()
    write_agreements(store, other, [0])
    assert other.fingerprint != declared.fingerprint and other.factors[0] > 1
    assert not LookupGate().open(AuditState(declared, replan=replan), store)


def test_the_gate_remembers_a_marker_it_found_and_asks_the_store_no_more(plans) -> None:
    declared, replan = plans
    store, gate, state = MemoryStore(), LookupGate(), AuditState(declared, replan=replan)
    write_agreements(store, declared, [0])
    assert gate.open(state, store)
    store.calls.clear()
    store.objects.clear()  # evicted since: the instance already trusts the namespace
    assert gate.open(state, store) and store.calls == []


def test_this_instances_own_agreement_opens_its_own_namespace_without_markers(plans) -> None:
    declared, replan = plans
    state = AuditState(declared, replan=replan)
    state.conclude([{0: _same()}] * 4)
    assert LookupGate().open(state, MemoryStore())


def test_an_audit_off_policy_needs_no_marker(tmp_path: Path) -> None:
    declared, replan = planner(audited_policy(AuditMode.OFF), hybrid_layout(tmp_path))
    store = MemoryStore()
    assert LookupGate().open(AuditState(declared, replan=replan), store) and store.calls == []


def test_the_gate_counts_the_lookups_it_refused(plans) -> None:
    declared, replan = plans
    gate = LookupGate()
    for _ in range(3):
        gate.open(AuditState(declared, replan=replan), MemoryStore())
    assert gate.closed_lookups == 3


def test_revoking_an_agreement_closes_the_gate_for_fresh_instances(plans) -> None:
    declared, replan = plans
    store = MemoryStore()
    write_agreements(store, declared, [0])
    revoke_agreements(store, declared, [0])
    assert agreement_key(declared, 0) not in store.objects
    assert not LookupGate().open(AuditState(declared, replan=replan), store)


# --- published demotions ---------------------------------------------------------------------------


def test_a_published_demotion_is_read_back_with_its_message(plans) -> None:
    declared, _ = plans
    store = MemoryStore()
    assert write_demotions(store, declared, {0: "group 0 differs"}) == 1
    assert read_demotions(store, declared, [0, 1]) == {0: "group 0 differs"}


def test_a_demotion_is_read_only_in_its_own_pp_namespace_and_plan(plans, tmp_path: Path) -> None:
    declared, _ = plans
    other, _ = planner(audited_policy(), hybrid_layout(tmp_path), tp_size=2)
    store = MemoryStore()
    write_demotions(store, declared, {0: "differs"}, pp_rank=1)
    assert read_demotions(store, declared, [0]) == {}
    assert read_demotions(store, other, [0], pp_rank=1) == {}
    assert read_demotions(store, declared, [0], pp_rank=1) == {0: "differs"}


def test_a_long_message_is_cut_to_the_limit(plans) -> None:
    declared, _ = plans
    store = MemoryStore()
    write_demotions(store, declared, {0: "x" * (DEMOTION_MESSAGE_LIMIT + 50)})
    assert len(read_demotions(store, declared, [0])[0]) == DEMOTION_MESSAGE_LIMIT


def test_a_second_demotion_of_the_same_group_keeps_the_first_message(plans) -> None:
    declared, _ = plans
    store = MemoryStore()
    write_demotions(store, declared, {0: "first"})
    write_demotions(store, declared, {0: "second"})
    assert read_demotions(store, declared, [0]) == {0: "first"}


def test_a_marker_whose_message_was_evicted_still_counts(plans) -> None:
    declared, _ = plans
    store = MemoryStore()
    store.objects[demotion_key(declared, 0)] = b""
    assert read_demotions(store, declared, [0]) == {0: "group 0 was demoted (the marker's message could not be read)"}


def test_a_store_that_cannot_answer_counts_as_no_demotion(plans) -> None:
    declared, _ = plans
    store = MemoryStore()
    write_demotions(store, declared, {0: "differs"})
    store.fail = True
    assert read_demotions(store, declared, [0]) == {}


def test_a_negative_existence_code_counts_as_not_found(plans) -> None:
    declared, _ = plans

    class Unsure(MemoryStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            return [-1 for _ in keys]

    store = Unsure()
    write_demotions(store, declared, {0: "differs"})
    assert read_demotions(store, declared, [0]) == {}


# --- agreeing on them --------------------------------------------------------------------------------


def test_the_ranks_take_the_union_of_what_each_found() -> None:
    gather = ListGather(rank=0, others={1: {1: "rank 1 saw group 1"}, 2: None, 3: {0: "rank 3 saw group 0"}})
    assert agree_on_demotions({}, gather=gather) == {0: "rank 3 saw group 0", 1: "rank 1 saw group 1"}


def test_a_groups_message_is_the_lowest_ranks() -> None:
    gather = ListGather(rank=2, others={0: {0: "from rank 0"}, 1: {0: "from rank 1"}})
    assert agree_on_demotions({0: "from rank 2"}, gather=gather) == {0: "from rank 0"}


def test_agreeing_is_one_collective_carrying_what_this_rank_found() -> None:
    gather = ListGather()
    agree_on_demotions({0: "mine"}, gather=gather)
    assert gather.sent == [{0: "mine"}]


def _same():
    from kvpolicy.evidence.audit import Digest

    return Digest("d1", all_zero=False)
