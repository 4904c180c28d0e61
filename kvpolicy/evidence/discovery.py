"""Discovery: which TP ranks hold byte-identical bytes, observed rather than declared (pure).

A policy's rules state which ranks repeat a group's bytes; the audit (:mod:`kvpolicy.evidence.audit`) checks
the groups a policy calls replicated. Discovery turns the same machinery around: for the first steps
of an instance every rank digests, per layer and per block, the bytes it saves for *every* group,
the digests are gathered over the TP group, and rank 0 keeps, for each layer, the partition of the
TP ranks into classes of equal bytes. Two ranks share a class only if their bytes were equal in
every block compared; a block that is all zero on some rank proves nothing and is only counted.

This module holds the pure half: partitions, the :class:`Observer` that accumulates them, and the
:class:`DiscoveryReport` document rank 0 writes (``kind: DiscoveryReport``, JSON Schema in
``schemas/discovery.schema.json``). :mod:`kvpolicy.runtime.discovery` runs it on a rank;
:mod:`kvpolicy.documents.propose` turns reports into a policy.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, StrictInt, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.dumper import flow, layout_data, yaml_text
from kvpolicy.language.expressions import ExpressionError
from kvpolicy.language.models import (
    DocumentVersion,
    Layout,
    SpecExpressionError,
    StrictModel,
    Topology,
    topology_variables,
)
from kvpolicy.planning.engine import check_topology

__all__ = [
    "MAX_DISTINCT_TRACKED",
    "BlockDigest",
    "DiscoveryReport",
    "Evidence",
    "GroupObservation",
    "LayerObservation",
    "Observer",
    "Partition",
    "RankObservation",
    "dump_report",
    "group_layers",
    "meet",
    "parse_partition",
    "partition_of",
    "plan_problems",
    "report_problems",
    "runs",
    "topology_label",
]

Partition = tuple[tuple[int, ...], ...]
"""TP ranks in classes of equal bytes: each class ascending, classes ordered by their first rank."""

BlockDigest = tuple[str, bool]
"""One rank's digest of one block of one layer: (hex digest, all zero)."""

RankObservation = Mapping[int, Mapping[str, Sequence[BlockDigest]]] | None
"""What one rank sends per observed step: group → layer → its blocks' digests, in the order the step
saves them (the same block ids on every rank); None when the rank could not read its blocks."""

MAX_DISTINCT_TRACKED = 4096
"""Distinct block contents counted per layer at most (the evidence needs a handful, not all)."""


def partition_of(values: Sequence[Hashable]) -> Partition:
    """The ranks (indices of ``values``) grouped by equal value, in rank order."""
    classes: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        classes.setdefault(value, []).append(rank)
    return tuple(sorted(tuple(members) for members in classes.values()))


def meet(first: Partition, second: Partition) -> Partition:
    """The coarsest partition finer than both: ranks share a class only where they do in each."""
    where = {rank: index for index, members in enumerate(second) for rank in members}
    split: dict[tuple[int, int], list[int]] = {}
    for index, members in enumerate(first):
        for rank in members:
            split.setdefault((index, where.get(rank, -1 - rank)), []).append(rank)
    return tuple(sorted(tuple(members) for members in split.values()))


def runs(size: int, tp_size: int) -> Partition:
    """``tp_size`` ranks in runs of ``size`` consecutive ranks (``size`` divides ``tp_size``)."""
    return tuple(tuple(range(start, start + size)) for start in range(0, tp_size, size))


class Evidence(StrictModel):
    """What an observed partition rests on."""

    steps: StrictInt = Field(ge=0)
    """Observed steps that compared at least one block of this layer (or group)."""
    blocks: StrictInt = Field(ge=0)
    """Blocks compared across every TP rank with non-zero bytes on each: the evidence."""
    zero_blocks: StrictInt = Field(ge=0)
    """Blocks all zero on some rank: an unwritten cache is identical everywhere, so they prove nothing."""
    distinct_blocks: StrictInt = Field(ge=0)
    """Distinct contents among the compared blocks (rank 0's digests; counted up to 4096). Equal bytes
    seen over one repeated content say little about the next one."""


class LayerObservation(StrictModel):
    """One layer's observed partition."""

    name: str
    """The layer's name, as in the layout."""
    partition: tuple[tuple[StrictInt, ...], ...] = Field(max_length=4096)
    """TP ranks in classes of byte-identical blocks (empty: nothing compared)."""
    evidence: Evidence
    """What the partition rests on."""


