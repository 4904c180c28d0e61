"""The connector against vLLM 0.33, the release GPU users run: its unit and equivalence tests run again
with 0.33's classes first on the path.

vLLM 0.33's package (the GPU build) pins a CUDA torch, so ``scripts/bootstrap.sh`` installs it without
its dependencies into ``<venv>/vllm-0.33``, next to the venv's CPU torch; on CPU it imports, which is all
these tests need. They run in a child pytest (one interpreter cannot hold two vLLMs): the layout
adapter, factors, keys and token databases against 0.33's own ``MooncakeStoreWorker`` methods, the
rebuilt ``__init__``'s drift check, config resolution, TP-sharded store objects, the hybrid block sizes,
the metrics (on simulated ranks through a real master), the version check, and what the replication audit
compares on quantized KV caches (vLLM's fp8 mapping).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import unavailable

REPO = Path(__file__).resolve().parents[2]
VLLM_033 = Path(os.environ.get("KVPOLICY_VLLM_033", Path(sys.prefix) / "vllm-0.33"))
SUITE = (
    "tests/connector/test_vllm_version.py",
    "tests/connector/test_layout_adapter.py",
    "tests/connector/test_compat_equivalence.py",
    "tests/connector/test_connector_config.py",
    "tests/connector/test_standalone_worker.py",
    "tests/connector/test_store_tp_layouts.py",
    "tests/connector/test_hybrid_block_sizes.py",
    "tests/connector/test_connector_metrics.py",
    "tests/connector/test_merged_saves.py",
    "tests/connector/test_minimal_lookup.py",
    "tests/connector/test_audit_cache_dtypes.py",
)


def test_the_connector_suite_passes_against_vllm_0_33() -> None:
    if not (VLLM_033 / "vllm" / "__init__.py").is_file():
        unavailable(f"vLLM 0.33 is not installed in {VLLM_033} (scripts/bootstrap.sh installs it)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(VLLM_033), str(REPO)]),
        "KVPOLICY_EXPECT_VLLM": "0.33",
        # The GPU package infers no platform on a machine without GPUs; vLLM's own switch selects its CPU one.
        "VLLM_TARGET_DEVICE": "cpu",
        "CI": os.environ.get("CI", ""),
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUITE],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    print(f"against vLLM 0.33: {summary}")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
