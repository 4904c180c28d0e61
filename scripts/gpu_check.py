#!/usr/bin/env python3
"""The device-memory paths of kvpolicy, exercised on whatever device torch offers, without vLLM.

    python scripts/gpu_check.py                  # cuda when torch sees a GPU, else cpu
    python scripts/gpu_check.py --device cpu     # what CI runs (tests/packaging/test_gpu_check.py)
    python scripts/gpu_check.py --format json    # one JSON document instead of the table

Each check moves real bytes and compares them byte for byte:

- ``audit``: the replication audit's block reader (:mod:`kvpolicy.device.blocks`) on device KV tensors in
  bf16 and fp8 (e4m3, e5m2; stored as ``uint8`` as vLLM stores them): digests equal to the host path's,
  a replica agrees, a distinct shard and a one-ulp replica differ in digest, and their sampled values are
  apart by more than, and within, the format's tolerance.
- ``striped``: a ``load: striped`` load between two processes through the product's
  :class:`~kvpolicy.device.striped.StripedReadStore`: each reads its stripe from Mooncake into device KV
  tensors, gathers it into one staging buffer, and exchanges it with the other over gloo; every block
  must hold its object's bytes, and each rank must receive no more than its share. (On CPU tensors the
  check forces the device path: device staging copied to and from the host once per piece.)
- ``mooncake``: a loopback ``mooncake_master`` and a store client; device tensors registered with
  ``register_buffer``, written with ``batch_put_from_multi_buffers`` from several regions per key and read
  back with ``batch_get_into_multi_buffers`` into other device tensors (Mooncake reads and writes device
  memory itself: GPUDirect RDMA, or staged by its TCP transport).

A check whose part is missing here (no Mooncake build importable, say) is ``skipped`` with the reason; with
``--strict`` (CI) a skip fails the run. Exit status: 0 when every check passed, 1 when one read a wrong byte
or failed, 2 on bad arguments.

On a GPU host, from a checkout: ``pip install '.[vllm]'`` brings torch with CUDA and Mooncake's CUDA 13 build;
then ``python scripts/gpu_check.py``. Everything it needs beside torch is kvpolicy's core (pydantic, PyYAML)
and ``mooncake-transfer-engine-cuda13``; vLLM is not imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Outcome = Literal["passed", "failed", "skipped"]

REPORT_KIND = "GpuCheckReport"
REPORT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class CheckResult:
    name: str
    outcome: Outcome
    detail: str
    """What was moved and compared, or why it failed or was skipped."""
    seconds: float


class Skip(Exception):
    """A part this check needs is not here (not a wrong byte)."""


class WrongBytes(AssertionError):
    """A check read back bytes that differ from what was written."""


def pick_device(requested: str) -> Any:
    import torch

    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: error: --device {requested}: torch {torch.__version__} sees no CUDA device")
    return device


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
        raise Skip(f"mooncake.store does not import: {error} (kvpolicy doctor says which library is missing)")
    from kvpolicy.mooncake.master import MooncakeMaster, MooncakeUnavailable

    try:
        master = MooncakeMaster().start()
    except MooncakeUnavailable as error:
        raise Skip(f"no mooncake_master: {error}")
    try:
        yield master
    finally:
        master.stop()


@contextlib.contextmanager
def loopback_stores() -> Iterator[tuple[Any, Any]]:
    """Two store clients of a loopback master, closed on exit: whichever segment an object lands in, one
    of the two moves it through the transfer engine rather than a local copy."""
    from kvpolicy.mooncake.client import store_client

    with loopback_master() as master:
        config = master.client_config(segment_mib=32)
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


def check_mooncake(device: Any) -> str:
    """Put from a registered device tensor with one client, get into another registered device tensor with a
    second client, compare."""
    import torch

    region_count = MOONCAKE_KEYS * MOONCAKE_REGIONS_PER_KEY
    source = random_bytes(region_count * MOONCAKE_REGION_BYTES, seed=1, device=device)
    target = torch.zeros_like(source)
    keys = [f"gpu-check@{device.type}@{index}" for index in range(MOONCAKE_KEYS)]
    sizes = [[MOONCAKE_REGION_BYTES] * MOONCAKE_REGIONS_PER_KEY for _ in keys]

    def regions(base: int) -> list[list[int]]:
        # Key k's i-th region is region i * keys + k: a key's bytes are not one span, as in a layer-outermost cache.
        return [
            [base + (part * MOONCAKE_KEYS + key) * MOONCAKE_REGION_BYTES for part in range(MOONCAKE_REGIONS_PER_KEY)]
            for key in range(MOONCAKE_KEYS)
        ]

    with loopback_stores() as (writer, reader), registered(writer, source), registered(reader, target):
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
    return (
        f"{MOONCAKE_KEYS} keys x {MOONCAKE_REGIONS_PER_KEY} interleaved regions of {MOONCAKE_REGION_BYTES // 1024} KiB "
        f"put from and read into registered {device.type} tensors by two clients: {source.numel()} bytes equal"
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
    path reads the same bytes as the host path."""
    import torch

    from kvpolicy.audit import relative_distance, value_comparison
    from kvpolicy.device.blocks import BlockReader, local_digests, local_samples

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
        host = local_digests([LayerOutermostBlocks(host_layers)], BlockReader(dict(zip(host_names, host_layers))), audited)[0]
        if digests["rank 0"] != host:
            raise WrongBytes(f"{cache_dtype}: the {device.type} reader digests other bytes than the host reader")
        if digests["replica"] != digests["rank 0"]:
            raise WrongBytes(f"{cache_dtype}: equal bytes on two {device.type} caches digest differently")
        if digests["shard"] == digests["rank 0"] or digests["one ulp"] == digests["rank 0"]:
            raise WrongBytes(f"{cache_dtype}: different bytes digest alike")

        def values(name: str) -> list[float]:
            return list(torch.frombuffer(bytearray(samples[name]), dtype=torch.float32).tolist())

        shard = relative_distance(values("rank 0"), values("shard"))
        ulp = relative_distance(values("rank 0"), values("one ulp"))
        if shard <= comparison.tolerance:
            raise WrongBytes(f"{cache_dtype}: a distinct shard is {shard:.3f} apart, within tolerance {comparison.tolerance}")
        if not 0 < ulp <= comparison.tolerance:
            raise WrongBytes(f"{cache_dtype}: one ulp is {ulp:.4f} apart, tolerance {comparison.tolerance}")
        lines.append(f"{cache_dtype} as {number_type}: shard {shard:.2f}, one ulp {ulp:.3f} <= {comparison.tolerance:g}")
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


