"""What one prompt costs the store under a plan: objects written by a cold instance, read by a warm one.

This restates how vLLM's Mooncake store connector (0.32 and 0.33) moves a prompt of ``N`` tokens,
so that counts measured on a real Mooncake master can be checked against the plan:

* a group of attention-like specs stores every **full chunk** of the prompt, ``N // chunk_tokens``
  chunks, each once per lookup namespace (the plan's write schedule gives each chunk one writer
  per replica set);
* a group of ``MambaSpec`` layers (Mamba, linear attention, short conv; ``mamba_cache_mode:
  align``) stores only its **boundary state** at the prompt's checkpoint, one object per lookup
  namespace;
* the checkpoint, and the longest hit a warm instance can get, is the last block boundary that
  leaves at least one token to compute: ``(N - 1) // chunk_tokens * chunk_tokens`` (vLLM's
  ``get_mamba_prefill_checkpoint_position`` without EAGLE);
* on a warm hit every TP rank of every (pcp, pp) rank reads its own namespace: per group, the hit
  chunks (one boundary state for a Mamba group) once per rank. Reads are not striped;
* under vLLM's TP-sharded store layout a chunk is one object per store shard: written once each,
  and read by every rank for each of its ``store_tp_size // tp_size`` shards.

Assumes an empty store, one request, and the groups' common block size at the plan's topology
(vLLM gives every group of a hybrid model the same one); refuses a layout whose groups differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvpolicy.language.models import Group, Layout
from kvpolicy.planning.plan import Plan

BOUNDARY_STATE_SPEC = "MambaSpec"
"""Spec class (or base) whose groups vLLM's store saves only at the prompt's checkpoint."""


class Stores(str, Enum):
    """What the store keeps of a group for one prompt."""

    CHUNKS = "chunks"
    """Every full chunk of the prompt."""
    BOUNDARY_STATE = "boundary-state"
    """Only the state at the prompt's checkpoint."""


@dataclass(frozen=True)
class GroupTraffic:
    """One group's objects for one prompt."""

    group: int
    name: str
    stores: Stores
    objects_written: int
    """Objects a cold instance writes (each once: the schedule has one writer per namespace)."""
    objects_read: int
    """Objects a warm instance reads on a full hit (every rank reads its own namespace)."""


@dataclass(frozen=True)
class PromptTraffic:
    """Store traffic of one prompt under one plan."""

    prompt_tokens: int
    chunk_tokens: int
    """Tokens per store chunk (the groups' common one)."""
    hit_tokens: int
    """Prompt tokens a warm instance loads instead of computing."""
    groups: tuple[GroupTraffic, ...]

    @property
    def objects_written(self) -> int:
        return sum(group.objects_written for group in self.groups)

    @property
    def objects_read(self) -> int:
        return sum(group.objects_read for group in self.groups)


def group_stores(group: Group) -> Stores:
    """What the store keeps of ``group`` for one prompt: every chunk, or only its boundary state."""
    specs = [group.spec] if group.spec is not None else [entry.spec for entry in group.uniform or ()]
    if any(BOUNDARY_STATE_SPEC in spec.classes for spec in specs):
        return Stores.BOUNDARY_STATE
    return Stores.CHUNKS


def prompt_traffic(plan: Plan, layout: Layout, prompt_tokens: int) -> PromptTraffic:
    """The objects one prompt of ``prompt_tokens`` tokens writes (cold) and reads (warm) under ``plan``.

    ``plan`` must be the plan of ``layout`` (same groups, in order). Raises ``ValueError`` for a
    negative prompt length or groups with different block sizes.
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must not be negative, got {prompt_tokens}")
    if len(plan.groups) != len(layout.groups):
        raise ValueError(f"the plan has {len(plan.groups)} groups but the layout {len(layout.groups)}")
    chunk_sizes = {group.chunk_tokens for group in plan.groups}
    if len(chunk_sizes) != 1:
        raise ValueError(
            f"the layout's groups have store chunks of different sizes ({', '.join(map(str, sorted(chunk_sizes)))} "
            "tokens); "
            "the traffic of such a model is not modelled"
        )
    (chunk_tokens,) = chunk_sizes
    full_chunks = prompt_tokens // chunk_tokens
    hit_chunks = max(prompt_tokens - 1, 0) // chunk_tokens
    topology = plan.topology
    readers = topology.tp_size * topology.pcp_size * topology.pp_size
    groups = []
    for group_plan, group in zip(plan.groups, layout.groups, strict=True):
        stores = group_stores(group)
        namespaces = len(group_plan.lookup_namespaces)
        objects_per_rank = len(group_plan.ranks[0].key_shards)
        if stores is Stores.BOUNDARY_STATE:
            written, read = (namespaces, readers * objects_per_rank) if hit_chunks else (0, 0)
        else:
            written, read = full_chunks * namespaces, hit_chunks * readers * objects_per_rank
        groups.append(GroupTraffic(group_plan.index, group_plan.name, stores, written, read))
    return PromptTraffic(prompt_tokens, chunk_tokens, hit_chunks * chunk_tokens, tuple(groups))
