"""The bytes a rank's KV cache holds for a chunk: the ground truth every check compares with.

Bytes depend only on the *content* they represent. A layer with physical factor ``T``
(:func:`~kvpolicy.sim.archetypes.physical_factor`) at ``tp`` splits into ``N = tp // T`` distinct
shards and rank ``r`` holds shard ``s = r // T``. ``T`` comes from the layer's own KV heads ``H``
(:attr:`~kvpolicy.sim.archetypes.Archetype.layer_kv_heads`, else the model-wide count), so where
``H < tp`` rank ``r`` holds head ``r * H // tp``, as vLLM's ``QKVParallelLinear`` places them, in a
model whose other layers may have other counts.

* An attention layer's block is its KV heads (dimension 1 of vLLM's logical ``(blocks, heads,
  tokens, content)`` tensor): shard ``s`` holds heads ``s * h .. s * h + h - 1`` of the model, ``h``
  being the rank's head count, and head ``g`` holds ``(seed, layer, tensor part, g, N * h, [dcp
  size, dcp rank,] chunk hash, size)``. A head is the same whichever TP size holds it: an MLA latent
  (one head) at any TP size, a 2-KV-head GQA layer at TP 2 and TP 4, and head 3 of an 8-head model
  on rank 1 at TP 2 and on rank 3 at TP 8, which is what vLLM's TP-sharded store layout relies on.
  The head count ``N * h`` keeps a scaled-down model (one head per rank at every TP size) from
  passing its heads off across TP sizes.
* Any other layer (Mamba / linear-attention state) holds ``(seed, layer, tensor part, N, s, ...)``
  as a whole: state splits into ``N = tp`` shards, so shard ``s`` at TP 2 is not shard ``s`` at TP 4
  and a cross-TP load of it is wrong.

The factor is per layer, not per group, so a uniform group's MLA layer is identical on every rank
even when the group's factor is smaller. Under decode-context parallelism rank ``r`` holds only the
tokens of dcp rank ``r % dcp_size``, so ranks of different dcp rank never hold the same content.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.core.kv_cache_utils import BlockHash

__all__ = ["block_bytes", "block_pieces", "content_id", "layer_tensors", "truth"]


def layer_tensors(value: Any) -> list[torch.Tensor]:
    """A layer's KV tensors: one, or the list a Mamba layer has (conv and SSM state)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def block_bytes(view: torch.Tensor, block_id: int) -> torch.Tensor:
    """The bytes of one block of a layer's KV view, as a uint8 view into the cache."""
    return view[block_id].view(torch.uint8)


def block_pieces(view: torch.Tensor, block_id: int, *, headed: bool) -> list[tuple[int | None, torch.Tensor]]:
    """(local head, bytes) of one block: per KV head for an attention layer (``headed``), else the
    whole block with head None."""
    block = block_bytes(view, block_id)
    if not headed:
        return [(None, block)]
    return [(head, block[head]) for head in range(block.shape[0])]


def content_id(
    layer: str,
    part: int,
    tp_rank: int,
    tp_size: int,
    true_factor: int,
    dcp_size: int = 1,
    head: int | None = None,
    total_heads: int = 0,
) -> str:
    """What rank ``tp_rank`` of a ``tp_size`` instance holds in tensor ``part`` of ``layer`` — in its
    local KV head ``head`` for an attention layer, else as a whole: the model's head (or the shard
    ``tp_rank // true_factor`` of ``tp_size // true_factor``) and, under decode-context parallelism,
    its tokens (dcp rank ``tp_rank % dcp_size``)."""
    shard = tp_rank // true_factor
    if head is None:
        what = f"{layer}#{part}/of{tp_size // true_factor}/{shard}"
    else:
        # With the model's head count: a scaled-down simulation (one head per rank whatever the TP
        # size) has other heads at every TP size, so its heads never pass for each other.
        what = f"{layer}#{part}/head{head}/of{total_heads}"
    return what if dcp_size == 1 else f"{what}/dcp{dcp_size}/{tp_rank % dcp_size}"


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
    *,
    local_head: int | None = None,
    local_heads: int = 1,
) -> torch.Tensor:
    """The bytes rank ``tp_rank`` holds in tensor ``part`` of ``layer`` for ``chunk_hash``: in its
    ``local_head`` of ``local_heads`` for an attention layer, else as a whole."""
    true_factor = layer_true_factors[layer]
    head = None if local_head is None else (tp_rank // true_factor) * local_heads + local_head
    total_heads = (tp_size // true_factor) * local_heads
    content = content_id(layer, part, tp_rank, tp_size, true_factor, dcp_size, head, total_heads)
    return truth(seed, content, chunk_hash, size)
