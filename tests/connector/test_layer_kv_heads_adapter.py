"""The layout adapter's ``layer_kv_heads``: the KV heads vLLM keeps per layer (its architecture config,
``model_config.model_arch_config[layer_index]``), read from real vLLM ``ModelConfig`` objects built
from Gemma-4 configs (transformers' ``Gemma4TextConfig``, no weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require

require("vllm")
require("transformers")

import torch  # noqa: E402
from vllm.config import ModelConfig  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvpolicy.documents.loader import check_text, load_policy, policies_dir  # noqa: E402
from kvpolicy.language.dumper import dump_layout  # noqa: E402
from kvpolicy.language.models import LayerHeads, Layout, Topology  # noqa: E402
from kvpolicy.planning.engine import make_plan  # noqa: E402
from kvpolicy.vllm import internals  # noqa: E402
from kvpolicy.vllm.internals import MODEL_ARCH, Internal, drift  # noqa: E402
from kvpolicy.vllm.layout import layout_from_kv_cache_config  # noqa: E402

BLOCK = 16
LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


def layer(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


SLIDING = [layer(index) for index, kind in enumerate(LAYER_TYPES) if kind == "sliding_attention"]
FULL = [layer(index) for index, kind in enumerate(LAYER_TYPES) if kind == "full_attention"]


def gemma4_model_config(root: Path, *, sliding: int, full: int, k_eq_v: bool = True) -> ModelConfig:
    """vLLM's ``ModelConfig`` of a Gemma-4 whose sliding layers have ``sliding`` KV heads and whose
    full-attention layers have ``full`` (through ``num_global_key_value_heads``)."""
    from transformers import Gemma4TextConfig

    directory = root / f"gemma4-{sliding}-{full}-{k_eq_v}"
    config = Gemma4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=sliding, head_dim=32,
        global_head_dim=32, num_global_key_value_heads=full, attention_k_eq_v=k_eq_v, sliding_window=128,
        hidden_size_per_layer_input=0, max_position_embeddings=1024,
    )
    config.architectures = ["Gemma4ForCausalLM"]
    config.save_pretrained(directory)
    return ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gemma4-configs")
    made: dict[tuple[int, int, bool], ModelConfig] = {}

    def get(sliding: int, full: int, k_eq_v: bool = True) -> ModelConfig:
        if (sliding, full, k_eq_v) not in made:
            made[sliding, full, k_eq_v] = gemma4_model_config(root, sliding=sliding, full=full, k_eq_v=k_eq_v)
        return made[sliding, full, k_eq_v]

    return get


def sliding_spec() -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32, sliding_window=128)


def full_spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)


def gemma_kv_cache_config() -> KVCacheConfig:
    """The two groups vLLM builds for the Gemma-4 above at TP 2 (one head per rank in both)."""
    return KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(SLIDING, sliding_spec()), KVCacheGroupSpec(FULL, full_spec())],
    )


def captured(model_config: ModelConfig | None, **options) -> Layout:
    model_wide = 2 if model_config is None else model_config.get_total_num_kv_heads()
    return layout_from_kv_cache_config(
        gemma_kv_cache_config(), model="tiny-gemma4", total_num_kv_heads=model_wide, model_config=model_config,
        **options,
    )


# --- what vLLM keeps per layer ---------------------------------------------------------------------


def test_the_sliding_layers_below_the_model_wide_count_are_listed_with_their_own(configs) -> None:
    layout = captured(configs(1, 2))
    assert layout.total_num_kv_heads == 2
    assert layout.layer_kv_heads == (LayerHeads(total_num_kv_heads=1, layers=tuple(SLIDING)),)


def test_full_attention_layers_below_the_model_wide_count_are_listed_with_their_own(configs) -> None:
    layout = captured(configs(2, 1))
    assert layout.total_num_kv_heads == 2
    assert layout.layer_kv_heads == (LayerHeads(total_num_kv_heads=1, layers=tuple(FULL)),)


def test_a_model_whose_layers_agree_has_none(configs) -> None:
    assert captured(configs(2, 2)).layer_kv_heads == ()


def test_without_k_eq_v_gemma4_full_layers_keep_num_key_value_heads(configs) -> None:
    # transformers gives full-attention layers num_global_key_value_heads only with attention_k_eq_v.
    layout = captured(configs(1, 2, k_eq_v=False))
    assert (layout.total_num_kv_heads, layout.layer_kv_heads) == (1, ())


def test_without_a_model_config_there_are_none() -> None:
    assert captured(None).layer_kv_heads == ()


def test_stated_counts_are_listed_and_win_over_the_model_config(configs) -> None:
    layout = captured(configs(1, 2), kv_heads_by_layer={SLIDING[0]: 2, FULL[0]: 1})
    # In group order: the sliding group's layers first.
    assert layout.layer_kv_heads == (LayerHeads(total_num_kv_heads=1, layers=(SLIDING[1], FULL[0])),)


def test_a_count_stated_for_a_state_layer_is_not_listed() -> None:
    state = MambaSpec(block_size=BLOCK, shapes=((3, 64),), dtypes=(torch.float32,))
    kv_cache_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.mixer"], state), KVCacheGroupSpec(FULL, full_spec())],
    )
    layout = layout_from_kv_cache_config(
        kv_cache_config, model="tiny-hybrid", total_num_kv_heads=2,
        kv_heads_by_layer={"model.layers.0.mixer": 1, FULL[0]: 1},
    )
    assert layout.layer_kv_heads == (LayerHeads(total_num_kv_heads=1, layers=(FULL[0],)),)


def test_layers_of_a_uniform_group_get_their_own_counts(configs) -> None:
    specs = {name: full_spec() for name in (layer(0), layer(1))}
    uniform = UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs)
    kv_cache_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(specs), uniform)]
    )
    layout = layout_from_kv_cache_config(
        kv_cache_config, model="tiny-gemma4", total_num_kv_heads=2, model_config=configs(1, 2)
    )
    assert layout.layer_kv_heads == (LayerHeads(total_num_kv_heads=1, layers=(layer(0),)),)


def test_a_name_vllm_cannot_index_keeps_the_model_wide_count(configs) -> None:
    names = ["lm_head.attn", "model.layers.0.block.1.attn", "model.layers.99.self_attn.attn", layer(0)]
    assert internals.layer_total_num_kv_heads(configs(1, 2), names) == {layer(0): 1}


# --- the captured layout, written and planned ------------------------------------------------------


def test_the_captured_layout_reads_back_equal_with_its_layer_kv_heads(configs) -> None:
    layout = captured(configs(1, 2))
    assert check_text(dump_layout(layout, captured_at=Topology(tp_size=2))) == (layout, [])


def test_default_shares_the_sliding_group_and_vllm_compat_does_not(configs) -> None:
    layout = captured(configs(1, 2))
    topology = Topology(tp_size=2)
    factors = {name: make_plan(load_policy(policies_dir() / f"{name}.yaml"), layout, topology).factors
               for name in ("default", "vllm-compat")}
    assert factors == {"default": (2, 1), "vllm-compat": (1, 1)}


# --- the drift check of the fields read ------------------------------------------------------------


def test_a_dataclass_field_vllm_no_longer_has_is_reported() -> None:
    entry = Internal(MODEL_ARCH, "ModelArchitectureConfig.kv_heads_gone", "field", None, "test")
    assert drift([entry], ()) == [
        f"{MODEL_ARCH}.ModelArchitectureConfig.kv_heads_gone: ModelArchitectureConfig no longer has the field"
        + " kv_heads_gone"
    ]


def test_the_field_check_sees_the_field_it_reads() -> None:
    assert drift([Internal(MODEL_ARCH, "ModelArchitectureConfig.total_num_kv_heads", "field", None, "test")], ()) == []
