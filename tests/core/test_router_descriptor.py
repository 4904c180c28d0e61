"""Dynamo's router descriptor (``kvpolicy keys --format dynamo``): Dynamo's field names, every group's
kind, geometry and exact lookup prefixes; within Dynamo's limits for every shipped policy on every
example layout it can describe; MLA and every other class Dynamo has no kind for refused rather than
left out; and a validator that refuses what Dynamo's refuses, at its limits exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from core_support import full, layout, mamba, mla, spec

from kvpolicy.app.cli import main
from kvpolicy.documents.loader import layouts_dir, load_layout, load_policy, policies_dir
from kvpolicy.documents.settings import KVPolicySettings, SettingsError
from kvpolicy.evidence.routers import (
    DYNAMO_MAX_GROUPS,
    DYNAMO_MAX_PREFIX_BYTES,
    DYNAMO_MAX_PREFIXES,
    DYNAMO_PINNED_ADAPTER,
    DynamoCoordinator,
    DynamoDescriptor,
    DynamoGroup,
    DynamoHashContract,
    DynamoInputContract,
    RouterExportError,
    check_dynamo_descriptor,
    dynamo_descriptor,
    dynamo_refusals,
)
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.models import Layout, Topology
from kvpolicy.planning.contract import KeyContract, key_contract
from kvpolicy.planning.engine import make_plan, plan_deployment

REPO = Path(__file__).resolve().parents[2]
POLICY_FILES = sorted(policies_dir().glob("*.yaml")) + sorted((REPO / "examples" / "policies").glob("*.yaml"))
LAYOUT_NAMES = tuple(path.stem for path in sorted(layouts_dir().glob("*.yaml")))
TOPOLOGIES: tuple[tuple[dict[str, int], dict[str, object]], ...] = (
    ({"tp_size": 1}, {}),
    ({"tp_size": 2}, {"cache_prefix": "tenant-a"}),
    ({"tp_size": 4}, {}),
    ({"tp_size": 8}, {}),
    ({"tp_size": 4, "pp_size": 2}, {}),
    ({"tp_size": 2, "pcp_size": 2}, {}),
    ({"tp_size": 4, "dcp_size": 2}, {}),
    ({"tp_size": 2}, {"store_tp_size": 8}),
)
DYNAMO_KINDS = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_window", "MambaSpec": "mamba"}
"""The spec classes Dynamo's exporter knows, by its ``type(spec) is`` checks."""
DESCRIPTOR_FIELDS = {
    "schema_version", "adapter", "vllm_revision", "hash", "input", "main_event_group", "main_event_block_size",
    "gpu_to_store_group", "coordinator", "groups",
}
GROUP_FIELDS = {
    "group_id", "kind", "spec", "manager", "block_size", "hash_block_size", "key_prefixes", "sliding_window",
    "mamba_cache_mode",
}
"""Dynamo's ``Descriptor`` and ``Group`` structs (``deny_unknown_fields``), field for field."""


def contract_of(policy: str, document: Layout, **sizes: int) -> KeyContract:
    return key_contract(make_plan(load_policy(policy), document, Topology(**sizes)), document)


# --- every shipped policy on every example layout ------------------------------------------------


