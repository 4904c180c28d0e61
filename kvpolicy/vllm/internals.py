"""kvpolicy's surface on vLLM's internals, declared as data, and the touches that go through it.

kvpolicy runs inside vLLM's Mooncake store connector, which offers no public extension API: the
worker overrides private methods, reads and writes private attributes, calls private helpers,
rebuilds ``__init__`` without the distributed runtime, and changes the class of a running thread.
:data:`SURFACE` lists every such name — module, name, kind, parameters — and :data:`REPEATED_INITS`
the upstream constructors kvpolicy repeats line for line. :func:`drift` compares both with the vLLM
that is installed; ``tests/connector/test_vllm_internals.py`` runs it under vLLM 0.32 and 0.33, so an
upgrade that renames, removes or re-signs one of them fails there, in one message naming each entry.

The touches themselves (binding a plan into upstream's attributes, decorating its threads, calling
its private helpers, reading its private state, the send thread's private hooks, the standalone
construction :func:`init_standalone` and the connector's worker role :func:`init_connector_worker_role`)
are the functions and classes below, and this is the only module of kvpolicy that reads, writes, calls
or overrides a private name of vLLM's (``tests/packaging/test_architecture.py`` scans for every private
name of :data:`SURFACE`). One exception, declared: ``KVPolicyStoreWorker`` in :mod:`kvpolicy.vllm.worker`
defines the override points upstream's ``MooncakeStoreWorker.__init__`` calls (the ``override`` entries of
``MooncakeStoreWorker`` below); they are what a subclass of upstream's worker is for, and they call
upstream's versions only through ``super()``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import queue
import textwrap
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvpolicy.runtime.binding import RankBinding, RankPlace
from kvpolicy.runtime.ports import KVStore, ReadStore, SendStore

if TYPE_CHECKING:
    from vllm.config import CacheConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ChunkedTokenDatabase
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

__all__ = [
    "REPEATED_INITS",
    "SURFACE",
    "Internal",
    "StoreCall",
    "RecvThread",
    "RepeatedInit",
    "SendThread",
    "StoreWorker",
    "adopt_class",
    "assignments_and_calls",
    "bind_plan",
    "capacity_only",
    "contiguous_blocks_for_hit",
    "counter_class",
    "decorate_recv_stores",
    "decorate_send_store",
    "drain",
    "drift",
    "fp8_dtype",
    "gauge_class",
    "hooked_sending_thread",
    "init_connector_worker_role",
    "init_standalone",
    "kv_cache_config",
    "kv_cache_groups",
    "layer_total_num_kv_heads",
    "lookup_key_prefixes",
    "make_mooncake_group_id",
    "place_of",
    "present_block",
    "record_operation",
    "replicate_config_supports_group_ids",
    "resolve",
    "set_lookup_key_prefixes",
    "tail_key_boundaries",
]

WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
DATA = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
DECODE_BENCH = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"
COORDINATOR = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator"
PROM = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
MANAGERS = "vllm.v1.core.single_type_kv_cache_manager"
MODEL_CONFIG = "vllm.config.model"
MODEL_ARCH = "vllm.config.model_arch"
MODEL_UTILS = "vllm.model_executor.models.utils"

Kind = Literal["override", "call", "attribute", "field", "constant"]


@dataclass(frozen=True)
class Internal:
    """One name of vLLM's that kvpolicy relies on."""

    module: str
    """The module that defines it."""
    name: str
    """Its name in the module (``Class.method`` for a method, ``Class.attribute`` for an instance attribute)."""
    kind: Kind
    """``override``: kvpolicy overrides it; ``call``: kvpolicy calls it; ``attribute``: an instance
    attribute upstream sets (``self.x = ...`` in the class) that kvpolicy reads or writes;
    ``field``: a dataclass field of the class that kvpolicy reads; ``constant``: a module-level value
    kvpolicy reads."""
    parameters: str | None
    """The parameters as ``inspect.signature`` renders them without annotations (None for attributes,
    fields and constants): an override must accept what upstream passes, a call must pass what it takes."""
    used_by: str
    """Where and why kvpolicy touches it."""


