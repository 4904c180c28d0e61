"""End to end: real vLLM engines on CPU, the KVPolicyConnector, a real Mooncake store.

Every engine runs in a fresh process (:func:`kvpolicy.harness.e2e.serve_once`), so the warm engine B
can only hit on objects the cold engine A left in the store. The model is a tiny random Llama
generated locally; greedy sampling over a fixed 109-token prompt (3 full 32-token chunks).

Each test gets its own model directory name: the model's basename is part of every store key, so
tests sharing one master and one segment holder never hit on each other's objects.

Runtime on 2 cores: a TP=1 engine takes about 20 s, a TP=2 engine 25 to 60 s (mostly Python
imports in the engine and its two workers); 9 engines in all.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")

from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.harness.e2e import (  # noqa: E402
    DEFAULT_BLOCK_SIZE,
    EngineFailed,
    EngineResult,
    fixed_prompt,
    serve_once,
)
from kvpolicy.harness.tinymodel import make_tiny_llama  # noqa: E402
from kvpolicy.language.keys import chunk_key  # noqa: E402
from kvpolicy.mooncake import MasterCounters, delta  # noqa: E402
from kvpolicy.mooncake.client import store_client  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.planning.contract import KeyContract  # noqa: E402
from kvpolicy.sim.scheduler import block_hashes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WRONG_POLICY = REPO / "examples" / "policies" / "wrong-attention-replicated.yaml"

PROMPT = fixed_prompt(109)
BLOCK_SIZE = DEFAULT_BLOCK_SIZE
FULL_CHUNKS = len(PROMPT) // BLOCK_SIZE
"""Chunks the store holds for the prompt: only full blocks are saved (the 8 decode tokens do not
complete a fourth block: 109 + 8 < 128)."""
CACHED_TOKENS = FULL_CHUNKS * BLOCK_SIZE
NUM_GROUPS = 1
"""A plain Llama has one KV-cache group (full attention)."""
MAX_TOKENS = 8
LOGPROBS = 20
"""vLLM's default max_logprobs; wide enough that the wrong policy's first step still shares
candidates with the right one, so the difference is a number rather than disjoint top-k sets."""
LOGPROB_TOLERANCE = 1e-4
"""Warm vs cold at the same TP. Observed: exactly 0.0 (same kernels, same bytes loaded back)."""
WRONG_MIN_DIFF = 0.05
"""The wrong policy must move some logprob by at least this much. Observed: 3.0 on the first step
(over the top-20 candidates both runs share), and a different token from the first step on."""
CROSS_TP_LOGPROB_TOLERANCE = 1e-3
"""Warm at TP 1 from KV a TP 2 engine wrote vs cold at TP 1: each TP 2 rank computes its heads' K
and V with its column slice of the projection, in other GEMM blocks than TP 1, so float32 rounding
may differ. Observed: 2.4e-6 (the same tokens)."""


def policy_config(policy: str | os.PathLike[str], **extra: Any) -> dict[str, Any]:
    """The connector's config with ``policy``; ``kvpolicy_*`` keys of ``extra`` are its settings, the
    others the Mooncake store connector's (``store_tp_size``)."""
    settings = {key: value for key, value in extra.items() if key.startswith("kvpolicy")}
    upstream = {key: value for key, value in extra.items() if not key.startswith("kvpolicy")}
    return KVPolicySettings(kvpolicy=os.fspath(policy), **settings).kv_transfer_config(upstream_extra=upstream)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """``models(name, kv_heads)`` → a tiny Llama directory named *name* (created once)."""
    root = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def get(name: str, kv_heads: int) -> Path:
        if name not in made:
            made[name] = make_tiny_llama(root / name, num_kv_heads=kv_heads)
        return made[name]

    return get


