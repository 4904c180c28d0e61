"""YAML parsing that remembers where every key and value came from.

PyYAML's node tree has line and column marks; this walks it into plain Python values and keeps a
map from each value's path (``("rules", 2, "factor")``) to its position, so later validation errors
can point at the exact line and column. Duplicate keys, which PyYAML silently merges, are errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import yaml
from yaml.constructor import SafeConstructor

from kvpolicy.diagnostics import Diagnostic
from kvpolicy.expressions import MAX_INT

Path = tuple[str | int, ...]
MAX_DOCUMENT_BYTES = 1024 * 1024
"""A policy or layout is a few KiB; a captured layout of a thousand layers some tens."""
MAX_NODES = 100_000
"""YAML nodes (keys, values, alias uses) one document may build."""
_STR_TAG = "tag:yaml.org,2002:str"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
MAX_INTEGER = MAX_INT
"""Largest integer a document may hold (in magnitude), the models' and expressions' bound too; no
field needs more, and a bound keeps every later step (messages, arithmetic) cheap."""
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser keeps line/column marks too


class Position(NamedTuple):
    """Where a key or value starts; a tuple because a document has tens of thousands of them."""

    line: int
    """1-based."""
    column: int
    """1-based."""
    quoted: bool = False
    """Whether the scalar starts with a quote, so its text starts one column later."""


@dataclass
class SourceMap:
    """Positions of the keys and values of one parsed document."""

    path: str
    keys: dict[Path, Position] = field(default_factory=dict)
    values: dict[Path, Position] = field(default_factory=dict)

    def locate(self, location: Path, *, prefer_key: bool = False) -> Position:
        """The position of ``location``, or of its nearest ancestor that exists in the file."""
        for end in range(len(location), -1, -1):
            prefix = location[:end]
            first, second = (self.keys, self.values) if prefer_key else (self.values, self.keys)
            if prefix in first:
                return first[prefix]
            if prefix in second:
                return second[prefix]
        return Position(1, 1)

    def diagnostic(
        self,
        location: Path,
        message: str,
        *,
        code: str,
        severity: str = "error",
        prefer_key: bool = False,
        offset: int | None = None,
    ) -> Diagnostic:
        """A diagnostic of check ``code`` at ``location``; ``offset`` is a column inside that scalar's text."""
        position = self.locate(location, prefer_key=prefer_key)
        column = position.column
        if offset is not None and location in self.values:
            column += offset + (1 if position.quoted else 0)
        return Diagnostic(self.path, position.line, column, severity, message, code)  # type: ignore[arg-type]