SURFACE: tuple[Internal, ...] = (
    # The store worker: the override points the plan answers and the methods around them.
    Internal(WORKER, "MooncakeStoreWorker.__init__", "call", "(self, vllm_config, kv_cache_config)",
             "worker: KVPolicyStoreWorker.__init__ runs it after setting what the override points read"),
    Internal(WORKER, "MooncakeStoreWorker._select_store_layout", "override", "(self, extra_config)",
             "worker: keeps the store namespace and sharding the plan is made for"),
    Internal(WORKER, "MooncakeStoreWorker._compute_group_tp_replication_factors", "override", "(self)",
             "worker: the plan's factors"),
    Internal(WORKER, "MooncakeStoreWorker._build_token_databases", "override", "(self, metadata, layout_cls)",
             "worker: the plan's key prefixes and shard ids"),
    Internal(WORKER, "MooncakeStoreWorker._init_lookup_key_prefixes", "override", "(self)",
             "worker: the plan's lookup prefixes"),
    Internal(WORKER, "MooncakeStoreWorker.register_kv_caches", "override", "(self, kv_caches)",
             "worker: binds the put schedule and decorates the transfer threads after upstream starts them"),
    Internal(WORKER, "MooncakeStoreWorker.wait_for_save", "override", "(self, metadata)",
             "worker: the replication audit runs before the save reaches the send thread"),
    Internal(WORKER, "MooncakeStoreWorker.get_kv_connector_stats", "override", "(self)",
             "worker: kvpolicy's counters beside upstream's telemetry"),
    Internal(WORKER, "MooncakeStoreWorker.lookup", "override", "(self, num_tokens, block_hashes)",
             "worker/lookup: the gate, read-failure masking, minimal probing"),
    Internal(WORKER, "MooncakeStoreWorker._record_kv_connector_operation", "call",
             "(self, operation, duration_seconds, num_keys, *, num_bytes=0, status='ok', num_failed_keys=0)",
             "record_operation: audit steps and lookups in vLLM's connector stats"),
    Internal(WORKER, "MooncakeStoreWorker._tail_key_boundaries", "call", "(self, block_hashes, hit_length, cached_block_pool)",
             "tail_key_boundaries (lookup): upstream's tail boundaries of a hit"),
    Internal(WORKER, "MooncakeStoreWorker._group_tp_replication_factors", "attribute", None,
             "bind_plan: the factors after a re-plan"),
    Internal(WORKER, "MooncakeStoreWorker._lookup_key_prefixes", "attribute", None,
             "bind_plan, lookup_key_prefixes, set_lookup_key_prefixes (worker, lookup): the lookup prefixes"),
    Internal(WORKER, "MooncakeStoreWorker._kv_cache_groups", "attribute", None,
             "kv_cache_groups (worker, lookup, audit): the groups' specs"),
    Internal(WORKER, "MooncakeStoreWorker._kv_cache_config", "attribute", None,
             "kv_cache_config (worker): the layout the plan is made of"),
    Internal(WORKER, "MooncakeStoreWorker._capacity_only", "attribute", None,
             "capacity_only (worker, lookup): a capacity-only instance transfers no KV"),
    Internal(WORKER, "MooncakeStoreWorker._mem_pool", "attribute", None, "standalone: no custom pool off CUDA"),
    Internal(WORKER, "MooncakeStoreWorker._is_hma_required", "attribute", None, "standalone"),
    Internal(WORKER, "MooncakeStoreWorker._supports_group_ids", "attribute", None, "standalone"),
    Internal(WORKER, "MooncakeStoreWorker._kv_connector_stats_lock", "attribute", None, "standalone"),
    Internal(WORKER, "_replicate_config_supports_group_ids", "call", "(replicate_config_cls, replicate_config)",
             "standalone: as upstream's __init__ decides group semantics"),
    Internal(WORKER, "_make_mooncake_group_id", "call", "(metadata, chunk_hash)",
             "send: the group ids of boundary puts riding on a chunk save"),
    Internal(WORKER, "MOONCAKE_NO_AVAILABLE_HANDLE", "constant", None, "send: store pressure on a failed boundary put"),
    # The send thread: hooked_sending_thread overrides and calls these for send's MergedSaveSendingThread.
    Internal(WORKER, "KVCacheStoreSendingThread._handle_request", "call", "(self, req_meta)",
             "hooked_sending_thread: the run loop calls it per job; the hooked class keeps it"),
    Internal(WORKER, "KVCacheStoreSendingThread._maybe_offload_boundary_states", "override", "(self, req_meta)",
             "hooked_sending_thread: offload_boundary_states (send: defers boundary puts to the chunk save)"),
    Internal(WORKER, "KVCacheStoreSendingThread.finish_store_job", "override", "(self, req_meta)",
             "send: settles boundary puts no chunk save carried"),
    Internal(WORKER, "KVCacheStoreSendingThread._record_operation", "override",
             "(self, operation, start_time, num_keys, *, num_bytes=0, status='ok', num_failed_keys=0)",
             "hooked_sending_thread: record_operation (send: counts the boundary keys that rode on a call)"),
    Internal(WORKER, "KVCacheStoreSendingThread.store", "attribute", None, "decorate_send_store"),
    Internal(WORKER, "KVCacheStoreSendingThread.tp_rank", "attribute", None, "bind_plan: the stripe rank"),
    Internal(WORKER, "KVCacheStoreSendingThread.group_put_steps", "attribute", None, "bind_plan: the put schedule"),
    Internal(WORKER, "KVCacheStoreSendingThread.group_participates", "attribute", None, "bind_plan: who puts a group"),
    Internal(WORKER, "KVCacheStoreRecvingThread.store", "attribute", None, "decorate_recv_stores"),
    Internal(WORKER, "MooncakeStoreWorker.kv_send_thread", "attribute", None, "worker: the thread to decorate"),
    Internal(WORKER, "MooncakeStoreWorker.kv_recv_threads", "attribute", None, "worker: the threads to decorate"),
    Internal(WORKER, "MooncakeStoreWorker.token_dbs", "attribute", None, "bind_plan: replaced in place"),
    Internal(WORKER, "KVCacheStoreSendingThread._boundary_puts", "call", "(self, req_meta)",
             "hooked_sending_thread: boundary_puts (send)"),
    Internal(WORKER, "KVCacheStoreSendingThread._mark_request_skipped_for_pressure", "call", "(self, req_meta)",
             "hooked_sending_thread: mark_request_skipped_for_pressure (send)"),
    # Token databases: re-built on a re-plan with the registered regions kept.
    Internal(DATA, "ChunkedTokenDatabase.set_kv_caches_base_addr", "call", "(self, kv_caches_base_addr)", "bind_plan"),
    Internal(DATA, "ChunkedTokenDatabase.set_block_len", "call", "(self, block_len)", "bind_plan"),
    Internal(DATA, "ChunkedTokenDatabase.prepare_value_for_block", "call", "(self, block_id)",
             "audit: the regions a block's put would write"),
    # The connector: the worker role is rebuilt to construct kvpolicy's worker.
    Internal(CONNECTOR, "MooncakeStoreConnector.__init__", "call", "(self, vllm_config, role, kv_cache_config=None)",
             "connector: the scheduler role runs it; REPEATED_INITS holds the worker role to it"),
    Internal(CONNECTOR, "MooncakeStoreConnector._validate_kv_cache_config", "call", "(vllm_config, kv_cache_config)",
             "init_connector_worker_role: the worker role validates as upstream does"),
    Internal(CONNECTOR, "MooncakeStoreConnector._kv_cache_events", "attribute", None,
             "init_connector_worker_role: the worker role sets it as upstream's __init__ does"),
    Internal(BASE, "KVConnectorBase_V1.__init__", "call", "(self, vllm_config, role, kv_cache_config)",
             "init_connector_worker_role: the worker role's base initialisation"),
    # The audit: vLLM's own answer to which fp8 type a uint8 KV cache holds.
    Internal(DECODE_BENCH, "_get_fp8_dtype", "call", "(spec, cache_dtype)", "fp8_dtype: the audit's value comparison"),
    # Prometheus: kvpolicy's series are made of the metric classes vLLM's multiprocess setup chose.
    Internal(PROM, "KVConnectorPromMetrics._gauge_cls", "attribute", None,
             "gauge_class (metrics): the group-info gauge"),
    Internal(PROM, "KVConnectorPromMetrics._counter_cls", "attribute", None,
             "counter_class (metrics): kvpolicy's counters"),
    # The lookup: vLLM's hit search over kvpolicy's probing block pool.
    Internal(COORDINATOR, "ExternalCachedBlockPool._present_block", "attribute", None,
             "present_block (lookup): the block a probing pool answers a hit with"),
    Internal(MANAGERS, "SlidingWindowManager._contiguous_blocks_for_hit", "call",
             "(window_size, block_size, use_eagle)",
             "contiguous_blocks_for_hit (lookup): the window a sliding-window group's search needs"),
    # Per-layer KV heads: the model's architecture config per layer, and vLLM's layer index of a layer name.
    Internal(MODEL_CONFIG, "ModelConfig.model_arch_config", "attribute", None,
             "layer_total_num_kv_heads (layout): the model's architecture config"),
    Internal(MODEL_ARCH, "ModelArchitectureConfig.__getitem__", "call", "(self, layer_idx)",
             "layer_total_num_kv_heads (layout): one layer's architecture config (per_layer_overrides applied)"),
    Internal(MODEL_ARCH, "ModelArchitectureConfig.total_num_kv_heads", "field", None,
             "layer_total_num_kv_heads (layout): a layer's KV heads over all TP ranks"),
    Internal(MODEL_UTILS, "extract_layer_index", "call", "(layer_name, num_attn_module=1)",
             "layer_total_num_kv_heads (layout): the layer index of a layer name, as vLLM's models compute it"),
)
"""Every private or internal name of vLLM's that kvpolicy relies on (public methods it overrides too)."""


