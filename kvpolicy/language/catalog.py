"""The spec classes vLLM 0.32 ships: their base classes and dataclass fields.

Used only for authoring help (did-you-mean on class and field names, spotting shadowed rules, the variables an
expression may read). Planning never depends on it: a layout carries its own class names and bases,
so a spec class added later by vLLM or a plugin is planned by a YAML rule alone.
"""

from __future__ import annotations

from types import MappingProxyType

SPEC_CLASSES: MappingProxyType[str, tuple[str, ...]] = MappingProxyType(
    {
        "KVCacheSpec": (),
        "AttentionSpec": ("KVCacheSpec",),
        "HiSparseHotSpec": ("KVCacheSpec",),
        "HiSparseResidentSpec": ("KVCacheSpec",),
        "MambaSpec": ("KVCacheSpec",),
        "UniformTypeKVCacheSpecs": ("KVCacheSpec",),
        "ChunkedLocalAttentionSpec": ("AttentionSpec", "KVCacheSpec"),
        "CircularBufferSpec": ("AttentionSpec", "KVCacheSpec"),
        "CrossAttentionSpec": ("AttentionSpec", "KVCacheSpec"),
        "EncoderOnlyAttentionSpec": ("AttentionSpec", "KVCacheSpec"),
        "FullAttentionSpec": ("AttentionSpec", "KVCacheSpec"),
        "SlidingWindowSpec": ("AttentionSpec", "KVCacheSpec"),
        "MLAAttentionSpec": ("FullAttentionSpec", "AttentionSpec", "KVCacheSpec"),
        "RSWASpec": ("FullAttentionSpec", "AttentionSpec", "KVCacheSpec"),
        "SinkFullAttentionSpec": ("FullAttentionSpec", "AttentionSpec", "KVCacheSpec"),
        "SlidingWindowMLASpec": ("SlidingWindowSpec", "AttentionSpec", "KVCacheSpec"),
        "HiddenStateCacheSpec": ("MLAAttentionSpec", "FullAttentionSpec", "AttentionSpec", "KVCacheSpec"),
    }
)
"""Spec class name → base class names, most specific first."""

SPEC_FIELDS: frozenset[str] = frozenset(
    {
        "alignment",
        "attention_chunk_size",
        "block_size",
        "block_stride_alignment",
        "blocks_per_request",
        "bounded_replay",
        "cache_dtype_str",
        "cache_role",
        "dcp_sharded",
        "dtype",
        "dtypes",
        "extra_retained_tokens",
        "head_size",
        "head_size_v",
        "is_index_group_leader",
        "kv_cache_specs",
        "kv_quant_mode",
        "mamba_cache_mode",
        "mamba_type",
        "max_tp_shards",
        "model_version",
        "non_causal",
        "non_causal_multi_token_decode",
        "num_head_slots",
        "num_heads",
        "num_kv_heads",
        "num_prefill_checkpoint_blocks",
        "num_speculative_blocks",
        "page_size",
        "page_size_padded",
        "prefill_checkpoint_alignment",
        "rswa_window",
        "shapes",
        "sink_len",
        "sliding_window",
        "state_content_bytes",
        "tokens_per_state",
        "tp_replicated",
    }
)
"""Every dataclass field of those classes."""


def is_subclass(name: str, ancestor: str) -> bool | None:
    """Whether spec class ``name`` is ``ancestor`` or derives from it; None when ``name`` is unknown."""
    if name == ancestor:
        return True
    bases = SPEC_CLASSES.get(name)
    return None if bases is None else ancestor in bases
