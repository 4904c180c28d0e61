"""Inputs nobody should write, answered like any other bad input: one located error per problem,
bounded in time, memory and output, never a traceback, and nothing loaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpolicy.diagnostics import MAX_MESSAGE_CHARS, Diagnostic
from kvpolicy.loader import MAX_DIAGNOSTICS_PER_FILE, check_file, check_text
from kvpolicy.yamlsource import MAX_DOCUMENT_BYTES, MAX_NODES

POLICY_HEAD = "version: 1\nkind: ReplicationPolicy\nname: example\n"
LAYOUT = """\
version: 1
kind: ModelLayout
model: org/m
total_num_kv_heads: 2
groups:
  - spec:
      type: FullAttentionSpec
      block_size: 16
      page_size_bytes: 4096
      fields: {num_kv_heads: 1}
    layers: ["l.{0..1}"]
"""


@contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def only_error(problems: list[Diagnostic]) -> Diagnostic:
    errors = [problem for problem in problems if problem.severity == "error"]
    assert len(errors) == 1, errors
    return errors[0]


# --- what a path names ---------------------------------------------------------------------------


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_a_device_is_refused_before_it_is_read(path: str, kind: str) -> None:
    with within(5):
        document, problems = check_file(path)
    assert document is None and only_error(problems).message == f"cannot read file: it is {kind}; give a YAML file"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    with within(5):
        document, problems = check_file(fifo)
    assert document is None and "it is a FIFO" in only_error(problems).message


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert "it is a directory" in only_error(check_file(tmp_path)[1]).message


def test_a_file_over_the_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as stream:
        stream.truncate(50 * MAX_DOCUMENT_BYTES)  # sparse: nothing to read but zeros
    assert f"larger than {MAX_DOCUMENT_BYTES} bytes" in only_error(check_file(huge)[1]).message


def test_a_symlink_to_a_policy_is_read(tmp_path: Path) -> None:
    target = tmp_path / "real.yaml"
    target.write_text(POLICY_HEAD + "rules: []\n")
    (tmp_path / "link.yaml").symlink_to(target)
    assert check_file(tmp_path / "link.yaml")[0] is not None


def test_bytes_that_are_not_utf8_are_located(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"version: 1\nkind: \xe9\n")
    error = only_error(check_file(path)[1])
    assert (error.line, error.column) == (2, 7) and "not UTF-8" in error.message


# --- what a file holds ---------------------------------------------------------------------------


def test_a_control_character_is_located() -> None:
    error = only_error(check_text(POLICY_HEAD + 'description: "a\x01b"\nrules: []\n', "p.yaml")[1])
    assert (error.line, error.column) == (4, 16) and "control character U+0001" in error.message


def test_a_message_quoting_a_huge_value_is_cut() -> None:
    problems = check_text(f"version: 1\nkind: {'K' * 1_000_000}\nname: x\n", "p.yaml")[1]
    assert problems and all(len(problem.message) <= MAX_MESSAGE_CHARS + 40 for problem in problems)


def test_at_most_the_cap_of_problems_is_listed_and_the_rest_counted() -> None:
    rules = "".join(f"  - name: Bad{index}\n    reason: ''\n" for index in range(400))
    problems = check_text(POLICY_HEAD + "rules:\n" + rules, "p.yaml")[1]
    assert len(problems) == MAX_DIAGNOSTICS_PER_FILE + 1
    assert problems[-1].message.endswith("more problems in this file not shown; fix these first")


def test_mapping_keys_count_towards_the_node_limit() -> None:
    keys = "".join(f"k{index}: 0\n" for index in range(MAX_NODES // 2 + 10))  # keys and values: over the limit
    error = only_error(check_text(POLICY_HEAD + "rules: []\nspec_fields:\n" + textwrap.indent(keys, "  "), "p.yaml")[1])
    assert f"more than {MAX_NODES} nodes" in error.message


@pytest.mark.parametrize(
    "line, message",
    [
        ("version: true", "version: must be the integer 1, not true"),
        ("version: '1'", "version: "),
    ],
)
def test_a_version_that_only_looks_like_1_is_refused(line: str, message: str) -> None:
    text = POLICY_HEAD.replace("version: 1", line) + "rules: []\n"
    assert only_error(check_text(text, "p.yaml")[1]).message.startswith(message)


def test_a_quoted_boolean_is_not_a_boolean() -> None:
    error = only_error(check_text(POLICY_HEAD + "strict: 'on'\nrules: []\n", "p.yaml")[1])
    assert error.message == "strict: expected true or false (not quoted)"


def test_a_block_size_below_one_is_refused_where_it_stands() -> None:
    error = only_error(check_text(LAYOUT.replace("block_size: 16", "block_size: '16 - 16'"), "l.yaml")[1])
    assert (error.line, error.message) == (8, "block_size: must be a positive number of tokens, got '16 - 16' = 0")


def test_a_block_size_reads_only_the_topology() -> None:
    error = only_error(check_text(LAYOUT.replace("block_size: 16", "block_size: 'page_size_bytes // 2'"), "l.yaml")[1])
    assert error.line == 8 and "unknown variable 'page_size_bytes'" in error.message


@pytest.mark.parametrize("name", ["total_num_kv_heads", "tp_size", "block_size", "page_size_bytes"])
def test_a_spec_field_may_not_shadow_a_variable_expressions_read(name: str) -> None:
    text = LAYOUT.replace("fields: {num_kv_heads: 1}", f"fields: {{num_kv_heads: 1, {name}: 8}}")
    assert f"spec field '{name}' would shadow" in only_error(check_text(text, "l.yaml")[1]).message


def test_a_number_where_layer_names_belong_is_an_error_not_a_traceback() -> None:
    error = only_error(check_text(LAYOUT.replace('layers: ["l.{0..1}"]', "layers: 1"), "l.yaml")[1])
    assert error.message == "layers: expected a list"


def test_a_missing_kind_still_reports_every_other_problem() -> None:
    text = "version: 1\nname: x\nrules:\n  - name: r\n    match: {spec: AttentionSpec}\n    replicaton: sharded\n"
    messages = [problem.message for problem in check_text(text, "p.yaml")[1]]
    assert messages[0] == "missing 'kind'; add 'kind: ReplicationPolicy'"
    assert "missing required field 'reason'" in messages
    assert "unknown field 'replicaton'; did you mean 'replication'?" in messages


# --- the command line ----------------------------------------------------------------------------


def run_cli(*argv: str, stdin: str | None = None, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys\n{prelude}\nfrom kvpolicy.app.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, input=stdin, check=False
    )


def test_a_closed_pipe_ends_the_command_without_a_traceback() -> None:
    command = f"{sys.executable} -m kvpolicy.app.cli explain --policy default --layout nemotron-h-8b --tp 2 | head -c 10"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout and "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr


def test_audit_without_vllm_is_one_line_naming_what_to_install() -> None:
    # vLLM is installed here; a None entry in sys.modules makes importing it fail as if it were not.
    result = run_cli("audit", "--policy", "default", "--archetype", "mla", "--tp", "2", prelude="sys.modules['vllm'] = None")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stdout.count("\n") == 1 and result.stdout.startswith("error: audit needs vllm")


def test_a_tp_size_of_zero_is_a_usage_error_naming_the_flag() -> None:
    result = run_cli("plan", "--policy", "default", "--layout", "llama-3.1-70b", "--tp", "0")
    last = result.stderr.splitlines()[-1]
    assert (result.returncode, result.stdout, last) == (
        2, "", "kvpolicy plan: error: argument --tp: expected a size between 1 and 4096, got 0"
    )


@pytest.mark.parametrize("character", ["\x1e", "\x85", "\u2028", "\x0b", "\x0c", "\t", "\r\n"])
def test_a_quoted_line_separator_keeps_every_diagnostic_on_one_line(character: str) -> None:
    escaped = character.encode("unicode_escape").decode()
    text = f'version: 1\nkind: "a{escaped}b"\nname: x\nrules: []\n'
    problems = check_text(text, "p.yaml")[1]
    assert problems and all(len(str(problem).splitlines()) == 1 for problem in problems)


@pytest.mark.parametrize(
    ("value", "what"),
    [("0x" + "f" * 4000, "an integer literal of 4002 characters is too long"),
     ("9" * 5000, "an integer literal of 5000 characters is too long"),
     ("1:" * 200 + "0.5", "a number literal of 403 characters is too long"),
     ("99999999999999999999", "an integer of 67 bits is too large"), ("-0x8000000000000001", "an integer of 64 bits")],
)
def test_a_number_beyond_what_is_read_is_refused_where_it_stands(value: str, what: str) -> None:
    text = f"version: 1\nkind: ReplicationPolicy\nname: x\nrules: []\naudit: {{steps: {value}}}\n"
    error = only_error(check_text(text, "p.yaml")[1])
    assert (error.line, error.column, error.code, error.message.startswith(what)) == (5, 16, "KVP003", True)


def test_the_largest_63_bit_integer_is_read_and_judged_by_the_model() -> None:
    text = f"version: 1\nkind: ReplicationPolicy\nname: x\nrules: []\naudit: {{steps: {2**63 - 1}}}\n"
    assert only_error(check_text(text, "p.yaml")[1]).message == "steps: input should be less than or equal to 10000"


# --- odd paths -----------------------------------------------------------------------------------

INVALID_POLICY = POLICY_HEAD + "rules: []\nbogus: 1\n"


@pytest.mark.parametrize("name", ["de\x00fault", "policies/x\x00.yaml", "/tmp/x\x00.yaml"])
def test_a_policy_name_or_path_holding_a_nul_is_one_located_error(name: str) -> None:
    from kvpolicy.diagnostics import DocumentError
    from kvpolicy.loader import load_policy

    with pytest.raises(DocumentError) as raised:
        load_policy(name)
    (error,) = raised.value.diagnostics
    assert (error.code, error.line, error.column) == ("KVP001", 1, 1)


def test_the_connector_refuses_a_policy_path_holding_a_nul_with_its_configuration_error() -> None:
    from kvpolicy.vllm.connector import KVPolicyConfigError, resolve_policy

    with pytest.raises(KVPolicyConfigError, match="the path contains a NUL character"):
        resolve_policy({"kvpolicy": "/tmp/policy\x00.yaml"})


@pytest.mark.parametrize("name", ["a\nb.yaml", "a\rb.yaml", "a\x1eb.yaml"])
def test_a_file_name_with_a_line_separator_keeps_each_problem_on_one_line(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(INVALID_POLICY)
    result = run_cli("validate", str(path))
    (line,) = result.stdout.splitlines()
    assert result.returncode == 1 and line.endswith("unknown field 'bogus'; allowed: audit, combine, description, key, "
                                                    "kind, load, name, rules, schedule, spec_fields, strict, unmatched, "
                                                    "version [KVP102]")
    assert line.startswith(str(tmp_path / name.encode("unicode_escape").decode()) + ":5:1: error: ")


@pytest.mark.parametrize("output", ["text", "github"])
def test_a_file_name_undecodable_as_utf8_prints_under_a_strict_utf8_stdout(output: str, tmp_path: Path) -> None:
    path = os.fsencode(tmp_path) + b"/policy-\xff.yaml"
    Path(os.fsdecode(path)).write_text(INVALID_POLICY)
    code = "import sys\nfrom kvpolicy.app.cli import main\nsys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "validate", "--format", output, path], capture_output=True, timeout=120,
        check=False, env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"},
    )
    assert (result.returncode, result.stderr) == (1, b"")
    assert b"policy-\\udcff.yaml" in result.stdout and b"KVP102" in result.stdout


def test_schema_write_into_a_file_says_so_with_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run_cli("schema", "--write", "--dir", str(tmp_path / "file"))
    assert (result.returncode, result.stdout) == (
        1, f"error: cannot write the schemas into '{tmp_path / 'file'}': it is not a directory\n"
    )


def test_schema_write_below_a_file_says_why_with_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = run_cli("schema", "--write", "--dir", str(tmp_path / "file" / "schemas"))
    assert (result.returncode, result.stdout) == (
        1, f"error: cannot write the schemas into '{tmp_path / 'file' / 'schemas'}': not a directory\n"
    )


def test_schema_write_into_a_path_holding_a_nul_is_a_sentence(tmp_path: Path) -> None:
    result = run_cli("schema", "--write", "--dir", "", prelude="sys.argv[-1] = 'schemas\\x00'")
    assert (result.returncode, result.stdout) == (
        1, "error: cannot write the schemas into 'schemas\\x00': the path contains a NUL character\n"
    )
