"""``kvpolicy discover`` on the command line: ``--check``'s verdict and exit codes (0 agrees, 1 harmless
differences, 3 no evidence, 4 dangerous), ``--propose`` refusing located instead of failing its own
self-check, and ``--layout`` refusing what the simulation cannot observe before anything starts.

Reports are made up as :mod:`tests.core.test_discovery` makes them: each rank's block holds the content
of its class, ranks ``r`` and ``s`` sharing a class exactly when ``r // f == s // f``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpolicy.app.cli import main
from kvpolicy.documents.loader import check_text, load_layout
from kvpolicy.documents.propose import load_reports, observation_summary
from kvpolicy.evidence.discovery import Observer, dump_report, group_layers
from kvpolicy.language.models import Layout, Topology

REPO = Path(__file__).resolve().parents[2]
WRONG = REPO / "examples" / "policies" / "wrong-recurrent-replicated.yaml"


def report(tmp_path: Path, name: str, layout: Layout | str, tp: int, factor: Callable[[str, str], int], *,
           zero: bool = False) -> Path:
    """A report of ``layout`` at ``tp`` in which layer ``L`` of class ``C`` repeats over ``factor(L, C)``
    consecutive ranks; every block all zero on some rank when ``zero``."""
    layout = load_layout(layout) if isinstance(layout, str) else layout
    classes = {layer: member.spec.type for group in layout.groups for member in group.members for layer in member.layers}
    observer = Observer(tp, group_layers(layout))
    for step in range(2):
        observer.observe([
            {index: {layer: [(f"{layer}/{step}/{block}/{rank // factor(layer, classes[layer])}", zero) for block in range(4)]
                     for layer in layers}
             for index, layers in enumerate(group_layers(layout))}
            for rank in range(tp)
        ])
    path = tmp_path / name
    path.write_text(dump_report(observer.report(model=layout.model, source="engine", topology=Topology(tp_size=tp),
                                                layout=layout)))
    return path


def mamba_sharded(layer: str, spec: str) -> int:
    """Nemotron-H at TP 2 as it computes: Mamba state split, attention of 8 KV heads split."""
    return 1


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    return code, capsys.readouterr().out.splitlines()


# --- --check: the verdict first, the exit code by the worst kind found -------------------------------


def test_check_exits_0_and_says_so_first_when_the_policy_plans_what_was_observed(tmp_path, capsys) -> None:
    code, lines = run(capsys, "discover", "--check", "default", str(report(tmp_path, "r.yaml", "nemotron-h-8b", 2, mamba_sharded)))
    assert code == 0
    assert lines[0] == "policy default agrees with every observed group and layer of 1 report (exit 0)"


def test_check_exits_4_and_says_dangerous_first_when_the_policy_replicates_what_was_observed_distinct(
    tmp_path, capsys
) -> None:
    code, lines = run(capsys, "discover", "--check", str(WRONG), str(report(tmp_path, "r.yaml", "nemotron-h-8b", 2, mamba_sharded)))
    assert code == 4
    assert lines[0].startswith("DANGEROUS: policy wrong-recurrent-replicated puts ranks observed holding different bytes")
    assert lines[0].endswith("(exit 4)") and "another rank's state" in lines[0]
    assert "  DANGEROUS: group 0 layers model.layers.0.mixer (+3 alike): planned head factor 2, observed 1" in lines


def test_check_exits_1_and_calls_harmless_a_policy_that_shards_what_every_rank_held_alike(tmp_path, capsys) -> None:
    code, lines = run(capsys, "discover", "--check", "no-dedup", str(report(tmp_path, "r.yaml", "deepseek-v3", 4, lambda layer, spec: 4)))
    assert code == 1
    assert lines[0].startswith("policy no-dedup departs harmlessly from 1 report") and lines[0].endswith("(exit 1)")
    assert all(not line.lstrip().startswith("DANGEROUS") for line in lines)
    assert any(line.startswith("  harmless: group 0") for line in lines)


def test_check_exits_3_and_says_no_evidence_when_every_block_was_all_zero(tmp_path, capsys) -> None:
    """Issue 38: a report whose every group saw only all-zero blocks proves nothing; it is no pass."""
    path = report(tmp_path, "r.yaml", "nemotron-h-8b", 2, mamba_sharded, zero=True)
    code, lines = run(capsys, "discover", "--check", "default", str(path))
    assert code == 3
    assert lines[0].startswith("NO EVIDENCE: 28 observed layers of 1 report") and lines[0].endswith("(exit 3)")
    assert "agrees" not in "\n".join(lines)
    assert "  not judged: group 0 (mamba-0) layers model.layers.0.mixer (+3 alike): no evidence: " \
           "its 32 blocks were all zero on some rank, which proves nothing" in lines


def test_check_exits_3_for_no_evidence_even_where_it_finds_only_harmless_differences(tmp_path, capsys) -> None:
    judged = report(tmp_path, "judged.yaml", "deepseek-v3", 4, lambda layer, spec: 4)
    unjudged = report(tmp_path, "zero.yaml", "deepseek-v3", 4, lambda layer, spec: 4, zero=True)
    code, lines = run(capsys, "discover", "--check", "no-dedup", str(judged), str(unjudged))
    assert code == 3 and lines[0].startswith("NO EVIDENCE:")


def test_check_exits_4_for_a_dangerous_difference_whatever_else_it_finds(tmp_path, capsys) -> None:
    sharded = report(tmp_path, "sharded.yaml", "nemotron-h-8b", 2, mamba_sharded)
    zero = report(tmp_path, "zero.yaml", "nemotron-h-8b", 2, mamba_sharded, zero=True)
    code, lines = run(capsys, "discover", "--check", str(WRONG), str(zero), str(sharded))
    assert code == 4 and lines[0].startswith("DANGEROUS:")


def test_check_lists_a_groups_alike_layers_on_one_line_and_at_most_50_lines_a_report(tmp_path, capsys) -> None:
    code, lines = run(capsys, "discover", "--check", "no-dedup", str(report(tmp_path, "r.yaml", "llama-3.1-70b", 2, lambda layer, spec: 2)))
    assert code == 1
    assert lines[2:] == [
        "  harmless: group 0 layers model.layers.0.self_attn.attn (+79 alike): planned head factor 1, observed 2",
        "  harmless: group 0 (full): planned replica sets [[0], [1]], observed [[0, 1]]",
    ]


STRICT = """\
version: 1
kind: ReplicationPolicy
name: mla-only
strict: true
rules:
  - name: mla-latent
    reason: The MLA latent cache has no head dimension.
    match: {spec: MLAAttentionSpec}
    replication: replicated
