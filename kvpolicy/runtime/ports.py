"""The ports the run-time policy is written against: what it needs of the store, the collective over
the TP ranks and the clock. The vLLM adapter plugs in Mooncake's client, a gather over vLLM's TP
group and ``time.monotonic``; the pure tests an in-memory store, a list collective and a hand clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["Clock", "Gather", "KVStore", "ReadStore"]

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


class ReadStore(Protocol):
    """The store call a receive thread loads with (negative codes for keys it could not read)."""

    def batch_get_into_multi_buffers(self, keys: list[str], *args: Any) -> Sequence[int]: ...
