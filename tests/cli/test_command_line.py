"""The command line never silently drops what was typed.

A flag of several values takes them repeated or space-separated alike; a flag of one value refuses a
second; an unknown flag is named with the nearest one and the subcommand's usage; names and paths are
judged before torch or vLLM is imported. These hold for every command and flag the parser has, read
from the parser itself, so a flag added later is covered without a new test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpolicy.app.archetypes import ARCHETYPE_NAMES
from kvpolicy.app.args import StoreOnce
from kvpolicy.app.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
LAYOUT = "kimi-linear-48b-a3b"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What argparse prints when ``argv`` is a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def flag_actions(collect: bool) -> list[tuple[str, str, StoreOnce]]:
    """(command, flag, action) for every flag of every command that stores one value (or several)."""
    return [
        (name, action.option_strings[-1], action)
        for name, command in commands().items()
        for action in command._actions
        if isinstance(action, StoreOnce) and action.option_strings and action.collect is collect
    ]


def a_value(action: argparse.Action) -> str:
    """A value ``action`` accepts, tried from a few of every kind the commands take."""
    for candidate in (*(action.choices or ()), "2", "default", "mla", "KVP201", "1.5", "my-name", "x"):
        try:
            value = action.type(candidate) if callable(action.type) else candidate
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if action.choices is None or value in action.choices:
            return str(candidate)
    raise AssertionError(f"no sample value for {action.option_strings}")


def plugin_layout(directory: Path) -> Path:
    """DeepSeek-V3's example layout with its group's class renamed to a plugin's, ``ConvStateSpec``."""
    text = (REPO / "examples" / "layouts" / "deepseek-v3.yaml").read_text()
    assert "type: MLAAttentionSpec" in text
    layout = directory / "plugin-layout.yaml"
    layout.write_text(text.replace("type: MLAAttentionSpec", "type: ConvStateSpec", 1))
    return layout