class GroupObservation(StrictModel):
    """One KV-cache group's observation: its layers', and the group's own (their meet)."""

    index: StrictInt = Field(ge=0)
    """The group's index (its ``@group:`` number in store keys)."""
    name: str = ""
    """The group's name in the layout (may be empty)."""
    partition: tuple[tuple[StrictInt, ...], ...] = Field(max_length=4096)
    """TP ranks in classes holding the same bytes in every layer of the group (empty: nothing compared)."""
    evidence: Evidence
    """Summed over the group's layers (``steps``: steps that compared any of its blocks)."""
    layers: tuple[LayerObservation, ...]
    """Every layer of the group, in the layout's order."""


class DiscoveryReport(StrictModel):
    """Which TP ranks held byte-identical bytes, per group and layer, over an instance's first steps."""

    version: DocumentVersion
    """The document format version: 1."""
    kind: Literal["DiscoveryReport"]
    """Always ``DiscoveryReport``."""
    model: str = Field(min_length=1, max_length=1000)
    """The model served (vLLM's model name or path)."""
    source: Literal["engine", "simulation"]
    """``engine``: observed by the connector on a running vLLM instance; ``simulation``: by
    ``kvpolicy discover`` on simulated ranks holding the bytes the model holds."""
    topology: Topology
    """The instance's parallel layout."""
    steps: StrictInt = Field(ge=0)
    """Save steps observed in which every rank read its blocks."""
    failed_steps: StrictInt = Field(default=0, ge=0)
    """Save steps observed in which some rank could not read its blocks: they prove nothing (the
    rank's log says why)."""
    layout: Layout
    """The layout the instance planned (what ``kvpolicy_layout_out`` captures), one rank's values at
    ``topology``: the spec classes, fields and KV heads a proposed rule is keyed by."""
    groups: tuple[GroupObservation, ...]
    """One entry per group of ``layout``, in order."""

    @model_validator(mode="after")
    def _consistent(self) -> DiscoveryReport:
        problems = report_problems(self)
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, [
                InitErrorDetails(type=PydanticCustomError("invalid-value", "{message}", {"message": message}),
                                 loc=location, input=None)
                for location, message in problems[:100]
            ])
        return self


Location = tuple[str | int, ...]
"""Where in a report a problem is: the keys and list indices leading to it."""


def report_problems(report: DiscoveryReport) -> list[tuple[Location, str]]:
    """What makes a well-formed report inconsistent, each where it stands: groups that are not the
    layout's, partitions that are not partitions of the TP ranks (an empty class included), a group's
    partition or evidence that is not what its layers' make, more distinct contents than blocks, and
    an instance no plan could run (:func:`plan_problems`). The model refuses such a report, and
    ``kvpolicy validate`` locates each problem (KVP104); the connector's reports have none, and
    ``discover --propose`` and ``--check`` refuse nothing for it that validate accepts."""
    problems: list[tuple[Location, str]] = []
    tp_size = report.topology.tp_size
    if len(report.groups) != len(report.layout.groups):
        return [(("groups",), f"lists {len(report.groups)} groups; the report's layout has {len(report.layout.groups)}")]

    def check_partition(where: Location, partition: Partition) -> bool:
        if any(not members for members in partition):
            problems.append((where, f"{_listed(partition)} has an empty class; each class holds the ranks of one "
                                    "content, at least one (an empty partition says nothing was compared)"))
            return False
        ranks = [rank for members in partition for rank in members]
        if partition and sorted(ranks) != list(range(tp_size)):
            problems.append((where, f"{_listed(partition)} is not a partition of the TP ranks 0..{tp_size - 1} "
                                    "(each rank in exactly one class)"))
            return False
        return True

    def check_distinct(where: Location, evidence: Evidence) -> None:
        if evidence.distinct_blocks > evidence.blocks:
            problems.append(((*where, "evidence", "distinct_blocks"),
                             f"{evidence.distinct_blocks} distinct contents among {evidence.blocks} compared blocks; "
                             "distinct contents are counted among the blocks compared, so at most as many"))

    for position, group in enumerate(report.groups):
        at: Location = ("groups", position)
        if group.index != position:
            problems.append(((*at, "index"), f"index {group.index} at position {position}; groups are listed in order"))
        expected = [layer for member in report.layout.groups[position].members for layer in member.layers]
        listed = [layer.name for layer in group.layers]
        if listed != expected:
            problems.append(((*at, "layers"), f"group {position} lists layers {_short(listed)}; its layout's are {_short(expected)}"))
            continue
        valid = check_partition((*at, "partition"), group.partition)
        check_distinct(at, group.evidence)
        meets: Partition | None = None
        for index, layer in enumerate(group.layers):
            check_distinct((*at, "layers", index), layer.evidence)
            if not check_partition((*at, "layers", index, "partition"), layer.partition):
                valid = False
            elif bool(layer.partition) != (layer.evidence.blocks > 0):
                problems.append(((*at, "layers", index, "partition"),
                                 f"layer {layer.name}: a partition needs compared blocks and compared blocks a partition "
                                 f"({layer.evidence.blocks} compared)"))
            elif layer.partition:
                meets = parse_partition(layer.partition) if meets is None else meet(meets, layer.partition)
        if valid and parse_partition(group.partition) != (meets or ()):
            problems.append(((*at, "partition"), f"group {position}: {_listed(group.partition)} is not the meet of its "
                                                 f"layers' partitions, {_listed(meets or ())}"))
        sums = (sum(layer.evidence.blocks for layer in group.layers), sum(layer.evidence.zero_blocks for layer in group.layers))
        if (group.evidence.blocks, group.evidence.zero_blocks) != sums:
            problems.append(((*at, "evidence"), f"group {position}: {group.evidence.blocks} blocks and "
                                                f"{group.evidence.zero_blocks} all-zero are not its layers' sums, {sums[0]} and {sums[1]}"))
    return problems or plan_problems(report.layout, report.topology)


