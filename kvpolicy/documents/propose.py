"""From observations to a policy: ``kvpolicy discover --propose`` (pure).

Discovery reports (:mod:`kvpolicy.evidence.discovery`) say, per layer, which TP ranks held byte-identical bytes.
:func:`propose` reads one or more of them (one model at several TP sizes, several models) and writes a
policy whose rules reproduce every observed partition:

* each observed partition must be one the plan can express — the replica sets of some head factor
  ``h`` (runs of ``h`` consecutive ranks, those of equal dcp rank together) — and rest on enough
  evidence (:data:`MIN_BLOCKS` blocks of :data:`MIN_DISTINCT` distinct contents); otherwise the
  layer is refused with a located, one-line reason and no rule is concluded from it;
* layers are keyed by spec class; a class whose layers need different factors is split by the spec
  field whose values tell them apart, else by layer names;
* per key, observed at two TP sizes or more: the first of factor 1 (``sharded``),
  ``max(1, tp_size // total_num_kv_heads)`` (attention specs) and ``tp_size`` (``replicated``) that
  fits every observation — the least replicated first, so that a formula never repeats bytes the
  evidence does not show repeated; observed at one TP size, or fitting no formula: a literal factor
  per observed TP size (``when: tp_size == N``), which says nothing about other TP sizes (they fall to
  ``unmatched: sharded``).

Rules by layer names match each name alone (glob characters escaped, :func:`escape_glob`).

The proposal is checked before it is returned: read back, and planned on every report's layout and
topology, it must give each layer the observed head factor and each group the replica sets its
observed layers make (:func:`differences`). Where it does not, nothing is proposed: each reason is a
located refusal, never an exception.

:func:`check_policy` is ``discover --check``: a policy against reports, each departure dangerous (the
plan puts ranks that held different bytes in one replica set) or harmless (it keeps apart ranks that
held the same bytes), and layers with no evidence left unjudged, with the exit code of the worst.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvpolicy.documents.loader import check_text, load_policy, read_text
from kvpolicy.evidence.discovery import (
    DiscoveryReport,
    GroupObservation,
    LayerObservation,
    Partition,
    parse_partition,
    topology_label,
)
from kvpolicy.language.diagnostics import Diagnostic, DocumentError, PlanError, printable_path
from kvpolicy.language.dumper import yaml_text
from kvpolicy.language.expressions import ExpressionError
from kvpolicy.language.models import Policy, Topology, topology_variables
from kvpolicy.language.yamlsource import SourceMap, parse
from kvpolicy.planning.engine import make_plan, replica_partition
from kvpolicy.planning.plan import GroupPlan

__all__ = [
    "EXIT_AGREES",
    "EXIT_DANGEROUS",
    "EXIT_DIFFERS",
    "EXIT_NO_EVIDENCE",
    "MIN_BLOCKS",
    "MIN_DISTINCT",
    "Difference",
    "LoadedReport",
    "Proposal",
    "check_policy",
    "differences",
    "disagreements",
    "escape_glob",
    "head_factor_of",
    "load_reports",
    "observation_summary",
    "propose",
    "shown_partition",
]

MIN_BLOCKS = 4
"""Blocks compared (non-zero on every rank) a layer's observation needs before a rule rests on it."""
MIN_DISTINCT = 2
"""Distinct block contents among them: equal bytes over one repeated content prove little."""
MAX_EVIDENCE_LINES = 4
"""Observations named in a rule's evidence comment; the rest are counted."""

HEADS_FACTOR = "max(1, tp_size // total_num_kv_heads)"


@dataclass(frozen=True)
class LoadedReport:
    path: str
    report: DiscoveryReport
    source: SourceMap


def load_reports(paths: Sequence[str]) -> tuple[list[LoadedReport], list[Diagnostic]]:
    """Every report in ``paths``, validated; every problem of every file, located."""
    loaded: list[LoadedReport] = []
    problems: list[Diagnostic] = []
    for path in paths:
        try:
            text = read_text(path)
        except DocumentError as error:
            problems.extend(error.diagnostics)
            continue
        document, found = check_text(text, str(path))
        problems.extend(found)
        if document is None:
            continue
        if not isinstance(document, DiscoveryReport):
            problems.append(Diagnostic(str(path), 1, 1, "error", f"expected a DiscoveryReport, found a {document.kind}", "KVP101"))
            continue
        _, source, _ = parse(text, str(path))
        loaded.append(LoadedReport(str(path), document, source))
    return loaded, [problem for problem in problems if problem.severity == "error"]


