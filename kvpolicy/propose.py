"""From observations to a policy: ``kvpolicy discover --propose`` (pure).

Discovery reports (:mod:`kvpolicy.discovery`) say, per layer, which TP ranks held byte-identical bytes.
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

The proposal is checked before it is returned: planned on every report's layout and topology, it
must give each layer the observed head factor and each group the observed replica sets
(:func:`disagreements`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpolicy.diagnostics import Diagnostic, DocumentError, PlanError, printable_path
from kvpolicy.discovery import DiscoveryReport, LayerObservation, Partition, parse_partition
from kvpolicy.dumper import yaml_text
from kvpolicy.engine import make_plan, replica_partition
from kvpolicy.expressions import ExpressionError
from kvpolicy.loader import check_text, load_policy, read_text
from kvpolicy.models import Policy, Topology, topology_variables
from kvpolicy.yamlsource import SourceMap, parse

__all__ = ["MIN_BLOCKS", "MIN_DISTINCT", "LoadedReport", "Proposal", "disagreements", "load_reports", "propose"]

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
    """The head factor whose replica sets are ``partition`` (what a rule's factor states), or None."""
    for factor in range(1, topology.tp_size + 1):
        if topology.tp_size % factor == 0 and replica_partition(factor, topology) == partition:
            return factor
    return None


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
                    f"replica sets of any factor at {_topology_label(topology)} (runs of consecutive ranks of one size); "
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


def _topology_label(topology: Topology) -> str:
    parts = [f"tp {topology.tp_size}"]
    parts += [f"{name} {value}" for name, value in (("pp", topology.pp_size), ("pcp", topology.pcp_size),
                                                     ("dcp", topology.dcp_size)) if value > 1]
    return ", ".join(parts)


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
        *(f"#   {printable_path(item.path)}: {_printable(item.report.model)} at {_topology_label(item.report.topology)} "
          f"({item.report.source}, {item.report.steps} steps)" for item in loaded[:MAX_EVIDENCE_LINES]),
        *([f"#   and {len(loaded) - MAX_EVIDENCE_LINES} more"] if len(loaded) > MAX_EVIDENCE_LINES else []),
        *([
            "# Some observations come from the simulation, which holds what kvpolicy.sim.archetypes.physical_factor",
            "# states for vLLM's own spec classes: a class it does not know is simulated as attention by KV heads,",
            "# so observe a new state type on an engine (kvpolicy_discover) before trusting its rule.",
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
                match["layers"] = list(rule.layers)
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
    policy, problems = check_text(text, f"<proposal {name}>")
    errors = [problem for problem in problems if problem.severity == "error"]
    if policy is None or errors or not isinstance(policy, Policy):
        raise AssertionError("kvpolicy wrote a proposal it cannot read back: " + "; ".join(map(str, errors)))
    for item in loaded:
        found = disagreements(policy, item.report)
        if found:
            raise AssertionError(f"the proposal does not reproduce {item.path}: {'; '.join(found)}")
    return Proposal(text, policy), []


def disagreements(policy: Policy, report: DiscoveryReport) -> list[str]:
    """Where ``policy``, planned on the report's layout and topology, departs from what was observed:
    a layer given another head factor (or observed in classes no factor expresses), a group given other
    replica sets. Layers observed on too little evidence (:func:`thin`) are not judged, nor groups with
    such a layer. A policy that cannot plan the layout is one disagreement."""
    topology = report.topology
    try:
        plan = make_plan(policy, report.layout, topology)
    except PlanError as error:
        return [f"the policy cannot plan {report.model} at {_topology_label(topology)}: {error.problems[0].message}"]
    found = []
    for group, observed in zip(plan.groups, report.groups, strict=True):
        decisions = {decision.layer: decision for decision in group.decisions}
        judged = [layer for layer in observed.layers if not thin(layer)]
        for layer in judged:
            factor = head_factor_of(parse_partition(layer.partition), topology)
            planned = decisions[layer.name].factor
            if factor is None:
                found.append(f"group {group.index} layer {layer.name}: observed {_listed(layer.partition)}, which no "
                             "factor expresses; planned head factor {planned}".replace("{planned}", str(planned)))
            elif planned != factor and not group.demoted:
                found.append(f"group {group.index} layer {layer.name}: planned head factor {planned}, observed {factor}")
        if judged and len(judged) == len(observed.layers):
            planned_sets = tuple(sorted({rank.replica_set for rank in group.ranks}))
            if planned_sets != parse_partition(observed.partition):
                found.append(
                    f"group {group.index} ({group.name}): planned replica sets {_listed(planned_sets)}, "
                    f"observed {_listed(parse_partition(observed.partition))}"
                )
    return found


def _listed(partition: Partition) -> str:
    return str([list(members) for members in partition])
