"""End to end: a model whose layers have KV-head counts of their own, through KVPolicyConnector at TP=2.

A tiny random Gemma-4 (:func:`kvpolicy.harness.tinymodel.make_tiny_gemma4`): sliding-window layers
with 1 KV head, full-attention layers with 2. vLLM 0.32 keeps the counts per layer and reports the
larger, 2, model-wide; its store derives every layer's replication from that, so at TP=2 it writes
the sliding layers' one head, identical on both ranks, from both. The connector captures each
layer's own count in the layout (``layer_kv_heads``), and:

* under ``default`` the sliding group has factor 2 and is written once; the master counts what
  ``kvpolicy plan --prompt-tokens`` predicts from the captured layout, and a fresh warm engine loads
  the prompt and generates exactly what the cold one did;
* under ``vllm-compat`` (the model-wide count for every layer, as vLLM) the sliding group is
  written by both ranks, and the master counts what ``vllm-compat``'s plan predicts.

Three engines, each in a fresh process (:func:`kvpolicy.harness.e2e.serve_once`): default cold and
warm, vllm-compat cold. Measured on 2 cores: 85 to 97 s each, 296 s for the module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")
require("transformers")

from kvpolicy.app.cli import main as kvpolicy_main  # noqa: E402
from kvpolicy.documents.loader import check_file  # noqa: E402
from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.harness.e2e import DEFAULT_BLOCK_SIZE, EngineResult, fixed_prompt, serve_once  # noqa: E402
from kvpolicy.harness.tinymodel import make_tiny_gemma4  # noqa: E402
from kvpolicy.language.models import Layout  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402

TP_SIZE = 2
SLIDING_KV_HEADS = 1
FULL_KV_HEADS = 2
PROMPT = fixed_prompt(3 * DEFAULT_BLOCK_SIZE + 1)
"""Three full blocks and one token to compute from them."""
FULL_BLOCKS = len(PROMPT) // DEFAULT_BLOCK_SIZE
MAX_TOKENS = 8
LOGPROBS = 20


@dataclass(frozen=True)
class Served:
    result: EngineResult
    plan: dict
    """The plan JSON rank 0 wrote (``kvpolicy_plan_json``)."""
    layout: Path
    """Where the connector captured the layout (``kvpolicy_layout_out``)."""

    @property
    def objects_written(self) -> int:
        assert self.result.traffic is not None
        return self.result.traffic.objects_written

    @property
    def objects_read(self) -> int:
        assert self.result.traffic is not None
        return self.result.traffic.objects_read

    def factor_of(self, spec_type: str) -> int:
        return next(group["factor"] for group in self.plan["groups"] if group["spec_types"] == [spec_type])


class Engines:
    """Serves the prompt in fresh TP=2 engines against the module's store; each policy under its own
    ``cache_prefix``, so that no run hits on another policy's objects."""

    def __init__(self, master: MooncakeMaster, config: Path, scratch: Path) -> None:
        self.master, self.config, self.scratch = master, config, scratch
        self.model = make_tiny_gemma4(
            scratch / "gemma4", num_kv_heads=SLIDING_KV_HEADS, num_global_kv_heads=FULL_KV_HEADS
        )

    def serve(self, policy: str, *, label: str, prefix: str) -> Served:
        run_dir = self.scratch / "runs" / label
        run_dir.mkdir(parents=True)
        settings = KVPolicySettings(
            kvpolicy=policy, kvpolicy_plan_json=run_dir / "plan.json", kvpolicy_layout_out=run_dir / "layout.yaml"
        )
        result = serve_once(
            self.model,
            PROMPT,
            tp_size=TP_SIZE,
            kv_transfer_config=settings.kv_transfer_config(upstream_extra={"cache_prefix": prefix} if prefix else None),
            mooncake_config_path=self.config,
            max_tokens=MAX_TOKENS,
            logprobs=LOGPROBS,
            master_metrics_url=self.master.metrics_url,
        )
        assert result.traffic is not None
        print(
            f"gemma4 {label}: wall {result.wall_s:.1f} s, cached {result.num_cached_tokens}/{result.prompt_len},"
            f" written {result.traffic.objects_written}, read {result.traffic.objects_read},"
            f" tokens {list(result.tokens)}"
        )
        assert len(result.tokens) == MAX_TOKENS, f"{label} failed its request:\n{result.stdout[-4000:]}"
        assert result.saves_drained, f"{label} exited before its puts finished"
        return Served(result, json.loads((run_dir / "plan.json").read_text()), run_dir / "layout.yaml")


@dataclass(frozen=True)
class ColdWarm:
    cold: Served
    warm: Served


