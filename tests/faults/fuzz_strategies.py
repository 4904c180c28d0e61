"""Hypothesis strategies and contracts for fuzzing the loader, the validator CLI and the expression
evaluator; shared by ``tests/faults/test_fuzz_loader.py`` (a few hundred inputs) and
``scripts/fuzz.py`` (a long run).

Inputs come from three families:

* **tree mutations** of the shipped policies and example layouts: parse, then delete, rename,
  duplicate or replace keys and values (other types, unicode, huge numbers, deep nesting,
  expressions), and dump back as YAML in a random style;
* **text mutations** of the same files (or of a tree mutation): truncation, deleted, duplicated
  and swapped lines, random indentation, random unicode, and YAML snippets — anchor/alias bombs,
  recursive aliases, explicit tags, huge numbers, directives, document markers, control
  characters, deep nesting, complex keys;
* **generated documents**: policy- and layout-shaped mappings with random fields, expressions,
  key templates and layer ranges, and arbitrary YAML trees.

The contracts (:func:`check_contract`, :func:`expression_contract`) are what the properties assert.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import json
import os
import re
import signal
import string
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from kvpolicy.app.cli import main as cli_main
from kvpolicy.documents.loader import MAX_DIAGNOSTICS_PER_FILE, check_text
from kvpolicy.language.diagnostics import MAX_MESSAGE_CHARS, Diagnostic, printable_path
from kvpolicy.language.expressions import MAX_DEPTH, MAX_INT, MAX_SOURCE_LENGTH, Expression, ExpressionError
from kvpolicy.language.keys import KEY_TEMPLATE_FIELDS, KeyContext, parse_prefix, render_prefix
from kvpolicy.language.models import KeyFormat

REPO = Path(__file__).resolve().parents[2]
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
SEED_PATHS = sorted(
    [
        *(REPO / "policies").glob("*.yaml"),
        *(REPO / "examples" / "policies").glob("*.yaml"),
        *(REPO / "examples" / "layouts").glob("*.yaml"),
    ]
)
SEEDS: dict[str, str] = {path.relative_to(REPO).as_posix(): path.read_text(encoding="utf-8") for path in SEED_PATHS}
PARSED: dict[str, Any] = {name: yaml.safe_load(text) for name, text in SEEDS.items()}

CHECK_SECONDS = 10.0
"""A document the loader has not judged after this long counts as a hang."""
EXPRESSION_SECONDS = 10.0
"""Parsing plus evaluating one expression not finished after this long counts as a hang. How fast the
work is belongs to the benchmarks; what keeps it small is structural and asserted directly: an accepted
expression is at most ``MAX_SOURCE_LENGTH`` characters and ``MAX_DEPTH`` levels deep, and every
intermediate integer stays within ±``MAX_INT``."""

# --- leaves --------------------------------------------------------------------------------------

FIELD_NAMES = sorted(
    {
        "version", "kind", "name", "description", "rules", "unmatched", "strict", "combine", "schedule", "load", "key",
        "audit", "spec_fields", "template", "mode", "steps", "match", "when", "replication", "factor", "shards",
        "reason", "spec", "fields", "layers", "model", "source", "total_num_kv_heads", "groups", "uniform", "type",
        "bases", "block_size", "page_size_bytes", "max_tp_shards", "tp_replicated", "num_kv_heads", "head_size",
        "dtype", "sliding_window", "mamba_type",
    }
)
VARIABLES = ("tp_size", "pp_size", "pcp_size", "dcp_size", "total_num_kv_heads", "max_tp_shards", "block_size",
             "page_size_bytes", "tp_replicated", "num_kv_heads")
DUNDERS = ("__class__", "__import__", "__builtins__", "__globals__", "__subclasses__", "__mro__", "__dict__",
           "__code__", "__getattribute__", "__init__", "__base__", "eval", "exec", "open", "getattr", "compile",
           "globals", "locals", "vars", "type", "object", "os", "sys")
TRICKY_STRINGS = (
    "", " ", "\t", "~", "null", "Null", "yes", "no", "on", "off", "y", "n", "0x1F", "0o17", "0b101", "1_000",
    "1e400", "-.inf", ".nan", "2001-12-14", "12:30:45", "=", "<<", "&a", "*a", "!!str", "%", "@", "`", "|", ">",
    "{model}", "{{model}}", "{shard", "shard}", "{model.__class__}", "{0}", "{}", "{shard!r}", "{shard:>9}",
    "MLAAttentionSpec", "MambaSpec", "AttentionSpec", "replicated", "sharded", "striped", "leader", "all",
    "warn", "enforce", "off", "gcd", "ReplicationPolicy", "ModelLayout", "layer.{0..3}", "l{0..99999}",
    "\u202e", "\u200b", "\ufeff", "🙂", "Ω", "ｔｐ_size", "\x1b[2J", "a" * 300,
)
HUGE_INTEGERS = (2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**100, 10**1000, 10**4000)


def unicode_text(max_size: int = 30) -> st.SearchStrategy[str]:
    return st.text(st.characters(blacklist_categories=("Cs",)), max_size=max_size)


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.integers(-3, 10),
        st.integers(),
        st.sampled_from(HUGE_INTEGERS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.none(),
        unicode_text(),
        st.sampled_from(TRICKY_STRINGS),
        st.sampled_from(FIELD_NAMES),
    )


def yaml_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    keys = st.one_of(st.sampled_from(FIELD_NAMES), unicode_text(12))
    return st.recursive(
        st.one_of(scalars(), _atoms()),
        lambda children: st.one_of(
            st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)
        ),
        max_leaves=max_leaves,
    )


# --- expressions ---------------------------------------------------------------------------------

_BINARY = (" + ", " - ", " * ", " // ", " % ", " / ", " ** ", " & ", " | ", " ^ ", " << ", " >> ", " @ ")
_COMPARE = (" == ", " != ", " < ", " <= ", " > ", " >= ", " is ", " is not ", " in ", " not in ")


def _atoms() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.sampled_from(("0", "1", "2", "True", "False", "None", "'x'", '"a"', "9" * 25, "0x7fffffffffffffff",
                         "1.5", "1j", "...", "b'x'", "f'{tp_size}'")),
        st.sampled_from(VARIABLES),
        st.sampled_from(DUNDERS),
    )


def _grow(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    pair = st.tuples(children, children)
    return st.one_of(
        st.tuples(children, st.sampled_from(_BINARY), children).map("".join),
        st.tuples(children, st.sampled_from(_COMPARE), children).map("".join),
        pair.map(lambda p: f"{p[0]} and {p[1]}"),
        pair.map(lambda p: f"{p[0]} or {p[1]}"),
        children.map(lambda c: f"not {c}"),
        children.map(lambda c: f"-{c}"),
        children.map(lambda c: f"({c})"),
        st.tuples(children, children, children).map(lambda t: f"{t[0]} if {t[1]} else {t[2]}"),
        st.tuples(st.sampled_from(("min", "max", "abs", "len", "pow", "getattr", "__import__", "eval", "type")),
                  st.lists(children, max_size=3)).map(lambda t: f"{t[0]}({', '.join(t[1])})"),
        st.tuples(children, st.sampled_from(DUNDERS)).map(lambda t: f"{t[0]}.{t[1]}"),
        st.tuples(children, children).map(lambda t: f"{t[0]}[{t[1]}]"),
        children.map(lambda c: f"lambda: {c}"),
        children.map(lambda c: f"[x for x in {c}]"),
        children.map(lambda c: f"(x := {c})"),
        children.map(lambda c: f"[{c}]"),
        children.map(lambda c: f"{{{c}: 1}}"),
        children.map(lambda c: f"*{c}"),
    )


def pathological_expressions() -> st.SearchStrategy[str]:
    """Long, deep and large: chains, nesting and literals at and beyond the evaluator's bounds."""
    n = st.integers(1, 600)
    return st.one_of(
        n.map(lambda k: " * ".join(["1"] * k)),
        n.map(lambda k: " * ".join(["9223372036854775807"] * k)),
        n.map(lambda k: " + ".join(["tp_size"] * k)),
        n.map(lambda k: "max(" * k + "1" + ")" * k),
        n.map(lambda k: "max(" + ", ".join(["tp_size"] * k) + ")"),
        n.map(lambda k: "1 if tp_size else " * k + "0"),
        n.map(lambda k: "(" * k + "1" + ")" * k),
        n.map(lambda k: "not " * k + "True"),
        n.map(lambda k: "-" * k + "1"),
        n.map(lambda k: "1 < " * k + "2"),
        n.map(lambda k: "9" * k),
        n.map(lambda k: "[" * k + "]" * k),
        n.map(lambda k: "min(max(tp_size, " * k + "1" + "))" * k),
        st.integers(1, 80).map(lambda k: "9223372036854775807 * " * k + "9223372036854775807"),
    )


