"""The bytes a rank's KV cache holds for a chunk: the ground truth every check compares with.

A block holds bytes that depend only on the *content* it represents: ``(seed, layer, tensor part,
N, s, [dcp size, dcp rank,] chunk hash, size)``, where a layer with physical factor ``T``
(:func:`~kvpolicy.sim.archetypes.physical_factor`) at ``tp`` splits into ``N = tp // T`` distinct
shards and rank ``r`` holds shard ``s = r // T``. Two ranks — of one instance or of two instances
at different TP sizes — hold the same content exactly when ``N`` and ``s`` are equal: an MLA latent
(``N = 1``) is the same at any TP size; a 2-KV-head GQA layer (``N = 2``) is the same at TP 2 and
TP 4; Mamba / linear-attention state splits into ``N = tp`` shards, so shard ``s`` at TP 2 is not
shard ``s`` at TP 4 and a cross-TP load of it is wrong. The factor is per layer, not per group, so
a uniform group's MLA layer is identical on every rank even when the group's factor is smaller.
Under decode-context parallelism rank ``r`` holds only the tokens of dcp rank ``r % dcp_size``, so
ranks of different dcp rank never hold the same content.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.core.kv_cache_utils import BlockHash

__all__ = ["block_bytes", "content_id", "layer_tensors", "truth"]


def layer_tensors(value: Any) -> list[torch.Tensor]:
    """A layer's KV tensors: one, or the list a Mamba layer has (conv and SSM state)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def block_bytes(view: torch.Tensor, block_id: int) -> torch.Tensor:
    """The bytes of one block of a layer's KV view, as a uint8 view into the cache."""
    return view[block_id].view(torch.uint8)


def content_id(layer: str, part: int, tp_rank: int, tp_size: int, true_factor: int, dcp_size: int = 1) -> str:
    """What rank ``tp_rank`` of a ``tp_size`` instance holds in tensor ``part`` of ``layer``: its heads
    (shard ``tp_rank // true_factor`` of ``tp_size // true_factor``) and, under decode-context
    parallelism, its tokens (dcp rank ``tp_rank % dcp_size``)."""
    heads = f"{layer}#{part}/of{tp_size // true_factor}/{tp_rank // true_factor}"
    return heads if dcp_size == 1 else f"{heads}/dcp{dcp_size}/{tp_rank % dcp_size}"


def truth(seed: int, content: str, chunk_hash: BlockHash, size: int) -> torch.Tensor:
    """``size`` bytes of ``content`` for the chunk ``chunk_hash``."""
    digest = hashlib.blake2b(f"{seed}/{content}/{size}/".encode() + bytes(chunk_hash), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def rank_truth(
    seed: int,
    layer_true_factors: Mapping[str, int],
    tp_rank: int,
    tp_size: int,
    layer: str,
    part: int,
    chunk_hash: BlockHash,
    size: int,
    dcp_size: int = 1,
) -> torch.Tensor:
    """The bytes rank ``tp_rank`` holds in tensor ``part`` of ``layer`` for ``chunk_hash``."""
    content = content_id(layer, part, tp_rank, tp_size, layer_true_factors[layer], dcp_size)
    return truth(seed, content, chunk_hash, size)
