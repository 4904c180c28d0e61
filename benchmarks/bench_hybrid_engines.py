"""Hybrid models on real vLLM-CPU engines at TP=2: cold vs warm through KVPolicyConnector, per policy.

For each tiny hybrid (``kvpolicy.harness.tinymodel``: Qwen3-Next / Gated DeltaNet, Nemotron-H /
Mamba2, LFM2 / short conv; one KV head, so attention is truly replicated over the two ranks while
the state is sharded) and each policy, a cold engine serves a prompt that ends one token past a
block boundary, then a fresh warm engine serves it again; both are new processes sharing only the
Mooncake store (a master on 127.0.0.1 started here, and a segment-holder process). Reported per
row: prompt tokens the warm engine loaded from Mooncake, the largest logprob difference between
warm and cold over 8 greedy tokens (top-20 candidates), objects the cold engine wrote and the warm
one read (the master's counters), and the objects ``kvpolicy plan --prompt-tokens`` predicts from
the layout the connector captured. Correct policies must give 0; the pre-#49499 rule (one
model-wide factor, the state "deduplicated" too) must not.

Nemotron-H runs with the harness's plugin ``kvpolicy/harness/zoo/plugins/kvpolicy_zoo_mamba2.py`` (vllm#54504).
About 20 s per engine on 2 cores: 24 engines for the default 3 architectures x 4 policies.

    python benchmarks/bench_hybrid_engines.py [--arch qwen3-next nemotron-h lfm2] [--policies default ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import table

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.harness.e2e import SegmentHolder, engine_store_config, fixed_prompt, serve_once
from kvpolicy.harness.tinymodel import ARCHITECTURES, HYBRIDS, make_tiny_model
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.traffic import prompt_traffic

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "kvpolicy" / "harness" / "zoo" / "plugins"
NEEDS_MAMBA2_PLUGIN = frozenset({"nemotron-h"})
PROMPT_TOKENS = {"qwen3-next": 193, "nemotron-h": 129, "lfm2": 97}
"""Full blocks of vLLM's hybrid block size at TP=2 (96, 64, 32) and one token to compute."""
POLICIES = {
    "default": "default",
    "vllm-compat": "vllm-compat",
    "no-dedup": "no-dedup",
    "pre-fix": str(REPO / "examples" / "policies" / "pre-fix-single-factor.yaml"),
}


def run(arch: str, policy_label: str, master: MooncakeMaster, store_config: Path, workdir: Path) -> list[object]:
    entry = ARCHITECTURES[arch]
    model = workdir / f"{arch}-kv1"
    if not model.exists():
        make_tiny_model(arch, model, num_kv_heads=1)
    prompt = fixed_prompt(PROMPT_TOKENS[arch])
    layout_path = workdir / f"{arch}-{policy_label}-layout.yaml"
    config = KVPolicySettings(kvpolicy=POLICIES[policy_label], kvpolicy_layout_out=layout_path).kv_transfer_config(
        upstream_extra={"cache_prefix": policy_label}
    )
    cold, warm = (
        serve_once(
            model,
            prompt,
            tp_size=2,
            kv_transfer_config=config,
            mooncake_config_path=store_config,
            logprobs=20,
            dtype=entry.dtype,
            hybrid=True,
            master_metrics_url=master.metrics_url,
            python_path=[PLUGINS] if arch in NEEDS_MAMBA2_PLUGIN else [],
        )
        for _ in range(2)
    )
    layout = load_layout(layout_path)
    predicted = prompt_traffic(
        make_plan(load_policy(POLICIES[policy_label]), layout, _topology()), layout, len(prompt)
    )
    assert cold.traffic is not None and warm.traffic is not None
    diff = cold.max_logprob_diff(warm)
    print(f"  {arch} {policy_label}: cached {warm.num_cached_tokens}, diff {diff:.3g}", file=sys.stderr, flush=True)
    return [
        f"{arch} ({entry.state})",
        policy_label,
        f"{warm.num_cached_tokens}/{len(prompt)}",
        "same" if cold.tokens == warm.tokens else "differ",
        "disjoint top-20" if diff == float("inf") else f"{diff:.3g}",
        cold.traffic.objects_written,
        warm.traffic.objects_read,
        f"{predicted.objects_written} / {predicted.objects_read}",
    ]


def _topology():
    from kvpolicy.language.models import Topology

    return Topology(tp_size=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", choices=HYBRIDS, default=list(HYBRIDS))
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    args = parser.parse_args(argv)
    rows = []
    with MooncakeMaster(object_lease_ms=120_000, client_ttl_s=120) as master, tempfile.TemporaryDirectory(
        prefix="kvpolicy-bench-hybrid-"
    ) as scratch:
        workdir = Path(scratch)
        store_config = engine_store_config(master.client_config(), workdir / "mooncake.json")
        with SegmentHolder(master.rpc_address, segment_mib=256):
            for arch in args.arch:
                for policy_label in args.policies:
                    rows.append(run(arch, policy_label, master, store_config, workdir))
    print(
        table(
            (
                "architecture (state)",
                "policy",
                "warm cached",
                "greedy tokens",
                "max logprob diff",
                "objects written (cold)",
                "objects read (warm)",
                "predicted written / read",
            ),
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
