"""Discovery's pure half: partitions, the observer, the report document, and proposing a policy.

Observations here are made up from what a model computes (attention heads repeat over ``tp // heads``
consecutive ranks; recurrent state is distinct on every rank), written as the connector writes them,
and read back through the same loader ``kvpolicy discover --propose`` uses.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.app.cli import main
from kvpolicy.documents.loader import check_text, load_layout, load_policy, schemas_dir
from kvpolicy.documents.propose import (
    MIN_BLOCKS,
    MIN_DISTINCT,
    differences,
    disagreements,
    escape_glob,
    load_reports,
    propose,
)
from kvpolicy.evidence.discovery import Observer, dump_report, group_layers, meet, partition_of, runs
from kvpolicy.language.diagnostics import CHECKS_BY_CODE
from kvpolicy.language.matcher import layers_matching
from kvpolicy.language.models import Layout, Match, Rule, Topology
from kvpolicy.planning.engine import PLANS, make_plan, rank_replica_sets, replica_partition


def _truth(layout: Layout, layer: str, spec_classes: tuple[str, ...], tp: int) -> int:
    """Consecutive ranks holding one layer's bytes, from what the model computes."""
    if "MambaSpec" in spec_classes:
        return 1
    if "MLAAttentionSpec" in spec_classes:
        return tp
    return max(1, tp // layout.layer_total_num_kv_heads(layer))


def _observe(layout: Layout, tp: int, *, steps: int = 2, blocks: int = 4, factor_of=None, zero: bool = False) -> Observer:
    """An observer fed ``steps`` steps in which each rank's block ``b`` of layer ``L`` holds the content
    of its class: ranks ``r`` and ``s`` hold equal bytes exactly when ``r // f == s // f``."""
    classes = {
        layer: member.spec.type
        for group in layout.groups for member in group.members for layer in member.layers
    }
    bases = {
        layer: (member.spec.type, *member.spec.bases)
        for group in layout.groups for member in group.members for layer in member.layers
    }
    observer = Observer(tp, group_layers(layout))
    for step in range(steps):
        gathered = []
        for rank in range(tp):
            per_group = {}
            for index, layers in enumerate(group_layers(layout)):
                per_group[index] = {}
                for layer in layers:
                    f = factor_of(layer, classes[layer]) if factor_of else _truth(layout, layer, bases[layer], tp)
                    per_group[index][layer] = [(f"{layer}/{step}/{b}/{rank // f}", zero) for b in range(blocks)]
            gathered.append(per_group)
        observer.observe(gathered)
    return observer


def _write(tmp_path: Path, name: str, layout: Layout, tp: int, **kwargs) -> Path:
    report = _observe(layout, tp, **kwargs).report(model=layout.model, source="engine", topology=Topology(tp_size=tp),
                                                   layout=layout)
    path = tmp_path / name
    path.write_text(dump_report(report))
    return path


def _propose(*paths: Path):
    loaded, problems = load_reports([str(path) for path in paths])
    assert not problems, problems
    return propose(loaded)


# --- partitions ---------------------------------------------------------------------------------


def test_ranks_with_equal_values_share_a_class_in_rank_order() -> None:
    assert partition_of(["b", "a", "b", "c"]) == ((0, 2), (1,), (3,))


def test_the_meet_keeps_ranks_together_only_where_both_partitions_do() -> None:
    assert meet(((0, 1, 2, 3),), ((0, 1), (2, 3))) == ((0, 1), (2, 3))
    assert meet(((0, 1), (2, 3)), ((0, 2), (1, 3))) == ((0,), (1,), (2,), (3,))


def test_runs_are_consecutive_ranks_of_one_size() -> None:
    assert runs(2, 4) == ((0, 1), (2, 3))


# --- the observer --------------------------------------------------------------------------------


def test_ranks_equal_in_one_step_but_not_in_another_are_observed_apart() -> None:
    layout = load_layout("llama-3.1-70b")
    observer = Observer(2, group_layers(layout))
    layer = group_layers(layout)[0][0]
    observer.observe([{0: {layer: [("same", False)]}}, {0: {layer: [("same", False)]}}])
    observer.observe([{0: {layer: [("x", False)]}}, {0: {layer: [("y", False)]}}])
    assert observer.layer(0, layer).partition == ((0,), (1,))
    assert observer.layer(0, layer).evidence.blocks == 2


def test_a_block_all_zero_on_some_rank_proves_nothing() -> None:
    layout = load_layout("llama-3.1-70b")
    observer = Observer(2, group_layers(layout))
    layer = group_layers(layout)[0][0]
    observer.observe([{0: {layer: [("z", True)]}}, {0: {layer: [("a", False)]}}])
    observed = observer.layer(0, layer)
    assert observed.partition == () and observed.evidence.blocks == 0 and observed.evidence.zero_blocks == 1


def test_a_step_in_which_a_rank_could_not_read_its_blocks_is_counted_and_ignored() -> None:
    layout = load_layout("llama-3.1-70b")
    observer = Observer(2, group_layers(layout))
    layer = group_layers(layout)[0][0]
    observer.observe([{0: {layer: [("a", False)]}}, None])
    report = observer.report(model="m", source="engine", topology=Topology(tp_size=2), layout=layout)
    assert report.steps == 0 and report.failed_steps == 1
    assert report.groups[0].layers[0].evidence.blocks == 0


def test_a_report_reads_back_equal_to_what_was_written() -> None:
    layout = load_layout("qwen3-next-80b-a3b")
    report = _observe(layout, 4).report(model=layout.model, source="engine", topology=Topology(tp_size=4), layout=layout)
    document, problems = check_text(dump_report(report), "report.yaml")
    assert problems == [] and document == report


def test_a_report_whose_partition_misses_a_rank_is_refused_where_it_stands() -> None:
    layout = load_layout("llama-3.1-70b")
    text = dump_report(_observe(layout, 2).report(model="m", source="engine", topology=Topology(tp_size=2), layout=layout))
    broken = text.replace("partition: [[0], [1]]", "partition: [[0]]", 1)
    document, problems = check_text(broken, "report.yaml")
    assert document is None
    found = [problem for problem in problems if "not a partition of the TP ranks" in problem.message]
    assert [problem.code for problem in found] == ["KVP104"]
    assert broken.splitlines()[found[0].line - 1].strip().startswith("partition: [[0]]")


def test_a_written_report_is_valid_under_its_shipped_json_schema() -> None:
    layout = load_layout("gemma-4-26b-a4b")
    report = _observe(layout, 4).report(model=layout.model, source="engine", topology=Topology(tp_size=4), layout=layout)
    schema = json.loads((schemas_dir() / "discovery.schema.json").read_text(encoding="utf-8"))
    data = yaml.safe_load(dump_report(report))
    jsonschema.Draft202012Validator(schema).validate(data)
    assert data["kind"] == "DiscoveryReport" and data["version"] == 1


def test_a_group_partition_that_is_not_its_layers_meet_is_refused_where_it_stands() -> None:
    layout = load_layout("llama-3.1-70b")
    text = dump_report(_observe(layout, 2).report(model="m", source="engine", topology=Topology(tp_size=2), layout=layout))
    broken = text.replace("    partition: [[0], [1]]", "    partition: [[0, 1]]", 1)
    document, problems = check_text(broken, "report.yaml")
    assert document is None and [problem.code for problem in problems] == ["KVP104"]
    assert "not the meet of its layers' partitions" in problems[0].message
    assert broken.splitlines()[problems[0].line - 1].strip().startswith("partition:")


def test_report_counts_are_whole_numbers_as_the_schema_says() -> None:
    layout = load_layout("llama-3.1-70b")
    text = dump_report(_observe(layout, 2).report(model="m", source="engine", topology=Topology(tp_size=2), layout=layout))
    document, problems = check_text(text.replace("blocks: 8\n", "blocks: '8'\n", 1), "report.yaml")
    assert document is None and problems[0].code == "KVP104"


def test_the_thin_evidence_explanation_states_the_thresholds_the_proposal_applies() -> None:
    assert f"{MIN_BLOCKS} blocks of {MIN_DISTINCT} distinct" in " ".join(CHECKS_BY_CODE["KVP401"].explanation.split())


# --- proposing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout_name", ["qwen3-next-80b-a3b", "nemotron-h-8b", "gpt-oss-120b", "llama-3.1-70b",
                                         "gemma-4-26b-a4b", "deepseek-v3", "kimi-linear-48b-a3b"])
