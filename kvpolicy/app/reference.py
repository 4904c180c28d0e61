"""The documentation's references, computed from the code they describe, so they cannot drift from it.

Each generator returns Markdown for one marker of the documentation site (``<!-- kvpolicy-reference:
NAME -->`` in a page under ``docs/``; ``docs/hooks.py`` calls :func:`expand` while MkDocs builds):

- ``policy-format`` / ``layout-format`` / ``discovery-format``: the documents' fields, from the JSON Schemas of the pydantic
  models (their attribute docstrings: the same text as ``schemas/``);
- ``diagnostics``: every check of :mod:`kvpolicy.language.diagnostics` with its explanation and its example,
  run through the CLI (``kvpolicy rule CODE`` prints the same, :func:`rule_text`);
- ``cli``: every command and flag, from the argparse parser of :mod:`kvpolicy.app.cli`;
- ``settings``: the connector's ``kv_connector_extra_config`` keys, from :class:`KVPolicySettings`;
- ``metrics``: the series kvpolicy adds to vLLM's ``/metrics`` and its connector-stats operations, read
  from the source of the modules that register them (which import vLLM; reading their source keeps
  this module, and the site's build, free of it).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kvpolicy.app import rule
from kvpolicy.app.cli import build_parser, main
from kvpolicy.app.cli_examples import COMMAND_EXAMPLES
from kvpolicy.app.rule import ExampleRun, diagnostic_page, shown_output
from kvpolicy.documents import schema
from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.evidence.discovery import DiscoveryReport
from kvpolicy.language.diagnostics import CHECKS, Check, Example
from kvpolicy.language.models import Layout, Policy

MARKER = re.compile(r"<!-- kvpolicy-reference: ([a-z0-9-]+) -->")
"""Where a page wants a generated reference. Alone, the marker is replaced while the site builds; followed by
its end marker (:data:`END`), the text between the two is the reference as last written into the page
(:func:`write_references`), so that the page reads whole in the repository too, and the build replaces it
with the reference computed afresh."""

END = "<!-- /kvpolicy-reference: {name} -->"
"""The end of a reference written into its page."""

DOCS = Path(__file__).resolve().parents[2] / "docs"
"""The documentation's source, in a checkout."""

PACKAGE = Path(__file__).resolve().parents[1]

# --- diagnostics ------------------------------------------------------------------------------------


def run_example(example: Example) -> ExampleRun:
    """Run ``example`` with this CLI in-process (:func:`kvpolicy.app.rule.run_example`)."""
    return rule.run_example(example, main)


def rule_text(check: Check) -> str:
    """What ``kvpolicy rule CODE`` prints (:func:`kvpolicy.app.rule.rule_text`)."""
    return rule.rule_text(check, main)


def diagnostics_markdown() -> str:
    """The table of every check, each code linking to its own page (:func:`diagnostic_markdown`)."""
    return "\n".join([
        "| code | name | severity | what it finds |",
        "|---|---|---|---|",
        *(
            f"| [`{check.code}`](diagnostics/{check.code.lower()}.md) | `{check.name}` | {check.severity} | {_cell(check.summary)} |"
            for check in CHECKS
        ),
        "",
    ])


def _example_markdown(example: Example) -> list[str]:
    run = run_example(example)
    out: list[str] = []
    for name, text in example.files:
        out += [f'```yaml title="{name}"', text.rstrip("\n"), "```", ""]
    return [*out, "```console", f"$ {run.command}", shown_output(run.output), "```", ""]


def diagnostic_markdown(check: Check) -> str:
    """One code's page, in the shape of ruff's rule pages: what it finds and does, why it matters, an
    example that reports it and the example fixed, each with what ``kvpolicy`` printed for it."""
    return "\n".join([
        f"# {check.code} `{check.name}`",
        "",
        f"**{check.severity}** · [every code](../diagnostics.md) · `kvpolicy rule {check.code}` prints this page",
        "",
        check.summary,
        "",
        "## What it does",
        "",
        check.explanation,
        "",
        "## Why it matters",
        "",
        check.why,
        "",
        "## Example",
        "",
        *_example_markdown(check.example),
        "## Use instead",
        "",
        *_example_markdown(check.fixed),
    ])


