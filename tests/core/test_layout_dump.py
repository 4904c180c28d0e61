"""``dump_layout``: layouts back to YAML that the loader reads as the same layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_support import full, layout, mamba, mla
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_properties import layouts as engine_layouts

from kvpolicy.documents.loader import check_file, check_text, load_layout
from kvpolicy.language.dumper import compress_layer_names, dump_layout
from kvpolicy.language.expressions import MAX_INT
from kvpolicy.language.models import RESERVED_FIELD_NAMES, Layout, Topology, expand_layer_pattern

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_LAYOUTS = sorted((REPO / "examples" / "layouts").glob("*.yaml"))

# Strings a YAML reader could take for something else: YAML 1.1 and 1.2 booleans, nulls and
# numbers, indicators, comments, quotes, whitespace at either end, breaks and control characters.
TRICKY_STRINGS = (
    "true", "True", "FALSE", "yes", "off", "y", "null", "Null", "~", "", " ", "  lead", "trail  ",
    "1e3", "+1e3", ".5", "1.", "0x10", "0o17", "0b101", "012", "1_000", "12:30", ".inf", "-.inf", ".nan", "-1",
    "2001-12-14", "a: b", "a #b", "#x", "- x", "-", "?", "[x]", "{a}", "a,b", "*a", "&a", "!x", "%x", "@x", "`x",
    "|", "> x", "'q'", '"q"', "...", "---", "<<", "=", "line\nbreak", "tab\tx", "\x07", "\x1b[2J", "\x85", "\u2028",
    "\ufeff", "\u202e", "é", "🙂",
)


def round_trip(original: Layout, tmp_path: Path, **options: Any) -> tuple[Layout | None, list[str]]:
    path = tmp_path / "layout.yaml"
    path.write_text(dump_layout(original, **options), encoding="utf-8")
    document, problems = check_file(path)
    assert document is None or isinstance(document, Layout)
    return document, [str(problem) for problem in problems]


def one_group(**fields: Any) -> Layout:
    return layout(mamba(**fields), heads=1)


def test_the_dumper_imports_neither_vllm_nor_mooncake() -> None:
    code = "import sys, kvpolicy.language.dumper; print(sorted({'vllm', 'mooncake', 'torch'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLE_LAYOUTS, ids=lambda path: path.stem)
def test_example_layouts_read_back_equal_without_diagnostics(path: Path, tmp_path: Path) -> None:
    original = load_layout(path)
    assert round_trip(original, tmp_path) == (original, [])


@pytest.mark.parametrize("value", TRICKY_STRINGS, ids=repr)
def test_a_string_field_value_reads_back_as_the_same_string(value: str) -> None:
    document, problems = check_text(dump_layout(one_group(text=value)))
    assert not problems and isinstance(document, Layout)
    assert document.groups[0].spec.fields["text"] == value


def test_the_string_true_reads_back_as_a_string_not_a_boolean() -> None:
    document, _ = check_text(dump_layout(one_group(flag="true")))
    assert isinstance(document, Layout)
    value = document.groups[0].spec.fields["flag"]
    assert (type(value), value) == (str, "true")


@pytest.mark.parametrize("value", TRICKY_STRINGS, ids=repr)
def test_tricky_strings_read_back_in_every_string_position(value: str, tmp_path: Path) -> None:
    spec = mamba(text=value, nested=[value, [value, 1.5]])
    spec["type"] = f"Plugin{value}Spec"
    spec["bases"] = [value or "KVCacheSpec"]
    original = Layout.model_validate(
        {
            "version": 1,
            "kind": "ModelLayout",
            "model": f"org/{value}",
            "description": value,
            "source": {value: value, "list": [value]},
            "total_num_kv_heads": 1,
            "groups": [{"name": value, "spec": spec, "layers": [f"l{value}", f"m{value}"]}],
        }
    )
    assert round_trip(original, tmp_path) == (original, [])


def test_yaml_1_2_numbers_are_quoted_for_editors_that_read_yaml_1_2() -> None:
    text = dump_layout(layout(mamba(a="1e3", b="0o17", c=".inf", d="+.5"), heads=1))
    assert all(f"{key}: '{value}'" in text for key, value in {"a": "1e3", "b": "0o17", "c": ".inf", "d": "+.5"}.items())


def test_an_integer_page_size_is_written_as_an_integer() -> None:
    data = yaml.safe_load(dump_layout(layout(mla(page_size_bytes=18432), heads=1)))
    assert data["groups"][0]["spec"]["page_size_bytes"] == 18432


def test_a_page_size_expression_keeps_its_text() -> None:
    data = yaml.safe_load(dump_layout(layout(full(page_size_bytes="2 * 16 * max(1, 8 // tp_size)"), heads=8)))
    assert data["groups"][0]["spec"]["page_size_bytes"] == "2 * 16 * max(1, 8 // tp_size)"


def test_a_uniform_group_reads_back_equal(tmp_path: Path) -> None:
    original = layout([mla(), full()], mamba(), heads=2)
    assert round_trip(original, tmp_path) == (original, [])


@settings(deadline=None)
@given(engine_layouts)
def test_generated_engine_layouts_read_back_equal(original: Layout) -> None:
    assert check_text(dump_layout(original)) == (original, [])


# --- shape ---------------------------------------------------------------------------------------


def test_keys_follow_the_order_of_the_example_layouts() -> None:
    original = load_layout(REPO / "examples" / "layouts" / "deepseek-v3.yaml")
    data = yaml.safe_load(dump_layout(original))
    group = data["groups"][0]
    assert (list(data), list(group), list(group["spec"])) == (
        ["version", "kind", "model", "description", "source", "total_num_kv_heads", "groups"],
        ["name", "spec", "layers"],
        ["type", "bases", "block_size", "page_size_bytes", "fields"],
    )


def test_empty_description_source_and_group_name_are_left_out() -> None:
    data = yaml.safe_load(dump_layout(layout(mla(), heads=1)))
    assert (list(data), list(data["groups"][0])) == (
        ["version", "kind", "model", "total_num_kv_heads", "groups"],
        ["spec", "layers"],
    )


def test_the_schema_line_comes_first_and_the_capture_comment_names_the_topology() -> None:
    text = dump_layout(
        layout(mla(), heads=1), schema="../schemas/layout.schema.json", captured_at=Topology(tp_size=4, pp_size=2)
    )
    first, second, third, fourth = text.splitlines()[:4]
    assert first == "# yaml-language-server: $schema=../schemas/layout.schema.json"
    assert "Captured from vLLM's KVCacheConfig" in second and "tp_size 4, pp_size 2" in second
    assert third.startswith("#") and fourth == "version: 1"


def test_without_schema_or_topology_the_document_starts_with_its_version() -> None:
    assert dump_layout(layout(mla(), heads=1)).startswith("version: 1\nkind: ModelLayout\n")


def test_the_same_layout_always_gives_the_same_text() -> None:
    assert dump_layout(layout(mla(), mamba(), heads=2)) == dump_layout(layout(mla(), mamba(), heads=2))


def test_the_document_is_block_style_with_lists_indented_under_their_key() -> None:
    text = dump_layout(layout(mla(), heads=1))
    assert "groups:\n  - spec:\n      type: MLAAttentionSpec\n" in text


def test_short_lists_stay_on_one_line() -> None:
    text = dump_layout(layout(mla(), heads=1))
    assert "bases: [FullAttentionSpec, AttentionSpec, KVCacheSpec]\n" in text


def test_long_layer_lists_have_one_name_per_line() -> None:
    names = [f"model.layers.{index}.mixer" for index in range(0, 40, 4)]
    original = Layout.model_validate(
        {"version": 1, "kind": "ModelLayout", "model": "m", "total_num_kv_heads": 1,
         "groups": [{"spec": mamba(), "layers": names}]}
    )
    assert "    layers:\n" + "".join(f"      - {name}\n" for name in names) in dump_layout(original)


# --- layer ranges --------------------------------------------------------------------------------


def test_consecutive_numbered_layers_become_one_range() -> None:
    names = [f"model.layers.{index}.self_attn.attn" for index in range(61)]
    assert compress_layer_names(names) == ["model.layers.{0..60}.self_attn.attn"]


def test_a_layout_file_writes_the_range_it_compressed() -> None:
    original = Layout.model_validate(
        {"version": 1, "kind": "ModelLayout", "model": "m", "total_num_kv_heads": 1,
         "groups": [{"spec": mla(), "layers": "model.layers.{0..60}.self_attn.attn"}]}
    )
    assert "layers: ['model.layers.{0..60}.self_attn.attn']\n" in dump_layout(original)


def test_runs_are_compressed_where_they_are_and_other_names_kept_in_order() -> None:
    names = ["embed", "l.3.a", "l.4.a", "l.5.a", "l.9.a", "x.10", "x.11", "x.12", "x.13"]
    assert compress_layer_names(names) == ["embed", "l.{3..5}.a", "l.9.a", "x.{10..13}"]


def test_runs_shorter_than_three_stay_literal() -> None:
    assert compress_layer_names(["l.0.attn", "l.1.attn"]) == ["l.0.attn", "l.1.attn"]


def test_numbers_with_leading_zeros_stay_literal() -> None:
    # The loader expands {7..9} to 7, 8, 9: no range spells 007, 008, 009.
    assert compress_layer_names(["l.007", "l.008", "l.009"]) == ["l.007", "l.008", "l.009"]


def test_descending_numbers_stay_literal() -> None:
    assert compress_layer_names(["l.3", "l.2", "l.1"]) == ["l.3", "l.2", "l.1"]


def test_the_number_that_counts_is_the_one_ranged() -> None:
    assert compress_layer_names(["b0.l0", "b0.l1", "b0.l2"]) == ["b0.l{0..2}"]


def test_a_brace_next_to_the_number_still_expands_back() -> None:
    names = ["x{0", "x{1", "x{2"]
    (pattern,) = compress_layer_names(names)
    assert expand_layer_pattern(pattern) == tuple(names)


def test_a_layer_name_the_loader_would_expand_is_refused() -> None:
    with pytest.raises(ValueError, match="contains a '\\{a..b\\}' range"):
        compress_layer_names(["l.{0..1}"])


# --- properties ----------------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
STRINGS = st.one_of(TEXT, st.sampled_from(TRICKY_STRINGS))
INTEGERS = st.integers(-MAX_INT, MAX_INT)
"""Integers a document may hold (the models and the YAML reader refuse larger ones alike)."""
LIST_ITEMS = st.recursive(
    st.one_of(st.none(), st.booleans(), INTEGERS, st.floats(allow_nan=False), STRINGS),
    lambda children: st.lists(children, max_size=3),
    max_leaves=6,
)
FIELD_VALUES = st.one_of(st.none(), st.booleans(), INTEGERS, STRINGS, st.lists(LIST_ITEMS, max_size=4))


@st.composite
def name_runs(draw: Any) -> list[str]:
    """A few layer names, often a run that counts up, sometimes with leading zeros or gaps."""
    head, tail = draw(TEXT), draw(TEXT)
    start, length, step = draw(st.integers(0, 120)), draw(st.integers(1, 6)), draw(st.sampled_from([1, 1, 2]))
    width = draw(st.sampled_from([0, 0, 3]))
    return [f"{head}{start + index * step:0{width}d}{tail}" for index in range(length)]


def literal_names(runs: list[list[str]]) -> list[str]:
    """The runs' names once each, in order, without those the loader would expand or refuse."""

    def literal(name: str) -> bool:
        try:
            return expand_layer_pattern(name) == (name,)
        except ValueError:
            return False

    return [name for name in dict.fromkeys(name for run in runs for name in run) if literal(name)]


