"""The standalone construction path against upstream's ``MooncakeStoreWorker.__init__``.

:func:`kvpolicy.vllm.standalone.init_standalone` rebuilds upstream's ``__init__`` without the
distributed runtime; the simulation, ``kvpolicy audit`` and the benchmarks build every rank with
it. If a vLLM upgrade adds an attribute or an override-point call to ``__init__``, these tests fail
instead of leaving simulated workers without it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker  # noqa: E402

from kvpolicy.sim import ThreadGather  # noqa: E402
from kvpolicy.sim.collective import CollectiveTimeout  # noqa: E402
from kvpolicy.vllm.standalone import Ranks, init_standalone  # noqa: E402

UPSTREAM_ONLY = {
    "self._create_mem_pool()": "custom_mem_pool is CUDA-only; the standalone worker sets _mem_pool = None",
}
"""Calls of upstream's __init__ the standalone path replaces, and why."""


def _attribute_of(node: ast.AST, receiver: str) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == receiver:
        return node.attr
    return None


def assignments_and_calls(function: Callable[..., object], receiver: str) -> set[str]:
    """``self.x =`` (tuple targets included) and ``self.f()`` in ``function``, spelled with ``self``
    whatever the receiver's name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [item for target in targets for item in (target.elts if isinstance(target, ast.Tuple) else [target])]
            found.update(f"self.{name} =" for name in (_attribute_of(target, receiver) for target in flat) if name)
        elif isinstance(node, ast.Call) and (name := _attribute_of(node.func, receiver)):
            found.add(f"self.{name}()")
    return found


def test_the_standalone_path_sets_every_attribute_upstreams_init_sets() -> None:
    upstream = {item for item in assignments_and_calls(MooncakeStoreWorker.__init__, "self") if item.endswith("=")}
    assert upstream - assignments_and_calls(init_standalone, "worker") == set()


def test_the_standalone_path_makes_every_call_upstreams_init_makes_on_the_worker() -> None:
    upstream = {item for item in assignments_and_calls(MooncakeStoreWorker.__init__, "self") if item.endswith("()")}
    assert upstream - assignments_and_calls(init_standalone, "worker") == set(UPSTREAM_ONLY)


def test_the_drift_check_sees_an_attribute_the_standalone_path_lacks() -> None:
    def lacking(worker: object) -> None:
        worker.tp_rank = 0  # type: ignore[attr-defined]

    assert "self.tp_size =" in assignments_and_calls(MooncakeStoreWorker.__init__, "self") - assignments_and_calls(
        lacking, "worker"
    )


@pytest.mark.parametrize("fields", [{"tp_rank": 2, "tp_size": 2}, {"tp_rank": 0, "tp_size": 0}, {"tp_rank": 0, "tp_size": 1, "pp_rank": 1}])
def test_ranks_outside_their_group_are_refused(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="outside a group"):
        Ranks(**fields)


def test_only_the_all_zero_rank_is_first() -> None:
    assert [Ranks(tp_rank=r, tp_size=2).is_first for r in range(2)] == [True, False]
    assert not Ranks(tp_rank=0, tp_size=1, pp_rank=1, pp_size=2).is_first


def test_the_thread_collective_gives_every_rank_every_payload() -> None:
    import threading

    collective = ThreadGather(3, timeout=10)
    results: dict[int, list[object]] = {}
    threads = [
        threading.Thread(target=lambda rank=rank: results.__setitem__(rank, collective.member(rank)(f"p{rank}")))
        for rank in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {rank: ["p0", "p1", "p2"] for rank in range(3)} and collective.rounds == 1


def test_a_rank_alone_in_the_collective_times_out_instead_of_hanging() -> None:
    with pytest.raises(CollectiveTimeout, match="rank 0 waited"):
        ThreadGather(2, timeout=0.2).member(0)("alone")


def test_a_collective_that_timed_out_says_so_on_the_next_gather() -> None:
    collective = ThreadGather(2, timeout=0.2)
    with pytest.raises(CollectiveTimeout):
        collective.member(0)("alone")
    with pytest.raises(CollectiveTimeout, match="timed out in an earlier round and is broken"):
        collective.member(1)("late")
