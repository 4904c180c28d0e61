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

from kvpolicy.documents.loader import MAX_DIAGNOSTICS_PER_FILE, check_file, check_text
from kvpolicy.language.diagnostics import MAX_MESSAGE_CHARS, Diagnostic
from kvpolicy.language.yamlsource import MAX_DOCUMENT_BYTES, MAX_NODES

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
    from kvpolicy.documents.loader import load_policy
    from kvpolicy.language.diagnostics import DocumentError

    with pytest.raises(DocumentError) as raised:
        load_policy(name)
    (error,) = raised.value.diagnostics
    assert (error.code, error.line, error.column) == ("KVP001", 1, 1)


def test_the_connector_refuses_a_policy_path_holding_a_nul_with_its_configuration_error() -> None:
    from kvpolicy.vllm.config import KVPolicyConfigError
    from kvpolicy.vllm.connector import resolve_policy

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


# --- YAML tags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "tag"),
    [
        (POLICY_HEAD + "rules: []\ndescription: !!binary ZXhhbXBsZQ==\n", (5, 14), "!!binary on a scalar"),
        (POLICY_HEAD + "rules: []\nspec_fields: !!set {a, b}\n", (5, 14), "!!set on a mapping"),
        (POLICY_HEAD + "rules: []\nspec_fields: !!omap [a: 1]\n", (5, 14), "!!omap on a list"),
        (POLICY_HEAD + "rules: []\nspec_fields: !!python/tuple [a]\n", (5, 14), "!!python/tuple on a list"),
        (POLICY_HEAD + "rules: []\naudit: !custom {mode: warn}\n", (5, 8), "!custom on a mapping"),
        ("%TAG ! tag:example.com,2000:\n---\n" + POLICY_HEAD + "rules: []\naudit: !a {mode: warn}\n", (7, 8),
         "!<tag:example.com,2000:a> on a mapping"),
    ],
    ids=["binary", "set", "omap", "python", "local", "directive"],
)
def test_a_tag_outside_the_core_types_is_refused_where_it_stands(text: str, where: tuple[int, int], tag: str) -> None:
    error = only_error(check_text(text, "p.yaml")[1])
    assert ((error.line, error.column), error.code) == (where, "KVP002")
    assert error.message.startswith(f"YAML tag {tag} is not read")


def test_every_refused_tag_is_reported_at_once() -> None:
    text = POLICY_HEAD + "rules: []\ndescription: !!binary ZXhhbXBsZQ==\naudit: !custom {mode: warn}\n"
    assert [(problem.line, problem.code) for problem in check_text(text, "p.yaml")[1]] == [(5, "KVP002"), (6, "KVP002")]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("version: !!float 1", "version: must be the integer 1, not the number 1.0"),
        ("version: 1.0", "version: must be the integer 1, not the number 1.0"),
        ("version: !!str 1", "version: "),
        ("name: !!int 5", "name: expected a string"),
    ],
)
def test_a_core_tag_gives_the_type_it_declares(line: str, message: str) -> None:
    text = POLICY_HEAD.replace(POLICY_HEAD.splitlines()[0 if line.startswith("version") else 2], line) + "rules: []\n"
    error = only_error(check_text(text, "p.yaml")[1])
    assert error.message.startswith(message) and error.line == (1 if line.startswith("version") else 3)


def test_a_string_tag_on_a_block_size_is_the_same_expression() -> None:
    document, problems = check_text(LAYOUT.replace("block_size: 16", "block_size: !!str 16"), "l.yaml")
    assert document is not None and document.groups[0].spec.block_size.source == "16"


def test_a_float_where_a_match_field_compares_is_refused() -> None:
    rule = "rules:\n  - name: a\n    reason: r\n    match: {fields: {num_kv_heads: 1.0}}\n    replication: sharded\n"
    document, problems = check_text(POLICY_HEAD + rule, "p.yaml")
    assert document is None and problems and all((problem.line, problem.column) == (7, 36) for problem in problems)


# --- literal sizes at validate -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "page_size_bytes: '-1' is -1, not a byte count"),
        ("'1 // 0'", "page_size_bytes: division by zero in '1 // 0'"),
        ("'block_size - 17'", "page_size_bytes: 'block_size - 17' is -1, not a byte count"),
        ("\"'x'\"", "page_size_bytes: ''x'' is 'x', not a byte count"),
    ],
)
def test_a_page_size_that_is_no_byte_count_at_any_topology_is_refused_at_validate(value: str, message: str) -> None:
    line = "      page_size_bytes: "
    error = only_error(check_text(LAYOUT.replace(line + "4096", line + value), "l.yaml")[1])
    inside_quotes = value[0] in "'\""
    assert (error.line, error.column, error.message) == (9, len(line) + 1 + inside_quotes, message)


