"""The fast YAML reader against the reference: PyYAML's own safe loader walked by the position-tracking
builder (``parse(..., reference=True)``). Whatever a document holds, both give the same values (types
included), the same problems and the same positions, and ``check_text`` the same documents and
diagnostics (message, code, line, column) whichever reads; the fast reader really takes plain documents."""

from __future__ import annotations

import datetime
import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yaml.constructor import SafeConstructor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import fuzz_strategies as fs

from kvpolicy.documents import loader
from kvpolicy.language.models import Policy
from kvpolicy.language.yamlsource import MAX_NODES, SourceMap, parse

PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


SCALARS = (str, int, float, bool, type(None), bytes, datetime.date)


def exact(value: Any) -> Any:
    """``value`` with every scalar spelled with its type: ``True``, ``1`` and ``1.0`` differ, as do key
    orders. Other objects by their type alone (PyYAML makes a generator of ``!!map 1``)."""
    if isinstance(value, dict):
        return ("dict", [(exact(key), exact(item)) for key, item in value.items()])
    if isinstance(value, list):
        return ("list", [exact(item) for item in value])
    return (type(value).__name__, repr(value) if isinstance(value, SCALARS) else None)


def same_reading(text: str) -> None:
    fast_value, fast_source, fast_problems = parse(text, "doc.yaml")
    slow_value, slow_source, slow_problems = parse(text, "doc.yaml", reference=True)
    assert exact(fast_value) == exact(slow_value)
    assert fast_problems == slow_problems
    if [problem.code for problem in slow_problems] == ["KVP003"] and "nodes" in slow_problems[0].message:
        return  # over the node limit the reference keeps the positions it had reached, which nothing reads
    assert fast_source.values == slow_source.values
    assert fast_source.keys == slow_source.keys


@contextmanager
def reference_reader() -> Iterator[None]:
    with mock.patch.object(loader, "parse", functools.partial(parse, reference=True)):
        yield


def described(document: Any) -> Any:
    """A loaded document in every respect a caller sees, exactly (``==`` takes ``true`` for ``1``)."""
    if document is None:
        return None
    if isinstance(document, Policy):
        origins = [
            (document.rule_origin(index), *(document.expression_origin(index, field) for field in ("when", "factor", "shards")))
            for index in range(len(document.rules))
        ]
        return repr(document), origins
    return repr(document)


def located(problems: list[Any]) -> list[tuple[str, str, str, int, int]]:
    # The patched reader runs one call deeper, so a recursion limit may be met in a C call rather
    # than a Python one, which Python words differently; the diagnostic is the same otherwise.
    return [
        (p.message.replace(" while calling a Python object", ""), p.code, p.severity, p.line, p.column) for p in problems
    ]


def same_check(text: str) -> None:
    fast_document, fast_problems = loader.check_text(text, "doc.yaml")
    with reference_reader():
        slow_document, slow_problems = loader.check_text(text, "doc.yaml")
    assert located(fast_problems) == located(slow_problems)
    assert described(fast_document) == described(slow_document)


def same(text: str) -> None:
    same_reading(text)
    same_check(text)


# --- the fuzzing corpora -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(fs.SEEDS))
def test_the_shipped_documents_read_alike_and_the_fast_reader_takes_them(name: str) -> None:
    same(fs.SEEDS[name])
    _, source, problems = parse(fs.SEEDS[name], name)
    assert not problems and not source.built  # the plain reader read it: the maps wait until asked for
    assert source.locate(("version",)).line >= 1 and not source.built
    assert source.values and source.built


@PROPERTY
@given(fs.mutated_documents())
def test_mutated_documents_read_alike(text: str) -> None:
    same(text)


@PROPERTY
@given(fs.mutated_texts())
def test_mangled_yaml_text_reads_alike(text: str) -> None:
    same(text)


@PROPERTY
@given(fs.generated_documents())
def test_generated_documents_read_alike(text: str) -> None:
    same(text)


@PROPERTY
@given(st.one_of(fs.yaml_values(30), st.lists(fs.yaml_values(8), max_size=5)))
def test_arbitrary_yaml_values_read_alike(value: Any) -> None:
    same_reading(yaml.safe_dump(value, allow_unicode=True))


@pytest.mark.parametrize("snippet", fs.SNIPPETS, ids=lambda snippet: repr(snippet[:24]))
def test_every_hostile_snippet_reads_alike(snippet: str) -> None:
    seed = fs.SEEDS["policies/default.yaml"]
    same(seed + snippet)
    same(snippet + seed)
    same(snippet)


# --- what the fast reader leaves to the reference ------------------------------------------------

POLICY = "version: 1\nkind: ReplicationPolicy\nname: p\nrules: []\n"