def test_a_proposal_from_tp_2_and_4_reproduces_tp_8(tmp_path: Path, layout_name: str) -> None:
    layout = load_layout(layout_name)
    proposal, refusals = _propose(_write(tmp_path, "2.yaml", layout, 2), _write(tmp_path, "4.yaml", layout, 4))
    assert proposal is not None, refusals
    at_8 = _observe(layout, 8).report(model=layout.model, source="engine", topology=Topology(tp_size=8), layout=layout)
    assert disagreements(proposal.policy, at_8) == []


def test_a_proposal_plans_each_layer_with_the_observed_factor_where_default_would_not(tmp_path: Path) -> None:
    """A model whose Mamba state is, unusually, the same on every rank: ``default`` shards it (writes it
    on every rank); the observation says otherwise and the proposal replicates it."""
    layout = load_layout("nemotron-h-8b")

    def factor(layer: str, spec: str) -> int:
        return 2 if spec == "MambaSpec" else 1

    path = _write(tmp_path, "r.yaml", layout, 2, factor_of=factor)
    report = load_reports([str(path)])[0][0].report
    assert disagreements(load_policy("default"), report)
    proposal, _ = _propose(path)
    assert proposal is not None and disagreements(proposal.policy, report) == []


TWO_MAMBA_KINDS = """
version: 1
kind: ModelLayout
model: two-mamba-kinds
total_num_kv_heads: 2
groups:
  - name: replicated-conv
    spec: {type: MambaSpec, bases: [KVCacheSpec], block_size: 16, page_size_bytes: 4096, fields: {tp_replicated: true}}
    layers: [layers.0.conv, layers.2.conv]
  - name: state
    spec: {type: MambaSpec, bases: [KVCacheSpec], block_size: 16, page_size_bytes: 4096, fields: {tp_replicated: false}}
    layers: [layers.1.mixer, layers.3.mixer]
"""


