"""One rank's part in discovery (:class:`kvpolicy.runtime.discovery.RankDiscovery`), without vLLM: ranks
are threads of this process gathering over a list collective, as the simulation's ranks do."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from runtime_support import logged

from kvpolicy.documents.loader import load, load_layout
from kvpolicy.evidence.discovery import DiscoveryReport, group_layers
from kvpolicy.language.models import Topology
from kvpolicy.runtime.discovery import RankDiscovery

LAYOUT = load_layout("llama-3.1-70b")
LAYERS = group_layers(LAYOUT)[0]


class Rendezvous:
    """A gather among ``size`` threads: each call returns every rank's payload in rank order."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list[object] = [None] * size
        self.calls = [0] * size

    def member(self, rank: int):
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


# --- a report that cannot be written: one line per rewrite, and observing goes on ------------------


def _ranks_writing(path: Path, steps: int, collective: Rendezvous) -> list[RankDiscovery]:
    return [
        RankDiscovery(layout=LAYOUT, topology=Topology(tp_size=2), model="llama", steps=steps,
                      gather=collective.member(rank), report_path=path if rank == 0 else None)
        for rank in range(2)
    ]


def test_a_report_whose_directory_was_removed_is_one_error_line_per_rewrite_and_observing_goes_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    collective = Rendezvous(2)
    ranks = _ranks_writing(run / "report.yaml", 2, collective)
    run.rmdir()
    with logged() as records:
        for step in range(2):
            _step(ranks, step)
    assert collective.calls == [2, 2] and not any(rank.observing for rank in ranks)
    assert not any(record.exc_info for record in records)
    errors = [record.getMessage() for record in records if record.levelno >= logging.WARNING]
    assert errors == [
        f"kvpolicy: cannot write the discovery report to {run / 'report.yaml'} (kvpolicy_discover): "
        "No such file or directory; serving on without it"
    ] * 2  # after steps 1 and 2
    assert not any("report written to" in record.getMessage() for record in records)
    report = ranks[0].report()
    assert report is not None and report.steps == 2


def test_a_report_path_holding_a_nul_is_one_error_line(tmp_path: Path) -> None:
    collective = Rendezvous(2)
    ranks = _ranks_writing(tmp_path / "report\0.yaml", 1, collective)
    with logged() as records:
        _step(ranks, 0)
    assert [record.getMessage() for record in records if record.levelno >= logging.WARNING] == [
        f"kvpolicy: cannot write the discovery report to {tmp_path}/report\\x00.yaml (kvpolicy_discover): "
        "the path contains a NUL character; serving on without it"
    ]


def test_a_report_path_that_became_a_directory_is_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "report.yaml"
    collective = Rendezvous(2)
    ranks = _ranks_writing(path, 1, collective)
    path.mkdir()
    with logged() as records:
        _step(ranks, 0)
    assert path.is_dir() and list(path.iterdir()) == []
    assert [record.levelname for record in records if record.levelno >= logging.WARNING] == ["ERROR"]