def expressions() -> st.SearchStrategy[str]:
    grammar = st.recursive(_atoms(), _grow, max_leaves=12)
    return st.one_of(grammar, pathological_expressions(), unicode_text(60), st.sampled_from(TRICKY_STRINGS))


ALLOWED_NODES = (
    ast.Constant, ast.Name, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.IfExp, ast.Compare, ast.Call, ast.Load,
    ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub, ast.UAdd, ast.Not, ast.And, ast.Or,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot,
)
TOPOLOGY = {"tp_size": 8, "pp_size": 2, "pcp_size": 1, "dcp_size": 1, "total_num_kv_heads": 2,
            "max_tp_shards": None, "block_size": 16, "page_size_bytes": 4096, "tp_replicated": False,
            "num_kv_heads": 1}


# --- key templates -------------------------------------------------------------------------------


def key_templates() -> st.SearchStrategy[str]:
    """Templates from literal pieces, fields (plain, escaped, with conversions and specs) and stray
    braces; most contain every required field, so many pass validation."""
    fields = st.sampled_from(KEY_TEMPLATE_FIELDS)
    piece = st.one_of(
        fields.map(lambda name: "{" + name + "}"),
        fields.map(lambda name: "@" + name + ":{" + name + "}"),
        fields.map(lambda name: "{{" + name + "}}"),
        fields.map(lambda name: "{" + name + "!r}"),
        fields.map(lambda name: "{" + name + ":>4}"),
        st.sampled_from(("@", ":", "/", "-", "{", "}", "{{", "}}", "{}", "{0}", "{model.__class__}", "{shard[0]}")),
        st.text(string.ascii_letters + "@:_", max_size=5),
    )
    segments = st.permutations([f"@{name}:{{{name}}}" for name in KEY_TEMPLATE_FIELDS])

    @st.composite
    def spliced(draw: Any) -> str:
        """Every field, with separators, plus pieces spliced in between segments; sometimes one
        field escaped ("{{shard}}" is the literal text "{shard}", not the field)."""
        parts = list(draw(segments))
        if draw(st.booleans()):
            index = draw(st.integers(0, len(parts) - 1))
            parts[index] = parts[index].replace("{", "{{").replace("}", "}}")
        for extra in draw(st.lists(piece, min_size=0, max_size=3)):
            parts.insert(draw(st.integers(0, len(parts))), extra)
        return "".join(parts)

    return st.one_of(st.lists(piece, max_size=14).map("".join), spliced())


NAMESPACES = tuple(
    {"group": group, "shard": shard, "pcp_rank": pcp, "dcp_rank": dcp, "pp_rank": pp}
    for group in (0, 1, 10, 11)
    for shard in (0, 1, 10, 11)
    for pcp in (0, 1)
    for dcp in (0, 1)
    for pp in (0, 1)
)
"""Namespaces whose numbers run together without separators (1 then 10 vs 11 then 0 …)."""


def template_contract(template: str) -> None:
    """A template the validator accepts renders every namespace, each to its own prefix, which
    :func:`~kvpolicy.language.keys.parse_prefix` reads back into that namespace."""
    try:
        KeyFormat(template=template)
    except ValueError:
        return
    context = KeyContext(model="m", cache_prefix="p", store_namespace="")
    rendered: dict[str, dict[str, int]] = {}
    for namespace in NAMESPACES:
        prefix = render_prefix(template, context, fingerprint="f" * 12, **namespace)
        other = rendered.setdefault(prefix, namespace)
        assert other == namespace, f"template {template!r}: {other} and {namespace} share the key prefix {prefix!r}"
        parsed = parse_prefix(prefix, template)
        assert {name: getattr(parsed, name) for name in namespace} == namespace, (template, prefix)
        assert parsed.render(template) == prefix, (template, prefix)


# --- documents -----------------------------------------------------------------------------------


def _rule() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(st.sampled_from(("mla", "kv-heads", "a", "Bad_Name", "")), unicode_text(10)),
            "reason": st.one_of(st.just("because"), scalars()),
            "match": st.fixed_dictionaries(
                {},
                optional={
                    "spec": st.one_of(
                        st.sampled_from(("MLAAttentionSpec", "MambaSpec", "AttentionSpec", "NoSuchSpec")),
                        st.lists(st.sampled_from(("MLAAttentionSpec", "MambaSpec")), max_size=3),
                        scalars(),
                    ),
                    "fields": st.dictionaries(st.sampled_from(VARIABLES + ("dtype",)), yaml_values(4), max_size=3),
                    "layers": st.one_of(st.lists(st.sampled_from(("*", "model.layers.*", "[", "l{0..3}")), max_size=3),
                                        scalars()),
                    "junk": scalars(),
                },
            ),
            "when": expressions(),
            "factor": st.one_of(expressions(), scalars()),
            "shards": st.one_of(expressions(), scalars()),
            "replication": st.one_of(st.sampled_from(("sharded", "replicated", "Replicated")), scalars()),
            "extra": scalars(),
        },
    )


def policy_documents() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "version": st.one_of(st.just(1), scalars()),
            "kind": st.one_of(
                st.just("ReplicationPolicy"), st.sampled_from(("ModelLayout", "replicationpolicy")), scalars()
            ),
        },
        optional={
            "name": st.one_of(st.just("fuzzed"), scalars()),
            "description": scalars(),
            "rules": st.one_of(st.lists(_rule(), max_size=5), scalars()),
            "unmatched": st.one_of(st.sampled_from(("sharded", "replicated")), scalars()),
            "strict": scalars(),
            "combine": st.one_of(st.just("gcd"), scalars()),
            "schedule": st.one_of(st.sampled_from(("striped", "leader", "all")), scalars()),
            "load": st.one_of(st.sampled_from(("per-rank", "striped")), scalars()),
            "key": st.one_of(st.fixed_dictionaries({"template": st.one_of(key_templates(), scalars())}), scalars()),
            "audit": st.one_of(
                st.fixed_dictionaries({}, optional={"mode": st.sampled_from(("warn", "enforce", "off", "x")),
                                                    "steps": st.one_of(st.integers(-5, 20_000), scalars())}),
                scalars(),
            ),
            "spec_fields": st.one_of(
                st.lists(st.one_of(st.sampled_from(VARIABLES), unicode_text(8)), max_size=4), scalars()
            ),
            "junk": yaml_values(6),
        },
    )