def striped_rank(rank: int, device_name: str, master: str, init_method: str, prefix: str, outcome: Any) -> None:
    """One TP rank in a process of its own: device KV tensors registered with a Mooncake client, a striped
    load through the product's StripedReadStore, stripes exchanged with the other rank over gloo."""
    import torch

    from kvpolicy.device.striped import KVStorages, StripedReadStore, gloo_exchange
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
        store = StripedReadStore(
            client, tp_rank=rank, group_of_key=lambda key: 0, replica_set_of=lambda group: tuple(range(STRIPED_RANKS)),
            exchange=gloo_exchange(list(range(STRIPED_RANKS)), timeout_s=60), storages=KVStorages(tensors),
            # On CPU tensors, take the path a GPU takes (device staging, one copy to and from the host).
            stage_through_host=True if device.type == "cpu" else None,
        )
        keys, addrs, sizes = striped_request(prefix, tensors)
        results = list(store.batch_get_into_multi_buffers(keys, addrs, sizes))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wrong = []
        for chunk, key in enumerate(keys):
            got = b"".join(bytes(tensor[2 * chunk + 1].cpu().numpy()) for tensor in tensors)
            if results[chunk] < 0 or got != striped_object(key):
                wrong.append(f"{key} (result {results[chunk]})")
        torch.distributed.barrier()
        for tensor in tensors:
            client.unregister_buffer(tensor.data_ptr())
        outcome.put((rank, wrong, dataclasses.asdict(store.counts)))
    except BaseException as error:
        outcome.put((rank, [f"{type(error).__name__}: {error}"], {}))
        raise
    finally:
        client.close()
        torch.distributed.destroy_process_group()