# --- flags of several values ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["plan", "explain", "keys"])
def test_planning_commands_take_several_tp_sizes_repeated_or_space_separated_alike(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = (command, "--policy", "default", "--layout", LAYOUT, "--format", "json")
    repeated = run(capsys, *base, "--tp", "2", "--tp", "4")
    spaced = run(capsys, *base, "--tp", "2", "4")
    assert repeated == spaced
    code, out, _ = repeated
    assert code == 0, out
    documents = json.loads(out)
    assert isinstance(documents, list) and len(documents) == 2
    one_each = [json.loads(run(capsys, *base, "--tp", size)[1]) for size in ("2", "4")]
    assert documents == one_each


def test_diff_compares_at_every_tp_size_given_repeated_or_space_separated(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("diff", "default", "no-dedup", "--layout", LAYOUT, "--format", "json")
    repeated = run(capsys, *base, "--tp", "2", "--tp", "4")
    spaced = run(capsys, *base, "--tp", "2", "4")
    assert repeated == spaced
    checked = {result["topology"] for result in json.loads(repeated[1])["plans"]}
    assert checked == {"tp=2 pp=1", "tp=4 pp=1"}


def test_diff_takes_several_layouts_repeated_or_space_separated_alike(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("diff", "default", "no-dedup", "--tp", "2")
    repeated = run(capsys, *base, "--layout", LAYOUT, "--layout", "deepseek-v3")
    spaced = run(capsys, *base, "--layout", LAYOUT, "deepseek-v3")
    assert repeated == spaced
    assert "2 layouts x tp 2" in repeated[1]


def test_diff_without_tp_compares_at_its_default_sizes_and_a_given_tp_replaces_them() -> None:
    parser = build_parser()
    assert parser.parse_args(["diff", "a", "b"]).tp == [1, 2, 4, 8]
    assert parser.parse_args(["diff", "a", "b", "--tp", "16"]).tp == [16]


def test_discover_collects_tp_sizes_repeated_or_space_separated_alike() -> None:
    parser = build_parser()
    repeated = parser.parse_args(["discover", "--archetype", "mla", "--tp", "2", "--tp", "4", "--tp", "8"])
    spaced = parser.parse_args(["discover", "--archetype", "mla", "--tp", "2", "4", "--tp", "8"])
    assert repeated.tp == spaced.tp == [2, 4, 8]


def test_discover_judges_every_tp_size_given_in_either_form(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["discover", "--archetype", "mla", "--tp", "2", "4", "--tp", "128"])
    assert exited.value.code == 2
    assert "--tp 128" in capsys.readouterr().err


def test_validate_collects_every_select_and_ignore_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "two-warnings.yaml"
    policy.write_text(textwrap.dedent("""\
        version: 1
        kind: ReplicationPolicy
        name: two-warnings
        rules:
          - name: plugin
            reason: a plugin's class
            match: {spec: [PluginStateSpec], fields: {plugin_field: 1}}
            replication: sharded
        """))
    both = run(capsys, "validate", str(policy))[1]
    assert "KVP201" in both and "KVP202" in both
    # Comma-separated, not space-separated: a second word after --ignore is the next file to validate.
    for ignored in (("--ignore", "KVP201", "--ignore", "KVP202"), ("--ignore", "KVP201,KVP202")):
        code, out, _ = run(capsys, "validate", str(policy), *ignored)
        assert code == 0 and "KVP20" not in out, ignored


@pytest.mark.parametrize(("command", "flag", "action"), flag_actions(collect=True),
                         ids=lambda value: value if isinstance(value, str) else "")
def test_every_flag_of_several_values_collects_them_repeated_or_space_separated(
    command: str, flag: str, action: StoreOnce
) -> None:
    value = a_value(action)
    namespace = argparse.Namespace(**{action.dest: action.default})
    parser = commands()[command]
    action(parser, namespace, [value, value] if action.nargs in ("+", "*") else value, flag)
    action(parser, namespace, [value] if action.nargs in ("+", "*") else value, flag)
    assert len(getattr(namespace, action.dest)) == (3 if action.nargs in ("+", "*") else 2)


# --- flags of one value --------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "flag", "action"), flag_actions(collect=False),
                         ids=lambda value: value if isinstance(value, str) else "")
def test_every_flag_of_one_value_refuses_a_second(
    command: str, flag: str, action: StoreOnce, capsys: pytest.CaptureFixture[str]
) -> None:
    value = a_value(action)
    err = usage_error(capsys, command, flag, value, flag, value)
    assert f"{flag} given twice" in err
    assert f"usage: kvpolicy {command}" in err


def test_single_value_flags_exist_in_every_planning_command() -> None:
    """The refusal test above covers something: each planning command has one-value flags."""
    covered = {command for command, _, _ in flag_actions(collect=False)}
    assert {"plan", "explain", "keys", "audit", "demo", "vllm-config", "doctor", "discover"} <= covered


def test_audit_refuses_a_second_tp_size_instead_of_keeping_the_last(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "audit", "--policy", "default", "--archetype", "mla", "--tp", "2", "--tp", "4")
    assert "--tp given twice (2, then 4)" in err


# --- unknown flags -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "nearest"),
    [("--tp-size", "--tp"), ("--prompt_tokens", "--prompt-tokens"), ("--polcy", "--policy"), ("--layouts", "--layout")],
)
def test_an_unknown_flag_names_the_nearest_with_the_subcommands_usage(
    typed: str, nearest: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(capsys, "plan", "--policy", "default", "--layout", LAYOUT, "--tp", "2", typed, "3")
    assert f"unknown flag '{typed}'; did you mean '{nearest}'?" in err
    assert "usage: kvpolicy plan" in err
    assert "usage: kvpolicy [-h]" not in err
    assert "unexpected value '3'" not in err  # the unknown flag's own value


def test_a_misspelled_required_flag_is_reported_as_the_misspelling(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "plan", "--policy", "default", "--layout", LAYOUT, "--tp-size", "2")
    assert "unknown flag '--tp-size'; did you mean '--tp'?" in err
    assert "required" not in err


def test_a_value_no_flag_takes_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "audit", "--policy", "default", "--archetype", "mla", "--tp", "2", "4")
    assert "unexpected value '4'" in err
    assert "usage: kvpolicy audit" in err


# --- names and paths judged before torch or vLLM -------------------------------------------------


def run_isolated(*argv: str) -> tuple[int, str, list[str]]:
    """``kvpolicy argv`` in a fresh interpreter: (exit code, stdout + stderr, the heavy modules it imported)."""
    script = textwrap.dedent(f"""\
        import json, sys
        from kvpolicy.app.cli import main
        try:
            code = main({list(argv)!r})
        except SystemExit as exited:
            code = exited.code
        heavy = sorted(name for name in ("torch", "vllm", "mooncake") if name in sys.modules)
        print("\\nRESULT " + json.dumps([code, heavy]))
        """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    text, _, result = done.stdout.rpartition("RESULT ")
    code, heavy = json.loads(result)
    return code, text + done.stderr, heavy


@pytest.mark.parametrize(
    "argv",
    [
        ("audit", "--policy", "default", "--archetype", "kimi-linaer", "--tp", "2"),
        ("discover", "--archetype", "kimi-linaer", "--tp", "2"),
        ("audit", "--policy", "default", "--layout", "no-such-layout.yaml", "--tp", "2"),
        ("audit", "--policy", "no-such-policy", "--archetype", "mla", "--tp", "2"),
        ("discover", "--layout", "no-such-layout.yaml", "--tp", "2"),
        ("audit", "--policy", "default", "--archetype", "mla", "--tp", "2", "--tokens", "0"),
    ],
    ids=["audit-archetype", "discover-archetype", "audit-layout", "audit-policy", "discover-layout", "audit-tokens"],
)
def test_wrong_names_paths_and_values_are_refused_before_torch_or_vllm_is_imported(argv: tuple[str, ...]) -> None:
    code, text, heavy = run_isolated(*argv)
    assert code in (1, 2), text
    assert heavy == [], text
    assert "Traceback" not in text


def test_an_unknown_archetype_names_the_nearest_and_every_archetype(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "audit", "--policy", "default", "--archetype", "kimi-linaer", "--tp", "2")
    assert "did you mean 'kimi-linear'?" in err
    assert all(name in err for name in ARCHETYPE_NAMES)


@pytest.mark.parametrize("command", ["audit", "discover"])
def test_help_lists_every_archetype(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps names at their hyphens
    assert all(name in help_text for name in ARCHETYPE_NAMES)


def test_the_archetype_names_are_the_simulations() -> None:
    """The list the command line checks names against, without importing torch, is the simulation's own."""
    from kvpolicy.sim import archetypes

    assert ARCHETYPE_NAMES == (*archetypes.ARCHETYPES, *archetypes.LAYER_HEADS_ARCHETYPES)


# --- the rest of the command line ----------------------------------------------------------------


def test_version_prints_the_packages_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy import __version__

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpolicy {__version__}"


def test_the_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    ") and line.split()}
    assert set(commands()) <= listed


def test_plan_lists_the_rules_that_decide_no_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "misspelled.yaml"
    policy.write_text(textwrap.dedent("""\
        version: 1
        kind: ReplicationPolicy
        name: misspelled
        rules:
          - name: latent
            reason: a misspelled class decides nothing
            match: {spec: [MLAAttentionSpc]}
            replication: replicated
          - name: everything-else
            reason: the rest
            replication: sharded
        """))
    code, out, _ = run(capsys, "plan", "--policy", str(policy), "--layout", "deepseek-v3", "--tp", "2", "4")
    assert code == 0
    assert [line for line in out.splitlines() if "deciding no layer" in line] == ["rules deciding no layer: latent"] * 2


def test_plan_warns_of_a_class_neither_vllm_nor_the_layout_declares_with_the_layouts_nearest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "misspelled.yaml"
    policy.write_text(textwrap.dedent("""\
        version: 1
        kind: ReplicationPolicy
        name: misspelled
        rules:
          - name: conv
            reason: a plugin's state, misspelled
            match: {spec: [ConvStateSpc]}
            replication: sharded
        """))
    layout = plugin_layout(tmp_path)
    code, _, err = run(capsys, "plan", "--policy", str(policy), "--layout", str(layout), "--tp", "2")
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "'ConvStateSpc'" in warnings[0] and "did you mean 'ConvStateSpec'" in warnings[0]


def test_vllm_config_shows_the_policys_warnings_instead_of_calling_it_simply_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "plugin.yaml"
    policy.write_text(textwrap.dedent("""\
        version: 1
        kind: ReplicationPolicy
        name: plugin
        rules:
          - name: conv
            reason: a plugin's state
            match: {spec: [ConvStateSpc]}
            replication: sharded
        """))
    code, out, err = run(capsys, "vllm-config", "--policy", str(policy))
    assert code == 0 and json.loads(out)["kv_connector"] == "KVPolicyConnector"
    assert "'ConvStateSpc' is not a spec class" in err
    assert "valid, with 1 warning" in err


def test_bootstrap_finds_a_library_in_a_cache_listing_longer_than_a_pipe(tmp_path: Path) -> None:
    """`ldconfig -p | grep -q` under pipefail fails when grep exits at the first match while ldconfig
    still writes (SIGPIPE): bootstrap then re-ran apt on a ready machine."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ldconfig").write_text(
        "#!/usr/bin/env bash\necho '\tlibibverbs.so.1 (libc6,x86-64) => /usr/lib/libibverbs.so.1'\n"
        "for i in $(seq 200000); do echo \"\tlibother$i.so.1 (libc6,x86-64) => /usr/lib/libother$i.so.1\"; done\n"
    )
    (fake / "ldconfig").chmod(0o755)
    script = (REPO / "scripts" / "bootstrap.sh").read_text()
    definition = next(line for line in script.splitlines() if line.startswith("have_library()"))
    check = f"set -euo pipefail\n{definition}\nhave_library 'libibverbs.so.1' && echo found\n"
    done = subprocess.run(["bash", "-c", check], check=False, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert done.stdout.strip() == "found", done.stderr
    missing = subprocess.run(["bash", "-c", check.replace("libibverbs.so.1' &&", "libabsent.so.9' &&")],
                             check=False, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert missing.stdout.strip() == ""


def test_library_log_lines_go_to_the_log_file_and_the_commands_own_words_to_the_terminal(tmp_path: Path) -> None:
    """What vLLM, torch and Mooncake write inside :func:`libraries_logging_to` (file descriptor 2,
    ``sys.stderr``, the ``vllm`` logger configured there) stays out of the command's output."""
    log = tmp_path / "libraries.log"
    script = textwrap.dedent(f"""\
        import logging, os, sys
        from kvpolicy.app.quiet import libraries_logging_to
        with libraries_logging_to({str(log)!r}) as terminal:
            os.write(2, b"native glog line\\n")
            print("torch import warning", file=sys.stderr)
            handler = logging.StreamHandler(sys.stderr)  # as vLLM's ext://sys.stderr stream is made
            logging.getLogger("vllm-like").addHandler(handler)
            logging.getLogger("vllm-like").error("vllm log line")
            print("result line")
            terminal.write("the command's own note\\n")
        print("after", file=sys.stderr)
        """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "result line\n"
    assert done.stderr.splitlines() == [
        "the command's own note", f"(the log lines of vLLM, torch and Mooncake: {log})", "after"]
    assert log.read_text().splitlines() == ["native glog line", "torch import warning", "vllm log line"]


def test_a_flag_of_several_values_takes_a_bounded_number(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy.app.args import MAX_VALUES

    sizes = [str(size) for size in range(1, MAX_VALUES + 2)]
    err = usage_error(capsys, "plan", "--policy", "default", "--layout", LAYOUT, "--tp", *sizes)
    assert f"--tp takes at most {MAX_VALUES} values, got {MAX_VALUES + 1}" in err


def test_validate_suggests_a_class_a_layout_beside_the_policy_declares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "plugin.yaml"
    policy.write_text(textwrap.dedent("""\
        version: 1
        kind: ReplicationPolicy
        name: plugin
        rules:
          - name: conv
            reason: a plugin's state, misspelled
            match: {spec: [ConvStateSpc]}
            replication: sharded
          - name: conv-right
            reason: a plugin's state
            match: {spec: [ConvStateSpec]}
            replication: sharded
        """))
    layout = plugin_layout(tmp_path)
    alone = run(capsys, "validate", str(policy))[1]
    assert alone.count("[KVP201]") == 2  # on its own, neither class is known
    _, out, _ = run(capsys, "validate", str(policy), str(layout))
    warnings = [line for line in out.splitlines() if "[KVP201]" in line]
    assert len(warnings) == 1, out  # the declared class is known; the misspelling is named with it
    assert f"'ConvStateSpc' is not a spec class of vLLM 0.32; did you mean 'ConvStateSpec' (declared by {layout})?" in warnings[0]
