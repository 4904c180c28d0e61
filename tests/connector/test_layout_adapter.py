"""The vLLM layout adapter, run on real vLLM spec and config classes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod

import pytest

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("vllm is not installed", allow_module_level=True)

import torch
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

from kvpolicy.language.models import Layout, thawed
from kvpolicy.vllm.layout import layout_from_kv_cache_config, spec_document

BLOCK = 16


def full_attention(num_kv_heads: int = 2, head_size: int = 64) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.bfloat16)


def mla(head_size: int = 576) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16)


MAMBA_SHAPES = ((3, 256), (8, 64, 16))


def mamba() -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=MAMBA_SHAPES, dtypes=(torch.bfloat16, torch.float32))


@dataclass(frozen=True)
class ShortConvStateSpec(MambaSpec):
    """Exists only in this test module: the adapter cannot have code for it."""

    conv_kernel_size: int = 4


def config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))


def layout_of(*groups: KVCacheGroupSpec) -> Layout:
    return layout_from_kv_cache_config(config(*groups), model="org/tiny", total_num_kv_heads=2)


def hybrid() -> Layout:
    return layout_of(
        KVCacheGroupSpec(["l.0.attn", "l.3.attn"], full_attention()),
        KVCacheGroupSpec(["l.1.attn"], mla()),
        KVCacheGroupSpec(["l.2.mixer"], mamba()),
    )


def test_hybrid_groups_keep_vllm_order_and_classes() -> None:
    assert [group.spec.type for group in hybrid().groups] == ["FullAttentionSpec", "MLAAttentionSpec", "MambaSpec"]


def test_hybrid_groups_have_their_base_classes() -> None:
    assert [group.spec.bases for group in hybrid().groups] == [
        ("AttentionSpec", "KVCacheSpec"),
        ("FullAttentionSpec", "AttentionSpec", "KVCacheSpec"),
        ("KVCacheSpec",),
    ]


def test_hybrid_page_sizes_match_the_spec_formulas() -> None:
    bf16, fp32 = 2, 4
    full = BLOCK * 2 * (64 + 64) * bf16  # heads x (K + V) per token
    latent = BLOCK * 1 * 576 * bf16  # one latent vector, no separate V
    state = prod(MAMBA_SHAPES[0]) * bf16 + prod(MAMBA_SHAPES[1]) * fp32
    assert [group.spec.page_size_bytes.evaluate({}) for group in hybrid().groups] == [full, latent, state]


def test_hybrid_groups_carry_block_size_and_layers() -> None:
    assert [(group.spec.block_size.evaluate({}), group.layers) for group in hybrid().groups] == [
        (BLOCK, ("l.0.attn", "l.3.attn")),
        (BLOCK, ("l.1.attn",)),
        (BLOCK, ("l.2.mixer",)),
    ]


def test_group_names_are_kebab_class_names() -> None:
    assert [group.name for group in hybrid().groups] == ["full-attention", "mla-attention", "mamba"]


def test_repeated_group_names_get_their_index() -> None:
    layout = layout_of(
        KVCacheGroupSpec(["a"], full_attention()),
        KVCacheGroupSpec(["b"], mla()),
        KVCacheGroupSpec(["c"], full_attention(num_kv_heads=4)),
    )
    assert [group.name for group in layout.groups] == ["full-attention-0", "mla-attention", "full-attention-2"]


def test_fields_are_converted_to_yaml_values() -> None:
    fields = thawed(spec_document(mamba()).fields)
    assert (fields["shapes"], fields["dtypes"], fields["tp_replicated"], fields["page_size_padded"]) == (
        [[3, 256], [8, 64, 16]],
        ["bfloat16", "float32"],
        False,
        None,
    )


def test_enum_fields_become_their_scalar_value() -> None:
    fields = spec_document(mla()).fields
    assert (fields["cache_role"], fields["kv_quant_mode"]) == ("sparse", 0)


def test_block_size_is_not_repeated_in_fields() -> None:
    assert "block_size" not in spec_document(full_attention()).fields


def test_spec_class_unknown_to_the_adapter_keeps_its_name_bases_and_extra_field() -> None:
    document = spec_document(ShortConvStateSpec(block_size=BLOCK, shapes=((4, 32),), dtypes=(torch.float32,)))
    page_size_bytes = document.page_size_bytes.evaluate({})
    assert (document.type, document.bases, document.fields["conv_kernel_size"], page_size_bytes) == (
        "ShortConvStateSpec",
        ("MambaSpec", "KVCacheSpec"),
        4,
        4 * 32 * 4,
    )


def test_spec_class_unknown_to_the_adapter_is_named_after_its_class() -> None:
    spec = ShortConvStateSpec(block_size=BLOCK, shapes=((4,),), dtypes=(torch.float32,))
    layout = layout_of(KVCacheGroupSpec(["l.0.conv"], spec))
    assert layout.groups[0].name == "short-conv-state"


def uniform_layout() -> Layout:
    specs: dict[str, KVCacheSpec] = {"l.0": mla(), "l.1": full_attention(), "l.2": mla(), "l.3": full_attention()}
    return layout_of(KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs)))


def test_uniform_group_merges_equal_layer_specs_in_first_appearance_order() -> None:
    (group,) = uniform_layout().groups
    assert [(entry.spec.type, entry.layers) for entry in group.uniform] == [
        ("MLAAttentionSpec", ("l.0", "l.2")),
        ("FullAttentionSpec", ("l.1", "l.3")),
    ]


def test_uniform_group_is_named_uniform() -> None:
    assert uniform_layout().groups[0].name == "uniform"


def test_uniform_layers_with_different_field_values_stay_apart() -> None:
    specs: dict[str, KVCacheSpec] = {"l.0": full_attention(), "l.1": full_attention(head_size=128)}
    uniform = UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs)
    layout = layout_of(KVCacheGroupSpec(list(specs), uniform))
    assert [entry.layers for entry in layout.groups[0].uniform] == [("l.0",), ("l.1",)]


def test_non_prefix_cacheable_groups_are_dropped_and_order_is_kept() -> None:
    ring = CircularBufferSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    assert not ring.prefix_cacheable
    layout = layout_of(
        KVCacheGroupSpec(["ring.0"], ring),
        KVCacheGroupSpec(["l.0"], mamba()),
        KVCacheGroupSpec(["ring.1"], ring),
        KVCacheGroupSpec(["l.1"], mla()),
    )
    assert [group.layers for group in layout.groups] == [("l.0",), ("l.1",)]


def test_groups_without_kv_transfer_are_dropped() -> None:
    layout = layout_of(
        KVCacheGroupSpec(["draft"], full_attention(), enable_kv_transfer=False),
        KVCacheGroupSpec(["l.0"], mla()),
    )
    assert [group.layers for group in layout.groups] == [("l.0",)]


def test_selection_is_the_one_the_mooncake_store_numbers() -> None:
    ring = CircularBufferSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = config(
        KVCacheGroupSpec(["ring"], ring),
        KVCacheGroupSpec(["draft"], full_attention(), enable_kv_transfer=False),
        KVCacheGroupSpec(["l.0"], mla()),
        KVCacheGroupSpec(["l.1"], mamba()),
    )
    layout = layout_from_kv_cache_config(kv_cache_config, model="org/tiny", total_num_kv_heads=2)
    assert [group.layers for group in layout.groups] == [
        tuple(group.layer_names) for group in kv_cache_config.prefix_cacheable_groups
    ]


def test_config_without_prefix_cacheable_groups_is_rejected() -> None:
    ring = CircularBufferSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="prefix-cacheable"):
        layout_of(KVCacheGroupSpec(["ring"], ring))


def test_layout_round_trips_through_model_dump() -> None:
    specs: dict[str, KVCacheSpec] = {"u.0": mla(), "u.1": full_attention()}
    layout = layout_of(
        KVCacheGroupSpec(["l.0"], full_attention()),
        KVCacheGroupSpec(["l.1"], mamba()),
        KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs)),
    )
    assert Layout.model_validate(layout.model_dump(mode="json")) == layout


def test_layout_carries_model_and_head_count() -> None:
    layout = hybrid()
    assert (layout.model, layout.total_num_kv_heads) == ("org/tiny", 2)


def test_an_attention_free_model_with_zero_kv_heads_makes_a_layout() -> None:
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["m.0"], mamba())])
    layout = layout_from_kv_cache_config(config, model="state-spaces/mamba2-130m", total_num_kv_heads=0)
    assert layout.total_num_kv_heads == 0 and [group.spec.type for group in layout.groups] == ["MambaSpec"]


def test_zero_kv_heads_beside_attention_is_one_clear_line() -> None:
    config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["m.0"], mamba()), KVCacheGroupSpec(["a.1"], full_attention())],
    )
    with pytest.raises(ValueError) as refused:
        layout_from_kv_cache_config(config, model="org/Broken", total_num_kv_heads=0)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("kvpolicy cannot describe this model's KV cache as a layout:")
    assert "group 1 holds attention (FullAttentionSpec)" in message
