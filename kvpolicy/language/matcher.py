"""Which rule applies to a layer spec, and why the rules before it did not."""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpolicy.language.expressions import ExpressionError, Value
from kvpolicy.language.models import Rule, SpecValues, thawed

_MISSING = object()


@dataclass(frozen=True)
class RuleMatch:
    """Whether one rule matched one layer, and the reason in words."""

    matched: bool
    reason: str
    """``matched``, or which condition of the rule the layer failed."""


def spec_variables(spec: SpecValues, topology_variables: Mapping[str, Value]) -> dict[str, Value]:
    """What expressions may read for ``spec`` (at the topology ``topology_variables`` describes): the
    topology, then the spec's own fields, block size and page size."""
    return {
        **topology_variables,
        **spec.fields,
        "block_size": spec.block_size,
        "page_size_bytes": spec.page_size_bytes,
    }


def match_spec(rule: Rule, spec: SpecValues) -> RuleMatch:
    """Match ``rule``'s spec-class and field conditions, which hold for every layer of ``spec`` alike."""
    match = rule.match
    if match.spec is not None and not set(match.spec) & set(spec.classes):
        return RuleMatch(False, f"{spec.type} is not {_either(match.spec)}")
    for name, expected in match.fields.items():
        actual = spec.fields.get(name, _MISSING)
        if actual is _MISSING:
            return RuleMatch(False, f"{spec.type} has no field '{name}'")
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if actual not in allowed:
            return RuleMatch(
                False, f"{name} is {thawed(actual)!r}, not {_either([repr(thawed(value)) for value in allowed])}"
            )
    return RuleMatch(True, "matched")


def layers_matching(rule: Rule, layers: Sequence[str]) -> list[str]:
    """Those of ``layers`` that ``rule``'s layer globs select (all of them when it has none)."""
    if rule.match.layers is None:
        return list(layers)
    pattern = _glob_pattern(rule.match.layers)
    return [layer for layer in layers if pattern.match(layer)]


def layers_reason(rule: Rule) -> str:
    """Why a layer the globs of ``rule`` do not select was passed over."""
    return f"layer matches none of {', '.join(rule.match.layers or ())}"


@functools.lru_cache(maxsize=1024)
def _glob_pattern(globs: tuple[str, ...]) -> re.Pattern[str]:
    # One compiled alternation instead of a fnmatch call per glob and layer: same semantics as fnmatchcase.
    return re.compile("|".join(f"(?:{fnmatch.translate(glob)})" for glob in globs))


def match_when(rule: Rule, spec: SpecValues, variables: Mapping[str, Value]) -> RuleMatch:
    """Match ``rule``'s ``when``; raises :class:`ExpressionError` when it cannot be evaluated."""
    if rule.when is None:
        return RuleMatch(True, "matched")
    missing = sorted(rule.when.names - variables.keys())
    if missing:
        raise ExpressionError(
            f"'when' reads '{missing[0]}', which this {spec.type} does not state; "
            f"add '{missing[0]}' to the layout's spec fields (null when vLLM leaves it unset)"
        )
    if not rule.when.evaluate(variables):
        return RuleMatch(False, f"when: {rule.when.source} is false")
    return RuleMatch(True, "matched")


def _either(options: list[str] | tuple[str, ...]) -> str:
    return options[0] if len(options) == 1 else "any of " + ", ".join(options)
