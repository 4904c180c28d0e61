"""A Mooncake store and vLLM servers spread over the hosts of a network of namespaces.

:class:`HostFleet` makes the hosts (:mod:`kvpolicy.harness.fleet.netns`), starts a Mooncake master on one,
a segment holder on each of the others it is told to (they own all the store's memory; the vLLM
servers mount no segment, so their objects outlive them and sit on other machines), and starts vLLM
OpenAI servers on the vLLM hosts with a ``--kv-transfer-config`` and the store config for their own
address. The test process itself reaches every server from a client host, over the network.

Mooncake is configured with the hosts' addresses only (``local_hostname``, ``master_server_address``,
``VLLM_HOST_IP``): no ``0.0.0.0``, no loopback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.harness.e2e import SegmentHolder, engine_store_config
from kvpolicy.harness.fleet.netns import Host, Network
from kvpolicy.harness.server import OpenAIServer
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.metrics import MasterCounters

__all__ = ["HostFleet", "kv_transfer_config"]


def kv_transfer_config(
    *, policy: str | None = "default", load_failure: str = "fail", connector: str | None = None
) -> str:
    """A ``--kv-transfer-config`` value: kvpolicy with ``policy``, or the stock ``connector``."""
    if connector is not None:
        config: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both", "kv_load_failure_policy": load_failure}
    else:
        config = KVPolicySettings(kvpolicy=policy).kv_transfer_config(kv_load_failure_policy=load_failure)
    return json.dumps(config)


class HostFleet:
    """Hosts ``master``, ``segment_hosts``, ``vllm_hosts`` and ``client`` on one bridge; a context manager.

    ``server(host, ...)`` starts (not enters) an :class:`OpenAIServer` on a vLLM host whose requests
    come from the client host. Everything (servers included) is killed and the namespaces are deleted
    on exit, also after a failure.
    """

    def __init__(
        self,
        scratch: str | os.PathLike[str],
        *,
        segment_hosts: Sequence[str] = ("seg1", "seg2"),
        vllm_hosts: Sequence[str] = ("vllma", "vllmb"),
        segment_mib: int = 256,
        client_ttl_s: int = 120,
        object_lease_ms: int = 120_000,
    ) -> None:
        self._scratch = Path(scratch)
        self.segment_hosts = tuple(segment_hosts)
        self.vllm_hosts = tuple(vllm_hosts)
        self.network = Network(["master", *self.segment_hosts, *self.vllm_hosts, "client"])
        self._segment_mib = segment_mib
        self._client_ttl_s = client_ttl_s
        """Mooncake's default (10 s) is shorter than the whole-VM freezes these machines see under load
        (docs/known-limits.md): on waking, the master drops every segment holder and all objects."""
        self._object_lease_ms = object_lease_ms
        """Mooncake's default lease (10 s) fails every read slower than it (LEASE_EXPIRED), which 8
        clients on 2 cores were seen to hit; the other test masters run with 120 s too."""
        self.master: MooncakeMaster | None = None
        self.holders: dict[str, SegmentHolder] = {}
        self._servers: list[OpenAIServer] = []

    def __getitem__(self, name: str) -> Host:
        return self.network[name]

    @property
    def client(self) -> Host:
        return self.network["client"]

    def __enter__(self) -> HostFleet:
        self._scratch.mkdir(parents=True, exist_ok=True)
        self.network.start()
        try:
            self.master = MooncakeMaster(
                host=self.network["master"], client_ttl_s=self._client_ttl_s, object_lease_ms=self._object_lease_ms
            ).start()
            for name in self.segment_hosts:
                self.start_segment_host(name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for server in self._servers:
            server.stop()
        self._servers = []
        for holder in self.holders.values():
            holder.stop()
        self.holders = {}
        if self.master is not None:
            self.master.stop()
            self.master = None
        self.network.close()

    def _master(self) -> MooncakeMaster:
        if self.master is None:
            raise RuntimeError("the fleet is not running")
        return self.master

    def start_segment_host(self, name: str) -> SegmentHolder:
        """Start (again) the segment holder of host ``name``."""
        master = self._master()
        holder = SegmentHolder(
            master.rpc_address, segment_mib=self._segment_mib, host=self.network[name], network=str(self.network.subnet)
        ).start()
        self.holders[name] = holder
        return holder

    def restart_master(self) -> None:
        """SIGKILL the master and start a fresh one at the same address: an empty store."""
        self._master().restart()

    def counters(self) -> MasterCounters:
        return self._master().counters()

    def capacity_bytes(self) -> int:
        """Bytes of segment memory mounted at the master now (segment holders remount after a restart)."""
        return int(self._master().metrics().get("master_total_capacity_bytes", 0))

    def describe_store(self) -> str:
        """One line on the store's health, for a failing assertion's message: objects, mounted memory,
        live segment clients and how often they had to mount again (a client the master dropped for a
        missed heartbeat remounts an empty segment: every object it held is gone)."""
        try:
            metrics = self._master().metrics()
        except (OSError, RuntimeError) as error:
            return f"the master's metrics did not answer: {error}"
        def value(name: str) -> int:
            return int(metrics.get(f"master_{name}", -1))

        return (
            f"{value('key_count')} objects, {value('total_capacity_bytes')} of {self.full_capacity_bytes} bytes mounted,"
            f" {value('active_clients')} live segment clients, {value('remount_segment_requests_total')} remounts"
            f" since the master started, {value('ping_requests_total')} heartbeats"
        )

    @property
    def full_capacity_bytes(self) -> int:
        """What :meth:`capacity_bytes` is with every segment holder mounted."""
        return len(self.holders) * self._segment_mib * 1024 * 1024

    def store_config(self, host: str) -> Path:
        """The ``MOONCAKE_CONFIG_PATH`` file of a vLLM server on ``host`` (it mounts no segment)."""
        master = self._master()
        config = master.client_config(local_hostname=self.network[host].address, network=str(self.network.subnet))
        return engine_store_config(config, self._scratch / f"mooncake-{host}.json")

    def server(
        self,
        host: str,
        model_dir: str | os.PathLike[str],
        *,
        tp_size: int,
        kv_transfer_config: str,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> OpenAIServer:
        """A started OpenAI server on vLLM host ``host``, reached from the client host."""
        server = OpenAIServer(
            model_dir, tp_size=tp_size, kv_transfer_config=kv_transfer_config,
            mooncake_config_path=self.store_config(host), extra_args=extra_args, extra_env=extra_env,
            host=self.network[host], client=self.client,
        )
        self._servers.append(server)
        server.start()
        return server