def test_groups_of_one_class_that_differ_are_told_apart_by_a_field(tmp_path: Path) -> None:
    layout, problems = check_text(TWO_MAMBA_KINDS, "layout.yaml")
    assert isinstance(layout, Layout), problems

    def factor(layer: str, spec: str) -> int:
        return TP if layer.endswith(".conv") else 1

    paths = []
    for TP in (2, 4):
        paths.append(_write(tmp_path, f"{TP}.yaml", layout, TP, factor_of=factor))
    proposal, refusals = _propose(*paths)
    assert proposal is not None, refusals
    by_field = {rule.match.fields.get("tp_replicated"): rule.replication for rule in proposal.policy.rules}
    assert by_field == {True: "replicated", False: "sharded"}


def test_layers_of_one_class_no_field_tells_apart_get_rules_by_layer_name(tmp_path: Path) -> None:
    layout = load_layout("llama-3.1-70b")
    layers = group_layers(layout)[0]
    odd = set(layers[1::2])

    def factor(layer: str, spec: str) -> int:
        return 2 if layer in odd else 1

    path = _write(tmp_path, "r.yaml", layout, 2, factor_of=factor)
    proposal, refusals = _propose(path)
    assert proposal is not None, refusals
    assert any(rule.match.layers for rule in proposal.policy.rules)
    assert disagreements(proposal.policy, load_reports([str(path)])[0][0].report) == []


def test_thin_evidence_is_refused_at_its_line_and_no_policy_is_proposed(tmp_path: Path) -> None:
    layout = load_layout("llama-3.1-70b")
    path = _write(tmp_path, "r.yaml", layout, 2, steps=1, blocks=2)
    proposal, refusals = _propose(path)
    assert proposal is None
    assert [refusal.code for refusal in refusals] == ["KVP401"]
    line = path.read_text().splitlines()[refusals[0].line - 1]
    assert line.strip().startswith("evidence:")


def test_all_zero_blocks_are_thin_evidence(tmp_path: Path) -> None:
    layout = load_layout("llama-3.1-70b")
    proposal, refusals = _propose(_write(tmp_path, "r.yaml", layout, 2, zero=True))
    assert proposal is None and {refusal.code for refusal in refusals} == {"KVP401"}


