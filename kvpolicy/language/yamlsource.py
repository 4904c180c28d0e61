"""YAML parsing that remembers where every key and value came from.

PyYAML's node tree has line and column marks; this walks it into plain Python values and keeps a
map from each value's path (``("rules", 2, "factor")``) to its position, so later validation errors
can point at the exact line and column. Duplicate keys, which PyYAML silently merges, are errors.

Two readers share the composed node tree: :class:`_Builder`, the reference, builds values and
positions and reports every problem; :func:`_plain_value` builds the values alone and gives up
(:class:`_Unsure`) on anything that is not a plain document of strings, numbers, booleans and nulls,
leaving it to the reference. A document the plain reader accepts gets its positions only when they
are asked for (:class:`SourceMap`), from the same nodes as the reference would record them, so every
position and diagnostic is the reference's whichever reader built the values.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from kvpolicy.language.diagnostics import Diagnostic
from kvpolicy.language.expressions import MAX_INT

Path = tuple[str | int, ...]
MAX_DOCUMENT_BYTES = 1024 * 1024
"""A policy or layout is a few KiB; a captured layout of a thousand layers some tens."""
MAX_NODES = 100_000
"""YAML nodes (keys, values, alias uses) one document may build."""
_YAML_TAG = "tag:yaml.org,2002:"
_STR_TAG = _YAML_TAG + "str"
_INT_TAG = _YAML_TAG + "int"
_FLOAT_TAG = _YAML_TAG + "float"
_MAP_TAG = _YAML_TAG + "map"
_SEQ_TAG = _YAML_TAG + "seq"
SCALAR_TAGS = frozenset(_YAML_TAG + name for name in ("str", "int", "float", "bool", "null", "timestamp"))
"""Tags a scalar may have, implicitly or written out (``!!float 1`` is the float 1.0, ``!!str 1`` the
string "1"): its value is what the tag declares, and the models judge it. Every other tag
(``!!binary``, ``!!set``, ``!!omap``, ``!!python/...``, a local ``!tag``, one a ``%TAG`` directive
names) is refused where it stands: a document holds strings, numbers, booleans, nulls, dates, lists and
mappings, and none other may pass for one of these."""
MAX_EXPANDED_CHARS = 1024 * 1024
"""Characters of keys and scalar values a document may hold once its aliases are expanded: as many as
it could hold written out (:data:`MAX_DOCUMENT_BYTES`), so that aliases repeating a long key or value
cannot make the problems of a small file, each quoting it, take gigabytes."""
MAX_INTEGER = MAX_INT
"""Largest integer a document may hold (in magnitude), the models' and expressions' bound too; no
field needs more, and a bound keeps every later step (messages, arithmetic) cheap."""
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser keeps line/column marks too
_MAX_LITERAL = 80
"""Characters of a number literal that are read (see :meth:`_Builder._scalar`)."""
_PLAIN_DEPTH = 100
"""Nesting the plain reader follows before it leaves a document to the reference: the reference
recurses two frames a level, so within this depth it never fails where the plain reader succeeded
(documents nest a few levels; values deeper than 64 are refused by the models anyway)."""


class _Loader(_BASE_LOADER):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader, resolving each distinct scalar once per document.

    The C composer asks the Python resolver for the tag of every node, a loop over regular
    expressions for a plain scalar, and tells it each step down and up the tree. Without path
    resolvers (PyYAML's safe loader has none unless a program adds them) the steps do nothing and a
    tag depends only on (kind, value, implicit): the steps become C no-ops and the tags a C cache
    (``functools.cache`` answers a repeated scalar without running Python), kept by this loader
    only, so it reads the resolvers of its class as they are."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        if not self.yaml_path_resolvers:
            # Bound to the class, not to self: a cache holding self would make a reference cycle.
            self.resolve = functools.cache(
                functools.partial(yaml.resolver.BaseResolver.resolve, type(self))  # type: ignore[arg-type]
            )
            self.descend_resolver = operator.is_  # (node, index) -> ignored
            self.ascend_resolver = tuple  # () -> ignored


class Position(NamedTuple):
    """Where a key or value starts; a tuple because a document has tens of thousands of them."""

    line: int
    """1-based."""
    column: int
    """1-based."""
    quoted: bool = False
    """Whether the scalar starts with a quote, so its text starts one column later."""


class SourceMap:
    """Positions of the keys and values of one parsed document.

    For a document the plain reader read (``root``), the maps are built when first read; the first
    :data:`WALKS` questions about one path each walk the nodes to it instead, as the maps would
    answer (a layout that loads without a warning asks none, a policy its rules' lines), and then
    the maps are built, so that many questions about a wide mapping stay linear."""

    WALKS = 64

    __slots__ = ("_keys", "_root", "_values", "_walks", "path")

    def __init__(self, path: str, root: yaml.Node | None = None) -> None:
        self.path = path
        self._keys: dict[Path, Position] = {}
        self._values: dict[Path, Position] = {}
        self._root = root
        self._walks = 0

    @property
    def built(self) -> bool:
        """Whether the maps are built (for a document the plain reader read, once :attr:`keys` or
        :attr:`values` has been read)."""
        return self._root is None

    @property
    def keys(self) -> dict[Path, Position]:
        self._fill()
        return self._keys

    @property
    def values(self) -> dict[Path, Position]:
        self._fill()
        return self._values

    def _fill(self) -> None:
        if self._root is not None:
            root, self._root = self._root, None
            _Builder(self.path, self._keys, self._values).build(root, ())

    def value_position(self, location: Path) -> Position | None:
        """``values.get(location)``."""
        found = self._positions(location)
        return None if found is None else found[1]

    def _positions(self, location: Path) -> tuple[Position | None, Position] | None:
        """(the key's position or None, the value's) at ``location``, or None where there is none."""
        self._walks += 1
        if self._walks > self.WALKS:
            self._fill()
        if self._root is None:
            value = self._values.get(location)
            return None if value is None else (self._keys.get(location), value)
        key_node: yaml.Node | None = None
        node: yaml.Node = self._root
        for part in location:
            # Paths as the reference builds them: mapping keys as strings, sequence items by index.
            if isinstance(node, MappingNode) and isinstance(part, str):
                pair = next(((k, v) for k, v in node.value if _plain_key(k) == part), None)
                if pair is None:
                    return None
                key_node, node = pair
            elif isinstance(node, SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                key_node, node = None, node.value[part]
            else:
                return None
        return (None if key_node is None else _position(key_node)), _position(node)

    def locate(self, location: Path, *, prefer_key: bool = False) -> Position:
        """The position of ``location``, or of its nearest ancestor that exists in the file."""
        for end in range(len(location), -1, -1):
            found = self._positions(location[:end])
            if found is not None:
                key, value = found
                return key if prefer_key and key is not None else value
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
        if offset is not None and self._positions(location) is not None:
            column += offset + (1 if position.quoted else 0)
        return Diagnostic(self.path, position.line, column, severity, message, code)  # type: ignore[arg-type]


class _Builder:
    """The reference reader: values, the position of every key and value, and every problem."""

    def __init__(self, path: str, keys: dict[Path, Position], values: dict[Path, Position]) -> None:
        self.path, self.keys, self.values = path, keys, values
        self.constructor = SafeConstructor()
        self.problems: list[Diagnostic] = []
        self.nodes = 0
        self.refused = False
        """Whether a tag was refused: the value built is then not the document's."""

    def build(self, node: yaml.Node, path: Path) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _TooLarge
        self.values[path] = _position(node)
        if not _honoured(node):
            self.problems.append(_refused_tag(self.path, node))
            self.refused = True
            return None
        if isinstance(node, yaml.MappingNode):
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self._scalar_key(key_node)
                if key is None:
                    continue
                if key in result:
                    first = self.keys[(*path, key)]
                    self.problems.append(
                        Diagnostic(
                            self.path,
                            key_node.start_mark.line + 1,
                            key_node.start_mark.column + 1,
                            "error",
                            f"duplicate key '{key}' (first defined at line {first.line}); remove one",
                            "KVP004",
                        )
                    )
                    continue
                self.nodes += 1  # a key is a node too: a mapping of many keys with tiny values is bounded the same
                self.keys[(*path, key)] = _position(key_node)
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
        if node.tag in (_INT_TAG, _FLOAT_TAG) and len(node.value) > _MAX_LITERAL:
            kind = "an integer" if node.tag == _INT_TAG else "a number"
            raise _IntegerTooLarge(
                node, f"{kind} literal of {len(node.value)} characters is too long; at most {_MAX_LITERAL} are read"
            )
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
        if isinstance(node, yaml.ScalarNode) and node.tag not in SCALAR_TAGS:
            self.problems.append(_refused_tag(self.path, node))
            self.refused = True
            return None
        if not isinstance(node, yaml.ScalarNode):
            self.problems.append(
                Diagnostic(
                    self.path,
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


def _honoured(node: yaml.Node) -> bool:
    """Whether ``node``'s tag is one a document may hold (:data:`SCALAR_TAGS`, a list's, a mapping's)."""
    kind = node.__class__
    if kind is ScalarNode:
        return node.tag in SCALAR_TAGS
    return node.tag == (_MAP_TAG if kind is MappingNode else _SEQ_TAG)


def _refused_tag(path: str, node: yaml.Node) -> Diagnostic:
    tag = str(node.tag)
    line, column = node.start_mark.line + 1, node.start_mark.column + 1
    if tag == _YAML_TAG + "merge":
        return Diagnostic(path, line, column, "error", "YAML merge keys ('<<') are not read; write the keys out", "KVP002")
    shown = "!!" + tag[len(_YAML_TAG):] if tag.startswith(_YAML_TAG) else tag if tag.startswith("!") else f"!<{tag}>"
    what = "a scalar" if isinstance(node, ScalarNode) else "a list" if isinstance(node, SequenceNode) else "a mapping"
    return Diagnostic(
        path, line, column, "error",
        f"YAML tag {shown} on {what} is not read: a policy or layout holds strings, numbers, booleans, nulls, lists "
        "and mappings; remove the tag (quote the value to keep it as text)",
        "KVP002",
    )


class _TooLarge(Exception):
    pass


class _IntegerTooLarge(Exception):
    def __init__(self, node: yaml.Node, what: str) -> None:
        super().__init__(what)
        self.node, self.what = node, what


class _Unsure(Exception):
    """The plain reader met something only the reference reports exactly."""


_CONSTRUCTOR = SafeConstructor()
"""For the plain reader's numbers and booleans: PyYAML's scalar constructors keep no state."""
_CONSTRUCTORS = SafeConstructor.yaml_constructors
"""The registry :meth:`_Builder._scalar` dispatches on; the plain reader takes only PyYAML's own
constructors of numbers, booleans and null from it, so a program registering others gets the reference."""
_PLAIN_CONSTRUCTORS = frozenset(
    (SafeConstructor.construct_yaml_bool, SafeConstructor.construct_yaml_null, SafeConstructor.construct_yaml_float)
)


def _plain_scalar(node: ScalarNode) -> Any:
    """What :meth:`_Builder._scalar` returns for a string, number, boolean or null; else :class:`_Unsure`."""
    tag, text = node.tag, node.value
    if tag == _STR_TAG:
        return text
    if len(text) > _MAX_LITERAL and tag in (_INT_TAG, _FLOAT_TAG):
        raise _Unsure
    construct = _CONSTRUCTORS.get(tag)
    if construct is SafeConstructor.construct_yaml_int:
        if text.isdigit() and text.isascii() and (text[0] != "0" or text == "0"):
            value = int(text)  # what construct_yaml_int does with plain decimal digits
        else:
            value = construct(_CONSTRUCTOR, node)
        if abs(value) > MAX_INTEGER:
            raise _Unsure
        return value
    if construct in _PLAIN_CONSTRUCTORS:
        return construct(_CONSTRUCTOR, node)
    raise _Unsure


def _plain_key(node: yaml.Node) -> str:
    """A mapping key of a document the plain reader read, as it read it."""
    if node.tag == _STR_TAG:
        return node.value  # type: ignore[no-any-return]
    key = _plain_scalar(node)  # type: ignore[arg-type]  # a key of a document read: a scalar
    return key if key.__class__ is str else str(key)


def _plain_value(root: yaml.Node) -> Any:
    """``root``'s value exactly as :class:`_Builder` builds it, without positions. Raises
    :class:`_TooLarge` where the reference would (nodes counted alike, in the same order, and
    nothing before them refused), else :class:`_Unsure` (or any error PyYAML raises) where the
    reference might report a problem: a duplicate or collection key, a tag other than
    str/int/float/bool/null, a number beyond what is read, nesting beyond :data:`_PLAIN_DEPTH`."""
    count = 1  # as the reference counts: every value (an alias at each use) and every key

    def collection(node: yaml.Node, depth: int) -> Any:
        nonlocal count
        if depth > _PLAIN_DEPTH:
            raise _Unsure
        kind = node.__class__
        if node.tag != (_MAP_TAG if kind is MappingNode else _SEQ_TAG):
            raise _Unsure  # a tag on a list or mapping (or a node class of PyYAML's own): the reference refuses it
        if kind is MappingNode:
            result: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if key_node.__class__ is not ScalarNode:
                    raise _Unsure
                key = key_node.value if key_node.tag == _STR_TAG else _plain_key(key_node)
                if key in result:
                    raise _Unsure
                count += 2  # the key, and the value about to be built
                if count > MAX_NODES:
                    raise _TooLarge
                if value_node.__class__ is ScalarNode:
                    result[key] = value_node.value if value_node.tag == _STR_TAG else _plain_scalar(value_node)
                else:
                    result[key] = collection(value_node, depth + 1)
            return result
        if kind is SequenceNode:
            items: list[Any] = []
            for item in node.value:
                count += 1
                if count > MAX_NODES:
                    raise _TooLarge
                if item.__class__ is ScalarNode:
                    items.append(item.value if item.tag == _STR_TAG else _plain_scalar(item))
                else:
                    items.append(collection(item, depth + 1))
            return items
        raise _Unsure  # a node class of PyYAML's own the reference would judge

    if root.__class__ is ScalarNode:
        return _plain_scalar(root)
    return collection(root, 1)


def _position(node: yaml.Node) -> Position:
    quoted = isinstance(node, yaml.ScalarNode) and node.style in ("'", '"')
    return Position(node.start_mark.line + 1, node.start_mark.column + 1, quoted)


def parse(text: str, path: str, *, reference: bool = False) -> tuple[Any, SourceMap, list[Diagnostic]]:
    """Parse one YAML document; return its value, its source map and any problems found.

    ``reference``: read the slow way, with PyYAML's own safe loader and :class:`_Builder` alone
    (positions at once); the result is the same, which the tests hold the fast way to."""
    source = SourceMap(path)
    if len(text.encode("utf-8", errors="replace")) > MAX_DOCUMENT_BYTES:
        return None, source, [
            Diagnostic(path, 1, 1, "error", f"document is larger than {MAX_DOCUMENT_BYTES} bytes", "KVP003")
        ]
    try:
        nodes = list(yaml.compose_all(text, Loader=_BASE_LOADER if reference else _Loader))
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
        return None, source, [Diagnostic(path, 1, 1, "error", "file is empty; expected a policy, layout or discovery report", "KVP002")]
    if len(nodes) > 1:
        mark = nodes[1].start_mark
        return None, source, [
            Diagnostic(
                path, mark.line + 1, mark.column + 1, "error", "one document per file; remove the '---' separator", "KVP002"
            )
        ]
    if "&" in text:  # else there is no anchor, so no alias to expand
        expanded = _expansion_problem(nodes[0], path)
        if expanded is not None:
            return None, source, [expanded]
    if not reference:
        try:
            value = _plain_value(nodes[0])
        except _TooLarge:  # the reference's answer, without walking an alias bomb a second time
            return None, source, [_too_many_nodes(path)]
        except Exception:  # noqa: BLE001 - anything the plain reader does not take, the reference judges
            return _reference_value(nodes[0], source)
        return value, SourceMap(path, nodes[0]), []
    return _reference_value(nodes[0], source)


class _Expanded(Exception):
    def __init__(self, node: yaml.Node, chars: int) -> None:
        super().__init__(chars)
        self.node, self.chars = node, chars


class _PastNodeLimit(Exception):
    pass


def _expansion_problem(root: yaml.Node, path: str) -> Diagnostic | None:
    """A diagnostic where aliases make the document hold more than :data:`MAX_EXPANDED_CHARS` characters
    of keys and scalars, at the innermost list or mapping whose expansion passes the bound; None
    otherwise, and where the expansion passes :data:`MAX_NODES` first (the readers report that). Each
    list or mapping is sized once, however often aliases repeat it: linear in the text."""
    sizes: dict[int, tuple[int, int]] = {}  # id of a list or mapping -> (nodes, characters) expanded

    def size(node: yaml.Node) -> tuple[int, int]:
        if node.__class__ is ScalarNode:
            return 1, len(node.value)
        known = sizes.get(id(node))
        if known is not None:
            return known
        nodes, chars = 1, 0
        children = node.value if node.__class__ is SequenceNode else (part for pair in node.value for part in pair)
        for child in children:
            child_nodes, child_chars = size(child)
            nodes, chars = nodes + child_nodes, chars + child_chars
            if nodes > MAX_NODES:
                raise _PastNodeLimit
            if chars > MAX_EXPANDED_CHARS:
                raise _Expanded(node, chars)
        sizes[id(node)] = (nodes, chars)
        return nodes, chars

    try:
        size(root)
    except (_PastNodeLimit, RecursionError):  # judged by the readers, as any document
        return None
    except _Expanded as expanded:
        line, column = _position(expanded.node)[:2]
        return Diagnostic(
            path, line, column, "error",
            f"aliases expand this to more than {MAX_EXPANDED_CHARS} characters of keys and values, more than the "
            "file could hold written out; repeat less through aliases",
            "KVP003",
        )
    return None


def _too_many_nodes(path: str) -> Diagnostic:
    return Diagnostic(path, 1, 1, "error", f"document has more than {MAX_NODES} nodes", "KVP003")


def _reference_value(root: yaml.Node, source: SourceMap) -> tuple[Any, SourceMap, list[Diagnostic]]:
    """:class:`_Builder`'s value of ``root``, filling ``source``, and every problem it found."""
    path = source.path
    builder = _Builder(path, source.keys, source.values)
    try:
        value = builder.build(root, ())
    except _TooLarge:
        return None, source, [_too_many_nodes(path)]
    except _IntegerTooLarge as error:
        line, column = _position(error.node)[:2]
        return None, source, [Diagnostic(path, line, column, "error", error.what, "KVP003")]
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, OverflowError) as error:
        mark = getattr(error, "problem_mark", None)
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        # A marked error's str() appends its marks on further lines; the diagnostic has them already.
        detail = getattr(error, "problem", None) or str(error)
        return None, source, [Diagnostic(path, line, column, "error", f"YAML value: {detail}", "KVP002")]
    if builder.refused:  # a value stood in for each refused tag: judge the types, not those values
        return None, source, builder.problems
    return value, source, builder.problems
