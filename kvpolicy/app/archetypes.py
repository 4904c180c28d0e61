"""The simulation's archetype names, known to the command line without importing torch or vLLM (the
simulation, :mod:`kvpolicy.sim`, imports both): an unknown or misspelled ``--archetype`` is refused
at once, with the nearest name, and ``--help`` lists them. A contract test holds this list equal to
:data:`kvpolicy.sim.archetypes.ARCHETYPES` and :data:`~kvpolicy.sim.archetypes.LAYER_HEADS_ARCHETYPES`."""

from __future__ import annotations

import argparse
import difflib

__all__ = ["ARCHETYPE_NAMES", "archetype_name", "archetypes_help"]

ARCHETYPE_NAMES: tuple[str, ...] = (
    "gqa-kv-lt-tp",
    "gqa-8kv",
    "mla",
    "kimi-linear",
    "gqa-gdn",
    "gqa-mamba",
    "mamba2",
    "sliding-window-full",
    "uniform-mla-full",
    "nas-like",
    "gemma4-like",
)
"""Every built-in archetype, in the simulation's order."""


def archetype_name(text: str) -> str:
    """``text`` if it names an archetype; an argparse type, so a wrong name is a usage error."""
    if text in ARCHETYPE_NAMES:
        return text
    close = difflib.get_close_matches(text, ARCHETYPE_NAMES, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    shown = ascii(text[:60])[1:-1] + ("..." if len(text) > 60 else "")
    raise argparse.ArgumentTypeError(f"unknown archetype '{shown}'{hint} (known: {', '.join(ARCHETYPE_NAMES)})")


def archetypes_help(what: str) -> str:
    """The ``--archetype`` flag's help: ``what`` it does, and every name."""
    return f"{what}: {', '.join(ARCHETYPE_NAMES)}"
