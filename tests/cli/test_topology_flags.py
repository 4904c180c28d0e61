"""The command line's topology flags come from the ``Topology`` model: a flag per field, its help the
field's docstring, its bounds the field's, refused as a usage error that states them."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from pydantic import Field

from kvpolicy.app.cli import build_parser, main
from kvpolicy.app.topology_flags import flags_of, topology_from_args
from kvpolicy.language.models import Topology

PLAN = ["--policy", "default", "--layout", "deepseek-v3"]
WITH_EVERY_FIELD = ("plan", "explain", "keys")
FIELDS = tuple(Topology.model_fields)


def subcommand(name: str) -> argparse.ArgumentParser:
    (commands,) = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return commands.choices[name]


def topology_actions(name: str) -> dict[str, argparse.Action]:
    """Option string → action of every option of command ``name`` that sets a topology field."""
    return {
        option: action
        for action in subcommand(name)._actions
        for option in action.option_strings
        if f"{action.dest}_size" in FIELDS
    }


def bound(field: str, name: str) -> int:
    """The field's ``ge`` or ``le`` as the model states it."""
    (value,) = [getattr(constraint, name) for constraint in Topology.model_fields[field].metadata if hasattr(constraint, name)]
    return value


@pytest.mark.parametrize("command", WITH_EVERY_FIELD)
def test_every_topology_field_has_a_flag_that_sets_it(command: str) -> None:
    # Values valid together (dcp over the pcp axis) and distinct from every default.
    wanted = Topology(tp_size=4, pp_size=3, pcp_size=2, dcp_size=2)
    assert all(getattr(wanted, field) != Topology.model_fields[field].default for field in FIELDS)
    flags = [part for field in FIELDS for part in (f"--{field.removesuffix('_size')}", str(getattr(wanted, field)))]
    args = build_parser().parse_args([command, *PLAN, *flags])
    assert args.tp == [wanted.tp_size]  # these commands take several TP sizes, each planned in turn
    args.tp = args.tp[0]
    assert topology_from_args(args) == wanted
    assert len(topology_actions(command)) == len(FIELDS)


@pytest.mark.parametrize("command", [*WITH_EVERY_FIELD, "diff", "audit"])
def test_a_topology_flags_help_is_its_fields_docstring(command: str) -> None:
    actions = topology_actions(command)
    assert actions
    for action in actions.values():
        description = Topology.model_fields[f"{action.dest}_size"].description
        assert action.help == description or action.help.startswith(f"{description} Several sizes"), action.help


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("side", ["ge", "le"])
def test_an_out_of_bounds_size_is_a_usage_error_stating_the_models_bounds(
    field: str, side: str, capsys: pytest.CaptureFixture[str]
) -> None:
    low, high = bound(field, "ge"), bound(field, "le")
    value = low - 1 if side == "ge" else high + 1
    flag = f"--{field.removesuffix('_size')}"
    argv = ["plan", *PLAN, "--tp", "1", flag, str(value)] if field != "tp_size" else ["plan", *PLAN, flag, str(value)]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert f"error: argument {flag}: expected a size between {low} and {high}, got {value}" in capsys.readouterr().err


def test_an_out_of_bounds_size_exits_without_a_traceback() -> None:
    value = bound("tp_size", "le") + 1
    result = subprocess.run(
        [sys.executable, "-m", "kvpolicy.app.cli", "plan", *PLAN, "--tp", str(value)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"kvpolicy plan: error: argument --tp: expected a size between 1 and {value - 1}, got {value}"
    )


def test_a_field_added_to_the_model_gets_its_flag_help_and_bounds() -> None:
    class Wider(Topology):
        ep_size: int = Field(default=1, ge=1, le=64, strict=True)
        """Expert-parallel size."""

    (added,) = [flag for flag in flags_of(Wider) if flag.field not in FIELDS]
    assert (added.flag, added.help, added.default, added.low, added.high) == ("--ep", "Expert-parallel size.", 1, 1, 64)
    parser = argparse.ArgumentParser()
    for flag in flags_of(Wider):
        parser.add_argument(flag.flag, type=flag.parse, dest=flag.dest)
    assert parser.parse_args(["--ep", "64"]).ep == 64
    with pytest.raises(argparse.ArgumentTypeError, match="between 1 and 64, got 65"):
        added.parse("65")