@dataclass(frozen=True)
class RepeatedInit:
    """An upstream constructor kvpolicy repeats line for line (it cannot call it), held to every
    ``self.x =`` and ``self.f()`` of upstream's."""

    upstream: str
    """``module:Class.__init__`` of vLLM's."""
    ours: str
    """``module:function`` of kvpolicy's that repeats it."""
    receiver: str
    """What ``ours`` calls the instance (``self`` or ``worker``)."""
    replaced: tuple[tuple[str, str], ...] = ()
    """Upstream statements ``ours`` leaves out on purpose, each with the reason."""


REPEATED_INITS: tuple[RepeatedInit, ...] = (
    RepeatedInit(
        f"{WORKER}:MooncakeStoreWorker.__init__", "kvpolicy.vllm.internals:init_standalone", "worker",
        replaced=(("self._create_mem_pool()", "custom_mem_pool is CUDA-only; the standalone worker sets _mem_pool = None"),),
    ),
    RepeatedInit(
        f"{CONNECTOR}:MooncakeStoreConnector.__init__", "kvpolicy.vllm.internals:init_connector_worker_role",
        "connector",
    ),
)
"""Constructors kvpolicy rebuilds: the standalone worker (no distributed runtime, no segment mounted)
and the connector's worker role (builds kvpolicy's worker instead of upstream's)."""