class Store:
    """Runs engines against the module's store and measures master traffic per engine."""

    def __init__(self, master: MooncakeMaster, config_path: Path) -> None:
        self.master = master
        self.config_path = config_path

    def serve(
        self, model: Path, *, tp_size: int, policy: str | os.PathLike[str], **extra: object
    ) -> tuple[EngineResult, MasterCounters]:
        before = MasterCounters.read(self.master.metrics_url)
        result = serve_once(
            model,
            PROMPT,
            tp_size=tp_size,
            kv_transfer_config=policy_config(policy, **extra),
            mooncake_config_path=self.config_path,
            max_tokens=MAX_TOKENS,
            logprobs=LOGPROBS,
        )
        traffic = delta(before, MasterCounters.read(self.master.metrics_url))
        print(
            f"tp={tp_size} policy={Path(os.fspath(policy)).stem} model={model.name}: wall {result.wall_s:.1f} s"
            f" (start-up {result.startup_s:.1f} s, generate {result.generate_s:.1f} s),"
            f" cached {result.num_cached_tokens}/{result.prompt_len}, written {traffic.objects_written},"
            f" read {traffic.objects_read}, tokens {list(result.tokens)}"
        )
        assert len(result.tokens) == MAX_TOKENS, (
            f"engine generated {len(result.tokens)} tokens, not {MAX_TOKENS} (a failed KV load fails the"
            f" request); stdout tail:\n{result.stdout[-4000:]}"
        )
        assert result.saves_drained, "the engine exited before the connector finished its puts"
        return result, traffic


@pytest.fixture(scope="module")
def store(e2e_master: MooncakeMaster, e2e_store_config: Path) -> Store:
    return Store(e2e_master, e2e_store_config)


def assert_warm_matches_cold(cold: EngineResult, warm: EngineResult) -> None:
    assert cold.num_cached_tokens == 0, "the cold engine hit: another test's objects share its keys"
    assert warm.num_cached_tokens == CACHED_TOKENS, "the warm engine did not load the prompt's chunks"
    assert warm.tokens == cold.tokens
    diff = cold.max_logprob_diff(warm)
    print(f"max |logprob(warm) - logprob(cold)| = {diff:.3g}")
    assert diff <= LOGPROB_TOLERANCE


def test_tp1_fresh_engine_hits_and_matches(store: Store, models) -> None:
    model = models("tiny-llama-tp1", kv_heads=2)
    cold, cold_traffic = store.serve(model, tp_size=1, policy="default")
    assert cold_traffic.objects_written == FULL_CHUNKS * NUM_GROUPS
    warm, warm_traffic = store.serve(model, tp_size=1, policy="default")
    assert_warm_matches_cold(cold, warm)
    assert warm_traffic.objects_written == 0
    assert warm_traffic.objects_read == FULL_CHUNKS * NUM_GROUPS


def predicted_chunk_keys(contract: KeyContract) -> list[str]:
    """The store keys the contract says a cold engine writes for PROMPT: every full chunk of every
    group, once per lookup namespace, keyed by vLLM's own block hashes of the prompt."""
    hashes = block_hashes(PROMPT, BLOCK_SIZE)
    return [
        chunk_key(prefix, hashes[chunk].hex())
        for group in contract.groups
        for prefix in group.lookup_prefixes
        for chunk in range(FULL_CHUNKS)
    ]


def test_tp2_one_kv_head_writes_each_chunk_once(store: Store, models, tmp_path: Path) -> None:
    # One KV head at TP=2: both ranks hold identical bytes (factor 2), so the pair writes each chunk
    # once, striped over the ranks, and each rank reads all of them back from the shared namespace.
    model = models("tiny-llama-tp2-kv1", kv_heads=1)
    keys_json = tmp_path / "keys.json"
    cold, cold_traffic = store.serve(model, tp_size=2, policy="default", kvpolicy_keys_json=str(keys_json))
    assert cold_traffic.objects_written == FULL_CHUNKS * NUM_GROUPS
    assert cold_traffic.batch_put_start_items == FULL_CHUNKS * NUM_GROUPS, "a chunk was offered twice"
    # The key contract the connector wrote names exactly the keys it put: as many as were written,
    # and every one of them in the store (the cold engine missed, so none was there before).
    predicted = predicted_chunk_keys(KeyContract.model_validate_json(keys_json.read_text()))
    with store_client(store.master.client_config()) as client:
        present = list(client.batch_is_exist(predicted))
    assert (len(predicted), present) == (cold_traffic.objects_written, [1] * len(predicted))
    warm, warm_traffic = store.serve(model, tp_size=2, policy="default")
    assert_warm_matches_cold(cold, warm)
    assert warm_traffic.objects_written == 0
    assert warm_traffic.objects_read == FULL_CHUNKS * NUM_GROUPS * 2


