"""``kvpolicy validate`` as CI pipelines use it: codes, formats, check selection and exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from kvpolicy.app.cli import main
from kvpolicy.language.diagnostics import CHECKS, CHECKS_BY_CODE

WARNS = """\
version: 1
kind: ReplicationPolicy
name: example
rules:
  - name: plugin-state
    reason: a plugin's class
    match: {spec: FooSpec}
    replication: sharded
"""
BROKEN = """\
version: 1
name: example
rules:
  - name: r
    match: {spec: AttentionSpec}
    replicaton: sharded
"""

# The properties SARIF 2.1.0 requires of what kvpolicy writes (OASIS SARIF 2.1.0, sections 3.13-3.30):
# the official schema is not reachable from these machines (no network beyond the package index,
# and no package ships it), so the test states the required structure itself.
SARIF_REQUIRED = {
    "type": "object",
    "required": ["version", "runs"],
    "properties": {
        "version": {"const": "2.1.0"},
        "runs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["tool"],
                "properties": {
                    "tool": {
                        "type": "object",
                        "required": ["driver"],
                        "properties": {
                            "driver": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string", "minLength": 1},
                                    "rules": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["id"],
                                            "properties": {
                                                "id": {"type": "string"},
                                                "shortDescription": {"$ref": "#/$defs/message"},
                                                "defaultConfiguration": {
                                                    "type": "object",
                                                    "properties": {"level": {"$ref": "#/$defs/level"}},
                                                },
                                            },
                                        },
                                    },
                                },
                            }
                        },
                    },
                    "results": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["message"],
                            "properties": {
                                "ruleId": {"type": "string"},
                                "ruleIndex": {"type": "integer", "minimum": 0},
                                "level": {"$ref": "#/$defs/level"},
                                "message": {"$ref": "#/$defs/message"},
                                "locations": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {
                                            "physicalLocation": {
                                                "type": "object",
                                                "required": ["artifactLocation"],
                                                "properties": {
                                                    "artifactLocation": {
                                                        "type": "object",
                                                        "required": ["uri"],
                                                        "properties": {"uri": {"type": "string", "format": "uri-reference"}},
                                                    },
                                                    "region": {
                                                        "type": "object",
                                                        "properties": {
                                                            "startLine": {"type": "integer", "minimum": 1},
                                                            "startColumn": {"type": "integer", "minimum": 1},
                                                        },
                                                    },
                                                },
                                            }
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    "$defs": {
        "level": {"enum": ["none", "note", "warning", "error"]},
        "message": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}},
    },
}


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {"warns": tmp_path / "warns.yaml", "broken": tmp_path / "dir with space" / "broken.yaml"}
    paths["broken"].parent.mkdir()
    paths["warns"].write_text(WARNS)
    paths["broken"].write_text(BROKEN)
    return paths


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_check_has_a_unique_well_formed_code_and_name() -> None:
    assert len(CHECKS_BY_CODE) == len(CHECKS) and len({check.name for check in CHECKS}) == len(CHECKS)
    assert all(re.fullmatch(r"KVP\d{3}", check.code) and re.fullmatch(r"[a-z-]+", check.name) for check in CHECKS)


def test_the_documentations_diagnostics_reference_lists_every_check() -> None:
    from kvpolicy.app.reference import diagnostics_markdown

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "diagnostics.md").read_text(encoding="utf-8")
    reference = diagnostics_markdown()
    assert "<!-- kvpolicy-reference: diagnostics -->" in page
    for check in CHECKS:
        assert f"| [`{check.code}`](diagnostics/{check.code.lower()}.md) | `{check.name}` | {check.severity} |" in reference, check.code


def test_text_lines_end_with_the_code(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", str(files["broken"]))
    assert code == 1
    assert f"{files['broken']}:1:1: error: missing 'kind'; add 'kind: ReplicationPolicy' [KVP101]" in out.splitlines()


def test_a_warning_alone_exits_0_and_as_an_error_exits_1(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "validate", str(files["warns"]))[0] == 0
    code, out, _ = run(capsys, "validate", "--warnings-as-errors", str(files["warns"]))
    assert code == 1 and ": error: 'FooSpec' is not a spec class" in out


def test_an_ignored_warning_is_not_reported(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "--ignore", "KVP2", "--warnings-as-errors", str(files["warns"]))
    assert (code, out) == (0, "")


def test_select_reports_only_the_selected_warnings(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "validate", "--select", "KVP203", str(files["warns"]))[1] == ""
    assert "[KVP201]" in run(capsys, "validate", "--select", "kvp201", str(files["warns"]))[1]


@pytest.mark.parametrize("selector", ["KVP104", "KVP1", "XYZ"])
def test_deselecting_errors_or_unknown_codes_is_a_usage_error(
    selector: str, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "validate", "--ignore", selector, str(files["broken"]))
    assert code == 2 and out == "" and err.startswith("kvpolicy validate: error: ")


def test_github_format_annotates_each_line_with_escaped_fields(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "validate", "--format", "github", str(files["broken"]))
    first = out.splitlines()[0]
    assert first == (
        f"::error file={files['broken']},line=1,col=1,title=KVP101 document-kind::missing 'kind'; add 'kind: ReplicationPolicy'"
    )
    assert all(line.startswith(("::error ", "::warning ")) for line in out.splitlines())


def test_github_format_escapes_what_would_end_a_property() -> None:
    from kvpolicy.app.diagnostic_formats import github_command
    from kvpolicy.language.diagnostics import Diagnostic

    command = github_command(Diagnostic("a,b:c.yaml", 1, 2, "warning", "50% done", "KVP203"))
    assert command == "::warning file=a%2Cb%3Ac.yaml,line=1,col=2,title=KVP203 unreachable-rule::50%25 done"


def test_sarif_has_the_structure_sarif_2_1_0_requires(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "--format", "sarif", str(files["broken"]), str(files["warns"]))
    log = json.loads(out)
    jsonschema.validate(log, SARIF_REQUIRED, format_checker=jsonschema.FormatChecker())
    (run_,) = log["runs"]
    rules = run_["tool"]["driver"]["rules"]
    assert code == 1 and [rule["id"] for rule in rules] == [check.code for check in CHECKS]
    for result in run_["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
    uris = {result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for result in run_["results"]}
    assert uris == {files["broken"].as_uri(), files["warns"].as_uri()}


def test_the_sarif_check_rejects_a_log_missing_what_sarif_requires() -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"version": "2.1.0", "runs": [{"tool": {"driver": {}}}]}, SARIF_REQUIRED)


def test_json_format_carries_codes(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "validate", "--format", "json", str(files["broken"]))
    (result,) = json.loads(out)["files"]
    assert result["valid"] is False and {diagnostic["code"] for diagnostic in result["diagnostics"]} == {
        "KVP101", "KVP102", "KVP103"
    }