def test_a_strided_partition_no_factor_expresses_is_refused(tmp_path: Path) -> None:
    layout = load_layout("llama-3.1-70b")
    text = _write(tmp_path, "r.yaml", layout, 4).read_text().replace("[[0], [1], [2], [3]]", "[[0, 2], [1, 3]]")
    path = tmp_path / "strided.yaml"
    path.write_text(text)
    proposal, refusals = _propose(path)
    assert proposal is None and {refusal.code for refusal in refusals} == {"KVP402"}
    assert "[[0, 2], [1, 3]]" in refusals[0].message


def test_reports_that_contradict_each_other_are_refused(tmp_path: Path) -> None:
    layout = load_layout("llama-3.1-70b")
    first = _write(tmp_path, "a.yaml", layout, 2, factor_of=lambda layer, spec: 1)
    second = _write(tmp_path, "b.yaml", layout, 2, factor_of=lambda layer, spec: 2)
    proposal, refusals = _propose(first, second)
    assert proposal is None and {refusal.code for refusal in refusals} == {"KVP403"}


def test_refusals_stay_one_per_group_however_many_layers_are_thin(tmp_path: Path) -> None:
    layout = load_layout("llama-3.1-70b")  # 80 layers in one group
    proposal, refusals = _propose(_write(tmp_path, "r.yaml", layout, 2, steps=1, blocks=1))
    assert proposal is None and len(refusals) == 1 and "79 more layers" in refusals[0].message


def test_a_rule_names_its_evidence_in_a_comment(tmp_path: Path) -> None:
    layout = load_layout("qwen3-next-80b-a3b")
    proposal, _ = _propose(_write(tmp_path, "2.yaml", layout, 2), _write(tmp_path, "4.yaml", layout, 4))
    assert proposal is not None
    comments = [line for line in proposal.text.splitlines() if line.strip().startswith("#   ")]
    assert any("at tp 2" in line and "2.yaml" in line for line in comments)
    assert any("at tp 4" in line and "4.yaml" in line for line in comments)


def test_the_proposal_plans_every_example_layout_it_was_not_observed_on_without_error(tmp_path: Path) -> None:
    layout = load_layout("qwen3-next-80b-a3b")
    proposal, _ = _propose(_write(tmp_path, "2.yaml", layout, 2), _write(tmp_path, "4.yaml", layout, 4))
    assert proposal is not None
    make_plan(proposal.policy, load_layout("deepseek-v3"), Topology(tp_size=8))  # unmatched specs stay sharded


# --- the command line ---------------------------------------------------------------------------


def test_discover_propose_writes_the_policy_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    layout = load_layout("qwen3-next-80b-a3b")
    out = tmp_path / "proposed.yaml"
    code = main(["discover", "--propose", str(_write(tmp_path, "2.yaml", layout, 2)),
                 str(_write(tmp_path, "4.yaml", layout, 4)), "--output", str(out), "--name", "qwen3-next"])
    assert code == 0
    assert load_policy(out).name == "qwen3-next"


def test_discover_propose_refusing_writes_nothing_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "proposed.yaml"
    code = main(["discover", "--propose", str(_write(tmp_path, "r.yaml", load_layout("llama-3.1-70b"), 2, blocks=1)),
                 "--output", str(out)])
    assert code == 1 and not out.exists()
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].endswith("[KVP401]") and printed[0].startswith(str(tmp_path))


def test_discover_check_exits_4_when_a_policy_replicates_what_was_observed_sharded(tmp_path: Path, capsys) -> None:
    layout = load_layout("nemotron-h-8b")
    path = _write(tmp_path, "r.yaml", layout, 2)
    assert main(["discover", "--check", "default", str(path)]) == 0
    wrong = Path(__file__).resolve().parents[2] / "examples" / "policies" / "wrong-recurrent-replicated.yaml"
    assert main(["discover", "--check", str(wrong), str(path)]) == 4
    assert "planned head factor 2, observed 1" in capsys.readouterr().out