@pytest.fixture(scope="module")
def engines(e2e_master: MooncakeMaster, e2e_store_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Engines:
    return Engines(e2e_master, e2e_store_config, tmp_path_factory.mktemp("layer-kv-heads"))


@pytest.fixture(scope="module")
def default_runs(engines: Engines) -> ColdWarm:
    # No cache prefix: the offline plan of the captured layout must reproduce these exact keys.
    cold = engines.serve("default", label="default-cold", prefix="")
    assert cold.result.num_cached_tokens == 0, "the cold engine hit on foreign objects"
    return ColdWarm(cold, engines.serve("default", label="default-warm", prefix=""))


@pytest.fixture(scope="module")
def compat_cold(engines: Engines) -> Served:
    served = engines.serve("vllm-compat", label="compat-cold", prefix="compat")
    assert served.result.num_cached_tokens == 0, "the cold engine hit on foreign objects"
    return served


def offline_plan(layout: Path, policy: str) -> dict:
    """``kvpolicy plan --format json`` of a layout file for the prompt, as a user would run it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = kvpolicy_main(
            ["plan", "--policy", policy, "--layout", os.fspath(layout), "--tp", str(TP_SIZE),
             "--prompt-tokens", str(len(PROMPT)), "--format", "json"]
        )
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


def sliding_layers(model: Path) -> list[str]:
    """The sliding-window layers' names, from the model's own ``config.json``."""
    layer_types = json.loads((model / "config.json").read_text())["layer_types"]
    return [
        f"model.layers.{index}.self_attn.attn" for index, kind in enumerate(layer_types) if kind == "sliding_attention"
    ]


def sliding_objects_written(plan: dict) -> int:
    return next(group["objects_written"] for group in plan["traffic"]["groups"] if group["name"] == "sliding-window")


# --- the captured layout ---------------------------------------------------------------------------


def test_captured_layout_gives_the_sliding_layers_their_own_kv_heads(engines: Engines, default_runs: ColdWarm) -> None:
    document, problems = check_file(default_runs.cold.layout)
    assert problems == [] and isinstance(document, Layout), problems
    assert document.total_num_kv_heads == FULL_KV_HEADS, "vLLM reports the larger count model-wide"
    assert dict(document.kv_heads_by_layer) == dict.fromkeys(sliding_layers(engines.model), SLIDING_KV_HEADS)


def test_offline_plan_of_the_captured_layout_is_the_plan_the_engine_ran(default_runs: ColdWarm) -> None:
    engine = default_runs.cold.plan
    offline = offline_plan(default_runs.cold.layout, "default")
    assert offline["fingerprint"] == engine["fingerprint"]
    assert [g["factor"] for g in offline["groups"]] == [g["factor"] for g in engine["groups"]]


# --- default: the sliding group written once, warm equals cold ---------------------------------------


def test_default_replicates_the_sliding_group_and_shards_the_full_one(default_runs: ColdWarm) -> None:
    plan = default_runs.cold
    assert (plan.factor_of("SlidingWindowSpec"), plan.factor_of("FullAttentionSpec")) == (
        TP_SIZE // SLIDING_KV_HEADS,
        max(1, TP_SIZE // FULL_KV_HEADS),
    )


def test_default_master_counts_equal_the_offline_plan(default_runs: ColdWarm) -> None:
    traffic = offline_plan(default_runs.cold.layout, "default")["traffic"]
    assert default_runs.cold.objects_written == traffic["objects_written"]
    assert default_runs.warm.objects_written == 0
    assert default_runs.warm.objects_read == traffic["objects_read"]


def test_default_writes_each_sliding_chunk_once(default_runs: ColdWarm) -> None:
    assert sliding_objects_written(offline_plan(default_runs.cold.layout, "default")) == FULL_BLOCKS


def test_default_warm_engine_loads_the_prompt_and_matches_cold(default_runs: ColdWarm) -> None:
    cold, warm = default_runs.cold.result, default_runs.warm.result
    assert warm.num_cached_tokens == FULL_BLOCKS * DEFAULT_BLOCK_SIZE
    assert warm.tokens == cold.tokens
    assert cold.max_logprob_diff(warm) == 0.0


# --- vllm-compat: as vLLM, the sliding group written by both ranks ----------------------------------


def test_vllm_compat_gives_every_group_the_model_wide_factor(compat_cold: Served) -> None:
    factor = max(1, TP_SIZE // FULL_KV_HEADS)
    assert (compat_cold.factor_of("SlidingWindowSpec"), compat_cold.factor_of("FullAttentionSpec")) == (factor, factor)


def test_vllm_compat_master_count_equals_its_plan(compat_cold: Served) -> None:
    planned = offline_plan(compat_cold.layout, "vllm-compat")
    assert compat_cold.objects_written == planned["traffic"]["objects_written"]
    assert sliding_objects_written(planned) == TP_SIZE * FULL_BLOCKS


def test_vllm_compat_writes_one_more_copy_of_each_sliding_chunk_than_default(
    default_runs: ColdWarm, compat_cold: Served
) -> None:
    assert compat_cold.objects_written - default_runs.cold.objects_written == (TP_SIZE - 1) * FULL_BLOCKS
