"""Every JSON document kvpolicy writes names its kind and format version, as the documents it reads
do: a reader (a router, a dashboard, CI) can tell a plan from a diff and notice a format it does not
know. The command line is enumerated, so a new ``--format json`` cannot land without a kind."""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

import pytest
from conftest import require
from pydantic import BaseModel

from kvpolicy.app.cli import build_parser, main
from kvpolicy.app.doctor import DoctorReport
from kvpolicy.documents.report import DOCUMENT_VERSIONS
from kvpolicy.planning.contract import KeyContract

REPO = Path(__file__).resolve().parents[2]
PLAN = ["--policy", "default", "--layout", "deepseek-v3", "--tp", "2", "--format", "json"]

DOCUMENTS: dict[tuple[str, str], tuple[list[str], str]] = {
    ("validate", "json"): (["validate", "--format", "json", str(REPO / "policies" / "default.yaml")], "ValidationReport"),
    ("plan", "json"): (["plan", *PLAN, "--prompt-tokens", "100"], "ReplicationPlan"),
    ("explain", "json"): (["explain", *PLAN], "ReplicationPlan"),
    ("keys", "json"): (["keys", *PLAN], "KeyContract"),
    ("diff", "json"): (["diff", "default", "no-dedup", "--layout", "deepseek-v3", "--tp", "2", "--format", "json"],
                       "PolicyDiff"),
}
"""(command, format) → an invocation and the kind of document it prints."""
RUN_ELSEWHERE = {
    ("audit", "json"): "AuditReport: runs simulated ranks on vLLM and Mooncake (the integration tests below)",
    ("doctor", "json"): "DoctorReport: its model's kind and version are checked below; tests/cli/test_doctor.py runs it",
}
"""JSON outputs whose kind is checked by another test here, or that another change owns."""
FOREIGN_FORMATS = {
    ("validate", "sarif"): "a SARIF 2.1.0 log: its own '$schema' and 'version', read by code-scanning tools",
}
"""JSON outputs in a format someone else defines, where a ``kind`` field has no place. (So are the
outputs without a ``--format``: ``vllm-config`` prints vLLM's ``--kv-transfer-config`` and
``schema`` prints JSON Schemas.)"""


def json_outputs() -> set[tuple[str, str]]:
    """(command, format) of every JSON format the command line offers."""
    (commands,) = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return {
        (name, choice)
        for name, parser in commands.choices.items()
        for action in parser._actions
        if action.dest == "format"
        for choice in action.choices or ()
        if choice in ("json", "sarif")
    }


def test_every_json_output_of_the_command_line_is_accounted_for() -> None:
    assert json_outputs() == set(DOCUMENTS) | set(RUN_ELSEWHERE) | set(FOREIGN_FORMATS)


@pytest.mark.parametrize("output", sorted(DOCUMENTS), ids="-".join)
def test_the_document_carries_its_kind_and_version_first(output: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    argv, kind = DOCUMENTS[output]
    main(argv)
    document = json.loads(capsys.readouterr().out)
    assert list(document)[:2] == ["version", "kind"]
    assert (document["kind"], document["version"]) == (kind, DOCUMENT_VERSIONS[kind])


@pytest.mark.parametrize("model", [KeyContract, DoctorReport], ids=lambda model: model.__name__)
def test_a_document_models_kind_and_version_are_the_registered_ones(model: type[BaseModel]) -> None:
    assert typing.get_args(model.model_fields["kind"].annotation) == (model.__name__,)
    assert typing.get_args(model.model_fields["version"].annotation) == (DOCUMENT_VERSIONS[model.__name__],)


def test_every_registered_kind_is_a_document_some_output_prints() -> None:
    printed = {kind for _, kind in DOCUMENTS.values()} | {reason.split(":")[0] for reason in RUN_ELSEWHERE.values()}
    assert printed == set(DOCUMENT_VERSIONS)


# --- the audit report: simulated ranks through real vLLM classes and a real Mooncake master -------------


def audit_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    require("vllm")
    require("mooncake.store")
    main(["audit", *argv, "--tp", "2", "--tokens", "64", "--format", "json"])
    return json.loads(capsys.readouterr().out)


def test_the_audit_report_carries_its_kind_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    document = audit_json(capsys, "--policy", "default", "--archetype", "mla")
    assert list(document)[:2] == ["version", "kind"] and "groups" in document
    assert (document["kind"], document["version"]) == ("AuditReport", DOCUMENT_VERSIONS["AuditReport"])


def test_an_enforced_audits_stop_is_an_audit_report_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = (REPO / "examples" / "policies" / "wrong-attention-replicated-audited.yaml").read_text(encoding="utf-8")
    assert "mode: warn" in wrong
    policy = tmp_path / "enforced.yaml"
    policy.write_text(wrong.replace("mode: warn", "mode: enforce"), encoding="utf-8")
    document = audit_json(capsys, "--policy", str(policy), "--archetype", "gqa-8kv")
    assert "enforced" in document
    assert (document["kind"], document["version"]) == ("AuditReport", DOCUMENT_VERSIONS["AuditReport"])
