"""One existence check and one batched put per store job: vLLM's send thread, with a job's boundary
puts riding on the Mooncake calls of its chunk save.

vLLM's ``KVCacheStoreSendingThread._handle_request`` saves a hybrid model's job in two rounds: first
the boundary puts (Mamba states and partial-tail blocks, ``_maybe_offload_boundary_states``: a
``batch_is_exist`` and a ``batch_put_from_multi_buffers``), then the chunks (another exists check and
another put). Each Mooncake call has a fixed cost (an RPC to the master, a transfer setup), so a
hybrid job pays it twice. :class:`MergedSaveSendingThread` keeps upstream's ``_handle_request``
unchanged and defers the boundary puts instead: they are prepended to the chunk save's own exists
check and put (:class:`_RidingStore`), and the results are split back, so upstream's code sees
exactly the answers it would have seen for its own keys.

Where the chunk save makes no call (nothing to save, every chunk already stored, an error first), the
deferred puts go out through upstream's own boundary path when the job finishes
(:meth:`MergedSaveSendingThread.finish_store_job`), before the scheduler may release their blocks.

One difference from upstream is deliberate: upstream skips a job's chunk save when its boundary puts
failed, and retries those chunks with the next job; merged, both went out in one call, so the chunks
that succeeded are stored and not offered again. That only ever stores more correct objects (a hit
needs the boundary state as well, which failed either way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as upstream
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ReqMeta
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import KVCacheStoreSendingThread
from vllm.logger import init_logger

from kvpolicy.language.keys import split_chunk_key
from kvpolicy.runtime.ports import SendStore
from kvpolicy.vllm import internals
from kvpolicy.vllm.internals import StoreCall

logger = init_logger(f"vllm.{__name__}")

__all__ = ["MergedSaveSendingThread"]


@dataclasses.dataclass
class _BoundaryBatch:
    """The boundary puts of the job in flight on the send thread (mutable: it is settled in steps,
    and only the send thread touches it)."""

    req_meta: ReqMeta
    keys: list[str]
    addrs: list[list[int]]
    sizes: list[list[int]]
    group_ids: list[str] | None
    """Mooncake group ids, where upstream would send them (group semantics on)."""
    exists: list[int] | None = None
    """Existence codes, once they rode on the chunk save's check."""
    settled: bool = False
    """Put (or found stored) through a chunk save's calls: nothing left for the end of the job."""
    unrecorded_exists: int = 0
    """Keys of this batch in the last exists check, not yet in vLLM's operation record."""
    unrecorded_put: tuple[int, int, int] | None = None
    """(keys, bytes, failed keys) of this batch in the last put, not yet in vLLM's operation record."""

    def missing(self) -> list[int]:
        assert self.exists is not None
        return [index for index, code in enumerate(self.exists) if code != 1]


class _RidingStore:
    """The send thread's store client (a :class:`~kvpolicy.runtime.ports.SendStore`), with the pending
    boundary batch prepended to the next exists check and put that upstream's chunk save makes."""

    def __init__(self, store: SendStore, thread: MergedSaveSendingThread) -> None:
        self._store = store
        self._thread = thread

    @property
    def inner(self) -> SendStore:
        """The client this wraps."""
        return self._store

    def batch_is_exist(self, keys: list[str]) -> Sequence[int]:
        batch = self._thread.pending_boundary_batch
        if batch is None or batch.exists is not None:
            return self._store.batch_is_exist(keys)
        results = list(self._store.batch_is_exist([*batch.keys, *keys]))
        count = len(batch.keys)
        batch.exists = results[:count]
        batch.unrecorded_exists = count
        if not batch.missing():
            batch.settled = True  # every boundary object is stored already
        return results[count:]

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any = None
    ) -> Sequence[int]:
        batch = self._thread.pending_boundary_batch
        if batch is None or batch.settled or batch.exists is None:
            return self._store.batch_put_from_multi_buffers(keys, addrs, sizes, config)
        # Upstream fenced this step's CUDA event before its put; the boundary blocks are fenced by the
        # same event (one event per step, recorded before any job of the step is queued).
        chunk_keys = set(keys)
        riding = [index for index in batch.missing() if batch.keys[index] not in chunk_keys]
        batch.settled = True
        if not riding:
            return self._store.batch_put_from_multi_buffers(keys, addrs, sizes, config)
        own_group_ids = None if batch.group_ids is None else [batch.group_ids[index] for index in riding]
        if own_group_ids is not None and config is not None and getattr(config, "group_ids", None) is not None:
            config.group_ids = [*own_group_ids, *config.group_ids]
        own_sizes = [batch.sizes[index] for index in riding]
        # Counted as failed unless the call returns (upstream records a raising put as all failed).
        batch.unrecorded_put = (len(riding), sum(map(sum, own_sizes)), len(riding))
        try:
            results = list(
                self._store.batch_put_from_multi_buffers(
                    [batch.keys[index] for index in riding] + list(keys),
                    [batch.addrs[index] for index in riding] + list(addrs),
                    own_sizes + list(sizes),
                    config,
                )
            )
        except Exception:
            logger.error(
                "Failed to put %d boundary-state keys of request %s with its chunks",
                len(riding), batch.req_meta.req_id,
            )
            raise
        own = results[: len(riding)]
        failed = [code for code in own if code < 0]
        batch.unrecorded_put = (len(riding), batch.unrecorded_put[1], len(failed))
        if failed:
            self._thread.boundary_puts_failed(batch.req_meta, len(failed), len(riding), set(failed))
        return results[len(riding) :]


