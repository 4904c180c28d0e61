"""vLLM's Mooncake store worker with factors, keys, put schedules and lookups taken from a plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    TPShardedStoreLayout,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvpolicy.engine import plan as make_plan
from kvpolicy.keys import KeyContext, model_basename
from kvpolicy.models import Policy, Topology
from kvpolicy.plan import Plan
from kvpolicy.report import format_plan_table, plan_to_json
from kvpolicy.vllm import store
from kvpolicy.vllm.layout import layout_from_kv_cache_config

# Under "vllm." so records reach vLLM's own handler (it configures only the "vllm" logger tree).
logger = init_logger(f"vllm.{__name__}")

PLAN_JSON_KEY = "kvpolicy_plan_json"
"""``kv_connector_extra_config`` key naming a file rank 0 writes the plan to, as JSON."""


class KVPolicyStoreWorker(MooncakeStoreWorker):
    """``MooncakeStoreWorker`` whose three override points answer from a kvpolicy plan.

    The plan is made once, from this worker's own ``KVCacheConfig`` and parallel sizes, the first
    time upstream asks for replication factors; token databases and lookup prefixes follow from it,
    and the send thread's put schedule is replaced after ``register_kv_caches``.
    """

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, policy: Policy) -> None:
        # Upstream's __init__ calls the override points, so everything they read is set first.
        assert vllm_config.kv_transfer_config is not None
        extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._init_policy_state(
            policy, model=vllm_config.model_config.model, cache_prefix=str(extra_config.get("cache_prefix", ""))
        )
        super().__init__(vllm_config, kv_cache_config)
        if vllm_config.parallel_config.rank == 0 and self._plan is not None:
            self._report_plan(extra_config.get(PLAN_JSON_KEY))

    def _init_policy_state(self, policy: Policy, *, model: str, cache_prefix: str) -> None:
        """What the override points read besides upstream's own attributes (model and cache prefix
        exactly as upstream reads them for ``KeyMetadata``)."""
        self._policy = policy
        self._model = model
        self._cache_prefix = cache_prefix
        self._store_namespace = ""
        self._plan: Plan | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan this worker runs; None only for a capacity-only instance, which transfers no KV."""
        return self._plan

    def _require_plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("no plan yet: upstream asked for token databases before replication factors")
        return self._plan

    # --- planning --------------------------------------------------------------------------------

    def _select_store_layout(
        self, extra_config: dict[str, Any]
    ) -> tuple[int | None, str, type[TPShardedStoreLayout] | None]:
        # Upstream computes the store namespace here and passes it on only inside KeyMetadata,
        # after the factors are needed; keep it so the plan's keys carry it.
        store_tp_size, store_namespace, layout_cls = super()._select_store_layout(extra_config)
        if layout_cls is not None:
            raise ValueError(
                "kvpolicy: store_tp_size / enable_store_tp_lcm selected vLLM's TP-sharded store layout "
                f"({layout_cls.__name__}), whose keys are per store shard rather than per replica set; "
                "kvpolicy plans cannot describe it. Remove those options or use MooncakeStoreConnector."
            )
        self._store_namespace = store_namespace
        return store_tp_size, store_namespace, layout_cls

    def _make_plan(self) -> Plan:
        """policy × this worker's layout × its topology, with upstream's key context."""
        layout = layout_from_kv_cache_config(
            self._kv_cache_config,
            model=model_basename(self._model),
            # Upstream sets num_kv_head to model_config.get_total_num_kv_heads().
            total_num_kv_heads=self.num_kv_head,
        )
        topology = Topology(
            tp_size=self.tp_size, pp_size=self.pp_size, pcp_size=self.pcp_size, dcp_size=self.dcp_size
        )
        context = KeyContext.for_model(self._model, self._cache_prefix, self._store_namespace)
        result = make_plan(self._policy, layout, topology, key_context=context)
        if len(result.groups) != len(self._kv_cache_groups):
            raise RuntimeError(
                f"kvpolicy planned {len(result.groups)} groups but the store coordinator has "
                f"{len(self._kv_cache_groups)}; the layout adapter and vLLM disagree on the group selection"
            )
        return result

    # --- the three override points ---------------------------------------------------------------

    def _compute_group_tp_replication_factors(self) -> tuple[int, ...]:
        self._plan = self._make_plan()
        return self._plan.factors

    def _build_token_databases(
        self,
        metadata: KeyMetadata,
        layout_cls: type[TPShardedStoreLayout] | None,
    ) -> list[ChunkedTokenDatabase]:
        assert layout_cls is None  # refused in _select_store_layout
        groups = self._kv_cache_groups
        return store.build_token_databases(
            self._require_plan(),
            tp_rank=self.tp_rank,
            pcp_rank=self.pcp_rank,
            pp_rank=self.pp_rank,
            block_sizes=[group.kv_cache_spec.block_size for group in groups],
            # Upstream's rule: groups outside prefix caching hash at their own block size.
            hash_block_sizes=[
                self.hash_block_size if group.kv_cache_spec.prefix_cacheable else group.kv_cache_spec.block_size
                for group in groups
            ],
            metadata=metadata,
        )

    def _init_lookup_key_prefixes(self) -> None:
        self._lookup_key_prefixes = store.lookup_key_prefixes(self._require_plan())

    # --- the put schedule ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self.kv_send_thread is None:
            return
        # Upstream builds and starts the send thread inline in register_kv_caches, with put steps =
        # factors and every prefix-cacheable group participating: right for "striped" only. There is
        # no hook, so the plan's schedule replaces both here. Safe although the thread is running:
        # saves reach it only through wait_for_save, which cannot run before this method returns.
        plan = self._require_plan()
        self.kv_send_thread.group_put_steps = store.group_put_steps(plan)
        self.kv_send_thread.group_participates = store.group_participates(
            plan, self.tp_rank, [group.kv_cache_spec.prefix_cacheable for group in self._kv_cache_groups]
        )

    # --- reporting -------------------------------------------------------------------------------

    def _report_plan(self, json_path: object) -> None:
        plan = self._require_plan()
        logger.info("kvpolicy plan (policy %s):\n%s", self._policy.name, format_plan_table(plan))
        if json_path:
            path = Path(str(json_path))
            path.write_text(json.dumps(plan_to_json(plan), indent=2) + "\n", encoding="utf-8")
            logger.info("kvpolicy plan written to %s", path)
