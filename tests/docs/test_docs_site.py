"""The documentation site: it builds strictly, its examples run and print what the pages show, and its
generated references cover every field, code, command, flag, setting and metric of the code.

A page's ``console`` blocks are run: each ``$ kvpolicy ...`` line with the lines after it as its
output (``...`` stands for lines, or text within a line, left out), in a directory holding the page's
``yaml title="NAME"`` blocks as files. ``text`` blocks are illustrations and are not run. Blocks inside
an admonition, a collapsible block or a tab (indented) count like the others. The references written
into their pages (between ``<!-- kvpolicy-reference: NAME -->`` and its end) are left to the tests of
the references below: they are what the generators print, held fresh by a test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel
from site_build import BuiltSite, built_site  # noqa: F401  (a fixture)

from kvpolicy.app import reference, rule
from kvpolicy.app.cli import build_parser, main
from kvpolicy.documents.loader import check_text
from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.evidence.discovery import DiscoveryReport
from kvpolicy.language.diagnostics import CHECKS
from kvpolicy.language.models import Layout, Policy

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(\w*)([^\n]*)\n(.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL)
WRITTEN = re.compile(r"<!-- kvpolicy-reference: ([a-z0-9-]+) -->.*?<!-- /kvpolicy-reference: \1 -->", re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: str
    """The page, relative to the repository: ``docs/...`` or ``README.md``."""
    language: str
    title: str | None
    body: str


def blocks(path: Path) -> list[Block]:
    text = WRITTEN.sub("", path.read_text(encoding="utf-8"))
    found = []
    for match in FENCE.finditer(text):
        indent = match.group("indent")
        title = re.search(r'title="([^"]+)"', match.group(3))
        body = "".join(line.removeprefix(indent) for line in match.group(4).splitlines(keepends=True))
        found.append(Block(str(path.relative_to(REPO)), match.group(2), title.group(1) if title else None, body))
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


def field_entry(markdown: str, name: str) -> str | None:
    """A field's entry in a generated reference: its definition line and meaning (``None`` if absent)."""
    found = re.search(rf"^`{re.escape(name)}`(?: ·[^\n]*)?\n:   (.*?)(?=\n\n\S|\Z)", markdown, re.MULTILINE | re.DOTALL)
    return found.group(0) if found else None


@pytest.mark.parametrize("document", [Policy, Layout, DiscoveryReport], ids=["policy", "layout", "discovery"])
def test_the_format_reference_lists_every_field_of_every_model_with_its_docstring(document: type[BaseModel]) -> None:
    markdown = reference.format_markdown(document)
    for model in models_of(document):
        text = section(markdown, model.model_config.get("title") or model.__name__)
        for name, field in model.model_fields.items():
            entry = field_entry(text, name)
            assert entry, f"{model.__name__}.{name}"
            if field.description:
                assert " ".join(field.description.split()).replace("``", "`")[:60] in " ".join(entry.split()), name


@pytest.mark.parametrize("name", sorted(reference.EXAMPLES))
def test_each_format_reference_opens_with_a_whole_valid_document(name: str) -> None:
    markdown = reference.GENERATORS[f"{name}-format"]()
    example = re.search(r'^## A whole document .*?```yaml title="[^"]+"\n(.*?)^```', markdown, re.MULTILINE | re.DOTALL)
    assert example and markdown.index("## A whole document") < markdown.index("\n## ", 1)
    kind = {"policy": "ReplicationPolicy", "layout": "ModelLayout", "discovery": "DiscoveryReport"}[name]
    _, problems = check_text(example.group(1), f"{name}.yaml")
    assert f"kind: {kind}" in example.group(1) and [str(problem) for problem in problems] == []


def test_a_field_entry_keeps_the_name_first_and_the_default_in_its_place() -> None:
    entry = reference.field_entry("steps", "integer", "`4`", ">= 1", "Audited steps.")
    assert entry[0] == "`steps` · integer · default `4`" and entry[1] == ":   Audited steps."
    assert reference.field_entry("name", "string", "required", "", "The name.")[0] == "`name` · string · **required**"


def test_the_settings_reference_lists_every_key_and_its_docstring() -> None:
    markdown = reference.settings_markdown()
    for model in models_of(KVPolicySettings):
        for name, field in model.model_fields.items():
            entry = field_entry(markdown, name)
            assert entry, name
            assert " ".join((field.description or "").split()).replace("``", "`")[:60] in " ".join(entry.split()), name


# --- the command-line reference ------------------------------------------------------------------------------


def documented_actions() -> list[tuple[str, argparse.Action]]:
    return [
        (name, action)
        for name, _, command in reference.subcommands(build_parser())
        for action in command._actions
        if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
    ]


