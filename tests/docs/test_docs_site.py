"""The documentation site: it builds strictly, its examples run and print what the pages show, and its
generated references cover every field, code, command, flag, setting and metric of the code.

A page's ``console`` blocks are run: each ``$ kvpolicy ...`` line with the lines after it as its
output (``...`` stands for lines, or text within a line, left out), in a directory holding the page's
``yaml title="NAME"`` blocks as files. ``text`` blocks are illustrations and are not run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import unavailable
from pydantic import BaseModel

from kvpolicy.app import reference
from kvpolicy.app.cli import build_parser, main
from kvpolicy.diagnostics import CHECKS
from kvpolicy.discovery import DiscoveryReport
from kvpolicy.loader import check_text
from kvpolicy.models import Layout, Policy
from kvpolicy.settings import KVPolicySettings

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: str
    """The page, relative to the repository: ``docs/...`` or ``README.md``."""
    language: str
    title: str | None
    body: str


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        title = re.search(r'title="([^"]+)"', match.group(2))
        found.append(Block(str(path.relative_to(REPO)), match.group(1), title.group(1) if title else None, match.group(3)))
    return found


SITE_BLOCKS = [block for page in PAGES for block in blocks(page)]


@dataclass(frozen=True)
class Transcript:
    page: str
    command: str
    """What follows ``$ `` on the line."""
    output: str


def transcripts() -> list[Transcript]:
    found = []
    for block in SITE_BLOCKS:
        if block.language != "console":
            continue
        command, output = None, []
        for line in [*block.body.splitlines(), "$ "]:
            if line.startswith("$ "):
                if command is not None:
                    found.append(Transcript(block.page, command, "".join(f"{out}\n" for out in output)))
                command, output = line[2:], []
            else:
                output.append(line)
    return found


TRANSCRIPTS = transcripts()


def matches(expected: str, actual: str) -> bool:
    """``actual`` is ``expected``, a ``...`` line standing for any lines and ``...`` in a line for any text."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line == "..." else ".*".join(map(re.escape, line.split("..."))) + r"\n"
        for line in expected.splitlines()
    )
    return re.fullmatch(pattern, actual) is not None


def page_files(page: str) -> dict[str, str]:
    return {block.title: block.body for block in SITE_BLOCKS if block.page == page and block.title and block.language == "yaml"}


