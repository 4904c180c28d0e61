"""``kvpolicy diff OLD NEW``: what a policy edit changes for a fleet, and a CI gate on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.app.cli import main
from kvpolicy.documents.loader import layouts_dir, policies_dir

DEFAULT_TEXT = (policies_dir() / "default.yaml").read_text(encoding="utf-8")
EVERY_PLAN = len(list(layouts_dir().glob("*.yaml"))) * len((1, 2, 4, 8))
"""Plans ``kvpolicy diff`` compares by default: every example layout at tp 1, 2, 4 and 8."""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_policy_against_itself_changes_nothing_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "diff", "default", "default")
    assert code == 0 and out.splitlines()[-1] == f"{EVERY_PLAN} of {EVERY_PLAN} plans unchanged"


def test_renamed_rules_with_the_same_outcome_change_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    renamed = DEFAULT_TEXT.replace("name: default", "name: site").replace("- name: kv-heads", "- name: heads")
    code, out = run(capsys, "diff", "default", write(tmp_path, "site", renamed))
    assert code == 0 and out.splitlines()[-1] == f"{EVERY_PLAN} of {EVERY_PLAN} plans unchanged"


def test_a_factor_change_names_the_group_its_bytes_and_the_cold_cache(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "diff", "default", "no-dedup", "--layout", "deepseek-v3", "--tp", "4")
    lines = out.splitlines()
    assert code == 1
    assert lines[1].startswith("deepseek-v3 tp=4 pp=1: fingerprint ") and "miss everything the old one stored" in lines[1]
    assert lines[2] == "  group 0 mla: factor: 4 -> 1; namespaces: 1 -> 4; written/token 68.6 KiB -> 274.5 KiB"
    assert lines[-1] == "0 of 1 plans unchanged"


def test_a_key_template_change_is_reported_once_per_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edited = DEFAULT_TEXT.replace("@plan:{fingerprint}", "@v2:{fingerprint}")
    code, out = run(capsys, "diff", "default", write(tmp_path, "v2", edited), "--layout", "llama-3.1-70b", "--tp", "2")
    assert code == 1 and out.count("  key template: ") == 1 and "group 0" not in out


def test_a_plan_the_new_policy_refuses_is_a_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    strict = (
        "version: 1\nkind: ReplicationPolicy\nname: strict-mla\nstrict: true\nrules:\n"
        "  - name: mla\n    reason: whole on every rank\n    match: {spec: MLAAttentionSpec}\n    replication: replicated\n"
    )
    code, out = run(capsys, "diff", "default", write(tmp_path, "strict", strict), "--layout", "llama-3.1-70b", "--tp", "2")
    assert code == 1 and "llama-3.1-70b tp=2 pp=1: refused by the new policy: " in out and "no rule matches" in out


def test_json_lists_every_plan_with_its_changes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "diff", "default", "no-dedup", "--layout", "deepseek-v3", "--tp", "1", "4", "--format", "json")
    payload = json.loads(out)
    # At tp 1 every factor is 1 under both policies: the same plan, the same fingerprint.
    assert code == 1 and payload["changed"] is True and [plan["changed"] for plan in payload["plans"]] == [False, True]
    tp4 = payload["plans"][1]
    assert tp4["groups"][0]["changes"] == ["factor: 4 -> 1", "namespaces: 1 -> 4"]
    assert tp4["written_bytes_per_token"]["new"] == 4 * tp4["written_bytes_per_token"]["old"]