def test_discover_propose_on_a_file_that_is_not_a_report_says_so(tmp_path: Path, capsys) -> None:
    assert main(["discover", "--propose", str(Path(__file__).resolve().parents[2] / "policies" / "default.yaml")]) == 1
    assert "expected a DiscoveryReport, found a ReplicationPolicy" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["discover"], ["discover", "--propose"], ["discover", "--archetype", "mla"], ["discover", "--check", "default"],
     ["discover", "--propose", "r.yaml", "--tp", "2"], ["discover", "--archetype", "mla", "--tp", "2", "r.yaml"],
     ["discover", "--archetype", "mla", "--tp", "128"], ["discover", "--propose", "r.yaml", "--name", "Not-Kebab"],
     ["discover", "--check", "default", "r.yaml", "--output", "p.yaml"], ["discover", "--archetype", "mla", "--tp", "2",
                                                                          "--name", "x"]],
)
def test_discover_without_what_it_needs_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "kvpolicy discover: error:" in capsys.readouterr().err


def test_check_names_a_layer_observed_in_classes_no_factor_expresses(tmp_path: Path, capsys) -> None:
    layout = load_layout("llama-3.1-70b")
    text = _write(tmp_path, "r.yaml", layout, 4).read_text().replace("[[0], [1], [2], [3]]", "[[0, 2], [1, 3]]")
    path = tmp_path / "strided.yaml"
    path.write_text(text)
    assert main(["discover", "--check", "default", str(path)]) == 1  # sharding what is alike is harmless
    assert "which no factor expresses" in capsys.readouterr().out


def test_a_proposal_survives_file_and_model_names_with_control_characters(tmp_path: Path) -> None:
    layout = load_layout("llama-3.1-70b")
    original = _write(tmp_path, "r.yaml", layout, 2).read_text()
    text = original.replace(f"model: {layout.model}", 'model: "odd\\nmodel"', 1)
    assert text != original
    path = tmp_path / "odd\nname.yaml"
    path.write_text(text)
    proposal, refusals = _propose(path)
    assert proposal is not None, refusals
    assert all(line.startswith(("#", " ", "version", "kind", "name", "description", "key", "audit", "rules"))
               for line in proposal.text.splitlines())


def test_a_proposal_from_simulated_observations_says_so_in_its_header(tmp_path: Path) -> None:
    layout = load_layout("qwen3-next-80b-a3b")
    paths = []
    for tp in (2, 4):
        path = _write(tmp_path, f"{tp}.yaml", layout, tp)
        path.write_text(path.read_text().replace("source: engine", "source: simulation", 1))
        paths.append(path)
    simulated, _ = _propose(*paths)
    observed, _ = _propose(_write(tmp_path, "e2.yaml", layout, 2), _write(tmp_path, "e4.yaml", layout, 4))
    assert simulated is not None and observed is not None
    assert "# Some observations come from the simulation" in simulated.text
    assert "simulation" not in observed.text


# --- a proposal's self-check ----------------------------------------------------------------------

GLOB_NAMES = """
version: 1
kind: ModelLayout
model: glob-names
total_num_kv_heads: 1
groups:
  - spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096}
    layers: ["a*", ab, "[x]", x, "q?", qq, "[!y]", z]
"""


def test_layer_names_holding_glob_characters_get_rules_matching_each_name_alone(tmp_path: Path) -> None:
    """``match.layers`` holds globs: a rule for the layer ``a*`` written verbatim would take ``ab`` too."""
    layout, problems = check_text(GLOB_NAMES, "layout.yaml")
    assert isinstance(layout, Layout), problems
    odd = {"a*", "[x]", "q?", "[!y]"}
    path = _write(tmp_path, "r.yaml", layout, 2, factor_of=lambda layer, spec: 2 if layer in odd else 1)
    proposal, refusals = _propose(path)
    assert proposal is not None, refusals
    assert disagreements(proposal.policy, load_reports([str(path)])[0][0].report) == []


@settings(deadline=None)
@given(st.text(alphabet="ab*?[]!-^\\\\\n", max_size=6), st.text(alphabet="ab*?[]!-^\\\\\n", max_size=6))
def test_an_escaped_layer_name_matches_that_name_and_no_other(name: str, other: str) -> None:
    rule = Rule(name="r", reason="r", match=Match(layers=(escape_glob(name),)), replication="sharded")
    assert layers_matching(rule, [other]) == ([other] if other == name else [])


CLASS_CYCLE = """
version: 1
kind: ModelLayout
model: {model}
total_num_kv_heads: 1
groups:
  - spec: {{type: {type}, bases: [{base}, KVCacheSpec], block_size: 16, page_size_bytes: 4096}}
    layers: [layers.0.state]
"""