def unobservable_windows(contract: KeyContract, document: Layout) -> list[int]:
    """The sliding-window groups whose window boundaries Dynamo's router cannot see (its rule: a window
    group's block is a multiple of the first full-attention group's, or its window fits in one block)."""
    kinds = [group.members[0].spec.type for group in document.groups]
    main = contract.groups[kinds.index("FullAttentionSpec")].chunk_tokens
    found = []
    for index, (kind, group) in enumerate(zip(kinds, document.groups, strict=True)):
        if kind != "SlidingWindowSpec":
            continue
        window = group.members[0].spec.fields["sliding_window"]
        block = contract.groups[index].chunk_tokens
        if block % main and math.ceil((window - 1) / block) != 1:
            found.append(index)
    return found


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
@pytest.mark.parametrize("policy_path", POLICY_FILES, ids=[path.stem for path in POLICY_FILES])
def test_a_shipped_plan_is_described_within_dynamos_limits_or_refused_with_the_reason(
    policy_path: Path, layout_name: str
) -> None:
    policy, document = load_policy(policy_path), load_layout(layout_name)
    classes = {member.spec.type for group in document.groups for member in group.members}
    expressible = classes <= set(DYNAMO_KINDS) and "FullAttentionSpec" in classes
    checked = 0
    for sizes, options in TOPOLOGIES:
        try:
            plan, planned, _ = plan_deployment(policy, document, Topology(**sizes), extra_config=options)
        except PlanError:
            continue
        contract = key_contract(plan, planned)
        if not expressible:
            with pytest.raises(RouterExportError):
                dynamo_descriptor(contract, planned)
            continue
        descriptor = dynamo_descriptor(contract, planned)
        assert [group.key_prefixes for group in descriptor.groups] == [
            tuple(sorted(group.lookup_prefixes)) for group in contract.groups
        ]
        assert [group.kind for group in descriptor.groups] == [
            DYNAMO_KINDS[group.members[0].spec.type] for group in planned.groups
        ]
        problems = check_dynamo_descriptor(descriptor).problems
        refused = unobservable_windows(contract, planned)
        assert [int(problem.split(" ", 2)[1].rstrip(":")) for problem in problems] == refused, problems
        checked += 1
    assert checked >= 4 or not expressible


def test_the_json_has_dynamos_field_names_and_reads_back_equal() -> None:
    descriptor = dynamo_descriptor(contract_of("default", load_layout("gpt-oss-120b"), tp_size=2), load_layout("gpt-oss-120b"))
    data = json.loads(json.dumps(descriptor.model_dump(mode="json")))
    assert set(data) == DESCRIPTOR_FIELDS
    assert all(set(group) == GROUP_FIELDS for group in data["groups"])
    assert DynamoDescriptor.model_validate(data) == descriptor


def test_a_field_dynamo_does_not_have_is_refused_on_reading() -> None:
    data = dynamo_descriptor(contract_of("default", load_layout("llama-3.1-70b"), tp_size=2),
                             load_layout("llama-3.1-70b")).model_dump(mode="json")
    data["groups"][0]["extra"] = 1
    with pytest.raises(ValueError):
        DynamoDescriptor.model_validate(data)


# --- what a group is -----------------------------------------------------------------------------


def test_the_main_event_group_is_the_first_full_attention_group() -> None:
    document = load_layout("gpt-oss-120b")  # sliding window first, then full attention
    descriptor = dynamo_descriptor(contract_of("default", document, tp_size=2), document)
    assert [group.kind for group in descriptor.groups] == ["sliding_window", "full_attention"]
    assert descriptor.main_event_group == 1
    assert descriptor.groups[0].sliding_window == 128


def test_the_hash_block_is_the_gcd_and_the_coordinator_block_the_lcm_of_the_groups() -> None:
    document = layout(mamba(block_size=64, mamba_cache_mode="align"), full(block_size=16), heads=8)
    descriptor = dynamo_descriptor(contract_of("default", document, tp_size=2), document)
    assert {group.hash_block_size for group in descriptor.groups} == {math.gcd(64, 16)}
    assert descriptor.coordinator.lcm_block_size == math.lcm(64, 16)
    assert descriptor.main_event_block_size == 16


def test_an_aligned_mamba_block_above_the_hash_block_gives_partial_hash_hits() -> None:
    document = layout(mamba(block_size=64, mamba_cache_mode="align"), full(block_size=16), heads=8)
    assert dynamo_descriptor(contract_of("default", document, tp_size=2), document).coordinator.partial_hash_hits


