"""Located problems in policy and layout files, printed like a compiler's: ``path:line:col: error: ...``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

Severity = Literal["error", "warning"]

MAX_MESSAGE_CHARS = 500
"""A message longer than this (one quoting a huge value) is cut, so output stays bounded."""


@dataclass(frozen=True)
class Check:
    """One kind of problem ``kvpolicy validate`` reports, under a stable code."""

    code: str
    """``KVP`` and three digits; the first digit is the family (0 file, 1 format, 2 lint, 3 plan, 9 output)."""
    name: str
    """Kebab-case name, the SARIF rule's ``name``."""
    severity: Severity
    """An error makes the document unusable; a warning is advice (``--warnings-as-errors`` promotes it)."""
    summary: str
    """What the check finds, in one sentence."""


CHECKS: tuple[Check, ...] = (
    Check("KVP001", "unreadable-file", "error",
          "The path is not a regular file that can be read, within the size limit, as UTF-8 text."),
    Check("KVP002", "yaml-syntax", "error",
          "The text is not exactly one well-formed YAML document of plain values (control characters, bad "
          "indentation, '---', a tag such as !!binary or !custom)."),
    Check("KVP003", "too-large", "error",
          "The document exceeds a bound: nodes, characters once aliases are expanded, layer names, an expression's "
          "size or a value's magnitude."),
    Check("KVP004", "duplicate-key", "error", "A mapping repeats a key (YAML loaders silently keep one)."),
    Check("KVP101", "document-kind", "error",
          "The top level is not a mapping, or 'kind' is missing, unknown or not what the command expects."),
    Check("KVP102", "unknown-field", "error", "A field the format does not have, typos included."),
    Check("KVP103", "missing-field", "error", "A required field is absent."),
    Check("KVP104", "invalid-value", "error",
          "A value of the wrong type, outside its range or pattern, or inconsistent with another field."),
    Check("KVP105", "invalid-expression", "error",
          "An expression that does not parse, uses syntax outside the sandbox, or reads an unknown variable."),
    Check("KVP106", "duplicate-layer", "error", "A layer listed in more than one group."),
    Check("KVP201", "unknown-spec-class", "warning", "A rule matches a spec class vLLM 0.32 does not define."),
    Check("KVP202", "unknown-spec-field", "warning", "A rule matches a field no known spec class has."),
    Check("KVP203", "unreachable-rule", "warning", "An earlier rule matches everything this rule matches."),
    Check("KVP204", "unexpected-bases", "warning", "A spec's base classes differ from vLLM 0.32's for that class."),
    Check("KVP205", "router-unreadable-keys", "warning",
          "Routers reading vLLM store keys (Mooncake Conductor's grammar) would not read the key template's keys as the "
          "key contract states them."),
    Check("KVP301", "plan-refused", "error",
          "The engine cannot prove a plan consistent for this layout and topology (or vLLM refuses the topology)."),
    Check("KVP901", "too-many-problems", "error", "More problems than are listed for one file; fix these first."),
)
"""Every check, by code: the table the README shows and the SARIF ``rules``."""

CHECKS_BY_CODE: dict[str, Check] = {check.code: check for check in CHECKS}
CHECKS_BY_NAME: dict[str, Check] = {check.name: check for check in CHECKS}


def _printable(character: str) -> str:
    """``character``, or its escape where it is not printable (a control character, a line or
    record separator, a lone surrogate that a file name undecodable as UTF-8 leaves)."""
    if character.isprintable():
        return character
    if "\ud800" <= character <= "\udfff":
        return f"\\u{ord(character):04x}"  # unicode_escape cannot encode a lone surrogate
    return character.encode("unicode_escape").decode()


def printable_path(path: str) -> str:
    """``path`` as a diagnostic line shows it: one line, printable on any output encoding (a newline
    in a file name is ``\\n``, a byte not decodable as UTF-8 ``\\udcXX``), unchanged when it is plain."""
    if path.isprintable():
        return path
    return "".join(_printable(character) for character in path)


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One problem at one place in one file."""

    path: str
    line: int
    """1-based line."""
    column: int
    """1-based column."""
    severity: Severity
    message: str
    """What is wrong and, where there is one, the fix; at most :data:`MAX_MESSAGE_CHARS` characters,
    on one line."""
    code: str
    """The :class:`Check` this is, e.g. ``KVP102``."""

    def __post_init__(self) -> None:
        if self.code not in CHECKS_BY_CODE:
            raise ValueError(f"unknown diagnostic code {self.code!r}")
        # Cut before escaping, so a message quoting a megabyte costs no more than a short one.
        cut = max(0, len(self.message) - MAX_MESSAGE_CHARS)
        # One line whatever the input quoted: a newline becomes a space, any other character that is
        # not printable (a record separator splits lines too) its escape.
        message = "".join(
            " " if character in "\r\n" else _printable(character) for character in self.message[:MAX_MESSAGE_CHARS]
        )
        if len(message) > MAX_MESSAGE_CHARS:  # escapes made it longer
            cut += len(message) - MAX_MESSAGE_CHARS
            message = message[:MAX_MESSAGE_CHARS]
        if cut:
            message = f"{message}... ({cut} more characters)"
        object.__setattr__(self, "message", message)

    def __str__(self) -> str:
        return f"{printable_path(self.path)}:{self.line}:{self.column}: {self.severity}: {self.message} [{self.code}]"

    @property
    def check(self) -> Check:
        return CHECKS_BY_CODE[self.code]

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class DocumentError(ValueError):
    """A document that cannot be used; carries every problem found, not just the first."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics = tuple(sorted(diagnostics))
        super().__init__("\n".join(str(diagnostic) for diagnostic in self.diagnostics))

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")


@dataclass(frozen=True)
class PlanProblem:
    """One reason the engine refuses a plan."""

    message: str
    """What is refused and why, naming the group, layer and rule."""
    location: str | None = None
    """``path:line:col`` of the expression or rule at fault, when the policy was loaded from a file."""

    def __str__(self) -> str:
        return f"{printable_path(self.location)}: error: {self.message}" if self.location else self.message


class PlanError(ValueError):
    """The engine refuses a plan it cannot prove consistent: every reason found (each failing group
    and layer, alike layers once), each naming its group and rule and, where it has one, located."""

    def __init__(self, problems: str | Iterable[PlanProblem], location: str | None = None) -> None:
        found = (PlanProblem(problems, location),) if isinstance(problems, str) else tuple(problems)
        self.problems: tuple[PlanProblem, ...] = tuple(dict.fromkeys(found))
        super().__init__("\n".join(str(problem) for problem in self.problems))