def layer_patterns() -> st.SearchStrategy[str]:
    bound = st.integers(0, 200)
    return st.one_of(
        st.sampled_from(("model.layers.0.attn", "l.{0..3}", "l.{3..0}", "l.{0..100000}", "l.{0..100001}", "{..}",
                         "l.{a..b}", "*")),
        st.tuples(bound, bound).map(lambda t: f"model.layers.{{{t[0]}..{t[1]}}}.self_attn"),
        st.tuples(bound, bound, bound, bound).map(lambda t: f"l{{{t[0]}..{t[1]}}}.{{{t[2]}..{t[3]}}}"),
        unicode_text(20),
    )


def _spec() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "type": st.one_of(
                st.sampled_from(("MLAAttentionSpec", "FullAttentionSpec", "MambaSpec", "PluginSpec")), scalars()
            ),
            "block_size": st.one_of(st.integers(-1, 4096), scalars()),
            "page_size_bytes": st.one_of(st.integers(-1, 2**40), expressions(), scalars()),
        },
        optional={
            "bases": st.one_of(
                st.lists(st.sampled_from(("AttentionSpec", "FullAttentionSpec", "KVCacheSpec")), max_size=4), scalars()
            ),
            "fields": st.dictionaries(st.sampled_from(VARIABLES + ("dtype", "shapes")), yaml_values(4), max_size=4),
        },
    )


def layout_documents() -> st.SearchStrategy[dict[str, Any]]:
    plain = st.fixed_dictionaries(
        {},
        optional={
            "name": scalars(),
            "spec": _spec(),
            "layers": st.one_of(st.lists(layer_patterns(), max_size=3), layer_patterns()),
        },
    )
    uniform = st.fixed_dictionaries(
        {
            "uniform": st.lists(
                st.fixed_dictionaries({"spec": _spec(), "layers": st.lists(layer_patterns(), max_size=2)}), max_size=3
            )
        },
        optional={"name": scalars(), "spec": _spec()},
    )
    return st.fixed_dictionaries(
        {
            "version": st.one_of(st.just(1), scalars()),
            "kind": st.one_of(st.just("ModelLayout"), scalars()),
        },
        optional={
            "model": st.one_of(st.just("org/model"), scalars()),
            "total_num_kv_heads": st.one_of(st.integers(-2, 128), scalars()),
            "groups": st.one_of(st.lists(st.one_of(plain, uniform), max_size=4), scalars()),
            "source": yaml_values(6),
            "description": scalars(),
        },
    )


def dump(data: Any, draw: Any) -> str:
    """``data`` as YAML in a random style (block or flow, ASCII or unicode, narrow or wide)."""
    return yaml.dump(
        data,
        Dumper=_DUMPER,
        default_flow_style=draw(st.sampled_from((False, True, None))),
        allow_unicode=draw(st.booleans()),
        sort_keys=False,
        width=draw(st.sampled_from((20, 80, 4096))),
    )


@st.composite
def generated_documents(draw: Any) -> str:
    data = draw(st.one_of(policy_documents(), layout_documents(), yaml_values(20)))
    return dump(data, draw)


# --- tree mutations ------------------------------------------------------------------------------