# --- what was seen --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sighting:
    """One layer as one report saw it."""

    report: LoadedReport
    group: int
    position: int
    layer: str
    spec_type: str
    classes: tuple[str, ...]
    fields: Mapping[str, Any]
    heads: int
    partition: Partition
    head_factor: int

    @property
    def tp(self) -> int:
        return self.report.report.topology.tp_size

    @property
    def model(self) -> str:
        return self.report.report.model


def thin(layer: LayerObservation) -> bool:
    """Whether a layer's observation rests on too little to conclude (or judge) a rule from."""
    evidence = layer.evidence
    return evidence.blocks < MIN_BLOCKS or evidence.distinct_blocks < MIN_DISTINCT or not layer.partition


def head_factor_of(partition: Partition, topology: Topology) -> int | None:
    """The head factor whose replica sets are ``partition`` (what a rule's factor states), or None:
    none where no factor's replica sets are the partition, or only a factor the plan refuses (under
    decode-context parallelism, one whose runs split into replica sets of different sizes)."""
    return _expressible(topology.tp_size, topology.pcp_size, topology.dcp_size).get(parse_partition(partition))


@functools.lru_cache(maxsize=8)
def _expressible(tp_size: int, pcp_size: int, dcp_size: int) -> dict[Partition, int]:
    """Every partition of the TP ranks a plan can give them, with its head factor: the replica sets of
    each divisor of ``tp_size`` whose sets are all of one size (the engine refuses the others). A few
    dozen partitions of ``tp_size`` ranks each, worked out once per topology (the last few kept)."""
    topology = Topology(tp_size=tp_size, pcp_size=pcp_size, dcp_size=dcp_size)
    found: dict[Partition, int] = {}
    for factor in range(1, tp_size + 1):
        if tp_size % factor == 0:
            partition = replica_partition(factor, topology)
            if len({len(members) for members in partition}) == 1:
                found.setdefault(partition, factor)
    return found


def _refines(finer: Partition, coarser: Partition) -> bool:
    """Whether every class of ``finer`` lies within one class of ``coarser``: the ranks a plan puts in
    one replica set (``finer``) all held the same bytes (``coarser``)."""
    where = {rank: index for index, members in enumerate(coarser) for rank in members}
    return all(len({where.get(rank, -1 - rank) for rank in members}) == 1 for members in finer)


def escape_glob(name: str) -> str:
    """``name`` as a ``match.layers`` glob matching that name alone (fnmatch: ``*``, ``?`` and ``[``
    each in brackets)."""
    return re.sub(r"[*?[]", lambda found: f"[{found.group()}]", name)


def _sightings(loaded: LoadedReport, refusals: list[Diagnostic]) -> list[_Sighting]:
    report = loaded.report
    topology = report.topology
    layout = report.layout
    found: list[_Sighting] = []
    for group_index, (group, observed) in enumerate(zip(layout.groups, report.groups, strict=True)):
        specs = {layer: member.spec for member in group.members for layer in member.layers}
        scant: list[tuple[int, str]] = []
        odd: list[tuple[int, str]] = []
        for position, layer in enumerate(observed.layers):
            spec = specs[layer.name]
            heads = layout.layer_total_num_kv_heads(layer.name)
            evidence = layer.evidence
            where = f"layer {layer.name} ({spec.type}, group {group_index}, tp {topology.tp_size})"
            if thin(layer):
                scant.append((position, (
                    f"{where}: too little evidence to conclude: {evidence.blocks} blocks compared "
                    f"({evidence.zero_blocks} all-zero, {evidence.distinct_blocks} distinct) over {evidence.steps} steps; "
                    f"a rule needs {MIN_BLOCKS} blocks of {MIN_DISTINCT} distinct contents: observe more steps "
                    "(kvpolicy_discover_steps) with prompts of several blocks"
                )))
                continue
            partition = parse_partition(layer.partition)
            factor = head_factor_of(partition, topology)
            if factor is None:
                odd.append((position, (
                    f"{where}: ranks held equal bytes in classes {[list(c) for c in partition]}, which are not the "
                    f"replica sets of any factor at {topology_label(topology)} (runs of consecutive ranks of one size); "
                    "no rule can express it, so none is proposed"
                )))
                continue
            try:
                values = spec.evaluate(topology_variables(topology, heads, layout.total_num_kv_heads))
            except ExpressionError as error:
                refusals.append(loaded.source.diagnostic(
                    ("layout", "groups", group_index), f"{where}: the report's layout does not evaluate at its own "
                    f"topology: {error.message}", code="KVP104",
                ))
                continue
            found.append(_Sighting(loaded, group_index, position, layer.name, values.type, values.classes,
                                   values.fields, heads, partition, factor))
        for code, items, what in (("KVP401", scant, "evidence"), ("KVP402", odd, "partition")):
            if items:
                position, message = items[0]
                more = f" (and {len(items) - 1} more layers of group {group_index} alike)" if len(items) > 1 else ""
                refusals.append(loaded.source.diagnostic(("groups", group_index, "layers", position, what),
                                                         message + more, code=code, prefer_key=what == "evidence"))
    return found


