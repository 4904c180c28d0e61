"""The NCCL exchange's device handling between two processes, without a GPU: the exchange's transfers go
over gloo (host tensors), and the CUDA device API it enters and synchronizes is a stand-in that records
what a real one would do. Only torch and kvpolicy.device are imported, so that a spawned rank starts fast."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch


class FakeCudaDevices:
    """Stands in for the CUDA device API, which cannot exist on a CPU machine (``kvpolicy.device.guard``'s
    ``DeviceApi``): each thread's current device (0 until it enters one, as a fresh thread's is), the devices
    given a context (entering one creates it; leaving restores the previous device without creating one
    there, as ``torch.cuda.device`` does), and every call, with the calling thread's current device."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.contexts: set[int] = set()
        self.events: list[tuple[Any, ...]] = []

    def current(self) -> int:
        return getattr(self._local, "device", 0)

    @contextlib.contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        previous = self.current()
        self._local.device = device.index
        self.contexts.add(device.index)
        self.events.append(("enter", device.index))
        try:
            yield
        finally:
            self._local.device = previous
            self.events.append(("leave", previous))

    def synchronize(self, device: torch.device) -> None:
        self.events.append(("synchronize", device.index, self.current()))


def nccl_exchange_rank(rank: int, init_method: str, outcome: Any) -> None:
    """TP rank ``rank`` of two, its KV cache on ``cuda:<rank>``: one :class:`NcclExchange` call on a new
    thread (vLLM's receive thread never sets a device), its transfers over gloo; puts (rank, events,
    contexts, the thread's device after the call, the bytes received) on ``outcome``."""
    from kvpolicy.device.striped import NcclExchange, exchange_group

    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        devices = FakeCudaDevices()
        real_batch = torch.distributed.batch_isend_irecv

        def batch(operations: Any) -> Any:
            devices.events.append(("batch_isend_irecv", devices.current()))
            return real_batch(operations)

        torch.distributed.batch_isend_irecv = batch  # a spy: the real call runs
        group = exchange_group([0, 1], "gloo", timedelta(seconds=30))
        exchange = NcclExchange(group, [0, 1], torch.device("cuda", rank), devices)
        send = torch.full((16,), rank + 1, dtype=torch.uint8)
        receive = torch.zeros(16, dtype=torch.uint8)
        after: dict[str, int] = {}

        def receive_thread() -> None:
            exchange([(1 - rank, send)], [(1 - rank, receive)])
            after["device"] = devices.current()

        thread = threading.Thread(target=receive_thread)
        thread.start()
        thread.join(60)
        outcome.put((rank, devices.events, sorted(devices.contexts), after.get("device"), receive.tolist()))
        torch.distributed.barrier()
    except BaseException as error:
        outcome.put((rank, [f"{type(error).__name__}: {error}"], [], None, []))
        raise
    finally:
        torch.distributed.destroy_process_group()