def _slots(node: Any) -> Iterator[tuple[Any, Any]]:
    """(container, key) of every value below ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield node, key
            yield from _slots(value)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield node, index
            yield from _slots(value)


def _near_miss(key: str) -> st.SearchStrategy[str]:
    variants = [key.upper(), key + "s", key[:-1], key.replace("_", "-"), key.replace("_", ""), " " + key, key + " "]
    return st.sampled_from([variant for variant in variants if variant])


def _nested(depth: int, leaf: Any, as_dict: bool) -> Any:
    for _ in range(depth):
        leaf = {"a": leaf} if as_dict else [leaf]
    return leaf


TREE_OPERATIONS = ("delete", "rename", "duplicate", "replace", "unicode", "huge", "nest", "expression", "empty")


@st.composite
def mutated_trees(draw: Any) -> Any:
    name = draw(st.sampled_from(sorted(PARSED)))
    tree = copy.deepcopy(PARSED[name])
    for _ in range(draw(st.integers(1, 4))):
        slots = list(_slots(tree))
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        operation = draw(st.sampled_from(TREE_OPERATIONS))
        if operation == "delete":
            del container[key]
        elif operation == "rename" and isinstance(container, dict):
            new = draw(st.one_of(_near_miss(str(key)), st.sampled_from(FIELD_NAMES), unicode_text(12)))
            value = container.pop(key)
            container[new] = value
        elif operation == "duplicate" and isinstance(container, list):
            container.insert(key, copy.deepcopy(container[key]))
        elif operation == "unicode":
            container[key] = draw(unicode_text(40))
        elif operation == "huge":
            container[key] = draw(st.sampled_from(HUGE_INTEGERS))
        elif operation == "nest":
            container[key] = _nested(draw(st.integers(1, 120)), container[key], draw(st.booleans()))
        elif operation == "expression":
            container[key] = draw(expressions())
        elif operation == "empty":
            container[key] = draw(st.sampled_from(([], {}, "", None)))
        else:
            container[key] = draw(yaml_values())
    return tree


@st.composite
def mutated_documents(draw: Any) -> str:
    return dump(draw(mutated_trees()), draw)


# --- text mutations ------------------------------------------------------------------------------


def _bomb(depth: int, width: int) -> str:
    lines = [f"b0: &b0 [{', '.join(['lol'] * width)}]"]
    lines += [f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * width)}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


SNIPPETS = (
    "a: &a [*a]\n",
    "a: &a {b: *a}\n",
    "x: *undefined\n",
    "x: !!bool \"maybe\"\n",
    "x: !!timestamp \"not a time\"\n",
    "x: !!int \"twelve\"\n",
    "x: !!float \"x\"\n",
    "x: !!binary \"!!!\"\n",
    "x: !!python/object/apply:os.system [\"true\"]\n",
    "x: !!python/name:os.system\n",
    "x: !!set {a, b}\n",
    "x: !!omap [a: 1]\n",
    "x: !!map \"scalar\"\n",
    "x: !!seq \"scalar\"\n",
    "x: !!null \"not null\"\n",
    "x: !<tag:yaml.org,2002:bool> \"x\"\n",
    "x: !custom 1\n",
    "? !!bool \"maybe\"\n: 1\n",
    "? [a, b]\n: c\n",
    "? {a: 1}\n: c\n",
    "<<: {a: 1}\n",
    "x: " + "9" * 5000 + "\n",
    "x: 0x" + "f" * 6000 + "\n",
    "x: -0b" + "1" * 20000 + "\n",
    "x: 1e999\n",
    "x: \"\\0\\x1b\\u202e\\U0001F642\"\n",
    "%YAML 1.1\n---\n",
    "%TAG ! tag:example.com,2000:\n---\n",
    "---\n",
    "...\n",
    "--- !!map\n",
    "{[}]\n",
    "x: [\n",
    "x: 'unterminated\n",
    "\t\tx: 1\n",
    "x: |\n  block\n    more\n",
    "x: " + "[" * 300 + "]" * 300 + "\n",
    "x: " + "{a: " * 200 + "1" + "}" * 200 + "\n",
    "x: \x00\n",
    "\ufeffx: 1\n",
    "x: \x85y\n",
    "x: a\u2028b\n",
    "x: a\rb\n",
    "x: " + "a" * 20000 + "\n",
    ("k" * 2000) + ": 1\n",
)


@st.composite
def yaml_snippets(draw: Any) -> str:
    return draw(
        st.one_of(
            st.sampled_from(SNIPPETS),
            st.tuples(st.integers(1, 9), st.integers(1, 9)).map(lambda t: _bomb(*t)),
        )
    )


TAGS = ("!!bool", "!!timestamp", "!!int", "!!float", "!!binary", "!!null", "!!str", "!!map", "!!seq", "!!set",
        "!!omap", "!!pairs", "!!merge", "!!python/none", "!!python/tuple", "!custom", "!<tag:yaml.org,2002:bool>",
        "!", "!e!x", "!<tag:example.com,2000:x>", "!<tag:yaml.org,2002:str>")
DIRECTIVES = ("%TAG ! tag:example.com,2000:\n", "%TAG !e! tag:example.com,2000:\n", "%TAG !! tag:example.com,2000:\n",
              "%TAG ! tag:yaml.org,2002:\n", "%YAML 1.1\n", "%YAML 1.2\n")
"""Directives that change what a tag means (``%TAG !! ...`` makes ``!!str`` someone else's type)."""
TEXT_OPERATIONS = ("truncate", "delete-line", "duplicate-line", "swap-lines", "indent", "unicode", "snippet", "value",
                   "tag", "directive")


@st.composite
def mutated_texts(draw: Any) -> str:
    base = draw(st.one_of(st.sampled_from(sorted(SEEDS)).map(SEEDS.__getitem__), mutated_documents()))
    text = base
    for _ in range(draw(st.integers(1, 3))):
        lines = text.splitlines(keepends=True) or [""]
        line = draw(st.integers(0, len(lines) - 1))
        operation = draw(st.sampled_from(TEXT_OPERATIONS))
        if operation == "truncate":
            text = text[: draw(st.integers(0, len(text)))]
            continue
        if operation == "delete-line":
            del lines[line]
        elif operation == "duplicate-line":
            lines.insert(line, lines[line])
        elif operation == "swap-lines":
            other = draw(st.integers(0, len(lines) - 1))
            lines[line], lines[other] = lines[other], lines[line]
        elif operation == "indent":
            body = lines[line].lstrip(" \t")
            lines[line] = draw(st.sampled_from(("", " ", "  ", "   ", "\t", " \t", " " * 40))) + body
        elif operation == "unicode":
            position = draw(st.integers(0, len(lines[line])))
            lines[line] = lines[line][:position] + draw(unicode_text(8)) + lines[line][position:]
        elif operation == "snippet":
            indent = draw(st.sampled_from(("", "  ", "    ")))
            snippet = "".join(indent + row for row in draw(yaml_snippets()).splitlines(keepends=True))
            lines.insert(line, snippet)
        elif operation == "tag":  # an explicit tag on a value: "version: !!bool 1"
            head, sep, tail = lines[line].partition(": ")
            if sep:
                lines[line] = head + sep + draw(st.sampled_from(TAGS)) + " " + tail
        elif operation == "directive":  # a directive, then the document it applies to
            lines.insert(0, draw(st.sampled_from(DIRECTIVES)) + "---\n")
        else:  # replace the value of a "key: value" line
            head, sep, _ = lines[line].partition(": ")
            if sep:
                value = draw(yaml_snippets()).partition(": ")[2] or "x\n"
                lines[line] = head + sep + value
        text = "".join(lines)
    return text


# --- alias amplification and tags on documents ----------------------------------------------------

AMPLIFIED_PLACES = ("rules", "groups", "layer_kv_heads", "match", "spec", "fields", "top")


@st.composite
def alias_amplified_documents(draw: Any) -> str:
    """A shipped document with an anchored mapping of unknown (sometimes very long) keys, repeated by
    aliases where the models list one problem per key and use: in its rules or groups, a rule's
    ``match``, a spec, a spec's ``fields``; sometimes a list of aliases itself repeated."""
    name = draw(st.sampled_from(sorted(SEEDS)))
    keys = draw(st.integers(1, 60))
    length = draw(st.sampled_from((1, 8, 1_000, 20_000, 200_000)))
    uses = draw(st.integers(1, 3_000))
    unknown = "".join(f"  ? {'k' * length}{index}\n  : 1\n" for index in range(keys))
    place = draw(st.sampled_from(AMPLIFIED_PLACES))
    item = {
        "rules": "*a", "groups": "*a", "layer_kv_heads": "*a", "top": "*a",
        "match": "{name: r, reason: x, replication: sharded, match: *a}",
        "spec": "{spec: *a, layers: [x]}",
        "fields": "{spec: {type: FullAttentionSpec, block_size: 16, page_size_bytes: 1, fields: *a}, layers: [x]}",
    }[place]
    field = {"match": "rules", "spec": "groups", "fields": "groups", "top": "repeated"}.get(place, place)
    repeated = "[" + ", ".join([item] * uses) + "]"
    if draw(st.booleans()):  # one level more: a list of aliases, itself repeated
        repeated = "&b " + repeated + "\nrepeated_again: [" + ", ".join(["*b"] * draw(st.integers(1, 50))) + "]"
    text = re.sub(rf"^{field}:.*$", "", SEEDS[name], flags=re.MULTILINE)
    return text + "anchor: &a\n" + unknown + f"{field}: {repeated}\n"


@st.composite
def tagged_documents(draw: Any) -> str:
    """A shipped or generated document whose values carry explicit tags (YAML's own, local ones, ones
    a ``%TAG`` directive names) on scalars, lists and mappings alike."""
    tree = draw(st.one_of(mutated_trees(), st.sampled_from(sorted(PARSED)).map(lambda name: copy.deepcopy(PARSED[name]))))
    text = dump(tree, draw)
    lines = text.splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 4))):
        line = draw(st.integers(0, len(lines) - 1))
        head, sep, tail = lines[line].partition(": ")
        if sep:
            lines[line] = head + sep + draw(st.sampled_from(TAGS)) + " " + tail
        elif lines[line].lstrip().startswith("- "):
            indent = lines[line][: len(lines[line]) - len(lines[line].lstrip())]
            lines[line] = indent + "- " + draw(st.sampled_from(TAGS)) + " " + lines[line].lstrip()[2:]
    prefix = draw(st.sampled_from(("", *DIRECTIVES)))
    return (prefix + "---\n" if prefix else "") + "".join(lines)