# --- document formats ---------------------------------------------------------------------------------


def _markdown_text(text: str) -> str:
    """A docstring as Markdown: reStructuredText's ``literal`` and :role:`name` become code spans."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return " ".join(_markdown_text(text).split()).replace("|", "\\|")


def _type(node: Mapping[str, Any]) -> str:
    """A JSON Schema node's type in words."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{name.lower()})"
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in node["enum"])
    if "anyOf" in node:
        return " or ".join(dict.fromkeys(_type(option) for option in node["anyOf"]))
    kind = node.get("type")
    if kind == "array":
        items = node.get("items")
        return f"list of {_type(items)}" if items else "list"
    if kind == "object":
        values = node.get("additionalProperties")
        return f"mapping of {_type(values)}" if isinstance(values, Mapping) and values else "mapping"
    return {"integer": "integer", "string": "string", "boolean": "boolean", "null": "null", "number": "number"}.get(
        str(kind), "any"
    )


_BOUNDS = (
    ("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"), ("exclusiveMaximum", "< {}"),
    ("minLength", "at least {} characters"), ("maxLength", "at most {} characters"),
    ("minItems", "at least {} items"), ("maxItems", "at most {} items"), ("pattern", "matches `{}`"),
)


def _constraints(node: Mapping[str, Any]) -> str:
    found = [template.format(node[key]) for key, template in _BOUNDS if key in node]
    for option in node.get("anyOf", ()):
        found += [template.format(option[key]) for key, template in _BOUNDS if key in option]
    return "; ".join(dict.fromkeys(found))


def _default(name: str, node: Mapping[str, Any], required: set[str]) -> str:
    if name in required:
        return "required"
    if "default" not in node:
        return ""
    return f"`{json.dumps(node['default'])}`"


def field_entry(name: str, kind: str, default: str, constraints: str, meaning: str) -> list[str]:
    """One field as a definition: its name, type and default on the first line (where a name cannot break),
    then its meaning and constraints. A table of five columns squeezed names into a third of a column."""
    head = " · ".join(part for part in (f"`{name}`", kind, "**required**" if default == "required" else
                                         (f"default {default}" if default else "")) if part)
    out = [head, f":   {_cell(meaning) or '(no description)'}"]
    if constraints:
        out += ["", f"    *Constraints: {_cell(constraints)}.*"]
    return [*out, ""]


def _model_section(title: str, node: Mapping[str, Any], level: str, anchor_prefix: str = "") -> list[str]:
    out = [f"{level} {title} {{#{anchor_prefix}{title.lower()}}}", ""]
    if node.get("description"):
        out += [_markdown_text(" ".join(node["description"].split())), ""]
    if "enum" in node:
        out += ["One of: " + ", ".join(f"`{value}`" for value in node["enum"]) + ".", ""]
        return out
    properties = node.get("properties", {})
    required = set(node.get("required", ()))
    for name, field in properties.items():
        kind = _type(field).replace("](#", f"](#{anchor_prefix}") if anchor_prefix else _type(field)
        out += field_entry(name, kind, _default(name, field, required), _constraints(field), field.get("description", ""))
    return out


EXAMPLES = {"policy": "policies/default.yaml", "layout": "examples/layouts/deepseek-v3.yaml",
            "discovery": "examples/discovery/my-model-tp2.yaml"}
"""Per format, a whole valid document from the checkout, shown at the top of its reference."""


def format_markdown(model: type[BaseModel], example: str | None = None) -> str:
    """A whole example document (``example``, a path relative to the checkout), then every field of
    ``model`` and of the models and enumerations it uses, from its JSON Schema."""
    document = schema.json_schema(model)
    out: list[str] = []
    if example is not None:
        text = (DOCS.parent / example).read_text(encoding="utf-8")
        out += ["## A whole document {#example}", "", f"`{example}`, valid as it stands (`kvpolicy validate {example}`):",
                "", f'```yaml title="{Path(example).name}"', text.rstrip("\n"), "```", ""]
    out += _model_section(document["title"], document, "##")
    for name, node in document.get("$defs", {}).items():
        out += _model_section(name, node, "###")
    return "\n".join(out)


