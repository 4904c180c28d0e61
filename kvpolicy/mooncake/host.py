"""Where a process runs and whose network a call uses: this machine's loopback, or a test host.

Servers (the Mooncake master, segment holders, vLLM) take a :class:`NetworkHost`: they bind its
``address``, start through its ``command`` and make their own HTTP calls through its ``call``.
:data:`LOOPBACK` is this machine on 127.0.0.1; :class:`kvpolicy.harness.fleet.netns.Host` is a host of a
network of namespaces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

__all__ = ["LOOPBACK", "NetworkHost"]


class NetworkHost(Protocol):
    @property
    def address(self) -> str:
        """The address servers on this host bind and clients on it advertise."""
        ...

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs on this host."""
        ...

    def call(self, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)`` with this host's network."""
        ...


@dataclass(frozen=True)
class _Loopback:
    address: str = "127.0.0.1"

    def command(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def call(self, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return function(*args, **kwargs)


LOOPBACK: NetworkHost = _Loopback()
"""This machine, on 127.0.0.1."""
