"""vLLM's store payload layouts, as a plan needs them: which one a deployment gets, and its namespace.

vLLM 0.32's Mooncake store writes a group's chunk *rank-locally* by default: one object per rank (or
per replica set) holding that rank's blocks, keyed by its TP rank. Opted in with ``store_tp_size`` or
``enable_store_tp_lcm`` (``kv_connector_extra_config``) and a packed LBHNC or LBNHC KV cache, it
writes them *TP-sharded*: the model's KV heads are cut into ``store_tp_size`` store shards, each chunk
is stored as one object per store shard, and a rank writes the ``store_tp_size // tp_size`` shards
whose heads it holds. The objects do not depend on the writer's TP size, so instances whose TP sizes
divide ``store_tp_size`` (a TP 4 prefill, a TP 2 decode) read each other's chunks.

:func:`select_store_layout` repeats upstream's choice (``MooncakeStoreWorker._select_store_layout``)
over kvpolicy's layout and topology, so the CLI plans what an engine would run; a drift test holds it
to upstream's. The worker takes upstream's own answer (:meth:`StoreSharding.of_format`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpolicy.language.keys import store_namespace
from kvpolicy.language.models import Layout, Topology

__all__ = ["SHARDED_FORMATS", "StoreSelection", "StoreSharding", "resolve_store_tp_size", "select_store_layout"]

SHARDED_FORMATS: Mapping[str, str] = {"LBHNC": "tp_shared_lbhnc", "LBNHC": "tp_shared_lbnhc"}
"""KV cache layout → the store format of vLLM's TP-sharded store layout for it (``store_format`` of
``LBHNCStoreLayout`` / ``LBNHCStoreLayout``); other layouts have none."""

MQA_FORMAT = "tp_shared_mqa"
"""The format vLLM names a single-KV-head model's store under ``store_tp_size``: rank-local objects,
one per chunk since every rank holds the one head, in a namespace without the TP size."""


@dataclass(frozen=True)
class StoreSharding:
    """vLLM's TP-sharded store layout: every chunk is ``store_tp_size`` objects, one per store shard
    of ``total_num_kv_heads // store_tp_size`` consecutive KV heads."""

    store_tp_size: int
    store_format: str
    """``tp_shared_lbhnc`` (heads outermost in a block: one segment per layer and shard) or
    ``tp_shared_lbnhc`` (tokens outermost: one segment per layer, token and shard)."""

    def __post_init__(self) -> None:
        if self.store_tp_size < 1:
            raise ValueError(f"store_tp_size must be positive, got {self.store_tp_size}")
        if self.store_format not in SHARDED_FORMATS.values():
            raise ValueError(
                f"unknown TP-sharded store format {self.store_format!r}; vLLM has {', '.join(SHARDED_FORMATS.values())}"
            )

    def shards_per_rank(self, tp_size: int) -> int:
        """Store shards each rank of a ``tp_size`` instance holds and writes."""
        return self.store_tp_size // tp_size

    def shards_of(self, tp_rank: int, tp_size: int) -> tuple[int, ...]:
        """The store shards rank ``tp_rank`` holds: its heads, in consecutive runs of store shards."""
        per_rank = self.shards_per_rank(tp_size)
        return tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))

    def namespace(self, pp_size: int) -> str:
        """``TPShardedStoreLayout.shared_namespace``: the store namespace keys carry."""
        return store_namespace(store_tp=self.store_tp_size, store_pp=pp_size, store_format=self.store_format)


@dataclass(frozen=True)
class StoreSelection:
    """The store layout a deployment runs: its key namespace and, when TP-sharded, the sharding."""

    store_namespace: str
    """``KeyMetadata.store_namespace``: empty for the historical rank-local keys."""
    sharding: StoreSharding | None
    reason: str
    """Why this layout, in one sentence (what ``kvpolicy plan`` reports)."""


