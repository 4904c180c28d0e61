"""Every problem in a policy file is reported, all at once, at its exact line and column.

The YAML is written inline so the line and column each test expects can be read off the test itself
(line 1 is the first line after the opening quotes; columns are 1-based).
"""

from __future__ import annotations

import textwrap

import pytest

from kvpolicy.documents.loader import (
    check_file,
    check_text,
    layouts_dir,
    load_layout,
    load_policy,
    policies_dir,
    read_text,
    shipped_layout_names,
    shipped_policy_names,
)
from kvpolicy.language.diagnostics import Diagnostic, DocumentError
from kvpolicy.language.models import Layout, Policy

PATH = "policy.yaml"


def check(text: str) -> tuple[object, list[Diagnostic]]:
    return check_text(textwrap.dedent(text), PATH)


def errors(text: str) -> list[Diagnostic]:
    return [d for d in check(text)[1] if d.severity == "error"]


def warnings_(text: str) -> list[Diagnostic]:
    return [d for d in check(text)[1] if d.severity == "warning"]


def only_error(text: str) -> Diagnostic:
    document, problems = check(text)
    assert document is None
    found = [d for d in problems if d.severity == "error"]
    assert len(found) == 1, [str(d) for d in problems]
    return found[0]


def at(diagnostic: Diagnostic) -> tuple[int, int]:
    return diagnostic.line, diagnostic.column


VALID = """\
    version: 1
    kind: ReplicationPolicy
    name: example
    rules:
      - name: mamba-state
        reason: Mamba state is split over TP.
        match:
          spec: MambaSpec
        replication: sharded
      - name: kv-heads
        reason: Heads repeat over TP ranks.
        factor: max(1, tp_size // total_num_kv_heads)
"""


def test_a_valid_policy_has_no_diagnostics():
    document, problems = check(VALID)
    assert isinstance(document, Policy)
    assert problems == []


def test_diagnostic_format_is_path_line_column_severity_message():
    diagnostic = only_error(VALID.replace("kind: ReplicationPolicy", "kind: ReplicationPolicyy"))
    assert str(diagnostic) == (
        f"{PATH}:{diagnostic.line}:{diagnostic.column}: error: {diagnostic.message} [KVP101]"
    )
    assert str(diagnostic).startswith(f"{PATH}:2:7: error: ")


def test_yaml_syntax_error():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: "unterminated
        rules: []
    """)
    # the scanner reaches the end of the input inside the quoted scalar (line 5, column 1)
    assert "YAML syntax" in diagnostic.message
    assert at(diagnostic) == (5, 1)


def test_yaml_syntax_error_in_a_flow_sequence():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: x
        rules: [a, b
        description: oops
    """)
    assert "YAML syntax" in diagnostic.message
    assert at(diagnostic) == (5, 12)  # the ':' that cannot appear inside '[...'


def test_duplicate_key_points_at_the_second_occurrence():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules: []
        name: other
    """)
    assert at(diagnostic) == (5, 1)
    assert "duplicate key 'name'" in diagnostic.message
    assert "line 3" in diagnostic.message


def test_duplicate_key_inside_a_rule():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            replication: sharded
            replication: replicated
    """)
    assert at(diagnostic) == (8, 5)
    assert "duplicate key 'replication'" in diagnostic.message


def test_unknown_top_level_field_with_did_you_mean():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        schedul: leader
        rules: []
    """)
    assert at(diagnostic) == (4, 1)
    assert "unknown field 'schedul'" in diagnostic.message
    assert "did you mean 'schedule'" in diagnostic.message


def test_unknown_field_in_a_rule_with_did_you_mean():
    found = errors("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reasn: r
            replication: sharded
    """)
    # the misspelt key is unknown, and the field it was meant to be is missing: both are reported
    assert [at(d) for d in found] == [(5, 5), (6, 5)]
    assert "missing required field 'reason'" in found[0].message
    assert "unknown field 'reasn'" in found[1].message
    assert "did you mean 'reason'" in found[1].message


def test_unknown_field_in_rule_match_with_did_you_mean():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            match:
              spec: MambaSpec
              feilds:
                tp_replicated: true
            replication: sharded
    """)
    assert at(diagnostic) == (9, 7)
    assert "unknown field 'feilds'" in diagnostic.message
    assert "did you mean 'fields'" in diagnostic.message


def test_wrong_type():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        strict: maybe
        rules: []
    """)
    assert at(diagnostic) == (4, 9)
    assert diagnostic.message.startswith("strict:")
    assert "true or false" in diagnostic.message


def test_wrong_type_of_a_nested_value():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        audit:
          steps: many
        rules: []
    """)
    assert at(diagnostic) == (5, 10)
    assert diagnostic.message.startswith("steps:")


def test_a_mapping_where_a_list_belongs():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          name: a
    """)
    assert at(diagnostic) == (5, 3)
    assert diagnostic.message.startswith("rules:")