def check_striped(device: Any) -> str:
    """A striped load between two processes: each rank reads its stripe of a replicated group from Mooncake
    into device KV tensors and receives the other's stripe over gloo, staged through one buffer per piece."""
    import multiprocessing
    import tempfile
    import uuid

    from kvpolicy.mooncake.client import store_client

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
                context.Process(target=striped_rank, args=(rank, str(device), master.rpc_address, init, prefix, outcome))
                for rank in range(STRIPED_RANKS)
            ]
            for process in processes:
                process.start()
            try:
                reports = sorted(outcome.get(timeout=180) for _ in processes)
            finally:
                for process in processes:
                    process.join(60)
                    if process.is_alive():
                        process.kill()
    wrong = [problem for _, problems, _ in reports for problem in problems]
    if wrong:
        raise WrongBytes(f"{len(wrong)} keys wrong or failed, first: {wrong[0]}")
    parts = []
    for rank, _, counts in reports:
        ratio = counts["bytes_received"] / counts["bytes_loaded"]
        if ratio > (STRIPED_RANKS - 1) / STRIPED_RANKS + 1 / STRIPED_KEYS:
            raise WrongBytes(f"rank {rank} received {ratio:.2f} of its load, more than its share")
        parts.append(
            f"rank {rank}: read {counts['keys_read']}, received {counts['keys_received']} ({ratio:.2f} of the load), "
            f"{counts['device_to_host_copies']}+{counts['host_to_device_copies']} bulk copies"
        )
    return f"{STRIPED_KEYS} keys x {STRIPED_LAYERS} layers of {STRIPED_BLOCK_BYTES // 1024} KiB, replica set of 2 over gloo; " + "; ".join(parts)


CHECKS: dict[str, Callable[[Any], str]] = {
    "mooncake": check_mooncake,
    "audit": check_audit,
    "striped": check_striped,
}


def run_check(name: str, check: Callable[[Any], str], device: Any) -> CheckResult:
    started = time.perf_counter()
    try:
        detail = check(device)
        outcome: Outcome = "passed"
    except Skip as skip:
        detail, outcome = str(skip), "skipped"
    except WrongBytes as wrong:
        detail, outcome = str(wrong), "failed"
    except Exception as error:  # a check that crashed is a failure, shown with where it happened
        where = traceback.extract_tb(error.__traceback__)[-1]
        detail, outcome = f"{type(error).__name__}: {error} ({Path(where.filename).name}:{where.lineno})", "failed"
    return CheckResult(name, outcome, detail, round(time.perf_counter() - started, 3))


def describe_device(device: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
    return info


def table(info: dict[str, Any], results: list[CheckResult]) -> str:
    lines = [" ".join(f"{key}={value}" for key, value in info.items()), "", "| check | outcome | s | detail |", "|---|---|---:|---|"]
    lines += [f"| {r.name} | {r.outcome} | {r.seconds:.2f} | {r.detail} |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="torch device: auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--only", action="append", choices=sorted(CHECKS), help="run only these checks")
    parser.add_argument("--strict", action="store_true", help="a skipped check fails the run (CI)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)

    device = pick_device(args.device)
    names = args.only or list(CHECKS)
    results = [run_check(name, CHECKS[name], device) for name in names]
    info = describe_device(device)
    if args.format == "json":
        document = {"kind": REPORT_KIND, "version": REPORT_VERSION, **info,
                    "checks": [dataclasses.asdict(result) for result in results]}
        print(json.dumps(document, indent=2))
    else:
        print(table(info, results))
    bad = [r for r in results if r.outcome == "failed" or (args.strict and r.outcome == "skipped")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