class _Builder:
    def __init__(self, source: SourceMap) -> None:
        self.source = source
        self.constructor = SafeConstructor()
        self.problems: list[Diagnostic] = []
        self.nodes = 0

    def build(self, node: yaml.Node, path: Path) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _TooLarge
        self.source.values[path] = _position(node)
        if isinstance(node, yaml.MappingNode):
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self._scalar_key(key_node)
                if key is None:
                    continue
                if key in result:
                    first = self.source.keys[(*path, key)]
                    self.problems.append(
                        Diagnostic(
                            self.source.path,
                            key_node.start_mark.line + 1,
                            key_node.start_mark.column + 1,
                            "error",
                            f"duplicate key '{key}' (first defined at line {first.line}); remove one",
                            "KVP004",
                        )
                    )
                    continue
                self.nodes += 1  # a key is a node too: a mapping of many keys with tiny values is bounded the same
                self.source.keys[(*path, key)] = _position(key_node)
                result[key] = self.build(value_node, (*path, key))
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, index)) for index, item in enumerate(node.value)]
        return self._scalar(node, deep=True)

    def _scalar(self, node: yaml.Node, *, deep: bool) -> Any:
        if node.tag == _STR_TAG:
            return node.value  # most scalars; what SafeConstructor would return, without its dispatch
        # Refused before it is read: PyYAML would spend quadratic time on a decimal literal of
        # megabytes, and Python cannot even print one of more than 4300 digits.
        if node.tag in (_INT_TAG, _FLOAT_TAG) and len(node.value) > 80:
            kind = "an integer" if node.tag == _INT_TAG else "a number"
            raise _IntegerTooLarge(node, f"{kind} literal of {len(node.value)} characters is too long; at most 80 are read")
        try:
            construct = self.constructor.yaml_constructors.get(node.tag)
            if construct is not None:  # the common case, without construct_object's recursion bookkeeping
                value = construct(self.constructor, node)
            else:
                value = self.constructor.construct_object(node, deep=deep)
        except (KeyError, AttributeError, IndexError) as error:
            # PyYAML's constructors raise these for explicitly tagged scalars they cannot read
            # (`!!bool "maybe"`, `!!timestamp "x"`); report them like its own constructor errors.
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {node.value!r} as {node.tag}", node.start_mark
            ) from error
        if type(value) is int and abs(value) > MAX_INTEGER:
            raise _IntegerTooLarge(
                node, f"an integer of {value.bit_length()} bits is too large; integers are at most 2**63 - 1 ({MAX_INTEGER})"
            )
        return value

    def _scalar_key(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            self.problems.append(
                Diagnostic(
                    self.source.path,
                    node.start_mark.line + 1,
                    node.start_mark.column + 1,
                    "error",
                    "mapping keys must be plain names, not collections",
                    "KVP002",
                )
            )
            return None
        key = self._scalar(node, deep=False)
        return str(key) if not isinstance(key, str) else key


class _TooLarge(Exception):
    pass


class _IntegerTooLarge(Exception):
    def __init__(self, node: yaml.Node, what: str) -> None:
        super().__init__(what)
        self.node, self.what = node, what


def _position(node: yaml.Node) -> Position:
    quoted = isinstance(node, yaml.ScalarNode) and node.style in ("'", '"')
    return Position(node.start_mark.line + 1, node.start_mark.column + 1, quoted)


def parse(text: str, path: str) -> tuple[Any, SourceMap, list[Diagnostic]]:
    """Parse one YAML document; return its value, its source map and any problems found."""
    source = SourceMap(path)
    if len(text.encode("utf-8", errors="replace")) > MAX_DOCUMENT_BYTES:
        return None, source, [
            Diagnostic(path, 1, 1, "error", f"document is larger than {MAX_DOCUMENT_BYTES} bytes", "KVP003")
        ]
    try:
        nodes = list(yaml.compose_all(text, Loader=_LOADER))
    except yaml.reader.ReaderError as error:
        # Not a marked error: PyYAML gives the offset of the character in the text, not a line.
        before = text[: error.position]
        line = before.count("\n") + 1
        column = error.position - (before.rfind("\n") + 1) + 1
        character = error.character if isinstance(error.character, int) else ord(str(error.character)[:1] or "?")
        return None, source, [
            Diagnostic(
                path, line, column, "error",
                f"YAML syntax: control character U+{character:04X} is not allowed; remove it "
                "(inside a double-quoted string write it as an escape, e.g. \\x01)",
                "KVP002",
            )
        ]
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = error.problem or error.context or "invalid YAML"
        return None, source, [Diagnostic(path, line, column, "error", f"YAML syntax: {problem}", "KVP002")]
    except (yaml.YAMLError, RecursionError, ValueError) as error:
        return None, source, [Diagnostic(path, 1, 1, "error", f"YAML syntax: {error}", "KVP002")]
    nodes = [node for node in nodes if node is not None]
    if not nodes:
        return None, source, [Diagnostic(path, 1, 1, "error", "file is empty; expected a policy or layout document", "KVP002")]
    if len(nodes) > 1:
        mark = nodes[1].start_mark
        return None, source, [
            Diagnostic(
                path, mark.line + 1, mark.column + 1, "error", "one document per file; remove the '---' separator", "KVP002"
            )
        ]
    builder = _Builder(source)
    try:
        value = builder.build(nodes[0], ())
    except _TooLarge:
        return None, source, [Diagnostic(path, 1, 1, "error", f"document has more than {MAX_NODES} nodes", "KVP003")]
    except _IntegerTooLarge as error:
        line, column = _position(error.node)[:2]
        return None, source, [Diagnostic(path, line, column, "error", error.what, "KVP003")]
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, OverflowError) as error:
        mark = getattr(error, "problem_mark", None)
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        # A marked error's str() appends its marks on further lines; the diagnostic has them already.
        detail = getattr(error, "problem", None) or str(error)
        return None, source, [Diagnostic(path, line, column, "error", f"YAML value: {detail}", "KVP002")]
    return value, source, builder.problems
