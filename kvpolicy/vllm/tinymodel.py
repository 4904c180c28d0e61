"""A tiny random Llama and its tokenizer, generated locally, for running vLLM end to end on a CPU.

No hub access: the weights come from a seeded ``LlamaForCausalLM`` and the tokenizer is a byte-level
BPE trained on a few fixed sentences. The same arguments always write the same files (byte for
byte, apart from ``config.json``'s transformers version field).

vLLM's CPU attention backend supports head sizes of 32 and up, so ``head_dim`` defaults to 32
whatever ``hidden / num_attention_heads`` is. The weights are drawn with a larger standard deviation
than a real model's (``init_std``) so that attention changes the logits by a visible amount: with
the usual 0.02 every output distribution is close to uniform, and loading the wrong KV bytes would
change the logprobs only in the fourth decimal.
"""

from __future__ import annotations

import os
from pathlib import Path

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
    if num_kv_heads < 1 or num_attention_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must be positive and divide"
            f" num_attention_heads ({num_attention_heads})"
        )
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
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
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    # fork_rng: seeding must not disturb the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        # Re-draw every weight from one generator in a fixed order, so the result does not depend
        # on how a transformers version happens to initialise modules.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    parameter.fill_(1.0)
                else:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * init_std)
    model.eval()
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target
