"""Hosts as network namespaces: private addresses reachable only between the hosts, links that can be
cut, and nothing left behind whatever happens to the test."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import unavailable

from kvpolicy.harness.fleet.netns import NetnsUnavailable, Network, remove_stale, require_netns


@pytest.fixture(scope="module", autouse=True)
def _netns_available() -> None:
    try:
        require_netns()
    except NetnsUnavailable as missing:
        unavailable(f"network namespaces: {missing}")


@pytest.fixture
def network() -> Iterator[Network]:
    with Network(["server", "client"]) as made:
        yield made


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def listen(network: Network) -> subprocess.Popen[bytes]:
    server = network["server"]
    echo = f"import socket; s = socket.create_server(({server.address!r}, 7000)); print('up', flush=True); s.accept()"
    process = subprocess.Popen(server.command([sys.executable, "-c", echo]), stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"up\n"
    return process


def connect(address: str, timeout: float = 2.0) -> None:
    with socket.create_connection((address, 7000), timeout=timeout):
        pass


def test_a_host_reaches_another_over_its_private_address(network: Network) -> None:
    server = listen(network)
    network["client"].call(connect, network["server"].address)
    server.wait(5)


def test_the_addresses_do_not_exist_outside_the_namespaces(network: Network) -> None:
    server = listen(network)
    ours = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert network["server"].address not in ours and network["client"].address not in ours
    # From this namespace the address leads elsewhere (this machine may even answer for any address):
    # whatever happens, the host's server never sees the connection.
    with contextlib.suppress(OSError):
        connect(network["server"].address, timeout=1.0)
    time.sleep(0.5)
    assert server.poll() is None


def test_a_program_on_a_host_has_that_host_s_pid_and_network(network: Network) -> None:
    process = subprocess.Popen(network["server"].command(["sleep", "30"]))
    time.sleep(0.3)
    assert network["server"].pids() == [process.pid]
    assert os.readlink(f"/proc/{process.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    network["server"].kill_all()
    assert process.wait(5) == -9


def test_tcp_counters_are_each_host_s_own(network: Network) -> None:
    client, server = network["client"], network["server"]
    before = {name: host.tcp_counters() for name, host in (("client", client), ("server", server))}
    listening = listen(network)
    client.call(connect, server.address)
    listening.wait(5)
    assert client.tcp_counters()["ActiveOpens"] == before["client"]["ActiveOpens"] + 1
    assert server.tcp_counters()["PassiveOpens"] == before["server"]["PassiveOpens"] + 1
    assert server.tcp_counters()["ActiveOpens"] == before["server"]["ActiveOpens"]
    assert "TCPSynRetrans" in client.tcp_counters() and "ListenDrops" in server.tcp_counters()


def test_a_call_moves_only_the_calling_thread_and_only_for_the_call(network: Network) -> None:
    mine = os.readlink("/proc/thread-self/ns/net")
    inside = network["client"].call(os.readlink, "/proc/thread-self/ns/net")
    assert inside != mine and os.readlink("/proc/thread-self/ns/net") == mine


def test_a_cut_link_stops_traffic_and_reconnecting_restores_it(network: Network) -> None:
    listen(network)
    network["server"].disconnect()
    with pytest.raises(OSError):
        network["client"].call(connect, network["server"].address, 1.0)
    network["server"].reconnect()
    network["client"].call(connect, network["server"].address, 5.0)


def test_closing_kills_every_process_and_removes_every_namespace() -> None:
    network = Network(["one", "two"]).start()
    made = {host.namespace for host in network.hosts.values()} | {network.switch}
    process = subprocess.Popen(network["one"].command(["sleep", "60"]))
    assert made <= namespaces()
    network.close()
    assert process.wait(5) == -9
    assert not made & namespaces()
    network.close()  # twice is harmless


def test_a_failing_test_body_still_tears_the_network_down() -> None:
    made: set[str] = set()
    with pytest.raises(RuntimeError, match="boom"), Network(["one"]) as network:
        made = {network["one"].namespace, network.switch}
        raise RuntimeError("boom")
    assert made and not made & namespaces()


def test_namespaces_of_a_run_that_died_are_removed(tmp_path: object) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = f"kvp{int(dead.stdout)}n1-left"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in remove_stale()
    assert stale not in namespaces()


@pytest.mark.parametrize("names", [[], ["Upper"], ["a", "a"], ["x" * 13], ["9lives"]])
def test_bad_host_names_are_refused_before_anything_is_made(names: list[str]) -> None:
    before = namespaces()
    with pytest.raises(ValueError, match="host names"):
        Network(names)
    assert namespaces() == before


def test_a_public_subnet_is_refused() -> None:
    with pytest.raises(ValueError, match="private"):
        Network(["one"], subnet="8.8.8.0/24")
