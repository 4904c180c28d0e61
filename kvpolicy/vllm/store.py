"""The one place a :class:`~kvpolicy.planning.plan.Plan` becomes vLLM Mooncake-store objects.

:class:`kvpolicy.vllm.worker.KVPolicyStoreWorker` builds its token databases, put schedules and
lookup prefixes here, on an engine and in the simulation alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    LBHNCStoreLayout,
    LBNHCStoreLayout,
    RankLocalStoreLayout,
    RankNamespace,
    StoreLayout,
    StoreShardId,
    TPShardedStoreLayout,
)
from vllm.v1.core.kv_cache_utils import BlockHash

from kvpolicy.language.keys import chunk_key
from kvpolicy.planning.plan import Plan
from kvpolicy.runtime.binding import RankBinding

__all__ = [
    "PlanLBHNCStoreLayout",
    "PlanLBNHCStoreLayout",
    "PlanShardedStoreLayout",
    "PlanStoreLayout",
    "build_token_databases",
    "chunk_bytes_per_rank",
    "rebuild_token_databases",
]


class PlanStoreLayout(RankLocalStoreLayout):
    """vLLM's rank-local payload layout, with the key namespace and lookup set taken from a plan.

    Payload addressing (``register_kv_caches``, ``prepare_values``) is upstream's unchanged; only
    the strings differ, so a policy can change keys (e.g. add a fingerprint) without touching bytes.
    """

    def __init__(
        self,
        plan: Plan,
        group: int,
        *,
        tp_rank: int,
        pcp_rank: int,
        pp_rank: int,
        metadata: KeyMetadata,
        block_size: int,
        hash_block_size: int,
    ) -> None:
        super().__init__(metadata, block_size, hash_block_size)
        self.plan = plan
        self.group = group
        self._key_prefix = plan.key_prefix(group, tp_rank, pcp_rank, pp_rank)
        self._lookup_prefixes = plan.groups[group].lookup_namespaces

    @property
    def key_prefix(self) -> str:
        """The namespace this rank reads and writes for its group."""
        return self._key_prefix

    def key_for(self, shard_id: StoreShardId, chunk_hash: BlockHash) -> str:
        if shard_id != 0:
            raise ValueError(f"a rank-local layout has one shard id, 0; got {shard_id}")
        return chunk_key(self._key_prefix, chunk_hash.hex())

    def lookup_key_prefixes(self, rank_namespaces: Sequence[RankNamespace] = ()) -> tuple[str, ...]:
        """The plan's lookup namespaces; ``rank_namespaces`` is ignored because the plan already
        enumerated every (shard, pcp, dcp, pp) namespace a hit needs."""
        return self._lookup_prefixes


class PlanShardedStoreLayout(TPShardedStoreLayout):
    """vLLM's TP-sharded payload layout (one object per store shard of heads), with the key of every
    store shard and the lookup set taken from a plan made with that :class:`~kvpolicy.planning.store_layout.StoreSharding`.

    Payload addressing is upstream's (:class:`PlanLBHNCStoreLayout`, :class:`PlanLBNHCStoreLayout`
    mix this into ``LBHNCStoreLayout`` / ``LBNHCStoreLayout``); the store shards a rank owns must be
    the plan's, so the plan's keys name the bytes the rank actually writes.
    """

    def __init__(
        self,
        plan: Plan,
        group: int,
        *,
        tp_rank: int,
        pcp_rank: int,
        pp_rank: int,
        metadata: KeyMetadata,
        block_size: int,
        hash_block_size: int,
        num_kv_heads: int,
    ) -> None:
        sharding = plan.store_sharding
        if sharding is None:
            raise ValueError("the plan has no TP-sharded store layout (plan it with store_sharding)")
        if sharding.store_format != self.store_format:
            raise ValueError(f"the plan stores {sharding.store_format}, this layout writes {self.store_format}")
        super().__init__(
            metadata,
            block_size,
            hash_block_size,
            local_tp_size=plan.topology.tp_size,
            store_tp_size=sharding.store_tp_size,
            tp_rank=tp_rank,
            num_kv_heads=num_kv_heads,
        )
        assigned = plan.groups[group].ranks[tp_rank].store_shards
        if tuple(self.store_shard_ids) != assigned:
            raise ValueError(
                f"tp_rank {tp_rank} holds store shards {list(self.store_shard_ids)} but the plan assigns {list(assigned)}"
            )
        self.plan = plan
        self.group = group
        self._plan_prefixes = dict(zip(assigned, plan.key_prefixes(group, tp_rank, pcp_rank, pp_rank), strict=True))
        self._lookup_prefixes = plan.groups[group].lookup_namespaces

    def key_for(self, shard_id: StoreShardId, chunk_hash: BlockHash) -> str:
        prefix = self._plan_prefixes.get(shard_id)
        if prefix is None:
            raise ValueError(f"store shard {shard_id} is not one of this rank's {sorted(self._plan_prefixes)}")
        return chunk_key(prefix, chunk_hash.hex())

    def lookup_key_prefixes(self, rank_namespaces: Sequence[RankNamespace] = ()) -> tuple[str, ...]:
        """The plan's lookup namespaces: every store shard's, at every pp rank."""
        return self._lookup_prefixes


class PlanLBHNCStoreLayout(PlanShardedStoreLayout, LBHNCStoreLayout):
    """:class:`PlanShardedStoreLayout` over vLLM's head-major (``tp_shared_lbhnc``) payload."""


