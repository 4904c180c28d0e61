"""The loopback Mooncake master, store clients and master counters, against real Mooncake."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import mooncake.store
except ImportError as error:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"mooncake.store does not import: {error}", allow_module_level=True)

from kvpolicy.mooncake import (
    OBJECT_NOT_FOUND,
    ClientConfig,
    MasterCounters,
    MooncakeMaster,
    MooncakeUnavailable,
    StoreSetupError,
    connect_store,
    delta,
    read_metrics,
    store_client,
)
from kvpolicy.mooncake.master import INSTALL_HINT, free_ports


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as started:
        yield started


# Closing a client takes about 2 s, so the traffic tests share one writer and one reader.
@pytest.fixture(scope="module")
def writer(master: MooncakeMaster) -> Iterator[mooncake.store.MooncakeDistributedStore]:
    with store_client(master.client_config()) as store:
        yield store


@pytest.fixture(scope="module")
def reader(master: MooncakeMaster) -> Iterator[mooncake.store.MooncakeDistributedStore]:
    with store_client(master.client_config()) as store:
        yield store


class Buffer:
    """A ctypes buffer registered with a store client while in a ``with``, cut into slots."""

    def __init__(self, store: mooncake.store.MooncakeDistributedStore, slots: int, slot: int):
        self.store = store
        self.raw = ctypes.create_string_buffer(slots * slot)
        self.slot = slot

    def __enter__(self) -> Buffer:
        assert self.store.register_buffer(ctypes.addressof(self.raw), len(self.raw)) == 0
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self.store.unregister_buffer(ctypes.addressof(self.raw)) == 0

    def address(self, index: int) -> int:
        return ctypes.addressof(self.raw) + index * self.slot

    def read(self, index: int) -> bytes:
        return self.raw.raw[index * self.slot : (index + 1) * self.slot]


def put_objects(
    store: mooncake.store.MooncakeDistributedStore, values: dict[str, bytes]
) -> list[int]:
    """Write *values* the way vLLM's connector does: one batch from registered memory."""
    slot = max(len(value) for value in values.values())
    with Buffer(store, len(values), slot) as source:
        for index, value in enumerate(values.values()):
            ctypes.memmove(source.address(index), value, len(value))
        return store.batch_put_from_multi_buffers(
            list(values),
            [[source.address(index)] for index in range(len(values))],
            [[len(value)] for value in values.values()],
        )


def get_objects(
    store: mooncake.store.MooncakeDistributedStore, keys: list[str], size: int
) -> tuple[list[int], list[bytes]]:
    """Read *keys* the way vLLM's connector does; returns the codes and the slots' bytes."""
    with Buffer(store, len(keys), size) as target:
        codes = store.batch_get_into_multi_buffers(
            keys, [[target.address(index)] for index in range(len(keys))], [[size]] * len(keys)
        )
        return codes, [target.read(index) for index in range(len(keys))]


