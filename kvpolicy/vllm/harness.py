"""Multi-rank byte-consistency harness: does a policy load every rank's own bytes back?

One call simulates the TP ranks of a vLLM instance twice over, with the objects vLLM's Mooncake
store connector runs on its workers:

* the model: per-layer vLLM spec objects (``MLAAttentionSpec``, ``MambaSpec`` …) for an
  archetype at a TP size, grouped by vLLM's ``get_kv_cache_groups``, sized by
  ``get_kv_cache_config_from_groups`` and allocated per rank by ``allocate_kv_cache`` on the CPU —
  the same ``KVCacheConfig`` and KV tensors a model runner hands to the connector;
* per rank: a ``MooncakeStoreWorker`` whose plan-dependent parts come from
  :mod:`kvpolicy.vllm.store` (the code ``KVPolicyStoreWorker`` runs), its real
  ``MooncakeStoreCoordinator``, its real ``register_kv_caches`` (which starts vLLM's
  ``KVCacheStoreSendingThread`` and ``KVCacheStoreRecvingThread``), and one real Mooncake store
  client on 127.0.0.1;
* ground truth that ignores the policy: every archetype group has a *true* replication factor
  ``T`` (GQA ``max(1, tp // kv_heads)``, MLA ``tp``, Mamba / linear attention 1, a uniform group the
  gcd of its layers), and rank ``r`` holds, for a block, bytes that are a deterministic function
  of ``(seed, group, r // T, chunk hash)``.

A *cold* instance saves a prompt through its send threads; a *new warm* instance (other clients,
zeroed tensors) runs vLLM's own ``MooncakeStoreWorker.lookup`` on rank 0 and loads through its
receive threads. Then, on every rank and for every group, each block the load touched must equal
the cold bytes of that rank, and every block it did not touch must still be zero. Write traffic
is measured from the master's counters.

The engine's distributed runtime is not started: each worker is built with ``__new__`` and given
the attributes ``MooncakeStoreWorker.__init__`` would derive from the parallel groups and the
Mooncake config (see :func:`_rank_worker`). Everything after construction is vLLM's code.

Mooncake facts that shape this module (measured with mooncake-transfer-engine-non-cuda 0.3.13):
several store clients work in one process; ``close()`` takes 1–2 s per client and does not
parallelise; a client still open at interpreter exit, or closed after its master stopped, blocks
for 30–40 s. Hence :class:`ClientPool`: a test session lends clients to many runs and closes them
once, before the master stops.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import queue
import re
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    BoundaryPut,
    ChunkedTokenDatabase,
    KeyMetadata,
    LoadSpec,
    MooncakeLookupResult,
    MooncakeStoreConnectorMetadata,
    ReqMeta,
    RequestTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import MooncakeStoreConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    MooncakeStoreWorker,
    _replicate_config_supports_group_ids,
)
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1 import kv_cache_interface
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    hash_block_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_mamba_prefill_checkpoint_position,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvpolicy.audit import AuditState, AuditStatus, initial_statuses
from kvpolicy.engine import make_plan
from kvpolicy.keys import KeyContext
from kvpolicy.models import AuditMode, Layout, Policy, Topology
from kvpolicy.mooncake.client import MiB, ClientConfig, connect_store
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.metrics import MasterCounters, delta, read_metrics
from kvpolicy.plan import Plan
from kvpolicy.vllm import audit as online_audit
from kvpolicy.vllm import store as plan_store
from kvpolicy.vllm.layout import layout_from_kv_cache_config

__all__ = [
    "ARCHETYPES",
    "BLOCK_SIZE",
    "ClientPool",
    "GroupOutcome",
    "archetype_description",
    "HarnessReport",
    "archetype_from_layout",
    "run_consistency",
]

BLOCK_SIZE = 16
"""Tokens per KV block in every archetype."""

ARCHETYPES: tuple[str, ...] = (
    "gqa-kv-lt-tp",
    "mla",
    "kimi-linear",
    "gqa-mamba",
    "sliding-window-full",
    "uniform-mla-full",
)
"""Model shapes the harness can build, as KV-cache layouts of real vLLM spec objects."""

_LOAD_TIMEOUT_S = 60.0
_ALLOCATED_BYTES = "master_allocated_bytes"


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupOutcome:
    """What one cache group did under the policy, measured against the ground truth."""

    index: int
    """The group's index: its ``@group:`` number in store keys."""
    name: str
    factor: int
    """The policy's replication factor for the group."""
    true_factor: int
    """TP ranks that really hold identical bytes for the group (the archetype's ground truth)."""
    consistent: bool
    """Every rank loaded its own cold bytes into every block the load touched, and nothing else."""
    mismatched_ranks: tuple[int, ...]
    """TP ranks whose loaded bytes differ from their cold bytes (or that were written outside the
    load)."""
    objects_written: int
    """Distinct keys of this group the cold instance put."""
    bytes_written: int
    """Bytes of those objects."""
    unique_bytes: int
    """Bytes the written chunks hold once each distinct shard is counted once:
    ``tp // true_factor`` objects per chunk."""
    blocks_checked: int = 0
    """(rank, block) pairs compared after the load; 0 when nothing was loaded."""
    audit: str = "-"
    """The replication audit's status for the group after the cold instance's audited save (a
    :class:`kvpolicy.audit.AuditStatus` value: ``agreed``, ``demoted``, ``pending`` …); ``-`` for a
    group with factor 1, ``off`` when the run did not audit."""
    audit_message: str = ""
    """For a demoted group: the error the connector's rank 0 logs (group, rule ``file:line``, ranks)."""
    declared_factor: int = 0
    """The factor the policy declared, before any demotion (``factor`` is the one the run used)."""


