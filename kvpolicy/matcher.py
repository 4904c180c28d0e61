"""Which rule applies to a layer spec, and why the rules before it did not."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from kvpolicy.expressions import ExpressionError, Value
from kvpolicy.models import Rule, Spec, thawed

_MISSING = object()


@dataclass(frozen=True)
class RuleMatch:
    """Whether one rule matched one layer, and the reason in words."""

    matched: bool
    reason: str
    """``matched``, or which condition of the rule the layer failed."""


def spec_variables(spec: Spec, topology_variables: Mapping[str, Value]) -> dict[str, Value]:
    """What expressions may read for ``spec``: the topology, then the spec's own fields."""
    page_size = spec.page_size_bytes.evaluate(topology_variables)
    return {
        **topology_variables,
        **spec.fields,
        "block_size": spec.block_size,
        "page_size_bytes": page_size,
    }


def match_rule(rule: Rule, spec: Spec, layer: str, variables: Mapping[str, Value]) -> RuleMatch:
    """Match ``rule`` against one layer; raises :class:`ExpressionError` when ``when`` cannot be evaluated."""
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
    if match.layers is not None and not any(fnmatchcase(layer, glob) for glob in match.layers):
        return RuleMatch(False, f"layer '{layer}' matches none of {', '.join(match.layers)}")
    if rule.when is not None:
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