def unique_keys(count: int) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"{prefix}@{index}" for index in range(count)]


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket of *pid* in LISTEN state, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            with_target = os.readlink(fd)
        except FileNotFoundError:
            continue  # closed by the master between listing and reading; it was not a listener
        if with_target.startswith("socket:["):
            inodes.add(with_target[len("socket:[") : -1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:
                continue
            address_hex, port_hex = local.split(":")
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            packed = b"".join(
                bytes.fromhex(address_hex[i : i + 8])[::-1] for i in range(0, len(address_hex), 8)
            )
            found.add((socket.inet_ntop(family, packed), int(port_hex, 16)))
    return found


def test_master_listens_on_loopback_only(master: MooncakeMaster) -> None:
    sockets = listening_sockets(master.pid)

    assert {host for host, _ in sockets} == {"127.0.0.1"}
    assert {master.rpc_port, master.metrics_port} <= {port for _, port in sockets}


def test_metrics_endpoint_answers_with_the_traffic_counters(master: MooncakeMaster) -> None:
    metrics = read_metrics(master.metrics_url)

    assert "master_key_count" in metrics
    assert MasterCounters.from_metrics(metrics).batch_put_start_items >= 0


def test_objects_put_by_one_client_are_read_by_another_and_counted_once_each(
    master: MooncakeMaster,
    writer: mooncake.store.MooncakeDistributedStore,
    reader: mooncake.store.MooncakeDistributedStore,
) -> None:
    values = {key: key.encode().ljust(64, b".") for key in unique_keys(3)}
    before = MasterCounters.read(master.metrics_url)

    put_codes = put_objects(writer, values)
    get_codes, read_back = get_objects(reader, list(values), 64)

    counted = delta(before, MasterCounters.read(master.metrics_url))
    assert put_codes == [0, 0, 0]
    assert get_codes == [64, 64, 64]
    assert read_back == list(values.values())
    assert counted.batch_put_start_items == counted.objects_written == 3
    assert counted.batch_get_replica_list_items == counted.objects_read == 3
    assert counted.key_count == 3


def test_putting_an_existing_key_reports_success_but_writes_nothing(
    master: MooncakeMaster,
    writer: mooncake.store.MooncakeDistributedStore,
    reader: mooncake.store.MooncakeDistributedStore,
) -> None:
    (key,) = unique_keys(1)
    assert put_objects(writer, {key: b"first"}) == [0]
    before = MasterCounters.read(master.metrics_url)

    assert put_objects(writer, {key: b"other"}) == [0]

    counted = delta(before, MasterCounters.read(master.metrics_url))
    assert get_objects(reader, [key], 5)[1] == [b"first"]
    assert counted.batch_put_start_items == 1
    assert counted.batch_put_start_failed_items == 1
    assert counted.objects_written == 0


def test_batch_is_exist_counts_every_probed_key(
    master: MooncakeMaster, writer: mooncake.store.MooncakeDistributedStore
) -> None:
    present, missing = unique_keys(2)
    put_objects(writer, {present: b"x"})
    before = MasterCounters.read(master.metrics_url)

    assert writer.batch_is_exist([present, missing]) == [1, 0]

    assert delta(before, MasterCounters.read(master.metrics_url)).batch_exist_key_items == 2


def test_getting_a_missing_key_returns_object_not_found(
    master: MooncakeMaster, reader: mooncake.store.MooncakeDistributedStore
) -> None:
    (missing,) = unique_keys(1)
    before = MasterCounters.read(master.metrics_url)

    with Buffer(reader, 1, 16) as target:
        assert reader.get_into(missing, target.address(0), 16) == OBJECT_NOT_FOUND
    assert get_objects(reader, [missing], 16)[0] == [OBJECT_NOT_FOUND]

    counted = delta(before, MasterCounters.read(master.metrics_url))
    assert counted.batch_get_replica_list_failed_items == 1
    assert counted.objects_read == 0


def test_stop_ends_only_its_own_process_and_reaps_it(master: MooncakeMaster) -> None:
    other = MooncakeMaster().start()
    pid = other.pid

    other.stop()

    assert not Path(f"/proc/{pid}").exists()
    assert not other.log_path.exists()
    assert read_metrics(master.metrics_url)["master_key_count"] >= 0


def test_kill_stops_the_master_at_once() -> None:
    with MooncakeMaster() as doomed:
        doomed.kill()

        with pytest.raises(OSError):
            read_metrics(doomed.metrics_url, timeout=1.0)


def test_missing_binary_raises_unavailable_with_the_install_hint() -> None:
    with pytest.raises(MooncakeUnavailable, match="mooncake-transfer-engine-non-cuda==0.3.13.post1"):
        MooncakeMaster(binary="/nonexistent/mooncake_master").start()
    assert "mooncake_master not found" in INSTALL_HINT


def test_a_binary_that_exits_during_start_up_raises_unavailable() -> None:
    exits = shutil.which("false")
    assert exits is not None

    with pytest.raises(MooncakeUnavailable, match="exited with code 1 during start-up"):
        MooncakeMaster(binary=exits).start()


def test_client_config_rejects_a_master_off_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        ClientConfig(master_server_address="10.0.0.1:50051")


def test_client_config_rejects_a_local_hostname_off_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        ClientConfig(master_server_address="127.0.0.1:50051", local_hostname="0.0.0.0")


def test_client_config_takes_addresses_of_the_test_network_it_names() -> None:
    config = ClientConfig(master_server_address="10.9.8.1:50051", local_hostname="10.9.8.2", network="10.9.8.0/24")
    assert "network" not in config.to_json_dict()


def test_client_config_rejects_an_address_outside_the_test_network_it_names() -> None:
    with pytest.raises(ValueError, match=r"loopback or in 10\.9\.8\.0/24"):
        ClientConfig(master_server_address="10.9.9.1:50051", network="10.9.8.0/24")


def test_client_config_rejects_a_public_test_network() -> None:
    with pytest.raises(ValueError, match="private"):
        ClientConfig(master_server_address="8.8.8.8:50051", network="8.8.8.0/24")


def test_connecting_where_no_master_listens_fails_at_once() -> None:
    (port,) = free_ports(1)
    started = time.monotonic()

    with pytest.raises(StoreSetupError, match="no Mooncake master listens"):
        connect_store(ClientConfig(master_server_address=f"127.0.0.1:{port}"))
    assert time.monotonic() - started < 5


def test_config_file_is_read_back_by_mooncake(tmp_path: Path) -> None:
    from mooncake.mooncake_config import MooncakeConfig

    config = ClientConfig(master_server_address="127.0.0.1:50051", local_buffer_size=3 * 1024)

    loaded = MooncakeConfig.from_file(str(config.write(tmp_path / "mooncake.json")))

    assert (loaded.master_server_address, loaded.local_hostname) == ("127.0.0.1:50051", "127.0.0.1")
    assert (loaded.global_segment_size, loaded.local_buffer_size) == (64 * 1024 * 1024, 3 * 1024)
    assert (loaded.metadata_server, loaded.protocol) == ("P2PHANDSHAKE", "tcp")


def test_config_file_is_read_back_by_vllm(tmp_path: Path) -> None:
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    config = ClientConfig(master_server_address="127.0.0.1:50051", local_buffer_size=3 * 1024)

    loaded = MooncakeStoreConfig.from_file(str(config.write(tmp_path / "mooncake.json")))

    assert loaded.master_server_address == "127.0.0.1:50051"
    assert (loaded.global_segment_size, loaded.local_buffer_size) == (64 * 1024 * 1024, 3 * 1024)
    assert (loaded.metadata_server, loaded.protocol, loaded.device_name) == (
        "P2PHANDSHAKE",
        "tcp",
        "",
    )


def test_a_segment_holder_starts_in_a_process_whose_descriptors_are_past_1024(master: MooncakeMaster) -> None:
    # select() refuses descriptors from FD_SETSIZE (1024) up, and a test session holding many Mooncake
    # clients reaches them: the holder's pipe must be waited on another way.
    import resource

    from kvpolicy.harness.e2e import SegmentHolder

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.fail(f"RLIMIT_NOFILE's hard limit {hard} is below {wanted}: this test cannot place a pipe past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    fillers: list[int] = []
    try:
        while not fillers or fillers[-1] < 1100:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        with SegmentHolder(master.rpc_address, segment_mib=16, buffer_mib=4) as holder:
            assert holder._process is not None and holder._process.stdout.fileno() > 1024
    finally:
        for descriptor in fillers:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_PUT_ON_CUE = """
import sys
from kvpolicy.mooncake.client import ClientConfig, connect_store
store = connect_store(ClientConfig(master_server_address=sys.argv[1], global_segment_size=16 << 20, local_buffer_size=4 << 20))
print("ready", flush=True)
sys.stdin.readline()
code = store.put(sys.argv[2], b"x" * 1024)
sys.stdin.readline()
print(code, store.is_exist(sys.argv[2]), flush=True)
"""


def _put_across_a_pause(master: MooncakeMaster, key: str, rpc_timeout_ms: int, pause_s: float) -> tuple[int, int]:
    """A client whose ``MC_RPC_TIMEOUT_MS`` is ``rpc_timeout_ms`` puts ``key`` while the master is stopped
    (SIGSTOP) for ``pause_s`` seconds, as a VM freeze stops it: the put's return code, and whether the
    key then exists (asked by that client, whose segment holds the object)."""
    import signal
    import subprocess
    import sys
    import threading

    from kvpolicy.harness.e2e import child_env

    env = child_env({"MC_RPC_TIMEOUT_MS": str(rpc_timeout_ms)}, ())
    with subprocess.Popen(
        [sys.executable, "-c", _PUT_ON_CUE, master.rpc_address, key],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    ) as client:
        assert client.stdin is not None and client.stdout is not None
        assert client.stdout.readline().strip() == "ready"
        os.kill(master.pid, signal.SIGSTOP)
        resume = threading.Timer(pause_s, os.kill, (master.pid, signal.SIGCONT))
        resume.start()
        try:
            client.stdin.write("go\n")
            client.stdin.flush()
        finally:
            resume.join()
        client.stdin.write("check\n")  # once the master runs again
        client.stdin.flush()
        code, exists = map(int, client.stdout.readline().split())
        client.stdin.close()
        client.wait(30)
    return code, exists


def test_a_put_outlasts_a_master_pause_shorter_than_the_rpc_timeout_and_fails_on_a_longer_one() -> None:
    # The harness's store clients rely on MC_RPC_TIMEOUT_MS to ride out whole-VM freezes (Mooncake's
    # default is 30 s): a longer pause fails the put, a shorter one only delays it.
    from kvpolicy.harness.e2e import STORE_CLIENT_ENV

    with MooncakeMaster(client_ttl_s=120) as paused:
        failed, missing = _put_across_a_pause(paused, "short-timeout", rpc_timeout_ms=1500, pause_s=4)
        assert failed < 0 and missing == 0
        assert _put_across_a_pause(paused, "long-timeout", rpc_timeout_ms=20_000, pause_s=4) == (0, 1)
    assert int(STORE_CLIENT_ENV["MC_RPC_TIMEOUT_MS"]) >= 2 * 60_000, "below twice the longest freeze measured here"
