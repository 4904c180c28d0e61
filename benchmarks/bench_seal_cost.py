"""Store protection: what keyed namespaces and sealed objects cost on the CPU data path vs raw Mooncake.

One Mooncake master on 127.0.0.1 and two store clients (a writer and a reader, as a saving and a loading
instance), each with its host buffer registered (``register_buffer``). Per object size, ``--objects`` objects
of ``--regions`` layer regions each, laid out layer-outermost as vLLM's KV caches are (region ``i`` of object
``k`` at ``(i * objects + k) * region``: an object is not one span), are written with ONE
``batch_put_from_multi_buffers`` from the writer's buffer and read back with ONE
``batch_get_into_multi_buffers`` into the reader's, as vLLM's transfer threads call them, through four paths:

* **raw** — the Mooncake clients themselves (the baseline);
* **keyed** — :class:`kvpolicy.runtime.trust.ProtectedStore` with keyed namespaces only: each key's chunk part
  becomes an HMAC of the logical key (one HMAC of ~100 bytes per key per call);
* **keyed+sealed** — keyed and sealed: each put also computes an HMAC-SHA256 over the object's physical key
  and every region's bytes, and appends it as one more 32-byte region (from the wrapper's own registered seal
  slots); each get reads that region too and recomputes the HMAC over the bytes it landed;
* **sealed** — sealed only (keys unchanged).

Every repetition runs the four paths in turn (the order rotated every two repetitions and reversed every other
one, so that each path runs in every position and after each of the others), each under fresh keys (Mooncake keeps the first write
of a key), put then get, and removes the objects afterwards (forced, untimed). Before the timed repetitions,
one untimed warm-up per path checks that every get returns every object's bytes (the reader's buffer compared
with the writer's) and its size (sealed paths: without the seal). A repetition in which any transfer fails
(Mooncake's TCP transport under load) is dropped, listed and replaced. Reported per size and path: median put
and get times, MiB/s, and x/raw = raw time / path time, the median of the per-repetition ratios (the fraction
of raw throughput the path keeps; 1.00 = free) with a bootstrap 95% CI.

A second table holds the host's pure costs, no store: HMAC-SHA256 over the same objects (what a seal is, one
object after another on one thread, the bytes read from the same registered buffer), its throughput, that time
as a fraction of the raw put and of the raw get, and keying's HMACs of the keys (``Namespaces.physical``).

CPU path only: ``ProtectedStore`` reads host memory at the addresses vLLM hands over; a GPU KV cache's path is
not measured here.

    python benchmarks/bench_seal_cost.py [--sizes-kib 16 256 2048] [--objects 64] [--regions 8] [--repeat 21]
        [--segment-mib N] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import hmac
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, median_ci, table

from kvpolicy.language.keys import chunk_key

MODES = ("raw", "keyed", "keyed+sealed", "sealed")
MiB = 1024 * 1024


class TransferFailed(RuntimeError):
    """A Mooncake transfer of one repetition failed."""


class Buffer:
    """``size`` bytes of host memory at a fixed address, registered with a store client while in use."""

    def __init__(self, size: int) -> None:
        self.memory = ctypes.create_string_buffer(size)
        self.address = ctypes.addressof(self.memory)
        self.size = size

    def fill(self, seed: int) -> None:
        data = random.Random(seed).randbytes(self.size)
        ctypes.memmove(self.address, data, self.size)

    def clear(self) -> None:
        ctypes.memset(self.address, 0, self.size)

    def bytes(self) -> bytes:
        return ctypes.string_at(self.address, self.size)


def layout(base: int, objects: int, regions: int, region: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per object, the addresses and sizes of its regions: layer-outermost, as vLLM's caches are laid out."""
    addrs = [[base + (layer * objects + index) * region for layer in range(regions)] for index in range(objects)]
    return addrs, [[region] * regions for _ in range(objects)]


def keys_for(run: str, size_kib: int, mode: str, rep: str, objects: int) -> list[str]:
    """Fresh logical keys for one path's repetition: a vLLM-like namespace and a 64-hex-digit chunk hash."""
    namespace = f"kvpolicy-bench-seal/{run}/{size_kib}k/{mode}/{rep}"
    return [chunk_key(namespace, hashlib.sha256(f"{namespace}#{index}".encode()).hexdigest()) for index in range(objects)]


def timed(call: Callable[[], Sequence[int]], check: Callable[[list[int]], str | None]) -> float:
    started = time.perf_counter()
    codes = list(call())
    elapsed = time.perf_counter() - started
    problem = check(codes)
    if problem:
        raise TransferFailed(problem)
    return elapsed