# --- vLLM's objects, as kvpolicy sees them ----------------------------------------------------------


class SendThread(Protocol):
    """What kvpolicy reads and writes of vLLM's ``KVCacheStoreSendingThread``."""

    store: SendStore
    """Its store client (decorated by :func:`decorate_send_store`)."""
    tp_rank: int
    """The rank its put phase is computed from (the plan's stripe rank: :func:`bind_plan`)."""
    group_put_steps: Sequence[int]
    group_participates: Sequence[bool]
    request_queue: queue.Queue[Any]
    """Its jobs; joined to drain it."""


class RecvThread(Protocol):
    """What kvpolicy reads and writes of vLLM's ``KVCacheStoreRecvingThread``."""

    store: ReadStore
    """Its store client (decorated by :func:`decorate_recv_stores`)."""


class StoreWorker(Protocol):
    """What kvpolicy reads and writes of vLLM's ``MooncakeStoreWorker`` (its attributes as upstream's
    ``__init__`` and :func:`init_standalone` set them; the private ones only through this module)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    pcp_rank: int
    pcp_size: int
    dcp_rank: int
    dcp_size: int
    dp_rank: int
    store: KVStore
    """The worker's own store client (lookups, markers)."""
    cache_config: CacheConfig
    hash_block_size: int
    num_kv_head: int
    """The model's KV heads over all TP ranks."""
    can_put: bool
    coord: MooncakeStoreCoordinator
    token_dbs: list[ChunkedTokenDatabase]
    kv_send_thread: SendThread | None
    kv_recv_threads: list[RecvThread]
    recv_request_queue: queue.Queue[Any]
    disk_offload_buffer_budget_bytes: int | None
    _capacity_only: bool
    _kv_cache_config: KVCacheConfig
    _kv_cache_groups: Sequence[KVCacheGroupSpec]
    _lookup_key_prefixes: Sequence[Sequence[str]]
    _group_tp_replication_factors: tuple[int, ...]

    def _record_kv_connector_operation(
        self, operation: str, duration_seconds: float, num_keys: int, *, num_bytes: int = 0, status: str = "ok",
        num_failed_keys: int = 0,
    ) -> None: ...

    def _tail_key_boundaries(self, block_hashes: Sequence[BlockHash], hit_length: int, cached_block_pool: object) -> Any: ...


def place_of(worker: StoreWorker) -> RankPlace:
    """Where ``worker`` sits in the parallel groups, as upstream's ``__init__`` read it."""
    return RankPlace(
        tp_rank=worker.tp_rank, tp_size=worker.tp_size, pp_rank=worker.pp_rank, pp_size=worker.pp_size,
        pcp_rank=worker.pcp_rank, pcp_size=worker.pcp_size, dcp_rank=worker.dcp_rank, dcp_size=worker.dcp_size,
        dp_rank=worker.dp_rank,
    )


def drain(worker: StoreWorker) -> None:
    """Wait until the worker's send and receive threads have no job queued or running."""
    if worker.kv_send_thread is not None:
        worker.kv_send_thread.request_queue.join()
    worker.recv_request_queue.join()


# --- the drift check -------------------------------------------------------------------------------


