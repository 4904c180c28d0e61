"""One source of validity: the Pydantic models decide what is valid; ``kvpolicy validate`` only
locates what they refuse, and the shipped JSON Schema never refuses what they accept."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import fuzz_strategies as fs

from kvpolicy.documents.loader import KINDS, check_text, schemas_dir
from kvpolicy.language.yamlsource import parse

SCHEMAS = {
    "ReplicationPolicy": json.loads((schemas_dir() / "policy.schema.json").read_text(encoding="utf-8")),
    "ModelLayout": json.loads((schemas_dir() / "layout.schema.json").read_text(encoding="utf-8")),
    "DiscoveryReport": json.loads((schemas_dir() / "discovery.schema.json").read_text(encoding="utf-8")),
}


def verdicts(text: str) -> tuple[bool, bool, bool] | None:
    """(validate accepts, model_validate accepts, the JSON Schema accepts), or None for text that is
    not a single well-formed document of a known kind (nothing for the three to agree on)."""
    data, _, problems = parse(text, "doc.yaml")
    if problems or not isinstance(data, dict) or not isinstance(data.get("kind"), str) or data["kind"] not in KINDS:
        return None
    document, _ = check_text(text, "doc.yaml")
    try:
        KINDS[data["kind"]].model_validate(data)
        model_accepts = True
    except ValidationError:
        model_accepts = False
    validator = jsonschema.Draft202012Validator(SCHEMAS[data["kind"]])
    try:
        schema_accepts = validator.is_valid(data)
    except (TypeError, ValueError):  # a YAML value JSON has no type for (a date): not JSON at all
        schema_accepts = False
    return document is not None, model_accepts, schema_accepts


def agree(text: str) -> None:
    found = verdicts(text)
    if found is None:
        return
    validate_accepts, model_accepts, schema_accepts = found
    assert validate_accepts == model_accepts, "kvpolicy validate and model_validate disagree"
    assert schema_accepts or not model_accepts, "the JSON Schema refuses a document the models accept"


PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(st.one_of(fs.generated_documents(), fs.mutated_documents()))
def test_validate_the_models_and_the_schema_agree_on_generated_documents(text: str) -> None:
    agree(text)


@pytest.mark.parametrize(
    "line, replacement",
    [
        ("version: 1", "version: true"),
        ("version: 1", "version: 1.0"),
        ("schedule: striped", "schedule: 'on'"),
        ("  steps: 4", "  steps: '4'"),
        ("  steps: 4", "  steps: 4.0"),
        ("name: default", "name: Default"),
    ],
)
def test_lax_values_are_refused_by_validate_the_models_and_the_schema_alike(line: str, replacement: str) -> None:
    text = (Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text(encoding="utf-8")
    assert line in text
    found = verdicts(text.replace(line, replacement, 1))
    assert found is not None and found[:2] == (False, False)


def test_an_unknown_expression_variable_is_refused_by_the_model_itself() -> None:
    data: dict[str, Any] = {
        "version": 1, "kind": "ReplicationPolicy", "name": "p",
        "rules": [{"name": "r", "reason": "r", "factor": "tp_sise"}],
    }
    with pytest.raises(ValidationError, match="unknown variable 'tp_sise'"):
        KINDS["ReplicationPolicy"].model_validate(data)


def test_a_layer_in_two_groups_is_refused_by_the_model_itself() -> None:
    spec = {"type": "FullAttentionSpec", "block_size": 16, "page_size_bytes": 4096}
    data = {
        "version": 1, "kind": "ModelLayout", "model": "m", "total_num_kv_heads": 1,
        "groups": [{"spec": spec, "layers": ["l0"]}, {"spec": spec, "layers": ["l0"]}],
    }
    with pytest.raises(ValidationError, match="layer 'l0' is already in group 0"):
        KINDS["ModelLayout"].model_validate(data)


@pytest.mark.parametrize(
    "value",
    [
        '{expr: "max(1, 8 // tp_size)"}', "{expr: 8}", "{expr: true}", "{expr: null}", '{expr: "tp_sise"}',
        '{expr: "tp_size", other: 1}', "{}", '[{expr: "tp_size"}, 2]', "[{a: 1}]", '[[{expr: "head_size"}]]',
        '{expr: "block_size * 2"}', '{expr: "1 +"}',
    ],
)
def test_field_expressions_are_judged_alike_by_validate_the_models_and_the_schema(value: str) -> None:
    text = (Path(__file__).resolve().parents[2] / "examples" / "layouts" / "llama-3.1-70b.yaml").read_text(encoding="utf-8")
    line = '        num_kv_heads: {expr: "max(1, 8 // tp_size)"}   # per rank'
    assert line in text
    agree(text.replace(line, f"        num_kv_heads: {value}", 1))


@pytest.mark.parametrize("value", ["9223372036854775808", "[1, [-9223372036854775809]]"])
def test_an_integer_beyond_63_bits_is_refused_by_the_models_as_by_the_reader(value: str) -> None:
    text = (Path(__file__).resolve().parents[2] / "examples" / "layouts" / "llama-3.1-70b.yaml").read_text(encoding="utf-8")
    line = "        head_size: 128\n"
    assert line in text
    changed = text.replace(line, f"        head_size: {value}\n", 1)
    data, _, _ = parse(text, "doc.yaml")
    data["groups"][0]["spec"]["fields"]["head_size"] = json.loads(value)
    with pytest.raises(ValidationError, match="integers are at most 2"):
        KINDS["ModelLayout"].model_validate(data)
    assert [problem.code for problem in check_text(changed, "doc.yaml")[1]] == ["KVP003"]


def nested_lists(depth: int) -> list[object]:
    """``[[...[1]...]]``: ``depth`` lists, one inside the next."""
    value: list[object] = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("source", "message"),
    [({"a": {2**70: 1}}, "mapping keys must be strings"), ({"a": [{1: 2}]}, "mapping keys must be strings"),
     ({"a": nested_lists(66)}, "nested deeper than 64 levels")],
)
def test_free_form_values_the_reader_could_not_give_back_are_refused_by_the_models(source: dict, message: str) -> None:
    data = {"version": 1, "kind": "ModelLayout", "model": "m", "total_num_kv_heads": 1, "source": source,
            "groups": [{"spec": {"type": "FullAttentionSpec", "block_size": 16, "page_size_bytes": 1}, "layers": ["l"]}]}
    with pytest.raises(ValidationError, match=message):
        KINDS["ModelLayout"].model_validate(data)


# --- discovery reports: what validate accepts, --propose and --check judge by its evidence only ------

@PROPERTY
@given(fs.discovery_reports())
def test_a_report_validate_accepts_is_refused_by_propose_and_check_only_for_its_evidence(text: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        fs.discovery_report_contract(text, Path(directory) / "report.yaml")


@pytest.mark.parametrize(
    ("what", "old", "new"),
    [
        ("an empty class", "        partition: [[0], [1]]", "        partition: [[], [0], [1]]"),
        ("pp and pcp in the thousands", "pp_size: 1, pcp_size: 1", "pp_size: 4096, pcp_size: 4096"),
        ("dcp on GQA heads vLLM refuses", "dcp_size: 1", "dcp_size: 2"),
        ("an expression failing at the topology", "head_size: 128", "head_size: {expr: '128 // (tp_size - 2)'}"),
    ],
)
def test_what_propose_or_check_would_refuse_of_a_report_validate_refuses_first(what: str, old: str, new: str, tmp_path: Path) -> None:
    text = fs.REPORT.format(tp=2, pp=1, pcp=1, dcp=1, partition="[[0], [1]]", group_partition="[[0], [1]]", blocks=8,
                            distinct=8, heads=8, spec="FullAttentionSpec", bases=fs.SPECS["FullAttentionSpec"],
                            head_size=128, layer="layers.0.attn")
    fs.discovery_report_contract(text, tmp_path / "valid.yaml")
    assert old in text
    edited = text.replace(old, new)
    document, problems = check_text(edited, "report.yaml")
    assert document is None and {problem.code for problem in problems} == {"KVP104"}, (what, problems)
    fs.discovery_report_contract(edited, tmp_path / "report.yaml")
