"""``kvpolicy rule CODE``: what a diagnostic code means, how to fix it, and an example that reports
it, run for real (as ``ruff rule`` does); ``kvpolicy rule --all`` lists every code. The text is the
documentation's diagnostics reference (:mod:`kvpolicy.app.reference`), from one source.

The examples run through the command line, which this module does not import (the command line imports
it): whoever runs one hands in the CLI's entry point (:data:`CommandLine`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpolicy.language.diagnostics import CHECKS, CHECKS_BY_CODE, CHECKS_BY_NAME, Check, Example

CommandLine = Callable[[Sequence[str]], int]
"""The ``kvpolicy`` command's entry point (:func:`kvpolicy.app.cli.main`): arguments in, exit code out."""

DOCS_URL_VARIABLE = "KVPOLICY_DOCS_URL"
"""The environment variable naming where a deployment publishes this site (``site_url`` in ``mkdocs.yml``
reads it too). kvpolicy has no public site of its own: without it, ``kvpolicy rule CODE`` names the page
in a checkout, where it reads whole."""


@dataclass(frozen=True)
class ExampleRun:
    """What ``kvpolicy`` printed for a check's example (stdout and stderr, in order) and its exit code."""

    command: str
    """The command line as a user types it: ``kvpolicy ARGS``."""
    exit_code: int
    output: str


def run_example(example: Example, cli: CommandLine) -> ExampleRun:
    """Run ``example`` with the CLI in-process, its files in a fresh directory; paths in the output
    are shown relative to that directory, as if the user had run it there."""
    with tempfile.TemporaryDirectory(prefix="kvpolicy-example-") as directory:
        root = Path(directory).resolve()
        for name, text in example.files:
            (root / name).write_text(text, encoding="utf-8")
        names = {name for name, _ in example.files}
        argv = [
            str(root / argument) if argument in names or argument.endswith((".yaml", ".yml")) else argument
            for argument in example.argv
        ]
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            try:
                code = cli(argv)
            except SystemExit as exit_:  # a usage error
                code = int(exit_.code or 0)
        output = captured.getvalue().replace(f"{root}/", "")
    return ExampleRun(" ".join(("kvpolicy", *example.argv)), code, output)


SHOWN_LINES = 12
"""An example's output longer than this is shown as its first and last lines around a ``...`` line."""


def shown_output(output: str) -> str:
    """``output`` as the reference shows it: whole, or cut in the middle to a ``...`` line."""
    lines = output.rstrip("\n").splitlines()
    if len(lines) > SHOWN_LINES:
        lines = [*lines[:3], "...", *lines[-2:]]
    return "\n".join(lines)


def find_check(code_or_name: str) -> Check | None:
    """The check of a code (any case) or a name."""
    return CHECKS_BY_CODE.get(code_or_name.upper()) or CHECKS_BY_NAME.get(code_or_name.lower())


def diagnostic_page(check: Check) -> str:
    """The code's page, relative to the documentation's source: ``reference/diagnostics/kvp203.md``."""
    return f"reference/diagnostics/{check.code.lower()}.md"


def diagnostic_location(check: Check, environ: Mapping[str, str] = os.environ) -> str:
    """Where the code's page is: on the site :data:`DOCS_URL_VARIABLE` names (directory URLs, as MkDocs
    writes them), else its source in a checkout (``docs/reference/diagnostics/kvp203.md``)."""
    site = environ.get(DOCS_URL_VARIABLE, "").strip()
    if site:
        return f"{site.rstrip('/')}/{diagnostic_page(check).removesuffix('.md')}/"
    return f"docs/{diagnostic_page(check)} in a kvpolicy checkout (bash scripts/run.sh docs builds the site)"


def _example_text(title: str, example: Example, cli: CommandLine) -> list[str]:
    run = run_example(example, cli)
    lines = [title, ""]
    for name, text in example.files:
        lines += [f"  {name}:", *(f"    {line}" for line in text.splitlines()), ""]
    return [*lines, f"$ {run.command}", shown_output(run.output), ""]


def rule_text(check: Check, cli: CommandLine) -> str:
    """``kvpolicy rule CODE``: what the code's page shows (what it finds, what it does, why it matters, an
    example that reports it and the example fixed, each run for real), then the page's URL."""
    lines = [
        f"{check.code} {check.name} ({check.severity})", "", check.summary, "",
        "What it does", "", check.explanation, "", "Why it matters", "", check.why, "",
        *_example_text("Example", check.example, cli), *_example_text("Use instead", check.fixed, cli),
        f"Documentation: {diagnostic_location(check)}",
    ]
    return "\n".join(lines) + "\n"


def rule_list() -> str:
    """``kvpolicy rule --all``: one line per check."""
    width = max(len(check.name) for check in CHECKS)
    return "".join(f"{check.code}  {check.name:<{width}}  {check.severity:<7}  {check.summary}\n" for check in CHECKS)


def run_rule(args: argparse.Namespace, cli: CommandLine) -> int:
    if args.all == (args.code is not None):
        print("kvpolicy rule: error: give one CODE (e.g. KVP203) or --all", file=sys.stderr)
        return 2
    if args.all:
        sys.stdout.write(rule_list())
        return 0
    check = find_check(args.code)
    if check is None:
        shown = ascii(args.code[:40])[1:-1] + ("..." if len(args.code) > 40 else "")
        print(f"kvpolicy rule: error: unknown code '{shown}'; codes: {', '.join(CHECKS_BY_CODE)}", file=sys.stderr)
        return 2
    sys.stdout.write(rule_text(check, cli))
    return 0
