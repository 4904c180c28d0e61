"""End to end: tiny copies of vLLM's own architectures, built from a configuration alone
(:mod:`kvpolicy.harness.zoo`), served on vLLM-CPU engines at TP=2 with discovery on.

One model per spec family that serves on CPU: dense GQA (Llama, one KV head, through the command line
with a warm engine), sliding window (Gemma-3: five sliding layers and one full), per-layer head sizes
(Gemma-4: full-attention layers of head size 512 next to sliding ones of 256), KV sharing (Gemma-3n),
chunked-local attention (Llama-4), MoE (Qwen3-MoE), MLA (DeepSeek-V2), Gated DeltaNet (Qwen3-Next),
Mamba2 next to attention (Falcon-H1) and alone (Mamba2), short conv (LFM2). Not here, because vLLM-CPU
0.32 does not serve them: Mamba1 and KDA (see the model coverage page). Each copy's report must say,
for every layer, which ranks held identical bytes as the copy's own configuration says they hold:

* attention of ``k`` KV heads at TP ``t`` repeats each head over ``max(1, t // k)`` consecutive ranks;
* MLA's latent is computed whole on every rank: all ranks hold the same bytes;
* recurrent state (Gated DeltaNet, Mamba2, short conv) is split over the ranks: each rank holds its own;

with evidence (blocks compared, none of them all-zero on a rank) in every group, and
``kvpolicy discover --check default`` must agree with it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")
require("transformers")

from kvpolicy.app.cli import main as kvpolicy_main  # noqa: E402
from kvpolicy.harness.zoo.observe import (  # noqa: E402
    ZooStore,
    build,
    degenerate,
    observe,
    prompt_blocks_unlike,
    summarize,
)
from kvpolicy.harness.zoo.shrink import TinyCopy, shrink  # noqa: E402

TP_SIZE = 2
REPO = Path(__file__).resolve().parents[2]

FAMILIES = {
    "sliding window": "Gemma3ForCausalLM",
    "per-layer head sizes": "Gemma4ForCausalLM",
    "KV sharing": "Gemma3nForCausalLM",
    "chunked local": "Llama4ForCausalLM",
    "MoE": "Qwen3MoeForCausalLM",
    "MLA": "DeepseekV2ForCausalLM",
    "Gated DeltaNet": "Qwen3NextForCausalLM",
    "Mamba2 hybrid": "FalconH1ForCausalLM",
    "Mamba2 alone": "Mamba2ForCausalLM",
    "short conv": "Lfm2ForCausalLM",
}
"""Spec family → the architecture whose copy (from its model type's defaults) covers it."""

RECURRENT = ("MambaSpec",)
"""Spec classes (and their subclasses) whose state TP splits: each rank holds its own."""
LATENT = ("MLAAttentionSpec",)
"""MLA: one latent (``kv_lora_rank`` + ``qk_rope_head_dim``) per token that every rank computes whole."""


def kv_heads(copy: TinyCopy) -> int:
    """The KV heads of a copy's attention layers, from its configuration (the same in every attention
    layer of these models)."""
    config = copy.config
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


def physical_partition(copy: TinyCopy, spec_type: str, bases: tuple[str, ...]) -> list[list[int]]:
    if any(base in RECURRENT for base in (spec_type, *bases)):
        return [[rank] for rank in range(TP_SIZE)]
    if any(base in LATENT for base in (spec_type, *bases)):
        return [list(range(TP_SIZE))]
    repeat = max(1, TP_SIZE // kv_heads(copy))
    return [list(range(start, start + repeat)) for start in range(0, TP_SIZE, repeat)]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    scratch = tmp_path_factory.mktemp("zoo")
    seen: dict[str, tuple[TinyCopy, Path]] = {}
    with ZooStore(scratch / "store") as store:

        def observe_family(architecture: str) -> tuple[TinyCopy, Path]:
            if architecture not in seen:
                copy = shrink(architecture)
                model = build(copy, scratch / architecture / "model")
                (observation,) = observe(copy, model, [TP_SIZE], scratch / architecture, store=store, timeout=240)
                print(f"{architecture}: tp {TP_SIZE}, block {observation.block_size}, {observation.wall_s:.1f} s")
                assert observation.report is not None, f"{architecture}: {observation.error}\n{observation.stderr_tail}"
                seen[architecture] = (copy, observation.report)
            return seen[architecture]

        yield observe_family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_copy_from_a_config_alone_observes_the_partition_its_config_says(zoo, family: str) -> None:
    copy, path = zoo(FAMILIES[family])
    report, groups = summarize(path)
    assert report.source == "engine" and report.topology.tp_size == TP_SIZE and report.failed_steps == 0
    assert degenerate(groups) == [], f"{family}: groups without evidence"
    specs = {layer: member.spec for group in report.layout.groups for member in group.members for layer in member.layers}
    for group in report.groups:
        for layer in group.layers:
            spec = specs[layer.name]
            expected = physical_partition(copy, spec.type, tuple(spec.bases))
            assert layer.evidence.blocks >= 4 and layer.evidence.zero_blocks == 0, f"{family} {layer.name}: {layer.evidence}"
            assert [list(c) for c in layer.partition] == expected, f"{family} {layer.name} ({spec.type})"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_agrees_with_what_the_copy_observed(zoo, family: str) -> None:
    _, path = zoo(FAMILIES[family])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = kvpolicy_main(["discover", "--check", "default", os.fspath(path)])
    assert code == 0, out.getvalue()
    assert "agrees with every observed group and layer" in out.getvalue()


def test_discover_model_serves_a_one_kv_head_config_and_a_warm_engine_loads_it_exactly(tmp_path: Path) -> None:
    """Dense GQA from a ``config.json`` given on the command line: one KV head, so both ranks hold the
    same bytes; a warm engine loads what the cold one stored and computes the same tokens."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 1, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 8192,
    }
    source = tmp_path / "llama-1kv"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "discovery"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from kvpolicy.app.cli import main; sys.exit(main(sys.argv[1:]))",
         "discover", "--model", str(source), "--tp", "2", "--out", str(out), "--check-warm"],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path, check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "kept   num_key_value_heads = 1" in done.stdout
    assert "shrunk num_hidden_layers: 32 -> 2" in done.stdout
    assert "equal bytes in [[0, 1]] (factor 2)" in done.stdout
    assert "default: agrees" in done.stdout
    warm = next(line for line in done.stdout.splitlines() if line.strip().startswith("warm:"))
    assert "same tokens" in warm and not warm.strip().startswith("warm: 0 of"), warm
    _, groups = summarize(out / "llamaforcausallm-tp2.yaml")
    assert [group.partition for group in groups] == [[[0, 1]]]
    assert json.loads((out / "llamaforcausallm-tiny.json").read_text())["layers"] == [0, 1]


PLUGIN = Path(__file__).resolve().parent / "zoo_plugin"
"""A test plugin package: ``ZooStateLfm2ForCausalLM``, LFM2 whose short-conv state has the spec class
``ZooConvStateSpec`` of its own (``zoo_state_model.py``)."""


def test_a_plugin_spec_class_is_discovered_from_a_config_alone_and_its_proposed_rule_plans_it(tmp_path: Path) -> None:
    """A new state type from a plugin, observed offline from its model's configuration: the engine
    serves the plugin's architecture, the report names its spec class, the default policy (which
    shards a class no rule names) agrees, and the policy proposed from the report plans every group as
    observed, with a rule naming the plugin's class."""
    from kvpolicy.documents.loader import load_policy
    from kvpolicy.planning.engine import make_plan

    layers = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention",
              "conv", "full_attention", "conv", "full_attention", "conv", "full_attention", "conv"]
    config = {
        "architectures": ["ZooStateLfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": len(layers), "layer_types": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "conv_L_cache": 3, "vocab_size": 65536, "max_position_embeddings": 128000,
    }
    source = tmp_path / "plugin-model"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "discovery"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from kvpolicy.app.cli import main; sys.exit(main(sys.argv[1:]))",
         "discover", "--model", str(source), "--tp", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path, check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    path = out / "zoostatelfm2forcausallm-tp2.yaml"
    report, groups = summarize(path)
    conv = [group for group in groups if group.spec_types == ("ZooConvStateSpec",)]
    assert conv and all(group.partition == [[0], [1]] for group in conv), groups  # short conv: split over TP
    assert degenerate(groups) == []
    proposal = tmp_path / "proposed.yaml"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = kvpolicy_main(["discover", "--propose", os.fspath(path), "--output", os.fspath(proposal)])
    assert code == 0
    policy = load_policy(proposal)
    assert any("ZooConvStateSpec" in (rule.match.spec or ()) for rule in policy.rules)
    plan = make_plan(policy, report.layout, report.topology)
    for group, observed in zip(plan.groups, report.groups, strict=True):
        replica_sets = sorted({rank.replica_set for rank in group.ranks})
        assert [list(s) for s in replica_sets] == [list(c) for c in observed.partition], f"group {group.index}"


WARM_BYTES = ("MLA", "short conv")
"""Families whose warm engine is not bit-exact with the cold one in the sweep (MLA changes tokens, short
conv logprobs): the store must still give back exactly the bytes the cold engine computed."""


def _prompt_blocks_unlike_cold(family: str, policy: str, scratch: Path) -> list[str]:
    """One prompt of two full blocks through a cold and a warm engine under *policy*: the prompt's full
    blocks whose bytes differ warm vs cold (``rank R LAYER.PART block B``)."""
    from kvpolicy.documents.settings import KVPolicySettings
    from kvpolicy.harness.e2e import serve_once
    from kvpolicy.harness.zoo.observe import engine_options

    copy = shrink(FAMILIES[family])
    model = build(copy, scratch / "model")
    connector = KVPolicySettings(kvpolicy=policy).kv_transfer_config(upstream_extra={"cache_prefix": scratch.name})
    with ZooStore(scratch / "store") as store:
        options = engine_options(copy, store, tp_size=TP_SIZE, prompts=1, timeout=240)
        cold = serve_once(model, [], kv_transfer_config=connector, digest_blocks=True, **options)
        warm = serve_once(model, [], kv_transfer_config=connector, digest_blocks=True, **options)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 2 * warm.block_size
    assert len(cold.block_digests) == len(warm.block_digests) == TP_SIZE
    differing, compared = prompt_blocks_unlike(cold, warm, full_blocks=2)
    assert compared >= 2 * TP_SIZE  # every rank compared both full blocks of at least one layer
    return differing


@pytest.mark.parametrize("family", WARM_BYTES)
def test_a_warm_engine_holds_exactly_the_prompt_blocks_the_cold_one_computed(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    assert _prompt_blocks_unlike_cold(family, "default", tmp_path_factory.mktemp("warm-bytes")) == []


def test_under_the_pre_fix_rule_a_warm_engine_holds_another_ranks_shards(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The comparison above can fail: the pre-fix rule stores every group once for all ranks (each rank
    writing some of the blocks), so each rank's warm engine holds the other's shards in those blocks."""
    pre_fix = str(REPO / "examples" / "policies" / "pre-fix-single-factor.yaml")
    differing = _prompt_blocks_unlike_cold("short conv", pre_fix, tmp_path_factory.mktemp("pre-fix-bytes"))
    assert {int(where.split()[1]) for where in differing} == set(range(TP_SIZE))