# --- the command line ---------------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    for action in parser._actions:  # argparse has no public accessor for its subcommands
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, command in action.choices.items():
                yield name, helps.get(name, ""), command


def _usage(command: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(prog=command.prog, width=100)
    formatter.add_usage(command.usage, command._actions, command._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


_DEFAULT_IN_HELP = (
    re.compile(r"\s*\(default:? ([^()]*(?:\([^()]*\)[^()]*)*)\)"),  # "... (default 4)", "(default: stdout)"
    re.compile(r";\s*default:? (.*)$"),  # "...; default: the layout's kv_cache_layout, else ..."
    re.compile(r"\s*\(([^();]*); default:? ([^()]*)\)"),  # "(repeatable; default: every example)"
)


def split_default(help_text: str) -> tuple[str, str | None]:
    """``help_text`` without the default it states in prose, and that default (``None`` if it states none):
    the reference shows defaults in their own column, ``--help`` in the prose."""
    found = _DEFAULT_IN_HELP[2].search(help_text)
    if found:
        return help_text[: found.start()] + f" ({found.group(1)})" + help_text[found.end():], found.group(2).strip()
    for pattern in _DEFAULT_IN_HELP[:2]:
        found = pattern.search(help_text)
        if found:
            return (help_text[: found.start()] + help_text[found.end():]).strip(), found.group(1).strip()
    return help_text, None


def _shown_default(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(_shown_default, value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def argument_row(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{option}`" for option in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or (action.dest.upper() if action.choices is None else None)
            if metavar is not None:
                names += f" `{metavar}`"
    else:
        names = f"`{action.metavar or action.dest}`"
    values = ", ".join(f"`{choice}`" for choice in action.choices) if action.choices else ""
    help_text, said = split_default("" if action.help in (None, argparse.SUPPRESS) else str(action.help))
    default = action.default
    shown = "" if default in (None, False, (), "", argparse.SUPPRESS) or action.required else f"`{_shown_default(default)}`"
    if said is not None and not shown:
        shown = _cell(said)
    if (action.required and action.option_strings) or (not action.option_strings and action.nargs in ("+", None)):
        shown = "required"
    return f"| {names} | {values} | {shown} | {_cell(help_text)} |"


def _command_example_markdown(example: Any) -> list[str]:
    """One of :data:`kvpolicy.app.cli_examples.COMMAND_EXAMPLES`: run from the checkout's root, its output shown."""
    out = [example.what, ""]
    if example.exit_code is None:
        return [*out, "```bash", f"{example.command}    # needs vLLM and Mooncake: not run while this page was built",
                "```", ""]
    run = run_command_example(example.command)
    shown = shown_output(run.output)
    return [*out, "```console", f"$ {example.command}", *([shown] if shown else []), "```", ""]


def run_command_example(command: str) -> ExampleRun:
    """Run ``kvpolicy ARGS`` in-process from the checkout's root (paths in examples are relative to it, and
    so are the paths it prints)."""
    captured = io.StringIO()
    with contextlib.chdir(DOCS.parent), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        try:
            code = main(shlex.split(command)[1:])
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    # Shown relative to the checkout, as a reader in it sees them: the page must not depend on where it was built.
    return ExampleRun(command, code, captured.getvalue().replace(f"{DOCS.parent}/", ""))


def cli_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """Every subcommand of ``kvpolicy``: its usage and a row per argument (hidden ones left out)."""
    if parser is None:
        parser = build_parser()
    out = ["| command | what it does |", "|---|---|"]
    commands = list(subcommands(parser))
    out += [f"| [`kvpolicy {name}`](#kvpolicy-{name}) | {_cell(summary)} |" for name, summary, _ in commands]
    out.append("")
    for name, summary, command in commands:
        description = command.description or summary[:1].upper() + summary[1:] + "."
        out += [f"### kvpolicy {name} {{#kvpolicy-{name}}}", "", _markdown_text(description), ""]
        out += ["```text", _usage(command), "```", ""]
        rows = [
            argument_row(action)
            for action in command._actions
            if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
        ]
        if rows:
            out += ["| argument | values | default | meaning |", "|---|---|---|---|", *rows, ""]
        for example in COMMAND_EXAMPLES.get(name, ()):
            out += _command_example_markdown(example)
    return "\n".join(out)


def parser_arguments(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Per subcommand, the option strings (or positional names) of its documented arguments."""
    return {
        name: [
            option
            for action in command._actions
            if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
            for option in (action.option_strings or [action.metavar or action.dest])
        ]
        for name, _, command in subcommands(parser)
    }


# --- the connector's settings ---------------------------------------------------------------------------


def settings_markdown() -> str:
    """An entry per key of ``kv_connector_extra_config`` that the connector reads, from its model."""
    document = schema.json_schema(KVPolicySettings)
    required = {"kvpolicy"}  # the connector needs it; the model allows it unset for standalone workers
    out: list[str] = []
    for name, field in document["properties"].items():
        default = "required" if name in required else (
            "unset" if field.get("default", None) is None else f"`{json.dumps(field['default'])}`"
        )
        out += field_entry(name, _type(field).replace("](#", "](#settings-"), default, _constraints(field),
                           field.get("description", ""))
    for name, node in document.get("$defs", {}).items():
        out += _model_section(name, node, "###", anchor_prefix="settings-")
    return "\n".join(out)


# --- metrics ------------------------------------------------------------------------------------------


def _module_tree(relative: str) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))


def _documented_constants(tree: ast.Module) -> Iterator[tuple[str, Any, str]]:
    """(name, literal value, docstring) of each module-level assignment followed by a docstring."""
    body = tree.body
    for statement, following in zip(body, body[1:], strict=False):
        if (
            isinstance(statement, (ast.Assign, ast.AnnAssign))
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            target = statement.targets[0] if isinstance(statement, ast.Assign) else statement.target
            if isinstance(target, ast.Name) and statement.value is not None:
                with contextlib.suppress(ValueError):
                    yield target.id, ast.literal_eval(statement.value), following.value.value


@dataclass(frozen=True)
class MetricsReference:
    """What the connector exports, as its source states it."""

    series: Mapping[str, str]
    """``kvpolicy.vllm.metrics.METRICS``: every series kvpolicy adds to ``/metrics``, with its help."""
    operations: Mapping[str, str]
    """Connector-stats operations kvpolicy records beside the store's own: name -> what it records."""
    reduced: tuple[str, ...]
    """The keys :meth:`KVPolicyConnectorStats.reduce` adds to vLLM's logged connector stats."""


def metrics_reference() -> MetricsReference:
    """Read from ``kvpolicy/vllm/metrics.py`` (the series, the reduced stats), ``kvpolicy/vllm/audit.py``
    (documented ``*_OPERATION`` constants) and ``kvpolicy/vllm/lookup.py`` (operations it records)."""
    metrics = _module_tree("vllm/metrics.py")
    series = next(value for name, value, _ in _documented_constants(metrics) if name == "METRICS")
    reduced = tuple(
        node.slice.value
        for node in ast.walk(metrics)
        if isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "reduced"
        and isinstance(node.slice, ast.Constant)
    )
    operations = {
        value: " ".join(doc.split())
        for name, value, doc in _documented_constants(_module_tree("vllm/audit.py"))
        if name.endswith("_OPERATION")
    }
    for node in ast.walk(_module_tree("vllm/lookup.py")):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "record_operation"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
        ):
            operations.setdefault(
                node.args[1].value,
                "Recorded per lookup probe (one `batch_is_exist` of the keys a lookup reads): the keys probed, "
                "status `error` with every key failed when the call raised.",
            )
    return MetricsReference(series=series, operations=operations, reduced=reduced)


def metrics_markdown() -> str:
    found = metrics_reference()
    out = ["| series | what it counts |", "|---|---|"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in found.series.items()]
    out += [
        "",
        "kvpolicy also records these operations in vLLM's connector stats, beside the Mooncake store's own "
        "(`save_put`, `save_exists`, `load_get`, ...): vLLM's `/metrics` shows each as an `operation` label of the "
        "stock `vllm:mooncake_store_operation_*` series, and its logged stats as `OPERATION_count`, `_avg_ms`, "
        "`_p90_ms` and the like.",
        "",
        "| operation | what it records |",
        "|---|---|",
        *(f"| `{name}` | {_cell(text)} |" for name, text in found.operations.items()),
        "",
        "The connector's stats, as vLLM logs them, add these totals over the workers:",
        "",
        *(f"- `{name}`" for name in found.reduced),
        "",
    ]
    return "\n".join(out)


# --- the site -------------------------------------------------------------------------------------------


GENERATORS: dict[str, Callable[[], str]] = {
    "policy-format": lambda: format_markdown(Policy, EXAMPLES["policy"]),
    "layout-format": lambda: format_markdown(Layout, EXAMPLES["layout"]),
    "discovery-format": lambda: format_markdown(DiscoveryReport, EXAMPLES["discovery"]),
    "diagnostics": diagnostics_markdown,
    **{f"diagnostic-{check.code.lower()}": (lambda check=check: diagnostic_markdown(check)) for check in CHECKS},
    "cli": cli_markdown,
    "settings": settings_markdown,
    "metrics": metrics_markdown,
    "model-coverage": lambda: _coverage_markdown(),
    "model-coverage-warm-path": lambda: _coverage_markdown(warm_path=True),
}
"""Marker name -> the Markdown that replaces it."""


def _coverage_markdown(*, warm_path: bool = False) -> str:
    from kvpolicy.app.coverage import coverage_markdown, warm_path_markdown

    return warm_path_markdown() if warm_path else coverage_markdown()


def _generate(name: str) -> str:
    if name not in GENERATORS:
        raise ValueError(f"unknown kvpolicy reference '{name}'; known: {', '.join(GENERATORS)}")
    return GENERATORS[name]().rstrip("\n") + "\n"


def _regions(markdown: str) -> Iterator[tuple[int, int, str, bool]]:
    """(start, end, name, written) of each marker: ``written`` when its end marker follows, the span then
    running to the end marker's end."""
    position = 0
    while (found := MARKER.search(markdown, position)) is not None:
        name = found.group(1)
        end = markdown.find(END.format(name=name), found.end())
        if end >= 0 and not MARKER.search(markdown, found.end(), end):
            stop = end + len(END.format(name=name))
            yield found.start(), stop, name, True
        else:
            yield found.start(), found.end(), name, False
            stop = found.end()
        position = stop


def expand(markdown: str) -> str:
    """``markdown`` with each reference (a marker, or a written reference between its markers) replaced
    by its text computed afresh; an unknown marker is a ``ValueError`` (the build fails rather than
    publish a page missing its reference)."""
    out, position = [], 0
    for start, stop, name, _ in _regions(markdown):
        out += [markdown[position:start], _generate(name).rstrip("\n")]
        position = stop
    return "".join([*out, markdown[position:]])


def written(markdown: str) -> str:
    """``markdown`` with each written reference replaced by its text computed afresh, between its markers
    (what :func:`write_references` writes); bare markers are left as they are."""
    out, position = [], 0
    for start, stop, name, is_written in _regions(markdown):
        if is_written:
            out += [markdown[position:start], f"<!-- kvpolicy-reference: {name} -->\n", _generate(name),
                    END.format(name=name)]
            position = stop
    return "".join([*out, markdown[position:]])


REFERENCE_PAGES = "reference"
"""The folder under ``docs/`` whose pages carry their references written out (readable in the repository)."""


def expected_reference_pages(docs: Path = DOCS) -> dict[Path, str]:
    """Every page of :data:`REFERENCE_PAGES` as it should be committed: the pages there with their references
    written afresh, and one page per diagnostic code (made if missing)."""
    pages = {path: written(path.read_text(encoding="utf-8")) for path in sorted((docs / REFERENCE_PAGES).rglob("*.md"))}
    for check in CHECKS:
        name = f"diagnostic-{check.code.lower()}"
        path = docs / diagnostic_page(check)
        if path not in pages:
            pages[path] = written(f"<!-- kvpolicy-reference: {name} -->\n{END.format(name=name)}\n")
    return pages


def write_references(docs: Path = DOCS) -> list[Path]:
    """Write every reference page afresh (:func:`expected_reference_pages`); the paths that changed."""
    changed = []
    for path, text in expected_reference_pages(docs).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


if __name__ == "__main__":  # python -m kvpolicy.app.reference: write the reference pages afresh
    for changed_path in write_references():
        print(f"wrote {changed_path.relative_to(DOCS.parent)}")
