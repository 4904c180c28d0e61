"""An archetype at one TP size as vLLM's own config objects: what a model runner hands the connector."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.config.model_arch import ModelArchitectureConfig
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_cache_spec, resolve_kv_cache_block_sizes

try:  # vLLM 0.33 moved KV-cache planning out of kv_cache_utils, same signatures
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

from kvpolicy.language.models import Layout
from kvpolicy.sim.archetypes import BLOCK_SIZE, Archetype, get_archetype, group_true_factor
from kvpolicy.vllm.layout import layout_from_kv_cache_config

__all__ = ["ArchitectureOnly", "SimulatedModel", "architecture_config", "build_model"]


@dataclass(frozen=True)
class SimulatedModel:
    """An archetype at one TP size: vLLM's config objects for it, and its ground truth."""

    archetype: Archetype
    name: str
    """The model name keys carry (its basename, as vLLM's ``KeyMetadata.model_name``)."""
    tp_size: int
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    block_size: int
    """Scheduler block size (lcm of the groups')."""
    hash_block_size: int
    layer_true_factors: Mapping[str, int]
    """Layer → consecutive TP ranks repeating its heads (:func:`~kvpolicy.sim.archetypes.physical_factor`)."""
    dcp_size: int = 1
    """Decode-context parallelism: rank ``r`` holds the tokens of dcp rank ``r % dcp_size``."""
    attention_layers: frozenset[str] = frozenset()
    """Layers whose blocks are KV heads (an ``AttentionSpec``), which the ground truth models per head."""

    @property
    def total_num_kv_heads(self) -> int:
        """The model-wide KV heads (vLLM's ``get_total_num_kv_heads()``)."""
        return self.archetype.kv_heads(self.tp_size)

    @property
    def true_factors(self) -> tuple[int, ...]:
        """Per prefix-cacheable group: the ranks holding identical bytes, the ground truth's replica-set
        size: the gcd of its layers' head factors, of which only ranks of equal dcp rank share tokens."""
        sizes = []
        for group in self.kv_cache_config.prefix_cacheable_groups:
            heads = group_true_factor(self.layer_true_factors, group.layer_names)
            sizes.append(heads // self.dcp_size if heads % self.dcp_size == 0 else 1)
        return tuple(sizes)

    def group_block_size(self, group: int) -> int:
        """Tokens per chunk of a group as the store sees it: the spec's block size, times ``dcp_size``
        for a DCP-sharded spec (each rank's block holds every ``dcp_size``-th token of the chunk)."""
        spec = self.kv_cache_config.prefix_cacheable_groups[group].kv_cache_spec
        return resolve_dcp_kv_cache_spec(spec, self.dcp_size).block_size

    @property
    def layout(self) -> Layout:
        """The kvpolicy layout of this model's ``KVCacheConfig``, as the connector derives it (each
        layer's own KV heads read off the model config, as on an engine)."""
        return layout_from_kv_cache_config(
            self.kv_cache_config, model=self.name, total_num_kv_heads=self.total_num_kv_heads,
            model_config=self.vllm_config.model_config,
        )


_ARCH_VALUES: Mapping[str, object] = MappingProxyType({
    "architectures": ["SimulatedForCausalLM"], "model_type": "kvpolicy-sim", "text_model_type": None,
    "hidden_size": 0, "total_num_attention_heads": 0, "head_size": 0, "vocab_size": 0, "num_experts": 0,
    "num_experts_per_token": 0, "quantization_config": None, "is_deepseek_mla": False, "is_mm_prefix_lm": False,
    "rswa_window": None, "derived_max_model_len_and_key": (float("inf"), None),
})
"""A simulated model's architecture fields besides its layers and KV heads, which no one reads."""


@dataclass(frozen=True)
class ArchitectureOnly:
    """The part of vLLM's ``ModelConfig`` a simulated instance has: the model's architecture config,
    where an engine's connector reads each layer's own KV heads (``model_arch_config[layer_index]``).
    A simulation has no checkpoint to build a whole ``ModelConfig`` from."""

    model_arch_config: ModelArchitectureConfig
    """vLLM's own class: the model-wide values, and each layer's own in ``per_layer_overrides``."""


def architecture_config(archetype: Archetype, tp_size: int) -> ModelArchitectureConfig:
    """``archetype`` at ``tp_size`` as vLLM's ``ModelArchitectureConfig``: its layers (indexed as vLLM's
    ``extract_layer_index`` reads their names), its model-wide KV heads, and each layer's own count
    (:attr:`Archetype.layer_kv_heads`) in ``per_layer_overrides``."""
    model_wide = archetype.kv_heads(tp_size)
    try:
        indices = {layer: extract_layer_index(layer) for layer, _ in archetype.layers}
    except AssertionError:
        raise ValueError(f"archetype {archetype.name!r}: a layer name has no single layer index") from None
    overrides: list[dict[str, object]] = [{} for _ in range(max(indices.values()) + 1)]
    for layer, heads in archetype.layer_kv_heads.items():
        if heads != model_wide:
            overrides[indices[layer]]["total_num_kv_heads"] = heads
    fields = [field.name for field in dataclasses.fields(ModelArchitectureConfig) if field.init]
    values = {name: _ARCH_VALUES[name] for name in fields if name in _ARCH_VALUES}
    return ModelArchitectureConfig(
        **values,
        total_num_hidden_layers=len(overrides),
        total_num_kv_heads=model_wide,
        per_layer_overrides=overrides if any(overrides) else None,
    )


def build_model(
    archetype: str | Archetype,
    tp_size: int,
    *,
    model_name: str,
    blocks_needed: int,
    blocks_per_group: int = 0,
    extra_config: Mapping[str, object] = MappingProxyType({}),
    dcp_size: int = 1,
    kv_cache_layout: str | None = None,
    pp_size: int = 1,
) -> SimulatedModel:
    """vLLM's ``KVCacheConfig`` for ``archetype`` at ``tp_size``: layers grouped by vLLM's
    ``get_kv_cache_groups`` and sized by ``get_kv_cache_config_from_groups`` for ``blocks_needed``
    blocks plus ``blocks_per_group`` per prefix-cacheable group (block ids come from one pool for all
    groups), with prefix caching and Mamba ``align`` mode on, as a hybrid engine runs.
    ``extra_config`` is the ``kv_connector_extra_config`` the workers read. ``dcp_size`` > 1 runs
    decode-context parallelism: vLLM's CPU platform refuses it when the config is validated, so it is
    set on the parallel config afterwards, where the coordinator and the block-size resolution read it.
    ``kv_cache_layout`` (a ``KVCacheLayout`` name, e.g. ``LBHNC``, the one vLLM's CPU attention
    backend supports) is the layout the attention backends would declare; by default vLLM's own
    preference for backends that declare none. ``pp_size`` sets the pipeline size the workers read
    (every stage gets all of the archetype's layers: the key namespaces are what it changes)."""
    shape = get_archetype(archetype)
    if tp_size < 1:
        raise ValueError(f"tp_size must be positive, got {tp_size}")
    if dcp_size < 1 or tp_size % dcp_size:
        raise ValueError(f"dcp_size {dcp_size} must divide tp_size {tp_size}")
    vllm_config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, mamba_cache_mode="align"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeStoreConnector", kv_role="kv_both", kv_connector_extra_config=dict(extra_config)
        ),
    )
    vllm_config.parallel_config.decode_context_parallel_size = dcp_size
    specs = shape.specs(tp_size)
    # The engine core resolves one layout from what the attention backends support; there are no
    # backends here, so the given one or vLLM's default preference (what undeclared backends get).
    supported = [kv_cache_layout] if kv_cache_layout else [layout.name for layout in get_supported_kv_cache_layouts(())]
    resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    blocks_needed += blocks_per_group * sum(1 for group in groups if group.kv_cache_spec.prefix_cacheable)
    bytes_per_block = sum(spec.page_size_bytes for spec in specs.values())
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, blocks_needed * bytes_per_block)
    if kv_cache_config.num_blocks > blocks_needed:
        # Where vLLM shares tensors between groups, a block costs less than every layer's page: size the
        # memory again for the blocks asked for (at real page sizes the first guess runs into GiBs).
        per_block = blocks_needed * bytes_per_block / kv_cache_config.num_blocks
        resized = get_kv_cache_config_from_groups(vllm_config, groups, math.ceil((blocks_needed + 1) * per_block))
        if resized.num_blocks >= blocks_needed:
            kv_cache_config = resized
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if shape.layer_kv_heads:
        # Where an engine's connector finds each layer's own KV heads. Set once the KV cache is planned
        # (vLLM's planning ran without a model config, as for every archetype) and after validation,
        # which would want a whole ModelConfig.
        vllm_config.model_config = ArchitectureOnly(architecture_config(shape, tp_size))  # type: ignore[assignment]
    return SimulatedModel(
        archetype=shape,
        name=model_name,
        tp_size=tp_size,
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        hash_block_size=hash_block_size,
        layer_true_factors=MappingProxyType(shape.true_factors(tp_size)),
        dcp_size=dcp_size,
        attention_layers=frozenset(layer for layer, spec in specs.items() if isinstance(spec, AttentionSpec)),
    )
