"""Run a Mooncake master on loopback (or on a test host), for tests, benchmarks and local demos.

``mooncake_master`` binds 0.0.0.0 by default; :class:`MooncakeMaster` always passes its host's
address (127.0.0.1 unless a test host of a network of namespaces is given) and keeps the optional
servers (HTTP metadata, KV events, HA) switched off.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Self

from kvpolicy.mooncake.availability import IBVERBS_HINT, INSTALL_HINT, MooncakeUnavailable, require_ibverbs
from kvpolicy.mooncake.client import ClientConfig, MiB
from kvpolicy.mooncake.host import LOOPBACK as LOOPBACK_HOST
from kvpolicy.mooncake.host import NetworkHost
from kvpolicy.mooncake.metrics import MasterCounters, read_metrics

LOOPBACK = "127.0.0.1"

_STOP_TIMEOUT_S = 5.0
_POLL_INTERVAL_S = 0.05


def find_master_binary(binary: str | os.PathLike[str] | None = None) -> str:
    """Path of ``mooncake_master``: *binary* if given, else the venv's ``bin/``, else ``PATH``."""
    if binary is not None:
        candidates = [os.fspath(binary)]
    else:
        candidates = [str(Path(sys.executable).parent / "mooncake_master"), "mooncake_master"]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found is not None:
            return found
    raise MooncakeUnavailable(INSTALL_HINT)


def free_ports(count: int) -> list[int]:
    """*count* distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        # All bound at once, so the kernel cannot hand out the same port twice.
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class MooncakeMaster:
    """A ``mooncake_master`` process bound to 127.0.0.1 only; a context manager.

    ``start()`` returns once the metrics endpoint answers; ``stop()`` ends this process only.
    Its stdout and stderr go to :attr:`log_path`, a temporary file removed by ``stop()``.
    """

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        *,
        start_timeout: float = 20.0,
        object_lease_ms: int | None = None,
        client_ttl_s: int | None = None,
        host: NetworkHost = LOOPBACK_HOST,
    ) -> None:
        self._binary = binary
        self.host = host
        """Where the master runs and listens: loopback, or a test host of a network of namespaces."""
        self._start_timeout = start_timeout
        self._object_lease_ms = object_lease_ms
        """Mooncake's object lease (its default is 10 s): a read slower than this fails with
        LEASE_EXPIRED, which a starved 2-core test machine can hit."""
        self._client_ttl_s = client_ttl_s
        """Seconds a client stays alive without a heartbeat (Mooncake's default is 10): past it the master
        unmounts the client's segment and drops its objects, which a starved machine can also hit."""
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self.rpc_port = 0
        """Port of the master's RPC service (clients' ``master_server_address``)."""
        self.metrics_port = 0
        """Port of the master's HTTP metrics/admin server."""

    @property
    def rpc_address(self) -> str:
        """``<host address>:<rpc port>``, what a client passes as ``master_server_address``."""
        return f"{self.host.address}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus text endpoint of the master."""
        return f"http://{self.host.address}:{self.metrics_port}/metrics"

    def metrics(self) -> dict[str, float]:
        """The master's metrics, parsed, read with the master host's network."""
        return self.host.call(read_metrics, self.metrics_url)

    def counters(self) -> MasterCounters:
        """A snapshot of the traffic counters."""
        return MasterCounters.from_metrics(self.metrics())

    @property
    def pid(self) -> int:
        """PID of the running master."""
        return self._running().pid

    @property
    def log_path(self) -> Path:
        """File holding the master's stdout and stderr."""
        if self._log_path is None:
            raise RuntimeError("the master has not been started")
        return self._log_path

    def client_config(
        self, *, segment_mib: int = 64, buffer_mib: int = 16, local_hostname: str = LOOPBACK, network: str | None = None
    ) -> ClientConfig:
        """A store-client config for this master, sized for a small machine: on loopback, or for a client
        at ``local_hostname`` of the test ``network`` the master's host is on."""
        return ClientConfig(
            master_server_address=self.rpc_address,
            local_hostname=local_hostname,
            global_segment_size=segment_mib * MiB,
            local_buffer_size=buffer_mib * MiB,
            network=network,
        )

    @property
    def serving(self) -> bool:
        """The process runs and its metrics endpoint answers."""
        if self._process is None or self._process.poll() is not None:
            return False
        return self._answers()

    def _answers(self) -> bool:
        """Whether both endpoints are up: the master opens its RPC port and its metrics endpoint
        separately, and under load one can lag the other by seconds."""

        def fetch() -> None:
            with urllib.request.urlopen(self.metrics_url, timeout=1.0) as response:
                response.read()
            with socket.create_connection((self.host.address, self.rpc_port), timeout=1.0):
                pass

        try:
            self.host.call(fetch)
            return True
        except (urllib.error.URLError, OSError):
            return False

    def start(self, *, ports: tuple[int, int] | None = None) -> Self:
        """Launch the master and wait until its metrics endpoint answers and its RPC port listens. ``ports`` (rpc, metrics)
        fixes the ports, e.g. to start a master again where its clients expect it; default: free ones."""
        if self._process is not None:
            raise RuntimeError("the master is already running")
        binary = find_master_binary(self._binary)
        require_ibverbs()
        self.rpc_port, self.metrics_port = ports if ports is not None else free_ports(2)
        fd, log_name = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
        self._log_path = Path(log_name)
        # A file, not a pipe: nobody drains the master's output while it runs.
        with os.fdopen(fd, "wb") as log:
            address = self.host.address
            self._process = subprocess.Popen(
                self.host.command([
                    binary,
                    f"--rpc_address={address}",
                    f"--rpc_port={self.rpc_port}",
                    f"--metrics_host={address}",
                    f"--metrics_port={self.metrics_port}",
                    # Off by default today; pinned so a changed default cannot open 0.0.0.0.
                    "--enable_http_metadata_server=false",
                    f"--http_metadata_server_host={address}",
                    "--enable_kv_events=false",
                    "--enable_ha=false",
                    # glog to stderr (our log file), never to files of its own under /tmp.
                    "--logtostderr=true",
                    *([f"--default_kv_lease_ttl={self._object_lease_ms}"] if self._object_lease_ms else []),
                    *([f"--client_ttl={self._client_ttl_s}"] if self._client_ttl_s else []),
                ]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate this master (SIGTERM, then SIGKILL after 5 s) and remove its log."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the master and reap it, keeping the log; for fault-injection tests."""
        process = self._running()
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def restart(self) -> None:
        """SIGKILL the master and start a fresh one on the same address and ports: the store is empty,
        and clients reconnect to it (a master that crashed and came back)."""
        ports = (self.rpc_port, self.metrics_port)
        self.kill()
        self._process = None
        if self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
        self.start(ports=ports)

    def log_tail(self, lines: int = 20) -> str:
        """The last *lines* lines the master printed."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with self._log_path.open(errors="replace") as log:
            return "".join(deque(log, maxlen=lines))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _running(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError("the master is not running")
        return self._process

    def _wait_ready(self) -> None:
        process = self._running()
        deadline = time.monotonic() + self._start_timeout
        while True:
            if process.poll() is not None:
                tail = self.log_tail()
                hint = f"\n{IBVERBS_HINT}" if "libibverbs" in tail else ""
                raise MooncakeUnavailable(
                    f"mooncake_master exited with code {process.returncode} during start-up;"
                    f" last output:\n{tail}{hint}"
                )
            if self._answers():
                return
            if time.monotonic() > deadline:
                raise MooncakeUnavailable(
                    f"mooncake_master did not answer on {self.metrics_url} within"
                    f" {self._start_timeout:g} s; last output:\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)
