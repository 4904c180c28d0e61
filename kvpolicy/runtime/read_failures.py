"""Chunks whose load just failed on this rank, which the next lookups report missing.

When a host holding store segments dies, the Mooncake master keeps listing its objects until the
host's lease lapses (the master's ``client_ttl``, 10 s by default). Under ``kv_load_failure_policy:
recompute`` vLLM then reschedules a request whose load failed, looks it up again, is told the same
objects exist, and fails to read them again: one request was seen to go round 11 times in 11 s.
:class:`ReadFailures` remembers the keys a load of this rank failed to read, for ``ttl_s`` seconds,
and the lookup reports them missing, so the next lookup stops short of them and vLLM computes those
blocks at once. Reporting a stored chunk missing costs a recompute at most; it never loads a byte.

Pure (no vLLM, torch or Mooncake): the clock is injected, the store is the :class:`~kvpolicy.runtime.ports.ReadStore`
port. Only TP rank 0 answers lookups, so what it knows is its own failed reads: every key of a replicated
group (all ranks read the same objects), and its own shard of a sharded one. A read that failed only
on another rank still goes round until the master forgets the object.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvpolicy.documents.settings import DEFAULT_READ_FAILURE_TTL_S
from kvpolicy.runtime.ports import Clock, ReadStore

__all__ = ["DEFAULT_LIMIT", "ReadFailures", "RecordingReadStore"]

DEFAULT_LIMIT = 65_536
"""Keys remembered at most (the oldest are forgotten first): bounded memory whatever fails."""


class ReadFailures:
    """Keys whose read failed in the last ``ttl_s`` seconds (thread-safe: receive threads record,
    the lookup server masks)."""

    def __init__(
        self, ttl_s: float = DEFAULT_READ_FAILURE_TTL_S, *, limit: int = DEFAULT_LIMIT, clock: Clock = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._limit = limit
        self._clock = clock
        self._failed: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self.masked = 0
        """Keys lookups were told are missing because their read had failed, so far."""

    def record(self, keys: Iterable[str]) -> None:
        """Remember that reading ``keys`` failed just now."""
        if self.ttl_s <= 0:
            return
        now = self._clock()
        with self._lock:
            for key in keys:
                self._failed[key] = now
                self._failed.move_to_end(key)
            while len(self._failed) > self._limit:
                self._failed.popitem(last=False)

    def mask(self, keys: Sequence[str], exists: Sequence[int]) -> list[int]:
        """``exists`` (``batch_is_exist`` codes for ``keys``) with every key whose read failed within
        ``ttl_s`` reported missing (0)."""
        answers = list(exists)
        if not self._failed:
            return answers
        with self._lock:
            self._forget_expired()
            hidden = [index for index, key in enumerate(keys) if answers[index] == 1 and key in self._failed]
            self.masked += len(hidden)
        for index in hidden:
            answers[index] = 0
        return answers

    def _forget_expired(self) -> None:
        oldest_kept = self._clock() - self.ttl_s
        while self._failed:
            key, when = next(iter(self._failed.items()))
            if when > oldest_kept:
                return
            del self._failed[key]

    def __len__(self) -> int:
        with self._lock:
            self._forget_expired()
            return len(self._failed)


class RecordingReadStore:
    """A receive thread's store client (a :class:`~kvpolicy.runtime.ports.ReadStore`) that records in
    ``failures`` every key a get did not read (a negative code, or every key of a get that raised)."""

    def __init__(self, store: ReadStore, failures: ReadFailures) -> None:
        self._store = store
        self._failures = failures

    @property
    def inner(self) -> ReadStore:
        """The client this wraps."""
        return self._store

    def batch_get_replica_desc(self, keys: list[str]) -> Any:
        return self._store.batch_get_replica_desc(keys)

    def batch_get_into_multi_buffers(self, keys: list[str], *args: Any) -> Sequence[int]:
        try:
            results = self._store.batch_get_into_multi_buffers(keys, *args)
        except Exception:
            self._failures.record(keys)
            raise
        self._failures.record(key for key, code in zip(keys, results, strict=False) if int(code) < 0)
        return results
