"""Keys routers can read: the port of Mooncake Conductor's ``ParseVllmObjectKey`` refuses what it
refuses and reads what it reads; every key of every shipped policy on every example layout, at the
topologies vLLM allows, reads under it into exactly the namespace, rank, pcp, dcp, pp and group the
key contract states; the ``KVP205`` warning fires on templates whose keys it would misread, at the
template, and on no shipped one."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpolicy.documents.loader import check_text, layouts_dir, load_layout, load_policy, policies_dir
from kvpolicy.evidence.routers import ConductorKey, ConductorRefusal, parse_vllm_object_key, template_router_problems
from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.keys import AGREEMENT_MARKER, UPSTREAM_KEY_TEMPLATE, chunk_key, marker_key
from kvpolicy.language.models import AuditMode, Policy, Topology
from kvpolicy.planning.contract import KeyContract, key_contract
from kvpolicy.planning.engine import make_plan, plan_deployment
from kvpolicy.planning.plan import Plan

REPO = Path(__file__).resolve().parents[2]
POLICY_FILES = sorted(policies_dir().glob("*.yaml")) + sorted((REPO / "examples" / "policies").glob("*.yaml"))
LAYOUT_NAMES = tuple(path.stem for path in sorted(layouts_dir().glob("*.yaml")))
SHA256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
HASH16 = "0123456789abcdef"

TOPOLOGIES: tuple[tuple[dict[str, int], dict[str, object]], ...] = (
    ({"tp_size": 1}, {}),
    ({"tp_size": 2}, {}),
    ({"tp_size": 4}, {}),
    ({"tp_size": 8}, {}),
    ({"tp_size": 4, "pp_size": 2}, {}),
    ({"tp_size": 2, "pp_size": 4}, {}),
    ({"tp_size": 4, "dcp_size": 2}, {}),
    ({"tp_size": 8, "dcp_size": 4}, {}),
    ({"tp_size": 2, "pcp_size": 2}, {}),
    ({"tp_size": 2, "pcp_size": 2, "dcp_size": 2}, {}),
    ({"tp_size": 2, "pcp_size": 2, "dcp_size": 4}, {}),
    ({"tp_size": 2}, {"store_tp_size": 8}),
    ({"tp_size": 4}, {"cache_prefix": "tenant-a"}),
    ({"tp_size": 8, "pp_size": 2}, {"cache_prefix": "org@tenant"}),
)
"""(parallel sizes, ``kv_connector_extra_config``): TP 1-8, PP, DCP over TP, PCP with each DCP vLLM
allows beside it, a TP-sharded store, cache prefixes (one holding '@')."""


def conductor(key: str) -> ConductorKey:
    parsed = parse_vllm_object_key(key)
    assert isinstance(parsed, ConductorKey), parsed
    return parsed


def refusal(key: str) -> ConductorRefusal:
    parsed = parse_vllm_object_key(key)
    assert isinstance(parsed, ConductorRefusal), parsed
    return parsed


# --- the port reads what Conductor reads --------------------------------------------------------


def test_a_labelled_vllm_key_reads_into_its_fields() -> None:
    parsed = conductor(f"deployment-a@model-a@tp_rank:2@pcp1@dcp0@pp_rank:3@group:4@{HASH16}000000000000002a")
    assert (parsed.layout, parsed.tp_rank, parsed.pcp_rank, parsed.dcp_rank, parsed.pp_rank, parsed.group) == (
        "vllm", 2, 1, 0, 3, 4
    )
    assert (parsed.namespace, parsed.model) == ("deployment-a@model-a", "model-a")


def test_conductors_namespace_prefix_leaves_out_the_part_before_tp_rank() -> None:
    # JoinParts(parts, 0, index - 1): the part just before tp_rank (the model) is not in it.
    assert conductor(f"deployment-a@model-a@tp_rank:0@pcp0@dcp0@pp_rank:0@{SHA256}").namespace_prefix == "deployment-a"
    assert conductor(f"model-b@tp_rank:0@pcp0@dcp0@pp_rank:0@{SHA256}").namespace_prefix == ""


def test_conductors_namespace_prefix_drops_leading_empty_parts_as_join_parts_does() -> None:
    assert conductor(f"@@a@m@tp_rank:0@pcp0@dcp0@pp_rank:0@{SHA256}").namespace_prefix == "a"


def test_a_key_without_a_group_part_reads_with_no_group() -> None:
    assert conductor(f"model-b@tp_rank:0@pcp0@dcp0@pp_rank:0@{HASH16}").group is None


def test_cache_role_and_cache_family_are_read_after_the_group() -> None:
    parsed = conductor(f"m@tp_rank:1@pcp0@dcp0@pp_rank:0@group:2@cache_role:k@cache_family:fp1@{SHA256}")
    assert (parsed.group, parsed.cache_role, parsed.cache_family) == (2, "k", "fp1")


def test_the_hash_reads_lowercase_without_0x_and_indexes_its_low_64_bits() -> None:
    parsed = conductor("m@tp_rank:0@pcp0@dcp0@pp_rank:0@0XFEDCBA9876543210000000000000002A")
    assert parsed.full_hash == "fedcba9876543210000000000000002a"
    assert parsed.low64 == 42


def test_leading_zeros_are_a_decimal_number() -> None:
    assert conductor(f"m@tp_rank:007@pcp0@dcp0@pp_rank:0@{SHA256}").tp_rank == 7


def test_a_vllm_ascend_key_reads_as_ascend_without_a_tp_rank() -> None:
    parsed = conductor(f"model-c@pcp0@dcp1@head_or_tp_rank:2@pp_rank:3@{HASH16}")
    assert (parsed.layout, parsed.head_or_tp_rank, parsed.dcp_rank, parsed.pp_rank, parsed.tp_rank) == (
        "vllm-ascend", 2, 1, 3, None
    )


def test_a_vllm_ascend_layer_number_after_the_hash_is_read_as_the_layer() -> None:
    parsed = conductor(f"model-d@pcp0@dcp0@head_or_tp_rank:1@{HASH16}@7")
    assert (parsed.layout, parsed.layer_id, parsed.full_hash) == ("vllm-ascend", 7, HASH16)


@pytest.mark.parametrize("key, group", [(f"model@{HASH16}@3", None), (f"model@5@{HASH16}@3", 5)])
def test_a_compact_key_of_three_or_four_parts_reads_as_ascend_compact(key: str, group: int | None) -> None:
    parsed = conductor(key)
    assert (parsed.layout, parsed.group, parsed.head_or_tp_rank) == ("vllm-ascend-compact", group, 3)


# --- the port refuses what Conductor refuses ----------------------------------------------------


@pytest.mark.parametrize(
    "key, part",
    [
        (f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH16[:14]}", "not a hash"),
        (f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH16}a", "not a hash"),
        (f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASH16[:-1]}g", "not a hash"),
        (f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@0x{HASH16[:14]}", "not a hash"),
        (f"m@tp_rank:0@dcp0@pp_rank:0@group:0@x@{SHA256}", "'@pcpN'"),
        (f"m@tp_rank:0@pcp0@pp_rank:0@group:0@x@{SHA256}", "'@dcpN'"),
        (f"m@tp_rank:0@pcp0@dcp0@group:0@x@{SHA256}", "'@pp_rank:N'"),
        (f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@demoted:0123456789ab@{SHA256}", "'@demoted:0123456789ab'"),
        (f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@cache_family:f@group:0@{SHA256}", "in that order"),
        (f"m@tp_rank:-1@pcp0@dcp0@pp_rank:0@{SHA256}", "no part after the first"),
        (f"m@tp_rank:+1@pcp0@dcp0@pp_rank:0@{SHA256}", "no part after the first"),
        (f"m@tp_rank:@pcp0@dcp0@pp_rank:0@{SHA256}", "no part after the first"),
        (f"m@tp_rank:18446744073709551616@pcp0@dcp0@pp_rank:0@{SHA256}", "no part after the first"),
        (f"tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{SHA256}", "the first part"),
        (f"m@tp_rank:0@pcp0@dcp0@{SHA256}", "at least 6"),
    ],
    ids=[
        "hash-of-14-digits", "odd-length-hash", "non-hex-hash", "short-hash-after-0x", "missing-pcp", "missing-dcp",
        "missing-pp-rank", "demoted-suffix", "labels-out-of-order", "negative-rank", "signed-rank", "empty-rank",
        "rank-beyond-64-bits", "tp-rank-first", "five-parts",
    ],
)
def test_conductor_refuses_a_key_and_the_port_says_which_part(key: str, part: str) -> None:
    found = refusal(key)
    assert part in found.detail
    assert found.reason in ("unrecognized vLLM/vLLM-Ascend object_key", "vLLM object_key has too few fields")


def test_the_largest_64_bit_rank_is_still_a_number() -> None:
    assert conductor(f"m@tp_rank:18446744073709551615@pcp0@dcp0@pp_rank:0@{SHA256}").tp_rank == 2**64 - 1


def test_a_thousand_digit_rank_is_refused_without_an_error() -> None:
    assert isinstance(parse_vllm_object_key(f"m@tp_rank:{'9' * 5000}@pcp0@dcp0@pp_rank:0@{SHA256}"), ConductorRefusal)


def test_an_audit_marker_is_not_read_as_a_chunk() -> None:
    prefix = "M@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
    assert isinstance(parse_vllm_object_key(marker_key(prefix, AGREEMENT_MARKER, "0123456789ab", replicas=2)), ConductorRefusal)


# --- every shipped key reads as the contract states ---------------------------------------------


def stated_namespace(contract: KeyContract) -> str:
    """Everything before '@tp_rank:' of the contract's keys, from the contract's own fields: the
    template's head rendered with the deployment's values and the plan fingerprint."""
    head, separator, _ = contract.template.partition("@tp_rank:{shard}")
    assert separator, contract.template
    return head.format(
        cache_prefix=f"{contract.cache_prefix}@" if contract.cache_prefix else "",
        model=contract.model,
        store_namespace=contract.store_namespace,
        fingerprint=contract.fingerprint,
    )


def mismatches(plan: Plan, contract: KeyContract) -> Iterator[str]:
    """Every chunk key of ``contract`` Conductor does not read as the contract states it."""
    namespace = stated_namespace(contract)
    for group in contract.groups:
        for rank in group.ranks:
            shards = plan.groups[group.index].ranks[rank.tp_rank].key_shards
            for shard, prefix in zip(shards, rank.prefixes, strict=True):
                key = chunk_key(prefix, SHA256)
                parsed = parse_vllm_object_key(key)
                stated = ("vllm", namespace, shard, rank.pcp_rank, rank.dcp_rank, rank.pp_rank, group.index, SHA256)
                read = None if isinstance(parsed, ConductorRefusal) else (
                    parsed.layout, parsed.namespace, parsed.tp_rank, parsed.pcp_rank, parsed.dcp_rank,
                    parsed.pp_rank, parsed.group, parsed.full_hash,
                )
                if read != stated:
                    yield f"{key}: read {read or parsed}, stated {stated}"


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
@pytest.mark.parametrize("policy_path", POLICY_FILES, ids=[path.stem for path in POLICY_FILES])
def test_every_key_of_a_shipped_policy_reads_under_conductors_grammar_as_the_contract_states(
    policy_path: Path, layout_name: str
) -> None:
    policy, layout = load_policy(policy_path), load_layout(layout_name)
    planned, found = 0, []
    for sizes, options in TOPOLOGIES:
        try:
            plan, document, _ = plan_deployment(policy, layout, Topology(**sizes), extra_config=options)
        except PlanError:
            continue  # a topology the engine (or vLLM) refuses for this layout has no keys
        plans = [plan]
        if policy.audit.mode is not AuditMode.OFF:  # what an instance runs after the audit demoted every group
            plans.append(make_plan(policy, document, plan.topology, key_context=plan.key_context,
                                   demoted=range(len(plan.groups)), store_sharding=plan.store_sharding))
        for each in plans:
            found.extend(mismatches(each, key_contract(each, document)))
        planned += 1
    assert planned >= 4, f"only {planned} topologies planned"
    assert found == []


def test_a_demoted_group_of_a_template_without_the_fingerprint_is_refused() -> None:
    # Why KVP205 warns of such a template under an audit: the demoted suffix follows the group.
    document = load_layout("llama-3.1-70b")
    plan = make_plan(load_policy("vllm-compat"), document, Topology(tp_size=2), demoted={0})
    assert isinstance(parse_vllm_object_key(chunk_key(plan.key_prefix(0, 0), SHA256)), ConductorRefusal)


# --- KVP205 ---------------------------------------------------------------------------------------


def policy_text(template: str | None, audit: str = "off") -> str:
    key = "" if template is None else f'key:\n  template: "{template}"\n'
    return textwrap.dedent("""\
        version: 1
        kind: ReplicationPolicy
        name: example
        rules:
          - name: kv-heads
            reason: Heads repeat over TP ranks.
            factor: max(1, tp_size // total_num_kv_heads)
        """) + key + f'audit:\n  mode: "{audit}"\n'


def router_warnings(template: str | None, audit: str = "off") -> list:
    document, problems = check_text(policy_text(template, audit), "policy.yaml")
    assert isinstance(document, Policy), [str(problem) for problem in problems]
    return [problem for problem in problems if problem.code == "KVP205"]


VLLM_TAIL = "@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}"


@pytest.mark.parametrize(
    "template, words",
    [
        ("{model}@tp:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}", "no part after the first is 'tp_rank:N'"),
        ("{model}" + VLLM_TAIL + "@{fingerprint}", "found '@0123456789ab'"),
        ("{model}@tp_rank:{shard}@dcp{dcp_rank}@pcp{pcp_rank}@pp_rank:{pp_rank}@group:{group}", "'@pcpN'"),
        ("{model}@tp_rank:{pcp_rank}@pcp{shard}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}", "reads tp_rank 1"),
        ("{model}@g{group}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}", "{group} lands in the namespace"),
        ("{model}@s{shard}" + VLLM_TAIL, "{shard} lands in the namespace"),
        ("{fingerprint}" + VLLM_TAIL + "@cache_family:{model}", "{model} is not in the namespace"),
        ("{model}@pcp{pcp_rank}@dcp{dcp_rank}@head_or_tp_rank:{shard}@pp_rank:{pp_rank}@group:{group}", "as vllm-ascend keys"),
    ],
    ids=["unlabelled-rank", "fingerprint-after-group", "pcp-dcp-swapped", "fields-swapped", "group-in-namespace",
         "shard-in-namespace", "model-after-the-ranks", "ascend-labels"],
)
def test_a_template_conductor_misreads_is_warned_of(template: str, words: str) -> None:
    warnings = router_warnings(template)
    assert warnings and all(warning.severity == "warning" for warning in warnings)
    assert any(words in warning.message for warning in warnings), [warning.message for warning in warnings]


def test_the_warning_points_at_the_field_at_fault_in_the_template() -> None:
    template = "{model}@g{group}@tp_rank:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}"
    (warning,) = router_warnings(template)
    line = policy_text(template).splitlines()[warning.line - 1]
    assert line[warning.column - 1 :].startswith("{group}")


def test_the_warning_says_the_fix() -> None:
    (warning,) = router_warnings("{model}@tp:{shard}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group}")
    assert VLLM_TAIL in warning.message


def test_an_audited_template_without_the_fingerprint_is_warned_of_its_demoted_keys() -> None:
    (warning,) = router_warnings(UPSTREAM_KEY_TEMPLATE, audit="warn")
    assert "@demoted:" in warning.message and "{fingerprint}" in warning.message


def test_the_same_template_without_an_audit_is_not_warned_of() -> None:
    assert router_warnings(UPSTREAM_KEY_TEMPLATE, audit="off") == []


def test_a_policy_without_a_template_keeps_vllms_keys_and_no_warning() -> None:
    assert router_warnings(None, audit="warn") == []


@pytest.mark.parametrize(
    "template",
    [
        "{cache_prefix}{model}{store_namespace}@plan:{fingerprint}" + VLLM_TAIL,
        "{cache_prefix}{fingerprint}@{model}{store_namespace}" + VLLM_TAIL,
        "{cache_prefix}{model}{store_namespace}" + VLLM_TAIL + "@cache_family:{fingerprint}",
        "{cache_prefix}{model}{store_namespace}@plan:{fingerprint}" + VLLM_TAIL + "@cache_role:kv",
    ],
    ids=["shipped-default", "fingerprint-before-model", "fingerprint-as-cache-family", "cache-role"],
)
def test_a_template_conductor_reads_right_is_not_warned_of(template: str) -> None:
    assert router_warnings(template, audit="warn") == []


@pytest.mark.parametrize("policy_path", POLICY_FILES, ids=[path.stem for path in POLICY_FILES])
def test_no_shipped_policy_template_has_a_router_problem(policy_path: Path) -> None:
    policy = load_policy(policy_path)
    assert template_router_problems(policy.key.template, audited=policy.audit.mode is not AuditMode.OFF) == ()
