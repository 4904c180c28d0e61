"""Mooncake store clients on one master, lent out and reused.

Mooncake facts that shape this (mooncake-transfer-engine-non-cuda 0.3.13): several store clients work
in one process; ``close()`` takes 1–2 s per client and does not parallelise; a client still open at
interpreter exit, or closed after its master stopped, blocks for 30–40 s. So a test session lends
clients to many runs and closes them once, before the master stops.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvpolicy.mooncake.client import ClientConfig, MiB, connect_store
from kvpolicy.mooncake.master import MooncakeMaster

__all__ = ["ClientPool"]


class ClientPool:
    """Mooncake store clients on one master, lent to simulated instances and reused between them.

    An instance leases one client per rank, so two instances never share a client. A fleet removes
    its objects and its ranks unregister their tensors before giving clients back, so a reused
    client carries nothing over. :meth:`close` must run before the master stops (a client that
    outlives its master blocks ~30 s on close).
    """

    def __init__(self, master: MooncakeMaster, *, segment_mib: int = 16, buffer_mib: int = 4) -> None:
        # Mooncake refuses segments below 16 MiB.
        self._config = ClientConfig(
            master_server_address=master.rpc_address,
            global_segment_size=segment_mib * MiB,
            local_buffer_size=buffer_mib * MiB,
        )
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._all: list[Any] = []
        self._closed = False
        self.master = master

    @property
    def size(self) -> int:
        """Clients opened so far."""
        return len(self._all)

    def acquire(self, count: int) -> list[Any]:
        """``count`` clients no run is using; opens new ones when too few are idle."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the client pool is closed")
            taken, self._idle = self._idle[:count], self._idle[count:]
        try:
            while len(taken) < count:
                client = connect_store(self._config)
                with self._lock:
                    self._all.append(client)
                taken.append(client)
        except BaseException:
            self.release(taken)
            raise
        return taken

    def release(self, clients: Sequence[Any]) -> None:
        with self._lock:
            self._idle.extend(clients)

    def close(self) -> None:
        """Close every client (1–2 s each); objects in their segments disappear."""
        with self._lock:
            clients, self._all, self._idle, self._closed = self._all, [], [], True
        for client in clients:
            client.close()

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