class PlanLBNHCStoreLayout(PlanShardedStoreLayout, LBNHCStoreLayout):
    """:class:`PlanShardedStoreLayout` over vLLM's token-major (``tp_shared_lbnhc``) payload."""


_SHARDED_LAYOUTS: dict[str, type[PlanShardedStoreLayout]] = {
    layout.store_format: layout for layout in (PlanLBHNCStoreLayout, PlanLBNHCStoreLayout)
}


def _check_metadata(plan: Plan, metadata: KeyMetadata, *, tp_rank: int, pcp_rank: int, pp_rank: int) -> None:
    """Refuse metadata that disagrees with the plan: vLLM would put it in group ids and events
    while the keys say something else."""
    context = plan.key_context
    expected = {
        "model_name": context.model,
        "cache_prefix": context.cache_prefix,
        "store_namespace": context.store_namespace,
        "pcp_rank": pcp_rank,
        "dcp_rank": plan.topology.dcp_rank(tp_rank, pcp_rank),
        "pp_rank": pp_rank,
    }
    wrong = {name: value for name, value in expected.items() if getattr(metadata, name) != value}
    if wrong:
        found = ", ".join(f"{name}={getattr(metadata, name)!r} (plan: {value!r})" for name, value in wrong.items())
        raise ValueError(f"KeyMetadata disagrees with the plan for tp_rank {tp_rank}: {found}")


def build_token_databases(
    plan: Plan,
    *,
    tp_rank: int,
    pcp_rank: int,
    pp_rank: int,
    block_sizes: Sequence[int],
    hash_block_sizes: Sequence[int],
    metadata: KeyMetadata,
    num_kv_heads: int | None = None,
) -> list[ChunkedTokenDatabase]:
    """One token database per plan group for ``tp_rank``, keyed by the plan's namespaces.

    Like upstream, each group's metadata gets ``group_id`` = the group index and ``tp_rank`` = the
    plan's shard for this rank (``tp_rank // head factor``; upstream's ``tp_rank // factor`` where
    there is no DCP). A plan with a TP-sharded store layout needs ``num_kv_heads``, the model's
    total KV heads (upstream's ``num_kv_head``), to cut them into store shards.
    """
    if not len(plan.groups) == len(block_sizes) == len(hash_block_sizes):
        raise ValueError(
            f"the plan has {len(plan.groups)} groups but {len(block_sizes)} block sizes "
            f"and {len(hash_block_sizes)} hash block sizes were given"
        )
    if not 0 <= tp_rank < plan.topology.tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside the plan's tp_size {plan.topology.tp_size}")
    _check_metadata(plan, metadata, tp_rank=tp_rank, pcp_rank=pcp_rank, pp_rank=pp_rank)
    databases: list[ChunkedTokenDatabase] = []
    for group, (block_size, hash_block_size) in enumerate(zip(block_sizes, hash_block_sizes, strict=True)):
        group_metadata = dataclasses.replace(
            metadata, group_id=group, tp_rank=plan.groups[group].ranks[tp_rank].shard
        )
        where: dict[str, Any] = {
            "tp_rank": tp_rank, "pcp_rank": pcp_rank, "pp_rank": pp_rank, "metadata": group_metadata,
            "block_size": block_size, "hash_block_size": hash_block_size,
        }
        layout: StoreLayout
        if plan.store_sharding is None:
            layout = PlanStoreLayout(plan, group, **where)
        else:
            if num_kv_heads is None:
                raise ValueError("a TP-sharded store layout needs num_kv_heads")
            layout = _SHARDED_LAYOUTS[plan.store_sharding.store_format](plan, group, num_kv_heads=num_kv_heads, **where)
        databases.append(
            ChunkedTokenDatabase(group_metadata, block_size, hash_block_size=hash_block_size, store_layout=layout)
        )
    return databases


def rebuild_token_databases(
    binding: RankBinding, previous: Sequence[ChunkedTokenDatabase]
) -> list[ChunkedTokenDatabase] | None:
    """The token databases of ``binding``'s plan, with the block sizes and key metadata of ``previous``
    (the worker's, built in ``__init__``); None where there are none yet (nothing registered)."""
    if not previous:
        return None
    if binding.plan.store_sharding is not None:
        # Unreachable: under a TP-sharded store every group has factor 1, so no audit demotes.
        raise RuntimeError("kvpolicy: a TP-sharded store layout is never re-planned")
    place = binding.place
    return build_token_databases(
        binding.plan, tp_rank=place.tp_rank, pcp_rank=place.pcp_rank, pp_rank=place.pp_rank,
        block_sizes=[database.block_size for database in previous],
        hash_block_sizes=[database.hash_block_size for database in previous],
        metadata=dataclasses.replace(previous[0].metadata, tp_rank=place.tp_rank, group_id=0),
    )


def chunk_bytes_per_rank(database: ChunkedTokenDatabase) -> int:
    """Bytes of one chunk of a group that one rank holds and writes: one block of every region, as
    one object, or under a TP-sharded store layout as one object per store shard of the rank."""
    layout = database.store_layout
    shards = list(layout.local_shard_ids)
    chunks = [(0, database.block_size)] * len(shards)
    _, sizes, _ = layout.prepare_values(chunks, [1], shards)
    return sum(sum(object_sizes) for object_sizes in sizes)