def plan_problems(layout: Layout, topology: Topology) -> list[tuple[Location, str]]:
    """What no policy could plan of the report's ``layout`` at its own ``topology``, each where it
    stands in the report: a topology the engine refuses for this layout (too many (group, rank)
    entries, sizes vLLM refuses together: :func:`kvpolicy.planning.engine.check_topology`), a spec expression
    that fails there, a group whose specs differ in block size there. The connector planned the
    instance it observed, so no report of it has any; a report that does is not of an instance."""
    label = topology_label(topology)
    try:
        check_topology(layout, topology)
    except PlanError as error:
        return [(("topology",), f"{label}: no plan is made at this topology, so no instance observed it: "
                                f"{error.problems[0].message}")]
    problems: list[tuple[Location, str]] = []
    evaluated: dict[tuple[int, int], Any] = {}
    for index, group in enumerate(layout.groups):
        block_sizes: dict[int, str] = {}
        for position, member in enumerate(group.members):
            spec = member.spec
            base: Location = ("layout", "groups", index, "spec") if group.uniform is None else (
                "layout", "groups", index, "uniform", position, "spec")
            for heads in dict.fromkeys(layout.layer_total_num_kv_heads(layer) for layer in member.layers):
                key = (id(spec), heads)
                if key not in evaluated:
                    try:
                        evaluated[key] = spec.evaluate(topology_variables(topology, heads, layout.total_num_kv_heads))
                    except ExpressionError as error:
                        evaluated[key] = None
                        attribute = error.attribute if isinstance(error, SpecExpressionError) else ()
                        problems.append(((*base, *attribute), f"group {index}: {spec.type} does not evaluate at the "
                                                              f"report's own topology, {label}: {error.message}"))
                values = evaluated[key]
                if values is not None:
                    block_sizes.setdefault(values.block_size, spec.type)
        if len(block_sizes) > 1:
            sizes = ", ".join(f"{size} ({name})" for size, name in block_sizes.items())
            problems.append((("layout", "groups", index), f"group {index}: its specs have block sizes {sizes} at {label}; "
                                                          "the layers of one vLLM KV-cache group share one block size"))
    return problems


def topology_label(topology: Topology) -> str:
    """``tp N`` and the other sizes above 1 (``tp 2, pp 4096, pcp 4096``)."""
    parts = [f"tp {topology.tp_size}"]
    parts += [f"{name} {value}" for name, value in (("pp", topology.pp_size), ("pcp", topology.pcp_size),
                                                     ("dcp", topology.dcp_size)) if value > 1]
    return ", ".join(parts)


def _listed(partition: Partition) -> str:
    return str([list(members) for members in partition])