@pytest.mark.parametrize(
    "text",
    [
        POLICY + "name: q\n",  # a duplicate key
        POLICY + "audit: {steps: 1, steps: 2}\n",
        POLICY + "spec_fields: {1: a, '1': b}\n",  # the same key once it is a string
        POLICY + "? [a, b]\n: c\n",  # a collection as a key
        POLICY + "? {a: 1}\n: c\n",
        POLICY + "base: &b {mode: warn}\naudit:\n  <<: *b\n",  # a merge key
        POLICY + "x: &a [1, 2]\ny: [*a, *a, *a]\n",  # aliases, expanded and counted
        POLICY + "audit: {steps: " + "9" * 80 + "}\n",  # number literals at and beyond what is read
        POLICY + "audit: {steps: " + "9" * 81 + "}\n",
        POLICY + "audit: {steps: " + "1." + "5" * 79 + "}\n",
        POLICY + "audit: {steps: 9223372036854775807}\n",  # 63 bits, and beyond
        POLICY + "audit: {steps: 9223372036854775808}\n",
        POLICY + "audit: {steps: -9223372036854775808}\n",
        POLICY + "audit: {steps: 0x7fffffffffffffff, x: 0o17, y: 017, z: 0b101, w: 1_000, v: 1:30, u: +12, t: -0}\n",
        POLICY + "x: [.inf, -.inf, .nan, 1e3, 1.5e-3, 0., -0.0, 1_0.5]\n",
        POLICY + "x: [~, null, Null, true, True, yes, no, on, off, y, n]\n",
        POLICY + "x: {1: a, 1.5: b, true: c, null: d, 0x10: e, 2001-12-14: f}\n",  # keys that are not strings
        POLICY + 'x: [!!int "12", !!float "1", !!bool "true", !!null "", !!str 12, !!str true]\n',  # explicit tags
        POLICY + 'x: [!!bool "maybe", !!int "a", !!float "b"]\n',
        POLICY + "x: [!!binary aGk=, !!timestamp 2001-12-14, 2001-12-14t21:59:43.10-05:00]\n",
        POLICY + "x: !!set {a, b}\ny: !!omap [a: 1]\nz: !custom 1\nw: !!python/none ''\n",
        POLICY + "x: !!int\n",
        POLICY + 'x: ["\\u0661\\u0662", !!int "\\u0661\\u0662", !!int "\\u00b2"]\n',  # non-ASCII digits
        POLICY + "x: " + "[" * 99 + "]" * 99 + "\n",  # nesting around where the fast reader stops
        POLICY + "x: " + "[" * 101 + "]" * 101 + "\n",
        POLICY + "x: " + "{a: " * 120 + "1" + "}" * 120 + "\n",
        POLICY + "x: " + "[" * 3000 + "]" * 3000 + "\n",
        POLICY + "x: 'a\x85b'\n",
        "",
        "---\n...\n",
        "1\n",
        "'text'\n",
        "[1, 2]\n",
        POLICY + "---\n" + POLICY,
        "a: 1\n\tb: 2\n",
        "a: \x01\n",
    ],
    ids=lambda text: repr(text[len(POLICY):][:40] if text.startswith(POLICY) else text[:40]),
)
def test_what_only_the_reference_judges_reads_alike(text: str) -> None:
    same(text)