def test_bad_enum_value():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            replication: shared
    """)
    assert at(diagnostic) == (7, 18)
    assert "'sharded'" in diagnostic.message and "'replicated'" in diagnostic.message


def test_bad_schedule_value():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        schedule: round-robin
        rules: []
    """)
    assert at(diagnostic) == (4, 11)
    assert "'striped'" in diagnostic.message


def test_bad_expression_column_points_into_the_quoted_string():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            factor: "max(1, tp_size ** 2)"
    """)
    # the quote is column 13, so the expression's first character is column 14; 'tp_size ** 2' is 7 further
    assert at(diagnostic) == (7, 21)
    assert "'**'" in diagnostic.message


def test_bad_expression_column_in_a_plain_scalar():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            when: dcp_size > 1 and shapes[0] == 1
            replication: sharded
    """)
    # 'when: ' ends at column 10; 'shapes[0]' starts 17 characters into the expression
    assert at(diagnostic) == (7, 28)
    assert "subscript" in diagnostic.message


def test_unknown_variable_with_did_you_mean_points_at_the_name():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            factor: 'max(1, tp_size // total_num_kv_head)'
    """)
    assert at(diagnostic) == (7, 32)
    assert "unknown variable 'total_num_kv_head'" in diagnostic.message
    assert "did you mean 'total_num_kv_heads'" in diagnostic.message


def test_unknown_variable_declared_in_spec_fields_is_accepted():
    document, problems = check("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        spec_fields: [num_index_heads]
        rules:
          - name: a
            reason: r
            factor: max(1, tp_size // num_index_heads)
    """)
    assert isinstance(document, Policy)
    assert problems == []


def test_a_rule_with_two_outcomes():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            replication: sharded
            factor: 2
    """)
    assert at(diagnostic) == (5, 5)  # the rule itself
    assert "exactly one of" in diagnostic.message
    assert "replication and factor" in diagnostic.message


def test_a_rule_with_no_outcome():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
    """)
    assert at(diagnostic) == (5, 5)
    assert "exactly one of" in diagnostic.message


def test_missing_kind_suggests_the_kind_to_add():
    diagnostic = only_error("""\
        version: 1
        name: example
        rules: []
    """)
    assert at(diagnostic) == (1, 1)
    assert "missing 'kind'" in diagnostic.message
    assert "kind: ReplicationPolicy" in diagnostic.message


def test_missing_version():
    diagnostic = only_error("""\
        kind: ReplicationPolicy
        name: example
        rules: []
    """)
    assert at(diagnostic) == (1, 1)
    assert "missing required field 'version'" in diagnostic.message


def test_wrong_version():
    diagnostic = only_error("""\
        version: 2
        kind: ReplicationPolicy
        name: example
        rules: []
    """)
    assert at(diagnostic) == (1, 10)
    assert diagnostic.message.startswith("version:")


def test_unknown_kind_with_did_you_mean():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicie
        name: example
        rules: []
    """)
    assert at(diagnostic) == (2, 7)
    assert "unknown kind 'ReplicationPolicie'" in diagnostic.message
    assert "did you mean 'ReplicationPolicy'" in diagnostic.message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_file(text):
    document, problems = check_text(text, PATH)
    assert document is None
    assert [(d.line, d.column, d.severity) for d in problems] == [(1, 1, "error")]
    assert "empty" in problems[0].message


def test_multi_document_file_points_at_the_second_document():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules: []
        ---
        version: 1
        kind: ReplicationPolicy
        name: other
        rules: []
    """)
    assert at(diagnostic) == (6, 1)
    assert "one document per file" in diagnostic.message


def test_a_list_at_the_top_level():
    diagnostic = only_error("""\
        - version: 1
    """)
    assert at(diagnostic) == (1, 1)
    assert "mapping" in diagnostic.message


def test_all_independent_errors_are_reported_at_once():
    document, problems = check("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        schedul: leader
        rules:
          - name: a
            reason: r
            replication: shared
          - name: b
            reason: r
            factor: "tp_size ** 2"
    """)
    assert document is None
    assert [(d.line, d.column, d.severity) for d in problems] == [
        (4, 1, "error"),
        (8, 18, "error"),
        (11, 14, "error"),
    ]


def test_structural_errors_and_unknown_variables_are_reported_together():
    found = errors("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        strict: maybe
        rules:
          - name: a
            reason: r
            factor: max(1, tp_sise)
    """)
    assert [at(d) for d in found] == [(4, 9), (8, 20)]
    assert "tp_sise" in found[1].message


