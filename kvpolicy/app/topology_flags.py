"""The command line's topology flags, derived from :class:`~kvpolicy.language.models.Topology` (as vLLM derives
its engine flags from its config classes): one flag per field, named for it (``tp_size`` → ``--tp``),
its help the field's docstring, its default and bounds the field's, so a field added to the model,
or a bound changed, reaches every command without restating it here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from kvpolicy.language.diagnostics import PlanError, PlanProblem
from kvpolicy.language.models import Topology

__all__ = [
    "TOPOLOGY_FLAGS", "TopologyFlag", "add_topology_flag", "add_topology_flags", "flags_of", "several_help", "topology_from_args",
]


@dataclass(frozen=True)
class TopologyFlag:
    """The flag of one :class:`Topology` field."""

    field: str
    """The field, e.g. ``tp_size``."""
    help: str
    """The field's docstring."""
    default: int
    low: int | None
    """The field's lower bound, inclusive (``ge``; ``gt`` + 1); None without one."""
    high: int | None
    """The field's upper bound, inclusive (``le``; ``lt`` - 1); None without one."""
    validator: TypeAdapter[int] = field(compare=False, repr=False)
    """The field's own validation (type, strictness, every constraint)."""

    @classmethod
    def of(cls, name: str, info: FieldInfo) -> TopologyFlag:
        return cls(name, info.description or "", info.default, *_bounds(info.metadata),
                   TypeAdapter(Annotated[info.annotation, info]))

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed arguments: the field without ``_size`` (``tp``)."""
        return self.field.removesuffix("_size")

    @property
    def flag(self) -> str:
        return f"--{self.dest}"

    def parse(self, text: str) -> int:
        """``text`` as a value of the field, or an :class:`argparse.ArgumentTypeError` that states the
        field's bounds (argparse prints it as a usage error naming the flag)."""
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        try:
            return self.validator.validate_python(value)
        except ValidationError as error:
            if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
                raise argparse.ArgumentTypeError(f"expected a size {self.bounds}, got {value}") from None
            raise argparse.ArgumentTypeError(f"{error.errors()[0]['msg']}, got {value}") from None

    @property
    def bounds(self) -> str:
        """The field's bounds in words: ``between 1 and 4096``, ``at least 1``, ``at most 8``."""
        if self.low is not None and self.high is not None:
            return f"between {self.low} and {self.high}"
        return f"at least {self.low}" if self.low is not None else f"at most {self.high}"


def _bounds(metadata: list[Any]) -> tuple[int | None, int | None]:
    """(lowest, highest) value the field's constraints allow (pydantic's ``annotated_types``
    ``Ge``/``Gt``/``Le``/``Lt``, read by their attribute names)."""
    low = high = None
    for constraint in metadata:
        if getattr(constraint, "ge", None) is not None:
            low = int(constraint.ge)
        elif getattr(constraint, "gt", None) is not None:
            low = int(constraint.gt) + 1
        elif getattr(constraint, "le", None) is not None:
            high = int(constraint.le)
        elif getattr(constraint, "lt", None) is not None:
            high = int(constraint.lt) - 1
    return low, high


def flags_of(model: type[BaseModel]) -> tuple[TopologyFlag, ...]:
    """One flag per field of ``model``, in the model's order."""
    return tuple(TopologyFlag.of(name, info) for name, info in model.model_fields.items())


TOPOLOGY_FLAGS = flags_of(Topology)
"""One flag per :class:`Topology` field, in the model's order."""
_BY_FIELD = {flag.field: flag for flag in TOPOLOGY_FLAGS}


def add_topology_flag(parser: argparse.ArgumentParser, field: str, **overrides: Any) -> argparse.Action:
    """Add the flag of ``field`` to ``parser``; ``overrides`` replace argparse settings (``required``,
    ``nargs``, a ``default`` or ``help`` of the command's own)."""
    flag = _BY_FIELD[field]
    settings: dict[str, Any] = {"type": flag.parse, "help": flag.help, "default": flag.default, "metavar": "N", "dest": flag.dest}
    settings.update(overrides)
    if settings.get("required"):
        settings.pop("default")
    return parser.add_argument(flag.flag, **settings)


def add_topology_flags(
    parser: argparse.ArgumentParser, *, required: tuple[str, ...] = ("tp_size",), several: tuple[str, ...] = ()
) -> None:
    """Add the flag of every :class:`Topology` field to ``parser``; the ``required`` ones must be given,
    the ``several`` ones take one or more sizes (repeated or space-separated: ``--tp 2 4``, ``--tp 2 --tp 4``)."""
    for flag in TOPOLOGY_FLAGS:
        overrides: dict[str, Any] = {"required": flag.field in required}
        if flag.field in several:
            overrides.update(nargs="+", default=[flag.default], help=several_help(flag.field))
        add_topology_flag(parser, flag.field, **overrides)


def several_help(field: str, default: list[int] | None = None) -> str:
    """The help of ``field``'s flag where it takes several sizes: the field's docstring, then how."""
    flag = _BY_FIELD[field]
    said = f" (default {' '.join(map(str, default))})" if default else ""
    return f"{flag.help} Several sizes ({flag.flag} 2 4, or the flag repeated) are each taken in turn{said}."


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology the flags give (each already a value argparse accepted; a flag the command lacks
    takes the field's default). Sizes vLLM would refuse together are a :class:`PlanError` (KVP301),
    one problem per refusal, naming the flag."""
    values = {flag.field: getattr(args, flag.dest, flag.default) for flag in TOPOLOGY_FLAGS}
    try:
        return Topology(**values)
    except ValidationError as error:
        raise PlanError(
            [
                PlanProblem(f"{_flag_of(problem['loc'])}: {str(problem['msg']).removeprefix('Value error, ')}")
                for problem in error.errors(include_url=False)
            ]
        ) from None


_TOGETHER = "dcp_size"
"""The field a refusal of the sizes together is reported at: :class:`Topology`'s model validator
judges ``dcp_size`` against the others (such an error has no location of its own)."""


def _flag_of(location: tuple[int | str, ...]) -> str:
    field = str(location[0]) if location else _TOGETHER
    return _BY_FIELD[field].flag if field in _BY_FIELD else "/".join(flag.flag for flag in TOPOLOGY_FLAGS)