# --- fitting --------------------------------------------------------------------------------------

_Outcome = tuple[tuple[tuple[str, Any], ...], ...]
"""Rule bodies (key, value pairs: ``when``, ``replication`` / ``factor``) that together give a key's factors."""


def _formulas(sighting: _Sighting) -> Iterable[tuple[Callable[[_Sighting], int | None], _Outcome]]:
    yield (lambda s: 1), ((("replication", "sharded"),),)
    if "AttentionSpec" in sighting.classes:
        yield (lambda s: max(1, s.tp // s.heads) if s.heads else None), ((("factor", HEADS_FACTOR),),)
    yield (lambda s: s.tp), ((("replication", "replicated"),),)


def _fit(sightings: Sequence[_Sighting]) -> _Outcome | None:
    """The rules giving every sighting its head factor: a formula that fits them all (observed at two
    TP sizes or more), else a literal per TP size; None when the sightings at one TP size need
    different literals."""
    by_tp: dict[int, set[int]] = {}
    for sighting in sightings:
        by_tp.setdefault(sighting.tp, set()).add(sighting.head_factor)
    if len(by_tp) >= 2:
        for formula, outcome in _formulas(sightings[0]):
            if all(formula(sighting) == sighting.head_factor for sighting in sightings):
                return outcome
    if any(len(factors) > 1 for factors in by_tp.values()):
        return None
    return tuple(
        (("when", f"tp_size == {tp}"), ("factor", str(next(iter(factors))))) for tp, factors in sorted(by_tp.items())
    )


def _invariant_scalar_fields(sightings: Sequence[_Sighting]) -> list[str]:
    """Fields every sighting has, of scalar value, the same for a layer at every TP size (a field that
    changes with TP, such as per-rank heads or shapes, would split one layer's observations)."""
    names = set.intersection(*(set(s.fields) for s in sightings))
    usable = []
    for name in sorted(names):
        values: dict[tuple[str, str], Any] = {}
        if all(_scalar(s.fields[name]) and values.setdefault((s.model, s.layer), s.fields[name]) == s.fields[name]
               for s in sightings):
            usable.append(name)
    return usable


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, str))


@dataclass(frozen=True)
class _Rule:
    spec_type: str
    depth: int
    fields: tuple[tuple[str, Any], ...]
    layers: tuple[str, ...]
    outcome: _Outcome
    sightings: tuple[_Sighting, ...]


def _rules_for_class(spec_type: str, sightings: list[_Sighting], refusals: list[Diagnostic]) -> list[_Rule]:
    depth = max(len(s.classes) for s in sightings)
    outcome = _fit(sightings)
    if outcome is not None:
        return [_Rule(spec_type, depth, (), (), outcome, tuple(sightings))]
    for name in _invariant_scalar_fields(sightings):
        split: dict[Any, list[_Sighting]] = {}
        for sighting in sightings:
            split.setdefault(sighting.fields[name], []).append(sighting)
        outcomes = {value: _fit(part) for value, part in split.items()}
        if len(split) > 1 and all(found is not None for found in outcomes.values()):
            return [
                _Rule(spec_type, depth, ((name, value),), (), outcomes[value], tuple(part))  # type: ignore[arg-type]
                for value, part in sorted(split.items(), key=lambda item: repr(item[0]))
            ]
    by_layer: dict[str, list[_Sighting]] = {}
    for sighting in sightings:
        by_layer.setdefault(sighting.layer, []).append(sighting)
    merged: dict[_Outcome, list[_Sighting]] = {}
    for layer, part in by_layer.items():
        found = _fit(part)
        if found is None:
            tp = next(tp for tp in sorted({s.tp for s in part}) if len({s.head_factor for s in part if s.tp == tp}) > 1)
            at_tp = [s for s in part if s.tp == tp]
            first = at_tp[0]
            other = next(s for s in at_tp if s.head_factor != first.head_factor)
            refusals.append(other.report.source.diagnostic(
                ("groups", other.group, "layers", other.position, "partition"),
                f"layer {layer} ({spec_type}, tp {tp}): observed with head factor {other.head_factor} here and "
                f"{first.head_factor} in {first.report.path} (model {first.model}); observations of one layer name at "
                "one TP size contradict each other, so no rule is proposed for it",
                code="KVP403",
            ))
            continue
        merged.setdefault(found, []).extend(part)
    return [
        _Rule(spec_type, depth, (), tuple(dict.fromkeys(s.layer for s in part)), outcome, tuple(part))
        for outcome, part in merged.items()
    ]