def test_one_full_attention_group_has_no_partial_hash_hits() -> None:
    document = load_layout("llama-3.1-70b")
    assert not dynamo_descriptor(contract_of("default", document, tp_size=2), document).coordinator.partial_hash_hits


@pytest.mark.parametrize(
    "groups, words",
    [
        ([mla()], "MLAAttentionSpec (an MLA latent)"),
        ([spec("SinkFullAttentionSpec", sink_len=4)], "holds SinkFullAttentionSpec"),
        ([full(sliding_window=64)], "has a sliding window"),
        ([mamba(mamba_cache_mode="all"), full()], "mamba_cache_mode 'all'"),
        ([mamba(mamba_cache_mode="align", num_speculative_blocks=2), full()], "2 speculative blocks"),
        ([spec("SlidingWindowSpec")], "no sliding window"),
        ([mamba(mamba_cache_mode="align")], "no group is full attention"),
    ],
    ids=["mla", "sink", "full-with-window", "mamba-not-aligned", "mamba-speculative", "window-unknown", "attention-free"],
)
def test_a_plan_dynamo_cannot_describe_is_refused_with_the_reason(groups: list, words: str) -> None:
    document = layout(*groups, heads=0 if words == "no group is full attention" else 8)
    with pytest.raises(RouterExportError) as refused:
        dynamo_descriptor(contract_of("vllm-compat", document, tp_size=2), document)
    assert any(words in problem for problem in refused.value.problems), refused.value.problems


def test_every_group_dynamo_cannot_describe_is_named() -> None:
    document = layout(mla(), full(), spec("SinkFullAttentionSpec", sink_len=4), heads=8)
    with pytest.raises(RouterExportError) as refused:
        dynamo_descriptor(contract_of("vllm-compat", document, tp_size=2), document)
    assert [problem.split(" ", 2)[1] for problem in refused.value.problems] == ["0", "2"]


# --- what today's Dynamo refuses besides the format ---------------------------------------------


def test_dynamo_refuses_any_adapter_but_its_own() -> None:
    document = load_layout("llama-3.1-70b")
    check = check_dynamo_descriptor(dynamo_descriptor(contract_of("default", document, tp_size=2), document))
    assert check.valid and any(DYNAMO_PINNED_ADAPTER in reason for reason in check.pinned)


def test_context_parallelism_is_named_as_refused_by_dynamo() -> None:
    document = layout(full(), heads=1)  # DCP needs more TP ranks than KV heads
    contract = contract_of("default", document, tp_size=4, dcp_size=2)
    assert any("context parallelism" in reason for reason in dynamo_refusals(contract, dynamo_descriptor(contract, document)))


def test_a_missing_cache_prefix_is_named_as_refused_by_dynamo() -> None:
    document = load_layout("llama-3.1-70b")
    bare = contract_of("default", document, tp_size=2)
    plan, planned, _ = plan_deployment(load_policy("default"), document, Topology(tp_size=2), extra_config={"cache_prefix": "t"})
    prefixed = key_contract(plan, planned)
    assert any("cache_prefix" in reason for reason in dynamo_refusals(bare, dynamo_descriptor(bare, document)))
    assert not any("cache_prefix" in reason for reason in dynamo_refusals(prefixed, dynamo_descriptor(prefixed, planned)))


# --- the validator, at Dynamo's limits -----------------------------------------------------------


def descriptor(groups: int = 1, prefixes: int = 2, *, prefix: str = "tenant@M@tp_rank:{r}@pcp0@dcp0@pp_rank:0@group:{g}",
               **changes: object) -> DynamoDescriptor:
    """A descriptor of ``groups`` full-attention groups of block 16, ``prefixes`` prefixes each."""
    built = DynamoDescriptor(
        schema_version=1,
        adapter=DYNAMO_PINNED_ADAPTER,
        vllm_revision="1085b64425a9e6f5ca52876ad32e55fda5665f4e",
        hash=DynamoHashContract(),
        input=DynamoInputContract(),
        main_event_group=0,
        main_event_block_size=16,
        gpu_to_store_group=tuple(range(groups)),
        coordinator=DynamoCoordinator(lcm_block_size=16, partial_hash_hits=False),
        groups=tuple(
            DynamoGroup(group_id=g, kind="full_attention", spec="FullAttentionSpec", manager="FullAttentionManager",
                        block_size=16, hash_block_size=16, key_prefixes=tuple(prefix.format(r=r, g=g) for r in range(prefixes)))
            for g in range(groups)
        ),
    )
    return built.model_copy(update=changes)