"""


def test_check_prints_a_policy_that_cannot_plan_a_report_as_located_errors(tmp_path, capsys) -> None:
    policy = tmp_path / "strict.yaml"
    policy.write_text(STRICT)
    code, lines = run(capsys, "discover", "--check", str(policy), str(report(tmp_path, "r.yaml", "llama-3.1-70b", 2, mamba_sharded)))
    assert code == 1
    assert lines[0].startswith("policy mla-only cannot plan 1 of 1 report")
    assert lines[2].startswith(f"{policy}:4:") and lines[2].endswith("[KVP301]") and "strict" in lines[2]


# --- --propose: refusals, never its own self-check's exception ----------------------------------------


def test_propose_of_a_report_at_a_topology_no_plan_is_made_at_is_one_located_error(tmp_path, capsys) -> None:
    """Pipeline and prefill-context parallelism in the thousands: the report is refused where its
    topology stands, as validate refuses it, not by the proposal's self-check."""
    path = report(tmp_path, "r.yaml", "llama-3.1-70b", 2, mamba_sharded)
    path.write_text(path.read_text().replace("  pp_size: 1\n  pcp_size: 1\n", "  pp_size: 4096\n  pcp_size: 4096\n", 1))
    code, lines = run(capsys, "discover", "--propose", str(path))
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"{path}:6:3: error: topology: tp 2, pp 4096, pcp 4096: no plan is made")
    assert lines[0].endswith("[KVP104]")


GLOB_NAMES = """
version: 1
kind: ModelLayout
model: glob-names
total_num_kv_heads: 1
groups:
  - spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096}
    layers: ["a*", ab, "[x]", x, "q?", qq]
"""


def test_propose_writes_rules_for_layer_names_with_glob_characters_that_reproduce_the_report(tmp_path, capsys) -> None:
    layout, problems = check_text(GLOB_NAMES, "layout.yaml")
    assert isinstance(layout, Layout), problems
    path = report(tmp_path, "r.yaml", layout, 2, lambda layer, spec: 2 if layer in ("a*", "[x]", "q?") else 1)
    out = tmp_path / "proposed.yaml"
    assert main(["discover", "--propose", str(path), "--output", str(out)]) == 0
    assert main(["discover", "--check", str(out), str(path)]) == 0
    assert "'[[]x]'" in out.read_text()


