"""Every field of the documents a plan is made from is decided: it reaches the plan fingerprint
(``engine.FINGERPRINTED``) or is left out for a stated reason (``engine.NOT_FINGERPRINTED``). A field
added to one of those models fails here until someone decides, and each decision is checked against
the fingerprint itself: changing a fingerprinted field changes it, changing any other does not."""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest
from core_support import full, mla
from pydantic import BaseModel

from kvpolicy.language.expressions import Expression
from kvpolicy.language.keys import UPSTREAM_KEY_TEMPLATE, KeyContext
from kvpolicy.language.models import (
    Audit,
    FieldExpression,
    Group,
    KeyFormat,
    LayerHeads,
    LayerSpecs,
    Layout,
    Match,
    Policy,
    Rule,
    Spec,
    Topology,
)
from kvpolicy.planning.engine import FINGERPRINTED, NOT_FINGERPRINTED, make_plan
from kvpolicy.planning.store_layout import StoreSharding

PLAN_INPUTS = (Policy, Layout, Topology, KeyContext, StoreSharding)
"""What :func:`make_plan` reads."""
BEHIND_ANY = (FieldExpression,)
"""Documents a field holds behind an ``Any`` annotation: a spec field's ``{expr: ...}``."""


def annotated_types(annotation: Any) -> Iterator[Any]:
    stack, seen = [annotation], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend(typing.get_args(current))
        if typing.get_origin(current) is not None:
            stack.append(typing.get_origin(current))


def field_annotations(cls: type) -> dict[str, Any]:
    if issubclass(cls, BaseModel):
        return {name: info.annotation for name, info in cls.model_fields.items()}
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def documents() -> dict[type, set[str]]:
    """Every model and dataclass reachable from the plan's inputs through field annotations → its fields."""
    found: dict[type, set[str]] = {}
    stack: list[type] = [*PLAN_INPUTS, *BEHIND_ANY]
    while stack:
        cls = stack.pop()
        if cls in found:
            continue
        annotations = field_annotations(cls)
        found[cls] = set(annotations)
        for annotation in annotations.values():
            stack.extend(
                kind for kind in annotated_types(annotation)
                if isinstance(kind, type) and (issubclass(kind, BaseModel) or dataclasses.is_dataclass(kind))
            )
    return found


def test_the_scan_reaches_nested_documents() -> None:
    assert {Rule, Match, KeyFormat, Audit, Group, LayerSpecs, Spec, Expression} <= set(documents())


def test_every_document_the_plan_reads_is_listed_both_ways() -> None:
    assert set(documents()) == set(FINGERPRINTED) == set(NOT_FINGERPRINTED)


@pytest.mark.parametrize("document", sorted(documents(), key=lambda cls: cls.__name__), ids=lambda cls: cls.__name__)
def test_every_field_is_either_fingerprinted_or_excluded_with_a_reason(document: type) -> None:
    fields = documents()[document]
    fingerprinted, excluded = FINGERPRINTED[document], NOT_FINGERPRINTED[document]
    assert not fingerprinted & set(excluded), "a field is both fingerprinted and excluded"
    assert fingerprinted | set(excluded) == fields, "decide each new field: FINGERPRINTED or NOT_FINGERPRINTED in engine.py"
    assert all(reason.strip() for reason in excluded.values())


# --- each decision against the fingerprint ---------------------------------------------------------

Documents = dict[str, Any]
Change = Callable[[Documents], None]

LATENT_RULE = {"name": "latent", "reason": "one latent for all heads", "match": {"spec": "MLAAttentionSpec"}, "factor": "tp_size"}
CUSTOM_BASES = ["MLAAttentionSpec", "FullAttentionSpec", "AttentionSpec", "KVCacheSpec"]