def test_reports_whose_class_hierarchies_contradict_get_a_located_refusal_not_an_exception(tmp_path: Path) -> None:
    """One report says FooSpec derives from BarSpec, the other BarSpec from FooSpec: BarSpec's rule,
    written first, then matches FooSpec's layers too, and the proposal cannot reproduce the first
    report. The self-check refuses it where the observation stands."""
    paths = []
    for name, base, factor in (("FooSpec", "BarSpec", 2), ("BarSpec", "FooSpec", 1)):
        layout, problems = check_text(CLASS_CYCLE.format(model=name.lower(), type=name, base=base), "layout.yaml")
        assert isinstance(layout, Layout), problems
        paths.append(_write(tmp_path, f"{name}.yaml", layout, 2, factor_of=lambda layer, spec, f=factor: f))
    proposal, refusals = _propose(*paths)
    assert proposal is None and [refusal.code for refusal in refusals] == ["KVP402"]
    assert refusals[0].path == str(paths[0]) and "do not reproduce this observation" in refusals[0].message
    assert paths[0].read_text().splitlines()[refusals[0].line - 1].strip().startswith("partition:")


def test_a_proposal_that_does_not_read_back_is_a_located_refusal_not_an_exception(tmp_path: Path, monkeypatch) -> None:
    import kvpolicy.documents.propose as proposing

    path = _write(tmp_path, "r.yaml", load_layout("llama-3.1-70b"), 2)
    monkeypatch.setattr(proposing, "_render", lambda rules, loaded, name: "version: 1\nkind: ReplicationPolicy\n")
    proposal, refusals = _propose(path)
    assert proposal is None and len(refusals) == 1
    assert refusals[0].path == str(path) and "does not read back" in refusals[0].message


# --- what validate refuses: what --propose and --check would -------------------------------------


def _edited(tmp_path: Path, name: str, old: str, new: str, *, layout: str = "llama-3.1-70b", tp: int = 2,
            count: int = 1) -> Path:
    text = _write(tmp_path, f"source-{name}", load_layout(layout), tp).read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new, count))
    return path


def test_a_report_at_a_topology_no_plan_is_made_at_is_refused_at_its_topology(tmp_path: Path) -> None:
    path = _edited(tmp_path, "r.yaml", "  pp_size: 1\n  pcp_size: 1\n", "  pp_size: 4096\n  pcp_size: 4096\n")
    document, problems = check_text(path.read_text(), str(path))
    assert document is None and [problem.code for problem in problems] == ["KVP104"]
    assert path.read_text().splitlines()[problems[0].line - 1].strip() == "tp_size: 2"
    assert "pp 4096, pcp 4096" in problems[0].message and "1,000,000" in problems[0].message


def test_a_report_at_sizes_vllm_refuses_together_is_refused_at_its_topology(tmp_path: Path) -> None:
    """Decode-context parallelism on 8 GQA KV heads needs more than 8 TP ranks."""
    path = _edited(tmp_path, "r.yaml", "  dcp_size: 1\n", "  dcp_size: 2\n")
    document, problems = check_text(path.read_text(), str(path))
    assert document is None and [problem.code for problem in problems] == ["KVP104"]
    assert "vLLM refuses dcp_size 2" in problems[0].message


def test_a_partition_with_an_empty_class_is_refused_where_it_stands(tmp_path: Path) -> None:
    path = _edited(tmp_path, "r.yaml", "        partition: [[0], [1]]", "        partition: [[], [0], [1]]")
    document, problems = check_text(path.read_text(), str(path))
    assert document is None and [problem.code for problem in problems] == ["KVP104"]
    assert "has an empty class" in problems[0].message
    assert path.read_text().splitlines()[problems[0].line - 1].strip() == "partition: [[], [0], [1]]"


def test_more_distinct_contents_than_compared_blocks_is_refused(tmp_path: Path) -> None:
    path = _edited(tmp_path, "r.yaml", "          distinct_blocks: 8\n", "          distinct_blocks: 9\n")
    document, problems = check_text(path.read_text(), str(path))
    assert document is None and [problem.code for problem in problems] == ["KVP104"]
    assert "9 distinct contents among 8 compared blocks" in problems[0].message