# --- observing: the summary, and what --layout refuses before it starts -------------------------------


def test_the_observation_summary_says_no_evidence_for_a_group_that_compared_no_block(tmp_path) -> None:
    (loaded,), _ = load_reports([str(report(tmp_path, "r.yaml", "deepseek-v3", 2, lambda layer, spec: 2, zero=True))])
    lines, every_layer_observed = observation_summary(loaded.report, "r.yaml")
    assert not every_layer_observed  # discover --layout exits 3
    assert lines[1] == (
        "  group 0 mla (MLAAttentionSpec): no evidence: no block compared in any of its 61 layers (488 all zero on some rank)"
    )


def test_the_observation_summary_gives_a_groups_partition_and_factor_where_it_compared_blocks(tmp_path) -> None:
    (loaded,), _ = load_reports([str(report(tmp_path, "r.yaml", "deepseek-v3", 2, lambda layer, spec: 2))])
    lines, every_layer_observed = observation_summary(loaded.report, "r.yaml")
    assert every_layer_observed
    assert lines[1] == "  group 0 mla (MLAAttentionSpec): equal bytes in [[0, 1]] (factor 2); 488 blocks compared, 0 all-zero"


PLUGIN_CLASS = """\
version: 1
kind: ModelLayout
model: plugin
total_num_kv_heads: 1
groups:
  - name: attention
    spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096}
    layers: [layers.0.attn]
  - name: conv
    spec:
      type: ConvStateSpec
      bases: [MambaSpec, KVCacheSpec]
      block_size: 16
      page_size_bytes: 4096
    layers: [layers.1.conv]
"""


def test_layout_with_a_class_vllm_does_not_ship_is_refused_at_that_class_naming_the_engine_route(tmp_path, capsys) -> None:
    layout = tmp_path / "plugin.yaml"
    layout.write_text(PLUGIN_CLASS)
    code, lines = run(capsys, "discover", "--layout", str(layout), "--tp", "2", "--out", str(tmp_path / "out"))
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"{layout}:11:13: error: ConvStateSpec is not a spec class of vLLM 0.32")
    assert "kvpolicy_discover" in lines[0] and lines[0].endswith("[KVP404]")
    assert not (tmp_path / "out").exists()


FAILS_AT_TP_4 = """\
version: 1
kind: ModelLayout
model: narrow
total_num_kv_heads: 4
groups:
  - spec:
      type: FullAttentionSpec
      bases: [AttentionSpec, KVCacheSpec]
      block_size: 16
      page_size_bytes: 4096
      fields:
        num_kv_heads: {expr: "4 // tp_size"}
        head_size: {expr: "128 // (4 - tp_size)"}
    layers: [layers.0.attn]
"""


def test_layout_whose_expression_fails_at_a_tp_size_is_located_as_plan_locates_it(tmp_path, capsys) -> None:
    layout = tmp_path / "narrow.yaml"
    layout.write_text(FAILS_AT_TP_4)
    plan_code, planned = run(capsys, "plan", "--policy", "no-dedup", "--layout", str(layout), "--tp", "4")
    code, lines = run(capsys, "discover", "--layout", str(layout), "--tp", "2", "4", "--out", str(tmp_path / "out"))
    assert code == plan_code == 1 and lines == planned
    assert lines[0].startswith(f"{layout}:13:") and "tp_size 4" in lines[0] and lines[0].endswith("[KVP301]")


def test_layout_refusals_come_before_torch_vllm_or_mooncake_is_imported(tmp_path: Path) -> None:
    layout = tmp_path / "plugin.yaml"
    layout.write_text(PLUGIN_CLASS)
    script = textwrap.dedent(f"""\
        import json, sys
        from kvpolicy.app.cli import main
        code = main(["discover", "--layout", {str(layout)!r}, "--tp", "2"])
        print("RESULT " + json.dumps([code, sorted(n for n in ("torch", "vllm", "mooncake") if n in sys.modules)]))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    code, heavy = json.loads(done.stdout.rpartition("RESULT ")[2])
    assert (code, heavy) == (1, []), done.stdout + done.stderr
