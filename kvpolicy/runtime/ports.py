"""Every port kvpolicy's run time is written against, declared in one place.

What the run-time policy needs of the store, the collective over the TP ranks and the clock; what
vLLM's transfer threads call on their store clients (and so what every wrapper around a client must
offer); the point-to-point exchange striped loads run over; what the audit's block reader needs of a
token database; and the device calls a striped load makes on a thread of vLLM's. The vLLM adapter
plugs in Mooncake's client, gathers and exchanges over vLLM's TP group, ``time.monotonic`` and torch's
devices; the pure tests an in-memory store, a list collective, threads and a hand clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

__all__ = [
    "Buffer",
    "Clock",
    "DeviceApi",
    "Gather",
    "KVStore",
    "PeerExchange",
    "ReadStore",
    "SendStore",
    "TokenDatabase",
    "Transfer",
]

Clock = Callable[[], float]
"""Seconds on a monotonic clock."""

Gather = Callable[[Any], Sequence[Any]]
"""``gather(payload)``: every TP rank's payload, indexed by TP rank. Every rank of the group must call
it, in the same place (``all_gather_object`` on an engine)."""


class KVStore(Protocol):
    """The Mooncake store calls the run-time policy makes (its markers; lookups' existence checks).

    Codes as Mooncake's: ``put`` and ``remove`` return 0 on success; ``batch_is_exist`` returns per key
    1 (present), 0 (absent) or a negative error code; ``get`` returns the object's bytes, empty when
    absent."""

    def put(self, key: str, value: bytes) -> int: ...

    def get(self, key: str) -> bytes: ...

    def remove(self, key: str, force: bool = ...) -> int: ...

    def batch_is_exist(self, keys: list[str]) -> Sequence[int]: ...


class SendStore(Protocol):
    """The store calls vLLM's send thread makes: an existence check and a batched put per save
    (negative codes for keys it could not put). Every wrapper of the send thread's client offers these."""

    def batch_is_exist(self, keys: list[str]) -> Sequence[int]: ...

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any = None
    ) -> Sequence[int]: ...


class ReadStore(Protocol):
    """The store calls a receive thread makes: the load (negative codes for keys it could not read)
    and, where ``VLLM_MOONCAKE_STORE_TIER_LOG`` is on, the replicas' descriptors of the keys loaded.
    Every wrapper of a receive thread's client offers these."""

    def batch_get_into_multi_buffers(self, keys: list[str], *args: Any) -> Sequence[int]: ...

    def batch_get_replica_desc(self, keys: list[str]) -> Any: ...


class Buffer(Protocol):
    """A flat, writable byte buffer of fixed length: a 1-D ``uint8`` tensor on an engine, a
    ``bytearray`` or ``memoryview`` in pure tests. ``buffer[:] = other`` copies ``other``'s bytes in."""

    def __len__(self) -> int: ...

    def __setitem__(self, index: slice, value: Any, /) -> None: ...


Transfer = tuple[int, Buffer]
"""(the TP rank at the other end, the buffer sent from or received into)."""


class PeerExchange(Protocol):
    """Point-to-point transfers among the TP ranks, one call per exchange on every rank involved.

    ``sends`` and ``receives`` pair a peer's TP rank with a buffer; between two ranks, the ``k``-th
    send of one to the other fills the ``k``-th receive the other lists from it, so both must list
    their transfers in the same order (the schedule does). Returns once every transfer is complete;
    raises on a timeout or a mismatch, after which the caller stops exchanging (see
    ``StripedReadStore.broken``): a transfer cut short may still land in a buffer of that call.
    """

    device_buffers: bool
    """True: hand it buffers on the KV cache's device (NCCL); False: host buffers (gloo, threads)."""

    def __call__(self, sends: Sequence[Transfer], receives: Sequence[Transfer]) -> None: ...


class TokenDatabase(Protocol):
    """What the audit's block reader needs of vLLM's ``ChunkedTokenDatabase``: the regions one block fills."""

    def prepare_value_for_block(self, block_id: int) -> tuple[Sequence[int], Sequence[int]]:
        """(addresses, sizes) of the block's regions, in the order the store writes them."""
        ...


DeviceT = TypeVar("DeviceT", contravariant=True)


class DeviceApi(Protocol[DeviceT]):
    """The device calls the striped-load path makes on a thread of vLLM's (``DeviceApi[torch.device]``
    in :mod:`kvpolicy.device.guard`; tests hand a stand-in where no CUDA device exists)."""

    def on(self, device: DeviceT) -> AbstractContextManager[object]:
        """Make ``device`` the thread's current device for the block; restore the previous one after."""
        ...

    def synchronize(self, device: DeviceT) -> None:
        """Wait for the work queued on ``device``'s current stream (nothing for a host device)."""
        ...
