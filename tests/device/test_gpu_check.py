"""scripts/gpu_check.py, the GPU host's check, as CI runs it (``--device cpu``) and as it must fail."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import subprocess
import sys
import threading
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
    assert (report["kind"], report["version"], report["devices"]) == ("GpuCheckReport", 2, [{"device": "cpu"}])
    outcomes = {check["name"]: check["outcome"] for check in report["checks"]}
    assert {name: outcomes.pop(name) for name in ("mooncake", "audit", "striped")} == dict.fromkeys(
        ("mooncake", "audit", "striped"), "passed"
    )
    # The two-GPU check cannot apply to a CPU; RDMA applies where the host has a device.
    assert outcomes["striped-nccl"] == "not applicable"
    assert outcomes["rdma"] == ("not applicable" if not Path("/sys/class/infiniband").is_dir() else "passed")
    assert report["verdict"].startswith("passed")
    (striped,) = [check for check in report["checks"] if check["name"] == "striped"]
    assert "on a worker thread" in striped["detail"]


def test_a_worker_thread_runs_the_load_off_the_main_thread_and_hands_back_its_error(gpu_check: ModuleType) -> None:
    assert gpu_check.on_worker_thread(lambda: threading.current_thread() is threading.main_thread()) is False

    def fails() -> None:
        raise gpu_check.WrongBytes("byte 1 is 2, 3 was written")

    with pytest.raises(gpu_check.WrongBytes, match="byte 1"):
        gpu_check.on_worker_thread(fails)


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


def test_a_check_needing_two_gpus_is_not_applicable_on_one_device_and_passes_strict(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = gpu_check.run_check("striped-nccl", gpu_check.check_striped_nccl, [gpu_check.pick_device("cpu")])
    assert (result.outcome, result.detail) == ("not applicable", "needs two GPUs; 0 checked here")
    monkeypatch.setattr(gpu_check, "CHECKS", {"striped-nccl": gpu_check.CHECKS["striped-nccl"]})
    assert gpu_check.main(["--device", "cpu", "--strict"]) == 0


def test_every_visible_gpu_is_checked_once_per_device_check(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = require("torch")
    # A host with three GPUs cannot exist on this CPU machine: torch's answers stand in for it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    devices = gpu_check.pick_devices("auto")
    assert [str(device) for device in devices] == ["cuda:0", "cuda:1", "cuda:2"]
    seen: list[str] = []
    monkeypatch.setattr(gpu_check, "CHECKS", {
        "each": lambda device: seen.append(str(device)) or "ok",
        "across": gpu_check.Check(lambda targets: seen.append(",".join(map(str, targets))) or "ok", across=True),
    })
    results = gpu_check.run_checks(["each", "across"], devices)
    assert seen == ["cuda:0", "cuda:1", "cuda:2", "cuda:0,cuda:1,cuda:2"]
    assert [(result.name, result.device) for result in results] == [
        ("each", "cuda:0"), ("each", "cuda:1"), ("each", "cuda:2"), ("across", "cuda:0,cuda:1,cuda:2")
    ]


def test_the_report_file_has_the_date_the_versions_and_each_checks_verdict(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    torch = require("torch")
    report = tmp_path / "gpu-check.md"
    assert gpu_check.main(["--device", "cpu", "--only", "audit", "--only", "striped-nccl", "--report", str(report)]) == 0
    text = report.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("#### 20") and lines[0].endswith("scripts/gpu_check.py on cpu")
    for field in ("date: 20", "kvpolicy: 0.", "python: 3.", f"torch: {torch.__version__}", "devices: cpu", "command: "):
        assert any(line.startswith(f"- {field}") for line in lines), field
    assert "| audit | cpu | passed |" in text
    assert "| striped-nccl | cpu | not applicable |" in text
    assert lines[-1] == "Verdict: passed (1 passed, 0 failed, 0 skipped, 1 not applicable)."


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
