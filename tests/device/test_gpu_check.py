"""scripts/gpu_check.py, the GPU host's check, as CI runs it (``--device cpu``) and as it must fail."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import require

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    require("torch")
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_check_passes_on_cpu_tensors_with_nothing_skipped() -> None:
    require("mooncake.store")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--strict", "--format", "json"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["kind"], report["version"], report["device"]) == ("GpuCheckReport", 1, "cpu")
    outcomes = {check["name"]: check["outcome"] for check in report["checks"]}
    assert outcomes == {"mooncake": "passed", "audit": "passed", "striped": "passed"}


class FlipFirstByteAfterGet:
    """A store client that reads as the real one does, then flips the first byte it wrote: a wrong byte."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> Any:
        results = self._store.batch_get_into_multi_buffers(keys, addrs, sizes)
        first = ctypes.c_uint8.from_address(addrs[0][0])
        first.value ^= 0xFF
        return results


def test_a_wrong_byte_read_back_fails_the_mooncake_check(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    require("mooncake.store")
    real = gpu_check.loopback_stores

    @contextlib.contextmanager
    def corrupting() -> Iterator[tuple[Any, Any]]:
        with real() as (writer, reader):
            yield writer, FlipFirstByteAfterGet(reader)

    monkeypatch.setattr(gpu_check, "loopback_stores", corrupting)
    result = gpu_check.run_check("mooncake", gpu_check.check_mooncake, gpu_check.pick_device("cpu"))
    assert result.outcome == "failed"
    assert "byte 0 is" in result.detail


def test_a_failed_check_makes_the_exit_status_one(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong(device: Any) -> str:
        raise gpu_check.WrongBytes("byte 3 is 7, 9 was written")

    monkeypatch.setattr(gpu_check, "CHECKS", {"wrong": wrong})
    assert gpu_check.main(["--device", "cpu"]) == 1


def test_a_skipped_check_passes_unless_strict(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(device: Any) -> str:
        raise gpu_check.Skip("mooncake.store does not import")

    monkeypatch.setattr(gpu_check, "CHECKS", {"missing": missing})
    assert gpu_check.main(["--device", "cpu"]) == 0
    assert gpu_check.main(["--device", "cpu", "--strict"]) == 1


def test_the_audit_check_fails_when_a_replica_holds_other_bytes(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    real = gpu_check.make_cache
    calls: list[int] = []

    def second_cache_differs(number_type: str, stored: str, *, seed: int, device: Any, nudge_ulp: bool = False) -> Any:
        calls.append(seed)
        # The second cache of each format is the replica of rank 0 (same seed): give it other values.
        other = seed + 1000 if len(calls) % 4 == 2 else seed
        return real(number_type, stored, seed=other, device=device, nudge_ulp=nudge_ulp)

    monkeypatch.setattr(gpu_check, "make_cache", second_cache_differs)
    result = gpu_check.run_check("audit", gpu_check.check_audit, gpu_check.pick_device("cpu"))
    assert (result.outcome, "digest differently" in result.detail) == ("failed", True), result.detail


def test_a_cuda_device_without_a_gpu_is_refused_in_one_line(gpu_check: ModuleType) -> None:
    torch = require("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot be shown")
    with pytest.raises(SystemExit, match="sees no CUDA device"):
        gpu_check.pick_device("cuda")
