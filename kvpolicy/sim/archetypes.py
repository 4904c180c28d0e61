"""Model shapes the simulation can run, and which TP ranks really hold identical bytes for them.

An :class:`Archetype` is a model's KV-cache layers as vLLM's own spec objects (``MLAAttentionSpec``,
``MambaSpec`` …), per TP size. :func:`physical_factor` is the ground truth the simulation judges a
policy against: how many consecutive TP ranks hold byte-identical bytes for a layer, stated from
what the model computes and never from a policy. It is the one place that knowledge lives outside
the YAML policies; the offline audit, the benchmarks and the tests read it from here.

The truth is per layer: an attention layer's heads repeat over ``tp // heads`` ranks with *its own*
KV heads (:attr:`Archetype.layer_kv_heads`: Gemma-4's full-attention layers, each Nemotron-NAS
block), whatever model-wide count vLLM reports.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.v1 import kv_cache_interface
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvpolicy.language.models import Layout, Spec, SpecValues

__all__ = [
    "ARCHETYPES",
    "BLOCK_SIZE",
    "HYBRIDS",
    "LAYER_HEADS_ARCHETYPES",
    "Archetype",
    "archetype_from_layout",
    "get_archetype",
    "physical_factor",
]

BLOCK_SIZE = 16
"""Tokens per KV block in every archetype."""

SpecBuilder = Callable[[int], KVCacheSpec]
"""tp_size → the spec one TP rank's layer reports (``Attention.get_kv_cache_spec`` etc.)."""


def physical_factor(classes: Collection[str], fields: Mapping[str, Any], total_num_kv_heads: int, tp_size: int) -> int:
    """Consecutive TP ranks holding byte-identical bytes for a layer whose spec has these class
    names (the class and its bases) and fields, the layer having ``total_num_kv_heads`` KV heads
    over all ranks (its own count, where it differs from the model-wide one).

    An MLA latent has no head dimension, so it is whole on every rank; Mamba and linear-attention
    state is split by heads, distinct on every rank, unless vLLM marks it ``tp_replicated``; GQA
    heads repeat on ``tp // heads`` consecutive ranks once TP exceeds them (``QKVParallelLinear``).
    """
    if "MambaSpec" in classes:
        return tp_size if fields.get("tp_replicated") else 1
    if "MLAAttentionSpec" in classes or "SlidingWindowMLASpec" in classes:
        return tp_size
    return max(1, tp_size // max(1, total_num_kv_heads))


def spec_physical_factor(spec: KVCacheSpec, total_num_kv_heads: int, tp_size: int) -> int:
    """:func:`physical_factor` of a vLLM spec object."""
    classes = [cls.__name__ for cls in type(spec).__mro__]
    fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
    return physical_factor(classes, fields, total_num_kv_heads, tp_size)


@dataclass(frozen=True)
class Archetype:
    """A model's KV-cache layers, buildable at any TP size as vLLM spec objects."""

    name: str
    description: str
    total_num_kv_heads: int | Callable[[int], int]
    """The model's KV heads (``get_total_num_kv_heads``), or tp_size → heads for a family of models."""
    layers: tuple[tuple[str, str], ...]
    """(layer name, kind) in model order."""
    kinds: Mapping[str, SpecBuilder]
    """kind → how a rank's spec for such a layer is built."""
    layer_kv_heads: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """Attention layers whose own KV heads (over all TP ranks) differ from the model-wide count, with
    that count: vLLM's ``model_config.model_arch_config[layer_index].total_num_kv_heads``. Their kinds
    build specs of that many heads; the ground truth repeats their heads over ``tp // heads`` ranks."""
    kind_factors: Mapping[str, Callable[[int], int]] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """Kinds whose spec class :func:`physical_factor` does not know (a plugin's state type), with what
    the model computes for them: tp_size → consecutive TP ranks holding byte-identical bytes. Stated by
    whoever adds the kind, as :func:`physical_factor` states it for vLLM's own classes."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_kv_heads) - {layer for layer, _ in self.layers})
        if unknown:
            raise ValueError(f"archetype {self.name!r}: layer_kv_heads names layers it does not have: {unknown}")
        unknown = sorted(set(self.kind_factors) - set(self.kinds))
        if unknown:
            raise ValueError(f"archetype {self.name!r}: kind_factors names kinds it does not have: {unknown}")

    def kv_heads(self, tp_size: int) -> int:
        """The model-wide KV heads at ``tp_size``."""
        heads = self.total_num_kv_heads
        return heads(tp_size) if callable(heads) else heads

    def layer_heads(self, layer: str, tp_size: int) -> int:
        """The KV heads of ``layer``: its own count, else the model-wide one."""
        return self.layer_kv_heads.get(layer, self.kv_heads(tp_size))

    def specs(self, tp_size: int) -> dict[str, KVCacheSpec]:
        """Layer name → one TP rank's spec, in model order."""
        return {layer: self.kinds[kind](tp_size) for layer, kind in self.layers}

    def true_factors(self, tp_size: int) -> dict[str, int]:
        """Layer name → :func:`physical_factor` at ``tp_size``, with the layer's own KV heads."""
        kinds = dict(self.layers)
        return {
            layer: self.kind_factors[kinds[layer]](tp_size)
            if kinds[layer] in self.kind_factors
            else spec_physical_factor(spec, self.layer_heads(layer, tp_size), tp_size)
            for layer, spec in self.specs(tp_size).items()
        }


_BF16 = torch.bfloat16


def _gqa(total_heads: Callable[[int], int], *, head_size: int = 64, sliding_window: int | None = None) -> SpecBuilder:
    def build(tp_size: int) -> KVCacheSpec:
        # vLLM replicates KV heads when TP exceeds them (QKVParallelLinear).
        heads = max(1, total_heads(tp_size) // tp_size)
        if sliding_window is not None:
            return SlidingWindowSpec(
                block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=head_size, dtype=_BF16, sliding_window=sliding_window
            )
        return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=head_size, dtype=_BF16)

    return build


def _mla(kv_lora_rank: int = 64, rope_dim: int = 32) -> SpecBuilder:
    # DeepSeek/Kimi MLA: one latent "head" of kv_lora_rank + rope dims, identical on every rank.
    return lambda tp_size: MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=kv_lora_rank + rope_dim, dtype=_BF16
    )


