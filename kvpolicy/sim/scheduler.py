"""The scheduler's side of a step, as vLLM computes it: block hashes, block tables, Mamba boundary
states, and the connector metadata a save or a load hands to every TP rank."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    BoundaryPut,
    LoadSpec,
    MooncakeLookupResult,
    MooncakeStoreConnectorMetadata,
    ReqMeta,
    RequestTracker,
)
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens
from vllm.v1.kv_cache_interface import MambaSpec, get_mamba_prefill_checkpoint_position

from kvpolicy.sim.model import SimulatedModel

__all__ = [
    "BlockTables",
    "Prompt",
    "block_hashes",
    "block_tables",
    "chunk_hash",
    "load_metadata",
    "mamba_boundaries",
    "save_metadata",
    "seed_of",
]

BlockTables = tuple[list[int], ...]
"""One block table per prefix-cacheable group, shared by every rank of an instance."""


def seed_of(*parts: object) -> int:
    """A stable 63-bit seed from ``parts`` (the same on every run and machine)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def block_hashes(token_ids: Sequence[int], hash_block_size: int) -> list[BlockHash]:
    """``Request.block_hashes`` as vLLM's request block hasher computes them (sha256, no extra keys)."""
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        kv_cache_utils.init_none_hash(sha256)
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - hash_block_size + 1, hash_block_size):
        parent = hash_block_tokens(sha256, parent, token_ids[start : start + hash_block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Prompt:
    """A request's tokens and their block hashes."""

    token_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]

    @classmethod
    def random(cls, num_tokens: int, hash_block_size: int, *, seed: int) -> Prompt:
        """``num_tokens`` pseudo-random token ids, the same for the same seed."""
        generator = torch.Generator().manual_seed(seed_of("tokens", seed))
        token_ids = tuple(torch.randint(0, 32_000, (num_tokens,), generator=generator).tolist())
        return cls(token_ids, tuple(block_hashes(token_ids, hash_block_size)))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def chunk_hash(hashes: Sequence[BlockHash], chunk: int, block_size: int, hash_block_size: int) -> BlockHash | None:
    """The hash keying chunk ``chunk`` of a group with ``block_size`` (its last sub-hash), or None
    for a partial chunk."""
    index = (chunk + 1) * block_size // hash_block_size - 1
    return hashes[index] if index < len(hashes) else None


def mamba_boundaries(num_tokens: int, hash_block_size: int, block_size: int) -> list[int]:
    """Token boundaries whose Mamba state the engine core hands to the connector in align mode for a
    one-step prefill: the prefill checkpoint (where a later hit resumes, below the prompt end) and
    the prompt end when it is block-aligned. Each state lives in the block ending at it."""
    boundaries = [get_mamba_prefill_checkpoint_position(num_tokens, hash_block_size, False)]
    if num_tokens % block_size == 0:
        boundaries.append(num_tokens)
    return sorted({boundary for boundary in boundaries if boundary > 0})


def block_tables(model: SimulatedModel, num_tokens: int, *, seed: int, salt: str, mamba_nulls: bool) -> BlockTables:
    """The scheduler's block table per group for a ``num_tokens`` request.

    Block ids come from one pool for all groups (vLLM's hybrid allocator), shuffled per ``salt`` so
    two instances place a chunk in different blocks. With ``mamba_nulls`` a Mamba group holds real
    blocks only where a state is kept (:func:`mamba_boundaries`), null elsewhere, as align mode
    allocates a prefill; without, every chunk gets a block (a load's destination).
    """
    groups = model.kv_cache_config.prefix_cacheable_groups
    chunks = math.ceil(num_tokens / model.block_size)
    free = list(range(1, model.kv_cache_config.num_blocks))  # block 0 is the null block
    if len(groups) * chunks > len(free):
        raise ValueError(f"{num_tokens} tokens need {len(groups) * chunks} blocks; the model has {len(free)}")
    generator = torch.Generator().manual_seed(seed_of(seed, salt))
    free = [free[i] for i in torch.randperm(len(free), generator=generator).tolist()]
    tables: list[list[int]] = []
    for index, group in enumerate(groups):
        table = free[index * chunks : (index + 1) * chunks]
        if mamba_nulls and isinstance(group.kv_cache_spec, MambaSpec):
            size = model.group_block_size(index)
            kept = {math.ceil(boundary / size) - 1 for boundary in mamba_boundaries(num_tokens, model.hash_block_size, size)}
            table = [block if chunk in kept else NULL_BLOCK_ID for chunk, block in enumerate(table)]
        tables.append(table)
    return tuple(tables)


def save_metadata(
    model: SimulatedModel,
    tables: BlockTables,
    hashes: Sequence[BlockHash],
    num_tokens: int,
    *,
    req_id: str,
    store_job_id: int,
    coord: MooncakeStoreCoordinator,
) -> MooncakeStoreConnectorMetadata:
    """The connector metadata the scheduler sends for a new request whose whole prompt was prefilled
    in one step (``MooncakeStoreScheduler.build_connector_meta``): a ``RequestTracker`` and
    ``ReqMeta.from_request_tracker``; Mamba states arrive as boundary puts
    (``_handle_boundary_state_offloads``); ``_reference_save_blocks`` numbers the store job. Block
    pinning and the partial-tail puts are left out (no block pool; partial hits are off)."""
    tracker = RequestTracker(
        req_id=req_id,
        token_len=num_tokens,
        allocated_block_ids=tuple(list(table) for table in tables),
        num_saved_tokens=0,
        token_ids=None,
        prefill_end_tokens=num_tokens,
    )
    meta = ReqMeta.from_request_tracker(
        tracker,
        model.block_size,
        load_spec=None,
        skip_save=False,
        block_hashes=list(hashes),
        num_prompt_tokens=num_tokens,
        save_partial_tail=coord.enable_partial_hash_hits,
    )
    assert meta is not None and meta.can_save
    boundary_puts = [
        BoundaryPut(index, tables[index][math.ceil(boundary / model.group_block_size(index)) - 1], boundary)
        for index in range(len(model.kv_cache_config.prefix_cacheable_groups))
        if index in coord.mamba_group_ids
        for boundary in mamba_boundaries(num_tokens, model.hash_block_size, model.group_block_size(index))
    ]
    meta.boundary_puts = boundary_puts or None
    meta.store_job_id = store_job_id
    metadata = MooncakeStoreConnectorMetadata(unfinished_request_ids={req_id}, preempted_req_ids=set())
    metadata.add_request(meta)
    return metadata


def load_metadata(
    model: SimulatedModel,
    tables: BlockTables,
    hashes: Sequence[BlockHash],
    num_tokens: int,
    *,
    req_id: str,
    lookup: MooncakeLookupResult,
) -> MooncakeStoreConnectorMetadata:
    """The metadata for an async load (``load_async``): the request waits for its remote KV, so it is
    issued from ``build_connector_meta``'s pending-load branch with a tracker over the hit."""
    load_spec = LoadSpec(
        vllm_cached_tokens=0,
        kvpool_cached_tokens=lookup.hit_length,
        can_load=True,
        tail_key_boundaries=lookup.tail_key_boundaries,
    )
    tracker = RequestTracker(
        req_id=req_id,
        token_len=load_spec.kvpool_cached_tokens,
        allocated_block_ids=tuple(list(table) for table in tables),
        num_saved_tokens=0,
    )
    meta = ReqMeta.from_request_tracker(
        tracker,
        model.block_size,
        load_spec=load_spec,
        skip_save=None,
        block_hashes=list(hashes),
        num_prompt_tokens=num_tokens,
    )
    assert meta is not None and meta.load_spec is not None
    metadata = MooncakeStoreConnectorMetadata(unfinished_request_ids={req_id}, preempted_req_ids=set())
    metadata.add_request(meta)
    return metadata
