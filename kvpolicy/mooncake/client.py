"""Mooncake store clients on loopback, and the config file vLLM's store connector reads.

Two facts shape this module. ``MooncakeDistributedStore.setup`` blocks about 90 s when no master
listens, so :func:`connect_store` first checks that the port answers. And the client's transfer
engine listens on all interfaces whatever ``local_hostname`` says (a Mooncake 0.3.13 limitation),
so the one thing this module can guarantee is that it only ever *connects* to loopback (or, when a
config names one, to a private network of test hosts that exists only inside network namespaces).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from kvpolicy.mooncake.availability import INSTALL_HINT, MooncakeUnavailable, require_ibverbs

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore

MiB: Final = 1024 * 1024
OBJECT_NOT_FOUND: Final = -704
"""What ``get_into`` and the batch gets return for a missing key (``get`` returns ``b""``)."""

_LOOPBACK_HOSTS = ("localhost",)


class StoreSetupError(RuntimeError):
    """``MooncakeDistributedStore.setup`` failed, or no master listens at the address."""


def _is_loopback(host: str) -> bool:
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def _in_network(host: str, network: str | None) -> bool:
    if network is None:
        return False
    try:
        return ipaddress.ip_address(host) in ipaddress.ip_network(network)
    except ValueError:
        return False


def _format_size(size: int) -> int | str:
    # Whole MiB are written as vLLM's docs write them ("64MB" = 64 MiB to both parsers).
    return f"{size // MiB}MB" if size % MiB == 0 else size


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Arguments of ``MooncakeDistributedStore.setup``, restricted to loopback or one private network."""

    master_server_address: str
    """``host:port`` of the master's RPC service; the host must be ``127.*``, ``localhost`` or in ``network``."""
    local_hostname: str = "127.0.0.1"
    """Address this client advertises to its peers; loopback or in ``network`` too."""
    metadata_server: str = "P2PHANDSHAKE"
    """Peer discovery; ``P2PHANDSHAKE`` needs no metadata server (the built-in one binds 0.0.0.0)."""
    protocol: str = "tcp"
    """Transfer protocol; ``tcp`` needs no RDMA hardware."""
    device_name: str = ""
    """RDMA device list; empty for TCP."""
    global_segment_size: int = 64 * MiB
    """Bytes this client contributes to the store (objects of *any* client may land there)."""
    local_buffer_size: int = 16 * MiB
    """Bytes of this client's registered staging buffer."""
    network: str | None = None
    """A private subnet (``10.77.1.0/24``) whose addresses are allowed besides loopback: the hosts of a
    test network made of namespaces (:mod:`kvpolicy.harness.fleet.netns`). Never written to the config file."""

    def __post_init__(self) -> None:
        host, sep, port = self.master_server_address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(
                f"master_server_address must be host:port, got {self.master_server_address!r}"
            )
        if self.network is not None and not ipaddress.ip_network(self.network).is_private:
            raise ValueError(f"network must be a private subnet, got {self.network!r}")
        where = "loopback" if self.network is None else f"loopback or in {self.network}"
        if not (_is_loopback(host) or _in_network(host, self.network)):
            raise ValueError(f"master_server_address must be on {where}, got {host!r}")
        if not (_is_loopback(self.local_hostname) or _in_network(self.local_hostname, self.network)):
            raise ValueError(f"local_hostname must be on {where}, got {self.local_hostname!r}")
        if self.global_segment_size <= 0 or self.local_buffer_size <= 0:
            raise ValueError("global_segment_size and local_buffer_size must be positive")

    def to_json_dict(self) -> dict[str, str | int]:
        """The JSON object that ``MOONCAKE_CONFIG_PATH`` points at.

        vLLM's ``MooncakeStoreConfig.from_file`` and Mooncake's ``MooncakeConfig.from_file`` both
        read it. vLLM ignores ``local_hostname`` (it uses ``VLLM_HOST_IP`` or
        ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME``); Mooncake requires it.
        """
        return {
            "local_hostname": self.local_hostname,
            "metadata_server": self.metadata_server,
            "protocol": self.protocol,
            "device_name": self.device_name,
            "global_segment_size": _format_size(self.global_segment_size),
            "local_buffer_size": _format_size(self.local_buffer_size),
            "master_server_address": self.master_server_address,
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_json_dict` to *path* and return it."""
        target = Path(path)
        target.write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")
        return target


def _store_class() -> type[MooncakeDistributedStore]:
    require_ibverbs()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        raise MooncakeUnavailable(f"{INSTALL_HINT} ({error})") from error
    return MooncakeDistributedStore


def _check_master_listens(address: str, timeout: float = 2.0) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as error:
        raise StoreSetupError(f"no Mooncake master listens at {address}: {error}") from error


def connect_store(config: ClientConfig) -> MooncakeDistributedStore:
    """A store client set up with *config*; the caller must ``close()`` it."""
    store_class = _store_class()
    _check_master_listens(config.master_server_address)
    store = store_class()
    code = store.setup(
        config.local_hostname,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.device_name,
        config.master_server_address,
    )
    if code != 0:
        raise StoreSetupError(
            f"MooncakeDistributedStore.setup returned {code} for master"
            f" {config.master_server_address}"
        )
    return store


@contextlib.contextmanager
def store_client(config: ClientConfig) -> Iterator[MooncakeDistributedStore]:
    """:func:`connect_store`, closed on exit; objects in its segment disappear with it."""
    store = connect_store(config)
    try:
        yield store
    finally:
        store.close()
