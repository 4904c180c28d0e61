"""The plan cache: asked again for the same policy and layout objects with equal other arguments,
``make_plan`` answers with the plan it made, which equals a fresh one; anything else that could change
the plan (another document, even one ``==`` calls equal, another topology, key context, demotion or
store sharding) is planned anew. Plans are immutable, so sharing them is safe."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
from core_support import full, layout, mamba, mla

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.keys import KeyContext
from kvpolicy.language.models import Topology
from kvpolicy.planning.engine import PLANS, PlanCache, make_plan
from kvpolicy.planning.store_layout import StoreSharding

DEFAULT = load_policy("default")
HYBRID = layout(mla(), full(), mamba(tp_replicated=True), heads=2)
TP4 = Topology(tp_size=4)


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    PLANS.clear()
    yield
    PLANS.clear()


def fresh(*args: object, **kwargs: object) -> object:
    PLANS.clear()
    return make_plan(*args, **kwargs)  # type: ignore[arg-type]


def test_a_replan_with_the_same_documents_is_the_plan_made_before() -> None:
    first = make_plan(DEFAULT, HYBRID, TP4, demoted=frozenset({1}))
    again = make_plan(DEFAULT, HYBRID, Topology(tp_size=4), demoted=[1])  # equal arguments, other objects
    assert again is first
    assert PLANS.info()[:3] == (1, 1, 1)
    assert first == fresh(DEFAULT, HYBRID, TP4, demoted={1})


def test_the_audits_replan_is_planned_once_per_demotion() -> None:
    # As the worker does: one closure over its policy, layout, topology, key context and sharding.
    context = KeyContext.for_model(HYBRID.model, "tenant", "")

    def replan(demoted: frozenset[int]) -> object:
        return make_plan(DEFAULT, HYBRID, TP4, key_context=context, demoted=demoted, store_sharding=None)

    plans = [replan(frozenset()), replan(frozenset({1})), replan(frozenset()), replan(frozenset({1}))]
    assert plans[0] is plans[2] and plans[1] is plans[3] and plans[0] != plans[1]
    assert PLANS.info()[:2] == (2, 2)


@pytest.mark.parametrize(
    "change",
    [
        {"topology": Topology(tp_size=2)},
        {"topology": Topology(tp_size=4, pp_size=2)},
        {"key_context": KeyContext.for_model(HYBRID.model, "tenant")},
        {"key_context": KeyContext.for_model("other/model")},
        {"demoted": {0}},
        {"policy": load_policy("vllm-compat")},
        {"policy": DEFAULT.model_copy()},  # an equal policy, another object: planned again, to an equal plan
        {"layout": layout(mla(), full(), mamba(tp_replicated=True), heads=2)},
    ],
    ids=lambda change: next(iter(change)),
)
def test_any_other_argument_is_planned_anew(change: dict[str, object]) -> None:
    arguments: dict[str, object] = {"policy": DEFAULT, "layout": HYBRID, "topology": TP4, **change}
    base = make_plan(DEFAULT, HYBRID, TP4)
    changed = make_plan(**arguments)  # type: ignore[arg-type]
    assert changed is not base and PLANS.info().misses == 2
    assert changed == fresh(**arguments)


def test_a_layout_equal_by_eq_but_not_the_same_gets_its_own_plan() -> None:
    # pydantic's == takes a field's true for 1; the fingerprint does not.
    flagged, counted = layout(mamba(tp_replicated=True), heads=1), layout(mamba(tp_replicated=1), heads=1)
    assert flagged == counted
    assert make_plan(DEFAULT, flagged, TP4).fingerprint != make_plan(DEFAULT, counted, TP4).fingerprint


def test_a_store_sharding_of_true_shards_is_not_one_of_one() -> None:
    # StoreSharding(True, ...) == StoreSharding(1, ...), but the fingerprint spells the size as given.
    llama, tp1 = load_layout("llama-3.1-70b"), Topology(tp_size=1)
    assert StoreSharding(True, "tp_shared_lbhnc") == StoreSharding(1, "tp_shared_lbhnc")
    one = make_plan(DEFAULT, llama, tp1, store_sharding=StoreSharding(1, "tp_shared_lbhnc"))
    true = make_plan(DEFAULT, llama, tp1, store_sharding=StoreSharding(True, "tp_shared_lbhnc"))
    assert true is not one and true.fingerprint != one.fingerprint


def test_a_refusal_is_not_cached() -> None:
    with pytest.raises(PlanError):
        make_plan(DEFAULT, HYBRID, Topology(tp_size=4, dcp_size=4))  # vLLM refuses it for 2 KV heads
    with pytest.raises(PlanError):
        make_plan(DEFAULT, HYBRID, Topology(tp_size=4, dcp_size=4))
    assert PLANS.info()[:3] == (0, 2, 0)


def test_the_cache_is_bounded_by_plans_and_by_layers() -> None:
    cache = PlanCache(max_plans=2, max_layers=13)
    context = KeyContext.for_model(HYBRID.model)
    plans = [cache.plan(DEFAULT, HYBRID, Topology(tp_size=tp), context, frozenset(), None) for tp in (1, 2, 4)]
    assert cache.info().plans == 2 and cache.info().layers == 12  # 6 layers each; the oldest went first
    assert cache.plan(DEFAULT, HYBRID, Topology(tp_size=4), context, frozenset(), None) is plans[2]
    assert cache.plan(DEFAULT, HYBRID, Topology(tp_size=1), context, frozenset(), None) is not plans[0]
    big = layout(*[full()] * 7, heads=2)  # 14 layers: more than the cache holds, planned but not kept
    assert cache.plan(DEFAULT, big, TP4, KeyContext.for_model(big.model), frozenset(), None).groups
    assert cache.info().plans == 2 and cache.info().layers == 12


def test_threads_asking_at_once_get_equal_plans() -> None:
    found: list[object] = []

    def plan() -> None:
        found.append(make_plan(DEFAULT, HYBRID, TP4))

    threads = [threading.Thread(target=plan) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 8 and all(plan == found[0] for plan in found)


def test_a_shared_plan_cannot_be_changed() -> None:
    plan = make_plan(DEFAULT, HYBRID, TP4)
    group, rank = plan.groups[0], plan.groups[0].ranks[0]
    for value, field in ((plan, "fingerprint"), (group, "factor"), (rank, "replica_set"), (rank.schedule, "phase")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    assert isinstance(plan.groups, tuple) and isinstance(group.decisions, tuple) and isinstance(group.ranks, tuple)
    with pytest.raises(AttributeError):
        group.decisions[0].factor = 2  # type: ignore[misc]
