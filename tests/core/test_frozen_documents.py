"""Loaded documents are immutable all the way down, hashable, and still dump to plain data."""

from __future__ import annotations

import pickle

import pytest
from core_support import MODEL, mamba, policy
from pydantic import ValidationError

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.models import FrozenMapping, Layout, Match, Policy, Spec, Topology

NESTED_SOURCE = {"architectures": ["DeepseekV3ForCausalLM"], "rope_scaling": {"factor": 40, "types": ["yarn"]}}


def layout_with_source(source: dict[str, object]) -> Layout:
    return Layout.model_validate(
        {
            "version": 1,
            "kind": "ModelLayout",
            "model": MODEL,
            "source": source,
            "total_num_kv_heads": 1,
            "groups": [{"spec": mamba(shapes=[[3, 256], [8, 64]]), "layers": ["l.0.mixer"]}],
        }
    )


def field_policy() -> Policy:
    return policy(
        """\
        version: 1
        kind: ReplicationPolicy
        name: fields
        rules:
          - name: mamba-state
            reason: split by heads
            match: {spec: MambaSpec, fields: {mamba_type: [mamba1, mamba2]}}
            replication: sharded
        """
    )


# --- hashing -------------------------------------------------------------------------------------


def test_a_policy_loaded_twice_hashes_equal() -> None:
    first, second = load_policy("default"), load_policy("default")
    assert first == second and hash(first) == hash(second)


def test_a_layout_loaded_twice_hashes_equal() -> None:
    first, second = load_layout("deepseek-v3"), load_layout("deepseek-v3")
    assert first == second and hash(first) == hash(second)


def test_a_topology_hashes_equal_to_an_equal_topology() -> None:
    assert hash(Topology(tp_size=4)) == hash(Topology(tp_size=4, pp_size=1))


def test_layouts_whose_source_differs_only_in_key_order_are_equal_and_hash_equal() -> None:
    first = layout_with_source({"a": 1, "b": [2]})
    second = layout_with_source({"b": [2], "a": 1})
    assert first == second and hash(first) == hash(second)


def test_layouts_with_different_sources_are_not_equal() -> None:
    assert layout_with_source({"a": 1}) != layout_with_source({"a": 2})


# --- immutability --------------------------------------------------------------------------------


def test_match_fields_reject_item_assignment() -> None:
    match = field_policy().rules[0].match
    with pytest.raises(TypeError):
        match.fields["mamba_type"] = "mamba1"  # type: ignore[index]


def test_a_list_in_match_fields_rejects_item_assignment() -> None:
    allowed = field_policy().rules[0].match.fields["mamba_type"]
    with pytest.raises(TypeError):
        allowed[0] = "linear"  # type: ignore[index]


def test_spec_fields_reject_item_assignment() -> None:
    spec = layout_with_source({}).groups[0].spec
    assert spec is not None
    with pytest.raises(TypeError):
        spec.fields["tp_replicated"] = True  # type: ignore[index]


def test_a_nested_list_in_spec_fields_rejects_item_assignment() -> None:
    spec = layout_with_source({}).groups[0].spec
    assert spec is not None
    with pytest.raises(TypeError):
        spec.fields["shapes"][0][1] = 1  # type: ignore[index]


def test_layout_source_rejects_item_assignment() -> None:
    with pytest.raises(TypeError):
        layout_with_source(NESTED_SOURCE).source["architectures"] = []  # type: ignore[index]


def test_a_mapping_nested_in_layout_source_rejects_item_assignment() -> None:
    with pytest.raises(TypeError):
        layout_with_source(NESTED_SOURCE).source["rope_scaling"]["factor"] = 1


def test_a_list_nested_in_layout_source_rejects_item_assignment() -> None:
    with pytest.raises(TypeError):
        layout_with_source(NESTED_SOURCE).source["rope_scaling"]["types"][0] = "linear"


def test_a_value_that_cannot_be_frozen_is_rejected() -> None:
    with pytest.raises(ValidationError, match="values must be scalars, lists or mappings"):
        layout_with_source({"tags": {"a", "b"}})


def test_the_mapping_interface_reads_like_a_dict() -> None:
    source = layout_with_source(NESTED_SOURCE).source
    assert (len(source), list(source), "architectures" in source, source.get("missing", 0)) == (
        2, ["architectures", "rope_scaling"], True, 0,
    )


def test_a_frozen_mapping_equals_the_dict_of_its_frozen_values() -> None:
    assert FrozenMapping({"a": [1, {"b": [2]}]}) == {"a": (1, {"b": (2,)})}


# --- serialization and schema --------------------------------------------------------------------


def test_model_dump_gives_plain_dicts_and_lists() -> None:
    dumped = layout_with_source(NESTED_SOURCE).model_dump()
    assert dumped["source"] == NESTED_SOURCE and type(dumped["source"]["rope_scaling"]) is dict
    fields = dumped["groups"][0]["spec"]["fields"]
    assert type(fields) is dict and fields["shapes"] == [[3, 256], [8, 64]]


def test_json_model_dump_gives_plain_dicts_and_lists() -> None:
    dumped = field_policy().model_dump(mode="json")
    assert dumped["rules"][0]["match"]["fields"] == {"mamba_type": ["mamba1", "mamba2"]}


def test_a_dumped_layout_validates_back_equal() -> None:
    original = layout_with_source(NESTED_SOURCE)
    assert Layout.model_validate(original.model_dump(mode="json")) == original


def test_a_pickled_layout_reads_back_equal() -> None:
    original = layout_with_source(NESTED_SOURCE)
    assert pickle.loads(pickle.dumps(original)) == original


@pytest.mark.parametrize(
    ("model", "name"), [(Match, "fields"), (Spec, "fields"), (Layout, "source")], ids=["match", "spec", "layout"]
)
def test_frozen_mappings_are_objects_in_the_json_schema(model: type[Match | Spec | Layout], name: str) -> None:
    assert model.model_json_schema()["properties"][name]["type"] == "object"
