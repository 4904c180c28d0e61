"""Tools that break a Mooncake store on purpose: a master that dies and comes back, a client that
runs a callback inside a chosen call, a store filled to the brim."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvpolicy.mooncake.client import MiB
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.metrics import read_metrics

__all__ = ["NO_AVAILABLE_HANDLE", "FaultyStore", "KillSwitch", "RestartableMaster", "fill_store"]

NO_AVAILABLE_HANDLE = -200
"""What Mooncake returns for a put that finds no free space (vLLM's ``MOONCAKE_NO_AVAILABLE_HANDLE``)."""


class RestartableMaster(MooncakeMaster):
    """A loopback master that can be killed and started again, empty, on the same ports.

    Store clients keep their master's address, so after :meth:`restart` they re-register their
    segments with the new process (about 2 s) and keep working; ``close()`` on them is fast again.
    That is what lets one pool of clients serve a *fresh* master per test.
    """

    def restart(self) -> None:
        """SIGKILL the running master (if any) and start a new, empty one on the same ports."""
        if not self.rpc_port:
            raise RuntimeError("the master was never started")
        ports = (self.rpc_port, self.metrics_port)
        if self.serving:
            self.kill()
        self.stop()  # forgets the reaped process and removes its log
        self.start(ports=ports)

    def wait_for_capacity(self, capacity_bytes: int, timeout: float = 30.0) -> None:
        """Wait until the master has ``capacity_bytes`` of mounted segments (clients re-registered)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                capacity = int(read_metrics(self.metrics_url, timeout=2.0).get("master_total_capacity_bytes", 0))
            except OSError:
                capacity = -1
            if capacity >= capacity_bytes:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the master has {capacity} bytes of segments after {timeout:g} s, expected {capacity_bytes}"
                )
            time.sleep(0.05)


class KillSwitch:
    """Kills a master once, from wherever it is called (a :class:`FaultyStore` hook, a test)."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.master = master
        self._lock = threading.Lock()
        self.fired = False

    def __call__(self, *_: Any) -> None:
        with self._lock:
            if not self.fired:
                self.master.kill()
                self.fired = True


class FaultyStore:
    """A real store client with callbacks run before chosen methods.

    ``before`` maps a method name (``batch_put_from_multi_buffers``, ``batch_get_into_multi_buffers``,
    ``batch_is_exist`` …) to a callable run just before the real call, every time; everything else
    is forwarded untouched. The transfer threads call it like the client they were given.
    """

    def __init__(self, client: Any, *, before: Mapping[str, Callable[[], None]]) -> None:
        self._client = client
        self._before = dict(before)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        hook = self._before.get(name)
        if hook is None:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            hook()
            return attribute(*args, **kwargs)

        return call


def fill_store(client: Any, prefix: str) -> int:
    """Fill every mounted segment with hard-pinned objects (never evicted) until no put of even 64
    bytes fits; return how many objects that took. Keys start with ``prefix``."""
    from mooncake.store import ReplicateConfig

    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    count = 0
    for size in (MiB, 64 * 1024, 4096, 256, 64):
        value = b"\xa5" * size
        while True:
            code = client.put(f"{prefix}-junk-{size}-{count}", value, pinned)
            if code == NO_AVAILABLE_HANDLE:
                break
            if code != 0:
                raise RuntimeError(f"filling the store: put returned {code}")
            count += 1
    return count
