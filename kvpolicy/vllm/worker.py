"""vLLM's Mooncake store worker with factors, keys, put schedules and lookups taken from a plan,
and the online replication audit (see :mod:`kvpolicy.vllm.audit`)."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

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

from kvpolicy.audit import AuditState, AuditStatus, ReplicationAuditError, StepOutcome
from kvpolicy.contract import key_contract
from kvpolicy.dumper import dump_layout
from kvpolicy.engine import make_plan
from kvpolicy.keys import KeyContext, model_basename
from kvpolicy.loader import schemas_dir
from kvpolicy.models import Layout, LoadMode, Policy, Topology
from kvpolicy.plan import Plan
from kvpolicy.report import format_plan_table, plan_to_json
from kvpolicy.runtime.collective import PeerExchange
from kvpolicy.store_layout import StoreSharding
from kvpolicy.vllm import audit as online_audit
from kvpolicy.vllm import store
from kvpolicy.vllm.layout import layout_from_kv_cache_config
from kvpolicy.vllm.lookup import LookupProbes
from kvpolicy.vllm.lookup import lookup as probing_lookup
from kvpolicy.vllm.metrics import CountingStore, KVPolicyConnectorStats, Tally, dedup_multiplier
from kvpolicy.vllm.read_failures import ReadFailures, RecordingReadStore, ttl_from_extra_config
from kvpolicy.vllm.send import MergedSaveSendingThread
from kvpolicy.vllm.standalone import Ranks, init_standalone
from kvpolicy.vllm.striped import KVStorages, StripedReadStore, StripedSettings, exchange_over_tp, striping_possible

# Under "vllm." so records reach vLLM's own handler (it configures only the "vllm" logger tree).
logger = init_logger(f"vllm.{__name__}")

PLAN_JSON_KEY = "kvpolicy_plan_json"
"""``kv_connector_extra_config`` key naming a file rank 0 writes the plan to, as JSON (rewritten
after every audited step that changes a group's audit status)."""
KEYS_JSON_KEY = "kvpolicy_keys_json"
"""``kv_connector_extra_config`` key naming a file rank 0 writes the key contract to
(:mod:`kvpolicy.contract`, what ``kvpolicy keys --format json`` prints), at start-up and whenever the
audit changes the plan. Without it, an instance given ``kvpolicy_plan_json`` writes the contract next
to the plan, as ``<plan file stem>.keys.json``."""
LAYOUT_OUT_KEY = "kvpolicy_layout_out"
"""``kv_connector_extra_config`` key naming a file rank 0 writes, at start-up, the layout it planned
(the ``ModelLayout`` of its ``KVCacheConfig``), for ``kvpolicy validate`` / ``plan --layout``."""

AUDIT_STATS_OPERATION = online_audit.AUDIT_STATS_OPERATION
AUDIT_DEMOTED_OPERATION = online_audit.AUDIT_DEMOTED_OPERATION


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a reader finds the previous file or the whole new one.

    A fresh name opened with ``O_EXCL`` never follows a planted symlink; mode 0o666 leaves the umask
    to decide, as a plain write would (``mkstemp``'s 0600 would hide the file from other users).
    """
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def keys_path_beside(plan_path: Path) -> Path:
    """Where the key contract goes without ``kvpolicy_keys_json``: ``<plan file stem>.keys.json`` beside
    the plan (``plan.json`` -> ``plan.keys.json``), never the plan file itself."""
    return plan_path.with_name(f"{plan_path.stem}.keys.json")


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
    another instance vouched for it (:class:`kvpolicy.vllm.audit.LookupGate`). A demotion is
    published, and a fresh instance of the same plan starts with it (:meth:`_start_audit`).
    """

    _layout: Layout | None = None
    """The layout the plan was made from, set by :meth:`_make_plan`; None before planning."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, policy: Policy) -> None:
        # Upstream's __init__ calls the override points, so everything they read is set first.
        is_first_rank = vllm_config.parallel_config.rank == 0
        self._init_policy_state(
            policy, vllm_config, model=vllm_config.model_config.model, is_first_rank=is_first_rank,
            gather=online_audit.gather_over_tp,
        )
        super().__init__(vllm_config, kv_cache_config)
        if is_first_rank:
            self._report_plan(vllm_config)

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
        worker._init_policy_state(
            policy, vllm_config, model=model, is_first_rank=ranks.is_first, gather=gather, exchange=exchange
        )
        init_standalone(
            worker, vllm_config, kv_cache_config, ranks=ranks, store=store, model=model,
            total_num_kv_heads=total_num_kv_heads,
        )
        if ranks.is_first:
            worker._report_plan(vllm_config)
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
    ) -> None:
        """What the override points read besides upstream's own attributes (model and cache prefix
        exactly as upstream reads them for ``KeyMetadata``; where rank 0 captures the layout)."""
        assert vllm_config.kv_transfer_config is not None
        extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
        layout_out = extra_config.get(LAYOUT_OUT_KEY) if is_first_rank else None
        self._policy = policy
        self._layout_out = Path(str(layout_out)) if layout_out else None
        self._model = model
        self._cache_prefix = str(extra_config.get("cache_prefix", ""))
        self._read_failures = ReadFailures(ttl_from_extra_config(extra_config))
        self._striped_settings = StripedSettings.from_extra_config(extra_config)
        self._gather = gather
        self._exchange = exchange
        self._last_lookup_gated = False
        self._last_lookup_probes = LookupProbes()
        self._store_namespace = ""
        self._store_sharding: StoreSharding | None = None
        self._plan: Plan | None = None
        self._audit: AuditState | None = None
        self._gate = online_audit.LookupGate()
        self._gate_logged = False
        self._block_reader: online_audit.BlockReader | None = None
        self._plan_json_path: Path | None = None
        self._keys_json_path: Path | None = None
        self._tally = Tally()
        # Instance-wide counts (audit steps, the plan) come from one worker: tp rank 0 of every (pcp,
        # pp) stage concludes each step, and vLLM sums the workers' stats.
        self._counts_instance = is_first_rank
        self._prefix_groups: dict[str, int] = {}

    @property
    def plan(self) -> Plan | None:
        """The plan this worker runs; None only for a capacity-only instance, which transfers no KV."""
        return self._plan

    @property
    def audit(self) -> AuditState | None:
        """The replication audit's state; None before planning and on a capacity-only instance."""
        return self._audit

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
            self._kv_cache_config,
            model=model_basename(self._model),
            # Upstream sets num_kv_head to model_config.get_total_num_kv_heads().
            total_num_kv_heads=self.num_kv_head,
            kv_cache_layout=self.cache_config.get_resolved_kv_cache_layout().name,
        )
        self._layout = layout
        topology = Topology(
            tp_size=self.tp_size, pp_size=self.pp_size, pcp_size=self.pcp_size, dcp_size=self.dcp_size
        )
        # Before planning: a policy that cannot plan this model is when its layout is needed most.
        if self._layout_out is not None:
            self._write_layout(self._layout_out, layout, topology)
        context = KeyContext.for_model(self._model, self._cache_prefix, self._store_namespace)
        policy = self._policy

        sharding = self._store_sharding

        def replan(demoted: frozenset[int]) -> Plan:
            return make_plan(policy, layout, topology, key_context=context, demoted=demoted, store_sharding=sharding)

        declared = replan(frozenset())
        if len(declared.groups) != len(self._kv_cache_groups):
            raise RuntimeError(
                f"kvpolicy planned {len(declared.groups)} groups but the store coordinator has "
                f"{len(self._kv_cache_groups)}; the layout adapter and vLLM disagree on the group selection"
            )
        self._audit = self._start_audit(declared, replan)
        self._gate = online_audit.LookupGate(pcp_rank=self.pcp_rank, pp_rank=self.pp_rank)
        return self._audit.plan

    def _start_audit(self, declared: Plan, replan: Callable[[frozenset[int]], Plan]) -> AuditState:
        """The audit this instance starts with: demoted already where another instance of ``declared``
        published a demotion (:func:`kvpolicy.audit.demotion_key`), so that it loads the fallback's
        objects from its first lookup.

        Every TP rank reads the markers of its (pcp, pp) namespace and the ranks take the union
        (:func:`kvpolicy.vllm.audit.agree_on_demotions`): a rank that alone saw a marker would
        otherwise skip audited steps the others make, and hang them in the collective. Whether the
        ranks gather at all depends on the plan only. Runs inside upstream's ``__init__``: the store
        client exists, the send thread does not yet.
        """
        fresh = AuditState(declared, replan=replan)
        groups = fresh.groups_to_audit()  # empty under audit: off, which trusts the rule and ignores markers
        if not groups:
            return fresh
        found = online_audit.read_demotions(
            self.store, declared, groups, pcp_rank=self.pcp_rank, pp_rank=self.pp_rank
        )
        inherited = online_audit.agree_on_demotions(found, gather=self._gather)
        if not inherited:
            return fresh
        try:
            state = AuditState(declared, replan=replan, inherited=inherited)
        except ReplicationAuditError as error:
            if self.tp_rank == 0:
                logger.error("%s (audit: enforce stops the engine)", error)
            raise
        if self.tp_rank == 0:
            logger.warning(
                "kvpolicy audit: inherited demotion of group%s %s from another instance of this plan; "
                "starting with factor 1 there (own namespace, plan fingerprint %s -> %s): %s",
                "s" if len(state.inherited) > 1 else "",
                ",".join(map(str, state.inherited)),
                declared.fingerprint,
                state.plan.fingerprint,
                " | ".join(state.inherited.values()),
            )
        return state

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
            num_kv_heads=self.num_kv_head,
        )

    def _init_lookup_key_prefixes(self) -> None:
        self._lookup_key_prefixes = store.lookup_key_prefixes(self._require_plan())

    # --- the put schedule ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self._capacity_only or not kv_caches:
            return
        self._block_reader = online_audit.BlockReader(kv_caches)
        # Upstream builds and starts the send thread inline in register_kv_caches, with put steps =
        # factors and every prefix-cacheable group participating: right for "striped" only. There is
        # no hook, so the plan's schedule replaces both here. Safe although the thread is running:
        # saves reach it only through wait_for_save, which cannot run before this method returns.
        self._bind(self._require_plan())
        if self.kv_send_thread is not None:
            # Counts, per group, what the send thread puts and finds stored (kvpolicy's /metrics).
            self.kv_send_thread.store = CountingStore(
                self.kv_send_thread.store,
                self._tally,
                self._group_of_key,
                lambda group: dedup_multiplier(self._require_plan(), group),
            )
            # One exists check and one put per job for boundary states and chunks together; outside
            # the counting view, so that it counts the boundary keys riding on the chunk calls.
            MergedSaveSendingThread.adopt(self.kv_send_thread)
        self._stripe_loads(kv_caches)
        if self._read_failures.ttl_s > 0:
            # Outermost, so that it sees every failure vLLM sees (striped loads report their own).
            for thread in self.kv_recv_threads:
                thread.store = RecordingReadStore(thread.store, self._read_failures)

    def _stripe_loads(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Under ``load: striped``, give the receive threads the striping view of the store."""
        plan = self._require_plan()
        replicated = any(len(rank.replica_set) > 1 for group in plan.groups for rank in group.ranks)
        if plan.load is not LoadMode.STRIPED or not replicated or not self.kv_recv_threads:
            return  # the same decision on every rank: it depends on the plan alone
        why = striping_possible(
            recv_threads=len(self.kv_recv_threads), disk_offload_budget=self.disk_offload_buffer_budget_bytes
        )
        if why is not None:
            if self.tp_rank == 0:
                logger.warning("kvpolicy: load: striped falls back to reads on every rank: %s", why)
            return
        settings = self._striped_settings
        exchange = self._exchange if self._exchange is not None else exchange_over_tp(settings)
        storages = KVStorages.of_kv_caches(kv_caches)
        for thread in self.kv_recv_threads:
            thread.store = StripedReadStore(
                thread.store,
                tp_rank=self.tp_rank,
                group_of_key=self._group_of_key,
                replica_set_of=self._replica_set_of,
                exchange=exchange,
                storages=storages,
                piece_budget_bytes=settings.piece_budget_bytes,
            )

    def _replica_set_of(self, group: int) -> tuple[int, ...]:
        """This rank's replica set in ``group``, as the plan it runs now says."""
        return self._require_plan().groups[group].ranks[self.tp_rank].replica_set

    def _group_of_key(self, key: str) -> int | None:
        """The group a store key of this rank belongs to (None for a key of no namespace it writes)."""
        return self._prefix_groups.get(key.rpartition("@")[0])

    def _bind(self, plan: Plan) -> None:
        """Point every plan-dependent part of this worker at ``plan``: factors, token databases (key
        prefixes and shard ids, keeping the registered regions), lookup prefixes, and the send
        thread's put steps, stripe rank and participation. The one place a plan is written into upstream's
        attributes after ``__init__``: after registration, and after an audit demotion. Call it while
        no save or load is in flight: the send thread reads all of these per job."""
        changed = plan is not self._plan
        self._plan = plan
        self._group_tp_replication_factors = plan.factors
        old = list(self.token_dbs)
        if old and changed:  # at registration they were built from this very plan in __init__
            if plan.store_sharding is not None:
                # Unreachable: under a TP-sharded store every group has factor 1, so no audit demotes.
                raise RuntimeError("kvpolicy: a TP-sharded store layout is never re-planned")
            new = store.build_token_databases(
                plan,
                tp_rank=self.tp_rank,
                pcp_rank=self.pcp_rank,
                pp_rank=self.pp_rank,
                block_sizes=[database.block_size for database in old],
                hash_block_sizes=[database.hash_block_size for database in old],
                metadata=dataclasses.replace(old[0].metadata, tp_rank=self.tp_rank, group_id=0),
            )
            for database, previous in zip(new, old, strict=True):
                database.set_kv_caches_base_addr(list(previous.kv_caches_base_addr))
                database.set_block_len(list(previous.block_len))
            # The same list object: the transfer threads hold it.
            self.token_dbs[:] = new
        self._lookup_key_prefixes = store.lookup_key_prefixes(plan)
        self._prefix_groups = {
            prefix: group.index
            for group in plan.groups
            for prefix in plan.key_prefixes(group.index, self.tp_rank, self.pcp_rank, self.pp_rank)
        }
        thread = self.kv_send_thread
        if thread is not None:
            thread.tp_rank = store.send_thread_rank(plan, self.tp_rank)
            thread.group_put_steps = store.group_put_steps(plan)
            thread.group_participates = store.group_participates(
                plan, self.tp_rank, [group.kv_cache_spec.prefix_cacheable for group in self._kv_cache_groups]
            )

    # --- reporting -------------------------------------------------------------------------------

    def _statuses(self) -> dict[int, AuditStatus] | None:
        return None if self._audit is None else self._audit.statuses

    def _report_plan(self, vllm_config: VllmConfig) -> None:
        if self._plan is None:
            return  # capacity-only: nothing planned
        assert vllm_config.kv_transfer_config is not None
        json_path = vllm_config.kv_transfer_config.kv_connector_extra_config.get(PLAN_JSON_KEY)
        plan = self._plan
        logger.info(
            "kvpolicy plan (policy %s):\n%s", self._policy.name, format_plan_table(plan, audit=self._statuses())
        )
        keys_path = vllm_config.kv_transfer_config.kv_connector_extra_config.get(KEYS_JSON_KEY)
        if json_path:
            self._plan_json_path = Path(str(json_path))
        if keys_path or json_path:
            self._keys_json_path = (
                Path(str(keys_path)) if keys_path else keys_path_beside(Path(str(json_path)))
            )
        self._write_plan_json()
        self._tally.plan(plan)
        for what, path in (("plan", self._plan_json_path), ("key contract", self._keys_json_path)):
            if path is not None:
                logger.info("kvpolicy %s written to %s", what, path)

    def _write_plan_json(self) -> None:
        """Rewrite the plan file and the key contract (where configured) for the plan now run."""
        if self._keys_json_path is not None:
            assert self._layout is not None  # planned from it
            contract = key_contract(self._require_plan(), self._layout)
            write_text_atomically(self._keys_json_path, json.dumps(contract.model_dump(mode="json"), indent=2) + "\n")
        if self._plan_json_path is None:
            return
        payload = plan_to_json(self._require_plan(), audit=self._statuses())
        if self._audit is not None and self._audit.inherited:
            declared = self._audit.initial_plan.fingerprint
            payload["audit"]["inherited"] = [
                {"group": group, "plan": declared, "message": message}
                for group, message in self._audit.inherited.items()
            ]
        if self._audit is not None and self._audit.history:
            payload["audit"]["steps_done"] = self._audit.steps_done
            payload["audit"]["errors"] = [message for step in self._audit.history for message in step.messages]
        write_text_atomically(self._plan_json_path, json.dumps(payload, indent=2) + "\n")

    @staticmethod
    def _write_layout(path: Path, layout: Layout, topology: Topology) -> None:
        """Capture ``layout`` (``kvpolicy_layout_out``) as YAML that ``kvpolicy validate`` and
        ``kvpolicy plan --layout`` read."""
        schema = schemas_dir() / "layout.schema.json"
        text = dump_layout(layout, captured_at=topology, schema=str(schema.resolve()) if schema.is_file() else None)
        try:
            write_text_atomically(path, text)
        except OSError as error:
            reason = error.strerror or str(error)
            raise OSError(f"kvpolicy: cannot write the layout to {path} ({LAYOUT_OUT_KEY}): {reason}") from error
        logger.info("kvpolicy layout written to %s", path)

    # --- the replication audit -------------------------------------------------------------------

    def wait_for_save(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        # The audit first, so that a demoted group's blocks of this very step go to its own namespace.
        if not self._capacity_only and self.can_put:
            self._audit_step(metadata)
        super().wait_for_save(metadata)

    def _audit_step(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        """One audited step, if this is one. Every TP rank reaches the same decision from the same
        metadata and state, so either all ranks enter the collective or none does."""
        state = self._audit
        if state is None:
            return
        groups = state.groups_to_audit()
        if not groups:
            return
        blocks = online_audit.blocks_to_audit(metadata, self.coord, groups)
        if not blocks:
            return
        started = time.perf_counter()
        timings: dict[str, float] = {}
        # What each group's values are (fp8 caches are uint8 tensors): the configuration's, the same on every rank.
        comparisons = online_audit.value_comparisons(
            self.cache_config.cache_dtype, [group.kv_cache_spec for group in self._kv_cache_groups]
        )

        def collect_reports() -> list[online_audit.Report]:
            report: online_audit.Report = None
            try:
                if self._block_reader is None:
                    raise RuntimeError("no KV caches registered")
                report = online_audit.encode_report(
                    online_audit.local_digests(self.token_dbs, self._block_reader, blocks)
                )
            except Exception:
                # Still join the collective: a rank that skipped it would hang every other rank.
                logger.exception("kvpolicy audit: tp rank %d could not digest its blocks", self.tp_rank)
            timings["digest"] = time.perf_counter() - started
            gathered = list(self._gather(report))
            timings["gather"] = time.perf_counter() - started - timings["digest"]
            return gathered

        def collect_samples(groups: tuple[int, ...]) -> list[online_audit.Samples]:
            began = time.perf_counter()
            samples: online_audit.Samples = None
            try:
                assert self._block_reader is not None
                layer_names = {group: self._kv_cache_groups[group].layer_names for group in groups}
                samples = online_audit.local_samples(
                    self.token_dbs, self._block_reader, blocks, layer_names, groups, comparisons=comparisons
                )
            except Exception:
                logger.exception("kvpolicy audit: tp rank %d could not sample its blocks", self.tp_rank)
            gathered = list(self._gather(samples))
            timings["values"] = time.perf_counter() - began
            return gathered

        try:
            outcome = online_audit.conclude_step(state, collect_reports, collect_samples, comparisons=comparisons)
        except ReplicationAuditError as error:
            if self.tp_rank == 0:
                logger.error("%s (audit: enforce stops the engine)", error)
                online_audit.record_stats(self, blocks, time.perf_counter() - started, demoted=len(error.audits))
                if self._counts_instance:
                    self._tally.audit_step(demoted=tuple(audit.group for audit in error.audits))
            raise
        if outcome.plan_changed:
            # No save or load may straddle the change of namespaces.
            online_audit.drain(self)
            self._bind(outcome.plan)
        if self.tp_rank == 0:
            self._after_audit(outcome, blocks, started, timings)

    def _after_audit(
        self,
        outcome: StepOutcome,
        blocks: Mapping[int, Sequence[int]],
        started: float,
        timings: Mapping[str, float],
    ) -> None:
        """Rank 0's side effects of an audited step; nothing here feeds back into the audit."""
        state = self._audit
        assert state is not None
        seconds = time.perf_counter() - started  # digest, collective, verdict and any fallback
        self._publish_demotions(outcome)
        for message in outcome.messages:
            logger.error(
                "%s; falling back to factor 1 for this instance (own namespace, plan fingerprint %s -> %s)",
                message,
                outcome.previous_plan.fingerprint,
                outcome.plan.fingerprint,
            )
        if outcome.failed_ranks:
            logger.warning(
                "kvpolicy audit step %d: ranks %s could not digest their blocks; this step proves nothing",
                outcome.step,
                ",".join(map(str, outcome.failed_ranks)),
            )
        verdicts = ", ".join(
            f"group {audit.group} {audit.verdict.value}"
            + (f" within rounding (relative distance {audit.distance:.1e})" if audit.distance else "")
            for audit in outcome.audits
        )
        logger.info(
            "kvpolicy audit step %d/%d: %d blocks per rank (%s); digest %.2f ms, gather %.2f ms, total %.2f ms%s",
            outcome.step,
            state.steps,
            sum(len(ids) for ids in blocks.values()),
            verdicts or "no verdict",
            timings.get("digest", 0.0) * 1e3,
            timings.get("gather", 0.0) * 1e3,
            seconds * 1e3,
            f" (values compared: {timings['values'] * 1e3:.2f} ms)" if "values" in timings else "",
        )
        for group in outcome.unverified:
            logger.warning(
                "kvpolicy audit: group %d (%s) saved only all-zero blocks in %d audited steps; its rule stays "
                "unverified, and lookups use its shared namespace only where another instance vouched for it",
                group,
                outcome.plan.groups[group].name,
                state.steps,
            )
        self._publish_agreements(outcome)
        online_audit.record_stats(self, blocks, seconds, demoted=len(outcome.demoted))
        if self._counts_instance:
            self._tally.audit_step(demoted=outcome.demoted)
            if outcome.plan_changed:
                self._tally.plan(outcome.plan)
        if outcome.plan_changed:
            logger.info("kvpolicy plan after the audit:\n%s", format_plan_table(outcome.plan, audit=state.statuses))
        if outcome.plan_changed or outcome.agreed or outcome.unverified:
            self._write_plan_json()

    def _publish_demotions(self, outcome: StepOutcome) -> None:
        """Tell fresh instances of this instance's initial plan which groups this step demoted, so they
        start demoted (:meth:`_start_audit`). First among rank 0's side effects: nothing that may fail
        before it keeps the next instance from the fallback's objects."""
        state = self._audit
        if state is None or not outcome.demoted:
            return
        try:
            online_audit.write_demotions(
                self.store, state.initial_plan, outcome.demotions, pcp_rank=self.pcp_rank, pp_rank=self.pp_rank
            )
        except Exception:
            logger.exception("kvpolicy audit: could not publish the demotion; the next instance audits again")

    def _publish_agreements(self, outcome: StepOutcome) -> None:
        """Vouch for the groups this instance verified (so fresh instances may load them), and
        withdraw what a demotion disproved."""
        state = self._audit
        assert state is not None
        agreed = outcome.agreed
        if outcome.plan_changed:
            # New fingerprint, new marker keys: vouch again for everything still agreed.
            agreed = tuple(group for group, status in state.statuses.items() if status is AuditStatus.AGREED)
        try:
            if outcome.demoted:
                online_audit.revoke_agreements(
                    self.store, outcome.previous_plan, outcome.demoted, pcp_rank=self.pcp_rank, pp_rank=self.pp_rank
                )
            if agreed:
                online_audit.write_agreements(
                    self.store, outcome.plan, agreed, pcp_rank=self.pcp_rank, pp_rank=self.pp_rank
                )
        except Exception:
            logger.exception("kvpolicy audit: could not update the agreement markers")

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
        state = self._audit
        if state is not None and not self._capacity_only:
            try:
                is_open = self._gate.open(state, self.store)
            except Exception:
                logger.exception("kvpolicy audit: could not check the agreement markers; treating as a miss")
                is_open = False
            if not is_open:
                if not self._gate_logged:
                    self._gate_logged = True
                    logger.info(
                        "kvpolicy audit: lookups miss until the replication audit verifies groups %s "
                        "(no other instance of plan %s has vouched for them yet)",
                        ", ".join(map(str, state.untrusted_groups())) or "(other pp/pcp stages)",
                        state.plan.fingerprint,
                    )
                self._last_lookup_gated = True
                self._tally.lookup_gated()
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