def test_the_cli_reference_lists_every_command_and_flag() -> None:
    markdown = reference.cli_markdown()
    arguments = reference.parser_arguments(build_parser())
    for command, options in arguments.items():
        text = section(markdown, f"kvpolicy {command}")
        assert [option for option in options if f"`{option}`" not in text] == [], command
    assert "rule" in arguments and "--all" in arguments["rule"]


def test_the_cli_reference_leaves_out_hidden_flags() -> None:
    assert "--explain" not in section(reference.cli_markdown(), "kvpolicy plan")


def test_every_argument_of_every_command_is_described() -> None:
    assert [(name, action.dest) for name, action in documented_actions() if not (action.help or "").strip()] == []


def test_every_command_has_a_description_of_its_own() -> None:
    commands = list(reference.subcommands(build_parser()))
    assert [name for name, summary, command in commands if not command.description or command.description == summary] == []
    markdown = reference.cli_markdown()
    assert all(" ".join(command.description.split())[:60] in " ".join(markdown.split()) for _, _, command in commands)


def test_defaults_are_in_their_column_not_in_the_meaning() -> None:
    rows = [line for line in reference.cli_markdown().splitlines() if line.startswith("| `")]
    in_prose = [row for row in rows if re.search(r"\(default|; default|default:", row.rsplit(" | ", 1)[-1])]
    assert rows and in_prose == []
    for name, action in documented_actions():
        said = reference.split_default(action.help or "")[1]
        if said is not None or action.default not in (None, False, (), "", argparse.SUPPRESS) and not action.required:
            row = reference.argument_row(action)
            assert row.split(" | ")[2].strip() not in ("", "required"), (name, action.dest, row)


def test_split_default_moves_every_way_of_stating_a_default() -> None:
    assert reference.split_default("prompt length (default 256)") == ("prompt length", "256")
    assert reference.split_default("file (default: stdout)") == ("file", "stdout")
    assert reference.split_default("paths (repeatable; default: every example)") == ("paths (repeatable)", "every example")
    assert reference.split_default("layout; default: the layout's own") == ("layout", "the layout's own")
    assert reference.split_default("no default said") == ("no default said", None)


def test_every_command_has_one_to_three_examples() -> None:
    from kvpolicy.app.cli_examples import COMMAND_EXAMPLES

    commands = [name for name, _, _ in reference.subcommands(build_parser())]
    assert sorted(COMMAND_EXAMPLES) == sorted(commands)
    assert [name for name, examples in COMMAND_EXAMPLES.items() if not 1 <= len(examples) <= 3] == []


def command_examples() -> list:
    from kvpolicy.app.cli_examples import COMMAND_EXAMPLES

    return [(name, example) for name, examples in COMMAND_EXAMPLES.items() for example in examples]


@pytest.mark.parametrize(("name", "example"), command_examples(), ids=[e.command for _, e in command_examples()])
def test_each_command_example_parses_and_runs_as_the_reference_says(name: str, example) -> None:
    argv = shlex.split(example.command)
    assert argv[:2] == ["kvpolicy", name]
    build_parser().parse_args(argv[1:])
    if example.exit_code is not None:
        run = reference.run_command_example(example.command)
        assert run.exit_code == example.exit_code, run.output
        assert rule.shown_output(run.output) in command_section(reference.cli_markdown(), name)


def command_section(markdown: str, name: str) -> str:
    """A command's part of the command-line reference (output lines may start with ``#``)."""
    return markdown.split(f"### kvpolicy {name} {{#", 1)[1].split("\n### kvpolicy ", 1)[0]


# --- the diagnostics ------------------------------------------------------------------------------------------


def test_the_diagnostics_table_links_every_code_to_its_page() -> None:
    table = reference.diagnostics_markdown()
    assert all(f"[`{check.code}`](diagnostics/{check.code.lower()}.md)" in table for check in CHECKS)


def part(page: str, title: str) -> str:
    """The part of a code's page under its ``## title`` heading (examples may hold ``#`` lines)."""
    return page.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("check", CHECKS, ids=[check.code for check in CHECKS])
def test_each_code_has_a_page_in_ruffs_shape_with_both_examples_run(check) -> None:
    page = reference.diagnostic_markdown(check)
    headings = re.findall(r"^## (.*)$", page, re.MULTILINE)
    assert headings == ["What it does", "Why it matters", "Example", "Use instead"]
    assert check.explanation in part(page, "What it does") and check.why in part(page, "Why it matters")
    for title, example in (("Example", check.example), ("Use instead", check.fixed)):
        run = reference.run_example(example)
        shown = part(page, title)
        assert f"$ {run.command}\n{rule.shown_output(run.output)}" in shown, title
        assert all(text.rstrip("\n") in shown for _, text in example.files), title


@pytest.mark.parametrize("check", CHECKS, ids=[check.code for check in CHECKS])
def test_each_diagnostic_example_reports_its_code(check) -> None:
    run = reference.run_example(check.example)
    assert f"[{check.code}]" in run.output
    assert run.exit_code == (1 if check.severity == "error" else 0), run.output


