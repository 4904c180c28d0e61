"""The TP group's collective for ranks that are threads of one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CollectiveTimeout", "ThreadGather"]


class CollectiveTimeout(RuntimeError):
    """A rank waited too long for the others: on an engine, this is a hang."""


class ThreadGather:
    """``all_gather_object`` among ``size`` threads: each rank calls its :meth:`member` with its payload
    and gets every rank's, indexed by rank, once all have called. A rank that waits longer than
    ``timeout`` seconds raises :class:`CollectiveTimeout` (and so does every rank waiting with it):
    the simulation's form of the hang a real TP group would suffer when ranks disagree on whether
    to gather."""

    def __init__(self, size: int, *, timeout: float = 60.0) -> None:
        self.size = size
        self.timeout = timeout
        self._slots: list[Any] = [None] * size
        self._arrived = threading.Barrier(size)
        self._read = threading.Barrier(size)
        self.rounds = 0
        """Completed gathers."""

    def member(self, rank: int) -> Callable[[Any], list[Any]]:
        """Rank ``rank``'s gather function (what the worker's ``gather`` parameter takes)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a group of {self.size}")

        def gather(payload: Any) -> list[Any]:
            self._slots[rank] = payload
            self._wait(self._arrived, rank)
            result = list(self._slots)
            if self._wait(self._read, rank) == 0:
                self.rounds += 1
            return result

        return gather

    def _wait(self, barrier: threading.Barrier, rank: int) -> int:
        if barrier.broken:
            # As on an engine, a TP group that once hung stays unusable; say so instead of timing out again.
            raise CollectiveTimeout(f"TP rank {rank}: the collective timed out in an earlier round and is broken")
        try:
            return barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise CollectiveTimeout(
                f"TP rank {rank} waited {self.timeout:g} s for the other ranks of the collective; "
                "ranks that disagree on whether to gather hang an engine"
            ) from None
