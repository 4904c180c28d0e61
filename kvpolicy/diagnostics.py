"""Located problems in policy and layout files, printed like a compiler's: ``path:line:col: error: ...``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

Severity = Literal["error", "warning"]

MAX_MESSAGE_CHARS = 500
"""A message longer than this (one quoting a huge value) is cut, so output stays bounded."""


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

    def __post_init__(self) -> None:
        message = " ".join(self.message.split("\n"))
        if len(message) > MAX_MESSAGE_CHARS:
            cut = len(message) - MAX_MESSAGE_CHARS
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more characters)"
        object.__setattr__(self, "message", message)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.severity}: {self.message}"

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


class PlanError(ValueError):
    """The engine refuses a plan it cannot prove consistent; the message names the group and rule."""
