"""Per-family fixes, where the generic rules of :mod:`~kvpolicy.harness.zoo.shrink` break a tie between
fields that a model (in transformers or vLLM) checks, or where vLLM's CPU path needs something.

Each entry names the model type, the fields it sets and why. A fix never changes a TP-deciding field
the copy has (:data:`~kvpolicy.harness.zoo.shrink.TP_DECIDING`); it sets the widths that depend on them, and
where vLLM reads a field transformers' class lacks, the value the model's published checkpoint has (or
what the copy's own fields restate), named in the reason. One such field is TP-deciding: MiMo-V2-Flash's
sliding-layer KV heads, twice the full layers' as in its checkpoint and in transformers' own model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

Fix = Iterator[tuple[str, Any, str]]
"""``(field, value, reason)`` for each field a family sets."""

MAMBA2 = "mamba2-cpu-prefill"
"""The plugin :mod:`kvpolicy.harness.zoo.plugins` holds for Mamba2 mixers on CPU (vllm#54504)."""

RECURRENT_TYPES = frozenset({
    "mamba", "falcon_mamba", "mamba2", "jamba", "zamba2", "falcon_h1", "nemotron_h", "granitemoehybrid",
    "lfm2", "lfm2_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text", "kimi_linear",
    "olmo_hybrid", "minimax", "bamba",
})
"""Model types holding a recurrent state (Mamba, Gated DeltaNet, KDA, short conv, linear attention)."""


def recurrent(model_type: str, config: Mapping[str, Any]) -> bool:
    if model_type in RECURRENT_TYPES:
        return True
    kinds = config.get("layer_types") or config.get("layers_block_type") or ()
    return any(isinstance(kind, str) and ("mamba" in kind or "linear" in kind or kind == "conv") for kind in kinds)


CheckpointFix = Iterator[tuple[str, Any, str]]
"""``(tensor name, tensor or None to drop it, reason)`` for each tensor a family's checkpoint edits."""


@dataclass(frozen=True)
class Family:
    fix: Callable[[dict[str, Any], Mapping[str, Any]], Fix]
    """``fix(shrunk, original)`` yields the fields to set."""
    dtype: str | None = None
    plugins: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    checkpoint: Callable[[Mapping[str, Any], Mapping[str, Any]], CheckpointFix] | None = None
    """``checkpoint(tensors, config)``: where transformers' model saves other tensors than the family's
    released checkpoints hold (and vLLM loads), the edits that make the seeded checkpoint hold those."""


def _nothing(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    yield from ()


def _mamba2_width(heads: str, head_dim: str, expand: str, hidden: str = "hidden_size") -> Callable[..., Fix]:
    """Mamba2 mixers check ``heads * head_dim == expand * hidden``: the hidden size follows the kept heads
    and the shrunk head size."""

    def fix(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
        width = config[heads] * config[head_dim]
        if width % config[expand] == 0:
            yield hidden, width // config[expand], f"{heads} * {head_dim} = {expand} * {hidden} (Mamba2)"

    return fix


def _lfm2(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # transformers 5's Lfm2Config lacks conv_dim and block_dim, which vLLM reads; both are the hidden size.
    yield "conv_dim", config["hidden_size"], "vLLM reads it; transformers 5 lacks it (= hidden size)"
    yield "block_dim", config["hidden_size"], "vLLM reads it; transformers 5 lacks it (= hidden size)"
    yield "block_auto_adjust_ff_dim", False, "keep the MLP width as shrunk"
    yield "block_ff_dim", config.get("intermediate_size", 128), "width"


def _falcon_h1(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    yield "mamba_d_ssm", config["mamba_n_heads"] * config["mamba_d_head"], "mamba_n_heads * mamba_d_head (Mamba2)"


def _zamba2(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # attention_hidden_size = 2 * hidden must hold num_attention_heads heads of at least 32 (CPU
    # attention); the Mamba2 head size then follows from expand * hidden = n_mamba_heads * mamba_headdim.
    heads = config["num_attention_heads"]
    hidden = max(128, heads * 16)
    yield "hidden_size", hidden, "2 * hidden holds the attention heads at head size 32"
    yield "attention_hidden_size", 2 * hidden, "2 * hidden (Zamba2's shared attention)"
    yield "attention_head_dim", 2 * hidden // heads, "attention_hidden_size / heads"
    yield "kv_channels", hidden // heads, "hidden / heads"
    width = config["mamba_expand"] * hidden
    if width % config["n_mamba_heads"] == 0:
        yield "mamba_headdim", width // config["n_mamba_heads"], "mamba_expand * hidden / n_mamba_heads (Mamba2)"


def _gemma3n(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vocab_size_per_layer_input must stay within the shrunk vocabulary.
    yield "vocab_size_per_layer_input", config["vocab_size"], "the shrunk vocabulary"


def _gdn_bf16() -> Family:
    return Family(_nothing, dtype="bfloat16", notes=("vLLM's CPU Gated DeltaNet kernel needs bfloat16",))


def _noaux_tc(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # transformers' DeepseekV3Config has no topk_method, and its model always carries the router's
    # e_score_correction_bias, which vLLM creates only under DeepSeek-V3's own "noaux_tc" routing.
    if config.get("topk_method") is None:
        yield "topk_method", "noaux_tc", "DeepSeek-V3's routing (vLLM loads the router's correction bias only under it)"


def _glm4_moe(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vLLM reads head_dim, which transformers' Glm4MoeConfig leaves unset (the GLM-4.5 checkpoints say 128).
    if config.get("head_dim") is None:
        yield "head_dim", 128, "vLLM reads it; transformers' defaults lack it (GLM-4.5's is 128)"
        yield "hidden_size", 256, "width (the head size now explicit)"


def _first_k_dense(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vLLM reads first_k_dense_replace; transformers' config says the same with mlp_layer_types.
    kinds = config.get("mlp_layer_types") or []
    dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    yield "first_k_dense_replace", dense, "vLLM reads it: the leading dense layers of mlp_layer_types"


def _minimax_m2(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vLLM reads rotary_dim, which transformers' MiniMaxM2Config lacks (MiniMax-M2's checkpoint: 64 of head_dim 128).
    if config.get("rotary_dim") is None and isinstance(config.get("head_dim"), int):
        yield "rotary_dim", config["head_dim"] // 2, "vLLM reads it; MiniMax-M2's checkpoint rotates half of each head"
    # vLLM reads scoring_func and use_routing_bias (else no correction bias); transformers' router always
    # scores by sigmoid and adds its e_score_correction_bias, as MiniMax-M2's checkpoint says.
    if config.get("scoring_func") is None:
        yield "scoring_func", "sigmoid", "vLLM reads it; transformers lacks it (MiniMax-M2's checkpoint: sigmoid)"
    if config.get("use_routing_bias") is None:
        yield "use_routing_bias", True, "vLLM reads it; transformers lacks it (MiniMax-M2's checkpoint: true)"


def _afmoe(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vLLM reads score_func, route_norm and the expert groups, which transformers' AfmoeConfig lacks; its router
    # scores by sigmoid, normalizes the top-k and has no groups, as Trinity-Mini's checkpoint says.
    if config.get("score_func") is None:
        yield "score_func", "sigmoid", "vLLM reads it; transformers lacks it (Trinity-Mini's checkpoint: sigmoid)"
    if config.get("route_norm") is None:
        yield "route_norm", True, "vLLM reads it; transformers lacks it (Trinity-Mini's checkpoint: true)"
    if config.get("n_group") is None:
        yield "n_group", 1, "vLLM reads it; transformers lacks it (Trinity-Mini's checkpoint: 1)"
        yield "topk_group", 1, "vLLM reads it; transformers lacks it (Trinity-Mini's checkpoint: 1)"


def _hy_v3(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    yield from _first_k_dense(config, original)
    # vLLM reads expert_hidden_dim, route_norm and qk_norm, which transformers' HYV3Config lacks (its model
    # always normalizes the top-k and has q/k norms); Hy3's checkpoint: expert_hidden_dim = moe_intermediate_size.
    if config.get("expert_hidden_dim") is None:
        yield "expert_hidden_dim", config["moe_intermediate_size"], (
            "vLLM reads it; transformers lacks it (Hy3's checkpoint: = moe_intermediate_size, 1536)")
    if config.get("route_norm") is None:
        yield "route_norm", True, "vLLM reads it; transformers lacks it (Hy3's checkpoint: true)"
    if config.get("qk_norm") is None:
        yield "qk_norm", True, "vLLM reads it (else no q/k norms); transformers lacks it (Hy3's checkpoint: true)"


def _longcat_flash(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vLLM reads these, which transformers' LongcatFlashConfig lacks: its model always scales the MLA LoRA
    # norms by sqrt(hidden / rank) and its zero experts are identities, as LongCat-Flash's checkpoint says.
    if config.get("mla_scale_q_lora") is None:
        yield "mla_scale_q_lora", True, "vLLM reads it; transformers lacks it (LongCat-Flash's checkpoint: true)"
    if config.get("mla_scale_kv_lora") is None:
        yield "mla_scale_kv_lora", True, "vLLM reads it; transformers lacks it (LongCat-Flash's checkpoint: true)"
    if config.get("zero_expert_type") is None:
        yield "zero_expert_type", "identity", (
            "vLLM reads it; transformers lacks it (LongCat-Flash's checkpoint: identity)")


def _mimo_v2_flash(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vLLM reads MiMo-V2-Flash's own checkpoint fields, which transformers' MiMoV2FlashConfig restates as
    # layer_types, mlp_layer_types and one set of attention sizes (its sliding layers have twice the KV
    # heads and an attention sink): each field below says again what the copy's own fields say.
    kinds = config["layer_types"]
    yield "hybrid_layer_pattern", [int(kind == "sliding_attention") for kind in kinds], (
        "vLLM reads it; transformers lacks it: layer_types (MiMo-V2-Flash's checkpoint: 1 = sliding)")
    yield "moe_layer_freq", [int(kind == "sparse") for kind in config["mlp_layer_types"]], (
        "vLLM reads it; transformers lacks it: mlp_layer_types (MiMo-V2-Flash's checkpoint: 1 = MoE)")
    yield "swa_num_attention_heads", config["num_attention_heads"], (
        "vLLM reads it; transformers lacks it: the attention heads (MiMo-V2-Flash's checkpoint: 64 and 64)")
    yield "swa_num_key_value_heads", 2 * config["num_key_value_heads"], (
        "vLLM reads it; transformers lacks it: twice the KV heads (MiMo-V2-Flash's checkpoint: 8 for 4)")
    yield "swa_head_dim", config["head_dim"], "vLLM reads it; transformers lacks it: head_dim (as the checkpoint)"
    yield "swa_v_head_dim", config["v_head_dim"], "vLLM reads it; transformers lacks it: v_head_dim (as the checkpoint)"
    yield "sliding_window_size", config["sliding_window"], (
        "vLLM reads it; transformers lacks it: sliding_window (as the checkpoint)")
    yield "add_swa_attention_sink_bias", True, (
        "vLLM reads it; transformers' sliding layers have sinks (MiMo-V2-Flash's checkpoint: true)")
    yield "add_full_attention_sink_bias", False, (
        "transformers' full layers have none (MiMo-V2-Flash's checkpoint: false)")
    yield "layernorm_epsilon", config["rms_norm_eps"], "vLLM reads it; transformers lacks it: rms_norm_eps"
    rope = config.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if "rope_theta" in full and "rope_theta" in sliding:
        yield "rope_theta", full["rope_theta"], "vLLM reads it: rope_parameters of the full layers"
        yield "swa_rope_theta", sliding["rope_theta"], "vLLM reads it: rope_parameters of the sliding layers"
    if "partial_rotary_factor" in full:
        yield "partial_rotary_factor", full["partial_rotary_factor"], "vLLM reads it: rope_parameters"


def _dbrx(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # vLLM's and transformers' DBRX attention read attn_config.rope_theta, where DBRX's checkpoint states it;
    # transformers 5's DbrxAttentionConfig lacks it (the value moved to rope_parameters).
    attention = config.get("attn_config") or {}
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if "rope_theta" not in attention and theta is not None:
        yield "attn_config", {**attention, "rope_theta": theta}, (
            "vLLM and transformers read attn_config.rope_theta (DBRX's checkpoint states it there): rope_parameters'")


def _longcat_flash_checkpoint(tensors: Mapping[str, Any], config: Mapping[str, Any]) -> CheckpointFix:
    # transformers' LongCat experts allocate gate/up weights for the zero (identity) experts too, and save
    # them as experts n_routed_experts and up; the released checkpoint has none, nor has vLLM's model.
    routed = int(config["n_routed_experts"])
    for name in tensors:
        head, found, tail = name.partition(".mlp.experts.")
        if found and tail.split(".", 1)[0].isdigit() and int(tail.split(".", 1)[0]) >= routed:
            yield name, None, "a zero expert's weight: identities hold none (released checkpoint, vLLM)"


def _axk1_checkpoint(tensors: Mapping[str, Any], config: Mapping[str, Any]) -> CheckpointFix:
    # vLLM's A.X-K1 layers all end in post_mlp_layernorm, and the released checkpoints store it on dense
    # layers too; transformers' model has it on MoE layers only. A norm weight of ones, as every norm here.
    import torch

    hidden = int(config["hidden_size"])
    dtype = next(iter(tensors.values())).dtype
    layers = {int(name.split(".")[2]) for name in tensors if name.startswith("model.layers.")}
    for layer in sorted(layers):
        name = f"model.layers.{layer}.post_mlp_layernorm.weight"
        if name not in tensors:
            yield name, torch.ones(hidden, dtype=dtype), "vLLM's layer has it; the released checkpoint's dense layers too"


def _hrm_text(config: dict[str, Any], original: Mapping[str, Any]) -> Fix:
    # HRM-Text's depth is num_layers_per_stack (the blocks of each of its two stacks); num_hidden_layers
    # counts attention invocations, num_layers_per_stack * H_cycles * (L_cycles + 1), each a KV cache of its
    # own in vLLM. The blocks of a stack are alike: one per stack keeps every step.
    steps = config["H_cycles"] * (config["L_cycles"] + 1)
    yield "num_layers_per_stack", 1, "depth: the blocks of a stack are alike (one keeps every recurrence step)"
    yield "num_hidden_layers", steps, "num_layers_per_stack * H_cycles * (L_cycles + 1): one per attention step"


FIXES: dict[str, Family] = {
    "lfm2": Family(_lfm2),
    "lfm2_moe": Family(_lfm2),
    "qwen3_next": _gdn_bf16(),
    "qwen3_5_text": _gdn_bf16(),
    "qwen3_5_moe_text": _gdn_bf16(),
    "qwen4_exp_text": _gdn_bf16(),
    "nemotron_h": Family(_nothing, plugins=(MAMBA2,)),
    "falcon_h1": Family(_falcon_h1, plugins=(MAMBA2,)),
    "mamba2": Family(_mamba2_width("num_heads", "head_dim", "expand"), plugins=(MAMBA2,)),
    "granitemoehybrid": Family(_mamba2_width("mamba_n_heads", "mamba_d_head", "mamba_expand"), plugins=(MAMBA2,)),
    "zamba2": Family(_zamba2, plugins=(MAMBA2,)),
    "gemma3n_text": Family(_gemma3n),
    "deepseek_v3": Family(_noaux_tc),
    "glm4_moe": Family(_glm4_moe),
    "glm4_moe_lite": Family(_first_k_dense),
    "hy_v3": Family(_hy_v3),
    "minimax_m2": Family(_minimax_m2),
    "afmoe": Family(_afmoe),
    "longcat_flash": Family(_longcat_flash, checkpoint=_longcat_flash_checkpoint, notes=(
        "the seeded checkpoint holds no zero-expert weights (transformers' model allocates them; vLLM's has none)",)),
    "axk1": Family(_nothing, checkpoint=_axk1_checkpoint, notes=(
        "the seeded checkpoint adds post_mlp_layernorm (ones) to dense layers, as the released one has",)),
    "mimo_v2_flash": Family(_mimo_v2_flash),
    "dbrx": Family(_dbrx),
    "hrm_text": Family(_hrm_text),
    "deepseek_v2": Family(_nothing, dtype="bfloat16", notes=(
        "vLLM's CPU MoE kernel refuses float32 weights for DeepSeek-V2 (measured): served in bfloat16",)),
}
"""Model type → its fix."""


_LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention",
                "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"]

DEFAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "lfm2": (
        {"num_hidden_layers": len(_LFM2_LAYERS), "layer_types": _LFM2_LAYERS,
         "full_attn_idxs": [i for i, kind in enumerate(_LFM2_LAYERS) if kind == "full_attention"]},
        ("transformers' Lfm2Config defaults make every layer attention (no short conv, which vLLM's LFM2 requires): "
         "the layer pattern of LFM2-1.2B (conv layers, attention at 2, 5, 8, 10, 12, 14) stands in"),
    ),
    "lfm2_moe": (
        {"num_hidden_layers": len(_LFM2_LAYERS), "layer_types": _LFM2_LAYERS},
        ("transformers' Lfm2MoeConfig defaults state no layer types: LFM2-1.2B's layer pattern stands in (not an "
         "LFM2-MoE checkpoint's own)"),
    ),
}
"""Model types whose transformers defaults describe no model vLLM serves: the fields that stand in when
the source is the model type or architecture alone (never over a given ``config.json``), and why."""
