"""Fuzzing the loader, ``kvpolicy validate`` and the expression evaluator with a few hundred inputs.

The inputs (mutated shipped policies and example layouts, YAML snippets such as alias bombs and
explicit tags, generated policy- and layout-shaped documents, adversarial expressions and key
templates, documents whose aliases multiply unknown keys, tagged documents and directives, file names
with control characters, layouts whose expressions fail at some topology) come from ``fuzz_strategies.py``, which
``scripts/fuzz.py`` runs for much longer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import fuzz_strategies as fs
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpolicy.app.cli import main
from kvpolicy.documents.loader import check_text
from kvpolicy.language.expressions import Expression, ExpressionError
from kvpolicy.language.models import KeyFormat

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- the loader ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(fs.SEEDS))
def test_the_unmutated_seed_documents_load(name: str) -> None:
    # The mutations start from valid documents, so the contract below is not vacuous.
    document, _ = fs.check_contract(fs.SEEDS[name], name)
    assert document is not None


@settings(FUZZ)
@given(fs.mutated_documents())
def test_check_text_reports_located_problems_for_mutated_documents(text: str) -> None:
    fs.check_contract(text)


@settings(FUZZ)
@given(fs.mutated_texts())
def test_check_text_reports_located_problems_for_mangled_yaml_text(text: str) -> None:
    fs.check_contract(text)


@settings(FUZZ)
@given(fs.generated_documents())
def test_check_text_reports_located_problems_for_generated_documents(text: str) -> None:
    fs.check_contract(text)


@pytest.mark.parametrize("snippet", fs.SNIPPETS, ids=lambda snippet: repr(snippet[:24]))
def test_check_text_reports_located_problems_for_every_yaml_snippet(snippet: str) -> None:
    seed = fs.SEEDS["policies/default.yaml"]
    fs.check_contract(seed + snippet)
    fs.check_contract(snippet + seed)


def test_an_alias_bomb_is_refused_quickly() -> None:
    document, problems = fs.check_contract(fs.SEEDS["policies/default.yaml"] + fs._bomb(9, 9))
    assert document is None and any("nodes" in problem.message for problem in problems)


@pytest.mark.parametrize("pattern", ["l.{0..9999}.{0..9999}", "l.{0..999}.{0..999}.{0..999}"])
def test_nested_layer_ranges_cannot_expand_a_small_layout_without_bound(pattern: str) -> None:
    layout = fs.SEEDS["examples/layouts/llama-3.1-70b.yaml"]
    mutated = re.sub(r"^    layers: .*$", f'    layers: ["{pattern}"]', layout, count=1, flags=re.MULTILINE)
    assert mutated != layout
    document, _ = fs.check_contract(mutated)  # within fs.CHECK_SECONDS
    assert document is None



def test_many_large_layer_ranges_cannot_expand_a_small_layout_without_bound() -> None:
    patterns = ", ".join(f'"l{index}.{{0..100000}}"' for index in range(100))
    layout = fs.SEEDS["examples/layouts/llama-3.1-70b.yaml"]
    mutated = re.sub(r"^    layers: .*$", f"    layers: [{patterns}]", layout, count=1, flags=re.MULTILINE)
    with fs.time_limit(1.5, "a 2 KB layout"):
        document, problems = check_text(mutated, "layout.yaml")
    assert document is None
    assert any("a layout may have at most" in problem.message for problem in problems)


@settings(FUZZ)
@given(fs.alias_amplified_documents())
def test_aliases_multiplying_unknown_keys_are_judged_in_bounded_time_and_memory(text: str) -> None:
    fs.memory_contract(text)


@settings(FUZZ)
@given(fs.tagged_documents())
def test_check_text_reports_located_problems_for_tagged_documents(text: str) -> None:
    fs.check_contract(text)


# --- the CLI -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("validate") / "fuzzed.yaml"


@settings(
    FUZZ, suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture]
)
@given(content=fs.raw_files(), output=st.sampled_from(["text", "json", "github", "sarif"]))
def test_validate_prints_diagnostics_never_a_traceback(
    content: bytes, output: str, scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # capsys is function-scoped but holds no state between examples: each reads its own output.
    scratch.write_bytes(content)
    capsys.readouterr()
    with fs.time_limit(fs.CHECK_SECONDS, "kvpolicy validate"):
        code = main(["validate", "--format", output, str(scratch)])
    out, err = capsys.readouterr()
    fs.judge_validate(code, out, err, output, scratch)


@pytest.mark.parametrize("output", ["text", "json", "github", "sarif"])
@pytest.mark.parametrize("kind", fs.SPECIAL_FILES)
def test_validate_refuses_every_special_path_with_one_located_error(kind: str, output: str, tmp_path: Path) -> None:
    fs.special_file_contract(kind, output, tmp_path)


@settings(
    FUZZ, suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture]
)
@given(name=fs.odd_file_names(), content=fs.raw_files(), output=st.sampled_from(["text", "json", "github", "sarif"]))
def test_validate_keeps_one_line_per_problem_whatever_the_file_is_named(
    name: bytes, content: bytes, output: str, tmp_path: Path
) -> None:
    fs.odd_path_contract(name, content, output, tmp_path)


@settings(
    FUZZ, suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.function_scoped_fixture]
)
@given(case=fs.plan_documents())
def test_a_plan_refused_for_what_a_layout_says_points_at_it(case: tuple[str, str, int], tmp_path: Path) -> None:
    fs.plan_document_contract(case, tmp_path)


@settings(FUZZ)
@given(fs.plan_argvs())
def test_any_plan_explain_or_diff_command_line_exits_0_1_or_2_without_a_traceback(argv: list[str]) -> None:
    fs.cli_contract(argv)


@given(fs.command_line_edges())
def test_repeated_unknown_and_misspelled_flags_of_every_command_exit_0_1_or_2_without_a_traceback(argv: list[str]) -> None:
    fs.cli_contract(argv)


@pytest.mark.parametrize("kind", fs.SPECIAL_FILES)
def test_doctor_refuses_every_special_mooncake_config_path_at_once(kind: str, tmp_path: Path) -> None:
    fs.doctor_config_contract(kind, tmp_path)


@given(fs.side_file_settings())
def test_side_file_paths_of_every_kind_are_parsed_or_refused_naming_their_key(extra_config: dict) -> None:
    fs.side_file_settings_contract(extra_config)


@settings(FUZZ)
@given(fs.trust_settings())
def test_trust_settings_of_any_json_value_are_parsed_or_refused_at_their_keys_never_showing_a_secret(extra_config: dict) -> None:
    fs.trust_settings_contract(extra_config)


@settings(FUZZ)
@example({"kvpolicy_previous_secret_until": fs.huge_json_value(0)})
@given(fs.trust_settings(huge=True))
def test_trust_settings_of_any_json_value_are_refused_in_lines_of_bounded_length(extra_config: dict) -> None:
    fs.trust_settings_contract(extra_config, bounded=True)


@given(st.lists(st.integers(1, 16), min_size=1, max_size=4))
def test_sizes_repeated_or_space_separated_plan_alike_in_every_command_taking_several(sizes: list[int]) -> None:
    fs.several_sizes_contract(sizes)


# --- the expression evaluator --------------------------------------------------------------------

ESCAPES = [
    "().__class__",
    "().__class__.__base__.__subclasses__()",
    "tp_size.__class__",
    "__import__('os').system('true')",
    "getattr(tp_size, '__class__')",
    "eval('1')",
    "exec('x = 1')",
    "open('/etc/passwd')",
    "type(tp_size)",
    "(lambda: 1)()",
    "[x for x in (1, 2)]",
    "{'a': 1}['a']",
    "'abc'[0]",
    "(x := 1)",
    "f'{tp_size.__class__}'",
    "max.__self__",
    "min(*[1, 2])",
    "max(tp_size, key=abs)",
    "'%s' % tp_size",
    "'a' * 10",
    "2 ** 64",
    "tp_size if True else __builtins__.open",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_expressions_cannot_reach_attributes_builtins_or_python_objects(source: str) -> None:
    try:
        value = Expression(source).evaluate(fs.TOPOLOGY)
    except ExpressionError:
        return
    pytest.fail(f"{source!r} evaluated to {value!r}")


@pytest.mark.parametrize("name", ["__class__", "__builtins__", "__import__", "os", "open"])
def test_a_dunder_or_builtin_name_is_only_ever_an_unknown_variable(name: str) -> None:
    with pytest.raises(ExpressionError, match="unknown variable"):
        Expression(name).evaluate(fs.TOPOLOGY)


@settings(FUZZ)
@given(fs.expressions())
def test_any_expression_is_refused_or_whitelisted_and_evaluates_to_a_bounded_value(source: str) -> None:
    fs.expression_contract(source)


@settings(FUZZ)
@given(fs.pathological_expressions())
def test_long_deep_and_large_expressions_are_refused_or_stay_within_the_bounds(source: str) -> None:
    fs.expression_contract(source)


BOUNDS: dict[str, Callable[[int], str]] = {
    "product chain": lambda k: " * ".join(["1"] * k),
    "nested max": lambda k: "max(" * k + "1" + ")" * k,
    "nested ternary": lambda k: "1 if tp_size else " * k + "0",
    "not chain": lambda k: "not " * k + "True",
    "parentheses": lambda k: "(" * k + "1" + ")" * k,
    "overflowing product": lambda k: " * ".join(["9223372036854775807"] * k),
}


@pytest.mark.parametrize("shape", BOUNDS)
@pytest.mark.parametrize("size", [10, 100, 400])
def test_expression_size_nesting_and_magnitude_are_bounded(shape: str, size: int) -> None:
    fs.expression_contract(BOUNDS[shape](size))


# --- key templates -------------------------------------------------------------------------------


@settings(FUZZ)
@given(fs.key_templates())
def test_a_valid_key_template_renders_every_namespace_to_its_own_prefix(template: str) -> None:
    fs.template_contract(template)


def test_a_key_template_without_separators_between_numbers_is_refused() -> None:
    template = "{cache_prefix}{model}@{pcp_rank}@{dcp_rank}@{pp_rank}@{shard}{group}"
    with pytest.raises(ValueError):
        fs.template_contract(template)
        KeyFormat(template=template)
