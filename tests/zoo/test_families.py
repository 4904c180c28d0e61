"""Per-family fixes (:mod:`kvpolicy.harness.zoo.families`): each tiny copy carries the fields vLLM's model
code reads where transformers' configuration class lacks them, with the value of the model's published
checkpoint (or what the copy's own fields say), and still keeps what decides what TP ranks hold.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from conftest import require

require("transformers")

from kvpolicy.harness.zoo.shrink import shrink, tp_deciding_changes  # noqa: E402

warnings.filterwarnings("ignore")


@pytest.mark.parametrize(("architecture", "expected"), [
    ("AfmoeForCausalLM", {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}),
    ("MiniMaxM2ForCausalLM", {"scoring_func": "sigmoid", "use_routing_bias": True}),
    ("LongcatFlashForCausalLM", {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity"}),
])
def test_a_copy_carries_the_checkpoint_fields_vllm_reads(architecture: str, expected: dict[str, object]) -> None:
    copy = shrink(architecture)
    assert {key: copy.config.get(key) for key in expected} == expected
    assert all(change.reason for change in copy.shrunk if change.field in expected)
    assert tp_deciding_changes(copy.original, copy.config, copy.layers) == []


def test_minimax_m2_keeps_its_rotary_dim_fix() -> None:
    copy = shrink("MiniMaxM2ForCausalLM")
    assert copy.config["rotary_dim"] == copy.config["head_dim"] // 2


def test_hy_v3_sizes_its_experts_by_moe_intermediate_size_and_keeps_its_dense_prefix() -> None:
    copy = shrink("HYV3ForCausalLM")
    assert copy.config["expert_hidden_dim"] == copy.config["moe_intermediate_size"]
    assert copy.config["route_norm"] is True and copy.config["qk_norm"] is True
    assert copy.config["first_k_dense_replace"] == copy.config["mlp_layer_types"].index("sparse")


def test_mimo_v2_flash_restates_its_layer_pattern_and_sliding_attention_sizes() -> None:
    copy = shrink("MiMoV2FlashForCausalLM")
    config = copy.config
    assert config["hybrid_layer_pattern"] == [int(kind == "sliding_attention") for kind in config["layer_types"]]
    assert config["moe_layer_freq"] == [int(kind == "sparse") for kind in config["mlp_layer_types"]]
    assert set(config["hybrid_layer_pattern"]) == {0, 1} and set(config["moe_layer_freq"]) == {0, 1}
    # transformers' sliding layers: twice the KV heads, the same head sizes, an attention sink.
    assert config["swa_num_key_value_heads"] == 2 * config["num_key_value_heads"]
    assert config["swa_num_attention_heads"] == config["num_attention_heads"]
    assert (config["swa_head_dim"], config["swa_v_head_dim"]) == (config["head_dim"], config["v_head_dim"])
    assert config["sliding_window_size"] == config["sliding_window"]
    assert config["add_swa_attention_sink_bias"] is True and config["add_full_attention_sink_bias"] is False
    assert config["layernorm_epsilon"] == config["rms_norm_eps"]
    assert config["rope_theta"] == config["rope_parameters"]["full_attention"]["rope_theta"]
    assert config["swa_rope_theta"] == config["rope_parameters"]["sliding_attention"]["rope_theta"]
    assert tp_deciding_changes(copy.original, config, copy.layers) == []


def test_dbrx_states_rope_theta_in_its_attention_config() -> None:
    copy = shrink("DbrxForCausalLM")
    assert copy.config["attn_config"]["rope_theta"] == copy.config["rope_parameters"]["rope_theta"]
    assert copy.config["attn_config"]["kv_n_heads"] == copy.original["attn_config"]["kv_n_heads"]


def test_hrm_text_shrinks_its_stacks_and_counts_one_layer_per_attention_step() -> None:
    copy = shrink("HrmTextForCausalLM")
    config, original = copy.config, copy.original
    steps = original["H_cycles"] * (original["L_cycles"] + 1)
    assert original["num_hidden_layers"] == original["num_layers_per_stack"] * steps
    assert (config["H_cycles"], config["L_cycles"]) == (original["H_cycles"], original["L_cycles"])
    assert config["num_layers_per_stack"] == 1
    assert config["num_hidden_layers"] == steps


def checkpoint_names(architecture: str, directory: Path) -> set[str]:
    from safetensors import safe_open

    from kvpolicy.harness.zoo.observe import build

    target = build(shrink(architecture), directory)
    with safe_open(str(target / "model.safetensors"), "pt") as checkpoint:
        return set(checkpoint.keys())


def test_longcat_flash_checkpoint_holds_no_zero_expert_weights(tmp_path: Path) -> None:
    routed = shrink("LongcatFlashForCausalLM").config["n_routed_experts"]
    experts = {int(name.split(".mlp.experts.")[1].split(".")[0])
               for name in checkpoint_names("LongcatFlashForCausalLM", tmp_path) if ".mlp.experts." in name}
    assert experts == set(range(routed))


def test_axk1_checkpoint_holds_a_post_mlp_norm_on_every_layer_dense_ones_too(tmp_path: Path) -> None:
    copy = shrink("AXK1ForCausalLM")
    names = checkpoint_names("AXK1ForCausalLM", tmp_path)
    assert copy.config.get("first_k_dense_replace", 0) >= 1  # a dense layer, which transformers saves without it
    assert {f"model.layers.{layer}.post_mlp_layernorm.weight" for layer in range(len(copy.layers))} <= names
