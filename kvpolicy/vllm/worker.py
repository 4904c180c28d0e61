"""vLLM's Mooncake store worker with factors, keys, put schedules and lookups taken from a plan,
and the online replication audit (see :mod:`kvpolicy.vllm.audit`)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Self

import torch
import vllm
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

from kvpolicy.audit import AuditState, ReplicationAuditError
from kvpolicy.keys import KeyContext, model_basename, split_chunk_key
from kvpolicy.models import Layout, LoadMode, Policy, Topology
from kvpolicy.plan import Plan
from kvpolicy.routers import DynamoDeployment, DynamoHashContract
from kvpolicy.device.blocks import local_layer_digests
from kvpolicy.runtime.collective import PeerExchange
from kvpolicy.runtime.discovery import RankDiscovery
from kvpolicy.runtime.policy import RankPlace, RankPolicy, capture_layout, plan_and_replan
from kvpolicy.settings import KVPolicySettings
from kvpolicy.store_layout import StoreSharding
from kvpolicy.vllm import audit as online_audit
from kvpolicy.vllm import internals
from kvpolicy.vllm import store
from kvpolicy.vllm.layout import layout_from_kv_cache_config
from kvpolicy.vllm.lookup import LookupProbes
from kvpolicy.vllm.lookup import lookup as probing_lookup
from kvpolicy.runtime.read_failures import ReadFailures, RecordingReadStore
from kvpolicy.runtime.tally import Tally
from kvpolicy.vllm.metrics import CountingStore, KVPolicyConnectorStats, dedup_multiplier
from kvpolicy.vllm.send import MergedSaveSendingThread
from kvpolicy.vllm.standalone import Ranks, init_standalone
from kvpolicy.vllm.striped import (
    KVStorages,
    StripedReadStore,
    exchange_over_tp,
    striping_possible,
    torchcomms_enabled,
)

# Under "vllm." so records reach vLLM's own handler (it configures only the "vllm" logger tree).
logger = init_logger(f"vllm.{__name__}")

LAYOUT_OUT_KEY = "kvpolicy_layout_out"
"""The ``kv_connector_extra_config`` key of :attr:`kvpolicy.settings.KVPolicySettings.kvpolicy_layout_out`."""

AUDIT_STATS_OPERATION = online_audit.AUDIT_STATS_OPERATION
AUDIT_DEMOTED_OPERATION = online_audit.AUDIT_DEMOTED_OPERATION


class KVPolicyStoreWorker(MooncakeStoreWorker):
    """``MooncakeStoreWorker`` whose three override points answer from a kvpolicy plan.

    The plan is made once, from this worker's own ``KVCacheConfig`` and parallel sizes, the first
    time upstream asks for replication factors; token databases and lookup prefixes follow from it,
    and the send thread's put schedule is replaced after ``register_kv_caches``.

    The replication audit runs in :meth:`wait_for_save`, before a step's save reaches the send
    thread: on the first ``audit.steps`` steps that save blocks of a group with factor > 1, the
    TP ranks compare digests of those blocks; a group whose replica sets disagree is re-planned
    with factor 1 (new fingerprint, its own namespace) or, under ``enforce``, stops the engine.
    Until its audit agreed, a lookup uses a replicated group's shared namespace only where
    another instance vouched for it. A demotion is published, and a fresh instance of the same plan
    starts with it.

    What is decided at run time — the plan and re-plans, each audited step's conclusion, markers,
    the lookup gate, read failures, the tally, the status documents — is this rank's
    :class:`~kvpolicy.runtime.policy.RankPolicy` (no vLLM, no torch); this class keeps upstream's
    override points, reads what only vLLM's objects hold (layout, blocks, KV tensors) and delegates.
    Its touches of vLLM's internals go through :mod:`kvpolicy.vllm.internals`; the private methods of
    upstream's it defines are the override points upstream's ``__init__`` calls, declared there as
    ``override`` entries of ``internals.SURFACE`` (the one module besides internals that may define them).
    """

    _layout: Layout | None = None
    """The layout the plan was made from, set by :meth:`_make_plan`; None before planning."""
    _discovery_source: Literal["engine", "simulation"] = "engine"
    """What a discovery report says observed it: ``simulation`` for :meth:`standalone` workers."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        policy: Policy,
        settings: KVPolicySettings | None = None,
    ) -> None:
        """``settings`` as the connector parsed them (parsed from ``vllm_config`` when not given)."""
        # Upstream's __init__ calls the override points, so everything they read is set first.
        is_first_rank = vllm_config.parallel_config.rank == 0
        self._init_policy_state(
            policy, vllm_config, model=vllm_config.model_config.model, is_first_rank=is_first_rank,
            gather=online_audit.gather_over_tp, settings=settings,
        )
        super().__init__(vllm_config, kv_cache_config)
        if is_first_rank:
            self._report_plan()

    @classmethod
    def standalone(
        cls,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        *,
        policy: Policy,
        ranks: Ranks,
        store: Any,
        model: str,
        total_num_kv_heads: int,
        gather: Callable[[Any], Sequence[Any]],
        exchange: PeerExchange | None = None,
        settings: KVPolicySettings | None = None,
    ) -> Self:
        """This worker without vLLM's distributed runtime (:mod:`kvpolicy.vllm.standalone`): the
        ranks, the store client and the TP collective are given instead of read off torch.distributed
        (``gather(payload)`` returns every TP rank's payload, indexed by TP rank, as
        :func:`~kvpolicy.vllm.audit.gather_over_tp` does over gloo), and ``exchange`` the point-to-point
        exchange of striped loads, called from the receive thread
        (:func:`~kvpolicy.vllm.striped.exchange_over_tp` on an engine). Plans, audits, gates lookups,
        schedules puts and stripes loads exactly as on an engine;
        :mod:`kvpolicy.sim` runs its ranks this way."""
        worker = cls.__new__(cls)
        worker._discovery_source = "simulation"
        worker._init_policy_state(
            policy, vllm_config, model=model, is_first_rank=ranks.is_first, gather=gather, exchange=exchange,
            settings=settings,
        )
        init_standalone(
            worker, vllm_config, kv_cache_config, ranks=ranks, store=store, model=model,
            total_num_kv_heads=total_num_kv_heads,
        )
        if ranks.is_first:
            worker._report_plan()
        return worker

    def _init_policy_state(
        self,
        policy: Policy,
        vllm_config: VllmConfig,
        *,
        model: str,
        is_first_rank: bool,
        gather: Callable[[Any], Sequence[Any]],
        exchange: PeerExchange | None = None,
        settings: KVPolicySettings | None = None,
    ) -> None:
        """What the override points read besides upstream's own attributes (model and cache prefix
        exactly as upstream reads them for ``KeyMetadata``; where rank 0 captures the layout)."""
        assert vllm_config.kv_transfer_config is not None
        extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
        if settings is None:
            settings = KVPolicySettings.parse(extra_config)
        self._settings = settings
        self._policy = policy
        self._layout_out = settings.kvpolicy_layout_out if is_first_rank else None
        self._model = model
        self._model_config = vllm_config.model_config  # per-layer KV heads for the layout (None in a simulation)
        self._cache_prefix = str(extra_config.get("cache_prefix", ""))  # vLLM's key, read as upstream reads it
        self._read_failures = ReadFailures(settings.kvpolicy_read_failure_ttl_s)
        self._gather = gather
        self._exchange = exchange
        self._last_lookup_gated = False
        self._last_lookup_probes = LookupProbes()
        self._store_namespace = ""
        self._store_sharding: StoreSharding | None = None
        self._plan: Plan | None = None
        self._runtime: RankPolicy | None = None
        self._discovery: RankDiscovery | None = None
        self._block_reader: online_audit.BlockReader | None = None
        self._kv_caches: dict[str, Any] = {}
        """The registered KV tensors, kept for the block reader, built on first use (:meth:`_reader`)."""
        self._tally = Tally()
        # Instance-wide counts (audit steps, the plan) come from one worker: tp rank 0 of every (pcp,
        # pp) stage concludes each step, and vLLM sums the workers' stats.
        self._is_first_rank = is_first_rank
        self._prefix_groups: dict[str, int] = {}

    @property
    def plan(self) -> Plan | None:
        """The plan this worker runs; None only for a capacity-only instance, which transfers no KV."""
        return self._plan

    @property
    def runtime(self) -> RankPolicy | None:
        """This rank's run-time policy (:mod:`kvpolicy.runtime.policy`); None before planning and on a
        capacity-only instance."""
        return self._runtime

    @property
    def audit(self) -> AuditState | None:
        """The replication audit's state; None before planning and on a capacity-only instance."""
        return None if self._runtime is None else self._runtime.audit

    @property
    def last_lookup_probes(self) -> LookupProbes:
        """Keys and ``batch_is_exist`` calls of the last :meth:`lookup` (none when the gate refused it)."""
        return self._last_lookup_probes

    @property
    def last_lookup_gated(self) -> bool:
        """The last :meth:`lookup` missed because the lookup gate was closed, not for want of objects."""
        return self._last_lookup_gated

    def _require_plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("no plan yet: upstream asked for token databases before replication factors")
        return self._plan

    # --- planning --------------------------------------------------------------------------------

    def _select_store_layout(
        self, extra_config: dict[str, Any]
    ) -> tuple[int | None, str, type[TPShardedStoreLayout] | None]:
        # Upstream computes the store namespace and layout here and passes them on only inside
        # KeyMetadata and _build_token_databases, after the factors are needed; keep them so the
        # plan is made for the store layout this worker will run.
        store_tp_size, store_namespace, layout_cls = super()._select_store_layout(extra_config)
        self._store_namespace = store_namespace
        if layout_cls is not None:
            assert store_tp_size is not None
            self._store_sharding = StoreSharding(store_tp_size, layout_cls.store_format)
        return store_tp_size, store_namespace, layout_cls

    def _make_plan(self) -> Plan:
        """policy × this worker's layout × its topology, with upstream's key context."""
        layout = layout_from_kv_cache_config(
            internals.kv_cache_config(self),
            model=model_basename(self._model),
            # Upstream sets num_kv_head to model_config.get_total_num_kv_heads().
            total_num_kv_heads=self.num_kv_head,
            kv_cache_layout=self.cache_config.get_resolved_kv_cache_layout().name,
            model_config=self._model_config,
        )
        self._layout = layout
        topology = Topology(
            tp_size=self.tp_size, pp_size=self.pp_size, pcp_size=self.pcp_size, dcp_size=self.dcp_size
        )
        # Before planning: a policy that cannot plan this model is when its layout is needed most.
        if self._layout_out is not None:
            capture_layout(self._layout_out, layout, topology)
        policy = self._policy
        declared, replan = plan_and_replan(
            policy,
            layout,
            topology,
            key_context=KeyContext.for_model(self._model, self._cache_prefix, self._store_namespace),
            store_sharding=self._store_sharding,
        )
        if len(declared.groups) != len(internals.kv_cache_groups(self)):
            raise RuntimeError(
                f"kvpolicy planned {len(declared.groups)} groups but the store coordinator has "
                f"{len(internals.kv_cache_groups(self))}; the layout adapter and vLLM disagree on the group selection"
            )
        settings = self._settings
        if settings.kvpolicy_discover is not None:
            self._discovery = RankDiscovery(
                layout=layout, topology=topology, model=self._model, steps=settings.kvpolicy_discover_steps,
                gather=self._gather, report_path=settings.kvpolicy_discover if self._is_first_rank else None,
                source=self._discovery_source,
            )
        self._runtime = RankPolicy(
            policy,
            store=self.store,
            gather=self._gather,
            place=RankPlace(
                tp_rank=self.tp_rank, pcp_rank=self.pcp_rank, pp_rank=self.pp_rank, is_first_rank=self._is_first_rank
            ),
            plan_json=settings.kvpolicy_plan_json,
            keys_json=settings.keys_json_path(),
            dynamo_json=settings.kvpolicy_dynamo_json,
            dynamo_deployment=self._dynamo_deployment(),
            read_failures=self._read_failures,
            tally=self._tally,
        )
        # Runs inside upstream's __init__: the store client exists, the send thread does not yet.
        return self._runtime.start(declared, replan, layout=layout)

    def _dynamo_deployment(self) -> DynamoDeployment:
        """What Dynamo's descriptor states of this instance: its vLLM, hash algorithm and hash seed."""
        seed = os.environ.get("PYTHONHASHSEED")
        return DynamoDeployment(
            vllm_revision=vllm.__version__,
            hash=DynamoHashContract(
                algorithm=str(self.cache_config.prefix_caching_hash_algo),
                # Unset, vLLM seeds a cryptographic hash with its own default and any other at random.
                seed_policy=f"pythonhashseed-{seed}" if seed is not None else "pythonhashseed-unset",
            ),
        )

    # --- the three override points ---------------------------------------------------------------

    def _compute_group_tp_replication_factors(self) -> tuple[int, ...]:
        self._plan = self._make_plan()
        return self._plan.factors

    def _build_token_databases(
        self,
        metadata: KeyMetadata,
        layout_cls: type[TPShardedStoreLayout] | None,
    ) -> list[ChunkedTokenDatabase]:
        plan = self._require_plan()
        planned = None if plan.store_sharding is None else plan.store_sharding.store_format
        if planned != (None if layout_cls is None else layout_cls.store_format):
            raise RuntimeError(f"kvpolicy planned store format {planned} but vLLM selected {layout_cls}")
        groups = internals.kv_cache_groups(self)
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
            num_kv_heads=self.num_kv_head,
        )

    def _init_lookup_key_prefixes(self) -> None:
        internals.set_lookup_key_prefixes(self, store.lookup_key_prefixes(self._require_plan()))

    # --- the put schedule ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if internals.capacity_only(self) or not kv_caches:
            return
        # The audit's and discovery's block reader is built when one of them first reads (_reader): an
        # engine running neither never scans the KV tensors, whatever devices they lie on.
        self._kv_caches = dict(kv_caches)
        # Upstream builds and starts the send thread inline in register_kv_caches, with put steps =
        # factors and every prefix-cacheable group participating: right for "striped" only. There is
        # no hook, so the plan's schedule replaces both here. Safe although the thread is running:
        # saves reach it only through wait_for_save, which cannot run before this method returns.
        self._bind(self._require_plan())
        # Counts, per group, what the send thread puts and finds stored (kvpolicy's /metrics).
        internals.decorate_send_store(
            self,
            lambda inner: CountingStore(
                inner, self._tally, self._group_of_key, lambda group: dedup_multiplier(self._require_plan(), group)
            ),
        )
        if self.kv_send_thread is not None:
            # One exists check and one put per job for boundary states and chunks together; outside
            # the counting view, so that it counts the boundary keys riding on the chunk calls.
            MergedSaveSendingThread.adopt(self.kv_send_thread)
        self._stripe_loads(kv_caches)
        if self._read_failures.ttl_s > 0:
            # Outermost, so that it sees every failure vLLM sees (striped loads report their own).
            internals.decorate_recv_stores(self, lambda inner: RecordingReadStore(inner, self._read_failures))

    def _stripe_loads(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Under ``load: striped``, give the receive threads the striping view of the store."""
        plan = self._require_plan()
        replicated = any(len(rank.replica_set) > 1 for group in plan.groups for rank in group.ranks)
        if plan.load is not LoadMode.STRIPED or not replicated or not self.kv_recv_threads:
            return  # the same decision on every rank: it depends on the plan alone
        storages = KVStorages.of_kv_caches(kv_caches)
        why = striping_possible(
            recv_threads=len(self.kv_recv_threads), disk_offload_budget=self.disk_offload_buffer_budget_bytes,
            kv_devices=storages.devices, torchcomms=torchcomms_enabled(),
        )
        if why is not None:
            if self.tp_rank == 0:
                logger.warning("kvpolicy: load: striped falls back to reads on every rank: %s", why)
            return
        settings = self._settings
        exchange = self._exchange
        if exchange is None:
            exchange = exchange_over_tp(settings.kvpolicy_striped_exchange, device=storages.device)
        internals.decorate_recv_stores(
            self,
            lambda inner: StripedReadStore(
                inner,
                tp_rank=self.tp_rank,
                group_of_key=self._group_of_key,
                replica_set_of=self._replica_set_of,
                exchange=exchange,
                storages=storages,
                piece_budget_bytes=settings.striped_piece_budget_bytes,
            ),
        )

    def _replica_set_of(self, group: int) -> tuple[int, ...]:
        """This rank's replica set in ``group``, as the plan it runs now says."""
        return self._require_plan().groups[group].ranks[self.tp_rank].replica_set

    def _group_of_key(self, key: str) -> int | None:
        """The group a store key of this rank belongs to (None for a key of no namespace it writes)."""
        try:
            namespace, _ = split_chunk_key(key)
        except ValueError:
            return None
        return self._prefix_groups.get(namespace)

    def _bind(self, plan: Plan) -> None:
        """Point every plan-dependent part of this worker at ``plan``: factors, token databases (key
        prefixes and shard ids, keeping the registered regions), lookup prefixes, and the send
        thread's put steps, stripe rank and participation. The one place a plan is written into upstream's
        attributes after ``__init__``: after registration, and after an audit demotion. Call it while
        no save or load is in flight: the send thread reads all of these per job."""
        changed = plan is not self._plan
        self._plan = plan
        databases = None
        old = list(self.token_dbs)
        if old and changed:  # at registration they were built from this very plan in __init__
            if plan.store_sharding is not None:
                # Unreachable: under a TP-sharded store every group has factor 1, so no audit demotes.
                raise RuntimeError("kvpolicy: a TP-sharded store layout is never re-planned")
            databases = store.build_token_databases(
                plan,
                tp_rank=self.tp_rank,
                pcp_rank=self.pcp_rank,
                pp_rank=self.pp_rank,
                block_sizes=[database.block_size for database in old],
                hash_block_sizes=[database.hash_block_size for database in old],
                metadata=dataclasses.replace(old[0].metadata, tp_rank=self.tp_rank, group_id=0),
            )
        self._prefix_groups = {
            prefix: group.index
            for group in plan.groups
            for prefix in plan.key_prefixes(group.index, self.tp_rank, self.pcp_rank, self.pp_rank)
        }
        internals.bind_plan(
            self,
            plan.factors,
            token_databases=databases,
            lookup_key_prefixes=store.lookup_key_prefixes(plan),
            send_rank=store.send_thread_rank(plan, self.tp_rank),
            put_steps=store.group_put_steps(plan),
            participates=store.group_participates(
                plan, self.tp_rank, [group.kv_cache_spec.prefix_cacheable for group in internals.kv_cache_groups(self)]
            ),
        )

    # --- reporting -------------------------------------------------------------------------------

    def _report_plan(self) -> None:
        if self._runtime is not None:  # capacity-only: nothing planned
            self._runtime.report_plan()

    # --- the replication audit -------------------------------------------------------------------

    def wait_for_save(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        # Discovery and the audit before the save, so that a demoted group's blocks of this very step go to
        # its own namespace (discovery only reads; its gather comes first on every rank alike).
        if not internals.capacity_only(self) and self.can_put:
            self._discovery_step(metadata)
            self._audit_step(metadata)
        super().wait_for_save(metadata)

    def _discovery_step(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        """Under ``kvpolicy_discover``, one observed step if this step saves blocks: every rank
        decides alike from the metadata and the count of steps observed (see
        :mod:`kvpolicy.runtime.discovery`)."""
        discovery = self._discovery
        if discovery is None or not discovery.observing:
            return
        groups = internals.kv_cache_groups(self)
        blocks = online_audit.blocks_to_audit(metadata, self.coord, range(len(groups)))
        if not blocks:
            return
        reader = self._reader()

        def collect() -> dict[int, dict[str, list[tuple[str, bool]]]]:
            if reader is None:
                raise RuntimeError("no KV caches registered")
            layer_names = {group: groups[group].layer_names for group in blocks}
            return local_layer_digests(self.token_dbs, reader, blocks, layer_names)

        discovery.observe_step(collect)

    def _audit_step(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        """One audited step, if this is one. Every TP rank reaches the same decision from the same
        metadata and state, so either all ranks enter the collective or none does."""
        runtime = self._runtime
        if runtime is None:
            return
        groups = runtime.groups_to_audit()
        if not groups:
            return
        blocks = online_audit.blocks_to_audit(metadata, self.coord, groups)
        if not blocks:
            return
        started = time.perf_counter()
        timings: dict[str, float] = {}
        # What each group's values are (fp8 caches are uint8 tensors): the configuration's, the same on every rank.
        comparisons = online_audit.value_comparisons(
            self.cache_config.cache_dtype, [group.kv_cache_spec for group in internals.kv_cache_groups(self)]
        )
        collect_reports, collect_samples = online_audit.step_collectors(
            self, blocks, comparisons=comparisons, gather=self._gather, reader=self._reader(), timings=timings
        )
        try:
            outcome = runtime.conclude_step(
                collect_reports,
                collect_samples,
                comparisons=comparisons,
                distance=online_audit.tensor_distance,
                on_plan_change=self._rebind,
                blocks_per_rank=sum(len(ids) for ids in blocks.values()),
                timings=timings,
            )
        except ReplicationAuditError as error:
            if self.tp_rank == 0:
                online_audit.record_stats(self, blocks, time.perf_counter() - started, demoted=len(error.audits))
            raise
        if self.tp_rank == 0:
            online_audit.record_stats(self, blocks, time.perf_counter() - started, demoted=len(outcome.demoted))

    def _reader(self) -> online_audit.BlockReader | None:
        """The block reader of the registered KV tensors, built on first use; None before registration
        and where the tensors cannot be read (logged once; the audit then joins its collectives empty)."""
        if self._block_reader is None and self._kv_caches:
            try:
                self._block_reader = online_audit.BlockReader(self._kv_caches)
            except Exception:
                logger.exception("kvpolicy: tp rank %d cannot read its KV caches for the audit or discovery", self.tp_rank)
                self._kv_caches = {}
        return self._block_reader

    def _rebind(self, plan: Plan) -> None:
        """Run ``plan`` from now on: no save or load may straddle the change of namespaces."""
        online_audit.drain(self)
        self._bind(plan)

    # --- metrics ---------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVPolicyConnectorStats | None:  # type: ignore[override]
        """Upstream's store telemetry since the last call, with kvpolicy's counters beside it."""
        upstream = super().get_kv_connector_stats()
        ours = self._tally.drain()
        if upstream is None and ours is None:
            return None
        return KVPolicyConnectorStats(data={"mooncake": upstream.data if upstream else {}, "kvpolicy": ours or {}})

    # --- the lookup gate -------------------------------------------------------------------------

    def lookup(self, num_tokens: int, block_hashes: Sequence[BlockHash]) -> MooncakeLookupResult:
        """Upstream's lookup (same hit, same tail boundaries), probing only the keys its hit search
        reads (:mod:`kvpolicy.vllm.lookup`), behind the lookup gate."""
        self._last_lookup_gated = False
        self._last_lookup_probes = LookupProbes()
        if self._runtime is not None and not internals.capacity_only(self) and not self._runtime.lookup_allowed():
            self._last_lookup_gated = True
            return MooncakeLookupResult(0)
        result, self._last_lookup_probes = probing_lookup(
            self, num_tokens, block_hashes, read_failures=self._read_failures
        )
        if self._last_lookup_probes.masked:
            logger.info(
                "kvpolicy: lookup reports %d stored chunks missing: reading them failed in the last %g s",
                self._last_lookup_probes.masked, self._read_failures.ttl_s,
            )
        return result
