"""The key grammar lives in ``kvpolicy/language/keys.py`` alone: every recorded key reads back into the fields
that rendered it and renders again to the same bytes, malformed keys are refused at the column where
they go wrong, and no other module spells a key's parts or cuts a key at its ``@``."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from core_support import full, layout, mla
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.keys import (
    AGREEMENT_MARKER,
    DEMOTED_SUFFIX,
    DEMOTION_MARKER,
    KEY_TEMPLATE_FIELDS,
    UPSTREAM_KEY_TEMPLATE,
    KeyContext,
    KeyParseError,
    chunk_key,
    marker_key,
    parse_key,
    parse_prefix,
    render_prefix,
)
from kvpolicy.language.models import Topology
from kvpolicy.planning.contract import key_contract
from kvpolicy.planning.engine import make_plan, plan_deployment

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import golden_keys  # noqa: E402

GOLDEN = json.loads(golden_keys.golden_path().read_text(encoding="utf-8"))
TEMPLATES = {name: load_policy(name).key.template for name in {case["policy"] for case in GOLDEN["cases"]}}
CHUNK_HASH = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def golden_prefixes() -> Iterator[tuple[str, str]]:
    """(policy, prefix) of every prefix recorded in the golden file."""
    for case in GOLDEN["cases"]:
        for group in case["lookup_prefixes"]:
            for prefix in group:
                yield case["policy"], prefix


# --- round trips ---------------------------------------------------------------------------------


def test_every_recorded_prefix_reads_back_and_renders_to_the_same_bytes() -> None:
    mismatched = [
        prefix for policy, prefix in golden_prefixes() if parse_prefix(prefix, TEMPLATES[policy]).render(TEMPLATES[policy]) != prefix
    ]
    assert mismatched == []


def test_every_recorded_prefix_reads_back_as_a_chunk_key_with_its_hash() -> None:
    for policy, prefix in golden_prefixes():
        parsed = parse_key(chunk_key(prefix, CHUNK_HASH), TEMPLATES[policy])
        assert parsed.chunk_hash == CHUNK_HASH and parsed.marker is None
        assert parsed.prefix == parse_prefix(prefix, TEMPLATES[policy])


@pytest.mark.parametrize("index", range(len(golden_keys.cases())))
def test_the_fields_read_back_are_those_the_contract_states(index: int) -> None:
    case = golden_keys.cases()[index]
    topology = Topology(tp_size=case["tp"], pp_size=case.get("pp", 1), dcp_size=case.get("dcp", 1))
    options = {"store_tp_size": case["store_tp"]} if "store_tp" in case else {}
    plan, document, _ = plan_deployment(
        load_policy(case["policy"]), load_layout(case["layout"]), topology,
        extra_config={**options, "cache_prefix": case.get("cache_prefix", "")},
    )
    contract = key_contract(plan, document)
    for group in contract.groups:
        for rank in group.ranks:
            shards = plan.groups[group.index].ranks[rank.tp_rank].key_shards
            for shard, prefix in zip(shards, rank.prefixes, strict=True):
                parsed = parse_prefix(prefix, contract.template)
                assert (parsed.model, parsed.cache_prefix, parsed.store_namespace) == (
                    contract.model, contract.cache_prefix, contract.store_namespace
                )
                assert (parsed.group, parsed.shard, parsed.pcp_rank, parsed.dcp_rank, parsed.pp_rank) == (
                    group.index, shard, rank.pcp_rank, rank.dcp_rank, rank.pp_rank
                )
                assert parsed.fingerprint == (contract.fingerprint if "{fingerprint}" in contract.template else None)
                assert parsed.demoted is None


def test_a_demoted_groups_suffix_reads_back_as_the_fingerprint_that_demoted_it() -> None:
    document = layout(mla(), full(), heads=1)
    plan = make_plan(load_policy("vllm-compat"), document, Topology(tp_size=4), demoted={0})
    template = plan.key_template
    demoted, kept = plan.key_prefix(0, 3), plan.key_prefix(1, 3)
    assert DEMOTED_SUFFIX in demoted and DEMOTED_SUFFIX not in kept
    assert parse_prefix(demoted, template).demoted == plan.fingerprint
    assert parse_prefix(kept, template).demoted is None
    assert parse_prefix(demoted, template).render(template) == demoted


def test_a_template_with_the_fingerprint_spells_a_demotion_without_the_suffix() -> None:
    document = layout(mla(), heads=1)
    plan = make_plan(load_policy("default"), document, Topology(tp_size=4), demoted={0})
    parsed = parse_prefix(plan.key_prefix(0, 1), plan.key_template)
    assert DEMOTED_SUFFIX not in plan.key_prefix(0, 1)
    assert (parsed.fingerprint, parsed.demoted) == (plan.fingerprint, None)


@pytest.mark.parametrize("marker, replicas", [(AGREEMENT_MARKER, 4), (DEMOTION_MARKER, None)])
def test_an_audit_marker_reads_back_as_a_marker_not_a_chunk(marker: str, replicas: int | None) -> None:
    policy, prefix = next(golden_prefixes())
    fingerprint = "0123456789ab"
    parsed = parse_key(marker_key(prefix, marker, fingerprint, replicas=replicas), TEMPLATES[policy])
    assert (parsed.marker, parsed.marker_fingerprint, parsed.replicas, parsed.chunk_hash) == (
        marker, fingerprint, replicas, None
    )
    assert parsed.prefix.render(TEMPLATES[policy]) == prefix


def segmented_templates() -> st.SearchStrategy[str]:
    """Valid templates: every field, each after a literal of its own (but the store namespace, which
    starts with its own ``@``), in any order."""
    return st.permutations(KEY_TEMPLATE_FIELDS).map(
        lambda names: "".join(
            "{store_namespace}" if name == "store_namespace" else f"@{name}:{{{name}}}" for name in names
        )
    )


names = st.text(st.sampled_from("abcXYZ019-._:/"), min_size=1, max_size=12)


@settings(deadline=None)
@given(
    template=st.one_of(st.just(UPSTREAM_KEY_TEMPLATE), segmented_templates()),
    model=names.filter(lambda name: "/" not in name),
    cache_prefix=st.one_of(st.just(""), names, names.map(lambda name: f"{name}@{name}")),
    store_namespace=st.sampled_from(
        ("", "@store_pp:1@store_format:tp_shared_mqa", "@store_tp:8@store_pp:2@store_format:tp_shared_lbhnc")
    ),
    numbers=st.tuples(*[st.integers(0, 10_000)] * 5),
    demoted=st.booleans(),
)
def test_any_rendered_prefix_reads_back_into_the_values_that_rendered_it(
    template: str, model: str, cache_prefix: str, store_namespace: str, numbers: tuple[int, ...], demoted: bool
) -> None:
    group, shard, pcp_rank, dcp_rank, pp_rank = numbers
    context = KeyContext(model, cache_prefix, store_namespace)
    prefix = render_prefix(
        template, context, fingerprint="00ff00ff00ff", group=group, shard=shard, pcp_rank=pcp_rank,
        dcp_rank=dcp_rank, pp_rank=pp_rank, demoted=demoted,
    )
    parsed = parse_prefix(prefix, template)
    assert parsed.context == context
    assert (parsed.group, parsed.shard, parsed.pcp_rank, parsed.dcp_rank, parsed.pp_rank) == numbers
    assert parsed.render(template) == prefix


def test_a_field_used_twice_must_render_the_same_text_in_both_places() -> None:
    template = UPSTREAM_KEY_TEMPLATE + "@again:{cache_prefix}{group}"
    context = KeyContext("M", "tenant@a")
    prefix = render_prefix(template, context, fingerprint="0" * 12, group=3, shard=1, pcp_rank=0, dcp_rank=0, pp_rank=0)
    parsed = parse_prefix(prefix, template)
    assert (parsed.context, parsed.group, parsed.render(template)) == (context, 3, prefix)
    with pytest.raises(KeyParseError):
        parse_prefix(prefix.removesuffix("3") + "4", template)


# --- refusals ------------------------------------------------------------------------------------


UPSTREAM_PREFIX = "DeepSeek-V3@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
DEFAULT_PREFIX = "DeepSeek-V3@plan:c656823b12c8@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"


@pytest.mark.parametrize(
    "template, good, bad_part, replacement, expected",
    [
        (UPSTREAM_KEY_TEMPLATE, UPSTREAM_PREFIX, "@pcp", "@pxp", "'@pcp'"),
        (UPSTREAM_KEY_TEMPLATE, UPSTREAM_PREFIX, "@tp_rank:0", "@tp_rank:x", "a number for {shard}"),
        (UPSTREAM_KEY_TEMPLATE, UPSTREAM_PREFIX, "@group:0", "@group:00", "the end of the prefix"),
        (UPSTREAM_KEY_TEMPLATE, UPSTREAM_PREFIX, "@group:", "@grp:", "'@group:'"),
        (UPSTREAM_KEY_TEMPLATE, UPSTREAM_PREFIX, "@pp_rank:0", "@pp_rank:-1", "a number for {pp_rank}"),
        ("{cache_prefix}{model}{store_namespace}@plan:{fingerprint}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}"
         "@pp_rank:{pp_rank}@group:{group}", DEFAULT_PREFIX, "c656823b12c8", "C656823B12C8", "a fingerprint"),
    ],
)
def test_a_malformed_prefix_is_refused_at_the_column_where_it_goes_wrong(
    template: str, good: str, bad_part: str, replacement: str, expected: str
) -> None:
    assert parse_prefix(good, template).render(template) == good
    bad = good.replace(bad_part, replacement, 1)
    first_difference = next((index for index, (a, b) in enumerate(zip(good, bad, strict=False)) if a != b), len(good))
    with pytest.raises(KeyParseError) as refused:
        parse_prefix(bad, template, source="keys.txt")
    # The refusal points at the part that differs, or at the separator just before it.
    assert refused.value.column - 1 in range(bad.rfind("@", 0, first_difference + 1), first_difference + 1)
    assert str(refused.value).startswith(f"keys.txt:1:{refused.value.column}: error: expected {expected}")
    assert repr(bad) in str(refused.value)


@pytest.mark.parametrize(
    "tail, what",
    [("", "no chunk hash"), ("@ABCDEF", "an upper-case hash"), ("@kvpolicy-audit-agreed@0123", "a short fingerprint")],
)
def test_a_key_without_a_chunk_hash_or_marker_is_refused_where_its_tail_starts(tail: str, what: str) -> None:
    with pytest.raises(KeyParseError) as refused:
        parse_key(UPSTREAM_PREFIX + tail, UPSTREAM_KEY_TEMPLATE)
    assert refused.value.column == len(UPSTREAM_PREFIX) + 1, what
    assert "a chunk hash (lowercase hex) or an audit marker" in refused.value.message


def test_an_empty_prefix_is_refused_at_its_first_column() -> None:
    with pytest.raises(KeyParseError) as refused:
        parse_prefix("", UPSTREAM_KEY_TEMPLATE)
    assert refused.value.column == 1 and "the model name" in refused.value.message


def test_an_invalid_template_is_refused_before_any_key_is_read() -> None:
    with pytest.raises(ValueError, match="lacks {group}"):
        parse_prefix(UPSTREAM_PREFIX, "{model}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}")


# --- one grammar ---------------------------------------------------------------------------------


KEY_SPELLINGS = ("@demoted:", "@tp_rank:", "@pp_rank:", "@group:", "@store_pp:", "@store_tp:", "@store_format:",
                 AGREEMENT_MARKER, DEMOTION_MARKER)
"""Parts of a key only :mod:`kvpolicy.language.keys` spells (a template is the policy's, not code's)."""
NOT_YET_SWITCHED: dict[str, set[str]] = {}
"""Call sites in files another change owns, to switch to :func:`kvpolicy.language.keys.split_chunk_key` there;
an entry that no longer matches is stale and fails."""


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in node.body:
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                    found.add(id(statement.value))
    return found


def key_grammar_uses(path: Path, *, spellings: bool) -> Iterator[str]:
    """Where ``path`` cuts a string at ``'@'`` or (with ``spellings``) spells a key part in code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if spellings and isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield from (f"{node.lineno}: spells {part!r}" for part in KEY_SPELLINGS if part in node.value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("split", "rsplit", "partition", "rpartition")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "@"
        ):
            yield f"{node.lineno}: {node.func.attr}('@')"


def test_the_scan_sees_a_cut_at_the_separator_and_a_spelled_key_part(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('"""@group: in a docstring is prose."""\nkey.rpartition("@")\nx = f"{a}@demoted:{b}"\n', encoding="utf-8")
    assert list(key_grammar_uses(probe, spellings=True)) == ["2: rpartition('@')", "3: spells '@demoted:'"]


def test_no_product_module_but_keys_spells_or_cuts_a_key() -> None:
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "kvpolicy").rglob("*.py")):
        name = str(path.relative_to(REPO))
        if name == "kvpolicy/language/keys.py":
            continue
        for use in key_grammar_uses(path, spellings=True):
            found.setdefault(name, set()).add(use.split(": ", 1)[1])
    assert found == NOT_YET_SWITCHED


def test_no_test_benchmark_or_script_cuts_a_key_at_its_separator() -> None:
    found = [
        f"{path.relative_to(REPO)}:{use}"
        for root in ("tests", "benchmarks", "scripts")
        for path in sorted((REPO / root).rglob("*.py"))
        for use in key_grammar_uses(path, spellings=False)
    ]
    assert found == []
