"""Which device a thread's CUDA calls go to, made explicit for the threads vLLM starts.

vLLM's receive thread never calls ``set_device``: its current device is 0 on every rank. A call that
takes the current device (``torch.cuda.current_stream()``, an NCCL ``batch_isend_irecv``, pinned
allocations) would then reach GPU 0 from every rank, create a CUDA context there outside vLLM's memory
budget, or wait on the wrong stream. What kvpolicy runs on such a thread enters the KV cache's device
first and leaves it as it found it (:meth:`~kvpolicy.runtime.ports.DeviceApi.on`), and synchronizes
that device's stream by name (:meth:`~kvpolicy.runtime.ports.DeviceApi.synchronize`).

:data:`TORCH_DEVICES` is torch's: ``torch.cuda.device`` enters a device and, on leaving, restores the
previous one only where that device already has a context (so leaving never creates one on GPU 0).
Tests hand a stand-in, since no CUDA device exists on a CPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvpolicy.runtime.ports import DeviceApi

__all__ = ["TORCH_DEVICES", "TorchDevices"]


class TorchDevices:
    """:class:`~kvpolicy.runtime.ports.DeviceApi` through torch: CUDA devices are entered, others are left alone."""

    def on(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if device.type != "cuda":
            return contextlib.nullcontext()
        return _entered(device)

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


@contextlib.contextmanager
def _entered(device: torch.device) -> Iterator[None]:
    # torch.cuda.device restores the previous device on exit only where it has a context already.
    with torch.cuda.device(device):
        yield


TORCH_DEVICES: DeviceApi[torch.device] = TorchDevices()
"""The device API the product runs with."""
