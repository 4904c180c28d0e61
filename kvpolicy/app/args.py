"""The command line's parser: argparse with the rules every ``kvpolicy`` command keeps, so that no
command silently drops what was typed.

- A flag that takes several values accumulates them whether they are repeated or space-separated
  (``--tp 2 --tp 4`` and ``--tp 2 4`` are the same), and the first one given replaces the default.
- A flag that takes one value refuses a second (``--tp 2 --tp 4`` on a command that plans one TP size),
  instead of argparse's "the last one wins".
- An unknown flag is refused with the subcommand's usage and the nearest flag it has
  (``--tp-size`` → ``--tp``), not the top-level usage.

The rules live in the actions argparse registers for ``store`` and ``append``, so they reach flags
added to argument groups and mutually exclusive groups too, and a flag added later gets them without
saying so.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["MAX_VALUES", "CommandParser", "StoreOnce", "nearest_flag", "unrecognized"]

_GIVEN = "_kvpolicy_flags_given"
"""The namespace attribute holding the destinations a flag has already stored into."""

_LISTS = ("+", "*")

MAX_VALUES = 64
"""Values a flag of several values takes in one command (what each computes, and prints, grows with them)."""


class StoreOnce(argparse.Action):
    """``store`` and ``append`` for a ``kvpolicy`` command: a flag of one value may be given once; a
    flag of several values (``nargs`` ``+``/``*``, or ``append``) collects every value given, its first
    use replacing the default."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, collect: bool = False, **settings: Any) -> None:
        self.collect = collect or settings.get("nargs") in _LISTS
        super().__init__(option_strings, dest, **settings)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        if not self.option_strings:  # a positional: argparse matches it once
            setattr(namespace, self.dest, values)
            return
        given: set[str] = namespace.__dict__.setdefault(_GIVEN, set())
        if self.collect:
            new = list(values) if isinstance(values, list) else [values]
            collected = [*getattr(namespace, self.dest), *new] if self.dest in given else new
            if len(collected) > MAX_VALUES:
                parser.error(f"{option_string} takes at most {MAX_VALUES} values, got {len(collected)}")
            setattr(namespace, self.dest, collected)
        elif self.dest in given:
            before = getattr(namespace, self.dest)
            parser.error(
                f"{option_string} given twice ({_shown(before)}, then {_shown(values)}): this command takes one; "
                f"give it once"
            )
        else:
            setattr(namespace, self.dest, values)
        given.add(self.dest)


class _Append(StoreOnce):
    """``action="append"``: one value a use, every use collected."""

    def __init__(self, option_strings: Sequence[str], dest: str, **settings: Any) -> None:
        super().__init__(option_strings, dest, collect=True, **settings)


def _shown(value: Any) -> str:
    text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


class CommandParser(argparse.ArgumentParser):
    """The parser of ``kvpolicy`` and each of its commands (subparsers are made of the same class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)
        self.register("action", "append", _Append)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._typed = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_GIVEN, None)
        return parsed, extras

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """argparse's usage error; an unknown flag is named first, whatever else went wrong (a
        misspelled required flag is reported as the misspelling, not as the flag missing)."""
        unknown = [typed for typed in getattr(self, "_typed", ()) if self._is_unknown_flag(typed)]
        if unknown and not message.startswith("unknown flag"):
            message = unrecognized(self, unknown)
        super().error(message)

    def _is_unknown_flag(self, typed: str) -> bool:
        if not typed.startswith("--") or typed == "--":
            return False
        name = typed.split("=", 1)[0]
        flags = flags_of(self)
        return name not in flags and not (self.allow_abbrev and any(flag.startswith(name) for flag in flags))

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self.command_parser(parsed) or self
            parser.error(unrecognized(parser, extras))
        return parsed

    def command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        """The subcommand's parser that ``parsed`` went through, if this parser has subcommands."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = getattr(parsed, action.dest, None)
                found = action.choices.get(chosen) if isinstance(chosen, str) else None
                return found if isinstance(found, argparse.ArgumentParser) else None
        return None


def flags_of(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """Every long and short flag ``parser`` takes, in the order added."""
    return tuple(option for action in parser._actions for option in action.option_strings)


def nearest_flag(parser: argparse.ArgumentParser, typed: str) -> str | None:
    """The flag of ``parser`` closest to ``typed`` (``--tp-size`` → ``--tp``, ``--prompt_tokens`` →
    ``--prompt-tokens``), or None when none is close."""
    name = typed.split("=", 1)[0]
    flags = [flag for flag in flags_of(parser) if flag.startswith("--")]
    spelled = "--" + name.lstrip("-").replace("_", "-").lower()
    if spelled in flags:
        return spelled
    for suffix in ("-size", "-sizes", "s"):
        if spelled.endswith(suffix) and spelled.removesuffix(suffix) in flags:
            return spelled.removesuffix(suffix)
    close = difflib.get_close_matches(spelled, flags, n=1, cutoff=0.6)
    return close[0] if close else None


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The usage error for arguments ``parser`` does not take, with the nearest flag for each unknown
    one and a word on a value no flag takes."""
    parts = []
    after_unknown_flag = False
    for extra in extras:
        shown = ascii(extra)[1:-1] if len(extra) <= 60 else f"{ascii(extra[:60])[1:-1]}..."
        if extra.startswith("-") and len(extra) > 1 and not _is_number(extra):
            close = nearest_flag(parser, extra)
            parts.append(f"unknown flag '{shown}'" + (f"; did you mean '{close}'?" if close else ""))
            after_unknown_flag = "=" not in extra
        elif not after_unknown_flag:  # a value right after an unknown flag is that flag's
            parts.append(f"unexpected value '{shown}' (no flag or argument of this command takes it here)")
        else:
            after_unknown_flag = False
    more = f" (and {len(parts) - 5} more)" if len(parts) > 5 else ""
    return "; ".join(parts[:5]) + more


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