def test_a_report_whose_layout_does_not_evaluate_at_its_topology_is_refused_at_the_expression(tmp_path: Path) -> None:
    path = _edited(tmp_path, "r.yaml", "head_size: 128", "head_size: {expr: '128 // (tp_size - 2)'}")
    document, problems = check_text(path.read_text(), str(path))
    assert document is None and [problem.code for problem in problems] == ["KVP104"]
    assert "does not evaluate at the report's own topology, tp 2" in problems[0].message
    assert "128 // (tp_size - 2)" in path.read_text().splitlines()[problems[0].line - 1]


def test_a_report_listing_a_class_out_of_order_is_read_as_its_partition(tmp_path: Path) -> None:
    path = _edited(tmp_path, "r.yaml", "partition: [[0], [1]]", "partition: [[1], [0]]", count=-1)
    loaded, problems = load_reports([str(path)])
    assert problems == []
    assert disagreements(load_policy("default"), loaded[0].report) == []


# --- what a plan can express -----------------------------------------------------------------------


def _report_of(layout: Layout, topology: Topology, classes: Sequence[Sequence[int]], tmp_path: Path) -> Path:
    """A report of ``layout`` in which every layer's ranks held equal bytes in ``classes``."""
    where = {rank: index for index, members in enumerate(classes) for rank in members}
    observer = Observer(topology.tp_size, group_layers(layout))
    for step in range(2):
        observer.observe([
            {index: {layer: [(f"{layer}/{step}/{block}/{where[rank]}", False) for block in range(4)] for layer in layers}
             for index, layers in enumerate(group_layers(layout))}
            for rank in range(topology.tp_size)
        ])
    path = tmp_path / "r.yaml"
    path.write_text(dump_report(observer.report(model=layout.model, source="engine", topology=topology, layout=layout)))
    return path


def test_replica_sets_of_runs_split_by_dcp_rank_into_unequal_sizes_are_refused_as_inexpressible(tmp_path: Path) -> None:
    """At TP 6 under DCP 2, runs of 3 ranks split into sets of 2 and 1, which the engine refuses to
    plan: such an observation gets KVP402, not a rule the plan would refuse."""
    layout = load_layout("deepseek-v3")
    topology = Topology(tp_size=6, dcp_size=2)
    proposal, refusals = _propose(_report_of(layout, topology, replica_partition(3, topology), tmp_path))
    assert proposal is None and {refusal.code for refusal in refusals} == {"KVP402"}


MIXED_HEADS = """
version: 1
kind: ModelLayout
model: mixed-heads
total_num_kv_heads: 3
layer_kv_heads:
  - {total_num_kv_heads: 2, layers: [layers.1.attn]}
groups:
  - spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096}
    layers: [layers.0.attn, layers.1.attn]
"""


def test_a_group_whose_layers_repeat_over_2_and_3_ranks_is_held_to_the_plan_of_their_gcd(tmp_path: Path) -> None:
    """At TP 6 the group's observed partition, the meet of runs of 2 and of 3, is no factor's; a plan
    of the observed layer factors gives the group runs of their gcd, which no policy can improve on."""
    layout, problems = check_text(MIXED_HEADS, "layout.yaml")
    assert isinstance(layout, Layout), problems
    paths = [_write(tmp_path, f"{tp}.yaml", layout, tp) for tp in (6, 12)]
    assert load_reports([str(paths[0])])[0][0].report.groups[0].partition == ((0, 1), (2,), (3,), (4, 5))
    proposal, refusals = _propose(*paths)
    assert proposal is not None, refusals
    assert differences(proposal.policy, load_reports([str(paths[0])])[0][0].report) == []


def replica_set(tp_rank: int, head_factor: int, topology: Topology) -> tuple[int, ...]:
    """A rank's replica set as defined: of its run of ``head_factor`` ranks, those of its dcp rank."""
    start = tp_rank - tp_rank % head_factor
    return tuple(rank for rank in range(start, start + head_factor) if topology.dcp_rank(rank) == topology.dcp_rank(tp_rank))


