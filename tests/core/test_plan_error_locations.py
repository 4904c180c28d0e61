"""A plan refused because of what a file says points at what it says: the layout's expression that
fails at a topology, the policy's ``strict:`` when no rule matches; one line each, naming the topology."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvpolicy.app.cli import main
from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.models import Topology
from kvpolicy.planning.engine import make_plan

LAYOUT = """\
version: 1
kind: ModelLayout
model: org/m
total_num_kv_heads: 2
groups:
  - spec:
      type: FullAttentionSpec
      bases: [AttentionSpec, KVCacheSpec]
      block_size: 16
      page_size_bytes: "4096 // (tp_size - 2)"
      fields: {num_kv_heads: 1, max_tp_shards: null}
    layers: ["l.{0..1}"]
  - name: state
    uniform:
      - spec:
          type: FullAttentionSpec
          bases: [AttentionSpec, KVCacheSpec]
          block_size: 16
          page_size_bytes: 4096
          fields: {num_kv_heads: 1, max_tp_shards: null, width: {expr: "64 // (tp_size - 4)"}}
        layers: ["m.{0..1}"]
"""
STRICT = """\
version: 1
kind: ReplicationPolicy
name: only-mamba
strict: true
rules:
  - name: mamba
    reason: Mamba state is sharded
    match: {spec: MambaSpec}
    replication: sharded
"""


def at(text: str, fragment: str) -> str:
    """``line:col`` of ``fragment`` in ``text``, as a diagnostic gives it."""
    before = text[: text.index(fragment)]
    return f"{before.count(chr(10)) + 1}:{len(before) - before.rfind(chr(10))}"


@pytest.fixture
def layout_file(tmp_path: Path) -> Path:
    path = tmp_path / "layout.yaml"
    path.write_text(LAYOUT)
    return path


def refusals(policy: str, layout: Path | str, tp_size: int) -> tuple[str, ...]:
    with pytest.raises(PlanError) as raised:
        make_plan(load_policy(policy), load_layout(layout), Topology(tp_size=tp_size))
    return tuple(str(problem) for problem in raised.value.problems)


def test_a_page_size_dividing_by_zero_at_a_topology_points_at_its_expression(layout_file: Path) -> None:
    (problem,) = refusals("default", layout_file, 2)
    assert problem == (
        f"{layout_file}:{at(LAYOUT, '4096 // (')}: error: group 0: FullAttentionSpec at tp_size 2, pp_size 1, pcp_size 1, "
        "dcp_size 1: "
        "page_size_bytes: division by zero in '4096 // (tp_size - 2)'"
    )


def test_a_page_size_negative_at_a_topology_points_at_its_expression(layout_file: Path) -> None:
    (problem,) = refusals("default", layout_file, 1)
    assert problem.startswith(f"{layout_file}:{at(LAYOUT, '4096 // (')}: error: group 0: FullAttentionSpec at tp_size 1,")
    assert problem.endswith("page_size_bytes '4096 // (tp_size - 2)' is -4096, not a byte count")


def test_a_field_expression_of_a_uniform_member_failing_at_a_topology_points_at_it(layout_file: Path) -> None:
    (problem,) = refusals("default", layout_file, 4)
    expression = at(LAYOUT, "64 // (")
    assert problem.startswith(f"{layout_file}:{expression}: error: group 1 (state): FullAttentionSpec at tp_size 4,")
    assert problem.endswith("field 'width': division by zero in '64 // (tp_size - 4)'")


def test_a_strict_policy_matching_no_rule_points_at_strict_and_names_the_topology(tmp_path: Path) -> None:
    policy = tmp_path / "strict.yaml"
    policy.write_text(STRICT)
    (problem,) = refusals(str(policy), "llama-3.1-70b", 2)
    assert problem.startswith(f"{policy}:{at(STRICT, 'true')}: error: group 0 (full), layers ")
    assert " at tp_size 2, pp_size 1, pcp_size 1, dcp_size 1: no rule matches FullAttentionSpec" in problem


def test_the_cli_prints_each_located_refusal_on_one_line(layout_file: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["plan", "--policy", "default", "--layout", str(layout_file), "--tp", "2"])
    (line,) = out.getvalue().splitlines()
    assert code == 1 and line.startswith(f"{layout_file}:{at(LAYOUT, '4096 // (')}: error: group 0: ")
    assert line.endswith(" [KVP301]")


def test_a_layout_built_in_code_refuses_the_same_plan_without_a_location(layout_file: Path) -> None:
    built = load_layout(layout_file).model_copy()  # a copy keeps no origins: it was not read from a file
    with pytest.raises(PlanError) as raised:
        make_plan(load_policy("default"), type(built).model_validate(built.model_dump()), Topology(tp_size=2))
    (problem,) = raised.value.problems
    assert problem.location is None and "division by zero" in problem.message
