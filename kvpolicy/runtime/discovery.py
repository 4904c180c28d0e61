"""One rank's part in discovery (``kvpolicy_discover``), without vLLM or torch.

Every TP rank holds a :class:`RankDiscovery`. For the first ``steps`` save steps that save blocks, each
rank digests what it saves, per group, layer and block (the caller's ``collect``), and the ranks gather
the digests; rank 0 folds them into its :class:`~kvpolicy.discovery.Observer` and rewrites the report
file. Whether a step is observed depends on the step's blocks (from the connector metadata, the same
on every rank) and on the count of steps observed so far (the same on every rank), never on anything
rank-local: every rank makes the same gathers. A rank that cannot read its blocks still joins the
gather with None, and that step proves nothing. Nothing here changes what is stored or loaded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvpolicy.discovery import BlockDigest, DiscoveryReport, Observer, RankObservation, dump_report, group_layers
from kvpolicy.loader import schemas_dir
from kvpolicy.models import Layout, Topology
from kvpolicy.runtime.policy import write_text_atomically

logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["RankDiscovery", "StepCost"]


class StepCost:
    """Seconds spent on observed steps, by part (rank 0's; what the benchmark and the log report)."""

    def __init__(self) -> None:
        self.digest = 0.0
        self.gather = 0.0
        self.steps = 0


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
        source: str = "engine",
    ) -> None:
        self.layout = layout
        self.topology = topology
        self.model = model
        self.steps = steps
        self.source = source
        self.report_path = report_path
        self.cost = StepCost()
        self._gather = gather
        self._observed = 0
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
            local = {int(group): {str(layer): [(str(value), bool(zero)) for value, zero in blocks]
                                  for layer, blocks in layers.items()}
                     for group, layers in collect().items()}
        except Exception:
            logger.exception("kvpolicy discover: this rank could not digest its blocks; the step proves nothing")
        digested = time.perf_counter()
        gathered = list(self._gather(local))
        gathered_at = time.perf_counter()
        self._observed += 1
        self.cost.digest += digested - started
        self.cost.gather += gathered_at - digested
        self.cost.steps += 1
        if self._observer is None:
            return
        self._observer.observe([_decoded(payload) for payload in gathered])
        self._write()
        blocks = sum(len(digests) for layers in (local or {}).values() for digests in layers.values())
        logger.info(
            "kvpolicy discover step %d/%d: %d layer blocks per rank; digest %.2f ms, gather %.2f ms",
            self._observed, self.steps, blocks, 1e3 * (digested - started), 1e3 * (gathered_at - digested),
        )
        if not self.observing:
            logger.info(
                "kvpolicy discover: %d steps observed, report written to %s (digest %.2f ms, gather %.2f ms per step)",
                self._observed, self.report_path, 1e3 * self.cost.digest / self.cost.steps,
                1e3 * self.cost.gather / self.cost.steps,
            )

    def report(self) -> DiscoveryReport | None:
        """Rank 0's report so far (None on the other ranks)."""
        if self._observer is None:
            return None
        source = "simulation" if self.source == "simulation" else "engine"
        return self._observer.report(model=self.model, source=source, topology=self.topology, layout=self.layout)

    def _write(self) -> None:
        report = self.report()
        if report is None or self.report_path is None:
            return
        schema = schemas_dir() / "discovery.schema.json"
        text = dump_report(report, schema=str(schema.resolve()) if schema.is_file() else None)
        try:
            write_text_atomically(self.report_path, text)
        except OSError as error:
            logger.error("kvpolicy discover: cannot write the report to %s (kvpolicy_discover): %s",
                         self.report_path, error.strerror or error)


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
