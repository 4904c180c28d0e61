"""Build kvpolicy's layout document from vLLM's own KV-cache objects.

Nothing here knows a spec class by name: class, bases and fields are read generically, so specs
from plugins come through like built-in ones. The one base class read is vLLM's ``AttentionSpec``:
only its layers have KV heads, so only they can have a KV-head count of their own.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from enum import Enum
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import torch
from pydantic import ValidationError
from vllm.config import ModelConfig
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)

from kvpolicy.language.models import Group, LayerHeads, LayerSpecs, Layout, Spec
from kvpolicy.vllm import internals

_OMITTED_FIELDS = ("block_size",)  # a top-level key of every Spec document
_UNIFORM_GROUP_NAME = "uniform"


def _plain(value: Any) -> Any:
    """Convert a spec field value into a YAML-friendly value (scalars, lists, dicts)."""
    # Enum first: IntEnum and str-Enum members are also ints and strs.
    if isinstance(value, Enum):
        inner = value.value
        return inner if inner is None or isinstance(inner, (bool, int, float, str)) else value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Fraction):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        # String keys, as a layout file's mappings have them (the loader reads every key as a string).
        return {str(_plain(key)): _plain(item) for key, item in value.items()}
    return str(value)


def spec_document(spec: KVCacheSpec) -> Spec:
    """Describe one vLLM ``KVCacheSpec`` as a kvpolicy ``Spec``: class name, base class names (MRO
    without ``object``), block size, page size in bytes and every other dataclass field."""
    # The per-layer specs of a uniform group become the group's ``uniform`` entries instead.
    skipped = _OMITTED_FIELDS
    if isinstance(spec, UniformTypeKVCacheSpecs):
        skipped = (*skipped, "kv_cache_specs")
    return Spec(
        type=type(spec).__name__,
        bases=tuple(cls.__name__ for cls in type(spec).__mro__[1:] if cls is not object),
        block_size=spec.block_size,
        page_size_bytes=int(spec.page_size_bytes),
        fields={
            field.name: _plain(getattr(spec, field.name))
            for field in dataclasses.fields(spec)
            if field.name not in skipped
        },
    )


def _kebab(class_name: str) -> str:
    stem = class_name.removesuffix("Spec")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", stem).lower()


def _uniform_entries(spec: UniformTypeKVCacheSpecs) -> tuple[LayerSpecs, ...]:
    # Equal spec documents merge into one entry, in order of first appearance.
    merged: dict[Spec, list[str]] = {}
    for layer, layer_spec in spec.kv_cache_specs.items():
        merged.setdefault(spec_document(layer_spec), []).append(layer)
    return tuple(LayerSpecs(spec=document, layers=tuple(layers)) for document, layers in merged.items())


def _attention_layers(groups: list[KVCacheGroupSpec]) -> Iterator[str]:
    """The layers of ``groups`` whose spec is an attention spec (the layers with KV heads), in group order."""
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            yield from (name for name, member in spec.kv_cache_specs.items() if isinstance(member, AttentionSpec))
        elif isinstance(spec, AttentionSpec):
            yield from group.layer_names


def _layer_kv_heads(
    layers: tuple[str, ...], own_heads: Mapping[str, int], total_num_kv_heads: int
) -> tuple[LayerHeads, ...]:
    """The ``layer_kv_heads`` entries of ``layers``: those whose count in ``own_heads`` differs from
    ``total_num_kv_heads``, one entry per count in order of first appearance, each entry's layers in
    the order of ``layers``."""
    by_count: dict[int, list[str]] = {}
    for layer in layers:
        heads = own_heads.get(layer, total_num_kv_heads)
        if heads != total_num_kv_heads:
            by_count.setdefault(heads, []).append(layer)
    return tuple(LayerHeads(total_num_kv_heads=heads, layers=tuple(names)) for heads, names in by_count.items())


def layout_from_kv_cache_config(
    kv_cache_config: KVCacheConfig,
    *,
    model: str,
    total_num_kv_heads: int,
    kv_cache_layout: str | None = None,
    model_config: ModelConfig | None = None,
    kv_heads_by_layer: Mapping[str, int] = MappingProxyType({}),
) -> Layout:
    """Build the ``Layout`` of a model from vLLM's ``KVCacheConfig`` (and the ``KVCacheLayout`` name
    the engine resolved, when known).

    Only the groups vLLM's Mooncake store transfers are kept, in its order, so that a group's index
    in the layout is its ``@group:`` number in store keys: ``kv_cache_config.prefix_cacheable_groups``,
    the selection ``MooncakeStoreCoordinator.from_kv_cache_config`` uses.

    Attention layers with KV heads of their own (over all TP ranks) that differ from
    ``total_num_kv_heads`` are listed in the layout's ``layer_kv_heads``: the counts vLLM keeps per
    layer in ``model_config`` (``model_config.model_arch_config[layer_index].total_num_kv_heads``:
    Gemma-4's full-attention layers, Nemotron-NAS blocks), and those ``kv_heads_by_layer`` states
    (layer name → its KV heads; it wins over ``model_config``: a simulated model has no model config).
    Without either, or for a model whose layers agree, there are none.
    """
    selected = kv_cache_config.prefix_cacheable_groups
    if not selected:
        raise ValueError("the KV cache config has no prefix-cacheable group to describe")
    names = [
        _UNIFORM_GROUP_NAME if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
        else _kebab(type(group.kv_cache_spec).__name__)
        for group in selected
    ]
    # Kebab names never end in "-<digit>", so a suffixed name cannot collide with another name.
    names = [f"{name}-{index}" if names.count(name) > 1 else name for index, name in enumerate(names)]
    groups = tuple(
        Group(name=name, uniform=_uniform_entries(group.kv_cache_spec))
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
        else Group(name=name, spec=spec_document(group.kv_cache_spec), layers=tuple(group.layer_names))
        for name, group in zip(names, selected, strict=True)
    )
    attention_layers = tuple(_attention_layers(selected))
    own_heads = {**internals.layer_total_num_kv_heads(model_config, attention_layers), **kv_heads_by_layer}
    try:
        return Layout(
            version=1, kind="ModelLayout", model=model, total_num_kv_heads=total_num_kv_heads,
            layer_kv_heads=_layer_kv_heads(attention_layers, own_heads, total_num_kv_heads),
            kv_cache_layout=kv_cache_layout, groups=groups,
        )
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, problem['loc'])) or 'layout'}: {problem['msg']}"
            for problem in error.errors(include_url=False)
        )
        raise ValueError(f"kvpolicy cannot describe this model's KV cache as a layout: {problems}") from None