@pytest.mark.parametrize("transcript", TRANSCRIPTS, ids=[f"{t.page}:{t.command}" for t in TRANSCRIPTS])
def test_every_console_command_prints_what_the_page_shows(
    transcript: Transcript, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert transcript.command.startswith("kvpolicy "), "a console block runs kvpolicy only; mark others bash or text"
    for name, text in page_files(transcript.page).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        main(shlex.split(transcript.command)[1:])
    assert matches(transcript.output, captured.getvalue()), captured.getvalue()


def test_the_site_has_console_transcripts_on_several_pages() -> None:
    assert len({transcript.page for transcript in TRANSCRIPTS}) >= 4


def test_the_ellipsis_stands_for_lines_and_for_text_within_a_line() -> None:
    assert matches("a\n...\nd\n", "a\nb\nc\nd\n") and matches("x ... z\n", "x y z\n")
    assert not matches("a\nd\n", "a\nb\nd\n") and not matches("x ... z\n", "x y\nz\n")


def test_every_policy_or_layout_shown_in_full_is_valid_or_validated_by_a_console_block() -> None:
    named = {(t.page, word) for t in TRANSCRIPTS for word in shlex.split(t.command)}
    shown = [
        block
        for block in SITE_BLOCKS
        if block.language == "yaml" and re.search(r"^kind: (ReplicationPolicy|ModelLayout)$", block.body, re.MULTILINE)
    ]
    invalid = [
        (block.page, str(problem))
        for block in shown
        if (block.page, block.title) not in named  # there a console block shows what validating it prints
        for problem in check_text(block.body, block.title or "block.yaml")[1]
        if problem.severity == "error"
    ]
    assert len(shown) >= 2 and invalid == []


def command_lines() -> list[tuple[str, str]]:
    found = []
    for path in [*PAGES, REPO / "README.md"]:
        for block in blocks(path):
            if block.language not in ("bash", "console", "text"):
                continue
            for line in block.body.splitlines():
                line = line.removeprefix("$ ").strip()
                if line.startswith("kvpolicy "):
                    found.append((block.page, line))
    return found


@pytest.mark.parametrize(("page", "line"), command_lines())
def test_every_kvpolicy_command_line_on_the_site_parses(page: str, line: str) -> None:
    argv = shlex.split(line, comments=True)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as error:
        pytest.fail(f"{page}: '{line}' is not a valid command line (exit {error.code})")


def kv_transfer_configs() -> list[tuple[str, str]]:
    found = []
    for path in [*PAGES, REPO / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"--kv-transfer-config \\\n\s*'(\{.*?\})'", text):
            found.append((path.name, match.group(1)))
    return found


@pytest.mark.parametrize(("page", "line"), kv_transfer_configs())
def test_every_kv_transfer_config_shown_is_what_the_settings_build(page: str, line: str) -> None:
    config = json.loads(line)
    settings = KVPolicySettings.parse(config["kv_connector_extra_config"])
    assert config == settings.kv_transfer_config(role=config["kv_role"])


def test_the_site_shows_kv_transfer_configs() -> None:
    assert len(kv_transfer_configs()) >= 4


# --- the generated references --------------------------------------------------------------------------------


def test_every_marker_on_the_site_names_a_reference_and_every_reference_is_on_a_page() -> None:
    used = [name for page in PAGES for name in reference.MARKER.findall(page.read_text(encoding="utf-8"))]
    assert sorted(used) == sorted(reference.GENERATORS)


def test_an_unknown_marker_fails_rather_than_publishing_a_page_without_its_reference() -> None:
    with pytest.raises(ValueError, match="unknown kvpolicy reference 'nope'"):
        reference.expand("<!-- kvpolicy-reference: nope -->")


def models_of(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and every model its fields hold, at any depth."""
    found: list[type[BaseModel]] = []

    def visit(annotation: object) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.append(annotation)
                for field in annotation.model_fields.values():
                    visit(field.annotation)
        for argument in typing.get_args(annotation):
            visit(argument)

    visit(model)
    return found


def section(markdown: str, title: str) -> str:
    """The part of ``markdown`` under the heading ``title`` (up to the next heading)."""
    found = re.search(rf"^#+ {re.escape(title)} .*?\n(.*?)(?=^#|\Z)", markdown, re.MULTILINE | re.DOTALL)
    assert found, f"no section {title!r}"
    return found.group(1)


@pytest.mark.parametrize("document", [Policy, Layout, DiscoveryReport], ids=["policy", "layout", "discovery"])
def test_the_format_reference_lists_every_field_of_every_model_with_its_docstring(document: type[BaseModel]) -> None:
    markdown = reference.format_markdown(document)
    for model in models_of(document):
        text = section(markdown, model.model_config.get("title") or model.__name__)
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in text, f"{model.__name__}.{name}"
            if field.description:
                assert " ".join(field.description.split()).replace("``", "`")[:60] in " ".join(text.split()), name


def test_the_settings_reference_lists_every_key_and_its_docstring() -> None:
    markdown = " ".join(reference.settings_markdown().split())
    for model in models_of(KVPolicySettings):
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in markdown, name
            assert " ".join((field.description or "").split()).replace("``", "`")[:60] in markdown, name


def test_the_cli_reference_lists_every_command_and_flag() -> None:
    markdown = reference.cli_markdown()
    arguments = reference.parser_arguments(build_parser())
    for command, options in arguments.items():
        text = section(markdown, f"kvpolicy {command}")
        assert [option for option in options if f"`{option}`" not in text] == [], command
    assert "rule" in arguments and "--all" in arguments["rule"]


def test_the_cli_reference_leaves_out_hidden_flags() -> None:
    assert "--explain" not in section(reference.cli_markdown(), "kvpolicy plan")


def test_the_diagnostics_reference_explains_every_code_with_its_example() -> None:
    markdown = reference.diagnostics_markdown()
    for check in CHECKS:
        text = section(markdown, check.code)
        assert check.explanation in text and f"$ {reference.run_example(check.example).command}" in text


@pytest.mark.parametrize("check", CHECKS, ids=[check.code for check in CHECKS])
def test_each_diagnostic_example_reports_its_code(check) -> None:  # noqa: ANN001
    run = reference.run_example(check.example)
    assert f"[{check.code}]" in run.output
    assert run.exit_code == (1 if check.severity == "error" else 0), run.output


def test_every_code_has_an_explanation_beyond_its_summary() -> None:
    assert [check.code for check in CHECKS if len(check.explanation) < 2 * len(check.summary) // 3] == []


def test_rule_prints_the_explanation_the_site_shows(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["rule", "KVP203"])
    out = capsys.readouterr().out
    site = section(reference.diagnostics_markdown(), "KVP203")
    assert code == 0 and out == reference.rule_text(reference.find_check("KVP203"))
    shown = re.search(r"```console\n\$ .*?\n(.*?)```", site, re.DOTALL).group(1)
    assert reference.find_check("KVP203").explanation in out and shown in out


def test_the_metrics_reference_names_every_series_and_operation_the_connector_registers() -> None:
    from kvpolicy.vllm import audit, metrics

    markdown = reference.metrics_markdown()
    assert [name for name in metrics.METRICS if f"`{name}`" not in markdown] == []
    assert f"`{audit.AUDIT_STATS_OPERATION}`" in markdown and f"`{audit.AUDIT_DEMOTED_OPERATION}`" in markdown
    reduced = metrics.KVPolicyConnectorStats().reduce()
    assert [key for key in reduced if key.startswith("kvpolicy_") and f"`{key}`" not in markdown] == []


def test_the_metrics_reference_names_the_lookup_probe_operation() -> None:
    assert "| `lookup_exists` |" in reference.metrics_markdown()


# --- the build ---------------------------------------------------------------------------------------------


def test_the_site_builds_strictly_with_its_references(tmp_path: Path) -> None:
    try:
        import mkdocs  # noqa: F401
        import material  # noqa: F401
    except ImportError as error:
        unavailable(f"the documentation tools are not installed (pip install '.[docs]'): {error}")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0 and "WARNING" not in built.stderr, built.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "diagnostics" / "index.html").read_text(encoding="utf-8")
    assert all(f'id="{check.code.lower()}"' in page for check in CHECKS)
    assert "kvpolicy-reference" not in "".join(p.read_text(encoding="utf-8") for p in (tmp_path / "site").rglob("*.html"))