def rotation(turn: int) -> tuple[str, ...]:
    """The paths' order in repetition ``turn``: rotated every two repetitions and reversed every other one, so
    that every path runs in every position and after different paths (a path's cost may linger into the next)."""
    shift = (turn // 2) % len(MODES)
    order = MODES[shift:] + MODES[:shift]
    return order[::-1] if turn % 2 else order


def run_size(size_kib: int, args: argparse.Namespace, writer: Any, reader: Any, run: str) -> dict[str, Any]:
    from kvpolicy.runtime.trust import DeploymentSecret, Keyring, Namespaces, ProtectedStore, host_memory

    objects, regions = args.objects, args.regions
    object_bytes = size_kib * 1024
    if object_bytes % regions:
        raise SystemExit(f"{size_kib} KiB does not split into {regions} equal regions")
    region = object_bytes // regions
    total = object_bytes * objects
    source, target = Buffer(total), Buffer(total)
    source.fill(seed=size_kib)
    secret = DeploymentSecret(os.urandom(32))
    namespaces = {
        "keyed": Namespaces(secret, keyed=True, sealed=False),
        "keyed+sealed": Namespaces(secret, keyed=True, sealed=True),
        "sealed": Namespaces(secret, keyed=False, sealed=True),
    }
    put_addrs, sizes = layout(source.address, objects, regions, region)
    get_addrs, _ = layout(target.address, objects, regions, region)

    if writer.register_buffer(source.address, total) != 0 or reader.register_buffer(target.address, total) != 0:
        raise SystemExit("register_buffer refused a host buffer")
    # One wrapper per client and path, as the connector has one per transfer thread (each with its seal slots).
    putters: dict[str, Any] = {"raw": writer}
    getters: dict[str, Any] = {"raw": reader}
    for mode, spaces in namespaces.items():
        putters[mode] = ProtectedStore(writer, Keyring(spaces))
        getters[mode] = ProtectedStore(reader, Keyring(spaces))

    def put_ok(codes: list[int]) -> str | None:
        bad = sorted({code for code in codes if code != 0})
        return f"put: {sum(code != 0 for code in codes)} of {objects} keys failed (codes {bad})" if bad else None

    def get_ok(codes: list[int]) -> str | None:
        bad = sorted({code for code in codes if code != object_bytes})
        if bad:
            return f"get: {sum(code != object_bytes for code in codes)} of {objects} keys wrong (codes/sizes {bad})"
        return None

    def one(mode: str, rep: str) -> tuple[float, float]:
        keys = keys_for(run, size_kib, mode, rep, objects)
        try:
            put = timed(lambda: putters[mode].batch_put_from_multi_buffers(keys, put_addrs, sizes), put_ok)
            get = timed(lambda: getters[mode].batch_get_into_multi_buffers(keys, get_addrs, sizes), get_ok)
        finally:
            writer.remove_all(True)
        return put, get

    times: dict[str, dict[str, list[float]]] = {op: {mode: [] for mode in MODES} for op in ("put", "get")}
    failures: list[str] = []
    checks: dict[str, bool] = {}
    try:
        expected = source.bytes()
        for mode in MODES:  # warm-up: seal slots registered, first-call costs paid, bytes checked
            target.clear()
            one(mode, "warmup")
            checks[mode] = target.bytes() == expected
        del expected
        attempt = 0
        while len(times["put"]["raw"]) < args.repeat:
            attempt += 1
            order = rotation(len(times["put"]["raw"]))
            try:
                measured = {mode: one(mode, f"r{attempt}") for mode in order}
            except TransferFailed as error:
                failures.append(f"{size_kib} KiB, repetition {attempt}: {error}")
                if len(failures) > args.repeat:
                    raise
                continue
            for mode, (put, get) in measured.items():
                times["put"][mode].append(put)
                times["get"][mode].append(get)

        # The host's own costs, no store: a seal's HMAC over the same regions, and keying's HMAC per key.
        seal_key = secret.derive("bench/seal")
        physical_keys = keys_for(run, size_kib, "sealed", "hmac", objects)
        views = [[host_memory(address, length) for address, length in zip(a, s, strict=True)] for a, s in
                 zip(put_addrs, sizes, strict=True)]

        def seal_all() -> None:
            for key, object_views in zip(physical_keys, views, strict=True):
                encoded = key.encode()
                mac = hmac.new(seal_key, len(encoded).to_bytes(4, "big") + encoded, hashlib.sha256)
                for view in object_views:
                    mac.update(view)
                mac.digest()

        keying = namespaces["keyed"]
        hmac_times, key_times = [], []
        seal_all()  # untimed: the source's pages in the cache as a transfer thread would find them
        for _ in range(args.repeat):
            started = time.perf_counter()
            seal_all()
            hmac_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            for key in physical_keys:
                keying.physical(key)
            key_times.append(time.perf_counter() - started)
    finally:
        writer.unregister_buffer(source.address)
        reader.unregister_buffer(target.address)
        # The wrappers unregister their seal slots when they go: now, while the clients are open.
        putters.clear()
        getters.clear()
    return {
        "size_kib": size_kib,
        "objects": objects,
        "regions": regions,
        "batch_bytes": total,
        "times": times,
        "hmac_s": hmac_times,
        "keying_s": key_times,
        "checks": checks,
        "failures": failures,
    }


def ratio_cell(raw: list[float], path: list[float]) -> str:
    """Median of the per-repetition ratios raw / path, with its bootstrap 95% CI."""
    ratios = [r / p for r, p in zip(raw, path, strict=True)]
    low, high = median_ci(ratios)
    return f"{median(ratios):.2f} ({low:.2f}-{high:.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[16, 256, 2048], help="bytes per object, KiB")
    parser.add_argument("--objects", type=int, default=64, help="objects per batch call")
    parser.add_argument("--regions", type=int, default=8, help="layer regions per object")
    parser.add_argument("--repeat", type=int, default=21, help="timed repetitions per size (all four paths each)")
    parser.add_argument(
        "--segment-mib", type=int, default=None, help="store segment per client; default twice the largest batch"
    )
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    args = parser.parse_args(argv)

    from kvpolicy.mooncake import MooncakeMaster, store_client
    from kvpolicy.mooncake.native_log import native_stderr_to
    from kvpolicy.runtime.trust import SEAL_BYTES

    largest = max(args.sizes_kib) * 1024 * args.objects
    segment_mib = args.segment_mib or max(64, math.ceil(2 * largest / MiB))
    run = os.urandom(4).hex()
    started = time.monotonic()
    results = []
    log = Path(tempfile.gettempdir()) / "kvpolicy-bench-mooncake.log"
    with native_stderr_to(log), MooncakeMaster() as master:
        config = master.client_config(segment_mib=segment_mib)
        with store_client(config) as writer, store_client(config) as reader:
            for size_kib in args.sizes_kib:
                results.append(run_size(size_kib, args, writer, reader, run))
    elapsed = time.monotonic() - started

    rows, cost_rows = [], []
    for result in results:
        t = result["times"]
        size = result["batch_bytes"]
        label = f"{result['size_kib']} KiB"
        for mode in MODES:
            put_ratio = ratio_cell(t["put"]["raw"], t["put"][mode])
            get_ratio = ratio_cell(t["get"]["raw"], t["get"][mode])
            rows.append((
                label, mode, len(t["put"][mode]),
                f"{median(t['put'][mode]) * 1000:.2f}", f"{median(t['get'][mode]) * 1000:.2f}",
                f"{size / median(t['put'][mode]) / MiB:.0f}", f"{size / median(t['get'][mode]) / MiB:.0f}",
                "-" if mode == "raw" else put_ratio, "-" if mode == "raw" else get_ratio,
            ))
        seal = median(result["hmac_s"])
        cost_rows.append((
            label, result["objects"], f"{size / MiB:.1f}", f"{size / seal / MiB:.0f}", f"{seal * 1000:.2f}",
            f"{seal / median(t['put']['raw']):.2f}", f"{seal / median(t['get']['raw']):.2f}",
            f"{median(result['keying_s']) * 1e6 / result['objects']:.1f}",
        ))

    print(
        f"Store protection on the CPU data path: per object size, {args.objects} objects x {args.regions} layer "
        "regions (layer-outermost in one registered host buffer per client), ONE batch_put_from_multi_buffers "
        "(writer client) and ONE batch_get_into_multi_buffers (reader client) per path and repetition, "
        "Mooncake TCP on loopback; raw = the Mooncake clients, the others kvpolicy.runtime.trust.ProtectedStore "
        f"(keyed namespaces and/or sealed objects, {SEAL_BYTES} extra bytes per sealed object). Median of "
        f"{args.repeat} repetitions, the four paths in rotating and reversed order, fresh keys each; x/raw = raw time / path "
        "time (the fraction of raw throughput kept), median of per-repetition ratios (95% CI: bootstrap)."
    )
    print()
    print(table(
        ("object", "path", "reps", "put ms", "get ms", "put MiB/s", "get MiB/s", "put x/raw (95% CI)",
         "get x/raw (95% CI)"),
        rows,
    ))
    print()
    print(
        "The host's own costs, no store: HMAC-SHA256 over the same objects' regions, one object after another on "
        "one thread (a seal; sealed puts compute it before the transfer, sealed gets after it); seal / raw = that "
        "time over the raw put's and the raw get's median; keying = Namespaces.physical per key (one HMAC of the "
        "key)."
    )
    print()
    print(table(
        ("object", "objects", "MiB/batch", "HMAC MiB/s", "seal ms/batch", "seal / raw put", "seal / raw get",
         "keying us/key"),
        cost_rows,
    ))
    print()
    wrong = [f"{result['size_kib']} KiB {mode}" for result in results for mode, ok in result["checks"].items() if not ok]
    print(
        "warm-up gets byte for byte (every object's bytes in the reader's buffer, sizes without the seal): "
        + ("yes" if not wrong else "NO for " + ", ".join(wrong))
    )
    dropped = [failure for result in results for failure in result["failures"]]
    if dropped:
        print(f"{len(dropped)} repetition(s) dropped after a Mooncake transfer failure, and replaced:")
        for failure in dropped:
            print(f"  {failure}")
    print(
        f"({elapsed:.0f} s; {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{value:.1f}' for value in os.getloadavg())} at the end; GPU path not measured; "
        f"Mooncake client log: {log})"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