def _kda(num_heads: int = 8, head_dim: int = 8, conv_kernel: int = 4) -> SpecBuilder:
    # Kimi Delta Attention state, shaped like KimiGatedDeltaNetAttention.get_kv_cache_spec; 8 heads, so that
    # it splits evenly up to TP 8, of 8 dims, so that its page stays smaller than an MLA page (never padded).
    return lambda tp_size: MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=MambaStateShapeCalculator.kda_state_shape(tp_size, num_heads, head_dim, conv_kernel_size=conv_kernel),
        dtypes=MambaStateDtypeCalculator.kda_state_dtype(_BF16, "auto"),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )


def _gdn(num_k_heads: int = 4, num_v_heads: int = 8, head_dim: int = 16, conv_kernel: int = 4) -> SpecBuilder:
    # Qwen3-Next Gated DeltaNet state, shaped like GatedDeltaNetAttention.get_kv_cache_spec.
    return lambda tp_size: MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp_size, num_k_heads, num_v_heads, head_dim, head_dim, conv_kernel
        ),
        dtypes=MambaStateDtypeCalculator.gated_delta_net_state_dtype(_BF16, "auto"),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )


def _mamba2(
    intermediate: int = 128, n_groups: int = 2, num_heads: int = 8, head_dim: int = 16, state: int = 16
) -> SpecBuilder:
    # Mamba2 SSM + conv state, shaped like MambaMixer2.get_kv_cache_spec; 8 heads, so that it splits evenly
    # up to TP 8, of 16 dims, so that from TP 2 on a state page stays smaller than a 1-KV-head attention page
    # (vLLM would pad the attention page instead, with bytes no forward pass writes).
    return lambda tp_size: MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=MambaStateShapeCalculator.mamba2_state_shape(tp_size, intermediate, n_groups, num_heads, head_dim, state, 4),
        dtypes=MambaStateDtypeCalculator.mamba2_state_dtype(_BF16, "auto", "auto"),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode="align",
    )