# --- writing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proposal:
    text: str
    """The proposed policy, as YAML with a comment per rule naming its evidence."""
    policy: Policy
    """The same, loaded."""


def _printable(text: str) -> str:
    """``text`` on one line, for a comment: control characters escaped, at most 200 characters."""
    shown = printable_path(text)
    return shown if len(shown) <= 200 else shown[:200] + "..."


def _kebab(name: str) -> str:
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", name).lower()
    return re.sub(r"[^a-z0-9]+", "-", words).strip("-") or "spec"


def _evidence_lines(rule: _Rule) -> list[str]:
    seen: dict[tuple[str, str, int], list[_Sighting]] = {}
    for sighting in rule.sightings:
        seen.setdefault((sighting.report.path, sighting.model, sighting.tp), []).append(sighting)
    lines = []
    for (path, model, tp), part in list(seen.items())[:MAX_EVIDENCE_LINES]:
        blocks = sum(s.report.report.groups[s.group].layers[s.position].evidence.blocks for s in part)
        distinct = sum(s.report.report.groups[s.group].layers[s.position].evidence.distinct_blocks for s in part)
        partitions = sorted({str([list(c) for c in s.partition]) for s in part})
        lines.append(
            f"#   {_printable(model)} at tp {tp} ({printable_path(path)}): {len(part)} layer{'s' if len(part) > 1 else ''}, "
            f"{blocks} blocks ({distinct} distinct) compared, ranks with equal bytes: {' / '.join(partitions)}"
        )
    if len(seen) > MAX_EVIDENCE_LINES:
        lines.append(f"#   and {len(seen) - MAX_EVIDENCE_LINES} more observations")
    return lines


def _render(rules: list[_Rule], loaded: Sequence[LoadedReport], name: str) -> str:
    default = load_policy("default")
    header = [
        f"# Proposed by 'kvpolicy discover --propose' from {len(loaded)} report{'s' if len(loaded) != 1 else ''}:",
        *(f"#   {printable_path(item.path)}: {_printable(item.report.model)} at {topology_label(item.report.topology)} "
          f"({item.report.source}, {item.report.steps} steps)" for item in loaded[:MAX_EVIDENCE_LINES]),
        *([f"#   and {len(loaded) - MAX_EVIDENCE_LINES} more"] if len(loaded) > MAX_EVIDENCE_LINES else []),
        *([
            "# Some observations come from the simulation, which holds what kvpolicy.sim.archetypes.physical_factor",
            "# states for vLLM's own spec classes (MLA whole on every rank, Mamba state split unless tp_replicated,",
            "# any other class repeated by KV heads as attention is): its rules restate that model, not a measurement.",
            "# 'kvpolicy discover --layout' refuses a class vLLM does not ship; observe a new state type on an engine",
            "# (the connector's kvpolicy_discover) before trusting its rule.",
        ] if any(item.report.source == "simulation" for item in loaded) else []),
        "# Review it, compare it with the policy you run (kvpolicy diff CURRENT THIS --layout L --tp N),",
        "# and deploy it with the audit on.",
    ]
    head = {
        "version": 1,
        "kind": "ReplicationPolicy",
        "name": name,
        "description": "Rules observed by kvpolicy discover: each reproduces the partitions of TP ranks into equal "
        "bytes named in its comment. Layers no rule matches stay sharded.",
        "key": {"template": default.key.template},
        "audit": {"mode": "warn", "steps": default.audit.steps},
    }
    body = ["rules:"] if rules else ["rules: []"]
    used: set[str] = set()
    for rule in rules:
        for index, outcome in enumerate(rule.outcome):
            base = _kebab(rule.spec_type)
            if rule.fields:
                base += "-" + "-".join(_kebab(f"{key}-{value}") for key, value in rule.fields)
            if rule.layers:
                base += "-layers"
            literal = dict(outcome).get("when")
            if literal:
                base += "-tp" + literal.split("==")[1].strip()
            rule_name = base[:120]
            suffix = 2
            while rule_name in used:
                rule_name = f"{base[:110]}-{suffix}"
                suffix += 1
            used.add(rule_name)
            match: dict[str, Any] = {"spec": rule.spec_type}
            if rule.fields:
                match["fields"] = dict(rule.fields)
            if rule.layers:
                match["layers"] = [escape_glob(layer) for layer in rule.layers]
            entry: dict[str, Any] = {"name": rule_name, "reason": _reason(rule, dict(outcome)), "match": match}
            entry.update(outcome)
            if index == 0:
                body.append("  # evidence:")
                body.extend("  " + line for line in _evidence_lines(rule))
            rendered = yaml_text([entry]).rstrip("\n").splitlines()
            body.extend("  " + line for line in rendered)
    return "\n".join(header) + "\n" + yaml_text(head) + "\n".join(body) + "\n"