class MergedSaveSendingThread(internals.hooked_sending_thread()):  # type: ignore[misc]
    """vLLM's send thread whose boundary puts ride on the chunk save's exists check and put.

    Installed on a running thread by :meth:`adopt` (upstream builds and starts its thread inside
    ``register_kv_caches``, with no hook for the class); the thread's ``run`` loop looks its methods
    up per job, so the next job already takes this path. Upstream's private hooks reach the public
    methods below through :func:`kvpolicy.vllm.internals.hooked_sending_thread`.
    """

    pending_boundary_batch: _BoundaryBatch | None = None
    """The boundary puts of the job being handled, until they are settled."""

    @classmethod
    def adopt(cls, thread: KVCacheStoreSendingThread) -> MergedSaveSendingThread:
        """Make ``thread`` (vLLM's, already running, idle: no job was queued yet) merge its saves.
        Its ``store`` becomes the riding view of the store it had."""
        if not isinstance(thread, KVCacheStoreSendingThread):
            raise TypeError(f"expected vLLM's KVCacheStoreSendingThread, got {type(thread).__name__}")
        internals.adopt_class(thread, cls)
        assert isinstance(thread, MergedSaveSendingThread)
        thread.pending_boundary_batch = None
        thread.store = _RidingStore(thread.store, thread)
        return thread

    def offload_boundary_states(self, req_meta: ReqMeta) -> bool:
        """Defer this job's boundary puts to its chunk save's calls (upstream: put them now)."""
        if not req_meta.boundary_puts or not req_meta.block_hashes:
            return True
        puts = self.boundary_puts(req_meta)
        if not puts:
            return True
        group_ids = (
            [internals.make_mooncake_group_id(metadata, split_chunk_key(key)[1]) for key, _, _, metadata in puts]
            if self.enable_group_semantics and self.supports_group_ids
            else None
        )
        self.pending_boundary_batch = _BoundaryBatch(
            req_meta,
            keys=[key for key, _, _, _ in puts],
            addrs=[list(addr) for _, addr, _, _ in puts],
            sizes=[list(size) for _, _, size, _ in puts],
            group_ids=group_ids,
        )
        return True

    def finish_store_job(self, req_meta: ReqMeta) -> None:
        """Settle boundary puts no chunk-save call carried, through upstream's own boundary path,
        before upstream reports the job done (which lets the scheduler release its blocks)."""
        batch, self.pending_boundary_batch = self.pending_boundary_batch, None
        if batch is not None and batch.req_meta is req_meta and not batch.settled:
            try:
                self.upstream_offload_boundary_states(req_meta)
            except Exception:
                logger.exception("Failed to offload the boundary states of request %s", req_meta.req_id)
        super().finish_store_job(req_meta)

    def boundary_puts_failed(self, req_meta: ReqMeta, failed: int, total: int, codes: set[int]) -> None:
        """Upstream's reaction to failed boundary puts: a warning, and store pressure noted."""
        logger.warning(
            "Boundary-state put failed for request %s: %d/%d keys failed (codes=%s)",
            req_meta.req_id, failed, total, codes,
        )
        if upstream.MOONCAKE_NO_AVAILABLE_HANDLE in codes:
            self.mark_request_skipped_for_pressure(req_meta)

    def record_operation(self, call: StoreCall) -> None:
        """Upstream's record of a call, counting the boundary keys that rode on it (vLLM's
        ``save_exists`` / ``save_put`` telemetry then covers every key a job offered, as upstream's
        two rounds do)."""
        batch = self.pending_boundary_batch
        if batch is not None and call.operation == "save_exists" and batch.unrecorded_exists:
            riding = batch.unrecorded_exists
            call = dataclasses.replace(
                call, num_keys=call.num_keys + riding,
                num_failed_keys=call.num_failed_keys + (riding if call.status == "error" else 0),
            )
            batch.unrecorded_exists = 0
        elif batch is not None and call.operation == "save_put" and batch.unrecorded_put is not None:
            keys, size, failed = batch.unrecorded_put
            call = dataclasses.replace(
                call, num_keys=call.num_keys + keys, num_bytes=call.num_bytes + size,
                num_failed_keys=call.num_failed_keys + failed,
                status="partial_failure" if failed and call.status == "ok" else call.status,
            )
            batch.unrecorded_put = None
        self.upstream_record_operation(call)