def odd_file_names() -> st.SearchStrategy[bytes]:
    """File names (bytes, as the OS takes them) with line and record separators, escapes, control
    characters and bytes that are not UTF-8."""
    odd = st.sampled_from((b"\n", b"\r", b"\r\n", b"\x1e", b"\x1b[2J", b"\x07", b"\t", b"\xff", b"\xc3(",
                           b"\xe2\x80\xa8", b"\xc2\x85", b"%", b":", b",", b"::error ", b" "))
    plain = st.text(string.ascii_letters + "._-", min_size=1, max_size=8).map(str.encode)
    return st.lists(st.one_of(odd, plain), min_size=1, max_size=6).map(lambda parts: b"".join(parts) + b".yaml")


def odd_path_contract(name: bytes, content: bytes, output: str, directory: Path) -> None:
    """``kvpolicy validate`` of a file whose name has odd characters: the contract of
    :func:`judge_validate` (one located line per problem, the path escaped), and output that a strict
    UTF-8 stream takes."""
    path = Path(os.fsdecode(os.fsencode(directory) + b"/" + name))
    path.write_bytes(content)
    try:
        out, err = io.StringIO(), io.StringIO()
        with time_limit(CHECK_SECONDS, "kvpolicy validate"), contextlib.redirect_stdout(out):
            with contextlib.redirect_stderr(err):
                code = cli_main(["validate", "--format", output, str(path)])
        (out.getvalue() + err.getvalue()).encode("utf-8")  # raises where a lone surrogate would reach a stream
        judge_validate(code, out.getvalue(), err.getvalue(), output, path)
    finally:
        path.unlink()


def memory_contract(text: str) -> None:
    """:func:`check_contract`, and judging ``text`` makes the process's resident memory peak at most
    :data:`MAX_GROWTH_MIB` above where it stood (a problem list built for every alias use of a long
    key took gigabytes). Linux resets the peak on request; elsewhere only the contract is checked."""
    before: int | None = _status_mib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as peak:
            peak.write("5")  # the peak (VmHWM) restarts from the memory resident now
    except OSError:
        before = None
    check_contract(text)
    if before is not None:
        growth = _status_mib("VmHWM") - before
        assert growth <= MAX_GROWTH_MIB, f"judging one document took {growth} MiB more"


MAX_GROWTH_MIB = 512
"""Memory judging one document may add at its peak (a 1 MiB file of 90,000 errors takes about 200)."""


def _status_mib(field: str) -> int:
    """A ``/proc/self/status`` memory figure, in MiB."""
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), flags=re.MULTILINE)
    return int(found.group(1)) // 1024 if found else 0


STRICT_POLICY = "version: 1\nkind: ReplicationPolicy\nname: strict\nstrict: true\nrules: []\n"


def plan_documents() -> st.SearchStrategy[tuple[str, str, int]]:
    """(layout text, policy, tp size): generated and mutated layouts, whose expressions may fail at
    some topology, planned by a shipped policy or a strict one without rules."""
    layouts = st.one_of(layout_documents().map(lambda data: yaml.dump(data, Dumper=_DUMPER, sort_keys=False)),
                        mutated_documents())
    return st.tuples(layouts, st.sampled_from(("default", "vllm-compat", "strict")), st.sampled_from((1, 2, 3, 4, 8)))


def plan_document_contract(case: tuple[str, str, int], directory: Path) -> None:
    """``kvpolicy plan`` of a layout file: :func:`cli_contract`, and each refusal caused by the
    layout's own expressions (or the policy's ``strict``) located in the file that says it."""
    text, policy, tp_size = case
    layout, strict = directory / "layout.yaml", directory / "strict.yaml"
    layout.write_text(text, encoding="utf-8")
    strict.write_text(STRICT_POLICY, encoding="utf-8")
    argv = ["plan", "--policy", str(strict) if policy == "strict" else policy, "--layout", str(layout), "--tp", str(tp_size)]
    out = cli_contract(argv)
    for line in out.splitlines():
        if line.endswith("[KVP301]") and re.search(r"at tp_size \d+, pp_size \d+, pcp_size \d+, dcp_size \d+: "
                                                   r"(block_size|page_size_bytes|field ')", line):
            assert line.startswith(f"{layout}:"), line
        if line.endswith("[KVP301]") and "and the policy is strict" in line:
            assert line.startswith(f"{strict}:"), line



# --- contracts -----------------------------------------------------------------------------------


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with ``TimeoutError`` if the block runs longer than ``seconds`` (main thread only)."""

    def expire(*_: Any) -> None:
        raise TimeoutError(f"{what} took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def well_formed(diagnostic: Diagnostic, path: str) -> bool:
    return (
        isinstance(diagnostic, Diagnostic)
        and diagnostic.path == path
        and isinstance(diagnostic.line, int) and diagnostic.line >= 1
        and isinstance(diagnostic.column, int) and diagnostic.column >= 1
        and diagnostic.severity in ("error", "warning")
        and isinstance(diagnostic.message, str) and bool(diagnostic.message.strip())
    )


def check_contract(text: str, path: str = "fuzzed.yaml") -> tuple[Any, list[Diagnostic]]:
    """``check_text`` returns (document or None, diagnostics) — never raises, never hangs — and every
    diagnostic has this path, a line and column ≥ 1 and a non-empty message; a document comes back
    exactly when there is no error."""
    with time_limit(CHECK_SECONDS, "check_text"):
        document, problems = check_text(text, path)
    bad = [problem for problem in problems if not well_formed(problem, path)]
    assert not bad, f"malformed diagnostics: {bad}"
    assert len(problems) <= MAX_DIAGNOSTICS_PER_FILE + 1, f"{len(problems)} diagnostics for one file"
    long = [problem for problem in problems if len(problem.message) > MAX_MESSAGE_CHARS + 40 or "\n" in problem.message]
    assert not long, f"unbounded or multi-line messages: {[problem.message[:80] for problem in long]}"
    errors = [problem for problem in problems if problem.severity == "error"]
    assert (document is None) == bool(errors), f"document {type(document).__name__} with errors {errors}"
    return document, problems


def expression_contract(source: str) -> None:
    """Parsing raises only ``ExpressionError`` and accepts only whitelisted syntax within the size and
    depth bounds; evaluating gives an integer within ±MAX_INT, a boolean, a string or None, or raises
    ``ExpressionError``; neither hangs."""
    with time_limit(EXPRESSION_SECONDS, "an expression"):
        try:
            expression = Expression(source)
        except ExpressionError:
            return
        assert len(source) <= MAX_SOURCE_LENGTH, f"a {len(source)}-character expression was accepted"
        tree = ast.parse(source.strip(), mode="eval")
        assert tree_depth(tree.body) <= MAX_DEPTH, f"{source!r:.80} nests deeper than {MAX_DEPTH} and was accepted"
        illegal = [type(node).__name__ for node in ast.walk(tree.body) if not isinstance(node, ALLOWED_NODES)]
        assert not illegal, f"{source!r} was accepted with {illegal}"
        calls = [node.func for node in ast.walk(tree.body) if isinstance(node, ast.Call)]
        assert all(isinstance(func, ast.Name) and func.id in ("min", "max") for func in calls), source
        try:
            value = expression.evaluate(TOPOLOGY)
        except ExpressionError:
            value = None
    assert value is None or isinstance(value, (bool, str)) or (type(value) is int and abs(value) <= MAX_INT), (
        f"{source!r} evaluated to {type(value).__name__} {value!r:.80}"
    )


def tree_depth(node: ast.AST) -> int:
    """Levels of the tree below and including ``node``, counted as the expression module counts them:
    a call's function name is not a level of its own."""
    operators = (ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)
    children = [
        child
        for child in ast.iter_child_nodes(node)
        if not isinstance(child, operators) and not (isinstance(node, ast.Call) and child is node.func)
    ]
    return 1 + max((tree_depth(child) for child in children), default=0)