def _reason(rule: _Rule, outcome: Mapping[str, Any]) -> str:
    tps = sorted({s.tp for s in rule.sightings})
    if "when" in outcome:
        factor = int(outcome["factor"])
        at = f"at tp {tps[0]}" if len(tps) == 1 else "at " + outcome["when"].replace("tp_size == ", "tp ")
        what = (f"every TP rank held distinct bytes {at}" if factor == 1
                else f"runs of {factor} consecutive ranks held the same bytes {at}")
    elif outcome.get("replication") == "sharded":
        what = "every TP rank held distinct bytes"
    elif outcome.get("replication") == "replicated":
        what = "every TP rank held the same bytes"
    else:
        what = "runs of tp_size // KV heads consecutive ranks held the same bytes"
    return f"Observed: {what} (tp {', '.join(map(str, tps))}; {len(rule.sightings)} layer observations)."


# --- proposing ------------------------------------------------------------------------------------


def propose(loaded: Sequence[LoadedReport], *, name: str = "discovered") -> tuple[Proposal | None, list[Diagnostic]]:
    """The policy the reports support, or None with every reason it cannot be concluded (located)."""
    refusals: list[Diagnostic] = []
    sightings = [sighting for item in loaded for sighting in _sightings(item, refusals)]
    by_class: dict[str, list[_Sighting]] = {}
    for sighting in sightings:
        by_class.setdefault(sighting.spec_type, []).append(sighting)
    rules = [rule for spec_type, part in by_class.items() for rule in _rules_for_class(spec_type, part, refusals)]
    if refusals:
        return None, sorted(refusals)
    # Most specific first: a rule names a class and matches its subclasses too, so derived classes go
    # before their bases; rules narrowed by layer names or field values go before the class's own.
    rules.sort(key=lambda rule: (-rule.depth, rule.spec_type, not rule.layers, not rule.fields))
    text = _render(rules, loaded, name)
    refusals = _self_check(text, name, loaded)
    if refusals:
        return None, sorted(refusals)
    policy = check_text(text, f"<proposal {name}>")[0]
    assert isinstance(policy, Policy)  # _self_check read it back
    return Proposal(text, policy), []


def _self_check(text: str, name: str, loaded: Sequence[LoadedReport]) -> list[Diagnostic]:
    """Why the proposal ``text`` is not what the reports support, each located in a report: it does
    not read back as a policy, or planned on a report's layout and topology it refuses or departs from
    an observation. Empty when it reproduces every observed partition."""
    policy, problems = check_text(text, f"<proposal {name}>")
    errors = [problem for problem in problems if problem.severity == "error"]
    if policy is None or errors or not isinstance(policy, Policy):
        first = errors[0] if errors else None
        why = f"{first.message} (line {first.line} of the proposal)" if first else "it is no ReplicationPolicy"
        return [loaded[0].source.diagnostic(
            (), f"the policy proposed from these reports does not read back ({why}); nothing is proposed",
            code=first.code if first else "KVP101",
        )]
    refusals: list[Diagnostic] = []
    for item in loaded:
        try:
            found = differences(policy, item.report)
        except PlanError as error:
            refusals.append(item.source.diagnostic(
                ("topology",), f"the rules proposed cannot plan {_printable(item.report.model)} at "
                f"{topology_label(item.report.topology)}: {error.problems[0].message}; nothing is proposed",
                code="KVP301",
            ))
            continue
        departures = [difference for difference in found if difference.kind != "unjudged"]
        by_layer = {difference.group for difference in departures if difference.layers}
        refusals.extend(
            item.source.diagnostic(
                difference.location, f"the rules proposed do not reproduce this observation: {difference.message}; "
                "nothing is proposed", code="KVP402",
            )
            for difference in departures
            if difference.layers or difference.group not in by_layer  # a group's sets follow from its layers'
        )
    return refusals


# --- a policy against observations ----------------------------------------------------------------