@pytest.mark.parametrize("nodes", [MAX_NODES, MAX_NODES + 1])
def test_the_node_limit_is_the_same_for_both(nodes: int) -> None:
    # A flow sequence of `nodes - 1` scalars is `nodes` nodes; so is a mapping of half as many keys.
    same_reading("[" + ", ".join(["0"] * (nodes - 1)) + "]\n")
    same_reading("{" + ", ".join(f"k{index}: 0" for index in range((nodes - 1) // 2)) + "}\n")


@pytest.mark.parametrize(("depth", "width"), [(5, 9), (9, 3), (9, 9), (11, 3)])
def test_alias_bombs_count_alike(depth: int, width: int) -> None:
    same(fs.SEEDS["policies/default.yaml"] + fs._bomb(depth, width))


@pytest.mark.parametrize("where", ["before", "after"])
def test_the_node_limit_and_a_refused_value_are_met_in_the_references_order(where: str) -> None:
    # Over the limit, the fast reader answers for the reference only when nothing it would refuse
    # comes before the node that crosses the limit.
    bomb = 'x0: &x0 ["y"]\n' + "".join(f"x{i}: &x{i} [*x{i - 1}, *x{i - 1}, *x{i - 1}]\n" for i in range(1, 12))
    bad = "bad: " + "9" * 81 + "\n"
    text = POLICY + (bad + bomb if where == "before" else bomb + bad)
    same(text)
    message = parse(text, "p.yaml")[2][0].message
    assert ("literal of 81 characters" in message) if where == "before" else ("more than" in message)


def test_a_constructor_a_program_registers_is_used_by_both(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fast reader takes only PyYAML's own number constructors; another one leaves the reading to the reference.
    monkeypatch.setitem(
        SafeConstructor.yaml_constructors, "tag:yaml.org,2002:int", lambda constructor, node: f"int {node.value}"
    )
    value, _, _ = parse(POLICY, "p.yaml")
    assert value["version"] == "int 1"
    same_reading(POLICY + "x: [1, 0x10, '2']\n")


def test_path_resolvers_a_program_registers_are_asked_by_both(monkeypatch: pytest.MonkeyPatch) -> None:
    # With a path resolver a tag depends on where a scalar stands, so the fast loader asks every time.
    class Probe(yaml.resolver.BaseResolver):
        pass

    # (Only for a quoted scalar: PyYAML's implicit resolvers come first for a plain one.)
    Probe.add_path_resolver("tag:yaml.org,2002:int", [(yaml.MappingNode, "x"), (yaml.MappingNode, "v")], yaml.ScalarNode)
    monkeypatch.setattr(yaml.resolver.BaseResolver, "yaml_path_resolvers", Probe.yaml_path_resolvers)
    text = POLICY + "w: '7'\nx: {v: '7'}\ny: ['7', {v: '7'}]\n"
    value, _, _ = parse(text, "p.yaml")
    assert (value["w"], value["x"]["v"], value["y"]) == ("7", 7, ["7", {"v": "7"}])
    same_reading(text)


def paths_near(paths: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Every path of a document, and paths beside them that it does not have."""
    near = [(), ("missing",), (0,), ("rules", -1), ("rules", True), ("rules", 10**6), ("rules", "0")]
    for path in paths:
        near += [path, (*path, "x"), (*path, 0), (*path[:-1], "zz"), (*path[:-1], 999)]
    return near


def same_positions(text: str) -> None:
    """Questions about single paths, asked before any map is built, are answered as the maps answer."""
    _, slow, slow_problems = parse(text, "doc.yaml", reference=True)
    _, fast, fast_problems = parse(text, "doc.yaml")
    if slow_problems or fast_problems:
        return
    deferred = not fast.built  # else the plain reader left the document to the reference
    with mock.patch.object(SourceMap, "WALKS", 10**9):  # every question walks
        for path in paths_near([*slow.values, *slow.keys]):
            for prefer_key in (False, True):
                assert fast.locate(path, prefer_key=prefer_key) == slow.locate(path, prefer_key=prefer_key), path
            assert fast.value_position(path) == slow.values.get(path) == slow.value_position(path), path
            assert fast.diagnostic(path, "m", code="KVP105", offset=2) == slow.diagnostic(path, "m", code="KVP105", offset=2)
    assert fast.built is not deferred  # the questions built no map


@pytest.mark.parametrize("name", sorted(fs.SEEDS))
def test_positions_of_single_paths_are_the_maps_answers_for_shipped_documents(name: str) -> None:
    same_positions(fs.SEEDS[name])


@PROPERTY
@given(st.one_of(fs.mutated_documents(), fs.generated_documents()))
def test_positions_of_single_paths_are_the_maps_answers(text: str) -> None:
    same_positions(text)


def test_positions_asked_later_are_those_the_reference_gives() -> None:
    text = fs.SEEDS["policies/default.yaml"]
    _, fast, _ = parse(text, "p.yaml")
    _, slow, _ = parse(text, "p.yaml", reference=True)
    assert fast.locate(("rules", 3, "shards")) == slow.locate(("rules", 3, "shards"))
    assert fast.diagnostic(("rules", 3, "when"), "m", code="KVP105", offset=4) == slow.diagnostic(
        ("rules", 3, "when"), "m", code="KVP105", offset=4
    )
    assert fast.keys == slow.keys and fast.values == slow.values


def test_many_questions_about_a_wide_mapping_build_the_maps_once() -> None:
    # Walking a mapping of many keys once per question would be quadratic in the warnings a policy earns.
    fields = "".join(f"          field{index}: 1\n" for index in range(2000))
    text = POLICY.replace("rules: []\n", "rules:\n  - name: r\n    reason: r\n    match:\n      fields:\n") + fields
    text += "    replication: sharded\n"
    _, source, problems = parse(text, "p.yaml")
    assert not problems and not source.built
    for index in range(2000):
        source.locate(("rules", 0, "match", "fields", f"field{index}"), prefer_key=True)
    assert source.built
    document, found = loader.check_text(text, "p.yaml")
    assert document is not None and sum(problem.code == "KVP202" for problem in found) == 100  # capped
    same(text)


@pytest.mark.parametrize(
    "text",
    [
        POLICY + "audit: !custom {mode: warn}\n",
        POLICY + "spec_fields: !!python/tuple [a]\n",
        POLICY + "spec_fields: !!set {a, b}\n",
        POLICY + "description: !!binary ZXhhbXBsZQ==\n",
        "%TAG ! tag:example.com,2000:\n---\n" + POLICY + "audit: !mode {mode: warn}\n",
        POLICY + "description: !!str 5\naudit: {steps: !!int '4'}\n",
        POLICY.replace("version: 1", "version: !!float 1"),
    ],
    ids=["local-tag-on-mapping", "python-tuple", "set", "binary", "tag-directive", "core-tags", "float-tag"],
)
def test_tags_are_honoured_or_refused_alike(text: str) -> None:
    same(text)
