"""``kvpolicy rule CODE``: a diagnostic code's explanation and an example that reports it; ``--all``
lists every code; a wrong code is one line and exit 2."""

from __future__ import annotations

import pytest

from kvpolicy.app.cli import main
from kvpolicy.language.diagnostics import CHECKS


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_rule_prints_the_codes_name_summary_and_explanation(capsys: pytest.CaptureFixture[str]) -> None:
    check = next(check for check in CHECKS if check.code == "KVP105")
    code, out, _ = run(capsys, "rule", "KVP105")
    assert code == 0 and out.startswith("KVP105 invalid-expression (error)\n")
    assert check.summary in out and check.explanation in out


def test_rule_runs_the_example_and_shows_the_code_it_printed(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "rule", "KVP102")
    example = out.split("\nExample\n", 1)[1].split("\nUse instead\n", 1)[0]
    assert "$ kvpolicy validate policy.yaml\npolicy.yaml:" in example and example.rstrip().endswith("[KVP102]")


def test_rule_shows_why_it_matters_the_fixed_example_and_the_pages_url(capsys: pytest.CaptureFixture[str]) -> None:
    check = next(check for check in CHECKS if check.code == "KVP102")
    _, out, _ = run(capsys, "rule", "KVP102")
    fixed = out.split("\nUse instead\n", 1)[1]
    assert check.why in out and "replication: sharded" in fixed and "policy.yaml: ok, ReplicationPolicy" in fixed
    assert "[KVP102]" not in fixed
    assert out.splitlines()[-1].startswith("Documentation: docs/reference/diagnostics/kvp102.md in a kvpolicy checkout")


def test_rule_names_the_page_on_the_deployments_site_where_one_is_published(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOLICY_DOCS_URL", "https://docs.example.org/kvpolicy")
    _, out, _ = run(capsys, "rule", "KVP102")
    assert out.splitlines()[-1] == "Documentation: https://docs.example.org/kvpolicy/reference/diagnostics/kvp102/"


def test_rule_accepts_a_lowercase_code_or_a_checks_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "rule", "kvp203")[1] == run(capsys, "rule", "unreachable-rule")[1] == run(capsys, "rule", "KVP203")[1]


def test_an_unknown_code_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "rule", "KVP999")
    assert (code, out) == (2, "") and err.count("\n") == 1 and "unknown code 'KVP999'" in err


def test_rule_without_a_code_or_all_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "rule")
    assert (code, out) == (2, "") and "give one CODE" in err


def test_rule_all_lists_every_code_once_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "rule", "--all")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == [check.code for check in CHECKS]


def test_a_long_example_output_is_cut_in_the_middle(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "rule", "KVP901")
    tail = out.split("$ kvpolicy validate policy.yaml\n", 1)[1].split("\n\nUse instead\n", 1)[0].splitlines()
    assert len(tail) == 6 and tail[3] == "..." and tail[-1].endswith("[KVP901]")