def base() -> Documents:
    """A plan's inputs: an MLA group one rule replicates, and a uniform group of full attention left
    to ``unmatched`` (sharded); tp 4, no store sharding."""
    return {
        "policy": {
            "version": 1, "kind": "ReplicationPolicy", "name": "base", "description": "a base policy",
            "rules": [copy.deepcopy(LATENT_RULE)], "unmatched": "sharded", "strict": False, "combine": "gcd",
            "schedule": "striped", "load": "per-rank", "key": {"template": UPSTREAM_KEY_TEMPLATE},
            "audit": {"mode": "warn", "steps": 4}, "spec_fields": [],
        },
        "layout": {
            "version": 1, "kind": "ModelLayout", "model": "org/base-model", "description": "a base layout",
            "source": {}, "total_num_kv_heads": 8, "kv_cache_layout": None,
            "groups": [
                {"name": "mla", "spec": mla(), "layers": ["model.layers.{0..3}.attn"]},
                {"name": "full", "uniform": [
                    {"spec": full(num_kv_heads=2), "layers": ["model.layers.4.attn"]},
                    {"spec": full(num_kv_heads=2, page_size_bytes=8192), "layers": ["model.layers.5.attn"]},
                ]},
            ],
        },
        "topology": {"tp_size": 4},
        "context": {"model": "base-model"},
        "sharding": None,
    }


def fingerprint_of(documents_: Documents) -> str:
    sharding = documents_["sharding"]
    return make_plan(
        Policy.model_validate(documents_["policy"]),
        Layout.model_validate(documents_["layout"]),
        Topology(**documents_["topology"]),
        key_context=KeyContext(**documents_["context"]),
        store_sharding=None if sharding is None else StoreSharding(**sharding),
    ).fingerprint


def sharded(documents_: Documents) -> None:
    """vLLM's TP-sharded store: one full-attention group of 8 KV heads, tp 2, 8 store shards (LBHNC)."""
    documents_["layout"].update(
        kv_cache_layout="LBHNC",
        groups=[{"name": "full", "spec": full(num_kv_heads=4), "layers": ["model.layers.{0..3}.attn"]}],
    )
    documents_["topology"] = {"tp_size": 2}
    documents_["sharding"] = {"store_tp_size": 8, "store_format": "tp_shared_lbhnc"}


def latent_only(documents_: Documents) -> None:
    documents_["layout"].update(total_num_kv_heads=1, groups=documents_["layout"]["groups"][:1])


def rule(documents_: Documents) -> dict[str, Any]:
    return documents_["policy"]["rules"][0]


def mla_group(documents_: Documents) -> dict[str, Any]:
    return documents_["layout"]["groups"][0]


def member(documents_: Documents) -> dict[str, Any]:
    return documents_["layout"]["groups"][1]["uniform"][0]


def replace_factor(documents_: Documents, **outcome: Any) -> None:
    del rule(documents_)["factor"]
    rule(documents_).update(outcome)


def setting(where: Callable[[Documents], dict[str, Any]], **values: Any) -> Change:
    return lambda documents_: where(documents_).update(values)


def add_full_rule(factor: str) -> Change:
    return lambda documents_: documents_["policy"]["rules"].append(
        {"name": "full", "reason": "a guess", "match": {"spec": "FullAttentionSpec"}, "factor": factor}
    )


def custom_latent(documents_: Documents) -> None:
    mla_group(documents_)["spec"].update(type="CustomLatentSpec", bases=list(CUSTOM_BASES))


def own_heads(count: int, *layers: str) -> dict[str, Any]:
    """A ``layer_kv_heads`` entry: ``layers`` have ``count`` KV heads of their own."""
    return {"total_num_kv_heads": count, "layers": list(layers)}


def policy_doc(documents_: Documents) -> dict[str, Any]:
    return documents_["policy"]


def layout_doc(documents_: Documents) -> dict[str, Any]:
    return documents_["layout"]


FIXED = None
"""A field with one possible value (a one-value ``Literal``): nothing to vary."""