MAX_SHOWN_RANKS = 64
"""Ranks a partition shows in a message; a larger one is cut (TP 4096 lists 4096 ranks)."""


Kind = Literal["dangerous", "harmless", "unjudged"]


@dataclass(frozen=True)
class Difference:
    """Where a policy's plan departs from one report's observation: a group's layers alike in how
    (named once), a group's replica sets, or layers observed on too little evidence to judge."""

    kind: Kind
    """``dangerous``: the plan puts ranks observed holding different bytes in one replica set (a warm
    hit would load another rank's state); ``harmless``: the plan keeps apart ranks that held the same
    bytes (it writes more than needed); ``unjudged``: no or too little evidence to tell."""
    group: int
    message: str
    """One line naming the group and layers, what was planned and what was observed."""
    location: tuple[str | int, ...]
    """Where in the report the observation stands (its first layer's, for several)."""
    layers: int = 1
    """Layers it stands for (0 for a group's replica sets)."""


def differences(policy: Policy, report: DiscoveryReport) -> list[Difference]:
    """Where ``policy``, planned on the report's layout and topology, departs from what was observed:
    layers given another head factor (or observed in classes no factor expresses), a group given other
    replica sets than its observed layers make; and layers observed on too little evidence
    (:func:`thin`), which are not judged, nor their group's replica sets. Raises :class:`PlanError`
    when the policy cannot plan the layout there.

    A group's observed partition is the meet of its layers'; where no factor expresses it (layers of
    factors 2 and 3 at TP 6), a plan can do no better than the gcd of its layers' factors, and that is
    what the group is held to. Work is linear in layers x TP ranks."""
    topology = report.topology
    plan = make_plan(policy, report.layout, topology)
    found: list[Difference] = []
    for group, observed in zip(plan.groups, report.groups, strict=True):
        found.extend(_group_differences(group, observed, topology))
    return found


def _group_differences(group: GroupPlan, observed: GroupObservation, topology: Topology) -> list[Difference]:
    index = group.index
    label = f"group {index} ({group.name})"
    decisions = {decision.layer: decision for decision in group.decisions}
    alike: dict[tuple[Kind, str], list[tuple[int, str]]] = {}
    unjudged: dict[bool, list[tuple[int, LayerObservation]]] = {}
    observed_factors: list[int | None] = []
    for position, layer in enumerate(observed.layers):
        if thin(layer):
            unjudged.setdefault(layer.evidence.blocks == 0, []).append((position, layer))
            continue
        partition = parse_partition(layer.partition)
        factor = head_factor_of(partition, topology)
        observed_factors.append(factor)
        planned = decisions[layer.name].factor
        if planned == factor:
            continue
        kind: Kind = "harmless" if _refines(replica_partition(planned, topology), partition) else "dangerous"
        if factor is None:
            what = f"observed {shown_partition(partition)}, which no factor expresses; planned head factor {planned}"
        else:
            what = f"planned head factor {planned}, observed {factor}"
        alike.setdefault((kind, what), []).append((position, layer.name))
    found = [
        Difference(kind, index, f"group {index} {_layers_label([name for _, name in layers])}: {what}",
                   ("groups", index, "layers", layers[0][0], "partition"), len(layers))
        for (kind, what), layers in alike.items()
    ]
    for empty, layers in sorted(unjudged.items(), reverse=True):
        names = _layers_label([layer.name for _, layer in layers])
        if empty:
            zero = sum(layer.evidence.zero_blocks for _, layer in layers)
            what = (f"no evidence: its {zero} blocks were all zero on some rank, which proves nothing" if zero
                    else "no evidence: no block of it was observed")
        else:
            blocks = sum(layer.evidence.blocks for _, layer in layers)
            distinct = sum(layer.evidence.distinct_blocks for _, layer in layers)
            what = (f"too little evidence: {blocks} blocks ({distinct} distinct) compared; judging a layer takes "
                    f"{MIN_BLOCKS} blocks of {MIN_DISTINCT} distinct contents")
        found.append(Difference("unjudged", index, f"{label} {names}: {what}",
                                ("groups", index, "layers", layers[0][0], "evidence"), len(layers)))
    if unjudged or not observed.layers:
        return found
    firsts = {rank.replica_set[0]: rank.replica_set for rank in group.ranks}  # by first rank: never hashed whole
    planned_sets = tuple(firsts[first] for first in sorted(firsts))
    seen = parse_partition(observed.partition)
    if planned_sets == seen:
        return found
    factors = [factor for factor in observed_factors if factor is not None]
    if len(factors) == len(observed_factors):
        best = replica_partition(math.gcd(*factors), topology)
        if planned_sets == best:  # the observed meet is no factor's: the plan cannot do better
            return found
    sets: Kind = "harmless" if _refines(planned_sets, seen) else "dangerous"
    what = f"planned replica sets {shown_partition(planned_sets)}, observed {shown_partition(seen)}"
    found.append(Difference(sets, index, f"{label}: {what}", ("groups", index, "partition"), 0))
    return found