def resolve_store_tp_size(extra_config: Mapping[str, Any]) -> int | None:
    """``resolve_store_tp_size`` of vLLM's store worker: the lcm of ``prefill_tp_sizes`` under
    ``enable_store_tp_lcm: true``, else ``store_tp_size``; None when that is not a positive int."""
    if extra_config.get("enable_store_tp_lcm") is True:
        sizes = extra_config.get("prefill_tp_sizes")
        if not isinstance(sizes, list) or not sizes or any(type(size) is not int or size <= 0 for size in sizes):
            return None
        return math.lcm(*sizes)
    size = extra_config.get("store_tp_size")
    return size if type(size) is int and size > 0 else None


def select_store_layout(
    layout: Layout, topology: Topology, extra_config: Mapping[str, Any], *, kv_cache_layout: str
) -> StoreSelection:
    """The store layout vLLM 0.32's worker picks for ``layout`` at ``topology`` with these
    ``kv_connector_extra_config`` options and KV cache layout (a ``KVCacheLayout`` name)."""
    lcm_enabled = extra_config.get("enable_store_tp_lcm") is True
    if not lcm_enabled and extra_config.get("store_tp_size") is None:
        return StoreSelection("", None, "rank-local (no store_tp_size or enable_store_tp_lcm)")
    store_tp = resolve_store_tp_size(extra_config)
    store_format = SHARDED_FORMATS.get(kv_cache_layout)
    tp, pp, heads = topology.tp_size, topology.pp_size, layout.total_num_kv_heads
    obstacle = _sharding_obstacle(layout, topology, extra_config, store_tp, store_format, kv_cache_layout)
    if obstacle is None:
        assert store_tp is not None and store_format is not None
        if heads % store_tp == 0:
            sharding = StoreSharding(store_tp, store_format)
            return StoreSelection(
                sharding.namespace(pp),
                sharding,
                f"TP-sharded ({store_format}): {store_tp} store shards of {heads // store_tp} KV heads, "
                f"{store_tp // tp} per rank",
            )
        if heads == 1:
            return StoreSelection(
                store_namespace(store_pp=pp, store_format=MQA_FORMAT),
                None,
                "shared MQA (one KV head: every rank holds it, so the namespace omits the TP size)",
            )
        obstacle = f"{heads} KV heads do not split into {store_tp} store shards"
    return StoreSelection(
        store_namespace(store_pp=pp, store_format=f"rank_local_tp{tp}_layout_{kv_cache_layout}"),
        None,
        f"rank-local in a namespace of its own TP size, because {obstacle}",
    )


def _sharding_obstacle(
    layout: Layout,
    topology: Topology,
    extra_config: Mapping[str, Any],
    store_tp: int | None,
    store_format: str | None,
    kv_cache_layout: str,
) -> str | None:
    """What keeps vLLM from its TP-sharded layout (``_supports_tp_sharded_store_layout`` and the
    size checks), or None."""
    tp = topology.tp_size
    if store_tp is None:
        return "the store TP size is not a positive integer (store_tp_size, or prefill_tp_sizes under enable_store_tp_lcm)"
    if store_tp < tp or store_tp % tp:
        return f"store TP size {store_tp} is not a multiple of tp_size {tp}"
    if store_format is None:
        return f"the KV cache layout {kv_cache_layout} is neither LBHNC nor LBNHC"
    if topology.pcp_size != 1 or topology.dcp_size != 1:
        return "vLLM shards the store only without prefill or decode context parallelism"
    if len(layout.groups) != 1:
        return f"the model has {len(layout.groups)} KV-cache groups, and vLLM shards the store of one only"
    (group,) = layout.groups
    if group.is_uniform or group.members[0].spec.type != "FullAttentionSpec":
        kind = group.members[0].spec.type if not group.is_uniform else "UniformTypeKVCacheSpecs"
        return f"its group is {kind}, and vLLM shards only FullAttentionSpec"
    if str(extra_config.get("enable_cross_layers_blocks", "False")).lower() == "true":
        return "enable_cross_layers_blocks is set"
    return None