def problems_of(built: DynamoDescriptor) -> tuple[str, ...]:
    return check_dynamo_descriptor(built).problems


def test_the_reference_descriptor_is_valid_and_unpinned_for_dynamo() -> None:
    check = check_dynamo_descriptor(descriptor())
    assert check.problems == () and check.pinned == ()


@pytest.mark.parametrize("groups, valid", [(DYNAMO_MAX_GROUPS, True), (DYNAMO_MAX_GROUPS + 1, False)])
def test_at_most_64_groups(groups: int, valid: bool) -> None:
    assert (problems_of(descriptor(groups=groups, prefixes=1)) == ()) is valid


@pytest.mark.parametrize("prefixes, valid", [(DYNAMO_MAX_PREFIXES, True), (DYNAMO_MAX_PREFIXES + 1, False)])
def test_at_most_1024_prefixes_in_all(prefixes: int, valid: bool) -> None:
    assert (problems_of(spread(prefixes)) == ()) is valid


def spread(total: int) -> DynamoDescriptor:
    """Four groups holding ``total`` prefixes between them."""
    built = descriptor(groups=4, prefixes=1)
    groups = tuple(
        group.model_copy(update={"key_prefixes": tuple(f"t@M@tp_rank:{r}@pcp0@dcp0@pp_rank:0@group:{g}"
                                                        for r in range(g, total, 4))})
        for g, group in enumerate(built.groups)
    )
    return built.model_copy(update={"groups": groups})


@pytest.mark.parametrize(
    "prefix, valid",
    [("é" * (DYNAMO_MAX_PREFIX_BYTES // 2), True), ("é" * (DYNAMO_MAX_PREFIX_BYTES // 2) + "x", False),
     ("x" * DYNAMO_MAX_PREFIX_BYTES, True)],
    ids=["4096-bytes-of-2-byte-characters", "4097-bytes", "4096-ascii"],
)
def test_a_prefix_is_at_most_4096_bytes_of_utf_8(prefix: str, valid: bool) -> None:
    built = descriptor(prefixes=1)
    group = built.groups[0].model_copy(update={"key_prefixes": (prefix,)})
    assert (problems_of(built.model_copy(update={"groups": (group,)})) == ()) is valid


def with_group(built: DynamoDescriptor, index: int = 0, **changes: object) -> DynamoDescriptor:
    groups = list(built.groups)
    groups[index] = groups[index].model_copy(update=changes)
    return built.model_copy(update={"groups": tuple(groups)})


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d.model_copy(update={"schema_version": 2}), "schema_version"),
        (lambda d: with_group(d, key_prefixes=("t@M@tp_rank:0@",)), "not end in '@'"),
        (lambda d: with_group(d, key_prefixes=("",)), "must be 1 to"),
        (lambda d: with_group(d, key_prefixes=()), "no key prefix"),
        (lambda d: with_group(d, 1, key_prefixes=d.groups[0].key_prefixes), "listed twice"),
        (lambda d: with_group(d, 1, group_id=2), "group_id 2"),
        (lambda d: d.model_copy(update={"gpu_to_store_group": (1, 0)}), "in order"),
        (lambda d: d.model_copy(update={"main_event_group": 5}), "is no store group"),
        (lambda d: with_group(d, 0, kind="sliding_window", spec="SlidingWindowSpec", manager="SlidingWindowManager",
                              sliding_window=8), "not a full-attention group"),
        (lambda d: d.model_copy(update={"hash": DynamoHashContract(algorithm="xxhash")}), "hash contract"),
        (lambda d: d.model_copy(update={"input": DynamoInputContract(text_only=False)}), "input contract"),
        (lambda d: d.model_copy(update={"coordinator": DynamoCoordinator(lcm_block_size=16, speculative=True,
                                                                         partial_hash_hits=False)}), "speculative"),
        (lambda d: with_group(d, 1, kind="mamba", spec="MambaSpec", manager="MambaManager"), "mamba_cache_mode 'align'"),
        (lambda d: with_group(d, 1, spec="MLAAttentionSpec"), "must be FullAttentionSpec"),
        (lambda d: with_group(d, 1, hash_block_size=8), "do not divide evenly"),
        (lambda d: with_group(d, 1, block_size=12), "do not divide evenly"),
    ],
    ids=["schema-2", "trailing-at", "empty-prefix", "no-prefixes", "duplicate-prefix", "gap-in-group-ids",
         "projection-out-of-order", "main-group-missing", "main-group-not-full", "hash-algorithm", "input-contract",
         "speculative", "mamba-not-aligned", "not-the-stock-class", "hash-block-differs", "block-not-dividing"],
)
def test_the_validator_refuses_what_dynamo_refuses(mutate, words: str) -> None:
    found = problems_of(mutate(descriptor(groups=2)))
    assert any(words in problem for problem in found), found