PERTURBATIONS: dict[tuple[type, str], tuple[Change | None, Change] | None] = {
    (Policy, "version"): FIXED,
    (Policy, "kind"): FIXED,
    (Policy, "combine"): FIXED,
    (Policy, "name"): (None, setting(policy_doc, name="renamed")),
    (Policy, "description"): (None, setting(policy_doc, description="other words")),
    (Policy, "rules"): (None, setting(policy_doc, rules=[])),
    (Policy, "unmatched"): (None, setting(policy_doc, unmatched="replicated")),
    (Policy, "strict"): (add_full_rule("1"), setting(policy_doc, strict=True)),
    (Policy, "schedule"): (None, setting(policy_doc, schedule="leader")),
    (Policy, "load"): (None, setting(policy_doc, load="striped")),
    (Policy, "key"): (
        None, setting(policy_doc, key={"template": "{model}@v2" + UPSTREAM_KEY_TEMPLATE.removeprefix("{cache_prefix}{model}")})
    ),
    (Policy, "audit"): (None, setting(policy_doc, audit={"mode": "off"})),
    (Policy, "spec_fields"): (None, setting(policy_doc, spec_fields=["plugin_field"])),
    (Rule, "name"): (None, setting(rule, name="renamed")),
    (Rule, "reason"): (None, setting(rule, reason="other words")),
    (Rule, "match"): (None, setting(rule, match={"spec": "MambaSpec"})),
    (Rule, "when"): (None, setting(rule, when="tp_size > 64")),
    (Rule, "replication"): (None, lambda documents_: replace_factor(documents_, replication="sharded")),
    (Rule, "factor"): (None, setting(rule, factor="2")),
    (Rule, "shards"): (None, lambda documents_: replace_factor(documents_, shards="tp_size")),
    (Match, "spec"): (None, lambda documents_: rule(documents_)["match"].update(spec="MambaSpec")),
    (Match, "fields"): (None, lambda documents_: rule(documents_)["match"].update(fields={"num_kv_heads": 5})),
    (Match, "layers"): (None, lambda documents_: rule(documents_)["match"].update(layers="nothing.*")),
    (KeyFormat, "template"): (
        None,
        lambda documents_: policy_doc(documents_)["key"].update(
            template="{model}@x" + UPSTREAM_KEY_TEMPLATE.removeprefix("{cache_prefix}{model}")
        ),
    ),
    (KeyFormat, "keyed"): (None, lambda documents_: policy_doc(documents_)["key"].update(keyed="required")),
    (KeyFormat, "verified"): (None, lambda documents_: policy_doc(documents_)["key"].update(verified="required")),
    (Audit, "mode"): (None, lambda documents_: policy_doc(documents_)["audit"].update(mode="enforce")),
    (Audit, "steps"): (None, lambda documents_: policy_doc(documents_)["audit"].update(steps=0)),
    (Expression, "source"): (None, setting(rule, factor="tp_size // 2")),
    (FieldExpression, "expr"): (
        lambda documents_: member(documents_)["spec"]["fields"].update(num_kv_heads={"expr": "8 // tp_size"}),
        lambda documents_: member(documents_)["spec"]["fields"].update(num_kv_heads={"expr": "16 // tp_size"}),
    ),
    (Layout, "version"): FIXED,
    (Layout, "kind"): FIXED,
    (Layout, "model"): (None, setting(layout_doc, model="org/other-model")),
    (Layout, "description"): (None, setting(layout_doc, description="other words")),
    (Layout, "source"): (None, setting(layout_doc, source={"num_key_value_heads": 8})),
    (Layout, "total_num_kv_heads"): (add_full_rule("max(1, tp_size // total_num_kv_heads)"), setting(layout_doc, total_num_kv_heads=2)),
    (Layout, "layer_kv_heads"): (None, setting(layout_doc, layer_kv_heads=[own_heads(4, "model.layers.4.attn")])),
    (LayerHeads, "total_num_kv_heads"): (
        setting(layout_doc, layer_kv_heads=[own_heads(4, "model.layers.4.attn")]),
        setting(layout_doc, layer_kv_heads=[own_heads(2, "model.layers.4.attn")]),
    ),
    (LayerHeads, "layers"): (
        setting(layout_doc, layer_kv_heads=[own_heads(4, "model.layers.4.attn")]),
        setting(layout_doc, layer_kv_heads=[own_heads(4, "model.layers.5.attn")]),
    ),
    (Layout, "kv_cache_layout"): (None, setting(layout_doc, kv_cache_layout="LBHNC")),
    (Layout, "groups"): (None, lambda documents_: layout_doc(documents_)["groups"].pop()),
    (Group, "name"): (None, setting(mla_group, name="renamed")),
    (Group, "spec"): (None, setting(mla_group, spec=full(num_kv_heads=2))),
    (Group, "layers"): (None, setting(mla_group, layers=["model.layers.{0..3}.attn", "model.layers.9.attn"])),
    (Group, "uniform"): (None, lambda documents_: layout_doc(documents_)["groups"][1]["uniform"].append(
        {"spec": full(num_kv_heads=2, page_size_bytes=2048), "layers": ["model.layers.9.attn"]})),
    (LayerSpecs, "spec"): (None, setting(member, spec=full(num_kv_heads=2, page_size_bytes=1024))),
    (LayerSpecs, "layers"): (None, setting(member, layers=["model.layers.4.attn", "model.layers.8.attn"])),
    (Spec, "type"): (None, lambda documents_: mla_group(documents_)["spec"].update(
        type="CustomLatentSpec", bases=list(CUSTOM_BASES))),
    (Spec, "bases"): (custom_latent, lambda documents_: mla_group(documents_)["spec"].update(bases=["KVCacheSpec"])),
    (Spec, "block_size"): (None, lambda documents_: mla_group(documents_)["spec"].update(block_size=32)),
    (Spec, "page_size_bytes"): (None, lambda documents_: mla_group(documents_)["spec"].update(page_size_bytes=8192)),
    (Spec, "fields"): (None, lambda documents_: mla_group(documents_)["spec"]["fields"].update(kv_lora_rank=512)),
    (Topology, "tp_size"): (None, lambda documents_: documents_["topology"].update(tp_size=2)),
    (Topology, "pp_size"): (None, lambda documents_: documents_["topology"].update(pp_size=2)),
    (Topology, "pcp_size"): (latent_only, lambda documents_: documents_["topology"].update(pcp_size=2)),
    (Topology, "dcp_size"): (latent_only, lambda documents_: documents_["topology"].update(dcp_size=2)),
    (KeyContext, "model"): (None, lambda documents_: documents_["context"].update(model="other-model")),
    (KeyContext, "cache_prefix"): (None, lambda documents_: documents_["context"].update(cache_prefix="tenant-a")),
    (KeyContext, "store_namespace"): (sharded, lambda documents_: documents_["context"].update(
        store_namespace="@store_tp:8@store_pp:1@store_format:tp_shared_lbhnc")),
    (StoreSharding, "store_tp_size"): (sharded, lambda documents_: documents_["sharding"].update(store_tp_size=4)),
    (StoreSharding, "store_format"): (sharded, lambda documents_: documents_["sharding"].update(store_format="tp_shared_lbnhc")),
}
"""(document, field) → (a change of the base it needs first, or None; the change of that one field)."""


def test_every_field_has_a_change_to_check_its_decision_by() -> None:
    assert set(PERTURBATIONS) == {(document, name) for document, fields in documents().items() for name in fields}


@pytest.mark.parametrize("where", sorted(PERTURBATIONS, key=lambda key: (key[0].__name__, key[1])),
                         ids=lambda key: f"{key[0].__name__}.{key[1]}")
def test_changing_a_field_changes_the_fingerprint_exactly_when_it_is_fingerprinted(where: tuple[type, str]) -> None:
    document, name = where
    perturbation = PERTURBATIONS[where]
    if perturbation is FIXED:
        annotation = document.model_fields[name].annotation
        assert len(set(typing.get_args(annotation))) == 1 and typing.get_origin(annotation) is Literal
        return
    setup, change = perturbation
    before = base()
    if setup is not None:
        setup(before)
    after = copy.deepcopy(before)
    change(after)
    assert after != before
    changed = fingerprint_of(before) != fingerprint_of(after)
    assert changed == (name in FINGERPRINTED[document]), (
        f"{document.__name__}.{name}: declared {'fingerprinted' if name in FINGERPRINTED[document] else 'excluded'}, "
        f"but changing it {'changes' if changed else 'leaves'} the fingerprint"
    )
