"""Layout documents back to YAML: the inverse of :mod:`kvpolicy.documents.loader` for ``kind: ModelLayout``.

:func:`dump_layout` writes the shape and key order of the hand-written layouts in
``examples/layouts/``, in block style, deterministically. Every scalar goes through PyYAML's safe
dumper, which quotes a string that would read back as anything else; this dumper also quotes
YAML 1.2's numbers (``1e3``, ``0o17``), which PyYAML reads as strings but editors
reading YAML 1.2 would not. Runs of consecutively numbered layer names become ``{a..b}`` ranges
only where the loader expands them back to exactly the same names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

from kvpolicy.language.expressions import Expression
from kvpolicy.language.models import FieldExpression, Group, Layout, Spec, Topology, expand_layer_pattern

MIN_RANGE_LENGTH = 3
"""Shortest run of numbered layer names written as one ``{a..b}`` range; shorter runs stay literal."""
MAX_RANGE_SPAN = 100_000
"""Largest ``b - a`` the loader expands in one range (:func:`kvpolicy.language.models.expand_layer_pattern`)."""
FLOW_WIDTH = 100
"""Lists of scalars that fit in this many characters stay on one line (``[a, b]``), like ``bases``."""

_NUMBER = re.compile(r"(?<![0-9])(0|[1-9][0-9]*)(?![0-9])")
"""A decimal number as the loader's expansion spells it (``str(int)``: no leading zeros)."""
_YAML_1_2_NUMBER = re.compile(
    r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)
        |0o[0-7]+|0x[0-9a-fA-F]+)$""",
    re.VERBOSE,
)


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper: no anchors, and YAML 1.2 numbers count as non-strings, so get quoted."""

    def ignore_aliases(self, data: Any) -> bool:
        return True

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        # Indent a list under its key ("groups:\n  - name: ..."), as the example layouts do.
        super().increase_indent(flow, False)


# Only the emitter consults this resolver, to decide whether a string needs quotes.
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_1_2_NUMBER, list("-+.0123456789"))


def _represent_str(dumper: _Dumper, data: str) -> yaml.ScalarNode:
    # PyYAML writes a NEL (U+0085) raw into a single-quoted scalar, where reading folds it to a
    # space; double quotes make it escape the character instead.
    style = '"' if "\x85" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


class _Flow(list[Any]):
    """A list written on one line, ``[a, b]``; other lists are written one item per line."""


def _represent_flow(dumper: _Dumper, data: _Flow) -> yaml.SequenceNode:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(_Flow, _represent_flow)


def flow(items: list[Any]) -> list[Any]:
    """``items`` written on one line by :func:`yaml_text` (nested lists too): ``[[0, 1], [2, 3]]``."""
    return _Flow(items)


def _fits_on_one_line(data: list[Any]) -> bool:
    if not all(_is_scalar_tree(item) for item in data):
        return False
    if sum(len(str(item)) + 2 for item in data) > FLOW_WIDTH:  # cheap lower bound before a real rendering
        return False
    rendered = yaml.dump(data, Dumper=_Dumper, default_flow_style=True, allow_unicode=True, width=1 << 30)
    return len(rendered.rstrip("\n")) <= FLOW_WIDTH


def _is_scalar_tree(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_scalar_tree(item) for item in value)
    return not isinstance(value, Mapping)


def dump_layout(layout: Layout, *, captured_at: Topology | None = None, schema: str | None = None) -> str:
    """``layout`` as a YAML document that :func:`kvpolicy.documents.loader.load_layout` reads back equal.

    ``schema`` (a path or URL of ``layout.schema.json``) adds the editor's ``yaml-language-server``
    line; ``captured_at`` is the topology of the vLLM instance the layout was read from, named in
    a comment because ``block_size``, ``page_size_bytes`` and ``fields`` are one rank's values there.
    Raises ``ValueError`` for a layer name the loader would expand (it contains ``{a..b}``).
    """
    header = []
    if schema is not None:
        header.append(f"# yaml-language-server: $schema={schema}")
    if captured_at is not None:
        header.append(
            f"# Captured from vLLM's KVCacheConfig at tp_size {captured_at.tp_size}, pp_size {captured_at.pp_size}, "
            f"pcp_size {captured_at.pcp_size}, dcp_size {captured_at.dcp_size}."
        )
        header.append("# block_size, page_size_bytes and fields are one rank's values at that topology.")
    return "".join(f"{line}\n" for line in header) + yaml_text(layout_data(layout))


