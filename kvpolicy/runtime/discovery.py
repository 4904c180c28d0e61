"""One rank's part in discovery (``kvpolicy_discover``), without vLLM or torch.

Every TP rank holds a :class:`RankDiscovery`. For the first ``steps`` save steps that save blocks, each
rank digests what it saves, per group, layer and block (the caller's ``collect``), and the ranks gather
the digests; rank 0 folds them into its :class:`~kvpolicy.evidence.discovery.Observer` and rewrites the report
file after steps 1, 2, 4, 8 ... and the last. Whether a step is observed depends on the step's blocks
(from the connector metadata, the same on every rank) and on the count of steps observed so far (the
same on every rank), never on anything rank-local: every rank makes the same gathers. A rank that cannot read its blocks still joins the
gather with None, and that step proves nothing. Nothing here changes what is stored or loaded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvpolicy.documents.loader import schemas_dir
from kvpolicy.evidence.discovery import (
    BlockDigest,
    DiscoveryReport,
    Observer,
    RankObservation,
    dump_report,
    group_layers,
)
from kvpolicy.language.diagnostics import printable_path
from kvpolicy.language.models import Layout, Topology
from kvpolicy.runtime.policy import write_side_file

logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["RankDiscovery", "StepCost"]


@dataclass(frozen=True)
class StepCost:
    """Seconds an observed step spent, by part (on rank 0 the log line and the benchmark report them)."""

    digest: float
    """Reading and hashing this rank's blocks, per layer."""
    gather: float
    """The gather of every rank's digests over the TP group (it waits for the slowest rank)."""
    report: float = 0.0
    """Rank 0 only: folding the digests into the observation and rewriting the report file."""

    @property
    def total(self) -> float:
        return self.digest + self.gather + self.report


class RankDiscovery:
    """Discovery on one TP rank: ``gather(payload)`` returns every TP rank's payload in rank order.
    ``report_path`` is where rank 0 writes the report (None on the other ranks)."""

    def __init__(
        self,
        *,
        layout: Layout,
        topology: Topology,
        model: str,
        steps: int,
        gather: Callable[[object], Sequence[object]],
        report_path: Path | None,
        source: Literal["engine", "simulation"] = "engine",
    ) -> None:
        self.layout = layout
        self.topology = topology
        self.model = model
        self.steps = steps
        self.source = source
        self.report_path = report_path
        self.costs: list[StepCost] = []
        """Every observed step's cost, in order (at most ``steps``)."""
        self._gather = gather
        self._observed = 0
        self._written = False
        """Whether the last rewrite of the report was written."""
        self._observer = Observer(topology.tp_size, group_layers(layout)) if report_path is not None else None

    @property
    def observing(self) -> bool:
        """Whether the next step that saves blocks is observed (the same answer on every rank)."""
        return self._observed < self.steps

    def observe_step(self, collect: Callable[[], Mapping[int, Mapping[str, Sequence[BlockDigest]]]]) -> None:
        """One observed step: this rank's digests (``collect()``), the gather, and on rank 0 the
        observation and the report. Call it on every rank of the step, or on none."""
        started = time.perf_counter()
        local: RankObservation = None
        try:
            local = collect()  # plain data already: rank 0 checks every payload as it receives it (_decoded)
        except Exception:
            logger.exception("kvpolicy discover: this rank could not digest its blocks; the step proves nothing")
        digested = time.perf_counter()
        gathered = list(self._gather(local))
        gathered_at = time.perf_counter()
        self._observed += 1
        if self._observer is None:
            self.costs.append(StepCost(digest=digested - started, gather=gathered_at - digested))
            return
        self._observer.observe([_decoded(payload) for payload in gathered])
        if self._report_due():
            self._write()
        cost = StepCost(digest=digested - started, gather=gathered_at - digested, report=time.perf_counter() - gathered_at)
        self.costs.append(cost)
        blocks = sum(len(digests) for layers in (local or {}).values() for digests in layers.values())
        logger.info(
            "kvpolicy discover step %d/%d: %d layer blocks per rank; digest %.2f ms, gather %.2f ms, report %.2f ms",
            self._observed, self.steps, blocks, 1e3 * cost.digest, 1e3 * cost.gather, 1e3 * cost.report,
        )
        if not self.observing and self._written:
            logger.info("kvpolicy discover: %d steps observed, report written to %s", self._observed,
                        printable_path(str(self.report_path)))

    def _report_due(self) -> bool:
        """Rewrite the report after observed steps 1, 2, 4, 8 ... and the last: a report from the first
        step on (an engine stopped early leaves one), at a cost of log2(steps) rewrites, not one a step
        (a rewrite is 15-30 ms for a real model's layers, ``benchmarks/bench_discovery.py``)."""
        observed = self._observed
        return observed == self.steps or observed & (observed - 1) == 0

    def report(self) -> DiscoveryReport | None:
        """Rank 0's report so far (None on the other ranks)."""
        if self._observer is None:
            return None
        return self._observer.report(model=self.model, source=self.source, topology=self.topology, layout=self.layout)

    def _write(self) -> None:
        report = self.report()
        if report is None or self.report_path is None:
            return
        schema = schemas_dir() / "discovery.schema.json"
        text = dump_report(report, schema=str(schema.resolve()) if schema.is_file() else None)
        # One that cannot be written is one error line; observing goes on, and the next rewrite tries again.
        self._written = write_side_file(self.report_path, text, what="discovery report", setting="kvpolicy_discover")


def _decoded(payload: object) -> RankObservation:
    """A gathered payload as an observation; anything malformed counts as a failed rank."""
    if payload is None or not isinstance(payload, Mapping):
        return None
    try:
        return {int(group): {str(layer): [(str(value), bool(zero)) for value, zero in blocks]
                             for layer, blocks in layers.items()}
                for group, layers in payload.items()}
    except (TypeError, ValueError):
        return None
