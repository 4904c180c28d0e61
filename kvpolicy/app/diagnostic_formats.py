"""``kvpolicy validate``'s output formats and its check selection, as a linter's in CI.

* ``text``: ``path:line:col: severity: message [CODE]``, one line each (what editors and people read);
* ``json``: per file, its kind, validity and diagnostics (a ``ValidationReport`` document);
* ``github``: GitHub Actions workflow commands, so every problem annotates its line in a pull request;
* ``sarif``: a SARIF 2.1.0 log (GitHub code scanning and other SARIF viewers), one rule per check.

Selection works on warnings: ``--select`` / ``--ignore`` take codes or code prefixes (``KVP2``), and
``--warnings-as-errors`` makes the warnings left count as errors. An error cannot be deselected: the
connector refuses such a document whatever the linter prints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any
from urllib.parse import quote

from kvpolicy import __version__
from kvpolicy.documents.report import versioned
from kvpolicy.language.diagnostics import CHECKS, CHECKS_BY_CODE, Diagnostic, printable_path

FORMATS = ("text", "json", "github", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


@dataclass(frozen=True)
class FileResult:
    """What validating one file found."""

    path: str
    kind: str | None
    """``ReplicationPolicy`` / ``ModelLayout`` when the document is usable, else None."""
    diagnostics: tuple[Diagnostic, ...]

    @property
    def valid(self) -> bool:
        return not any(diagnostic.severity == "error" for diagnostic in self.diagnostics)


@dataclass(frozen=True)
class Selection:
    """Which warnings are reported, and whether they count as errors."""

    select: tuple[str, ...] = ()
    """Codes or prefixes of the warnings to report; empty: all."""
    ignore: tuple[str, ...] = ()
    """Codes or prefixes of warnings not to report."""
    warnings_as_errors: bool = False

    def __post_init__(self) -> None:
        for selector in (*self.select, *self.ignore):
            matched = [check for check in CHECKS if check.code.startswith(selector)]
            if not matched:
                raise ValueError(f"'{selector}' is not a check code or prefix; codes: {', '.join(CHECKS_BY_CODE)}")
            errors = [check.code for check in matched if check.severity == "error"]
            if errors and len(errors) == len(matched):
                raise ValueError(
                    f"'{selector}' selects only errors ({', '.join(errors)}); errors are always reported, since "
                    "the connector refuses such a document"
                )

    def apply(self, diagnostics: Iterable[Diagnostic]) -> tuple[Diagnostic, ...]:
        kept = []
        for diagnostic in diagnostics:
            if diagnostic.severity == "warning":
                if self.select and not diagnostic.code.startswith(self.select):
                    continue
                if diagnostic.code.startswith(self.ignore) if self.ignore else False:
                    continue
                if self.warnings_as_errors:
                    diagnostic = replace(diagnostic, severity="error")
            kept.append(diagnostic)
        return tuple(kept)


def parse_codes(text: str) -> tuple[str, ...]:
    """``KVP201,KVP2`` → its codes, upper-cased; an argparse type."""
    return tuple(part.strip().upper() for part in text.split(",") if part.strip())


def render(results: Sequence[FileResult], output: str) -> tuple[str, str]:
    """(stdout, stderr) of ``kvpolicy validate`` for ``results`` in format ``output``."""
    if output == "json":
        return json.dumps(_json(results), indent=2) + "\n", ""
    if output == "sarif":
        return json.dumps(sarif_log(results), indent=2) + "\n", ""
    if output == "github":
        return "".join(github_command(diagnostic) + "\n" for result in results for diagnostic in result.diagnostics), ""
    lines = [f"{diagnostic}\n" for result in results for diagnostic in result.diagnostics]
    notes = []
    for result in results:
        if result.valid and result.kind is not None:
            warnings = sum(diagnostic.severity == "warning" for diagnostic in result.diagnostics)
            note = f" ({warnings} warning{'s' * (warnings != 1)})" if warnings else ""
            notes.append(f"{printable_path(result.path)}: ok, {result.kind}{note}\n")
    return "".join(lines), "".join(notes)


def _json(results: Sequence[FileResult]) -> dict[str, Any]:
    return versioned("ValidationReport", {
        "valid": all(result.valid for result in results),
        "files": [
            {
                "path": result.path,
                "kind": result.kind if result.valid else None,
                "valid": result.valid,
                "diagnostics": [diagnostic.to_json() for diagnostic in result.diagnostics],
            }
            for result in results
        ],
    })


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_command(diagnostic: Diagnostic) -> str:
    """A GitHub Actions ``::error`` / ``::warning`` workflow command for ``diagnostic``."""
    properties = ",".join(
        f"{name}={_escape_property(value)}"
        for name, value in (
            ("file", printable_path(diagnostic.path)),
            ("line", str(diagnostic.line)),
            ("col", str(diagnostic.column)),
            ("title", f"{diagnostic.code} {diagnostic.check.name}"),
        )
    )
    return f"::{diagnostic.severity} {properties}::{_escape_data(diagnostic.message)}"


def _artifact_uri(path: str) -> str:
    """A SARIF ``artifactLocation.uri``: a file URI for an absolute path, else a relative reference."""
    pure = PurePath(path)
    if pure.is_absolute():
        return pure.as_uri()
    return quote(os.fsencode(pure.as_posix()), safe="/")  # the bytes the OS names: a name need not be UTF-8


def sarif_log(results: Sequence[FileResult]) -> dict[str, Any]:
    """A SARIF 2.1.0 log of ``results``: one run of the ``kvpolicy`` driver, every check a rule."""
    index = {check.code: position for position, check in enumerate(CHECKS)}
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "kvpolicy",
                        "version": __version__,
                        "rules": [
                            {
                                "id": check.code,
                                "name": check.name,
                                "shortDescription": {"text": check.summary},
                                "defaultConfiguration": {"level": check.severity},
                            }
                            for check in CHECKS
                        ],
                    }
                },
                "results": [
                    {
                        "ruleId": diagnostic.code,
                        "ruleIndex": index[diagnostic.code],
                        "level": diagnostic.severity,
                        "message": {"text": diagnostic.message},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": _artifact_uri(diagnostic.path)},
                                    "region": {"startLine": diagnostic.line, "startColumn": diagnostic.column},
                                }
                            }
                        ],
                    }
                    for result in results
                    for diagnostic in result.diagnostics
                ],
            }
        ],
    }