@pytest.mark.parametrize("check", CHECKS, ids=[check.code for check in CHECKS])
def test_each_fixed_example_reports_nothing_of_its_code_and_passes(check) -> None:
    run = reference.run_example(check.fixed)
    assert f"[{check.code}]" not in run.output and run.exit_code == 0, run.output
    assert check.fixed != check.example


def test_every_code_has_an_explanation_and_a_reason_beyond_its_summary() -> None:
    assert [check.code for check in CHECKS if len(check.explanation) < 2 * len(check.summary) // 3] == []
    assert [check.code for check in CHECKS if len(check.why) < 80 or check.why in check.explanation] == []


def test_rule_prints_what_the_codes_page_shows_and_its_url(capsys: pytest.CaptureFixture[str]) -> None:
    check = rule.find_check("KVP203")
    code = main(["rule", "KVP203"])
    out = capsys.readouterr().out
    assert code == 0 and out == reference.rule_text(check)
    page = reference.diagnostic_markdown(check)
    for title in ("Example", "Use instead"):
        shown = re.search(r"```console\n\$ .*?\n(.*?)```", part(page, title), re.DOTALL).group(1)
        assert shown in out
    assert all(text in out for text in (check.summary, check.explanation, check.why, "What it does", "Why it matters"))
    assert out.rstrip().endswith(f"Documentation: {rule.diagnostic_location(check)}")
    assert "docs/reference/diagnostics/kvp203.md" in out or "reference/diagnostics/kvp203/" in out


def test_the_metrics_reference_names_every_series_and_operation_the_connector_registers() -> None:
    from kvpolicy.vllm import audit, metrics

    markdown = reference.metrics_markdown()
    assert [name for name in metrics.METRICS if f"`{name}`" not in markdown] == []
    assert f"`{audit.AUDIT_STATS_OPERATION}`" in markdown and f"`{audit.AUDIT_DEMOTED_OPERATION}`" in markdown
    reduced = metrics.KVPolicyConnectorStats().reduce()
    assert [key for key in reduced if key.startswith("kvpolicy_") and f"`{key}`" not in markdown] == []


def test_the_metrics_reference_names_the_lookup_probe_operation() -> None:
    assert "| `lookup_exists` |" in reference.metrics_markdown()


# --- the references, written into their pages ----------------------------------------------------------------


def test_the_reference_pages_hold_their_references_as_the_code_writes_them_now() -> None:
    """The pages under docs/reference/ read whole in the repository; regenerate with
    ``python -m kvpolicy.app.reference`` after changing what they are generated from."""
    stale = [str(path.relative_to(REPO)) for path, text in reference.expected_reference_pages().items()
             if not path.is_file() or path.read_text(encoding="utf-8") != text]
    assert stale == [], "stale: run `python -m kvpolicy.app.reference`"
    pages = sorted((DOCS / "reference").rglob("*.md"))
    assert all(reference.MARKER.search(path.read_text(encoding="utf-8")) for path in pages)
    assert len(pages) == 7 + len(CHECKS)


def test_the_reference_pages_do_not_depend_on_where_the_checkout_lies() -> None:
    """CI builds them in another folder than the one they were written in: a path of this checkout
    printed by an example would make them stale there."""
    holding_the_checkout = [str(path.relative_to(REPO)) for path, text in reference.expected_reference_pages().items()
                            if str(REPO) in text]
    assert holding_the_checkout == []


def test_a_written_reference_is_replaced_at_build_and_kept_between_its_markers() -> None:
    page = "intro\n<!-- kvpolicy-reference: diagnostics -->\nOLD\n<!-- /kvpolicy-reference: diagnostics -->\nend\n"
    assert "OLD" not in reference.expand(page) and "kvpolicy-reference" not in reference.expand(page)
    written = reference.written(page)
    assert written.startswith("intro\n<!-- kvpolicy-reference: diagnostics -->\n| code |") and "OLD" not in written
    assert written.endswith("<!-- /kvpolicy-reference: diagnostics -->\nend\n") and reference.written(written) == written


def test_the_readme_links_to_pages_that_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)", (REPO / "README.md").read_text(encoding="utf-8"))
    assert len(links) >= 10 and [link for link in links if not (REPO / link).is_file()] == []


# --- the build ---------------------------------------------------------------------------------------------


def test_the_site_builds_strictly_with_its_references(built_site: BuiltSite) -> None:  # noqa: F811
    assert built_site.returncode == 0 and "WARNING" not in built_site.stderr, built_site.stderr[-3000:]
    for check in CHECKS:
        page = built_site.page(f"reference/diagnostics/{check.code.lower()}/index.html")
        assert check.why.split(":")[0][:40] in page, check.code
    pages = "".join(built_site.pages().values())
    assert "kvpolicy-reference" not in pages and "{{ " not in pages
