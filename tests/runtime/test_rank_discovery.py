"""One rank's part in discovery (:class:`kvpolicy.runtime.discovery.RankDiscovery`), without vLLM: ranks
are threads of this process gathering over a list collective, as the simulation's ranks do."""

from __future__ import annotations

import threading
from pathlib import Path

from kvpolicy.discovery import DiscoveryReport, group_layers
from kvpolicy.loader import load, load_layout
from kvpolicy.models import Topology
from kvpolicy.runtime.discovery import RankDiscovery

LAYOUT = load_layout("llama-3.1-70b")
LAYERS = group_layers(LAYOUT)[0]


class Rendezvous:
    """A gather among ``size`` threads: each call returns every rank's payload in rank order."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list[object] = [None] * size
        self.calls = [0] * size

    def member(self, rank: int):  # noqa: ANN201
        def gather(payload: object) -> list[object]:
            self.slots[rank] = payload
            self.calls[rank] += 1
            self.barrier.wait()
            found = list(self.slots)
            self.barrier.wait()
            return found

        return gather


def _ranks(tmp_path: Path, steps: int, collective: Rendezvous) -> list[RankDiscovery]:
    return [
        RankDiscovery(layout=LAYOUT, topology=Topology(tp_size=2), model="llama", steps=steps,
                      gather=collective.member(rank), report_path=tmp_path / "report.yaml" if rank == 0 else None)
        for rank in range(2)
    ]


def _step(ranks: list[RankDiscovery], step: int, *, failing: int | None = None) -> None:
    def run(rank: int) -> None:
        def collect() -> dict[int, dict[str, list[tuple[str, bool]]]]:
            if rank == failing:
                raise RuntimeError("no KV caches registered")
            return {0: {layer: [(f"{layer}/{step}/{block}/{rank}", False) for block in range(2)] for layer in LAYERS}}

        ranks[rank].observe_step(collect)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)


def test_rank_0_writes_a_report_of_what_every_rank_saw(tmp_path: Path) -> None:
    collective = Rendezvous(2)
    ranks = _ranks(tmp_path, 2, collective)
    for step in range(2):
        _step(ranks, step)
    report = load(tmp_path / "report.yaml")
    assert isinstance(report, DiscoveryReport) and report.steps == 2
    assert report.groups[0].layers[0].partition == ((0,), (1,))
    assert ranks[1].report() is None  # only rank 0 observes


def test_observing_stops_after_its_steps_on_every_rank_alike(tmp_path: Path) -> None:
    collective = Rendezvous(2)
    ranks = _ranks(tmp_path, 3, collective)
    for step in range(3):
        assert all(rank.observing for rank in ranks)
        _step(ranks, step)
    assert not any(rank.observing for rank in ranks)
    assert collective.calls == [3, 3]


def test_a_rank_that_cannot_read_its_blocks_still_joins_the_gather_and_the_step_proves_nothing(tmp_path: Path) -> None:
    collective = Rendezvous(2)
    ranks = _ranks(tmp_path, 1, collective)
    _step(ranks, 0, failing=1)
    assert collective.calls == [1, 1]
    report = load(tmp_path / "report.yaml")
    assert isinstance(report, DiscoveryReport) and report.steps == 0 and report.failed_steps == 1


def test_the_report_is_rewritten_after_steps_1_2_4_and_the_last(tmp_path: Path) -> None:
    collective = Rendezvous(2)
    ranks = _ranks(tmp_path, 6, collective)
    seen = []
    for step in range(6):
        _step(ranks, step)
        report = load(tmp_path / "report.yaml")
        assert isinstance(report, DiscoveryReport)
        seen.append(report.steps)
    assert seen == [1, 2, 2, 4, 4, 6]


def test_every_observed_step_has_its_cost(tmp_path: Path) -> None:
    collective = Rendezvous(2)
    ranks = _ranks(tmp_path, 2, collective)
    for step in range(2):
        _step(ranks, step)
    assert len(ranks[0].costs) == 2 and all(cost.report > 0 and cost.total >= cost.gather for cost in ranks[0].costs)
    assert all(cost.report == 0 for cost in ranks[1].costs)