def test_tp2_one_kv_head_striped_load_reads_each_chunk_once(store: Store, models, tmp_path: Path) -> None:
    # The same pair of identical ranks, warm under load: striped: each rank reads half of the chunks
    # from Mooncake and receives the other half from its peer over the TP group's gloo group.
    model = models("tiny-llama-tp2-kv1-striped", kv_heads=1)
    striped = tmp_path / "default-striped.yaml"
    striped.write_text((REPO / "policies" / "default.yaml").read_text(encoding="utf-8") + "load: striped\n")
    cold, _ = store.serve(model, tp_size=2, policy="default")
    warm, warm_traffic = store.serve(model, tp_size=2, policy=striped)
    assert_warm_matches_cold(cold, warm)
    assert warm_traffic.objects_read == FULL_CHUNKS * NUM_GROUPS  # per rank: FULL_CHUNKS * 2


def test_tp2_distinct_heads_default_policy_matches(store: Store, models) -> None:
    # Two KV heads at TP=2: each rank holds its own head, so each rank writes and reads its own.
    model = models("tiny-llama-tp2-kv2-default", kv_heads=2)
    cold, cold_traffic = store.serve(model, tp_size=2, policy="default")
    assert cold_traffic.objects_written == FULL_CHUNKS * NUM_GROUPS * 2
    warm, warm_traffic = store.serve(model, tp_size=2, policy="default")
    assert_warm_matches_cold(cold, warm)
    assert warm_traffic.objects_read == FULL_CHUNKS * NUM_GROUPS * 2


def test_tp2_distinct_heads_wrong_policy_is_caught(store: Store, models) -> None:
    # The deliberately wrong policy calls those distinct heads replicated: the ranks share one
    # namespace and take turns writing, so warm, each rank loads chunks holding the other's head.
    model = models("tiny-llama-tp2-kv2-wrong", kv_heads=2)
    cold, cold_traffic = store.serve(model, tp_size=2, policy=WRONG_POLICY)
    assert cold.num_cached_tokens == 0
    assert cold_traffic.objects_written == FULL_CHUNKS * NUM_GROUPS, "the wrong policy was not in effect"
    warm, _ = store.serve(model, tp_size=2, policy=WRONG_POLICY)
    assert warm.num_cached_tokens == CACHED_TOKENS, "the warm engine must still report a hit"
    diff = cold.max_logprob_diff(warm)
    print(f"wrong policy: max |logprob(warm) - logprob(cold)| = {diff:.3g}; tokens {cold.tokens} vs {warm.tokens}")
    assert diff >= WRONG_MIN_DIFF, "loading another rank's heads went unnoticed: the e2e check cannot fail"


def test_unknown_policy_fails_startup_with_located_error(store: Store, models) -> None:
    model = models("tiny-llama-bad-policy", kv_heads=2)
    with pytest.raises(EngineFailed) as failure:
        serve_once(
            model,
            PROMPT,
            tp_size=1,
            kv_transfer_config=policy_config("defualt"),
            mooncake_config_path=store.config_path,
            timeout=240,
        )
    assert failure.value.returncode is not None, "the engine hung instead of failing"
    assert "no policy file or shipped policy named 'defualt'" in failure.value.stderr
    assert "did you mean 'default'?" in failure.value.stderr
    assert "did you mean 'default'?" in str(failure.value), "the raised message should carry the stderr tail"


def test_a_tp1_engine_loads_the_store_shards_a_tp2_engine_wrote(store: Store, models) -> None:
    """vLLM's TP-sharded store layout (``store_tp_size: 2``; vLLM's CPU attention backend keeps its KV
    cache in LBHNC) through the KVPolicyConnector: the TP 2 engine writes one object per chunk and
    KV head, and a TP 1 engine reads both heads of every chunk and generates what a cold TP 1 engine
    generates. The cold reference is the same weights under another model name (so other keys)."""
    shared = models("tiny-llama-store-tp", kv_heads=2)
    reference = models("tiny-llama-store-tp-cold", kv_heads=2)
    _, prefill = store.serve(shared, tp_size=2, policy="default", store_tp_size=2)
    assert prefill.objects_written == FULL_CHUNKS * 2  # one object per store shard (KV head)
    cold, _ = store.serve(reference, tp_size=1, policy="default", store_tp_size=2)
    warm, decode = store.serve(shared, tp_size=1, policy="default", store_tp_size=2)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == CACHED_TOKENS
    assert decode.objects_read == FULL_CHUNKS * 2 and decode.objects_written == 0
    assert warm.tokens == cold.tokens
    diff = cold.max_logprob_diff(warm)
    print(f"max |logprob(TP 1 warm from TP 2) - logprob(TP 1 cold)| = {diff:.3g}")
    assert diff <= CROSS_TP_LOGPROB_TOLERANCE