# --- the CLI -------------------------------------------------------------------------------------


def raw_files() -> st.SearchStrategy[bytes]:
    """File contents for ``kvpolicy validate``, including ones that are not UTF-8 at all."""
    texts = st.one_of(mutated_texts(), generated_documents(), mutated_documents())
    return st.one_of(
        texts.map(lambda text: text.encode("utf-8")),
        texts.map(lambda text: text.encode("utf-16")),
        texts.map(lambda text: text.encode("latin-1", errors="replace")),
        st.binary(max_size=200),
    )


def validate_contract(content: bytes, output: str, path: Path) -> None:
    """``kvpolicy validate --format OUTPUT PATH`` run in-process on ``content``, judged by
    :func:`judge_validate`."""
    path.write_bytes(content)
    out, err = io.StringIO(), io.StringIO()
    with time_limit(CHECK_SECONDS, "kvpolicy validate"), contextlib.redirect_stdout(out):
        with contextlib.redirect_stderr(err):
            code = cli_main(["validate", "--format", output, str(path)])
    judge_validate(code, out.getvalue(), err.getvalue(), output, path)


def judge_validate(code: int, out: str, err: str, output: str, path: Path) -> None:
    """Exit 0 or 1, no traceback, output bounded; JSON and SARIF parse and agree with the exit code;
    text and GitHub output have one located line per problem and nothing else."""
    assert code in (0, 1), code
    assert "Traceback" not in out + err, out + err
    bound = (MAX_DIAGNOSTICS_PER_FILE + 1) * (MAX_MESSAGE_CHARS + len(str(path)) + 400) + 10_000
    assert len(out) + len(err) <= bound, f"{len(out)} characters of output"
    if output == "json":
        payload = json.loads(out)
        assert payload["valid"] == (code == 0), payload
        for diagnostic in payload["files"][0]["diagnostics"]:
            assert diagnostic["line"] >= 1 and diagnostic["column"] >= 1 and diagnostic["message"], diagnostic
    elif output == "sarif":
        (run,) = json.loads(out)["runs"]
        levels = {result["level"] for result in run["results"]}
        assert ("error" in levels) == (code == 1), levels
    else:
        shown = printable_path(str(path))
        prefix = r"::(error|warning) file=" if output == "github" else re.escape(shown) + r":\d+:\d+: (error|warning): "
        located = re.compile(prefix)
        lines = out.splitlines()
        assert all(located.match(line) for line in lines), out[:2000]
        assert code == 0 or lines, out


SPECIAL_FILES = ("fifo", "dev-zero", "dev-null", "directory", "sparse-huge", "symlink-loop", "dangling-symlink", "missing")


def special_file(kind: str, directory: Path) -> Path:
    """A path of ``kind`` in ``directory`` that is no regular file of bounded size."""
    path = directory / f"{kind}.yaml"
    if path.is_symlink() or path.exists():
        return path
    if kind == "fifo":
        os.mkfifo(path)
    elif kind in ("dev-zero", "dev-null"):
        path.symlink_to(f"/dev/{kind[4:]}")
    elif kind == "directory":
        path.mkdir()
    elif kind == "sparse-huge":
        with path.open("wb") as stream:
            stream.truncate(1 << 34)
    elif kind == "symlink-loop":
        path.symlink_to(path)
    elif kind == "dangling-symlink":
        path.symlink_to(directory / "nowhere")
    return path


def special_file_contract(kind: str, output: str, directory: Path) -> None:
    """``kvpolicy validate`` on a special path: one located error, exit 1, within the time limit."""
    path = special_file(kind, directory)
    out, err = io.StringIO(), io.StringIO()
    with time_limit(CHECK_SECONDS, f"kvpolicy validate {kind}"), contextlib.redirect_stdout(out):
        with contextlib.redirect_stderr(err):
            code = cli_main(["validate", "--format", output, str(path)])
    assert code == 1, (kind, code)
    judge_validate(code, out.getvalue(), err.getvalue(), output, path)


def doctor_config_contract(kind: str, directory: Path) -> None:
    """``kvpolicy doctor``'s MOONCAKE_CONFIG_PATH check on a special path: a failed check with a
    one-line reason within the time limit (never a hang on a FIFO, never reading /dev/zero whole)."""
    from kvpolicy.app.doctor import check_mooncake_config

    path = special_file(kind, directory)
    with time_limit(CHECK_SECONDS, f"doctor {kind}"):
        result, address = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert result.status == "fail" and address is None, (kind, result)
    assert "\n" not in result.message and len(result.message) < 2000, result.message


FLAG_VALUES = st.one_of(
    st.integers(-3, 20).map(str),
    st.sampled_from(["0", "4096", "4097", "99999999999999999999", "1e3", "", "x", "-0", "8 "]),
)


@st.composite
def plan_argvs(draw: Any) -> list[str]:
    """Command lines for ``plan`` / ``explain`` / ``diff`` with arbitrary sizes and names."""
    command = draw(st.sampled_from(["plan", "explain", "diff"]))
    odd = ["de\x00fault", "x\n.yaml", "policies/\udcff.yaml", "/tmp/\x00.yaml", "\x1b[2J"]
    names = st.sampled_from(["default", "vllm-compat", "no-dedup", "nosuch", "", "/dev/zero", "../x", *odd])
    layouts = st.sampled_from(["deepseek-v3", "kimi-linear-48b-a3b", "llama-3.1-70b", "nosuch", "/dev/null", *odd])
    if command == "diff":
        argv = ["diff", draw(names), draw(names), "--layout", draw(layouts), "--tp", draw(FLAG_VALUES)]
    else:
        argv = [command, "--policy", draw(names), "--layout", draw(layouts), "--tp", draw(FLAG_VALUES)]
        for flag in draw(st.lists(st.sampled_from(["--pp", "--pcp", "--dcp", "--store-tp", "--prompt-tokens"]), max_size=3, unique=True)):
            argv += [flag, draw(FLAG_VALUES)]
        if draw(st.booleans()):
            argv += ["--format", "json"]
    return argv


