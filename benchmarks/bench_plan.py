"""Planning cost: load + validate + plan of a shipped policy on a 100-group layout at tp=8.

Prints a table of medians over repeated runs, after import. Baseline in the same run: parsing the same
two YAML files with PyYAML's C loader alone (the floor any YAML loader pays), so the ratio stays
meaningful on a noisy machine.

    python benchmarks/bench_plan.py [--groups 100] [--tp 8] [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from kvpolicy.engine import make_plan
from kvpolicy.loader import load_layout, load_policy, resolve_policy_path
from kvpolicy.models import Topology

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

SPECS = [
    ("MLAAttentionSpec", ["FullAttentionSpec", "AttentionSpec", "KVCacheSpec"], {"num_kv_heads": 1, "head_size": 576, "max_tp_shards": 1}),
    ("FullAttentionSpec", ["AttentionSpec", "KVCacheSpec"], {"num_kv_heads": 8, "head_size": 128, "max_tp_shards": None}),
    ("SlidingWindowSpec", ["AttentionSpec", "KVCacheSpec"], {"num_kv_heads": 8, "head_size": 64, "sliding_window": 128, "max_tp_shards": None}),
    ("MambaSpec", ["KVCacheSpec"], {"shapes": [[3, 8192], [32, 128, 128]], "tp_replicated": False}),
]


def write_layout(directory: Path, groups: int) -> Path:
    document = {
        "version": 1,
        "kind": "ModelLayout",
        "model": "bench/hundred-groups",
        "total_num_kv_heads": 8,
        "groups": [
            {
                "name": f"g{index}",
                "spec": {
                    "type": SPECS[index % len(SPECS)][0],
                    "bases": SPECS[index % len(SPECS)][1],
                    "block_size": 16,
                    "page_size_bytes": "2 * 16 * max(1, 8 // tp_size) * 128 * 2",
                    "fields": SPECS[index % len(SPECS)][2],
                },
                "layers": [f"model.layers.{index}.attn"],
            }
            for index in range(groups)
        ],
    }
    path = directory / "layout.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def median_ms(function, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        layout_path = write_layout(Path(directory), args.groups)
        topology = Topology(tp_size=args.tp)
        rows = []
        for policy_name in ("default", "vllm-compat", "no-dedup"):
            policy_path = resolve_policy_path(policy_name)

            def yaml_only() -> None:
                yaml.load(policy_path.read_text(), Loader=LOADER)
                yaml.load(layout_path.read_text(), Loader=LOADER)

            def full() -> None:
                make_plan(load_policy(policy_path), load_layout(layout_path), topology)

            policy, layout = load_policy(policy_path), load_layout(layout_path)
            baseline = median_ms(yaml_only, args.repeat)
            total = median_ms(full, args.repeat)
            plan_only = median_ms(lambda: make_plan(policy, layout, topology), args.repeat)
            rows.append((policy_name, total, plan_only, baseline))
    print(f"load + validate + plan, {args.groups} groups, tp={args.tp}, median of {args.repeat}")
    print(f"{'policy':12} {'total ms':>9} {'plan ms':>8} {'yaml C load ms':>15} {'total/yaml':>11}")
    for name, total, plan_only, baseline in rows:
        print(f"{name:12} {total:9.2f} {plan_only:8.2f} {baseline:15.2f} {total / baseline:10.2f}x")


if __name__ == "__main__":
    main()
