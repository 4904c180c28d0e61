"""``examples/layouts/gemma-4-26b-a4b.yaml`` against vLLM itself: from the published config's values,
vLLM's ``ModelConfig`` gives each layer's KV heads and head size, the specs its ``Attention`` layers
would declare on the example's hardware go through vLLM's own grouping (``get_kv_cache_groups``, page
sizes unified by vLLM), and the layout adapter describes the result. At tp 1, 2, 4, 8 and 16 the
example, evaluated at that tp, must state the same groups, layers, block and page sizes, per-rank
fields and per-layer KV heads.

Two stand-ins, because a CPU machine cannot have the rest: the ``ModelConfig`` is the text model's
(``Gemma4ForCausalLM``; inspecting the multimodal class needs torchvision), whose per-layer values are
the ones the multimodal config's ``text_config`` gives; and the specs are built as
``Attention.get_kv_cache_spec`` builds them with the example's backend (TRITON_ATTN, block sizes in
multiples of 16: 16 for both kinds of layer), with the CPU platform's own adjustments off.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from unittest import mock

import pytest
from conftest import require

require("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec  # noqa: E402

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

from kvpolicy.documents.loader import load_layout  # noqa: E402
from kvpolicy.language.models import Layout, thawed  # noqa: E402
from kvpolicy.vllm.layout import layout_from_kv_cache_config  # noqa: E402

EXAMPLE = Path(__file__).parents[2] / "examples" / "layouts" / "gemma-4-26b-a4b.yaml"
TP_SIZES = (1, 2, 4, 8, 16)
BLOCK_SIZE = 16
"""The default block size, which TRITON_ATTN (multiples of 16) keeps."""
LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 5
TEXT_CONFIG = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "num_hidden_layers": 30,
    "layer_types": LAYER_TYPES, "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
    "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True, "sliding_window": 1024,
    "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "hidden_size": 2816, "intermediate_size": 2112,
    "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
    "vocab_size": 262144, "max_position_embeddings": 262144, "dtype": "bfloat16",
}
"""google/gemma-4-26B-A4B's text config: the values the example's ``source`` names, and what the config
classes need to construct."""
LAYER = "language_model.model.layers.{}.self_attn.attn"
"""How Gemma4ForConditionalGeneration registers a decoder layer's attention."""


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    directory = tmp_path_factory.mktemp("gemma-4-26b-a4b")
    (directory / "config.json").write_text(json.dumps(TEXT_CONFIG))
    return ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)


def vllm_layout(model_config: ModelConfig, tp_size: int) -> Layout:
    """The layout the connector would capture at ``tp_size``."""
    no_cpu_adjustments = classmethod(lambda cls, vllm_config: None)
    with mock.patch.object(type(current_platform), "check_and_update_config", no_cpu_adjustments):
        vllm_config = VllmConfig(
            model_config=model_config,
            parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        )
    arch_config = model_config.model_arch_config
    specs = {}
    for index, kind in enumerate(LAYER_TYPES):
        layer = arch_config[index]
        shape = {
            "block_size": BLOCK_SIZE,
            "num_kv_heads": model_config.get_num_kv_heads(vllm_config.parallel_config, arch_config=layer),
            "head_size": layer.head_size,
            "dtype": torch.bfloat16,
        }
        specs[LAYER.format(index)] = (
            SlidingWindowSpec(**shape, sliding_window=TEXT_CONFIG["sliding_window"])
            if kind == "sliding_attention"
            else FullAttentionSpec(**shape)
        )
    supported = [layout.name for layout in get_supported_kv_cache_layouts([TritonAttentionBackend])]
    resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    groups = get_kv_cache_groups(vllm_config, specs)
    return layout_from_kv_cache_config(
        KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups),
        model="google/gemma-4-26B-A4B",
        total_num_kv_heads=model_config.get_total_num_kv_heads(),
        model_config=model_config,
    )


@pytest.fixture(scope="module")
def captured(model_config: ModelConfig):
    """``captured(tp_size)``: :func:`vllm_layout` at ``tp_size``, built once."""
    return functools.cache(functools.partial(vllm_layout, model_config))


def stated(layout: Layout, tp_size: int, stated_fields: Layout | None = None) -> list[tuple]:
    """Per group: name, spec type, layers, block size, page size, and the fields the example states."""
    names = stated_fields or layout
    variables = {"tp_size": tp_size, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
                 "total_num_kv_heads": layout.total_num_kv_heads}
    rows = []
    for group, example_group in zip(layout.groups, names.groups, strict=True):
        values = group.spec.evaluate(variables)
        fields = {name: thawed(values.fields[name]) for name in example_group.spec.fields}
        rows.append((group.name, group.spec.type, group.layers, values.block_size, values.page_size_bytes, fields))
    return rows


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_the_example_groups_are_vllms_at_every_tp(captured, tp_size: int) -> None:
    example = load_layout(EXAMPLE)
    assert stated(example, tp_size) == stated(captured(tp_size), tp_size, stated_fields=example)


def test_the_example_states_vllms_model_wide_kv_heads(captured) -> None:
    assert load_layout(EXAMPLE).total_num_kv_heads == captured(1).total_num_kv_heads


def test_the_example_states_each_layers_own_kv_heads_as_vllm_keeps_them(captured) -> None:
    assert load_layout(EXAMPLE).kv_heads_by_layer == captured(1).kv_heads_by_layer


def test_the_full_attention_layers_are_the_ones_with_their_own_count() -> None:
    full = {LAYER.format(index) for index, kind in enumerate(LAYER_TYPES) if kind == "full_attention"}
    own = TEXT_CONFIG["num_global_key_value_heads"]
    assert dict(load_layout(EXAMPLE).kv_heads_by_layer) == dict.fromkeys(full, own)
