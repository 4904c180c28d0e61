"""The example hybrid layouts state block sizes, page sizes and state shapes as expressions over the
topology; here vLLM itself computes them at tp 1, 2, 4 and 8 and the two must agree.

For each model a ``VllmConfig`` is built from its published ``config.json`` dimensions (no weights),
vLLM's own ``Platform._align_hybrid_block_size`` picks the block size, and the model class's own
``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` give the state. The
specs vLLM would build from those values go through the layout adapter (``spec_document``) and are
compared with the example layout evaluated at the same TP size, then planned: bytes per token must
be equal too.

What cannot exist on a CPU machine is a GPU platform: the example layouts describe an H100
deployment, so the configs are built with the CPU platform's own adjustments switched off (it
turns MLA prefix caching off and may store GDN state in fp32; a GPU platform does neither), and the
attention backends are the GPU ones the layouts name (FLASH_ATTN, FlashMLA), whose classes import
on CPU. Nothing else is replaced.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from conftest import require

require("vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.model_executor.models import ModelRegistry  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec  # noqa: E402

from kvpolicy.documents.loader import load_layout, load_policy, resolve_policy_path  # noqa: E402
from kvpolicy.language.models import Layout, SpecValues, Topology, thawed  # noqa: E402
from kvpolicy.planning.engine import make_plan  # noqa: E402
from kvpolicy.vllm.layout import spec_document  # noqa: E402

TP_SIZES = (1, 2, 4, 8)
EXAMPLES = Path(__file__).parents[2] / "examples" / "layouts"

# Published config.json dimensions of each model (only what the KV cache depends on, plus what
# the config classes need to construct).
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 48,
        "full_attention_interval": 4, "hidden_size": 2048, "intermediate_size": 5120, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16", "vocab_size": 151936, "max_position_embeddings": 4096, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    },
    "nemotron-h-8b": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", "hidden_size": 4096,
        "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "expand": 2, "torch_dtype": "bfloat16", "vocab_size": 131072, "max_position_embeddings": 8192,
    },
    "kimi-linear-48b-a3b": {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "num_hidden_layers": 27,
        "hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 32, "num_key_value_heads": 32,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "torch_dtype": "bfloat16", "vocab_size": 163840, "max_position_embeddings": 4096, "num_experts": 256,
        "moe_intermediate_size": 1024, "num_experts_per_token": 8,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
            "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
        },
    },
}


@functools.cache
def _model_directory(name: str, root: Path) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIGS[name]))
    return directory


@functools.cache
def vllm_specs(name: str, tp_size: int, root: Path) -> tuple[MambaSpec, FullAttentionSpec | MLAAttentionSpec]:
    """The Mamba-like and the attention spec vLLM builds for ``name`` at ``tp_size`` on an H100."""
    model_config = ModelConfig(
        model=str(_model_directory(name, root)), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096
    )
    no_cpu_adjustments = classmethod(lambda cls, vllm_config: None)
    with mock.patch.object(type(current_platform), "check_and_update_config", no_cpu_adjustments):
        vllm_config = VllmConfig(
            model_config=model_config,
            parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
            cache_config=CacheConfig(block_size=16, enable_prefix_caching=True, mamba_cache_mode="align"),
        )
    backend = FlashMLABackend if model_config.use_mla else FlashAttentionBackend
    Platform._align_hybrid_block_size(vllm_config, backend)
    cache = vllm_config.cache_config
    model_class, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    state = MambaSpec(
        block_size=cache.mamba_block_size,
        shapes=model_class.get_mamba_state_shape_from_config(vllm_config),
        dtypes=model_class.get_mamba_state_dtype_from_config(vllm_config),
        page_size_padded=cache.mamba_page_size_padded,
        mamba_cache_mode="align",
    )
    heads, head_size = model_config.get_num_kv_heads(vllm_config.parallel_config), model_config.get_head_size()
    attention_class = MLAAttentionSpec if model_config.use_mla else FullAttentionSpec
    attention = attention_class(block_size=cache.block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    return state, attention


@pytest.fixture(scope="module")
def configs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("configs")


def example_spec(layout: Layout, spec_type: str, tp_size: int) -> SpecValues:
    spec = next(member.spec for group in layout.groups for member in group.members if spec_type in member.spec.classes)
    return spec.evaluate({"tp_size": tp_size, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
                          "total_num_kv_heads": layout.total_num_kv_heads})


def as_stated(spec: SpecValues, fields: tuple[str, ...]) -> dict[str, Any]:
    return {"block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes,
            **{name: thawed(spec.fields[name]) for name in fields}}


CASES = [(name, tp) for name in CONFIGS for tp in TP_SIZES]
STATE_FIELDS = ("shapes", "dtypes", "page_size_padded")


@pytest.mark.parametrize(("name", "tp_size"), CASES)
def test_the_example_state_spec_is_vllms_at_every_tp(name: str, tp_size: int, configs_root: Path) -> None:
    state, _ = vllm_specs(name, tp_size, configs_root)
    stated = as_stated(example_spec(load_layout(EXAMPLES / f"{name}.yaml"), "MambaSpec", tp_size), STATE_FIELDS)
    vllm_document = spec_document(state).evaluate({"tp_size": tp_size})
    assert stated == as_stated(vllm_document, STATE_FIELDS)


@pytest.mark.parametrize(("name", "tp_size"), CASES)
def test_the_example_attention_spec_is_vllms_at_every_tp(name: str, tp_size: int, configs_root: Path) -> None:
    _, attention = vllm_specs(name, tp_size, configs_root)
    stated = as_stated(example_spec(load_layout(EXAMPLES / f"{name}.yaml"), "AttentionSpec", tp_size), ("num_kv_heads", "head_size"))
    vllm_document = spec_document(attention).evaluate({"tp_size": tp_size})
    assert stated == as_stated(vllm_document, ("num_kv_heads", "head_size"))


@pytest.mark.parametrize(("name", "tp_size"), CASES)
def test_planned_bytes_per_token_are_vllms_at_every_tp(name: str, tp_size: int, configs_root: Path) -> None:
    layout = load_layout(EXAMPLES / f"{name}.yaml")
    plan = make_plan(load_policy(resolve_policy_path("no-dedup")), layout, Topology(tp_size=tp_size))
    state, attention = vllm_specs(name, tp_size, configs_root)
    expected = []
    for group in layout.groups:
        real = attention if "AttentionSpec" in group.members[0].spec.classes else state
        expected.append(real.page_size_bytes * len(group.members[0].layers) / real.block_size)
    assert [group.bytes_per_token_per_rank for group in plan.groups] == pytest.approx(expected, rel=1e-12)