@st.composite
def command_line_edges(draw: Any) -> list[str]:
    """Command lines at the parser's edges, for every command that runs without a Mooncake master or
    vLLM: flags repeated, sizes space-separated, unknown and misspelled flags with and without values,
    bad archetypes and missing layouts for the commands that would start simulated ranks, and REPORT
    files that are not reports."""
    sizes = st.lists(FLAG_VALUES, min_size=1, max_size=4)
    command = draw(st.sampled_from(["plan", "explain", "keys", "diff", "audit", "discover", "vllm-config", "validate", "rule"]))
    argv: list[str] = [command]
    if command in ("plan", "explain", "keys"):
        argv += ["--policy", draw(st.sampled_from(["default", "no-dedup", "nosuch"])),
                 "--layout", draw(st.sampled_from(["deepseek-v3", "kimi-linear-48b-a3b", "nosuch"]))]
    elif command == "diff":
        argv += ["default", draw(st.sampled_from(["vllm-compat", "nosuch"])), "--layout", "deepseek-v3"]
    elif command == "audit":  # never a runnable pair: it would start a master
        argv += ["--policy", "default", *draw(st.sampled_from([["--archetype", "kimi-linaer"], ["--archetype", ""],
                                                                ["--layout", "no-such.yaml"], ["--layout", ""]]))]
    elif command == "discover":
        argv += draw(st.sampled_from([["--archetype", "mla2"], ["--layout", "no-such.yaml"], ["--check", "default"],
                                      ["--propose"], ["--check", "nosuch"]]))
        argv += draw(st.lists(st.sampled_from(["", "/dev/null", "no-such-report.yaml", "policies/default.yaml"]), max_size=2))
    elif command == "vllm-config":
        argv += ["--policy", draw(st.sampled_from(["default", "nosuch", ""]))]
    elif command == "validate":
        argv += [draw(st.sampled_from(["policies/default.yaml", "", "/dev/null"]))]
    else:
        argv += [draw(st.sampled_from(["KVP201", "kvp2", "", "unreachable-rule"]))]
    for _ in range(draw(st.integers(0, 3))):
        flag = draw(st.sampled_from(["--tp", "--tp", "--pp", "--format", "--tp-size", "--tokens", "--steps", "--ignore",
                                     "--layout", "--prompt_tokens", "--store-tp", "--name", "--", "-x", "--tp=2"]))
        argv.append(flag)
        if flag in ("--tp", "--tp-size"):
            argv += draw(sizes)
        elif not flag.startswith("--tp=") and draw(st.booleans()):
            argv.append(draw(st.sampled_from(["2", "json", "KVP201", "x", "", "-1"])))
    return argv


def several_sizes_contract(sizes: list[int]) -> None:
    """``--tp A B`` and ``--tp A --tp B`` plan the same sizes, in the same order, for every command that
    takes several."""
    spaced = ["--tp", *map(str, sizes)]
    repeated = [part for size in sizes for part in ("--tp", str(size))]
    for command in (["plan", "--policy", "default", "--layout", "deepseek-v3", "--format", "json"],
                    ["keys", "--policy", "default", "--layout", "deepseek-v3", "--format", "json"],
                    ["diff", "default", "no-dedup", "--layout", "deepseek-v3", "--format", "json"]):
        assert cli_contract([*command, *spaced]) == cli_contract([*command, *repeated]), (command, sizes)


# --- discovery reports: what validate accepts, --propose and --check judge by its evidence only ------

REPORT = """\
version: 1
kind: DiscoveryReport
model: m
source: engine
topology: {{tp_size: {tp}, pp_size: {pp}, pcp_size: {pcp}, dcp_size: {dcp}}}
steps: 2
groups:
  - index: 0
    partition: {group_partition}
    evidence: {{steps: 2, blocks: {blocks}, zero_blocks: 0, distinct_blocks: {distinct}}}
    layers:
      - name: '{layer}'
        partition: {partition}
        evidence: {{steps: 2, blocks: {blocks}, zero_blocks: 0, distinct_blocks: {distinct}}}
layout:
  version: 1
  kind: ModelLayout
  model: m
  total_num_kv_heads: {heads}
  groups:
    - spec: {{type: {spec}, bases: [{bases}], block_size: 16, page_size_bytes: 65536,
              fields: {{head_size: {head_size}, max_tp_shards: null}}}}
      layers: ['{layer}']
"""
SPECS = {"FullAttentionSpec": "AttentionSpec, KVCacheSpec", "MLAAttentionSpec": "FullAttentionSpec, AttentionSpec, KVCacheSpec",
         "MambaSpec": "KVCacheSpec"}
EVIDENCE_CODES = {"KVP401", "KVP402", "KVP403"}
"""What --propose may refuse a report validate accepts for: what was observed, not what the report is."""


@st.composite
def discovery_reports(draw: Any) -> str:
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    pcp = draw(st.sampled_from([1, 1, 2, 4096]))
    dcp = draw(st.sampled_from(sorted({1, tp, *(d for d in range(2, tp + 1) if tp % d == 0), pcp, tp * pcp})))
    classes = draw(st.lists(st.lists(st.integers(0, tp), max_size=tp), min_size=1, max_size=tp + 1))
    partition = json.dumps(draw(st.one_of(st.just(classes), st.just([list(range(tp))]), st.just([[r] for r in range(tp)]))))
    spec = draw(st.sampled_from(sorted(SPECS)))
    return REPORT.format(
        tp=tp, pp=draw(st.sampled_from([1, 2, 4096])), pcp=pcp, dcp=dcp, partition=partition,
        group_partition=draw(st.sampled_from([partition, "[[0]]", "[]"])),
        blocks=draw(st.sampled_from([0, 3, 8])), distinct=draw(st.sampled_from([0, 1, 8, 9])),
        heads=draw(st.sampled_from([1, 2, 8])), spec=spec, bases=SPECS[spec],
        head_size=draw(st.sampled_from(["128", "{expr: '128 // (tp_size - 2)'}", "{expr: '64 * tp_size'}"])),
        layer=draw(st.sampled_from(["layers.0.attn", "a*", "a[b]", "x?", "[!a]", "layers.*.attn"])),
    )


def discovery_report_contract(text: str, path: Path) -> None:
    """A report validate accepts is read by --propose and --check; their refusals are of its evidence."""
    from kvpolicy.documents.loader import check_text, load_policy
    from kvpolicy.documents.propose import check_policy, load_reports, propose

    path.write_text(text, encoding="utf-8")
    document, problems = check_text(text, str(path))
    loaded, refused = load_reports([str(path)])
    assert (document is None) == bool(refused) == bool(loaded == []), (problems, refused)
    if document is None:
        return
    _, refusals = propose(loaded)
    assert {refusal.code for refusal in refusals} <= EVIDENCE_CODES, refusals
    assert not any("do not reproduce" in refusal.message for refusal in refusals), refusals
    lines, code = check_policy(load_policy("default"), loaded)
    assert code in (0, 1, 3, 4) and not any("[KVP" in line for line in lines), lines


SIDE_FILE_KEYS = ("kvpolicy_plan_json", "kvpolicy_keys_json", "kvpolicy_dynamo_json", "kvpolicy_layout_out", "kvpolicy_discover")


