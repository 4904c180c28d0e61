"""The in-process form of the point-to-point exchange striped loads run over.

:class:`~kvpolicy.runtime.ports.PeerExchange` is what the striped-load schedule
(:mod:`kvpolicy.runtime.striping`) needs of a collective: each rank hands over the buffers it sends
and the buffers it receives into, each paired with the TP rank at the other end, and gets back once
every transfer is done. On an engine this is gloo (or NCCL) send/recv among the members of each
replica set (:mod:`kvpolicy.vllm.striped`); in the simulation and in tests it is
:class:`ThreadExchange`, whose ranks are threads of one process.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from kvpolicy.runtime.ports import Buffer, PeerExchange, Transfer

__all__ = ["ExchangeError", "ExchangeTimeout", "ThreadExchange"]


class ExchangeError(RuntimeError):
    """The ranks disagree on a transfer (a receive of another length than its send)."""


class ExchangeTimeout(ExchangeError):
    """A rank waited too long for a peer: on an engine, a gloo timeout."""


@dataclass
class _Parcel:
    buffer: Buffer
    taken: threading.Event = field(default_factory=threading.Event)


class ThreadExchange:
    """:class:`PeerExchange` among ``size`` threads of one process: each rank calls its :meth:`member`.

    A send waits until its peer has copied it (a rendezvous, as a blocking send), so a rank may reuse
    its buffers once the call returns. A rank that waits longer than ``timeout`` seconds raises
    :class:`ExchangeTimeout`, and the exchange is broken for every rank from then on (each later call
    raises at once), as a TP group that once timed out stays unusable on an engine.
    """

    def __init__(self, size: int, *, timeout: float = 60.0, device_buffers: bool = False) -> None:
        self.size = size
        self.timeout = timeout
        self.device_buffers = device_buffers
        self._mail: dict[tuple[int, int], deque[_Parcel]] = {}
        self._changed = threading.Condition()
        self.broken = False
        self.calls = 0
        """Calls that completed, over all ranks."""

    def member(self, rank: int) -> PeerExchange:
        """Rank ``rank``'s exchange (what a striped-load store takes)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a group of {self.size}")
        return _Member(self, rank)

    def _call(self, rank: int, sends: Sequence[Transfer], receives: Sequence[Transfer]) -> None:
        for peer, _ in (*sends, *receives):
            if not 0 <= peer < self.size or peer == rank:
                raise ValueError(f"rank {rank}: peer {peer} is not another rank of a group of {self.size}")
        deadline = _Deadline(self.timeout)
        posted: list[_Parcel] = []
        with self._changed:
            self._check(rank)
            for peer, buffer in sends:
                parcel = _Parcel(buffer)
                self._mail.setdefault((rank, peer), deque()).append(parcel)
                posted.append(parcel)
            self._changed.notify_all()
        for peer, buffer in receives:
            with self._changed:
                box = self._mail.setdefault((peer, rank), deque())
                self._wait(rank, partial(bool, box), deadline, f"a transfer from rank {peer}")
                parcel = box.popleft()
            try:
                if len(parcel.buffer) != len(buffer):
                    raise ExchangeError(
                        f"rank {rank} expected {len(buffer)} bytes from rank {peer}, which sent {len(parcel.buffer)}"
                    )
                buffer[:] = parcel.buffer
            finally:
                with self._changed:
                    parcel.taken.set()
                    self._changed.notify_all()
        with self._changed:
            self._wait(rank, lambda: all(parcel.taken.is_set() for parcel in posted), deadline, "its peers to receive")
            self.calls += 1

    def _check(self, rank: int) -> None:
        if self.broken:
            raise ExchangeTimeout(f"TP rank {rank}: the exchange timed out in an earlier call and is broken")

    def _wait(self, rank: int, ready: Callable[[], bool], deadline: _Deadline, what: str) -> None:
        """Wait (holding the condition) until ``ready()``; a timeout breaks the exchange for all."""
        while not ready():
            self._check(rank)
            left = deadline.left()
            if left <= 0:
                self.broken = True
                self._changed.notify_all()
                raise ExchangeTimeout(f"TP rank {rank} waited {self.timeout:g} s for {what}")
            self._changed.wait(left)
        self._check(rank)


class _Member:
    def __init__(self, exchange: ThreadExchange, rank: int) -> None:
        self._exchange = exchange
        self._rank = rank
        self.device_buffers = exchange.device_buffers

    def __call__(self, sends: Sequence[Transfer], receives: Sequence[Transfer]) -> None:
        self._exchange._call(self._rank, sends, receives)


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return self._end - time.monotonic()