EXIT_AGREES = 0
"""``discover --check``: the policy plans every observed group and layer as observed."""
EXIT_DIFFERS = 1
"""``discover --check``: the policy departs from the observations only harmlessly (it keeps apart ranks
that held the same bytes, and writes them more than once), or it cannot plan a report (located errors),
or an input is invalid."""
EXIT_NO_EVIDENCE = 3
"""``discover --check``: some observed layer rests on no (or too little) evidence to judge it, and
nothing judged is dangerous: not a pass, since what was not observed may be either."""
EXIT_DANGEROUS = 4
"""``discover --check``: the policy puts in one replica set ranks observed holding different bytes:
with it, a warm hit loads another rank's state."""
_SEVERITY = (EXIT_AGREES, EXIT_DIFFERS, EXIT_NO_EVIDENCE, EXIT_DANGEROUS)
"""Exit codes from least to most severe: the worst found is the exit code."""
MAX_LINES_PER_REPORT = 50
"""Lines ``discover --check`` prints per report at most; the rest are counted."""


def check_policy(policy: Policy, loaded: Sequence[LoadedReport]) -> tuple[list[str], int]:
    """``kvpolicy discover --check``: the lines to print and the exit code. The first line is the
    verdict (``DANGEROUS``, ``NO EVIDENCE``, harmless differences, or agreement, with the exit code);
    then, per report, its differences, the dangerous first, alike layers of a group on one line; a
    report the policy cannot plan gives its plan errors, located (at the report's topology where the
    engine names no place in the policy)."""
    body: list[str] = []
    totals = {"dangerous": 0, "harmless": 0, "unjudged": 0}
    refused = 0
    code = EXIT_AGREES
    for item in loaded:
        report = item.report
        label = (f"{printable_path(item.path)}: policy {policy.name} vs {_printable(report.model)} at "
                 f"{topology_label(report.topology)}")
        try:
            found = differences(policy, report)
        except PlanError as error:
            refused += 1
            code = max(code, EXIT_DIFFERS, key=_SEVERITY.index)
            body.append(f"{label}: the policy cannot plan it")
            for problem in error.problems[:MAX_LINES_PER_REPORT]:
                if problem.location:
                    body.append(f"{printable_path(problem.location)}: error: {_one_line(problem.message)} [KVP301]")
                else:
                    body.append(str(item.source.diagnostic(("topology",), problem.message, code="KVP301")))
            continue
        counts = {kind: sum(d.layers or 1 for d in found if d.kind == kind) for kind in totals}
        for kind, count in counts.items():
            totals[kind] += count
        if counts["dangerous"]:
            code = EXIT_DANGEROUS
        elif counts["unjudged"]:
            code = max(code, EXIT_NO_EVIDENCE, key=_SEVERITY.index)
        elif counts["harmless"]:
            code = max(code, EXIT_DIFFERS, key=_SEVERITY.index)
        departures = counts["dangerous"] + counts["harmless"]
        said = []
        if departures:
            said.append(f"{departures} difference{'s' if departures != 1 else ''}, "
                        + (f"{counts['dangerous']} DANGEROUS" if counts["dangerous"] else "all harmless"))
        if counts["unjudged"]:
            said.append(f"no evidence to judge {counts['unjudged']} layer{'s' if counts['unjudged'] != 1 else ''}")
        body.append(f"{label}: {'; '.join(said) if said else 'agrees with every observed group and layer'}")
        order = {"dangerous": 0, "harmless": 1, "unjudged": 2}
        lines = [f"  {_KIND_WORDS[d.kind]}: {d.message}" for d in sorted(found, key=lambda d: (order[d.kind], d.group))]
        body.extend(lines[:MAX_LINES_PER_REPORT])
        if len(lines) > MAX_LINES_PER_REPORT:
            body.append(f"  ... and {len(lines) - MAX_LINES_PER_REPORT} more")
    reports = f"{len(loaded)} report{'s' if len(loaded) != 1 else ''}"
    if code == EXIT_DANGEROUS:
        verdict = (f"DANGEROUS: policy {policy.name} puts ranks observed holding different bytes in one replica set "
                   f"({totals['dangerous']} place{'s' if totals['dangerous'] != 1 else ''} in {reports}): it treats "
                   "sharded state as replicated, and a warm hit would load another rank's state")
    elif code == EXIT_NO_EVIDENCE:
        verdict = (f"NO EVIDENCE: {totals['unjudged']} observed layer{'s' if totals['unjudged'] != 1 else ''} of "
                   f"{reports} compared no (or too few) blocks, so policy {policy.name} cannot be judged there; "
                   "observe more steps with prompts of several blocks")
    elif code == EXIT_DIFFERS:
        parts = []
        if totals["harmless"]:
            parts.append(f"departs harmlessly from {reports} in {totals['harmless']} place"
                         f"{'s' if totals['harmless'] != 1 else ''} (it writes bytes ranks hold alike more than once)")
        if refused:
            parts.append(f"cannot plan {refused} of {reports} (errors below)")
        verdict = f"policy {policy.name} {' and '.join(parts)}"
    else:
        verdict = f"policy {policy.name} agrees with every observed group and layer of {reports}"
    return [f"{verdict} (exit {code})", *body], code