def resolve(module: str, name: str) -> Any:
    """``module``'s ``name`` (dotted for a class member)."""
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def _parameters(function: Callable[..., Any]) -> str:
    signature = inspect.signature(function)
    bare = signature.replace(
        parameters=[parameter.replace(annotation=inspect.Parameter.empty) for parameter in signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return str(bare)


@functools.cache
def _assigned_by(cls: type) -> frozenset[str]:
    """Attributes ``cls`` itself assigns (``self.x = ...`` in its source)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return frozenset()
    return frozenset(item[len("self.") : -len(" =")] for item in assignments_and_calls_in(source, "self") if item.endswith(" ="))


def _sets_attribute(cls: type, attribute: str) -> bool:
    """``self.<attribute> =`` somewhere in ``cls`` or a base class of it."""
    return any(attribute in _assigned_by(klass) for klass in inspect.getmro(cls) if klass is not object)


def _entry_drift(entry: Internal) -> str | None:
    where = f"{entry.module}.{entry.name}"
    if entry.kind == "field":
        owner, _, field = entry.name.rpartition(".")
        try:
            cls = resolve(entry.module, owner)
        except (ImportError, AttributeError):
            return f"{where}: {owner} is gone"
        fields = {item.name for item in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        return None if field in fields else f"{where}: {owner} no longer has the field {field}"
    if entry.kind == "attribute":
        owner, _, attribute = entry.name.rpartition(".")
        try:
            cls = resolve(entry.module, owner)
        except (ImportError, AttributeError):
            return f"{where}: {owner} is gone"
        return None if _sets_attribute(cls, attribute) else f"{where}: upstream no longer sets self.{attribute}"
    try:
        found = resolve(entry.module, entry.name)
    except (ImportError, AttributeError):
        return f"{where}: is gone"
    if entry.parameters is None:
        return None
    if not callable(found):
        return f"{where}: is no longer callable"
    parameters = _parameters(found)
    if parameters != entry.parameters:
        return f"{where}: parameters were {entry.parameters}, are now {parameters} ({entry.used_by})"
    return None


def assignments_and_calls_in(source: str, receiver: str) -> set[str]:
    """``self.x =`` (tuple targets included) and ``self.f()`` in ``source``, spelled with ``self``
    whatever the receiver's name."""

    def attribute_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == receiver:
            return node.attr
        return None

    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [item for target in targets for item in (target.elts if isinstance(target, ast.Tuple) else [target])]
            found.update(f"self.{name} =" for name in map(attribute_of, flat) if name)
        elif isinstance(node, ast.Call) and (name := attribute_of(node.func)):
            found.add(f"self.{name}()")
    return found


def assignments_and_calls(function: Callable[..., object], receiver: str) -> set[str]:
    """:func:`assignments_and_calls_in` of ``function``'s source."""
    return assignments_and_calls_in(textwrap.dedent(inspect.getsource(function)), receiver)


def _repeated_drift(repeated: RepeatedInit) -> list[str]:
    module, _, name = repeated.upstream.partition(":")
    ours_module, _, ours_name = repeated.ours.partition(":")
    try:
        upstream = assignments_and_calls(resolve(module, name), "self")
    except (ImportError, AttributeError):
        return [f"{module}.{name}: is gone (repeated by {repeated.ours})"]
    ours = assignments_and_calls(resolve(ours_module, ours_name), repeated.receiver)
    replaced = {statement for statement, _ in repeated.replaced}
    missing = sorted(upstream - ours - replaced)
    stale = sorted(replaced - upstream)
    problems = [f"{module}.{name}: `{statement}` is not repeated by {repeated.ours}" for statement in missing]
    problems += [f"{module}.{name}: no longer has `{statement}` that {repeated.ours} replaces" for statement in stale]
    return problems


def drift(
    surface: Iterable[Internal] = SURFACE, repeated: Sequence[RepeatedInit] = REPEATED_INITS
) -> list[str]:
    """Every way the installed vLLM differs from the declared surface, one line each (empty: none)."""
    problems = [problem for entry in surface if (problem := _entry_drift(entry)) is not None]
    for constructor in repeated:
        problems.extend(_repeated_drift(constructor))
    return problems


# --- the standalone construction -------------------------------------------------------------------
#
# ``MooncakeStoreWorker.__init__`` reads its ranks off the parallel groups, mounts a Mooncake segment
# from ``MOONCAKE_CONFIG_PATH`` and starts a ZMQ lookup server on rank 0: none of that exists in one
# process that plays several ranks. :func:`init_standalone` sets the same attributes, in the same
# order, from values given to it, then calls the same override points (REPEATED_INITS holds it to
# upstream's ``__init__``).


def init_standalone(
    worker: StoreWorker,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    *,
    place: RankPlace,
    store: KVStore,
    model: str,
    total_num_kv_heads: int,
) -> None:
    """Set ``worker`` up as ``MooncakeStoreWorker.__init__`` does, with its ``place`` and ``store`` given.

    Differences, each because the part cannot exist here: ``store`` is used as given (no segment is
    mounted from a config file); there is no lookup server (call ``worker.lookup`` directly, as the
    server does on rank 0); no custom memory pool (CUDA-only); no disk-offload budget (no store
    config file to enable it); ``num_layers`` counts the KV-cache config's layers (no model config).
    """
    import vllm.envs as envs
    from mooncake.store import ReplicateConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import rdma_utils
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStoreConnectorStats
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from kvpolicy.language.keys import model_basename

    worker.dp_rank = place.dp_rank
    worker.tp_rank = place.tp_rank
    worker.tp_size = place.tp_size
    worker.pp_size = place.pp_size
    worker.pp_rank = place.pp_rank
    worker.pcp_size = place.pcp_size
    worker.pcp_rank = place.pcp_rank
    worker.dcp_size = place.dcp_size
    worker.dcp_rank = place.dcp_rank

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
    worker._supports_group_ids = replicate_config_supports_group_ids(ReplicateConfig, worker.store_replicate_config)
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


# --- the touches -----------------------------------------------------------------------------------


def adopt_class(instance: Any, cls: type) -> None:
    """Make ``instance`` (one of vLLM's, already running) an instance of ``cls``, a subclass of its class.

    Why not composition: upstream builds and starts its send thread inside ``register_kv_caches``
    (no factory or hook takes a class), and the thread's ``run`` loop calls ``self._handle_request``
    and, from there, ``self._maybe_offload_boundary_states`` / ``self._record_operation`` on the
    thread object itself; a wrapper object would never be called. Only the class of that object
    changes what those calls reach, so the swap stays, here, on a subclass that adds no slots.
    ``instance`` must be an instance of the vLLM class ``cls`` derives from (the first of vLLM's in
    its MRO: :func:`hooked_sending_thread`'s class sits between them)."""
    upstream = next((klass for klass in cls.__mro__ if klass.__module__.split(".")[0] == "vllm"), cls.__mro__[1])
    if not isinstance(instance, upstream):
        raise TypeError(f"expected an instance of {upstream.__name__}, got {type(instance).__name__}")
    instance.__class__ = cls


def bind_plan(worker: StoreWorker, binding: RankBinding, *, token_databases: list[ChunkedTokenDatabase] | None) -> None:
    """Write ``binding`` into upstream's attributes: the factors, the token databases (``token_databases``
    replace the worker's, keeping the regions registered in them; None keeps them), the lookup
    prefixes, and the send thread's stripe rank, put steps and participation. Call it while no save
    or load is in flight: the transfer threads read all of these per job."""
    worker._group_tp_replication_factors = binding.factors
    if token_databases is not None:
        for database, previous in zip(token_databases, worker.token_dbs, strict=True):
            database.set_kv_caches_base_addr(list(previous.kv_caches_base_addr))
            database.set_block_len(list(previous.block_len))
        # The same list object: the transfer threads hold it.
        worker.token_dbs[:] = token_databases
    worker._lookup_key_prefixes = binding.lookup_key_prefixes
    thread = worker.kv_send_thread
    if thread is not None:
        thread.tp_rank = binding.send_rank
        thread.group_put_steps = binding.put_steps
        thread.group_participates = list(binding.participates)


def decorate_send_store(worker: StoreWorker, wrap: Callable[[SendStore], SendStore]) -> None:
    """Replace the send thread's store client by ``wrap(client)`` (no thread: nothing)."""
    thread = worker.kv_send_thread
    if thread is not None:
        thread.store = wrap(thread.store)


def decorate_recv_stores(worker: StoreWorker, wrap: Callable[[ReadStore], ReadStore]) -> None:
    """Replace every receive thread's store client by ``wrap(client)``; the last decoration is outermost."""
    for thread in worker.kv_recv_threads:
        thread.store = wrap(thread.store)


@dataclass(frozen=True)
class StoreCall:
    """One Mooncake call as the send thread records it in vLLM's connector stats (the arguments of
    upstream's ``_record_operation``)."""

    operation: str
    """``save_exists``, ``save_put``, ..."""
    start_time: float
    """``time.perf_counter()`` when the call started."""
    num_keys: int
    num_bytes: int = 0
    status: str = "ok"
    """``ok``, ``partial_failure`` or ``error``."""
    num_failed_keys: int = 0


def record_operation(
    worker: StoreWorker, operation: str, seconds: float, num_keys: int, *, num_bytes: int = 0, status: str = "ok",
    num_failed_keys: int = 0,
) -> None:
    """One operation in vLLM's connector stats (upstream's private recorder)."""
    worker._record_kv_connector_operation(
        operation, seconds, num_keys, num_bytes=num_bytes, status=status, num_failed_keys=num_failed_keys
    )


def fp8_dtype(spec: Any, cache_dtype: str) -> Any:
    """vLLM's fp8 element type of a layer's ``uint8`` KV cache (``_get_fp8_dtype``), or None; None
    too should a release drop it (every ``uint8`` cache is then compared by exact digests)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import _get_fp8_dtype
    except ImportError:
        return None
    return _get_fp8_dtype(spec, cache_dtype)


def replicate_config_supports_group_ids(replicate_config_cls: type, replicate_config: Any) -> bool:
    """Upstream's test of whether Mooncake's ``ReplicateConfig`` takes group ids."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        _replicate_config_supports_group_ids,
    )

    return _replicate_config_supports_group_ids(replicate_config_cls, replicate_config)


def tail_key_boundaries(
    worker: StoreWorker, block_hashes: Sequence[BlockHash], hit_length: int, cached_block_pool: object
) -> Any:
    """Upstream's tail-key boundaries of a lookup hit (``_tail_key_boundaries``)."""
    return worker._tail_key_boundaries(block_hashes, hit_length, cached_block_pool)


def make_mooncake_group_id(metadata: Any, chunk_hash: str) -> str:
    """Upstream's Mooncake group id of a chunk."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import _make_mooncake_group_id

    return _make_mooncake_group_id(metadata, chunk_hash)


# --- upstream's private state, read and written ------------------------------------------------------


def capacity_only(worker: StoreWorker) -> bool:
    """The store worker transfers no KV (a consumer with lookups and decode saves off)."""
    return worker._capacity_only


def kv_cache_groups(worker: StoreWorker) -> Sequence[KVCacheGroupSpec]:
    """The store worker's KV-cache groups as its coordinator sees them (``.kv_cache_spec``, ``.layer_names``)."""
    return worker._kv_cache_groups


def kv_cache_config(worker: StoreWorker) -> KVCacheConfig:
    """The ``KVCacheConfig`` the store worker was built with."""
    return worker._kv_cache_config


def lookup_key_prefixes(worker: StoreWorker) -> Sequence[Sequence[str]]:
    """Per group, every namespace a lookup hit needs (what ``_init_lookup_key_prefixes`` set)."""
    return worker._lookup_key_prefixes


def set_lookup_key_prefixes(worker: StoreWorker, prefixes: Sequence[Sequence[str]]) -> None:
    """What the ``_init_lookup_key_prefixes`` override point sets: per group, the lookup namespaces."""
    worker._lookup_key_prefixes = prefixes


def layer_total_num_kv_heads(model_config: Any, layer_names: Iterable[str]) -> Mapping[str, int]:
    """Each of ``layer_names`` whose own KV heads (over all TP ranks) vLLM keeps per layer and which
    differ from the model-wide count, with that count: ``model_config.model_arch_config[index]
    .total_num_kv_heads``, the index read off the name with vLLM's ``extract_layer_index``.

    Empty for a model without per-layer values (vLLM then returns the model-wide config for every
    index) and without a model config (a simulated instance). A name vLLM cannot index (no number, or
    several) or an index past the model's layers keeps the model-wide count, as vLLM's store does for
    every layer."""
    arch_config = None if model_config is None else getattr(model_config, "model_arch_config", None)
    if arch_config is None:
        return {}
    from vllm.model_executor.models.utils import extract_layer_index

    model_wide = arch_config.total_num_kv_heads
    own: dict[str, int] = {}
    for name in layer_names:
        try:
            heads = arch_config[extract_layer_index(name)].total_num_kv_heads
        except (AssertionError, IndexError, ValueError):
            continue  # extract_layer_index asserts one integer; past the last layer there is no override
        if heads != model_wide:
            own[name] = heads
    return own


def present_block(pool: Any) -> Any:
    """The block an ``ExternalCachedBlockPool`` answers a hit with (one dummy block, set in its ``__init__``)."""
    return pool._present_block


def contiguous_blocks_for_hit(manager: type, window_size: int, block_size: int, use_eagle: bool) -> int:
    """Blocks a sliding-window manager's hit search needs in a row (upstream's classmethod)."""
    return manager._contiguous_blocks_for_hit(window_size, block_size, use_eagle)  # type: ignore[attr-defined]


def gauge_class(metrics: Any) -> Any:
    """The gauge class a ``KVConnectorPromMetrics`` was given (vLLM's, or a test's)."""
    return metrics._gauge_cls


def counter_class(metrics: Any) -> Any:
    """The counter class a ``KVConnectorPromMetrics`` was given (vLLM's, or a test's)."""
    return metrics._counter_cls


# --- the send thread's private hooks ---------------------------------------------------------------


@functools.cache
def hooked_sending_thread() -> type:
    """vLLM's ``KVCacheStoreSendingThread`` with its private hooks routed to public methods, the base
    of :class:`kvpolicy.vllm.send.MergedSaveSendingThread` (built on first call: this module imports
    no vLLM at import time).

    Hooks a subclass overrides (each defaults to upstream's behaviour): ``offload_boundary_states``
    (upstream's ``_maybe_offload_boundary_states``, called per job by ``_handle_request``) and
    ``record_operation`` (``_record_operation``, called per Mooncake call). Upstream's own versions stay
    reachable as ``upstream_offload_boundary_states`` / ``upstream_record_operation``, and its private
    helpers as ``boundary_puts`` / ``mark_request_skipped_for_pressure``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import KVCacheStoreSendingThread

    class HookedSendingThread(KVCacheStoreSendingThread):  # type: ignore[misc, valid-type]
        """vLLM's send thread whose private hooks call public methods (see :func:`hooked_sending_thread`)."""

        def _maybe_offload_boundary_states(self, req_meta: Any) -> bool:
            return self.offload_boundary_states(req_meta)

        def _record_operation(
            self,
            operation: str,
            start_time: float,
            num_keys: int,
            *,
            num_bytes: int = 0,
            status: str = "ok",
            num_failed_keys: int = 0,
        ) -> None:
            self.record_operation(StoreCall(operation, start_time, num_keys, num_bytes, status, num_failed_keys))

        def offload_boundary_states(self, req_meta: Any) -> bool:
            """A job's boundary puts (Mamba states, partial tails); upstream's: put them now."""
            return self.upstream_offload_boundary_states(req_meta)

        def upstream_offload_boundary_states(self, req_meta: Any) -> bool:
            """Upstream's ``_maybe_offload_boundary_states``: the boundary puts, now."""
            return KVCacheStoreSendingThread._maybe_offload_boundary_states(self, req_meta)

        def record_operation(self, call: StoreCall) -> None:
            """One Mooncake call in vLLM's connector stats; upstream's: record it as given."""
            self.upstream_record_operation(call)

        def upstream_record_operation(self, call: StoreCall) -> None:
            """Upstream's ``_record_operation``."""
            KVCacheStoreSendingThread._record_operation(
                self, call.operation, call.start_time, call.num_keys,
                num_bytes=call.num_bytes, status=call.status, num_failed_keys=call.num_failed_keys,
            )

        def boundary_puts(self, req_meta: Any) -> Any:
            """Upstream's ``_boundary_puts``: (key, addresses, sizes, key metadata) of a job's boundary puts."""
            return self._boundary_puts(req_meta)

        def mark_request_skipped_for_pressure(self, req_meta: Any) -> bool:
            """Upstream's ``_mark_request_skipped_for_pressure``: store pressure noted for the request."""
            return self._mark_request_skipped_for_pressure(req_meta)

    return HookedSendingThread


# --- the connector's worker role -------------------------------------------------------------------


def init_connector_worker_role(
    connector: Any, vllm_config: Any, role: Any, kv_cache_config: Any, build_worker: Callable[[], Any]
) -> None:
    """Set ``connector`` up as ``MooncakeStoreConnector.__init__`` does for the worker role, with
    ``build_worker()`` as its worker (REPEATED_INITS holds it to upstream's ``__init__``).

    Why not upstream's ``__init__``: it ends with ``MooncakeStoreWorker(vllm_config, kv_cache_config)``,
    a module-global name with no hook, and that constructor must not run: it mounts a Mooncake segment
    and binds rank 0's lookup socket. The alternatives were rebinding that global in vLLM's module around
    ``super().__init__`` (a process-wide monkeypatch that any other connector built concurrently would
    see) or this: repeat the few role-independent lines of that ``__init__``, in its order, and build
    kvpolicy's worker instead. The scheduler role still runs the upstream ``__init__`` unchanged."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    KVConnectorBase_V1.__init__(connector, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
    assert vllm_config.kv_transfer_config is not None
    connector.kv_role = vllm_config.kv_transfer_config.kv_role
    extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
    connector._capacity_only = (
        connector.kv_role == "kv_consumer"
        and not extra_config.get("enable_lookup", True)
        and not extra_config.get("save_decode_cache", False)
    )
    if not connector._capacity_only:
        connector._validate_kv_cache_config(vllm_config, kv_cache_config)
    connector._kv_cache_config = kv_cache_config
    connector._kv_cache_events = None
    connector.connector_scheduler = None
    connector.connector_worker = build_worker()
