"""``load: striped`` in vLLM's worker: when striping can run, and the exchange over vLLM's TP group.
The striped store itself is :mod:`kvpolicy.device.striped` (torch only), its schedule
:mod:`kvpolicy.runtime.striping` (neither); :mod:`kvpolicy.vllm.stores` installs it.

Every TP rank must make the same exchanges in the same order: one series of pieces per
``batch_get_into_multi_buffers`` call, which holds while a rank has one receive thread and no
disk-offload staging budget (one get per request). :func:`striping_possible` says when it does not
hold; the worker then reads per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvpolicy.device.striped import gloo_exchange, nccl_exchange
from kvpolicy.runtime.ports import PeerExchange

__all__ = ["exchange_over_tp", "striping_possible"]

# vLLM's init_logger is logging.getLogger under the "vllm" logger it configures; this name keeps that.
logger = logging.getLogger(f"vllm.{__name__}")


def striping_possible(
    *, recv_threads: int, disk_offload_budget: int | None, kv_devices: Sequence[torch.device] = (),
    torchcomms: bool = False,
) -> str | None:
    """Why striped loads cannot run on this worker, or None: they need every rank to make the same
    exchanges per request, in the same order, over a process group of their own, staged on the one
    device of the KV caches (``kv_devices``: every device a registered KV tensor lies on)."""
    if recv_threads != 1:
        return f"VLLM_MOONCAKE_LOAD_RECV_THREADS is {recv_threads}: ranks would process loads in different orders"
    if disk_offload_budget is not None:
        return "a disk-offload buffer budget splits a load into a varying number of gets per rank"
    if len(kv_devices) > 1:
        return f"the KV caches lie on several devices ({', '.join(map(str, kv_devices))}), as with host-resident groups"
    if torchcomms:
        return (
            "TORCH_DISTRIBUTED_USE_TORCHCOMMS is on: a process group of the TP ranks alone cannot be made "
            "(TorchComms splits the world's group, which every rank must enter)"
        )
    return None


def exchange_over_tp(exchange: str = "gloo", *, device: torch.device, timeout_s: float = 120.0) -> PeerExchange:
    """The exchange on an engine (``kvpolicy_striped_exchange``: ``gloo`` or ``nccl``), over this
    rank's TP group as vLLM has it. Every TP rank calls this while registering its KV caches, on its
    main thread (where vLLM has made ``device``, the KV caches', current): the NCCL communicator is
    made there and then, not lazily on the receive thread that runs the loads."""
    from vllm.distributed.parallel_state import get_tp_group

    ranks = list(get_tp_group().ranks)
    if exchange == "nccl":
        world = torch.distributed.group.WORLD
        if getattr(world, "bound_device_id", None) is not None and len(ranks) < torch.distributed.get_world_size():
            # A device-bound world group (VLLM_DISTRIBUTED_USE_SPLIT_GROUP=1) makes torch split a new NCCL group
            # from the world's communicator, which every rank of the world must enter: TP ranks alone would hang.
            logger.warning(
                "kvpolicy: kvpolicy_striped_exchange: nccl runs over gloo here: the world's process group is bound "
                "to a device, so an NCCL group of the TP ranks alone would be split from the world's communicator, "
                "which every rank must enter"
            )
            return gloo_exchange(ranks, timeout_s)
        return nccl_exchange(ranks, device, timeout_s)
    return gloo_exchange(ranks, timeout_s)