_KIND_WORDS = {"dangerous": "DANGEROUS", "harmless": "harmless", "unjudged": "not judged"}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def disagreements(policy: Policy, report: DiscoveryReport) -> list[str]:
    """:func:`differences` that are departures (not layers left unjudged), one line each; a policy
    that cannot plan the layout is one disagreement."""
    try:
        found = differences(policy, report)
    except PlanError as error:
        return [f"the policy cannot plan {report.model} at {topology_label(report.topology)}: {error.problems[0].message}"]
    return [difference.message for difference in found if difference.kind != "unjudged"]


def observation_summary(report: DiscoveryReport, label: str) -> tuple[list[str], bool]:
    """What ``kvpolicy discover`` prints of a report it observed (``label``: where it was written), one
    line per group, and whether every layer had evidence. A group that compared no block says "no
    evidence", never a partition; one whose layers compared too few blocks to propose from says so."""
    topology = report.topology
    lines = [f"{label}: {_printable(report.model)} at tp {topology.tp_size}, {report.steps} steps observed"]
    every = True
    for group, observed in zip(report.layout.groups, report.groups, strict=True):
        types = ", ".join(dict.fromkeys(member.spec.type for member in group.members))
        evidence = observed.evidence
        head = f"  group {observed.index} {observed.name or '-'} ({types})"
        empty = sum(1 for layer in observed.layers if layer.evidence.blocks == 0)
        scant = sum(1 for layer in observed.layers if thin(layer)) - empty
        every = every and not empty
        if not observed.partition:
            lines.append(f"{head}: no evidence: no block compared in any of its {len(observed.layers)} layers "
                         f"({evidence.zero_blocks} all zero on some rank)")
            continue
        partition = parse_partition(observed.partition)
        factor = head_factor_of(partition, topology)
        said = f"factor {factor}" if factor is not None else "no factor expresses it"
        notes = []
        if empty:
            notes.append(f"no evidence for {empty} of its {len(observed.layers)} layers (no block compared)")
        if scant:
            notes.append(f"too little evidence for {scant} of its layers to propose from ({MIN_BLOCKS} blocks of "
                         f"{MIN_DISTINCT} distinct contents each)")
        lines.append(f"{head}: equal bytes in {shown_partition(partition)} ({said}); {evidence.blocks} blocks compared, "
                     f"{evidence.zero_blocks} all-zero" + "".join(f"; {note}" for note in notes))
    return lines, every


def _layers_label(names: Sequence[str]) -> str:
    return f"layer {names[0]}" if len(names) == 1 else f"layers {names[0]} (+{len(names) - 1} alike)"


def shown_partition(partition: Partition) -> str:
    """``partition`` as a list of lists, cut after :data:`MAX_SHOWN_RANKS` ranks (saying how many)."""
    ranks = sum(len(members) for members in partition)
    if ranks <= MAX_SHOWN_RANKS:
        return _listed(partition)
    parts, left = [], MAX_SHOWN_RANKS
    for members in partition:
        if left <= 0:
            break
        parts.append("[" + ", ".join(map(str, members[:left])) + (", ..." if len(members) > left else "") + "]")
        left -= len(members)
    more = ", ..." if len(parts) < len(partition) else ""
    return f"[{', '.join(parts)}{more}] ({len(partition)} class{'es' if len(partition) != 1 else ''} of {ranks} ranks)"


def _listed(partition: Partition) -> str:
    return str([list(members) for members in partition])