@st.composite
def specs(draw: Any) -> dict[str, Any]:
    return {
        "type": draw(st.sampled_from(["PluginSpec", "ShortConvStateSpec"])) + draw(TEXT),
        "bases": draw(st.lists(STRINGS, max_size=3)),
        "block_size": draw(st.integers(1, 4096)),
        "page_size_bytes": draw(st.one_of(st.integers(1, 2**40), st.sampled_from(["4096 // tp_size + 1", "16*2"]))),
        "fields": draw(st.dictionaries(STRINGS.filter(lambda name: name not in RESERVED_FIELD_NAMES), FIELD_VALUES, max_size=4)),
    }


@st.composite
def string_layouts(draw: Any) -> Layout:
    runs = draw(st.lists(name_runs(), min_size=1, max_size=6))
    names = literal_names(runs)
    if not names:
        names = ["layer"]
    groups: list[dict[str, Any]] = []
    while names:
        take = draw(st.integers(1, len(names)))
        members, names = names[:take], names[take:]
        group: dict[str, Any] = {} if draw(st.booleans()) else {"name": draw(STRINGS)}
        if draw(st.booleans()):
            group.update(spec=draw(specs()), layers=members)
        else:
            split = draw(st.integers(1, len(members)))
            parts = [part for part in (members[:split], members[split:]) if part]
            group["uniform"] = [{"spec": draw(specs()), "layers": part} for part in parts]
        groups.append(group)
    return Layout.model_validate(
        {
            "version": 1,
            "kind": "ModelLayout",
            "model": draw(STRINGS.filter(bool)),
            "description": draw(STRINGS),
            "source": draw(st.dictionaries(STRINGS, LIST_ITEMS, max_size=3)),
            "total_num_kv_heads": draw(st.integers(1, 256)),
            "groups": groups,
        }
    )


@settings(deadline=None)
@given(string_layouts())
def test_generated_layouts_with_arbitrary_strings_read_back_equal(original: Layout) -> None:
    assert check_text(dump_layout(original, captured_at=Topology(tp_size=2))) == (original, [])


@settings(deadline=None)
@given(st.lists(name_runs(), min_size=1, max_size=5))
def test_written_layer_patterns_expand_to_exactly_the_names(runs: list[list[str]]) -> None:
    names = literal_names(runs)
    patterns = compress_layer_names(names)
    assert [name for pattern in patterns for name in expand_layer_pattern(pattern)] == names
