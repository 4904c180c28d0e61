"""Hosts as Linux network namespaces: several machines' network stacks on one machine, for tests.

A :class:`Network` makes one namespace per host and a switch namespace that holds a bridge. Each host
gets a veth pair, ``eth0`` inside the host and a bridge port inside the switch, and an address of a
private ``/24`` that exists only inside those namespaces. Nothing is added to the caller's own
namespace, so traffic between hosts crosses a real network stack (ARP, a bridge, TCP over non-loopback
addresses) and never leaves the namespaces the network made.

A :class:`Host` runs programs on itself (:meth:`Host.command` prefixes ``ip netns exec``, which execs,
so the PID is the program's) and runs Python on itself (:meth:`Host.call` moves the calling thread
into the host's namespace for the call: sockets opened there belong to the host). It can lose its
link (:meth:`Host.disconnect`) and have every process on it killed (:meth:`Host.kill_all`).

:meth:`Network.close` kills every process in the namespaces and deletes them, also when a test failed,
and at interpreter exit; :func:`remove_stale` deletes what a killed run left behind. Needs root (or
CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2: :func:`require_netns` names the missing piece.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

__all__ = ["Host", "NetnsUnavailable", "Network", "remove_stale", "require_netns"]

P = ParamSpec("P")
T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/var/run/netns"
_PREFIX = "kvp"
"""Namespaces this module makes are named ``kvp<pid>n<k>-<host>``; ``<pid>`` is the process that made them."""
_NAME = re.compile(rf"^{_PREFIX}(\d+)n\d+-")
_HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_IP_TIMEOUT_S = 60.0
"""`ip` waits for the kernel's network lock, which a namespace being torn down holds for seconds."""
_counter = iter(range(1, 1 << 30))
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces; the message names the missing piece."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip")
    if ip is None:
        raise NetnsUnavailable("the `ip` command is missing: apt-get install -y iproute2")
    result = subprocess.run(
        [ip, *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def require_netns() -> None:
    """Raise :class:`NetnsUnavailable` unless a namespace with a veth pair can be made here."""
    probe = f"{_PREFIX}{os.getpid()}n0-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            raise NetnsUnavailable(
                f"`ip netns add` failed: {made.stderr.strip()} (network namespaces need root, or CAP_SYS_ADMIN"
                " and CAP_NET_ADMIN, and a kernel with CONFIG_NET_NS)"
            )
        veth = _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if veth.returncode != 0:
            raise NetnsUnavailable(f"a veth pair cannot be made: {veth.stderr.strip()} (the kernel needs CONFIG_VETH)")
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            raise NetnsUnavailable(f"a bridge cannot be made: {bridge.stderr.strip()} (the kernel needs CONFIG_BRIDGE)")
    finally:
        _ip("netns", "del", probe, check=False)


def _namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that may never reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids(namespace: str) -> list[int]:
    listed = _ip("netns", "pids", namespace, check=False).stdout
    return [int(pid) for pid in listed.split() if pid.isdigit() and _alive(int(pid))]


def _kill_and_delete(namespace: str) -> None:
    for _ in range(50):
        pids = _pids(namespace)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _ip("netns", "del", namespace, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces (and kill their processes) that runs no longer alive left behind."""
    removed = []
    for namespace in _namespaces():
        owner = _NAME.match(namespace)
        if owner is not None and not os.path.exists(f"/proc/{owner.group(1)}"):
            _kill_and_delete(namespace)
            removed.append(namespace)
    return removed


@contextlib.contextmanager
def _inside(namespace: str) -> Iterator[None]:
    """Move the calling thread into ``namespace``'s network namespace, and back afterwards."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(os.path.join(_NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if _libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
        try:
            yield
        finally:
            if _libc.setns(home, _CLONE_NEWNET) != 0:  # pragma: no cover - the kernel refusing our own namespace
                raise OSError(ctypes.get_errno(), "setns back to the caller's namespace failed")
    finally:
        os.close(target)
        os.close(home)


@dataclass(frozen=True)
class Host:
    """One host of a :class:`Network`: a network namespace with one address."""

    name: str
    namespace: str
    address: str
    """This host's IPv4 address; it exists only inside the network's namespaces."""
    switch_namespace: str = field(repr=False)
    port: str = field(repr=False)
    """The host's port on the bridge, in the switch namespace."""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host (``ip netns exec`` execs: the PID is the program's)."""
        ip = shutil.which("ip") or "ip"
        return [ip, "netns", "exec", self.namespace, *argv]

    def call(self, function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``function(*args, **kwargs)`` with this host's network: the calling thread joins the host's
        namespace for the call (other threads are not affected)."""
        with _inside(self.namespace):
            return function(*args, **kwargs)

    def pids(self) -> list[int]:
        """PIDs of every process running on this host."""
        return _pids(self.namespace)

    def tcp_counters(self) -> dict[str, int]:
        """This host's kernel TCP counters (``/proc/net/snmp`` ``Tcp:`` and ``/proc/net/netstat``
        ``TcpExt:``, e.g. ``RetransSegs``, ``TCPSynRetrans``, ``ListenDrops``), read in its namespace."""
        return self.call(_tcp_counters)

    def kill_all(self) -> list[int]:
        """SIGKILL every process on this host (a host that dies); returns their PIDs."""
        killed = self.pids()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def disconnect(self) -> None:
        """Cut this host's link: its bridge port goes down, its processes keep running."""
        _ip("-n", self.switch_namespace, "link", "set", self.port, "down")

    def reconnect(self) -> None:
        """Bring the link back up."""
        _ip("-n", self.switch_namespace, "link", "set", self.port, "up")


class Network:
    """Hosts on one bridge; a context manager that tears everything down on exit.

    ``Network(["master", "seg1", "vllm1"])`` makes the namespaces on :meth:`start`; ``network["seg1"]``
    is that :class:`Host`. Host names are lower-case letters and digits, at most 12.
    """

    def __init__(self, host_names: Sequence[str], *, subnet: str | None = None) -> None:
        names = list(host_names)
        bad = [name for name in names if not _HOST_NAME.match(name)]
        if bad or len(set(names)) != len(names) or not 1 <= len(names) <= 250:
            raise ValueError(f"host names must be 1-250 distinct [a-z][a-z0-9]{{0,11}} names, got {names!r}")
        self._names = names
        network = ipaddress.ip_network(subnet or f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}.0/24")
        if network.prefixlen > 24 or not network.is_private:
            raise ValueError(f"the subnet must be a private /24 or larger, got {network}")
        self.subnet = network
        self._tag = f"{_PREFIX}{os.getpid()}n{next(_counter)}"
        self.switch = f"{self._tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> Network:
        require_netns()
        remove_stale()
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            addresses = iter(self.subnet.hosts())
            for index, name in enumerate(self._names):
                namespace = f"{self._tag}-{name}"
                self._add_namespace(namespace)
                port = f"p{index}"
                address = str(next(addresses))
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
                self.hosts[name] = Host(name, namespace, address, self.switch, port)
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        return self

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)
        # Loopback up: programs on a host talk to themselves over 127.0.0.1 (vLLM's own workers do).
        _ip("-n", namespace, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill every process on every host and delete the namespaces; safe to call twice."""
        atexit.unregister(self.close)
        with self._lock:
            made, self._made = self._made, []
        for namespace in reversed(made):
            _kill_and_delete(namespace)
        self.hosts = {}

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _tcp_counters() -> dict[str, int]:
    # thread-self: Host.call moved only this thread; /proc/self/net would show the process's namespace.
    counters: dict[str, int] = {}
    for table in ("snmp", "netstat"):
        lines = Path(f"/proc/thread-self/net/{table}").read_text().splitlines()
        for header, values in zip(lines[::2], lines[1::2], strict=False):
            prefix, _, names = header.partition(":")
            if prefix in ("Tcp", "TcpExt"):
                counters.update(zip(names.split(), map(int, values.partition(":")[2].split()), strict=False))
    return counters
