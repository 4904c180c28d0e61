"""The standalone construction path: its ranks and the thread collective the simulation gives it.

:func:`kvpolicy.vllm.internals.init_standalone` rebuilds upstream's ``__init__`` without the
distributed runtime; the simulation, ``kvpolicy audit`` and the benchmarks build every rank with it.
That it repeats every ``self.x =`` and ``self.f()`` of upstream's ``__init__`` is checked with the rest
of vLLM's internals, in ``tests/connector/test_vllm_internals.py``.
"""

from __future__ import annotations

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.runtime.binding import RankPlace  # noqa: E402
from kvpolicy.sim import ThreadGather  # noqa: E402
from kvpolicy.sim.collective import CollectiveTimeout  # noqa: E402


@pytest.mark.parametrize("fields", [{"tp_rank": 2, "tp_size": 2}, {"tp_rank": 0, "tp_size": 0}, {"tp_rank": 0, "tp_size": 1, "pp_rank": 1}])
def test_ranks_outside_their_group_are_refused(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="outside a group"):
        RankPlace(**fields)


def test_only_the_all_zero_rank_is_first() -> None:
    assert [RankPlace(tp_rank=r, tp_size=2).is_first for r in range(2)] == [True, False]
    assert not RankPlace(tp_rank=0, tp_size=1, pp_rank=1, pp_size=2).is_first


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
