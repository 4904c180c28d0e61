"""Getting started's "Serve a model and see a hit", run as the page shows it.

The section's ``bash`` blocks (its CPU tab, not its GPU one) are joined into one script and run by bash,
with ``MODEL`` a tiny local Llama instead of a model from the hub, and the page's ports (8000, 50051,
9003) replaced by free ones. The last block's ``grep`` of ``/metrics`` must show a store hit: a positive
``vllm:external_prefix_cache_hits_total``. A real ``mooncake_master`` and a real OpenAI server (vLLM's CPU
build), about 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from conftest import require, unavailable

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
SECTION = "## Serve a model and see a hit"
PORTS = ("8000", "50051", "9003")


def quickstart_blocks(page: Path = PAGE) -> list[str]:
    """The section's ``bash`` blocks in order, dedented; in a tab, only the CPU tab's."""
    text = page.read_text(encoding="utf-8").split(f"{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    blocks, tab = [], None
    for found in re.finditer(r'^=== "([^"]+)"|^(?P<indent>[ ]*)```bash\n(?P<body>.*?)^(?P=indent)```$', text,
                             re.MULTILINE | re.DOTALL):
        if found.group(1) is not None:
            tab = found.group(1)
            continue
        indent = found.group("indent")
        if indent and tab is not None and "CPU" not in tab:
            continue
        if not indent:
            tab = None
        blocks.append("".join(line.removeprefix(indent) for line in found.group("body").splitlines(keepends=True)))
    return blocks


def test_the_quickstart_serves_sends_twice_and_shows_the_metrics() -> None:
    blocks = quickstart_blocks()
    script = "\n".join(blocks)
    assert len(blocks) == 4 and "vllm serve" not in script and "vllm.entrypoints.openai.api_server" in script
    assert script.count("curl -s localhost:8000/v1/completions") == 1 and "for request in first second" in script
    assert "--no-enable-prefix-caching" in script and "kvpolicy vllm-config --policy default" in script
    assert blocks[-1].startswith("curl -s localhost:8000/metrics | grep")


def test_the_quickstart_runs_and_the_second_request_hits_the_store(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[cpu]' on CPUs)")
    require("mooncake.store")
    from kvpolicy.harness.tinymodel import make_tiny_llama
    from kvpolicy.mooncake.master import find_master_binary, free_ports

    if shutil.which("curl") is None:
        unavailable("curl is not installed")
    model = make_tiny_llama(tmp_path / "tiny-llama", num_kv_heads=1)
    script = "\n".join(quickstart_blocks())
    for port, free in zip(PORTS, free_ports(len(PORTS)), strict=True):
        script = script.replace(port, str(free))
    script = script.replace("export MODEL=Qwen/Qwen3-0.6B", f"export MODEL={model}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "PATH": f"{Path(find_master_binary()).parent}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    process = subprocess.Popen(
        ["bash", "-c", f"set -eu\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n{script}"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    log = (tmp_path / "server.log").read_text(errors="replace") if (tmp_path / "server.log").exists() else ""
    print("\n".join(line for line in output.splitlines() if line.startswith("vllm:")))
    hits = re.search(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", output, re.MULTILINE)
    assert process.returncode == 0 and hits, f"{output[-3000:]}\nserver log tail:\n{log[-3000:]}"
    assert float(hits.group(1)) > 0, output
    assert re.search(r"^vllm:kvpolicy_objects_written_total\{", output, re.MULTILINE), output
