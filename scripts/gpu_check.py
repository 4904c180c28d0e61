#!/usr/bin/env python3
"""The device-memory paths of kvpolicy, exercised on whatever device torch offers, without vLLM.

    python scripts/gpu_check.py                  # cuda when torch sees a GPU, else cpu
    python scripts/gpu_check.py --device cpu     # what CI runs (tests/packaging/test_gpu_check.py)
    python scripts/gpu_check.py --format json    # one JSON document instead of the table

Each check moves real bytes and compares them byte for byte:

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
def loopback_stores() -> Iterator[tuple[Any, Any]]:
    """A Mooncake master on 127.0.0.1 and two store clients of it, all stopped on exit: whichever segment
    an object lands in, one of the two moves it through the transfer engine rather than a local copy."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as error:
        raise Skip(f"mooncake.store does not import: {error} (kvpolicy doctor says which library is missing)")
    from kvpolicy.mooncake.client import store_client
    from kvpolicy.mooncake.master import MooncakeMaster, MooncakeUnavailable

    try:
        master = MooncakeMaster().start()
    except MooncakeUnavailable as error:
        raise Skip(f"no mooncake_master: {error}")
    try:
        config = master.client_config(segment_mib=32)
        with store_client(config) as writer, store_client(config) as reader:
            yield writer, reader
    finally:
        master.stop()


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


CHECKS: dict[str, Callable[[Any], str]] = {
    "mooncake": check_mooncake,
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