def test_a_field_expression_failing_at_every_topology_is_refused_at_validate() -> None:
    text = LAYOUT.replace("fields: {num_kv_heads: 1}", "fields: {num_kv_heads: 1, x: {expr: '1 // 0'}}")
    error = only_error(check_text(text, "l.yaml")[1])
    assert (error.line, error.message) == (10, "expr: field 'x': division by zero in '1 // 0'")


# --- bounded memory ------------------------------------------------------------------------------

MEMORY_LIMIT_MIB = 512


def judged_within(text: str, mib: int = MEMORY_LIMIT_MIB, seconds: int = 60) -> list[str]:
    """The diagnostics ``check_text`` gives ``text`` in a process whose address space is ``mib`` MiB."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({mib} << 20, {mib} << 20))
        from kvpolicy.documents.loader import check_text
        document, problems = check_text(sys.stdin.read(), "p.yaml")
        for problem in problems:
            print(problem)
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], input=text, capture_output=True, text=True, timeout=seconds, check=False
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr[-2000:]
    return result.stdout.splitlines()


def test_judging_a_document_fits_in_the_memory_limit_the_tests_below_run_under() -> None:
    assert judged_within(POLICY_HEAD + "rules: []\n") == []


def test_aliases_repeating_a_long_unknown_key_are_refused_before_any_is_judged() -> None:
    # 2,000 uses of a 200 KB key: each of pydantic's errors would copy it (400 MB, or 4 GB at 20,000).
    text = POLICY_HEAD + "x: &a\n  ? " + "k" * 200_000 + "\n  : 1\nrules: [" + ", ".join(["*a"] * 2000) + "]\n"
    (line,) = judged_within(text)
    rules = text[: text.index("rules: [")].count("\n") + 1
    at_the_list = f"p.yaml:{rules}:{len('rules: [')}: error: "  # the list repeating the key
    assert line.startswith(at_the_list + "aliases expand this to more than 1048576 characters") and "KVP003" in line


def test_aliases_within_what_the_file_could_hold_written_out_are_read() -> None:
    text = POLICY_HEAD + "x: &a {k: 1}\nrules: [" + ", ".join(["*a"] * 50) + "]\n"
    lines = judged_within(text)
    assert lines[0].startswith("p.yaml:4:1: error: unknown field 'x'")
    assert "missing required field 'name' [KVP103]" in lines[1]


def test_a_layer_range_behind_a_long_name_is_refused_before_a_name_is_made() -> None:
    layout = LAYOUT.replace('layers: ["l.{0..1}"]', "layers: ['" + "a" * 100_000 + "{0..99999}']")
    (line,) = judged_within(layout)
    assert "the layer names expand to 10000500000 characters" in line and "KVP003" in line


def test_a_layer_pattern_naming_layers_over_the_length_limit_is_refused_once_before_expanding() -> None:
    layout = LAYOUT.replace('layers: ["l.{0..1}"]', "layers: ['" + "a" * 1000 + "{0..9}']")
    error = only_error(check_text(layout, "l.yaml")[1])
    assert error.message.endswith("expands to names of 1001 characters; at most 1000 are allowed")


def test_a_file_of_a_hundred_thousand_errors_is_judged_within_the_limit_and_lists_a_hundred() -> None:
    layout = "version: 1\nkind: ModelLayout\nmodel: m\ntotal_num_kv_heads: 1\ngroups: [" + ", ".join(["{}"] * 90_000) + "]\n"
    lines = judged_within(layout, seconds=120)
    assert len(lines) == MAX_DIAGNOSTICS_PER_FILE + 1
    hidden = int(lines[-1].split(": error: ")[1].split()[0])
    assert hidden >= 90_000 - MAX_DIAGNOSTICS_PER_FILE and lines[-1].endswith("fix these first [KVP901]")


# --- kv_connector_extra_config's trust keys -----------------------------------------------------------

@pytest.mark.parametrize(
    "key",
    ["kvpolicy_secret", "kvpolicy_previous_secret", "kvpolicy_previous_secret_until", "kvpolicy_keyed_namespaces",
     "kvpolicy_verify_objects"],
)
def test_a_trust_setting_holding_a_huge_value_is_refused_in_one_bounded_line(key: str) -> None:
    from kvpolicy.documents.settings import KVPolicySettings, SettingsError

    huge = "x" * 1_000_000
    with pytest.raises(SettingsError) as raised:
        KVPolicySettings.parse({"kvpolicy_secret": "env:S", "kvpolicy_previous_secret": "env:OLD", key: huge})
    (line,) = raised.value.problems
    assert line.startswith(f"kv_connector_extra_config.{key}: error: ")
    assert len(line) <= MAX_MESSAGE_CHARS + 200