@dataclass(frozen=True)
class HarnessReport:
    """One cold save and warm load of an archetype under a policy."""

    policy: str
    archetype: str
    tp_size: int
    hit_tokens: int
    """Prefix tokens the warm instance's lookup found (``MooncakeLookupResult.hit_length``)."""
    groups: tuple[GroupOutcome, ...]
    objects_written: int
    """Objects the cold save stored, from the master's ``master_batch_put_end_items_total``."""
    bytes_written: int
    """Bytes the cold save stored, from the master's ``master_allocated_bytes``."""
    unique_bytes: int
    """Sum of the groups' ``unique_bytes``."""
    num_tokens: int = 0
    """Prompt length."""
    load_failed_ranks: tuple[int, ...] = ()
    """Warm ranks whose receive thread reported the load as failed."""
    put_failures: int = 0
    """Keys whose put the store refused during the cold save."""
    audited: bool = False
    """The cold instance ran the replication audit on its save (see ``run_consistency(audit=)``)."""
    warm_gated: bool = False
    """The warm instance's lookup gate refused the store: a replicated group no audit had vouched for."""
    audit_stats: dict[str, float] = dataclasses.field(default_factory=dict)
    """The audit's entries (``kvpolicy_audit_*``) of cold rank 0's reduced connector stats."""

    @property
    def consistent(self) -> bool:
        """Every group consistent (vacuously true for groups nothing was loaded into)."""
        return all(group.consistent for group in self.groups)

    @property
    def write_amplification(self) -> float:
        """``bytes_written / unique_bytes``: 1.0 when each distinct byte was written once, below 1.0
        when the store holds fewer shards than exist (bytes were lost); NaN when nothing was written."""
        return self.bytes_written / self.unique_bytes if self.unique_bytes else math.nan

    def group(self, name_or_index: str | int) -> GroupOutcome:
        """The outcome of the group with this name or index."""
        for outcome in self.groups:
            if name_or_index in (outcome.name, outcome.index):
                return outcome
        raise KeyError(name_or_index)


# --- Mooncake clients ----------------------------------------------------------------------------


class ClientPool:
    """Mooncake store clients on one master, lent to harness runs and reused between them.

    A run leases ``2 * tp`` clients (one per cold rank, one per warm rank), so within a run the
    warm instance never reads through a client that wrote. Between runs the harness removes its
    objects and unregisters its tensors, so a reused client carries nothing over. :meth:`close`
    must run before the master stops (a client that outlives its master blocks ~30 s on close).
    """

    def __init__(self, master: MooncakeMaster, *, segment_mib: int = 16, buffer_mib: int = 4) -> None:
        # Mooncake refuses segments below 16 MiB.
        self._config = ClientConfig(
            master_server_address=master.rpc_address,
            global_segment_size=segment_mib * MiB,
            local_buffer_size=buffer_mib * MiB,
        )
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._all: list[Any] = []
        self._closed = False
        self.master = master

    @property
    def size(self) -> int:
        """Clients opened so far."""
        return len(self._all)

    def acquire(self, count: int) -> list[Any]:
        """``count`` clients no run is using; opens new ones when too few are idle."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the client pool is closed")
            taken, self._idle = self._idle[:count], self._idle[count:]
        try:
            while len(taken) < count:
                client = connect_store(self._config)
                with self._lock:
                    self._all.append(client)
                taken.append(client)
        except BaseException:
            self.release(taken)
            raise
        return taken

    def release(self, clients: Sequence[Any]) -> None:
        with self._lock:
            self._idle.extend(clients)

    def close(self) -> None:
        """Close every client (1–2 s each); objects in their segments disappear."""
        with self._lock:
            clients, self._all, self._idle, self._closed = self._all, [], [], True
        for client in clients:
            client.close()

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _RecordingStore:
    """A store client as the transfer threads see it, recording puts and registered buffers.

    Everything is forwarded to the real client; the records give per-group write counts (the
    master only counts totals) and let a pooled client be cleaned up after the run.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.puts: list[tuple[str, int, int]] = []
        """(key, bytes, result code) of every key offered to ``batch_put_from_multi_buffers``."""
        self.registered: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def register_buffer(self, address: int, length: int) -> int:
        code = self._client.register_buffer(address, length)
        if code == 0:
            self.registered.append(address)
        return code

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> Any:
        results = self._client.batch_put_from_multi_buffers(keys, addrs, sizes, *args)
        with self._lock:
            self.puts.extend(
                (key, sum(size), int(code)) for key, size, code in zip(keys, sizes, results, strict=True)
            )
        return results

    def unregister_all(self) -> None:
        for address in self.registered:
            self._client.unregister_buffer(address)
        self.registered.clear()


# --- archetypes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LayerKind:
    """One kind of layer of an archetype: how to build its per-rank spec, and its true factor."""

    build: Callable[[int], KVCacheSpec]
    """tp_size → the spec one TP rank's layer reports (``Attention.get_kv_cache_spec`` etc.)."""
    true_factor: Callable[[int], int]
    """tp_size → consecutive ranks holding identical bytes for this layer."""


@dataclass(frozen=True)
class _Archetype:
    description: str
    total_num_kv_heads: int | Callable[[int], int]
    layers: tuple[tuple[str, str], ...]
    """(layer name, kind) in model order."""
    kinds: dict[str, _LayerKind]

    def kv_heads(self, tp_size: int) -> int:
        heads = self.total_num_kv_heads
        return heads(tp_size) if callable(heads) else heads


_BF16 = torch.bfloat16


def _heads_per_rank(total: int, tp_size: int) -> int:
    # vLLM replicates KV heads when TP exceeds them (QKVParallelLinear).
    return max(1, total // tp_size)


def _gqa(total_heads: Callable[[int], int], *, head_size: int = 64, sliding_window: int | None = None) -> _LayerKind:
    def build(tp_size: int) -> KVCacheSpec:
        heads = _heads_per_rank(total_heads(tp_size), tp_size)
        if sliding_window is not None:
            return SlidingWindowSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=heads,
                head_size=head_size,
                dtype=_BF16,
                sliding_window=sliding_window,
            )
        return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=head_size, dtype=_BF16)

    return _LayerKind(build, lambda tp_size: max(1, tp_size // total_heads(tp_size)))


def _mla(kv_lora_rank: int = 64, rope_dim: int = 32) -> _LayerKind:
    # DeepSeek/Kimi MLA: one latent "head" of kv_lora_rank + rope dims, identical on every rank.
    return _LayerKind(
        lambda tp_size: MLAAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=kv_lora_rank + rope_dim, dtype=_BF16
        ),
        lambda tp_size: tp_size,
    )


def _kda(num_heads: int = 4, head_dim: int = 16, conv_kernel: int = 4) -> _LayerKind:
    # Kimi Delta Attention state, shaped like KimiGatedDeltaNetAttention.get_kv_cache_spec.
    return _LayerKind(
        lambda tp_size: MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=MambaStateShapeCalculator.kda_state_shape(
                tp_size, num_heads, head_dim, conv_kernel_size=conv_kernel
            ),
            dtypes=MambaStateDtypeCalculator.kda_state_dtype(_BF16, "auto"),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            mamba_cache_mode="align",
        ),
        lambda tp_size: 1,
    )