def test_replica_sets_are_what_each_rank_is_defined_to_hold() -> None:
    for tp in range(1, 13):
        for pcp, dcp in {(1, 1), *((1, d) for d in range(2, tp + 1) if tp % d == 0), (2, 2), (2, 2 * tp)}:
            topology = Topology(tp_size=tp, pcp_size=pcp, dcp_size=dcp)
            for factor in (f for f in range(1, tp + 1) if tp % f == 0):
                defined = tuple(replica_set(rank, factor, topology) for rank in range(tp))
                assert rank_replica_sets(factor, topology) == defined, (topology, factor)
                assert replica_partition(factor, topology) == tuple(sorted(set(defined))), (topology, factor)


def _counting_dcp_ranks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every rank's dcp rank asked: the unit of work of replica sets."""
    calls = [0]
    original = Topology.dcp_rank

    def counted(self: Topology, tp_rank: int, pcp_rank: int = 0) -> int:
        calls[0] += 1
        return original(self, tp_rank, pcp_rank)

    monkeypatch.setattr(Topology, "dcp_rank", counted)
    return calls


REPLICATED_GROUP = """
version: 1
kind: ModelLayout
model: mla
total_num_kv_heads: 1
groups:
  - spec: {type: MLAAttentionSpec, bases: [FullAttentionSpec, AttentionSpec, KVCacheSpec], block_size: 64, page_size_bytes: 36864}
    layers: [layers.0.attn, layers.1.attn]
"""


def test_planning_a_group_replicated_over_tp_4096_asks_each_ranks_dcp_rank_about_once(monkeypatch) -> None:
    """Replica sets rank by rank cost tp x factor: 16.8 million dcp ranks (6-19 s, 657 MB) at TP 4096."""
    layout, _ = check_text(REPLICATED_GROUP, "layout.yaml")
    calls = _counting_dcp_ranks(monkeypatch)
    PLANS.clear()
    plan = make_plan(load_policy("default"), layout, Topology(tp_size=4096))
    assert plan.groups[0].factor == 4096
    assert calls[0] <= 2 * 4096


def test_planning_a_group_replicated_over_tp_4096_takes_memory_linear_in_tp() -> None:
    layout, _ = check_text(REPLICATED_GROUP, "layout.yaml")
    PLANS.clear()
    tracemalloc.start()
    try:
        make_plan(load_policy("default"), layout, Topology(tp_size=4096))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024  # a set of 4096 ranks per rank would be 134 MB of references alone


def test_checking_a_group_replicated_over_tp_4096_asks_each_ranks_dcp_rank_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch
) -> None:
    layout, _ = check_text(REPLICATED_GROUP, "layout.yaml")
    topology = Topology(tp_size=4096)
    report = load_reports([str(_report_of(layout, topology, [range(4096)], tmp_path))])[0][0].report
    PLANS.clear()
    calls = _counting_dcp_ranks(monkeypatch)
    assert differences(load_policy("default"), report) == []
    assert calls[0] <= 64 * 4096  # the factors of 4096 (13) tried once each, and the plan's


def test_the_simulation_header_says_a_class_vllm_does_not_ship_is_refused_not_simulated(tmp_path: Path) -> None:
    """``kvpolicy discover --layout`` refuses such a class (KVP404); the header says so, and no longer
    that the simulation holds it as attention."""
    layout = load_layout("qwen3-next-80b-a3b")
    path = _write(tmp_path, "r.yaml", layout, 2)
    path.write_text(path.read_text().replace("source: engine", "source: simulation", 1))
    proposal, _ = _propose(path)
    assert proposal is not None
    header = " ".join(line.lstrip("# ") for line in proposal.text.splitlines() if line.startswith("#"))
    assert "refuses a class vLLM does not ship" in header and "is simulated as attention" not in header


def test_a_difference_at_tp_4096_names_its_partitions_in_a_bounded_line(tmp_path: Path) -> None:
    layout, _ = check_text(REPLICATED_GROUP, "layout.yaml")
    path = _report_of(layout, Topology(tp_size=4096), [[rank] for rank in range(4096)], tmp_path)
    found = differences(load_policy("default"), load_reports([str(path)])[0][0].report)
    assert {difference.kind for difference in found} == {"dangerous"}
    assert all(len(difference.message) < 1000 for difference in found)
    assert "(4096 classes of 4096 ranks)" in found[-1].message