def yaml_text(data: Any) -> str:
    """Plain ``data`` as block-style YAML, keys in the order given, every string quoted where it
    would read back as anything else (YAML 1.2 numbers included)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1 << 30)


def layout_data(layout: Layout) -> dict[str, Any]:
    """``layout`` as plain data in the example layouts' key order (what :func:`dump_layout` writes)."""
    data: dict[str, Any] = {"version": layout.version, "kind": layout.kind, "model": layout.model}
    if layout.description:
        data["description"] = layout.description
    if layout.source:
        data["source"] = _plain(layout.source)
    data["total_num_kv_heads"] = layout.total_num_kv_heads
    if layout.layer_kv_heads:
        data["layer_kv_heads"] = [
            {"total_num_kv_heads": entry.total_num_kv_heads, "layers": _plain(compress_layer_names(entry.layers))}
            for entry in layout.layer_kv_heads
        ]
    if layout.kv_cache_layout is not None:
        data["kv_cache_layout"] = layout.kv_cache_layout
    data["groups"] = [_group_data(group) for group in layout.groups]
    return data


def _group_data(group: Group) -> dict[str, Any]:
    data: dict[str, Any] = {} if group.name is None else {"name": group.name}
    if group.uniform is not None:
        data["uniform"] = [
            {"spec": _spec_data(member.spec), "layers": _plain(compress_layer_names(member.layers))}
            for member in group.uniform
        ]
    else:
        assert group.spec is not None and group.layers is not None
        data["spec"] = _spec_data(group.spec)
        data["layers"] = _plain(compress_layer_names(group.layers))
    return data


def _expression_data(expression: Expression) -> int | str:
    # An integer stays an integer; any other expression keeps its exact text.
    source = expression.source
    return int(source) if re.fullmatch(r"0|[1-9][0-9]*", source) else source


def _spec_data(spec: Spec) -> dict[str, Any]:
    return {
        "type": spec.type,
        "bases": _plain(spec.bases),
        "block_size": _expression_data(spec.block_size),
        "page_size_bytes": _expression_data(spec.page_size_bytes),
        "fields": _plain(spec.fields),
    }


def _plain(value: Any) -> Any:
    """Mappings as dicts and tuples as lists (the safe dumper represents only YAML's own types); short
    lists of scalars on one line."""
    if isinstance(value, FieldExpression):
        return {"expr": value.expr.source}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(item) for item in value]
        return _Flow(items) if _fits_on_one_line(items) else items
    return value


def compress_layer_names(names: tuple[str, ...] | list[str]) -> list[str]:
    """Layer names as patterns: each run of at least :data:`MIN_RANGE_LENGTH` names that differ
    only in one number counting up by one becomes ``{a..b}``; the patterns expand to ``names``.

    Raises ``ValueError`` for a name that already contains ``{a..b}``: the loader would expand it,
    so no pattern can stand for it.
    """
    for name in names:
        if _expand(name) != (name,):
            raise ValueError(
                f"layer name '{name}' contains a '{{a..b}}' range, which the loader expands; "
                "a layout document cannot name this layer"
            )
    patterns: list[str] = []
    start = 0
    while start < len(names):
        pattern, length = _longest_run(names, start)
        patterns.append(pattern)
        start += length
    return patterns


def _longest_run(names: tuple[str, ...] | list[str], start: int) -> tuple[str, int]:
    """The pattern for the longest run of names starting at ``start``, and the run's length."""
    first = names[start]
    best_pattern, best_length = first, 1
    for number in _NUMBER.finditer(first):
        head, tail, low = first[: number.start()], first[number.end() :], int(number.group())
        length = 1
        limit = min(len(names) - start, MAX_RANGE_SPAN + 1)
        while length < limit and names[start + length] == f"{head}{low + length}{tail}":
            length += 1
        if length > best_length:
            best_pattern, best_length = f"{head}{{{low}..{low + length - 1}}}{tail}", length
    # The loader's own expansion decides, so a range is written only where it reads back the same.
    if best_length < MIN_RANGE_LENGTH or _expand(best_pattern) != tuple(names[start : start + best_length]):
        return first, 1
    return best_pattern, best_length


def _expand(pattern: str) -> tuple[str, ...] | None:
    """What the loader reads ``pattern`` as; None where it refuses the pattern."""
    try:
        return expand_layer_pattern(pattern)
    except ValueError:
        return None