def _short(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")


# --- accumulating ---------------------------------------------------------------------------------


@dataclass
class _Tally:
    partition: Partition | None = None
    steps: int = 0
    blocks: int = 0
    zero_blocks: int = 0
    distinct: set[str] = field(default_factory=set)

    def evidence(self) -> Evidence:
        return Evidence(steps=self.steps, blocks=self.blocks, zero_blocks=self.zero_blocks,
                        distinct_blocks=len(self.distinct))


@dataclass
class Observer:
    """Rank 0's running observation of one instance (``group_layers``: group → its layers in order).

    :meth:`observe` folds in one step's gathered :data:`RankObservation` of every TP rank. A step in
    which some rank failed to read its blocks is skipped whole (counted in :attr:`failed_steps`)."""

    tp_size: int
    group_layers: Sequence[Sequence[str]]
    steps: int = 0
    failed_steps: int = 0
    _layers: dict[tuple[int, str], _Tally] = field(default_factory=dict)
    _group_steps: dict[int, int] = field(default_factory=dict)

    def observe(self, gathered: Sequence[RankObservation]) -> None:
        if len(gathered) != self.tp_size:
            raise ValueError(f"expected {self.tp_size} ranks' observations, got {len(gathered)}")
        self.steps += 1
        if any(rank is None for rank in gathered):
            self.failed_steps += 1
            return
        reports: list[Mapping[int, Mapping[str, Sequence[BlockDigest]]]] = [rank for rank in gathered if rank is not None]
        for group, layers in enumerate(self.group_layers):
            compared = False
            for layer in layers:
                per_rank = [report.get(group, {}).get(layer) for report in reports]
                if any(blocks is None for blocks in per_rank) or not per_rank[0]:
                    continue
                lengths = {len(blocks) for blocks in per_rank if blocks is not None}
                if len(lengths) != 1:
                    continue  # ranks saved different blocks: not comparable (cannot happen on one metadata)
                tally = self._layers.setdefault((group, layer), _Tally())
                tally.steps += 1
                compared = True
                for position in range(lengths.pop()):
                    digests = [blocks[position] for blocks in per_rank if blocks is not None]
                    if any(all_zero for _, all_zero in digests):
                        tally.zero_blocks += 1
                        continue
                    tally.blocks += 1
                    if len(tally.distinct) < MAX_DISTINCT_TRACKED:
                        tally.distinct.add(digests[0][0])
                    seen = partition_of([value for value, _ in digests])
                    tally.partition = seen if tally.partition is None else meet(tally.partition, seen)
            if compared:
                self._group_steps[group] = self._group_steps.get(group, 0) + 1

    def layer(self, group: int, layer: str) -> LayerObservation:
        tally = self._layers.get((group, layer), _Tally())
        return LayerObservation(name=layer, partition=tally.partition or (), evidence=tally.evidence())

    def groups(self, names: Sequence[str] = ()) -> tuple[GroupObservation, ...]:
        found = []
        for group, layer_names in enumerate(self.group_layers):
            layers = tuple(self.layer(group, layer) for layer in layer_names)
            partition: Partition | None = None
            for observed in layers:
                if observed.partition:
                    partition = observed.partition if partition is None else meet(partition, observed.partition)
            evidence = Evidence(
                steps=self._group_steps.get(group, 0),
                blocks=sum(layer.evidence.blocks for layer in layers),
                zero_blocks=sum(layer.evidence.zero_blocks for layer in layers),
                distinct_blocks=min(MAX_DISTINCT_TRACKED, sum(layer.evidence.distinct_blocks for layer in layers)),
            )
            found.append(GroupObservation(
                index=group, name=names[group] if group < len(names) else "", partition=partition or (),
                evidence=evidence, layers=layers,
            ))
        return tuple(found)

    def report(self, *, model: str, source: Literal["engine", "simulation"], topology: Topology, layout: Layout) -> DiscoveryReport:
        names = [group.name or "" for group in layout.groups]
        return DiscoveryReport(
            version=1, kind="DiscoveryReport", model=model, source=source, topology=topology,
            steps=self.steps - self.failed_steps, failed_steps=self.failed_steps, layout=layout,
            groups=self.groups(names),
        )


def group_layers(layout: Layout) -> tuple[tuple[str, ...], ...]:
    """Each group's layers in the layout's order: what an :class:`Observer` is built with."""
    return tuple(tuple(layer for member in group.members for layer in member.layers) for group in layout.groups)


# --- writing --------------------------------------------------------------------------------------


def report_data(report: DiscoveryReport) -> dict[str, Any]:
    """The report as plain data in its document order (partitions as lists of lists)."""

    def partition(value: Partition) -> list[list[int]]:
        return flow([list(members) for members in value])

    return {
        "version": report.version,
        "kind": report.kind,
        "model": report.model,
        "source": report.source,
        "topology": dict(report.topology.model_dump()),
        "steps": report.steps,
        "failed_steps": report.failed_steps,
        "groups": [
            {
                "index": group.index,
                "name": group.name,
                "partition": partition(group.partition),
                "evidence": dict(group.evidence.model_dump()),
                "layers": [
                    {"name": layer.name, "partition": partition(layer.partition), "evidence": layer.evidence.model_dump()}
                    for layer in group.layers
                ],
            }
            for group in report.groups
        ],
        "layout": layout_data(report.layout),
    }


def dump_report(report: DiscoveryReport, *, schema: str | None = None) -> str:
    """``report`` as YAML that :func:`kvpolicy.documents.loader.check_file` reads back equal."""
    header = f"# yaml-language-server: $schema={schema}\n" if schema else ""
    return header + yaml_text(report_data(report))


def parse_partition(value: Iterable[Iterable[int]]) -> Partition:
    return tuple(sorted(tuple(sorted(members)) for members in value))

