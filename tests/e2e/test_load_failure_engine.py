"""End to end: a load that fails never fails the request. The store may lose an object between the lookup
that hit it and the load that reads it (Mooncake's eviction under memory pressure, a segment host gone);
with the ``--kv-transfer-config`` line ``kvpolicy vllm-config`` prints (``kv_load_failure_policy:
recompute``) vLLM recomputes those blocks and the request completes with the cold tokens.

A real Mooncake master and segment holder, two TP=1 engines in fresh processes (about 20 s each on 2
cores): a cold one stores a 109-token prompt; in the warm one a test-only vLLM plugin
(``load_failure_plugin/remove_after_lookup.py``) removes the prompt's objects right after the lookup hit
them, so the load that follows finds nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")

from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.harness.e2e import fixed_prompt, serve_once  # noqa: E402
from kvpolicy.harness.tinymodel import make_tiny_llama  # noqa: E402

PLUGIN = Path(__file__).resolve().parent / "load_failure_plugin"
PROMPT = fixed_prompt(109)
MAX_TOKENS = 8
LOGPROBS = 5
LOGPROB_TOLERANCE = 1e-4
"""Recomputed vs cold at the same TP: the same kernels on the same tokens (observed 0.0)."""


def test_an_object_removed_between_a_lookups_hit_and_its_load_is_recomputed_with_the_cold_tokens(
    e2e_store_config: Path, tmp_path: Path
) -> None:
    model = make_tiny_llama(tmp_path / "removed-after-lookup-llama", num_kv_heads=1)
    config = KVPolicySettings(kvpolicy="default").kv_transfer_config()  # the line kvpolicy vllm-config prints
    assert config["kv_load_failure_policy"] == "recompute"
    cold = serve_once(
        model, PROMPT, tp_size=1, kv_transfer_config=config, mooncake_config_path=e2e_store_config,
        max_tokens=MAX_TOKENS, logprobs=LOGPROBS,
    )
    warm = serve_once(
        model, PROMPT, tp_size=1, kv_transfer_config=config, mooncake_config_path=e2e_store_config,
        max_tokens=MAX_TOKENS, logprobs=LOGPROBS, python_path=[PLUGIN],
        extra_env={"KVPOLICY_E2E_REMOVE_AFTER_LOOKUP": "1"},
    )
    removed = [line for line in warm.stderr.splitlines() if line.startswith("KVPOLICY_E2E_REMOVED ")]
    assert removed and int(removed[0].split()[1]) > 0, warm.stderr[-3000:]  # the lookup hit, then lost them
    assert warm.tokens == cold.tokens and len(warm.tokens) == MAX_TOKENS
    assert warm.max_logprob_diff(cold) <= LOGPROB_TOLERANCE