def _mamba2(
    intermediate: int = 128, n_groups: int = 2, num_heads: int = 4, head_dim: int = 32, state: int = 16
) -> _LayerKind:
    # Mamba2 SSM + conv state, shaped like MambaMixer2.get_kv_cache_spec.
    return _LayerKind(
        lambda tp_size: MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=MambaStateShapeCalculator.mamba2_state_shape(
                tp_size, intermediate, n_groups, num_heads, head_dim, state, 4
            ),
            dtypes=MambaStateDtypeCalculator.mamba2_state_dtype(_BF16, "auto", "auto"),
            mamba_type=MambaAttentionBackendEnum.MAMBA2,
            mamba_cache_mode="align",
        ),
        lambda tp_size: 1,
    )


def _attn(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def _mixer(index: int) -> str:
    return f"model.layers.{index}.mixer"


_ARCHETYPES: dict[str, _Archetype] = {
    "gqa-kv-lt-tp": _Archetype(
        "GQA with fewer KV heads than TP ranks (tp // 2 heads): pairs of ranks repeat a head",
        lambda tp_size: max(1, tp_size // 2),
        tuple((_attn(i), "attn") for i in range(2)),
        {"attn": _gqa(lambda tp_size: max(1, tp_size // 2))},
    ),
    "mla": _Archetype(
        "DeepSeek-style MLA: the latent cache is whole on every rank",
        1,
        tuple((_attn(i), "mla") for i in range(2)),
        {"mla": _mla()},
    ),
    "kimi-linear": _Archetype(
        "Kimi-Linear: MLA attention plus head-sharded KDA (linear-attention) state",
        1,
        ((_mixer(0), "kda"), (_attn(1), "mla"), (_mixer(2), "kda"), (_attn(3), "mla")),
        {"mla": _mla(), "kda": _kda()},
    ),
    "gqa-mamba": _Archetype(
        "hybrid of single-KV-head attention (replicated over TP) and head-sharded Mamba2 state",
        1,
        ((_mixer(0), "mamba"), (_attn(1), "attn"), (_mixer(2), "mamba"), (_attn(3), "attn")),
        {"attn": _gqa(lambda tp_size: 1), "mamba": _mamba2()},
    ),
    "sliding-window-full": _Archetype(
        "interleaved full and sliding-window (32 tokens) GQA layers with 2 KV heads",
        2,
        ((_attn(0), "full"), (_attn(1), "swa"), (_attn(2), "full"), (_attn(3), "swa")),
        {"full": _gqa(lambda tp_size: 2), "swa": _gqa(lambda tp_size: 2, sliding_window=32)},
    ),
    "uniform-mla-full": _Archetype(
        "MLA and 2-KV-head full-attention layers packed into one UniformTypeKVCacheSpecs group",
        2,
        ((_attn(0), "mla"), (_attn(1), "full"), (_attn(2), "mla"), (_attn(3), "full")),
        {"mla": _mla(), "full": _gqa(lambda tp_size: 2)},
    ),
}


@dataclass
class _Model:
    """An archetype at one TP size: vLLM's config objects for it, and its ground truth."""

    archetype: str
    name: str
    total_num_kv_heads: int
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    block_size: int
    """Scheduler block size (lcm of the groups')."""
    hash_block_size: int
    true_factors: tuple[int, ...]
    """Per prefix-cacheable group: gcd of its layers' true factors."""


def _build_model(archetype: str, tp_size: int, *, model_name: str, blocks_needed: int) -> _Model:
    try:
        shape = _ARCHETYPES[archetype]
    except KeyError:
        raise ValueError(f"unknown archetype {archetype!r}; known: {', '.join(ARCHETYPES)}") from None
    vllm_config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, mamba_cache_mode="align"),
        kv_transfer_config=KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both"),
    )
    specs = {layer: shape.kinds[kind].build(tp_size) for layer, kind in shape.layers}
    kind_of = dict(shape.layers)
    # The engine core resolves one layout from what the attention backends support; the harness has
    # no backends, so it takes vLLM's default preference (what undeclared backends get).
    resolve_kv_cache_layout(
        vllm_config, [[layout.name for layout in get_supported_kv_cache_layouts(())]], specs.values()
    )
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    bytes_per_block = sum(spec.page_size_bytes for spec in specs.values())
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, blocks_needed * bytes_per_block)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    true_factors = tuple(
        math.gcd(*(shape.kinds[kind_of[layer]].true_factor(tp_size) for layer in group.layer_names))
        for group in kv_cache_config.prefix_cacheable_groups
    )
    return _Model(
        archetype=archetype,
        name=model_name,
        total_num_kv_heads=shape.kv_heads(tp_size),
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        hash_block_size=hash_block_size,
        true_factors=true_factors,
    )


# --- one rank ------------------------------------------------------------------------------------


class _NoCudaEvent:
    """Stands in for the ``torch.cuda.Event`` ``MooncakeStoreWorker.wait_for_save`` records after the
    forward pass (CUDA-only; the CPU build cannot even construct one). The KV here is already in
    place, so there is nothing to wait for."""

    def synchronize(self) -> None:
        return None


class _StopThread:
    """Queued to a transfer thread to end it: its first attribute read raises ``SystemExit``, which
    the thread's ``except Exception`` lets through, so ``run()`` returns (vLLM's threads have no
    stop signal; a long test session would otherwise collect idle threads)."""

    def __getattr__(self, name: str) -> Any:
        raise SystemExit


def _ignore_system_exit(thread: threading.Thread) -> None:
    """Keep a thread's ``SystemExit`` away from ``threading.excepthook``.

    The default hook ignores it, but hooks that collect thread exceptions (pytest's) report it. CPython
    routes a thread's exception through its ``_invoke_excepthook``; other exceptions still go there.
    """
    invoke = getattr(thread, "_invoke_excepthook", None)
    if invoke is None:
        return

    def invoke_unless_exit(failed: threading.Thread) -> None:
        if not isinstance(sys.exc_info()[1], SystemExit):
            invoke(failed)

    thread._invoke_excepthook = invoke_unless_exit  # type: ignore[attr-defined]


def _rank_worker(
    model: _Model,
    plan: Plan,
    tp_rank: int,
    store: _RecordingStore,
) -> MooncakeStoreWorker:
    """A ``MooncakeStoreWorker`` for ``tp_rank``, without vLLM's distributed runtime.

    The attributes are the ones ``MooncakeStoreWorker.__init__`` sets, in its order, from what it
    would read off the parallel groups (``get_tensor_model_parallel_rank`` …), the model config and
    ``MooncakeStoreConfig``; the store is ``store`` instead of a client set up from a config file,
    and there is no lookup server (lookups are called directly). The three plan-dependent parts —
    replication factors, token databases, lookup prefixes — come from :mod:`kvpolicy.vllm.store`,
    as in ``KVPolicyStoreWorker``.
    """
    from mooncake.store import ReplicateConfig

    config = model.vllm_config
    kv_cache_config = model.kv_cache_config
    worker = MooncakeStoreWorker.__new__(MooncakeStoreWorker)
    worker.dp_rank = 0
    worker.tp_rank = tp_rank
    worker.tp_size = plan.topology.tp_size
    worker.pp_size, worker.pp_rank = 1, 0
    worker.pcp_size, worker.pcp_rank = 1, 0
    worker.dcp_size, worker.dcp_rank = 1, 0
    worker.kv_role = "kv_both"
    worker.can_put = True
    worker.load_async = True
    worker._capacity_only = False
    worker.cache_config = config.cache_config
    worker._is_hma_required = len(kv_cache_config.kv_cache_groups) > 1
    worker.block_size, worker.hash_block_size = model.block_size, model.hash_block_size
    worker.num_layers = sum(len(group.layer_names) for group in kv_cache_config.kv_cache_groups)
    worker.num_kv_head = model.total_num_kv_heads
    worker._mem_pool = None
    worker.store = store
    worker.preferred_segment = None
    worker.store_replicate_config = ReplicateConfig()
    worker.enable_group_semantics = False
    worker._supports_group_ids = _replicate_config_supports_group_ids(ReplicateConfig, worker.store_replicate_config)
    worker.disk_offload_buffer_budget_bytes = None
    worker.lookup_server = None
    worker.enable_kv_events = False
    worker.kv_send_thread = None
    worker.kv_recv_threads = []
    worker.num_recv_threads = 1
    worker.recv_request_queue = queue.Queue()
    worker.finished_store_req = set()
    worker._kv_connector_stats_lock = threading.Lock()
    worker.kv_connector_stats = MooncakeStoreConnectorStats()
    worker._kv_cache_config = kv_cache_config
    worker.token_dbs = []
    worker.coord = MooncakeStoreCoordinator.from_kv_cache_config(
        kv_cache_config, config, model.block_size, model.hash_block_size
    )
    worker._kv_cache_groups = worker.coord.kv_cache_groups
    worker.store_tp_size = None
    context = plan.key_context
    metadata = KeyMetadata(
        model_name=context.model,
        tp_rank=tp_rank,
        pcp_rank=0,
        dcp_rank=0,
        pp_rank=0,
        cache_prefix=context.cache_prefix,
        store_namespace=context.store_namespace,
    )
    groups = worker._kv_cache_groups
    worker._group_tp_replication_factors = plan.factors
    worker.token_dbs = plan_store.build_token_databases(
        plan,
        tp_rank=tp_rank,
        pcp_rank=0,
        pp_rank=0,
        block_sizes=[group.kv_cache_spec.block_size for group in groups],
        hash_block_sizes=[
            model.hash_block_size if group.kv_cache_spec.prefix_cacheable else group.kv_cache_spec.block_size
            for group in groups
        ],
        metadata=metadata,
    )
    worker._lookup_key_prefixes = plan_store.lookup_key_prefixes(plan)
    return worker


@dataclass
class _Rank:
    tp_rank: int
    worker: MooncakeStoreWorker
    store: _RecordingStore
    kv_caches: dict[str, Any]


def _layer_tensors(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _block_bytes(view: torch.Tensor, block_id: int) -> torch.Tensor:
    """The bytes of one block of a layer's KV view, as a uint8 view into the cache."""
    return view[block_id].view(torch.uint8)


def _start_rank(model: _Model, plan: Plan, tp_rank: int, client: Any) -> _Rank:
    store = _RecordingStore(client)
    worker = _rank_worker(model, plan, tp_rank, store)
    layout = model.vllm_config.cache_config.get_resolved_kv_cache_layout()
    kv_caches = allocate_kv_cache(model.kv_cache_config, torch.device("cpu"), layout)
    # vLLM's own registration: register_buffer per backing region, regions into every token
    # database, then the send thread and the receive threads start.
    worker.register_kv_caches(kv_caches)
    # As KVPolicyStoreWorker.register_kv_caches: upstream starts the send thread with put steps =
    # factors and every prefix-cacheable group participating; the plan's schedule replaces both.
    assert worker.kv_send_thread is not None
    worker.kv_send_thread.group_put_steps = plan_store.group_put_steps(plan)
    worker.kv_send_thread.group_participates = plan_store.group_participates(
        plan, tp_rank, [group.kv_cache_spec.prefix_cacheable for group in worker._kv_cache_groups]
    )
    return _Rank(tp_rank, worker, store, kv_caches)


def _stop_rank(rank: _Rank) -> None:
    worker = rank.worker
    threads = [thread for thread in (worker.kv_send_thread, *worker.kv_recv_threads) if thread is not None]
    for thread in threads:
        _ignore_system_exit(thread)
        thread.request_queue.put(_StopThread())
    for thread in threads:
        thread.join(timeout=5.0)
    rank.store.unregister_all()


# --- the request ---------------------------------------------------------------------------------


def _block_hashes(token_ids: Sequence[int], hash_block_size: int) -> list[BlockHash]:
    """``Request.block_hashes`` as vLLM's request block hasher computes them (sha256, no extra keys)."""
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        kv_cache_utils.init_none_hash(sha256)
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - hash_block_size + 1, hash_block_size):
        parent = hash_block_tokens(sha256, parent, token_ids[start : start + hash_block_size])
        hashes.append(parent)
    return hashes


def _chunk_hash(hashes: Sequence[BlockHash], chunk: int, block_size: int, hash_block_size: int) -> BlockHash | None:
    """The hash keying chunk ``chunk`` (its last sub-hash), or None for a partial chunk."""
    index = (chunk + 1) * block_size // hash_block_size - 1
    return hashes[index] if index < len(hashes) else None


def _mamba_boundaries(num_tokens: int, hash_block_size: int, block_size: int) -> list[int]:
    """Token boundaries whose Mamba state the engine core hands to the connector in align mode for a
    one-step prefill: the prefill checkpoint (where a later hit resumes, below the prompt end) and
    the prompt end when it is block-aligned. Each state lives in the block ending at it."""
    boundaries = [get_mamba_prefill_checkpoint_position(num_tokens, hash_block_size, False)]
    if num_tokens % block_size == 0:
        boundaries.append(num_tokens)
    return sorted({boundary for boundary in boundaries if boundary > 0})


def _block_tables(
    model: _Model, num_tokens: int, *, seed: int, salt: str, mamba_nulls: bool
) -> tuple[list[int], ...]:
    """The scheduler's block table per store group, shared by every rank of the instance.

    Block ids come from one pool for all groups (vLLM's hybrid allocator), shuffled per instance so
    cold and warm place a chunk in different blocks. With ``mamba_nulls`` a Mamba group holds real
    blocks only where a state is kept (:func:`_mamba_boundaries`), null elsewhere, as in align mode.
    """
    groups = model.kv_cache_config.prefix_cacheable_groups
    chunks = math.ceil(num_tokens / model.block_size)
    free = list(range(1, model.kv_cache_config.num_blocks))  # block 0 is the null block
    generator = torch.Generator().manual_seed(_seed_of(seed, salt))
    free = [free[i] for i in torch.randperm(len(free), generator=generator).tolist()]
    tables: list[list[int]] = []
    for index, group in enumerate(groups):
        table = free[index * chunks : (index + 1) * chunks]
        if mamba_nulls and isinstance(group.kv_cache_spec, MambaSpec):
            kept = {
                math.ceil(boundary / group.kv_cache_spec.block_size) - 1
                for boundary in _mamba_boundaries(num_tokens, model.hash_block_size, group.kv_cache_spec.block_size)
            }
            table = [block if chunk in kept else NULL_BLOCK_ID for chunk, block in enumerate(table)]
        tables.append(table)
    return tuple(tables)


def _seed_of(*parts: object) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _truth(seed: int, group: int, layer: str, shard: int, chunk_hash: BlockHash, size: int) -> torch.Tensor:
    """The bytes shard ``shard`` of ``group`` holds in ``layer`` for the chunk ``chunk_hash``."""
    digest = hashlib.blake2b(f"{seed}/{group}/{layer}/{shard}/".encode() + bytes(chunk_hash), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def _fill_cold(rank: _Rank, model: _Model, tables: Sequence[list[int]], hashes: Sequence[BlockHash], seed: int) -> None:
    """Write the ground truth into every block of the cold instance that holds a chunk."""
    tp_rank = rank.tp_rank
    for index, group in enumerate(model.kv_cache_config.prefix_cacheable_groups):
        shard = tp_rank // model.true_factors[index]
        block_size = group.kv_cache_spec.block_size
        for chunk, block_id in enumerate(tables[index]):
            chunk_hash = _chunk_hash(hashes, chunk, block_size, model.hash_block_size)
            if block_id == NULL_BLOCK_ID or chunk_hash is None:
                continue
            for layer in group.layer_names:
                for part, view in enumerate(_layer_tensors(rank.kv_caches[layer])):
                    target = _block_bytes(view, block_id)
                    source = _truth(seed, index, f"{layer}#{part}", shard, chunk_hash, target.numel())
                    target.copy_(source.view(target.shape))


def _save_meta(
    model: _Model,
    tables: tuple[list[int], ...],
    hashes: list[BlockHash],
    num_tokens: int,
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
        block_hashes=hashes,
        num_prompt_tokens=num_tokens,
        save_partial_tail=coord.enable_partial_hash_hits,
    )
    assert meta is not None and meta.can_save
    boundary_puts = [
        BoundaryPut(index, tables[index][math.ceil(boundary / group.kv_cache_spec.block_size) - 1], boundary)
        for index, group in enumerate(model.kv_cache_config.prefix_cacheable_groups)
        if index in coord.mamba_group_ids
        for boundary in _mamba_boundaries(num_tokens, model.hash_block_size, group.kv_cache_spec.block_size)
    ]
    meta.boundary_puts = boundary_puts or None
    meta.store_job_id = store_job_id
    metadata = MooncakeStoreConnectorMetadata(unfinished_request_ids={req_id}, preempted_req_ids=set())
    metadata.add_request(meta)
    return metadata


def _load_meta(
    model: _Model,
    tables: tuple[list[int], ...],
    hashes: list[BlockHash],
    num_tokens: int,
    req_id: str,
    lookup: Any,
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
        block_hashes=hashes,
        num_prompt_tokens=num_tokens,
    )
    assert meta is not None and meta.load_spec is not None
    metadata = MooncakeStoreConnectorMetadata(unfinished_request_ids={req_id}, preempted_req_ids=set())
    metadata.add_request(meta)
    return metadata


# --- the run -------------------------------------------------------------------------------------


def _counters(master: MooncakeMaster) -> tuple[MasterCounters, int]:
    metrics = read_metrics(master.metrics_url)
    return MasterCounters.from_metrics(metrics), int(metrics.get(_ALLOCATED_BYTES, 0))


def _group_of_key(plan: Plan) -> Callable[[str], int]:
    prefixes = {
        prefix: group.index for group in plan.groups for prefix in group.lookup_namespaces
    }

    def group_of(key: str) -> int:
        return prefixes[key.rsplit("@", 1)[0]]

    return group_of


def _object_size(db: ChunkedTokenDatabase) -> int:
    """Bytes of one stored chunk object of a group on one rank (one block of every region)."""
    return sum(db.prepare_value_for_block(1)[1])


def run_consistency(
    policy: Policy,
    archetype: str,
    tp_size: int,
    *,
    master: MooncakeMaster,
    num_tokens: int = 256,
    seed: int = 0,
    clients: ClientPool | None = None,
    save: bool = True,
    audit: bool | None = None,
) -> HarnessReport:
    """Save a ``num_tokens`` prompt from a cold ``tp_size``-rank instance of ``archetype`` under
    ``policy``, load it into a new warm instance, and compare every rank's bytes.

    ``clients`` lends the store clients (see :class:`ClientPool`); without it the run opens
    ``2 * tp_size`` fresh clients and closes them at the end (1–2 s each). ``save=False`` skips the
    cold save, so the warm lookup meets a store without this prompt.

    ``audit``: ``None`` follows the policy's ``audit`` mode, ``True`` audits even under ``off``
    (with ``warn``'s fallback), ``False`` never audits. The audit is the connector's
    (:mod:`kvpolicy.vllm.audit`): before the cold save, the ranks digest the blocks they are about
    to save, :class:`kvpolicy.audit.AuditState` judges the digests, a disagreeing group is demoted
    and every rank retargeted; ``enforce`` raises :class:`kvpolicy.audit.ReplicationAuditError`.
    An agreeing audit leaves its agreement markers (outside the measured writes). The warm
    instance runs the plan the audit produced and, as the connector does, passes its lookup
    through :class:`kvpolicy.vllm.audit.LookupGate`.
    """
    if archetype not in _ARCHETYPES:
        raise ValueError(f"unknown archetype {archetype!r}; known: {', '.join(ARCHETYPES)}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be positive, got {tp_size}")
    if num_tokens < BLOCK_SIZE:
        raise ValueError(f"num_tokens must be at least one block ({BLOCK_SIZE}), got {num_tokens}")
    own_pool = clients is None
    pool = ClientPool(master) if own_pool else clients
    assert pool is not None
    try:
        return _run(
            policy, archetype, tp_size, pool=pool, master=master, num_tokens=num_tokens, seed=seed, save=save,
            audit=audit,
        )
    finally:
        if own_pool:
            pool.close()


def _run(
    policy: Policy,
    archetype: str,
    tp_size: int,
    *,
    pool: ClientPool,
    master: MooncakeMaster,
    num_tokens: int,
    seed: int,
    save: bool,
    audit: bool | None = None,
) -> HarnessReport:
    # Every run gets its own key space, so runs sharing a master never see each other's objects.
    run_id = f"kvh{uuid.uuid4().hex[:12]}"
    in_prefix = "{cache_prefix}" in policy.key.template
    model_name = f"kvpolicy-harness/{archetype}" + ("" if in_prefix else f"-{run_id}")
    chunks = math.ceil(num_tokens / BLOCK_SIZE)
    shape_groups = len({kind for _, kind in _ARCHETYPES[archetype].layers})
    model = _build_model(archetype, tp_size, model_name=model_name, blocks_needed=1 + shape_groups * chunks)
    layout = layout_from_kv_cache_config(
        model.kv_cache_config, model=model.name, total_num_kv_heads=model.total_num_kv_heads
    )
    context = KeyContext.for_model(model.name, cache_prefix=run_id if in_prefix else "")
    plan = make_plan(policy, layout, Topology(tp_size=tp_size), key_context=context)
    declared = plan
    audit_state = _audit_state(policy, plan, layout, context, audit)

    generator = torch.Generator().manual_seed(_seed_of("tokens", seed))
    token_ids = torch.randint(0, 32_000, (num_tokens,), generator=generator).tolist()
    hashes = _block_hashes(token_ids, model.hash_block_size)
    req_id = f"{run_id}-req"

    leased = pool.acquire(2 * tp_size)
    cold: list[_Rank] = []
    warm: list[_Rank] = []
    try:
        cold = [_start_rank(model, plan, rank, client) for rank, client in enumerate(leased[:tp_size])]
        cold_tables = _block_tables(model, num_tokens, seed=seed, salt=f"{run_id}/cold", mamba_nulls=True)
        for rank in cold:
            _fill_cold(rank, model, cold_tables, hashes, seed)
        if audit_state is not None and save:
            # Before the measured window: the agreement markers are not the save's writes.
            plan = _audit_cold(audit_state, model, cold, cold_tables, hashes, num_tokens, req_id)

        before, allocated_before = _counters(master)
        if save:
            for rank in cold:
                # One store job, broadcast to every rank, as the scheduler's metadata is.
                metadata = _save_meta(model, cold_tables, hashes, num_tokens, req_id, 0, rank.worker.coord)
                # MooncakeStoreWorker.wait_for_save, minus the CUDA event it records.
                for request in metadata.requests:
                    request.current_event = _NoCudaEvent()  # type: ignore[assignment]
                    assert rank.worker.kv_send_thread is not None
                    rank.worker.kv_send_thread.add_request(request)
            for rank in cold:
                assert rank.worker.kv_send_thread is not None
                rank.worker.kv_send_thread.request_queue.join()
                completed = rank.worker.build_connector_worker_meta()
                if completed is None or 0 not in completed.completed_saves:
                    raise RuntimeError(f"cold rank {rank.tp_rank}: the send thread did not finish store job 0")
        after, allocated_after = _counters(master)
        written = delta(before, after)

        # A new instance: its own clients and zeroed KV tensors.
        warm = [_start_rank(model, plan, rank, client) for rank, client in enumerate(leased[tp_size:])]
        # vLLM's lookup (LookupKeyServer calls it on worker rank 0): every namespace of the plan's
        # lookup set must hold a chunk, then the coordinator takes the longest prefix all groups hit.
        warm_gated = False
        if audit_state is not None:
            # A fresh instance of the audited plan: its lookups pass the connector's gate
            # (KVPolicyStoreWorker.lookup), which needs the cold instance's agreement markers.
            fresh = AuditState(plan, replan=lambda demoted: plan, mode=audit_state.mode, steps=audit_state.steps)
            warm_gated = not online_audit.LookupGate().open(fresh, warm[0].store)
        lookup = MooncakeLookupResult(0) if warm_gated else warm[0].worker.lookup(num_tokens, hashes)
        hit_tokens = lookup.hit_length
        warm_tables = _block_tables(model, num_tokens, seed=seed, salt=f"{run_id}/warm", mamba_nulls=False)
        failed: list[int] = []
        masks: tuple[list[bool], ...] = tuple([] for _ in plan.groups)
        if hit_tokens > 0:
            masks = warm[0].worker.coord.load_mask(hashes, hit_tokens)
            loads = [_load_meta(model, warm_tables, hashes, num_tokens, req_id, copy.deepcopy(lookup)) for _ in warm]
            for rank, metadata in zip(warm, loads, strict=True):
                rank.worker.start_load_kv(metadata)
            for rank, metadata in zip(warm, loads, strict=True):
                rank.worker.recv_request_queue.join()
                results = rank.worker.get_transfer_results(set(), metadata)
                if req_id in results.failed_recving or rank.worker.get_block_ids_with_load_errors():
                    failed.append(rank.tp_rank)

        outcomes = _compare(model, plan, cold, warm, cold_tables, warm_tables, masks, hashes)
        writes = _writes_by_group(plan, cold)
        statuses = audit_state.statuses if audit_state is not None else initial_statuses(plan, mode=AuditMode.OFF)
        messages = {
            group: message
            for step in (audit_state.history if audit_state is not None else ())
            for group, message in zip(step.demoted, step.messages, strict=True)
        }
        groups = tuple(
            dataclasses.replace(
                outcome,
                audit=statuses[outcome.index].value,
                audit_message=messages.get(outcome.index, ""),
                declared_factor=declared.groups[outcome.index].factor,
                objects_written=len(writes[outcome.index]),
                bytes_written=sum(writes[outcome.index].values()),
                unique_bytes=(tp_size // outcome.true_factor)
                * len({key.rsplit("@", 1)[1] for key in writes[outcome.index]})
                * _object_size(cold[0].worker.token_dbs[outcome.index]),
            )
            for outcome in outcomes
        )
        return HarnessReport(
            policy=policy.name,
            archetype=archetype,
            tp_size=tp_size,
            hit_tokens=hit_tokens,
            groups=groups,
            objects_written=written.objects_written,
            bytes_written=allocated_after - allocated_before,
            unique_bytes=sum(group.unique_bytes for group in groups),
            num_tokens=num_tokens,
            load_failed_ranks=tuple(failed),
            put_failures=sum(1 for rank in cold for _, _, code in rank.store.puts if code < 0),
            audited=audit_state is not None and save,
            warm_gated=warm_gated,
            audit_stats={
                name: value
                for name, value in cold[0].worker.kv_connector_stats.reduce().items()
                if name.startswith(online_audit.AUDIT_STATS_OPERATION)
            },
        )
    finally:
        for rank in (*cold, *warm):
            _stop_rank(rank)
        if leased:
            leased[0].remove_by_regex(f".*{run_id}.*", True)
        pool.release(leased)


def _audit_state(
    policy: Policy, plan: Plan, layout: Layout, context: KeyContext, audit: bool | None
) -> AuditState | None:
    """The cold instance's audit, or None when the run does not audit (see ``run_consistency``)."""
    if audit is False:
        return None
    forced = audit is True and (policy.audit.mode is AuditMode.OFF or policy.audit.steps == 0)
    state = AuditState(
        plan,
        replan=lambda demoted: make_plan(policy, layout, plan.topology, key_context=context, demoted=demoted),
        mode=AuditMode.WARN if forced else None,
        steps=max(1, policy.audit.steps) if forced else None,
    )
    return None if state.mode is AuditMode.OFF else state


def _audit_cold(
    state: AuditState,
    model: _Model,
    cold: Sequence[_Rank],
    tables: tuple[list[int], ...],
    hashes: list[BlockHash],
    num_tokens: int,
    req_id: str,
) -> Plan:
    """The connector's audited step (``KVPolicyStoreWorker.wait_for_save``) on the simulated ranks:
    the same blocks, digests, value samples, verdicts, fallback and markers; the collectives are lists."""
    coord = cold[0].worker.coord
    metadata = _save_meta(model, tables, hashes, num_tokens, req_id, 0, coord)
    blocks = online_audit.blocks_to_audit(metadata, coord, state.groups_to_audit())
    if not blocks:
        return state.plan
    readers = [online_audit.BlockReader(rank.kv_caches) for rank in cold]
    layer_names = {index: group.layer_names for index, group in enumerate(cold[0].worker._kv_cache_groups)}
    outcome = online_audit.conclude_step(  # raises ReplicationAuditError under enforce
        state,
        lambda: [
            online_audit.encode_report(online_audit.local_digests(rank.worker.token_dbs, reader, blocks))
            for rank, reader in zip(cold, readers, strict=True)
        ],
        lambda groups: [
            online_audit.local_samples(rank.worker.token_dbs, reader, blocks, layer_names, groups)
            for rank, reader in zip(cold, readers, strict=True)
        ],
    )
    if outcome.plan_changed:
        for rank in cold:
            online_audit.retarget(rank.worker, outcome.plan)
    online_audit.record_stats(cold[0].worker, blocks, 0.0, demoted=len(outcome.demoted))
    agreed = [group for group, status in state.statuses.items() if status is AuditStatus.AGREED]
    online_audit.write_agreements(cold[0].store, outcome.plan, agreed)
    return outcome.plan


def _writes_by_group(plan: Plan, ranks: Sequence[_Rank]) -> list[dict[str, int]]:
    """Per group: each distinct key some rank put successfully → its bytes."""
    group_of = _group_of_key(plan)
    writes: list[dict[str, int]] = [{} for _ in plan.groups]
    for rank in ranks:
        for key, size, code in rank.store.puts:
            if code >= 0:
                writes[group_of(key)][key] = size
    return writes


def _compare(
    model: _Model,
    plan: Plan,
    cold: Sequence[_Rank],
    warm: Sequence[_Rank],
    cold_tables: Sequence[list[int]],
    warm_tables: Sequence[list[int]],
    masks: Sequence[list[bool]],
    hashes: Sequence[BlockHash],
) -> list[GroupOutcome]:
    outcomes: list[GroupOutcome] = []
    for index, group in enumerate(model.kv_cache_config.prefix_cacheable_groups):
        mask = masks[index]
        mismatched: set[int] = set()
        checked = 0
        for cold_rank, warm_rank in zip(cold, warm, strict=True):
            for chunk, warm_block in enumerate(warm_tables[index]):
                loaded = chunk < len(mask) and mask[chunk]
                cold_block = cold_tables[index][chunk]
                for layer in group.layer_names:
                    warm_views = _layer_tensors(warm_rank.kv_caches[layer])
                    cold_views = _layer_tensors(cold_rank.kv_caches[layer])
                    for warm_view, cold_view in zip(warm_views, cold_views, strict=True):
                        got = _block_bytes(warm_view, warm_block)
                        if loaded:
                            same = cold_block != NULL_BLOCK_ID and torch.equal(got, _block_bytes(cold_view, cold_block))
                        else:
                            same = not bool(got.any())
                        if not same:
                            mismatched.add(warm_rank.tp_rank)
                checked += loaded
        # The null block must stay untouched too: a load into it would be a load nowhere.
        for warm_rank in warm:
            for layer in group.layer_names:
                for view in _layer_tensors(warm_rank.kv_caches[layer]):
                    if _block_bytes(view, NULL_BLOCK_ID).any():
                        mismatched.add(warm_rank.tp_rank)
        group_plan = plan.groups[index]
        outcomes.append(
            GroupOutcome(
                index=index,
                name=group_plan.name,
                factor=group_plan.factor,
                true_factor=model.true_factors[index],
                consistent=not mismatched,
                mismatched_ranks=tuple(sorted(mismatched)),
                objects_written=0,
                bytes_written=0,
                unique_bytes=0,
                blocks_checked=checked,
            )
        )
    return outcomes


def archetype_description(archetype: str) -> str:
    """One line on what an archetype models."""
    try:
        return _ARCHETYPES[archetype].description
    except KeyError:
        raise ValueError(f"unknown archetype {archetype!r}; known: {', '.join(ARCHETYPES)}") from None


# --- archetypes from layout documents ------------------------------------------------------------

_MAMBA_DIM = 4
"""Largest state dimension a layout's Mamba spec keeps in :func:`archetype_from_layout`."""


def _spec_value(value: Any, default: Any) -> Any:
    """A layout field value (YAML: scalars, lists) as the spec dataclass wants it."""
    if isinstance(default, Enum):
        return type(default)(value)
    if isinstance(value, list):
        return tuple(_spec_value(item, None) for item in value)
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    return value


def _layout_layer_kind(spec: Any, *, head_size: int, num_kv_heads: int) -> Callable[[int], KVCacheSpec]:
    """tp_size → a per-rank spec of the layout's class, from its fields, at a scaled-down size."""
    cls = getattr(kv_cache_interface, spec.type, None)
    if not (isinstance(cls, type) and issubclass(cls, KVCacheSpec)):
        raise ValueError(f"{spec.type} is not a spec class of vllm.v1.kv_cache_interface")
    init = {field.name: field for field in dataclasses.fields(cls) if field.init}
    kwargs: dict[str, Any] = {}
    for name, value in spec.fields.items():
        if name in init:
            default = init[name].default
            kwargs[name] = _spec_value(value, None if default is dataclasses.MISSING else default)
    # Scaled down, by field rather than by class: the store moves bytes without reading them, so only
    # the class and the fields the policies read matter; vLLM pads the pages to one size when grouping.
    kwargs["block_size"] = BLOCK_SIZE
    kwargs.pop("page_size_padded", None)
    if "num_kv_heads" in kwargs:
        kwargs["num_kv_heads"] = num_kv_heads
    if "head_size" in kwargs:
        kwargs["head_size"] = head_size
    if kwargs.get("head_size_v"):
        kwargs["head_size_v"] = head_size
    if "shapes" in kwargs:
        kwargs["shapes"] = tuple(tuple(min(dim, _MAMBA_DIM) for dim in shape) for shape in kwargs["shapes"])
    built = cls(**kwargs)
    return lambda tp_size: built


def _layer_order(name: str) -> tuple[Any, ...]:
    # Model order: "model.layers.10" after "model.layers.9".
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def archetype_from_layout(
    layout: Layout,
    true_factors: Mapping[str, Callable[[int], int]],
    *,
    name: str | None = None,
    layers_per_group: int | None = None,
    head_size: int = 32,
    num_kv_heads: int = 1,
) -> str:
    """Make a kvpolicy ``Layout`` an archetype :func:`run_consistency` accepts; return its name.

    Each layer gets the layout's spec class, looked up by name in ``vllm.v1.kv_cache_interface``,
    built from the layout's fields, and scaled down: block size :data:`BLOCK_SIZE`, attention
    ``num_kv_heads`` and ``head_size`` (and a non-zero ``head_size_v``) as given here, Mamba state
    dimensions cut to 4, no page padding (vLLM's grouping pads pages to one size, as for the real
    model). Layers go in model order, so vLLM's ``get_kv_cache_groups`` regroups them itself;
    ``layers_per_group`` keeps only the first layers of each group (of each entry of a uniform
    group). ``true_factors`` maps each group name (``group-<index>`` when unnamed) to its ground
    truth, tp_size → TP ranks holding identical bytes, stated independently of any policy.

    The archetype is registered for this process under ``name`` (default ``layout-<model
    basename>``), replacing one of that name. vLLM pads a smaller page only for Mamba and non-MLA
    attention, so next to Mamba state an MLA page must stay the larger: ``head_size`` >= 16 does.
    """
    kinds: dict[str, _LayerKind] = {}
    layers: list[tuple[str, str]] = []
    for index, group in enumerate(layout.groups):
        group_name = group.name or f"group-{index}"
        if group_name not in true_factors:
            raise ValueError(f"no true factor for group {group_name!r} of {layout.model}")
        for member_index, member in enumerate(group.members):
            kind = group_name if len(group.members) == 1 else f"{group_name}#{member_index}"
            kinds[kind] = _LayerKind(
                _layout_layer_kind(member.spec, head_size=head_size, num_kv_heads=num_kv_heads),
                true_factors[group_name],
            )
            kept = member.layers if layers_per_group is None else member.layers[:layers_per_group]
            layers.extend((layer, kind) for layer in kept)
    archetype = name or f"layout-{layout.model.rstrip('/').split('/')[-1].lower()}"
    _ARCHETYPES[archetype] = _Archetype(
        layout.description or layout.model,
        layout.total_num_kv_heads,
        tuple(sorted(layers, key=lambda entry: _layer_order(entry[0]))),
        kinds,
    )
    return archetype
