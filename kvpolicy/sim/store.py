"""A store client as a simulated rank's worker sees it: the real Mooncake client, with a record."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Put", "RecordingStore"]


@dataclass(frozen=True)
class Put:
    """One key a worker offered the store."""

    key: str
    size: int
    code: int
    """Mooncake's result: 0 or more on success, negative on failure."""
    batched: bool
    """Offered through ``batch_put_from_multi_buffers`` (KV chunks), not ``put`` (audit markers)."""

    @property
    def ok(self) -> bool:
        return self.code >= 0


class RecordingStore:
    """Forwards everything to a Mooncake client (or a wrapper of one, such as
    :class:`kvpolicy.mooncake.faults.FaultyStore`) and records the puts, and while :attr:`capturing`
    the batch calls' arguments, and the buffers it registered (so a pooled client can be returned
    clean). The master only counts totals; the record gives per-group writes."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.puts: list[Put] = []
        self.registered: list[int] = []
        self.capturing = False
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        """While capturing, every batch call in order: (method name, (keys, [addrs, sizes]))."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    @property
    def client(self) -> Any:
        """The client this records for."""
        return self._client

    def _capture(self, method: str, keys: list[str], *buffers: list[list[int]]) -> None:
        if self.capturing:
            with self._lock:
                self.calls.append((method, (list(keys), *([list(item) for item in buffer] for buffer in buffers))))

    def register_buffer(self, address: int, length: int) -> int:
        code = self._client.register_buffer(address, length)
        if code == 0:
            self.registered.append(address)
        return code

    def put(self, key: str, value: bytes, *args: Any) -> int:
        code = self._client.put(key, value, *args)
        with self._lock:
            self.puts.append(Put(key, len(value), int(code), batched=False))
        return code

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> Any:
        self._capture("batch_put_from_multi_buffers", keys, addrs, sizes)
        results = self._client.batch_put_from_multi_buffers(keys, addrs, sizes, *args)
        with self._lock:
            self.puts.extend(
                Put(key, sum(size), int(code), batched=True) for key, size, code in zip(keys, sizes, results, strict=True)
            )
        return results

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> Any:
        self._capture("batch_get_into_multi_buffers", keys, addrs, sizes)
        return self._client.batch_get_into_multi_buffers(keys, addrs, sizes, *args)

    def batch_is_exist(self, keys: list[str]) -> Any:
        self._capture("batch_is_exist", keys)
        return self._client.batch_is_exist(keys)

    def calls_of(self, method: str) -> list[tuple[Any, ...]]:
        """The captured arguments of every call of ``method``."""
        return [arguments for name, arguments in self.calls if name == method]

    def unregister_all(self) -> None:
        for address in self.registered:
            self._client.unregister_buffer(address)
        self.registered.clear()