def test_duplicate_keys_and_validation_errors_are_reported_together():
    found = errors("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        name: again
        schedule: sometimes
        rules: []
    """)
    assert [at(d) for d in found] == [(4, 1), (5, 11)]


def test_duplicate_rule_names():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            replication: sharded
          - name: a
            reason: r
            replication: replicated
    """)
    assert at(diagnostic) == (5, 3)  # the 'rules' list
    assert "'a' is used twice" in diagnostic.message


def test_unknown_key_template_field():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        key:
          template: "{model}@{shrad}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"
        rules: []
    """)
    assert at(diagnostic) == (5, 13)
    assert "{shrad}" in diagnostic.message


def test_key_template_missing_a_required_field():
    diagnostic = only_error("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        key:
          template: "{model}@tp_rank:{shard}@pp_rank:{pp_rank}@group:{group}"
        rules: []
    """)
    assert "{pcp_rank}" in diagnostic.message


# --- warnings ----------------------------------------------------------------------------------


def test_rule_shadowed_by_a_base_class_rule_is_reported_unreachable():
    document, problems = check("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: attention
            reason: r
            match:
              spec: AttentionSpec
            factor: max(1, tp_size // total_num_kv_heads)
          - name: mla
            reason: r
            match:
              spec: MLAAttentionSpec
            replication: replicated
    """)
    assert isinstance(document, Policy)  # a warning does not reject the file
    assert [(d.line, d.column, d.severity) for d in problems] == [(10, 5, "warning")]
    assert "'mla' is unreachable" in problems[0].message
    assert "'attention' (line 5)" in problems[0].message


def test_rule_shadowed_by_a_catch_all_is_reported_unreachable():
    found = warnings_("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: everything
            reason: r
            replication: sharded
          - name: mamba
            reason: r
            match:
              spec: MambaSpec
            replication: replicated
    """)
    assert [at(d) for d in found] == [(8, 5)]
    assert "unreachable" in found[0].message


NARROWER_FIRST_RULES = {
    "a condition": """\
      - name: first
        reason: r
        when: dcp_size > 1
        match:
          spec: AttentionSpec
        replication: sharded
""",
    "a layer filter": """\
      - name: first
        reason: r
        match:
          spec: AttentionSpec
          layers: ["model.layers.0.*"]
        replication: sharded
""",
    "a field match": """\
      - name: first
        reason: r
        match:
          spec: AttentionSpec
          fields:
            head_size: 64
        replication: sharded
""",
    "a subclass": """\
      - name: first
        reason: r
        match:
          spec: MLAAttentionSpec
        replication: sharded
""",
}


@pytest.mark.parametrize("first_rule", NARROWER_FIRST_RULES.values(), ids=NARROWER_FIRST_RULES.keys())
def test_rules_behind_a_narrower_rule_are_not_reported_unreachable(first_rule):
    text = (
        "version: 1\nkind: ReplicationPolicy\nname: example\nrules:\n"
        + textwrap.indent(textwrap.dedent(first_rule), "  ")
        + "  - name: second\n    reason: r\n    match:\n      spec: FullAttentionSpec\n    replication: replicated\n"
    )
    document, problems = check_text(text, PATH)
    assert isinstance(document, Policy), [str(d) for d in problems]
    assert problems == []


def test_unknown_spec_class_is_a_warning_with_did_you_mean():
    document, problems = check("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            match:
              spec: MLAAttentionSpc
            replication: replicated
    """)
    assert isinstance(document, Policy)
    assert [(d.line, d.column, d.severity) for d in problems] == [(8, 13, "warning")]
    assert "'MLAAttentionSpc'" in problems[0].message
    assert "did you mean 'MLAAttentionSpec'" in problems[0].message


def test_plugin_spec_class_without_a_close_name_is_only_a_warning():
    found = warnings_("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            match:
              spec: [MambaSpec, QuuxStateCache]
            replication: sharded
    """)
    assert len(found) == 1
    assert "'QuuxStateCache'" in found[0].message
    assert "did you mean" not in found[0].message


def test_unknown_match_field_is_a_warning_at_its_key():
    found = warnings_("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: a
            reason: r
            match:
              spec: MambaSpec
              fields:
                tp_replicatd: true
            replication: replicated
    """)
    assert [at(d) for d in found] == [(10, 9)]
    assert "did you mean 'tp_replicated'" in found[0].message


# --- the shipped policies and the raising entry points ----------------------------------------


SHIPPED = sorted(policies_dir().glob("*.yaml"))


def test_the_three_policies_are_shipped():
    assert {path.stem for path in SHIPPED} >= {"default", "no-dedup", "vllm-compat"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_every_shipped_policy_validates_without_errors_or_warnings(path):
    document, problems = check_file(path)
    assert isinstance(document, Policy)
    assert document.name == path.stem
    assert [str(d) for d in problems] == []


def test_load_policy_raises_with_every_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent("""\
            version: 1
            kind: ReplicationPolicy
            name: Example
            strict: maybe
            rules: []
        """))
    with pytest.raises(DocumentError) as caught:
        load_policy(path)
    assert [(d.line, d.column) for d in caught.value.errors] == [(3, 7), (4, 9)]


def test_load_policy_refuses_a_layout(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text(textwrap.dedent("""\
        version: 1
        kind: ModelLayout
        model: org/m
        total_num_kv_heads: 1
        groups:
          - spec: {type: MambaSpec, bases: [KVCacheSpec], block_size: 16, page_size_bytes: 4096}
            layers: [l0]
    """))
    document, problems = check_file(path)
    assert isinstance(document, Layout) and problems == []
    with pytest.raises(DocumentError, match="expected a ReplicationPolicy"):
        load_policy(path)


def test_unknown_shipped_policy_name_suggests_a_close_one():
    with pytest.raises(DocumentError, match="did you mean 'vllm-compat'"):
        load_policy("vllm-compt")


# --- an empty path and an unknown name ------------------------------------------------------------


def only_diagnostic(raised: pytest.ExceptionInfo[DocumentError]) -> str:
    (diagnostic,) = raised.value.diagnostics
    return str(diagnostic)


def test_an_empty_path_is_refused_as_empty_not_as_a_missing_file():
    document, problems = check_file("")
    assert document is None
    assert [str(problem) for problem in problems] == [
        "<empty path>:1:1: error: the path is empty; give a policy, layout or discovery report file [KVP001]"
    ]


def test_reading_an_empty_path_raises_the_same_refusal():
    with pytest.raises(DocumentError) as raised:
        read_text("")
    assert only_diagnostic(raised) == (
        "<empty path>:1:1: error: the path is empty; give a policy, layout or discovery report file [KVP001]"
    )


def test_an_empty_policy_name_is_refused_as_empty_naming_the_shipped_policies():
    with pytest.raises(DocumentError) as raised:
        load_policy("")
    assert only_diagnostic(raised) == (
        "<empty path>:1:1: error: the path is empty; give a shipped policy name "
        f"({', '.join(shipped_policy_names())}) or a policy file [KVP001]"
    )


def test_an_empty_layout_name_is_refused_as_empty_naming_the_shipped_layouts():
    with pytest.raises(DocumentError) as raised:
        load_layout("")
    assert only_diagnostic(raised) == (
        "<empty path>:1:1: error: the path is empty; give a shipped example layout name "
        f"({', '.join(shipped_layout_names())}) or a layout file [KVP001]"
    )


def test_an_unknown_layout_name_names_what_was_typed_and_the_nearest_shipped_layout():
    with pytest.raises(DocumentError) as raised:
        load_layout("llama-3.1-7b")
    assert only_diagnostic(raised) == (
        "llama-3.1-7b:1:1: error: no layout file or shipped example layout named 'llama-3.1-7b'; "
        f"did you mean 'llama-3.1-70b'? (shipped: {', '.join(shipped_layout_names())}) [KVP001]"
    )


def test_an_unknown_layout_name_like_no_shipped_one_lists_them_all():
    with pytest.raises(DocumentError) as raised:
        load_layout("nosuch")
    assert only_diagnostic(raised) == (
        "nosuch:1:1: error: no layout file or shipped example layout named 'nosuch' "
        f"(shipped: {', '.join(shipped_layout_names())}) [KVP001]"
    )
    assert str(layouts_dir()) not in only_diagnostic(raised)


def test_an_unknown_layout_name_holding_control_characters_is_shown_escaped_on_one_line():
    with pytest.raises(DocumentError) as raised:
        load_layout("a\nb\x00")
    line = only_diagnostic(raised)
    assert line.startswith("a\\nb\\x00:1:1: error: no layout file or shipped example layout named 'a b\\x00'")
    assert "\n" not in line


def test_every_shipped_layout_loads_by_its_name():
    names = shipped_layout_names()
    assert len(names) >= 6
    assert all(isinstance(load_layout(name), Layout) for name in names)


def test_layout_errors_are_located_too():
    document, problems = check_text(textwrap.dedent("""\
        version: 1
        kind: ModelLayout
        model: org/m
        total_num_kv_heads: -1
        groups:
          - spec:
              type: MambaSpec
              bases: [KVCacheSpec]
              block_size: 16
              page_size_bytes: 4096
              feilds: {}
            layers: [l0]
    """), "layout.yaml")
    assert document is None
    # the only group is invalid, yet no spurious "groups: should have at least 1 item" is reported
    assert [(d.line, d.column) for d in problems] == [(4, 21), (11, 7)]
    assert "did you mean 'fields'" in problems[1].message
