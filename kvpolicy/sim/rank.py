"""One simulated TP rank: the production worker, its KV tensors on the CPU, a recorded store client."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.v1.worker.utils import allocate_kv_cache

from kvpolicy.language.models import Policy
from kvpolicy.runtime.binding import RankPlace
from kvpolicy.runtime.ports import PeerExchange
from kvpolicy.sim.model import SimulatedModel
from kvpolicy.sim.store import RecordingStore
from kvpolicy.vllm.internals import init_standalone
from kvpolicy.vllm.worker import KVPolicyStoreWorker

if not torch.cuda.is_available():
    # MooncakeStoreWorker.wait_for_save records a torch.cuda.Event after the forward pass, which a
    # CPU build cannot construct. vLLM's CPU worker processes import this module first
    # (vllm/v1/worker/cpu_worker.py): it replaces torch.cuda.Event and streams with no-ops. The
    # simulated ranks are CPU workers, so they run under the same replacement.
    import vllm.v1.worker.cpu.shm  # noqa: F401

__all__ = ["Rank"]


@dataclass
class Rank:
    """A TP rank of a simulated instance.

    ``worker`` is a :class:`~kvpolicy.vllm.worker.KVPolicyStoreWorker` built by its
    :meth:`~kvpolicy.vllm.worker.KVPolicyStoreWorker.standalone` path — or, for a baseline, vLLM's
    own ``MooncakeStoreWorker`` built the same way — with vLLM's own KV tensors
    (``allocate_kv_cache``), its real ``register_kv_caches`` (which starts vLLM's send and receive
    threads), and one real Mooncake client behind a :class:`RecordingStore`.
    """

    tp_rank: int
    worker: MooncakeStoreWorker
    store: RecordingStore
    kv_caches: dict[str, Any]

    @classmethod
    def start(
        cls,
        model: SimulatedModel,
        policy: Policy | None,
        tp_rank: int,
        client: Any,
        *,
        gather: Callable[[Any], Sequence[Any]],
        exchange: PeerExchange | None = None,
    ) -> Rank:
        """Rank ``tp_rank`` of ``model`` under ``policy`` (None: vLLM's own rules), registered and running."""
        store = RecordingStore(client)
        dcp_size = model.dcp_size
        place = RankPlace(tp_rank=tp_rank, tp_size=model.tp_size, dcp_rank=tp_rank % dcp_size, dcp_size=dcp_size)
        worker: MooncakeStoreWorker
        if policy is None:
            worker = MooncakeStoreWorker.__new__(MooncakeStoreWorker)
            init_standalone(
                worker, model.vllm_config, model.kv_cache_config, place=place, store=store, model=model.name,
                total_num_kv_heads=model.total_num_kv_heads,
            )
        else:
            worker = KVPolicyStoreWorker.standalone(
                model.vllm_config, model.kv_cache_config, policy=policy, place=place, store=store, model=model.name,
                total_num_kv_heads=model.total_num_kv_heads, gather=gather, exchange=exchange,
            )
        layout = model.vllm_config.cache_config.get_resolved_kv_cache_layout()
        kv_caches = allocate_kv_cache(model.kv_cache_config, torch.device("cpu"), layout)
        worker.register_kv_caches(kv_caches)
        return cls(tp_rank, worker, store, kv_caches)

    @property
    def policy_worker(self) -> KVPolicyStoreWorker:
        """The worker as a :class:`KVPolicyStoreWorker` (an error on a baseline rank)."""
        if not isinstance(self.worker, KVPolicyStoreWorker):
            raise TypeError("this rank runs vLLM's own MooncakeStoreWorker, not kvpolicy's")
        return self.worker

    def transfer_threads(self) -> list[threading.Thread]:
        worker = self.worker
        return [thread for thread in (worker.kv_send_thread, *worker.kv_recv_threads) if thread is not None]

    def stop(self) -> None:
        """End the transfer threads and unregister the KV buffers; the client stays open (pooled)."""
        threads = self.transfer_threads()
        for thread in threads:
            _ignore_system_exit(thread)
            thread.request_queue.put(_StopThread())  # type: ignore[attr-defined]
        for thread in threads:
            thread.join(timeout=5.0)
        self.store.unregister_all()


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
