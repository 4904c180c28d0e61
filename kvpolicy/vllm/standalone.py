"""A Mooncake store worker built without vLLM's distributed runtime.

``MooncakeStoreWorker.__init__`` reads its ranks off the parallel groups
(``get_tensor_model_parallel_rank`` …), mounts a Mooncake segment from ``MOONCAKE_CONFIG_PATH``
and starts a ZMQ lookup server on rank 0: none of that exists in one process that plays several
ranks. :func:`init_standalone` sets the same attributes, in the same order, from values given to
it — the ranks, a store client, the model's name and KV-head count — and then calls the same
override points upstream's ``__init__`` calls, so a :class:`~kvpolicy.vllm.worker.KVPolicyStoreWorker`
plans exactly as on an engine. Everything after construction is the worker's own code.

``tests/vllm/test_standalone_worker.py`` compares this function with upstream's ``__init__`` (every
``self.x =`` and ``self.f()``), so a vLLM upgrade that adds one fails there instead of leaving a
simulated worker without it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import vllm.envs as envs
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import rdma_utils
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStoreConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    MooncakeStoreWorker,
    _replicate_config_supports_group_ids,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvpolicy.keys import model_basename

__all__ = ["Ranks", "init_standalone"]


@dataclass(frozen=True)
class Ranks:
    """One worker's place in the parallel groups: what upstream's ``__init__`` asks torch.distributed."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dcp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name} rank {rank} is outside a group of size {size}")

    @property
    def is_first(self) -> bool:
        """Global rank 0 of the instance (``parallel_config.rank == 0``): it reports plans and layouts."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.pcp_rank == 0 and self.dcp_rank == 0


def init_standalone(
    worker: MooncakeStoreWorker,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    *,
    ranks: Ranks,
    store: Any,
    model: str,
    total_num_kv_heads: int,
) -> None:
    """Set ``worker`` up as ``MooncakeStoreWorker.__init__`` does, with ``ranks`` and ``store`` given.

    Differences, each because the part cannot exist here: ``store`` is used as given (no segment is
    mounted from a config file); there is no lookup server (call ``worker.lookup`` directly, as the
    server does on rank 0); no custom memory pool (CUDA-only); no disk-offload budget (no store
    config file to enable it); ``num_layers`` counts the KV-cache config's layers (no model config).
    """
    from mooncake.store import ReplicateConfig

    worker.dp_rank = ranks.dp_rank
    worker.tp_rank = ranks.tp_rank
    worker.tp_size = ranks.tp_size
    worker.pp_size = ranks.pp_size
    worker.pp_rank = ranks.pp_rank
    worker.pcp_size = ranks.pcp_size
    worker.pcp_rank = ranks.pcp_rank
    worker.dcp_size = ranks.dcp_size
    worker.dcp_rank = ranks.dcp_rank

    transfer_config = vllm_config.kv_transfer_config
    if transfer_config is None or transfer_config.kv_role is None:
        raise ValueError("the vLLM config has no kv_transfer_config with a kv_role")
    worker.kv_role = transfer_config.kv_role
    extra_config = transfer_config.kv_connector_extra_config
    worker.can_put = worker.kv_role in ("kv_producer", "kv_both") or extra_config.get("save_decode_cache", False)
    worker.load_async = extra_config.get("load_async", True)
    worker._capacity_only = (
        worker.kv_role == "kv_consumer" and not extra_config.get("enable_lookup", True) and not worker.can_put
    )
    worker.cache_config = vllm_config.cache_config
    worker._is_hma_required = len(kv_cache_config.kv_cache_groups) > 1
    worker.block_size, worker.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    worker.num_layers = sum(len(group.layer_names) for group in kv_cache_config.kv_cache_groups)
    worker.num_kv_head = total_num_kv_heads

    worker._mem_pool = None
    worker.store = store
    worker.preferred_segment = rdma_utils.get_configured_preferred_segment(extra_config)
    worker.store_replicate_config = ReplicateConfig()
    worker.enable_group_semantics = str(extra_config.get("enable_group_semantics", "False")).strip().lower() == "true"
    worker._supports_group_ids = _replicate_config_supports_group_ids(ReplicateConfig, worker.store_replicate_config)
    if worker.preferred_segment is not None:
        worker.store_replicate_config.preferred_segment = worker.preferred_segment
    worker.disk_offload_buffer_budget_bytes = None

    worker.lookup_server = None
    events = vllm_config.kv_events_config
    worker.enable_kv_events = bool(events and events.enable_kv_cache_events)

    worker.kv_send_thread = None
    worker.kv_recv_threads = []
    worker.num_recv_threads = max(1, envs.VLLM_MOONCAKE_LOAD_RECV_THREADS)
    worker.recv_request_queue = queue.Queue()
    worker.finished_store_req = set()
    worker._kv_connector_stats_lock = threading.Lock()
    worker.kv_connector_stats = MooncakeStoreConnectorStats()
    worker._kv_cache_config = kv_cache_config
    worker.token_dbs = []
    if worker._capacity_only:
        return

    worker.coord = MooncakeStoreCoordinator.from_kv_cache_config(
        kv_cache_config, vllm_config, worker.block_size, worker.hash_block_size
    )
    worker._kv_cache_groups = worker.coord.kv_cache_groups
    worker.store_tp_size, store_namespace, store_layout_cls = worker._select_store_layout(extra_config)
    metadata = KeyMetadata(
        model_name=model_basename(model),
        tp_rank=worker.tp_rank,
        pcp_rank=worker.pcp_rank,
        dcp_rank=worker.dcp_rank,
        pp_rank=worker.pp_rank,
        cache_prefix=str(extra_config.get("cache_prefix", "")),
        store_namespace=store_namespace,
    )
    worker._group_tp_replication_factors = worker._compute_group_tp_replication_factors()
    worker.token_dbs = worker._build_token_databases(metadata, store_layout_cls)
    worker._init_lookup_key_prefixes()
