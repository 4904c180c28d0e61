"""A layout states once what changes with TP: ``block_size``, ``page_size_bytes`` and any spec
field may be an expression over the topology, evaluated per plan."""

from __future__ import annotations

import json

import jsonschema
import pytest
from core_support import full, layout, mamba, policy

from kvpolicy.documents.loader import check_text, load_layout, load_policy, schemas_dir
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.dumper import dump_layout
from kvpolicy.language.models import Layout, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.traffic import prompt_traffic

HYBRID_BLOCK = "16 * cdiv(65536 // tp_size, 16 * 512)"
"""A state of 64 KiB over TP padded to attention pages of 512 bytes per token: 128, 64, 32, 16 tokens."""

MATCH_ONE_HEAD = policy(
    """
    version: 1
    kind: ReplicationPolicy
    name: one-head
    rules:
      - name: one-head-replicated
        reason: test
        match: {spec: FullAttentionSpec, fields: {num_kv_heads: 1}}
        replication: replicated
      - name: several-heads
        reason: test
        match: {spec: FullAttentionSpec}
        when: num_kv_heads > 1
        replication: sharded
    """
)


def plan(document: Layout, tp: int, policy_name: str = "default"):
    return make_plan(load_policy(policy_name), document, Topology(tp_size=tp))


@pytest.mark.parametrize(("tp", "block"), [(1, 128), (2, 64), (4, 32), (8, 16)])
def test_a_block_size_expression_gives_each_tp_its_block(tp: int, block: int) -> None:
    document = layout(full(block_size=HYBRID_BLOCK, page_size_bytes="block_size * 512"), heads=8)
    assert plan(document, tp).groups[0].chunk_tokens == block


def test_a_page_size_reading_block_size_keeps_bytes_per_token_at_every_tp() -> None:
    document = layout(full(block_size=HYBRID_BLOCK, page_size_bytes="block_size * 512"), heads=8)
    assert {plan(document, tp).groups[0].bytes_per_token_per_rank for tp in (1, 2, 4, 8)} == {2 * 512}


def test_rules_match_a_field_expression_at_the_plan_topology() -> None:
    document = layout(full(num_kv_heads={"expr": "max(1, 2 // tp_size)"}), heads=2)
    decided = {tp: make_plan(MATCH_ONE_HEAD, document, Topology(tp_size=tp)).groups[0].rules for tp in (1, 2, 4)}
    assert decided == {1: ("several-heads",), 2: ("one-head-replicated",), 4: ("one-head-replicated",)}


def test_a_field_expression_inside_a_list_is_evaluated() -> None:
    document = layout(mamba(shapes=[[3, {"expr": "8192 // tp_size"}], [{"expr": "32 // tp_size"}, 128]]), heads=0)
    spec = document.groups[0].spec
    assert spec is not None
    values = spec.evaluate({"tp_size": 4, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "total_num_kv_heads": 0})
    assert values.fields["shapes"] == ((3, 2048), (8, 128))


def test_a_field_expression_may_read_the_page_size() -> None:
    document = layout(mamba(page_size_bytes="block_size * 100", page_size_padded={"expr": "page_size_bytes"}), heads=0)
    spec = document.groups[0].spec
    assert spec is not None
    values = spec.evaluate({"tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "total_num_kv_heads": 0})
    assert values.fields["page_size_padded"] == 1600


def test_the_fingerprint_covers_a_field_expression_value() -> None:
    by_expression = layout(full(num_kv_heads={"expr": "max(1, 8 // tp_size)"}), heads=8)
    stated = {heads: layout(full(num_kv_heads=heads), heads=8) for heads in (1, 2)}
    at_tp_4 = plan(by_expression, 4).fingerprint
    assert (at_tp_4 == plan(stated[2], 4).fingerprint, at_tp_4 == plan(stated[1], 4).fingerprint) == (True, False)


LAYOUT_TEXT = """\
version: 1
kind: ModelLayout
model: m
total_num_kv_heads: 2
groups:
  - spec:
      type: FullAttentionSpec
      bases: [AttentionSpec, KVCacheSpec]
      block_size: 16
      page_size_bytes: 4096
      fields: {num_kv_heads: {expr: "max(1, 2 // tp_sise)"}}
    layers: [l0]
"""


def test_a_field_expression_reading_an_unknown_name_is_located() -> None:
    _, problems = check_text(LAYOUT_TEXT, "l.yaml")
    (error,) = problems
    assert (error.line, "unknown variable 'tp_sise'; did you mean 'tp_size'?" in error.message) == (11, True)


def test_a_field_expression_may_not_read_a_spec_field() -> None:
    _, problems = check_text(LAYOUT_TEXT.replace("tp_sise", "head_size"), "l.yaml")
    assert [problem.line for problem in problems] == [11]


def test_a_block_size_below_one_at_some_tp_is_refused_naming_the_group_and_topology() -> None:
    document = layout(full(block_size="16 // tp_size"), heads=8)
    plan(document, 16)  # one token per block: allowed
    with pytest.raises(PlanError, match=r"group 0: FullAttentionSpec at tp_size 32, .*: block_size '16 // tp_size' is 0"):
        plan(document, 32)


def test_uniform_members_with_different_block_sizes_at_a_tp_are_refused() -> None:
    document = layout([full(block_size="16 * tp_size"), full(block_size=16, sliding_window=128)], heads=8)
    assert plan(document, 1).groups[0].chunk_tokens == 16
    with pytest.raises(PlanError, match="block sizes 32, 16 at tp_size 2"):
        plan(document, 2)


@pytest.mark.parametrize("name", ["kimi-linear-48b-a3b", "qwen3-next-80b-a3b", "nemotron-h-8b", "llama-3.1-70b"])
def test_an_example_layout_with_expressions_dumps_and_reads_back_equal(name: str) -> None:
    example = load_layout(name)
    document, problems = check_text(dump_layout(example), "dumped.yaml")
    assert (problems, document) == ([], example)


@pytest.mark.parametrize("name", ["kimi-linear-48b-a3b", "qwen3-next-80b-a3b", "nemotron-h-8b", "gpt-oss-120b"])
def test_the_json_schema_accepts_the_example_layouts_with_expressions(name: str) -> None:
    schema = json.loads((schemas_dir() / "layout.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(load_layout(name).model_dump(mode="json"))


def test_the_json_schema_refuses_a_field_mapping_that_is_not_an_expression() -> None:
    schema = json.loads((schemas_dir() / "layout.schema.json").read_text())
    data = load_layout("llama-3.1-70b").model_dump(mode="json")
    data["groups"][0]["spec"]["fields"]["num_kv_heads"] = {"exp": "8"}
    _, problems = check_text(json.dumps(data), "l.json")
    assert [problem.message for problem in problems] == [
        "num_kv_heads: a mapping as a field value must be {expr: EXPRESSION} (a value that depends on the "
        "topology), not one with keys 'exp'"
    ]
    assert not jsonschema.Draft202012Validator(schema).is_valid(data)


def test_prompt_traffic_counts_chunks_of_the_block_at_the_plan_topology() -> None:
    kimi = load_layout("kimi-linear-48b-a3b")
    hits = {tp: prompt_traffic(plan(kimi, tp), kimi, 2000).hit_tokens for tp in (1, 2, 4, 8)}
    assert hits == {1: 1920, 2: 1024, 4: 1536, 8: 1792}