def test_a_sliding_window_of_one_block_may_have_a_smaller_block_than_the_main_group() -> None:
    built = with_group(descriptor(groups=2), 1, kind="sliding_window", spec="SlidingWindowSpec",
                       manager="SlidingWindowManager", sliding_window=8, block_size=8, hash_block_size=8)
    built = with_group(built, 0, hash_block_size=8)
    assert problems_of(built) == ()
    assert problems_of(with_group(built, 1, sliding_window=10)) != ()


# --- the command line ------------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_keys_format_dynamo_prints_the_descriptor_of_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "keys", "--policy", "default", "--layout", "qwen3-next-80b-a3b", "--tp", "4",
                         "--cache-prefix", "tenant-a", "--format", "dynamo")
    assert code == 0
    printed = DynamoDescriptor.model_validate_json(out)
    document = load_layout("qwen3-next-80b-a3b")
    plan, planned, _ = plan_deployment(load_policy("default"), document, Topology(tp_size=4), extra_config={"cache_prefix": "tenant-a"})
    assert printed == dynamo_descriptor(key_contract(plan, planned), planned)
    assert f"'{DYNAMO_PINNED_ADAPTER}'" in err and "note:" in err


def test_keys_format_dynamo_refuses_an_mla_model_with_the_group_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "keys", "--policy", "default", "--layout", "deepseek-v3", "--tp", "2", "--format", "dynamo")
    assert code == 1
    assert out.startswith("error: no Dynamo descriptor: group 0 (mla) holds MLAAttentionSpec") and "{" not in out


# --- the connector option --------------------------------------------------------------------------


def test_the_connector_takes_a_path_for_the_dynamo_descriptor() -> None:
    assert KVPolicySettings.parse({"kvpolicy_dynamo_json": "run/dynamo.json"}).kvpolicy_dynamo_json == Path("run/dynamo.json")


def test_an_empty_dynamo_path_writes_none() -> None:
    assert KVPolicySettings.parse({"kvpolicy_dynamo_json": ""}).kvpolicy_dynamo_json is None


def test_a_dynamo_path_that_is_no_path_is_refused_at_its_key() -> None:
    with pytest.raises(SettingsError) as refused:
        KVPolicySettings.parse({"kvpolicy_dynamo_json": 3})
    assert refused.value.problems[0].startswith("kv_connector_extra_config.kvpolicy_dynamo_json: error: must be a file path")
