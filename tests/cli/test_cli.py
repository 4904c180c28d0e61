"""The `kvpolicy` command's contract: exit codes, located errors, JSON shapes."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from kvpolicy.app.cli import main

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = sorted((REPO / "examples" / "layouts").glob("*.yaml"))
POLICIES = sorted((REPO / "policies").glob("*.yaml"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_validate_accepts_every_shipped_policy_and_example_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(POLICIES) >= 3 and len(LAYOUTS) >= 6
    code, out, _ = run(capsys, "validate", *map(str, POLICIES), *map(str, LAYOUTS))
    assert code == 0, out
    assert "error" not in out


def test_validate_reports_every_error_with_its_location_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        textwrap.dedent(
            """\
            version: 1
            kind: ReplicationPolicy
            name: bad
            rules:
              - name: first
                reason: typo in a field name
                replicaton: sharded
              - name: second
                reason: typo in a variable
                factor: "tp_sise // 2"
            """
        )
    )
    code, out, _ = run(capsys, "validate", str(bad))
    assert code == 1
    lines = out.strip().splitlines()
    assert f"{bad}:7:5: error: unknown field 'replicaton'; did you mean 'replication'? [KVP102]" in lines
    assert f"{bad}:10:14: error: factor: unknown variable 'tp_sise'; did you mean 'tp_size'? [KVP105]" in lines


def test_validate_json_lists_diagnostics_per_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nkind: ModelLayuot\n")
    code, out, _ = run(capsys, "validate", "--format", "json", str(bad), str(POLICIES[0]))
    payload = json.loads(out)
    assert code == 1 and payload["valid"] is False
    first, second = payload["files"]
    assert first["valid"] is False and second["valid"] is True
    assert first["diagnostics"][0]["line"] == 2
    assert "did you mean 'ModelLayout'" in first["diagnostics"][0]["message"]


def test_validate_unreadable_path_is_a_located_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "/nonexistent/policy.yaml")
    assert code == 1
    assert out.startswith("/nonexistent/policy.yaml:1:1: error: cannot read file")


def test_validate_an_empty_path_says_the_path_is_empty(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "")
    assert code == 1
    assert out.splitlines()[0] == (
        "<empty path>:1:1: error: the path is empty; give a policy, layout or discovery report file [KVP001]"
    )


def test_plan_with_an_unknown_layout_name_names_it_as_typed_and_suggests_the_shipped_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "default", "--layout", "deepseek-v2", "--tp", "2")
    assert code == 1
    assert out.startswith(
        "deepseek-v2:1:1: error: no layout file or shipped example layout named 'deepseek-v2'; did you mean 'deepseek-v3'?"
    )


def test_schema_check_passes_on_the_committed_schemas(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schema", "--check")
    assert code == 0, out


def test_schema_check_fails_on_a_stale_schema_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "schema", "--write", "--dir", str(tmp_path))
    schema_file = tmp_path / "policy.schema.json"
    schema_file.write_text(schema_file.read_text().replace("Ordered rules", "Stale rules"))
    code, out, _ = run(capsys, "schema", "--check", "--dir", str(tmp_path))
    assert code == 1
    assert "policy.schema.json:1:1: error: schema is stale" in out


def test_shipped_yaml_files_name_their_schema_for_editors() -> None:
    for path in POLICIES + LAYOUTS:
        first = path.read_text().splitlines()[0]
        kind = "policy" if path in POLICIES else "layout"
        assert first.startswith("# yaml-language-server: $schema=") and first.endswith(f"{kind}.schema.json"), path


def test_plan_json_has_the_documented_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "vllm-compat", "--layout", "kimi-linear-48b-a3b", "--tp", "4", "--format", "json")
    assert code == 0
    payload = json.loads(out)
    assert isinstance(payload["fingerprint"], str)
    # Kimi-Linear: three KDA (MambaSpec) groups, then MLA.
    assert [group["factor"] for group in payload["groups"]] == [1, 1, 1, 4]
    assert [group["shards"] for group in payload["groups"]] == [4, 4, 4, 1]
    mla = payload["groups"][3]
    assert mla["index"] == 3 and mla["rule"] == "mla-latent"
    assert mla["lookup_namespaces"] == ["Kimi-Linear-48B-A3B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@group:3"]


def test_plan_text_shows_a_row_per_group_and_the_dedup_saving(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "default", "--layout", "deepseek-v3", "--tp", "8")
    assert code == 0
    assert "mla-latent" in out and "1 of 8, striped" in out
    assert "8.00x less than no dedup" in out


def test_explain_says_why_earlier_rules_did_not_match(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "--policy", "default", "--layout", "llama-3.1-70b", "--tp", "8")
    assert code == 0
    assert "mla-latent: skipped, FullAttentionSpec is not any of MLAAttentionSpec, SlidingWindowMLASpec" in out
    assert "= rule kv-heads" in out


def test_plan_with_unknown_policy_name_suggests_the_shipped_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "defualt", "--layout", "deepseek-v3", "--tp", "2")
    assert code == 1
    assert "did you mean 'default'?" in out


def always_three(directory: Path) -> Path:
    """A policy whose one rule gives factor 3, which divides no TP size these tests use."""
    policy = directory / "three.yaml"
    policy.write_text(
        "version: 1\nkind: ReplicationPolicy\nname: three\nrules:\n"
        "  - name: always-three\n    reason: wrong on purpose\n    factor: 3\n"
    )
    return policy


def test_plan_refusal_is_an_error_line_naming_group_and_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = always_three(tmp_path)
    code, out, _ = run(capsys, "plan", "--policy", str(policy), "--layout", "deepseek-v3", "--tp", "4")
    assert code == 1 and out.count("\n") == 1
    # Located at the expression (line 7, after "    factor: "), every layer alike said once.
    assert out.startswith(f"{policy}:7:13: error: group 0 (mla), layers model.layers.0.self_attn.attn (+60 alike): ")
    assert "rule 'always-three'" in out and "not a divisor of tp_size 4" in out and out.endswith("[KVP301]\n")


def test_plan_reports_every_failing_group_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = always_three(tmp_path)
    code, out, _ = run(capsys, "plan", "--policy", str(policy), "--layout", "kimi-linear-48b-a3b", "--tp", "4")
    assert code == 1 and [line.split(", layer")[0].split("error: ")[1] for line in out.splitlines()] == [
        "group 0 (kda-0)", "group 1 (kda-1)", "group 2 (kda-2)", "group 3 (mla)"
    ]


def test_vllm_config_prints_the_line_to_paste(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "vllm-config", "--policy", "default", "--role", "kv_producer")
    assert code == 0
    assert json.loads(out) == {
        "kv_connector": "KVPolicyConnector",
        "kv_connector_module_path": "kvpolicy.vllm",
        "kv_role": "kv_producer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvpolicy": "default"},
    }


def test_vllm_config_refuses_an_invalid_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 2\nkind: ReplicationPolicy\nname: p\nrules: []\n")
    code, out, _ = run(capsys, "vllm-config", "--policy", str(policy))
    assert code == 1
    assert f"{policy}:1:10: error: version" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "4", "--pcp", "2", "--dcp", "4"], "error: --dcp: with pcp_size 2, vLLM allows dcp_size 1, 2"),
        (["--tp", "4", "--dcp", "3"], "error: --dcp: dcp_size 3 must divide tp_size 4"),
    ],
)
def test_a_topology_vllm_refuses_is_one_plan_refusal_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "default", "--layout", "deepseek-v3", *flags)
    assert (code, out.startswith(message), out.endswith(" [KVP301]\n"), out.count("\n")) == (1, True, True, 1)


@pytest.mark.parametrize(
    "argv",
    [
        [command, "--policy", "default", "--layout", "deepseek-v3", "--tp", "2", flag, "0"]
        for command in ("plan", "explain")
        for flag in ("--tp", "--pp", "--pcp", "--dcp")
    ]
    + [["audit", "--policy", "default", "--layout", "deepseek-v3", "--tp", "0"], ["demo", "--tp", "0"]],
)
def test_a_size_flag_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    flag = argv[-2]
    assert exited.value.code == 2
    assert f"argument {flag}: expected a size between 1 and 4096, got 0" in capsys.readouterr().err


def test_plan_under_dcp_writes_mla_once_per_dcp_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "default", "--layout", "deepseek-v3", "--tp", "8", "--dcp", "2",
                       "--format", "json")
    (group,) = json.loads(out)["groups"]
    assert code == 0 and (group["factor"], group["shards"]) == (4, 2)
    assert sorted({tuple(group["replica_sets"][rank["replica_set"]]) for rank in group["ranks"]}) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert all(rank["tp_rank"] in group["replica_sets"][rank["replica_set"]] for rank in group["ranks"])


def test_plan_json_grows_linearly_with_tp_for_a_group_replicated_over_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = {}
    for tp in (1024, 2048):
        code, out, _ = run(capsys, "plan", "--policy", "default", "--layout", "deepseek-v3", "--tp", str(tp), "--format", "json")
        assert code == 0
        (group,) = json.loads(out)["groups"]
        assert group["replica_sets"] == [list(range(tp))] and {rank["replica_set"] for rank in group["ranks"]} == {0}
        sizes[tp] = len(out)
    assert sizes[2048] < 2.2 * sizes[1024]  # tp² would be 4x


def test_plan_with_store_tp_shows_each_ranks_store_shards(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "vllm-compat", "--layout", "llama-3.1-70b", "--tp", "2",
                       "--store-tp", "8", "--kv-cache-layout", "LBHNC", "--format", "json")
    payload = json.loads(out)
    (group,) = payload["groups"]
    assert code == 0 and payload["store"]["sharding"] == {"store_tp_size": 8, "format": "tp_shared_lbhnc"}
    assert [rank["store_shards"] for rank in group["ranks"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(group["lookup_namespaces"]) == 8


def test_plan_with_store_tp_lcm_takes_the_lcm_of_the_prefill_tp_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "default", "--layout", "llama-3.1-70b", "--tp", "2",
                       "--store-tp-lcm", "2,4", "--kv-cache-layout", "LBNHC", "--format", "json")
    assert code == 0 and json.loads(out)["store"]["sharding"] == {"store_tp_size": 4, "format": "tp_shared_lbnhc"}


def test_plan_says_why_vllm_would_not_shard_the_store(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--policy", "default", "--layout", "deepseek-v3", "--tp", "4", "--store-tp", "8")
    assert code == 0
    assert "store namespace: @store_pp:1@store_format:rank_local_tp4_layout_LBNHC" in out
    assert "because its group is MLAAttentionSpec, and vLLM shards only FullAttentionSpec" in out


def test_store_tp_and_store_tp_lcm_together_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--policy", "default", "--layout", "llama-3.1-70b", "--tp", "2", "--store-tp", "4",
              "--store-tp-lcm", "2"])
    assert exit_info.value.code == 2 and "not allowed with argument --store-tp" in capsys.readouterr().err


def plan_transcripts() -> list[tuple[str, str]]:
    """Every ``$ kvpolicy plan ...`` transcript in a text or console block of the README or a page of the
    documentation (docs/): (command, printed output)."""
    transcripts = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for block in re.split(r"```(?:text|console)\n", text)[1:]:
            body = block.split("```", 1)[0]
            if body.startswith("$ kvpolicy plan "):
                command, _, output = body.partition("\n")
                # Elided outputs and commands reading a page's own files are run, with those files and
                # `...` matching, by tests/docs/test_docs_site.py.
                if "\n...\n" in f"\n{output}" or "policy.yaml" in command:
                    continue
                transcripts.append((command.removeprefix("$ kvpolicy "), output))
    return transcripts


@pytest.mark.parametrize(("command", "output"), plan_transcripts())
def test_the_documented_plan_transcripts_are_what_the_cli_prints(
    capsys: pytest.CaptureFixture[str], command: str, output: str
) -> None:
    code, out, _ = run(capsys, *command.split())
    assert (code, out) == (0, output)


def test_the_documentation_has_plan_transcripts() -> None:
    assert len(plan_transcripts()) >= 2


def test_keys_prints_a_contract_valid_against_its_schema(capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    code, out, _ = run(capsys, "keys", "--policy", "default", "--layout", "kimi-linear-48b-a3b", "--tp", "4",
                       "--cache-prefix", "tenant-a", "--format", "json")
    contract = json.loads(out)
    schema = json.loads((REPO / "schemas" / "keys.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(contract)
    assert (code, contract["cache_prefix"], [g["stores"] for g in contract["groups"]]) == (
        0, "tenant-a", ["boundary-state"] * 3 + ["chunks"]
    )
    assert all(prefix.startswith("tenant-a@") for g in contract["groups"] for prefix in g["lookup_prefixes"])


def test_keys_text_names_the_fingerprint_and_each_ranks_writes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "keys", "--policy", "default", "--layout", "deepseek-v3", "--tp", "2")
    plan_code, plan_out, _ = run(capsys, "plan", "--policy", "default", "--layout", "deepseek-v3", "--tp", "2", "--format", "json")
    fingerprint = json.loads(plan_out)["fingerprint"]
    lines = out.splitlines()
    assert (code, plan_code) == (0, 0)
    assert lines[0].endswith(f"fingerprint {fingerprint}, key version 1")
    assert [line.split(" (writes ")[1] for line in lines if " (writes " in line] == [
        "chunks c with c % 2 == 0)", "chunks c with c % 2 == 1)"
    ]


def test_keys_of_a_broken_layout_is_a_located_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "l.yaml"
    broken.write_text("version: 1\nkind: ModelLayout\nmodel: m\ntotal_num_kv_heads: 1\ngroups: []\n")
    code, out, _ = run(capsys, "keys", "--policy", "default", "--layout", str(broken), "--tp", "2")
    assert code == 1 and out.startswith(f"{broken}:5:") and out.rstrip().endswith("]")


def test_audit_sends_vllms_log_to_its_log_file_only_while_it_runs_and_leaves_the_callers_environment_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In-process callers (tests, tools) start vLLM processes afterwards: a leaked VLLM_LOGGING_STREAM or
    VLLM_LOGGING_LEVEL would redirect or silence them."""
    from kvpolicy.app import cli

    seen: list[tuple[str | None, str | None]] = []
    # The simulated ranks are not the subject here: only the environment around them.
    monkeypatch.setattr(cli, "_run_audit", lambda *args: seen.append(
        (os.environ.get("VLLM_LOGGING_STREAM"), os.environ.get("VLLM_LOGGING_LEVEL"))) or 0)
    audit = ["audit", "--policy", "default", "--archetype", "mla", "--tp", "2"]
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_STREAM", raising=False)
    assert main(audit) == 0
    assert "VLLM_LOGGING_LEVEL" not in os.environ and "VLLM_LOGGING_STREAM" not in os.environ
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert main(audit) == 0
    assert seen == [("ext://sys.stderr", "INFO"), ("ext://sys.stderr", "DEBUG")]
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG" and "VLLM_LOGGING_STREAM" not in os.environ
