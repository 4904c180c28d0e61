"""The key contract (``kvpolicy keys``): a versioned document of every store key prefix a plan reads
and writes, valid against its own JSON Schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from core_support import full, layout, mamba

from kvpolicy.documents.loader import load_layout, load_policy, schemas_dir, shipped_policy_names
from kvpolicy.language.keys import KeyContext, chunk_key
from kvpolicy.language.models import Topology
from kvpolicy.planning.contract import KEY_VERSION, KeyContract, key_contract
from kvpolicy.planning.engine import make_plan

SCHEMA = json.loads((schemas_dir() / "keys.schema.json").read_text(encoding="utf-8"))
EXAMPLES = ("deepseek-v3", "kimi-linear-48b-a3b", "llama-3.1-70b", "qwen3-next-80b-a3b")


def contract_of(policy: str, layout_name: str, **sizes: int) -> KeyContract:
    document = load_layout(layout_name)
    return key_contract(make_plan(load_policy(policy), document, Topology(**sizes)), document)


@pytest.mark.parametrize("policy", shipped_policy_names())
@pytest.mark.parametrize("layout_name", EXAMPLES)
@pytest.mark.parametrize("sizes", [{"tp_size": 1}, {"tp_size": 4}, {"tp_size": 2, "pp_size": 2}])
def test_the_contract_is_valid_against_its_schema_and_reads_back_equal(policy, layout_name, sizes) -> None:
    contract = contract_of(policy, layout_name, **sizes)
    data = json.loads(json.dumps(contract.model_dump(mode="json")))
    jsonschema.Draft202012Validator(SCHEMA).validate(data)
    assert KeyContract.model_validate(data) == contract


def test_the_schema_refuses_a_contract_with_an_unknown_field() -> None:
    data = contract_of("default", "deepseek-v3", tp_size=2).model_dump(mode="json")
    data["groups"][0]["extra"] = 1
    assert not jsonschema.Draft202012Validator(SCHEMA).is_valid(data)


def test_the_contract_names_its_key_version() -> None:
    assert contract_of("default", "deepseek-v3", tp_size=2).key_version == KEY_VERSION


def test_a_replicated_chunk_is_written_once_to_each_lookup_namespace() -> None:
    contract = contract_of("default", "deepseek-v3", tp_size=8, dcp_size=2)
    (group,) = contract.groups
    for chunk in range(2 * group.factor):
        writers = [
            prefix
            for rank in group.ranks
            if rank.writes.active and chunk % rank.writes.step == rank.writes.phase
            for prefix in rank.prefixes
        ]
        assert sorted(writers) == sorted(group.lookup_prefixes), chunk


def test_every_rank_writes_only_into_namespaces_a_lookup_reads() -> None:
    for name in EXAMPLES:
        contract = contract_of("default", name, tp_size=4, pp_size=2)
        for group in contract.groups:
            assert {p for rank in group.ranks for p in rank.prefixes} == set(group.lookup_prefixes), (name, group.name)


def test_a_state_group_stores_its_boundary_state_and_attention_its_chunks() -> None:
    document = layout(mamba(), full(), heads=2)
    contract = key_contract(make_plan(load_policy("default"), document, Topology(tp_size=2)), document)
    assert [group.stores for group in contract.groups] == ["boundary-state", "chunks"]


def test_the_cache_prefix_leads_every_key_with_its_separator() -> None:
    document = load_layout("llama-3.1-70b")
    plan = make_plan(
        load_policy("vllm-compat"), document, Topology(tp_size=2), key_context=KeyContext.for_model(document.model, "tenant-a")
    )
    prefixes = key_contract(plan, document).groups[0].lookup_prefixes
    assert prefixes == (
        "tenant-a@Llama-3.1-70B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",
        "tenant-a@Llama-3.1-70B-Instruct@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0",
    )


def test_a_demoted_group_gets_keys_of_its_own() -> None:
    document = load_layout("deepseek-v3")
    trusted, demoted = (
        key_contract(make_plan(load_policy("vllm-compat"), document, Topology(tp_size=2), demoted=d), document)
        for d in ((), (0,))
    )
    assert demoted.groups[0].demoted and not set(demoted.groups[0].lookup_prefixes) & set(trusted.groups[0].lookup_prefixes)


def test_a_chunk_key_is_its_namespace_an_at_sign_and_the_hash() -> None:
    contract = contract_of("default", "deepseek-v3", tp_size=2)
    prefix = contract.groups[0].lookup_prefixes[0]
    assert contract.chunk_key.format.format(prefix=prefix, chunk_hash="ab12") == chunk_key(prefix, "ab12")


def test_a_contract_beyond_its_bound_is_refused_before_it_is_built() -> None:
    from kvpolicy.language.diagnostics import PlanError
    from kvpolicy.planning.contract import MAX_CONTRACT_PREFIXES

    document = load_layout("llama-3.1-70b")
    plan = make_plan(load_policy("default"), document, Topology(tp_size=1024, pp_size=128))
    assert len(plan.groups) * 1024 * 128 > MAX_CONTRACT_PREFIXES
    with pytest.raises(PlanError, match="the key contract would list 131,072 key prefixes"):
        key_contract(plan, document)


def test_a_sharded_store_counts_its_shards_toward_the_plan_bound() -> None:
    from kvpolicy.language.diagnostics import PlanError
    from kvpolicy.planning.store_layout import StoreSharding

    document = layout(full(num_kv_heads=1), heads=4096).model_copy(update={"kv_cache_layout": "LBNHC"})
    with pytest.raises(PlanError, match=r"16,777,216 \(group, rank\) entries .*store_tp_size 4096"):
        make_plan(load_policy("vllm-compat"), document, Topology(tp_size=1, pp_size=4096),
                  store_sharding=StoreSharding(4096, "tp_shared_lbnhc"))