@st.composite
def side_file_settings(draw: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` with side-file paths of every odd kind: NULs, directories, devices,
    FIFOs' and sockets' places, missing and file parents, control characters, undecodable bytes, very
    long names, non-strings, and several settings naming one file."""
    special = st.sampled_from(["", ".", "..", "/", "/dev/null", "/dev/zero", "/proc/self/status", "/tmp", "/tmp/",
                               "a\x00b.json", "/nonexistent/dir/x.json", "/etc/passwd/x.json", "x" * 5000, "~/x.json",
                               "plan.json", "run/", "/tmp/kvpolicy-fuzz-side/x.json"])
    odd = odd_file_names().map(os.fsdecode)
    value = st.one_of(special, odd, st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))
    keys = draw(st.lists(st.sampled_from(SIDE_FILE_KEYS), min_size=1, max_size=3, unique=True))
    return {"kvpolicy": "default", **{key: draw(value) for key in keys}}


def side_file_settings_contract(extra_config: dict[str, Any]) -> None:
    """Parsed, or refused with :class:`SettingsError` whose every line names its key; never another
    exception, whatever the paths are and whichever rank judges them."""
    from kvpolicy.documents.settings import KVPolicySettings, SettingsError

    for check_side_files in (False, True):
        with time_limit(CHECK_SECONDS, "settings"):
            try:
                KVPolicySettings.parse(extra_config, check_side_files=check_side_files)
            except SettingsError as error:
                assert error.problems and all(
                    problem.startswith("kv_connector_extra_config.") and "\n" not in problem for problem in error.problems
                ), error.problems
                str(error).encode("utf-8")


TRUST_KEYS = ("kvpolicy_secret", "kvpolicy_previous_secret", "kvpolicy_previous_secret_until", "kvpolicy_keyed_namespaces",
              "kvpolicy_verify_objects")
SECRET_SOURCE_KEYS = TRUST_KEYS[:2]
"""Keys whose value may be the secret itself, written by mistake: never shown in a message."""
TRUST_STRINGS = (
    "env:KVPOLICY_SECRET", "env:OLD_SECRET", "file:/run/secrets/kv", "file:relative", "env:", "file:", ":", "env:9x",
    "env:A-B", "file:a\x00b", "vault:kv", "ENV:X", "s3cr3t-0123456789abcdef", "2030-01-01T00:00:00Z",
    "2030-01-01T00:00:00", "2030-01-01T00:00:00+05:30", "1970-01-01", "9999-12-31T23:59:59-23:59", "0", "1",
    "true", "false", "yes", "off", "null", "",
)
HUGE_CHARS = 100_000


def huge_json_value(shape: int) -> Any:
    """A JSON value holding a text of :data:`HUGE_CHARS` characters, in one of four shapes."""
    return ("x" * HUGE_CHARS, "2030-01-01T00:00:00" + "9" * HUGE_CHARS, ["y" * HUGE_CHARS], {"z": "w" * HUGE_CHARS})[shape % 4]


SETTINGS_LINE_CHARS = MAX_MESSAGE_CHARS + 200
"""The longest a settings error line may be: a cut message and its location."""


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Anything ``json.loads`` could give: null, booleans, numbers, text, lists and string-keyed objects."""
    leaves = st.one_of(
        st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE_INTEGERS), st.floats(allow_nan=True, allow_infinity=True),
        unicode_text(), st.sampled_from(TRUST_STRINGS), st.sampled_from(TRICKY_STRINGS),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(unicode_text(8), children, max_size=3)),
        max_leaves=max_leaves,
    )


def secret_like_values() -> st.SearchStrategy[Any]:
    """What a user might write where a secret's source belongs: the secret itself (12 to 64 characters), bare or
    behind a source's prefix, or inside a list or an object."""
    secret = st.text(st.characters(blacklist_categories=("Cs",)), min_size=12, max_size=64)
    written = st.tuples(st.sampled_from(("", "env:", "file:", "vault:", "env: ", "ENV:")), secret).map("".join)
    return st.one_of(written, st.lists(written, min_size=1, max_size=2), st.dictionaries(unicode_text(8), written, min_size=1, max_size=2))


@st.composite
def trust_settings(draw: Any, huge: bool = False) -> dict[str, Any]:
    """``kv_connector_extra_config`` with some of the five trust keys set to any JSON value (``huge``: or
    to a very long text); a secret's source may be the secret itself."""
    value = st.one_of(json_values(), st.integers(0, 3).map(huge_json_value)) if huge else json_values()
    keys = draw(st.lists(st.sampled_from(TRUST_KEYS), min_size=1, max_size=len(TRUST_KEYS), unique=True))
    return {key: draw(st.one_of(value, secret_like_values()) if key in SECRET_SOURCE_KEYS else value) for key in keys}


def _texts(value: Any) -> Iterator[str]:
    """Every text in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)


def _settings_lines_contract(error: Any, given: dict[str, Any], keys: Iterable[str], bounded: bool) -> None:
    assert error.problems, error
    for line in error.problems:
        assert line.startswith("kv_connector_extra_config.") and "\n" not in line, line
        assert line.split(": error: ")[0].removeprefix("kv_connector_extra_config.").split(".")[0] in keys, line
        assert not bounded or len(line) <= SETTINGS_LINE_CHARS, f"a line of {len(line)} characters: {line[:200]}"
    str(error).encode("utf-8")
    text = str(error)
    for key in SECRET_SOURCE_KEYS:
        elsewhere = repr({other: value for other, value in given.items() if other != key})
        for secret in _texts(given.get(key)):
            # Text also given to another key may be shown as that key's value.
            if len(secret) >= 12 and secret not in elsewhere:
                assert secret not in text, f"{key}'s value {secret!r} is shown: {text[:2000]}"


def trust_settings_contract(extra_config: dict[str, Any], *, bounded: bool = False) -> None:
    """Parsed, or refused with :class:`SettingsError` only, one line per problem at a key that was given, never
    showing text given to ``kvpolicy_secret`` / ``kvpolicy_previous_secret`` (``bounded``: and every line at most
    :data:`SETTINGS_LINE_CHARS` long); parsed settings give every policy requirement a protection or a
    :class:`SettingsError` of the same kind."""
    from kvpolicy.documents.settings import KVPolicySettings, SettingsError
    from kvpolicy.language.models import Keyed, Verified

    with time_limit(CHECK_SECONDS, "trust settings"):
        try:
            settings = KVPolicySettings.parse(extra_config)
        except SettingsError as error:
            _settings_lines_contract(error, extra_config, extra_config, bounded)
            return
        for keyed in Keyed:
            for verified in Verified:
                try:
                    settings.protection(KeyFormat(keyed=keyed, verified=verified))
                except SettingsError as error:
                    _settings_lines_contract(error, extra_config, TRUST_KEYS, bounded)


def cli_contract(argv: list[str]) -> str:
    """Any command line: exit 0, 1 or 2, never a traceback, output bounded, errors on one line each, all of it
    printable on a strict UTF-8 stream; returns what it printed on standard output."""
    out, err = io.StringIO(), io.StringIO()
    with time_limit(CHECK_SECONDS * 5, " ".join(argv)), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code if isinstance(exit_.code, int) else 2
    text = out.getvalue() + err.getvalue()
    # discover --check also exits 3 (no evidence) and 4 (a dangerous difference).
    assert code in (0, 1, 2) or (argv[:1] == ["discover"] and code in (3, 4)), (argv, code)
    assert "Traceback" not in text, text[-2000:]
    # A plan is as large as its (group, rank) entries, which the engine bounds (tp 4096 in JSON: some
    # tens of MB); anything else (errors, usage) is a few lines.
    assert len(text) <= (100_000_000 if code == 0 else 2_000_000), len(text)
    if code == 1 and "--format" not in argv:
        for line in out.getvalue().splitlines():
            if "error" in line:
                assert line.startswith(("error: ", "/")) or re.match(r"[^:]+:\d+:\d+: error: ", line), line
    text.encode("utf-8")  # raises where a lone surrogate (an undecodable path) would reach a stream
    return out.getvalue()