def _attn(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def _mixer(index: int) -> str:
    return f"model.layers.{index}.mixer"


def _half_tp(tp_size: int) -> int:
    return max(1, tp_size // 2)


def _registry(*archetypes: Archetype) -> Mapping[str, Archetype]:
    return MappingProxyType({archetype.name: archetype for archetype in archetypes})


ARCHETYPES: Mapping[str, Archetype] = _registry(
    Archetype(
        "gqa-kv-lt-tp",
        "GQA with fewer KV heads than TP ranks (tp // 2 heads): pairs of ranks repeat a head",
        _half_tp,
        tuple((_attn(i), "attn") for i in range(2)),
        MappingProxyType({"attn": _gqa(_half_tp)}),
    ),
    Archetype(
        "gqa-8kv",
        "Llama-style GQA with 8 KV heads in one full-attention group: every rank holds its own heads up to TP 8 "
        "(vLLM's TP-sharded store layout applies)",
        8,
        tuple((_attn(i), "attn") for i in range(2)),
        MappingProxyType({"attn": _gqa(lambda tp_size: 8)}),
    ),
    Archetype(
        "mla",
        "DeepSeek-style MLA: the latent cache is whole on every rank",
        1,
        tuple((_attn(i), "mla") for i in range(2)),
        MappingProxyType({"mla": _mla()}),
    ),
    Archetype(
        "kimi-linear",
        "Kimi-Linear: MLA attention plus head-sharded KDA (linear-attention) state",
        1,
        ((_mixer(0), "kda"), (_attn(1), "mla"), (_mixer(2), "kda"), (_attn(3), "mla")),
        MappingProxyType({"mla": _mla(), "kda": _kda()}),
    ),
    Archetype(
        "gqa-gdn",
        "Qwen3-Next-style hybrid: 2-KV-head attention plus head-sharded Gated DeltaNet state",
        2,
        ((_mixer(0), "gdn"), (_mixer(1), "gdn"), (_mixer(2), "gdn"), (_attn(3), "attn")),
        MappingProxyType({"attn": _gqa(lambda tp_size: 2), "gdn": _gdn()}),
    ),
    Archetype(
        "gqa-mamba",
        "hybrid of single-KV-head attention (replicated over TP) and head-sharded Mamba2 state",
        1,
        ((_mixer(0), "mamba"), (_attn(1), "attn"), (_mixer(2), "mamba"), (_attn(3), "attn")),
        MappingProxyType({"attn": _gqa(lambda tp_size: 1), "mamba": _mamba2()}),
    ),
    Archetype(
        "mamba2",
        "attention-free Mamba2 model (vLLM reports 0 KV heads): head-sharded state only",
        0,
        tuple((_mixer(i), "mamba") for i in range(4)),
        MappingProxyType({"mamba": _mamba2()}),
    ),
    Archetype(
        "sliding-window-full",
        "interleaved full and sliding-window (32 tokens) GQA layers with 2 KV heads",
        2,
        ((_attn(0), "full"), (_attn(1), "swa"), (_attn(2), "full"), (_attn(3), "swa")),
        MappingProxyType({"full": _gqa(lambda tp_size: 2), "swa": _gqa(lambda tp_size: 2, sliding_window=32)}),
    ),
    Archetype(
        "uniform-mla-full",
        "MLA and 2-KV-head full-attention layers packed into one UniformTypeKVCacheSpecs group",
        2,
        ((_attn(0), "mla"), (_attn(1), "full"), (_attn(2), "mla"), (_attn(3), "full")),
        MappingProxyType({"mla": _mla(), "full": _gqa(lambda tp_size: 2)}),
    ),
)
"""The built-in archetypes, by name."""

HYBRIDS: tuple[str, ...] = ("kimi-linear", "gqa-gdn", "gqa-mamba")
"""Archetypes with TP-sharded recurrent state beside replicated attention: MLA+KDA, GQA+GDN, GQA+Mamba2."""


def _own_heads_archetype(
    name: str, description: str, model_wide: int, layers: tuple[tuple[int, int, int | None], ...]
) -> Archetype:
    """GQA layers ``(index, KV heads, sliding window or None)`` of their own head counts, vLLM
    reporting ``model_wide``: each layer's kind builds a spec of its own heads, and
    :attr:`Archetype.layer_kv_heads` states the counts that differ from ``model_wide``."""
    kinds: dict[str, SpecBuilder] = {}
    named: list[tuple[str, str]] = []
    for index, heads, window in layers:
        kind = f"{'swa' if window else 'full'}-{heads}kv"
        kinds.setdefault(kind, _gqa(lambda tp_size, heads=heads: heads, sliding_window=window))
        named.append((_attn(index), kind))
    own = {_attn(index): heads for index, heads, _ in layers if heads != model_wide}
    return Archetype(name, description, model_wide, tuple(named), MappingProxyType(kinds), MappingProxyType(own))


LAYER_HEADS_ARCHETYPES: Mapping[str, Archetype] = _registry(
    _own_heads_archetype(
        "nas-like",
        "Nemotron-NAS-like GQA, each block of its own KV heads (2, 8, 4, 8): vLLM reports the first block's 2 "
        "for the model; at TP 8 every block has one head per rank, so all four share one KV-cache group",
        2,
        ((0, 2, None), (1, 8, None), (2, 4, None), (3, 8, None)),
    ),
    _own_heads_archetype(
        "gemma4-like",
        "Gemma-4-like: sliding-window (32 tokens) layers of 1 KV head and full-attention layers of 2, vLLM "
        "reporting the larger, 2, for the model",
        2,
        ((0, 1, 32), (1, 2, None), (2, 1, 32), (3, 2, None)),
    ),
)
"""Built-in archetypes whose layers have KV-head counts of their own (vLLM 0.32's per-layer
``model_arch_config``), by name. Apart from :data:`ARCHETYPES`: under ``vllm-compat``, which reads the
model-wide count for every layer as vLLM's store does, ``nas-like`` loads other ranks' heads."""


def get_archetype(archetype: str | Archetype) -> Archetype:
    """The built-in archetype of that name (or ``archetype`` itself); a clear error for an unknown name."""
    if isinstance(archetype, Archetype):
        return archetype
    found = ARCHETYPES.get(archetype) or LAYER_HEADS_ARCHETYPES.get(archetype)
    if found is None:
        known = ", ".join((*ARCHETYPES, *LAYER_HEADS_ARCHETYPES))
        raise ValueError(f"unknown archetype {archetype!r}; known: {known}")
    return found


# --- archetypes from layout documents ------------------------------------------------------------

_MAMBA_DIM = 4
"""Largest state dimension a layout's Mamba spec keeps in :func:`archetype_from_layout`."""


def _spec_value(value: Any, default: Any) -> Any:
    """A layout field value (YAML: scalars, lists) as the spec dataclass wants it."""
    if isinstance(default, Enum):
        return type(default)(value)
    if isinstance(value, (list, tuple)):
        return tuple(_spec_value(item, None) for item in value)
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    return value


def _scaled_spec(
    spec: SpecValues, *, head_size: int, num_kv_heads: int, mamba_dim: int | None = _MAMBA_DIM
) -> KVCacheSpec:
    """A per-rank spec of the layout's class, from its fields at one topology, at a scaled-down size
    (Mamba state dimensions cut to ``mamba_dim``; None keeps the real state)."""
    cls = getattr(kv_cache_interface, spec.type, None)
    if not (isinstance(cls, type) and issubclass(cls, KVCacheSpec)):
        raise ValueError(f"{spec.type} is not a spec class of vllm.v1.kv_cache_interface")
    init = {field.name: field for field in dataclasses.fields(cls) if field.init}
    kwargs: dict[str, Any] = {}
    for name, value in spec.fields.items():
        if name in init:
            default = init[name].default
            kwargs[name] = _spec_value(value, None if default is dataclasses.MISSING else default)
    # Scaled down, by field rather than by class: the store moves bytes without reading them, so only
    # the class and the fields the policies read matter; vLLM pads the pages to one size when grouping.
    kwargs["block_size"] = BLOCK_SIZE
    kwargs.pop("page_size_padded", None)
    if "num_kv_heads" in kwargs:
        kwargs["num_kv_heads"] = num_kv_heads
    if "head_size" in kwargs:
        kwargs["head_size"] = head_size
    if kwargs.get("head_size_v"):
        kwargs["head_size_v"] = head_size
    if "shapes" in kwargs and mamba_dim is not None:
        kwargs["shapes"] = tuple(tuple(min(dim, mamba_dim) for dim in shape) for shape in kwargs["shapes"])
    return cls(**kwargs)


def _real_page_spec(spec: SpecValues, *, num_kv_heads: int) -> KVCacheSpec:
    """A per-rank spec of the layout's class whose :data:`BLOCK_SIZE`-token page holds as many bytes
    as the real model's page at its own block size, and whose Mamba state is the real one: one chunk
    object of a group is then as large as the real model's (fewer tokens in it, the same bytes)."""
    probe = _scaled_spec(spec, head_size=1, num_kv_heads=num_kv_heads, mamba_dim=None)
    if not isinstance(probe, AttentionSpec):
        return probe
    per_head_byte = probe.page_size_bytes
    if spec.page_size_bytes % per_head_byte:
        raise ValueError(
            f"{spec.type}: a page of {spec.page_size_bytes} bytes is no whole head size at block {BLOCK_SIZE} "
            f"({per_head_byte} bytes per unit of head size)"
        )
    return _scaled_spec(spec, head_size=spec.page_size_bytes // per_head_byte, num_kv_heads=num_kv_heads, mamba_dim=None)


def _rank_spec(
    spec: Spec,
    head_size: int | None,
    total_num_kv_heads: int,
    num_kv_heads: int | None,
    tp_size: int,
    *,
    model_total_num_kv_heads: int | None = None,
) -> KVCacheSpec:
    """:func:`_scaled_spec` of ``spec`` evaluated at ``tp_size`` for layers of ``total_num_kv_heads``
    KV heads (in a model of ``model_total_num_kv_heads``, None: the same), with ``num_kv_heads`` heads
    or (None) those one of ``tp_size`` ranks holds (vLLM's QKVParallelLinear); ``head_size`` None: the
    real page (:func:`_real_page_spec`)."""
    model_wide = total_num_kv_heads if model_total_num_kv_heads is None else model_total_num_kv_heads
    values = spec.evaluate(
        {
            "tp_size": tp_size, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
            "total_num_kv_heads": total_num_kv_heads, "model_total_num_kv_heads": model_wide,
        }
    )
    heads = max(1, total_num_kv_heads // tp_size) if num_kv_heads is None else num_kv_heads
    if head_size is None:
        return _real_page_spec(values, num_kv_heads=heads)
    return _scaled_spec(values, head_size=head_size, num_kv_heads=heads)


def _layer_order(name: str) -> tuple[Any, ...]:
    # Model order: "model.layers.10" after "model.layers.9".
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def archetype_from_layout(
    layout: Layout,
    *,
    name: str | None = None,
    layers_per_group: int | None = None,
    head_size: int | None = 32,
    num_kv_heads: int | None = 1,
) -> Archetype:
    """A kvpolicy ``Layout`` as an archetype, scaled down.

    Each layer gets the layout's spec class, looked up by name in ``vllm.v1.kv_cache_interface``,
    built from the layout's fields: block size :data:`BLOCK_SIZE`, attention ``num_kv_heads`` and
    ``head_size`` (and a non-zero ``head_size_v``) as given here (``num_kv_heads=None``: the model's
    own per-rank count, ``max(1, total_num_kv_heads // tp_size)`` with the layer's own heads), Mamba
    state dimensions cut to 4, no page padding (vLLM's grouping pads pages to one size, as for the
    real model). Layers go in model order, so vLLM's ``get_kv_cache_groups`` regroups them itself;
    ``layers_per_group`` keeps only the first layers of each group (of each entry of a uniform group,
    and of each KV-head count among its layers). The ground truth stays the full model's:
    :func:`physical_factor` with each layer's heads (``layer_kv_heads``, else ``total_num_kv_heads``).

    vLLM pads a smaller page only for Mamba and non-MLA attention, so next to Mamba state an MLA page
    must stay the larger: ``head_size`` >= 16 does.

    ``head_size=None`` keeps the real bytes instead (use with ``num_kv_heads=None``): every page of
    :data:`BLOCK_SIZE` tokens is as large as the real model's page at its own block size at that TP
    size, and Mamba states keep their real shapes, so chunk objects have the real model's sizes.
    """
    kinds: dict[str, SpecBuilder] = {}
    layers: list[tuple[str, str]] = []
    model_wide = layout.total_num_kv_heads
    for index, group in enumerate(layout.groups):
        group_name = group.name or f"group-{index}"
        for member_index, member in enumerate(group.members):
            member_kind = group_name if len(group.members) == 1 else f"{group_name}#{member_index}"
            by_heads: dict[int, list[str]] = {}
            for layer in member.layers:
                by_heads.setdefault(layout.layer_total_num_kv_heads(layer), []).append(layer)
            for heads, heads_layers in by_heads.items():
                kind = member_kind if heads == model_wide else f"{member_kind}@{heads}kv"
                kinds[kind] = functools.partial(
                    _rank_spec, member.spec, head_size, heads, num_kv_heads, model_total_num_kv_heads=model_wide
                )
                kept = heads_layers if layers_per_group is None else heads_layers[:layers_per_group]
                layers.extend((layer, kind) for layer in kept)
    kept_layers = {layer for layer, _ in layers}
    return Archetype(
        name or f"layout-{layout.model.rstrip('/').split('/')[-1].lower()}",
        layout.description or layout.model,
        model_wide,
        tuple(sorted(layers, key=lambda entry: _layer_order(entry[0]))),
        MappingProxyType(kinds),
        MappingProxyType({layer: heads for layer, heads in layout.kv_heads_by_layer.items() if layer in kept_layers}),
    )


def group_true_factor(layer_factors: Mapping[str, int], layer_names: Collection[str]) -> int:
    """A group's physical factor: the gcd of its layers' (a uniform group mixes kinds)."""
    return math.gcd(*(layer_factors[layer] for layer in layer_names))
