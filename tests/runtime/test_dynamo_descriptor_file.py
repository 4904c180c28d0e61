"""The connector's ``kvpolicy_dynamo_json``: the first rank writes Dynamo's router descriptor of the
plan it runs beside the key contract, rewrites it when the audit changes the plan, and writes none
(removing one left from before) for a plan Dynamo cannot describe."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime_support import TP, ListGather, MemoryStore, audited_policy, hybrid_layout, logged, planner

from kvpolicy.documents.loader import load_layout
from kvpolicy.evidence.audit import Digest
from kvpolicy.evidence.routers import DynamoDeployment, DynamoDescriptor, check_dynamo_descriptor
from kvpolicy.language.models import Layout
from kvpolicy.planning.contract import key_contract
from kvpolicy.runtime.audit_step import encode_report
from kvpolicy.runtime.binding import RankPlace
from kvpolicy.runtime.policy import RankPolicy

GQA = """\
version: 1
kind: ModelLayout
model: org/gqa
total_num_kv_heads: 1
groups:
  - name: attn
    spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 1024,
           fields: {num_kv_heads: 1, max_tp_shards: null}}
    layers: [l.0.attn]
"""
"""One KV head at TP 4: the attention group is replicated over every rank, so the audit has work."""


def gqa_layout(tmp_path: Path) -> Layout:
    path = tmp_path / "gqa.yaml"
    path.write_text(GQA, encoding="utf-8")
    return load_layout(path)


def started(layout: Layout, gather: ListGather | None = None, **kwargs) -> RankPolicy:
    policy = audited_policy()
    declared, replan = planner(policy, layout)
    runtime = RankPolicy(policy, store=MemoryStore(), gather=gather or ListGather(), **kwargs)
    runtime.start(declared, replan, layout=layout)
    return runtime


def written(path: Path) -> DynamoDescriptor:
    return DynamoDescriptor.model_validate(json.loads(path.read_text(encoding="utf-8")))


def lookup_prefixes(runtime: RankPolicy, layout: Layout) -> list[tuple[str, ...]]:
    assert runtime.decided_plan is not None
    return [tuple(sorted(group.lookup_prefixes)) for group in key_contract(runtime.decided_plan, layout).groups]


def test_the_first_rank_writes_the_descriptor_of_the_plan_it_runs(tmp_path: Path) -> None:
    layout, path = gqa_layout(tmp_path), tmp_path / "dynamo.json"
    runtime = started(layout, dynamo_json=path)
    runtime.report_plan()
    descriptor = written(path)
    assert check_dynamo_descriptor(descriptor).problems == ()
    assert [group.key_prefixes for group in descriptor.groups] == lookup_prefixes(runtime, layout)


def test_the_descriptor_follows_a_demotion(tmp_path: Path) -> None:
    layout, path = gqa_layout(tmp_path), tmp_path / "dynamo.json"
    runtime = started(layout, dynamo_json=path)
    runtime.report_plan()
    before = written(path)
    differs = [Digest("d1", all_zero=False)] * (TP - 1) + [Digest("d2", all_zero=False)]
    runtime.conclude_step(lambda: [encode_report({0: digest}) for digest in differs],
                          lambda groups: [{group: bytes(8) for group in groups} for _ in range(TP)],
                          distance=lambda a, b: 1.0)
    after = written(path)
    assert runtime.decided_plan is not None and runtime.decided_plan.factors == (1,)
    assert after.groups[0].key_prefixes != before.groups[0].key_prefixes
    assert [group.key_prefixes for group in after.groups] == lookup_prefixes(runtime, layout)


def test_the_descriptor_states_the_deployment_it_is_given(tmp_path: Path) -> None:
    path = tmp_path / "dynamo.json"
    started(gqa_layout(tmp_path), dynamo_json=path, dynamo_deployment=DynamoDeployment(vllm_revision="0.32.0")).report_plan()
    assert written(path).vllm_revision == "0.32.0"


def test_a_plan_dynamo_cannot_describe_writes_none_and_removes_an_old_one(tmp_path: Path) -> None:
    path = tmp_path / "dynamo.json"
    path.write_text("{}", encoding="utf-8")
    started(hybrid_layout(tmp_path), dynamo_json=path).report_plan()  # an MLA group
    assert not path.exists()


def test_another_rank_writes_no_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "dynamo.json"
    started(gqa_layout(tmp_path), dynamo_json=path, gather=ListGather(rank=1),
            place=RankPlace(tp_rank=1, tp_size=TP)).report_plan()
    assert not path.exists()


# --- a descriptor path that cannot be written or cleared: one line, and the rank serves on ----------


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The run-time policy's warnings and errors while the block runs, none with a traceback."""
    messages: list[str] = []
    with logged() as records:
        yield messages
    assert not any(record.exc_info for record in records)
    messages.extend(record.getMessage() for record in records if record.levelno >= logging.WARNING)


def test_a_descriptor_whose_directory_was_removed_is_one_error_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    runtime = started(gqa_layout(tmp_path), dynamo_json=run / "dynamo.json")
    run.rmdir()
    with warnings_logged() as messages:
        runtime.report_plan()
    assert messages == [
        f"kvpolicy: cannot write the Dynamo router descriptor to {run / 'dynamo.json'} (kvpolicy_dynamo_json): "
        "No such file or directory; serving on without it"
    ]


def test_an_old_descriptor_that_cannot_be_removed_is_said_in_the_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "dynamo.json"
    path.mkdir()  # what stands there is no file to remove
    with warnings_logged() as messages:
        started(hybrid_layout(tmp_path), dynamo_json=path).report_plan()  # an MLA group: no descriptor
    (message,) = messages
    assert message.startswith(
        f"kvpolicy: no Dynamo router descriptor for this plan ({path} not written; the one left from before could not "
        "be removed (Is a directory)): "
    )
    assert path.is_dir()


def test_a_descriptor_path_holding_a_nul_is_one_line_whether_written_or_removed(tmp_path: Path) -> None:
    path = tmp_path / "dynamo\0.json"
    with warnings_logged() as messages:
        started(gqa_layout(tmp_path), dynamo_json=path).report_plan()
        started(hybrid_layout(tmp_path), dynamo_json=path).report_plan()
    assert [message.split(": ")[:2] for message in messages] == [
        ["kvpolicy", f"cannot write the Dynamo router descriptor to {tmp_path}/dynamo\\x00.json (kvpolicy_dynamo_json)"],
        ["kvpolicy", f"no Dynamo router descriptor for this plan ({tmp_path}/dynamo\\x00.json not written; the one left "
                     "from before could not be removed (the path contains a NUL character))"],
    ]
