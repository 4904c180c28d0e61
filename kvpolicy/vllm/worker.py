"""vLLM's Mooncake store worker with factors, keys, put schedules and lookups taken from a plan,
and the online replication audit (see :mod:`kvpolicy.vllm.audit`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Self

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    MooncakeLookupResult,
    MooncakeStoreConnectorMetadata,
    TPShardedStoreLayout,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvpolicy.device.blocks import tensor_distance
from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.evidence.audit import AuditState, ReplicationAuditError
from kvpolicy.language.keys import KeyContext, model_basename
from kvpolicy.language.models import Policy, Topology
from kvpolicy.planning.plan import Plan
from kvpolicy.planning.store_layout import StoreSharding
from kvpolicy.runtime.binding import RankBinding, RankPlace
from kvpolicy.runtime.discovery import RankDiscovery
from kvpolicy.runtime.policy import RankPolicy, capture_layout, plan_and_replan
from kvpolicy.runtime.ports import Gather, KVStore, PeerExchange
from kvpolicy.vllm import audit, internals, store
from kvpolicy.vllm.config import StoreTarget, WorkerSetup, dynamo_deployment, parse_settings, read_keyring
from kvpolicy.vllm.layout import layout_from_kv_cache_config
from kvpolicy.vllm.lookup import LookupProbes
from kvpolicy.vllm.lookup import lookup as probing_lookup
from kvpolicy.vllm.metrics import KVPolicyConnectorStats
from kvpolicy.vllm.stores import wrap_transfer_stores

# Under "vllm." so records reach vLLM's own handler (it configures only the "vllm" logger tree).
logger = init_logger(f"vllm.{__name__}")


class KVPolicyStoreWorker(MooncakeStoreWorker):
    """``MooncakeStoreWorker`` whose override points answer from a kvpolicy plan.

    The plan is made once, from this worker's own ``KVCacheConfig`` and parallel sizes, the first time
    upstream asks for replication factors; token databases and lookup prefixes follow from it, and the
    send thread's put schedule is replaced after ``register_kv_caches``. The replication audit runs in
    :meth:`wait_for_save`, before a step's save reaches the send thread.

    What is decided at run time — the plan, its binding and re-plans, each audited step's conclusion,
    markers, the lookup gate, read failures, the tally, the status documents — is this rank's
    :class:`~kvpolicy.runtime.policy.RankPolicy` (no vLLM, no torch); this class keeps upstream's
    override points, reads what only vLLM's objects hold (layout, blocks, KV tensors), writes bindings
    into upstream's attributes (:func:`kvpolicy.vllm.internals.bind_plan`) and delegates the rest.
    """

    _target = StoreTarget()
    """Set by :meth:`_select_store_layout`."""
    _runtime: RankPolicy | None = None
    """Set by the first override point; None on a capacity-only instance."""
    _discovery: RankDiscovery | None = None
    """Under ``kvpolicy_discover``, the observed steps."""
    _kv_reader: audit.KVCacheReader | None = None
    """The registered KV tensors' block reader, built on first use; None before registration."""
    _last_lookup = LookupProbes()
    """What the last :meth:`lookup` probed."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, policy: Policy, settings: KVPolicySettings
    ) -> None:
        """``settings`` as the connector parsed them."""
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        # Upstream's __init__ calls the override points, so everything they read is set first.
        self._setup = WorkerSetup(
            policy, settings, model=vllm_config.model_config.model, model_config=vllm_config.model_config,
            cache_prefix=str(transfer.kv_connector_extra_config.get("cache_prefix", "")), gather=audit.gather_over_tp,
            keyring=read_keyring(settings, policy),
        )
        super().__init__(vllm_config, kv_cache_config)
        self._report_plan()

    @classmethod
    def standalone(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, policy: Policy, place: RankPlace,
        store: KVStore, model: str, total_num_kv_heads: int, gather: Gather, exchange: PeerExchange | None = None,
        settings: KVPolicySettings | None = None,
    ) -> Self:
        """This worker without vLLM's distributed runtime (:func:`kvpolicy.vllm.internals.init_standalone`):
        the place, the store client, the TP collective (``gather``) and the striped loads' ``exchange``
        are given instead of read off torch.distributed; ``settings`` default to those in ``vllm_config``.
        Runs exactly as on an engine; :mod:`kvpolicy.sim` runs its ranks this way."""
        assert vllm_config.kv_transfer_config is not None
        extra_config, worker = vllm_config.kv_transfer_config.kv_connector_extra_config, cls.__new__(cls)
        settings = settings if settings is not None else parse_settings(extra_config)
        worker._setup = WorkerSetup(
            policy, settings, model=model,
            cache_prefix=str(extra_config.get("cache_prefix", "")), gather=gather,
            model_config=vllm_config.model_config, exchange=exchange, source="simulation",
            keyring=read_keyring(settings, policy),
        )
        internals.init_standalone(
            worker, vllm_config, kv_cache_config, place=place, store=store, model=model,
            total_num_kv_heads=total_num_kv_heads,
        )
        worker._report_plan()
        return worker

    @property
    def plan(self) -> Plan | None:
        """The plan this worker runs (its bound plan); None only for a capacity-only instance, which transfers no KV."""
        return None if self._runtime is None else self._runtime.bound_plan

    @property
    def runtime(self) -> RankPolicy | None:
        """This rank's run-time policy; None before planning and on a capacity-only instance."""
        return self._runtime

    @property
    def audit(self) -> AuditState | None:
        """The replication audit's state; None before planning and on a capacity-only instance."""
        return None if self._runtime is None else self._runtime.audit

    @property
    def last_lookup_probes(self) -> LookupProbes:
        """Keys and ``batch_is_exist`` calls of the last :meth:`lookup` (none when the gate refused it)."""
        return self._last_lookup

    @property
    def last_lookup_gated(self) -> bool:
        """The last :meth:`lookup` missed because the lookup gate was closed, not for want of objects."""
        return self._last_lookup.gated

    def _require_binding(self) -> RankBinding:
        if self._runtime is None or self._runtime.binding is None:
            raise RuntimeError("no plan yet: upstream asked for token databases before replication factors")
        return self._runtime.binding

    def _report_plan(self) -> None:
        if self._runtime is not None:  # capacity-only: nothing planned
            self._runtime.report_plan()

    # --- upstream's override points --------------------------------------------------------------

    def _select_store_layout(self, extra_config: dict[str, object]) -> tuple[int | None, str, type[TPShardedStoreLayout] | None]:
        # Upstream passes the namespace and layout on only inside KeyMetadata and _build_token_databases,
        # after the factors are needed: keep them so the plan is made for the store layout this worker runs.
        store_tp_size, namespace, layout_cls = super()._select_store_layout(extra_config)
        if layout_cls is None:
            self._target = StoreTarget(namespace)
        else:
            assert store_tp_size is not None
            self._target = StoreTarget(namespace, StoreSharding(store_tp_size, layout_cls.store_format))
        return store_tp_size, namespace, layout_cls

    def _compute_group_tp_replication_factors(self) -> tuple[int, ...]:
        """Plan (policy × this worker's layout × its topology, with upstream's key context) and start."""
        setup, place = self._setup, internals.place_of(self)
        layout = layout_from_kv_cache_config(
            internals.kv_cache_config(self), model=model_basename(setup.model),
            total_num_kv_heads=self.num_kv_head,  # upstream: model_config.get_total_num_kv_heads()
            kv_cache_layout=self.cache_config.get_resolved_kv_cache_layout().name, model_config=setup.model_config,
        )
        topology = Topology(tp_size=self.tp_size, pp_size=self.pp_size, pcp_size=self.pcp_size, dcp_size=self.dcp_size)
        settings = setup.settings
        # Before planning: a policy that cannot plan this model is when its layout is needed most.
        if place.is_first and settings.kvpolicy_layout_out is not None:
            capture_layout(settings.kvpolicy_layout_out, layout, topology)
        declared, replan = plan_and_replan(
            setup.policy, layout, topology, store_sharding=self._target.sharding,
            key_context=KeyContext.for_model(setup.model, setup.cache_prefix, self._target.namespace),
        )
        if settings.kvpolicy_discover is not None:
            self._discovery = RankDiscovery(
                layout=layout, topology=topology, model=setup.model, steps=settings.kvpolicy_discover_steps,
                gather=setup.gather, report_path=settings.kvpolicy_discover if place.is_first else None,
                source=setup.source,
            )
        groups = internals.kv_cache_groups(self)
        self._runtime = RankPolicy.from_settings(
            setup.policy, settings, store=self.store, gather=setup.gather, place=place,
            dynamo_deployment=dynamo_deployment(self.cache_config),
            prefix_cacheable=[group.kv_cache_spec.prefix_cacheable for group in groups], keyring=setup.keyring,
        )
        # Under a keyring every later user of the client (transfer threads, lookups, markers) gets it wrapped.
        self.store = self._runtime.store
        if setup.keyring is not None and place.is_first:
            logger.info("kvpolicy: %s", setup.keyring.describe())
        # Runs inside upstream's __init__: the store client exists, the send thread does not yet.
        return self._runtime.start(declared, replan, layout=layout).factors

    def _build_token_databases(
        self, metadata: KeyMetadata, layout_cls: type[TPShardedStoreLayout] | None
    ) -> list[ChunkedTokenDatabase]:
        plan = self._require_binding().plan
        planned = None if plan.store_sharding is None else plan.store_sharding.store_format
        if planned != (None if layout_cls is None else layout_cls.store_format):
            raise RuntimeError(f"kvpolicy planned store format {planned} but vLLM selected {layout_cls}")
        groups = internals.kv_cache_groups(self)
        return store.build_token_databases(
            plan, tp_rank=self.tp_rank, pcp_rank=self.pcp_rank, pp_rank=self.pp_rank,
            block_sizes=[group.kv_cache_spec.block_size for group in groups],
            # Upstream's rule: groups outside prefix caching hash at their own block size.
            hash_block_sizes=[
                self.hash_block_size if group.kv_cache_spec.prefix_cacheable else group.kv_cache_spec.block_size
                for group in groups
            ],
            metadata=metadata, num_kv_heads=self.num_kv_head,
        )

    def _init_lookup_key_prefixes(self) -> None:
        internals.set_lookup_key_prefixes(self, self._require_binding().lookup_key_prefixes)

    # --- the put schedule and the transfer threads' stores ---------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if internals.capacity_only(self) or not kv_caches:
            return
        binding, runtime = self._require_binding(), self._runtime
        assert runtime is not None
        self._kv_reader = audit.KVCacheReader(kv_caches, self.tp_rank)
        # Upstream builds and starts the send thread inline in register_kv_caches, with put steps =
        # factors and every prefix-cacheable group participating: right for "striped" only. There is
        # no hook, so the plan's schedule replaces both here. Safe although the thread is running:
        # saves reach it only through wait_for_save, which cannot run before this method returns.
        internals.bind_plan(self, binding, token_databases=None)
        wrap_transfer_stores(self, runtime, kv_caches, settings=self._setup.settings, exchange=self._setup.exchange)

    def _bind(self, binding: RankBinding) -> None:
        """Run ``binding`` from now on (an audit re-planned): drain the transfers, so that no save or load
        straddles the change of namespaces, then write it into upstream's attributes with token
        databases rebuilt for its plan (keeping the registered regions)."""
        internals.drain(self)
        internals.bind_plan(self, binding, token_databases=store.rebuild_token_databases(binding, self.token_dbs))

    # --- the replication audit and discovery -----------------------------------------------------

    def wait_for_save(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        # Discovery and the audit before the save, so that a demoted group's blocks of this very step go to
        # its own namespace (discovery only reads; its gather comes first on every rank alike).
        if not internals.capacity_only(self) and self.can_put:
            if self._discovery is not None:
                audit.discovery_step(self, self._discovery, metadata, self._kv_reader)
            self._audit_step(metadata)
        super().wait_for_save(metadata)

    def _audit_step(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        """One audited step, if this is one. Every TP rank reaches the same decision from the same
        metadata and state, so either all ranks enter the collective or none does."""
        runtime = self._runtime
        groups = () if runtime is None else runtime.groups_to_audit()
        blocks = audit.blocks_to_audit(metadata, self.coord, groups) if groups else {}
        if runtime is None or not blocks:
            return
        started = time.perf_counter()
        timings: dict[str, float] = {}
        # What each group's values are (fp8 caches are uint8 tensors): the configuration's, the same on every rank.
        specs = [group.kv_cache_spec for group in internals.kv_cache_groups(self)]
        comparisons = audit.value_comparisons(self.cache_config.cache_dtype, specs)
        reader = None if self._kv_reader is None else self._kv_reader.get()
        collect_reports, collect_samples = audit.step_collectors(
            self, blocks, comparisons=comparisons, gather=self._setup.gather, reader=reader, timings=timings
        )
        try:
            outcome = runtime.conclude_step(
                collect_reports, collect_samples, comparisons=comparisons, distance=tensor_distance,
                bind=self._bind, blocks_per_rank=sum(len(ids) for ids in blocks.values()), timings=timings,
            )
        except ReplicationAuditError as error:
            if self.tp_rank == 0:
                audit.record_stats(self, blocks, time.perf_counter() - started, demoted=len(error.audits))
            raise
        if self.tp_rank == 0:
            audit.record_stats(self, blocks, time.perf_counter() - started, demoted=len(outcome.demoted))

    # --- metrics and the lookup gate -------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVPolicyConnectorStats | None:  # type: ignore[override]
        """Upstream's store telemetry since the last call, with kvpolicy's counters beside it."""
        upstream = super().get_kv_connector_stats()
        ours = None if self._runtime is None else self._runtime.tally.drain()
        if upstream is None and ours is None:
            return None
        return KVPolicyConnectorStats(data={"mooncake": upstream.data if upstream else {}, "kvpolicy": ours or {}})

    def lookup(self, num_tokens: int, block_hashes: Sequence[BlockHash]) -> MooncakeLookupResult:
        """Upstream's lookup (same hit, same tail boundaries), probing only the keys its hit search
        reads (:mod:`kvpolicy.vllm.lookup`), behind the lookup gate."""
        runtime = self._runtime
        if runtime is not None and not internals.capacity_only(self) and not runtime.lookup_allowed():
            self._last_lookup = LookupProbes(gated=True)
            return MooncakeLookupResult(0)
        failures = None if runtime is None else runtime.read_failures
        result, self._last_lookup = probing_lookup(self, num_tokens, block_hashes, read_failures=failures)
        if self._last_lookup.masked and failures is not None:
            logger.info(
                "kvpolicy: lookup reports %d stored chunks missing: reading them failed in the last %g s",
                self._last_lookup.masked, failures.ttl_s,
            )
        return result
