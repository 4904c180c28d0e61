"""Planning cost: load + validate + plan of a shipped policy on a 100-group layout at tp=8.

Prints a table of medians over repeated runs, after import. Baseline in the same run: parsing the same
two YAML files with PyYAML's C loader alone (the floor any YAML loader pays), run before each
measurement so that every sample has a baseline taken next to it; ratios are medians of those pairs,
in wall time and in this process's CPU time (which other processes on a shared machine do not
inflate), so they stay meaningful on a noisy machine; the target is judged in CPU time, which moves
least with the load (wall-time ratios move by a few tenths at a load average of 4-8).

* ``cold``: the first plan of a fresh policy and layout: ``load_policy`` + ``load_layout`` (read,
  parse, validate, lint) + ``make_plan``; the target is at most 1.5x the baseline. Fresh documents
  are new objects, so the plan cache (keyed by their identity) never answers; what the process
  keeps between them is per expression text (parsed, checked, compiled) and per layer glob.
* ``plan``: ``make_plan`` alone on documents already loaded (a copy of the policy, so that the
  cache does not answer).
* ``replan``: the audit's replan after a demotion (``make_plan`` of the same documents with
  ``demoted``), asked again: answered by the plan cache.

    python benchmarks/bench_plan.py [--groups 100] [--tp 8] [--repeat 30] [--warmup 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import yaml

from kvpolicy.documents.loader import load_layout, load_policy, resolve_policy_path
from kvpolicy.language.keys import KeyContext
from kvpolicy.language.models import Topology
from kvpolicy.planning.engine import PLANS, make_plan

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
TARGET = 1.5
"""Cold planning at most this many times the bare C-YAML parse of the same files (issue 13)."""

SPECS = [
    ("MLAAttentionSpec", ["FullAttentionSpec", "AttentionSpec", "KVCacheSpec"], {"num_kv_heads": 1, "head_size": 576, "max_tp_shards": 1}),
    ("FullAttentionSpec", ["AttentionSpec", "KVCacheSpec"], {"num_kv_heads": 8, "head_size": 128, "max_tp_shards": None}),
    (
        "SlidingWindowSpec",
        ["AttentionSpec", "KVCacheSpec"],
        {"num_kv_heads": 8, "head_size": 64, "sliding_window": 128, "max_tp_shards": None},
    ),
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


class Sample(NamedTuple):
    wall_ms: float
    cpu_ms: float
    """This process's CPU time: what another process's load on a shared machine does not add."""


def sample(function: Callable[[], object]) -> Sample:
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return Sample((time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000)


class Result(NamedTuple):
    wall_ms: float
    """Median wall time."""
    wall_ratio: float
    """Median of the wall-time ratios to the baseline run just before each sample."""
    cpu_ratio: float
    """The same in CPU time."""


def paired(
    measured: dict[str, Callable[[], object]], baseline: Callable[[], object], repeat: int, warmup: int
) -> dict[str, Result]:
    """Each measurement, every sample next to a baseline sample; the baseline itself as ``yaml``.
    ``warmup`` unmeasured rounds first: until then the process is not in its steady state (the plan
    cache fills up, the heap grows), and the first policy measured would pay for it."""
    for _ in range(warmup):
        for function in (baseline, *measured.values()):
            function()
    pairs: dict[str, list[tuple[Sample, Sample]]] = {name: [] for name in measured}
    for _ in range(repeat):
        for name, function in measured.items():
            base = sample(baseline)
            pairs[name].append((sample(function), base))
    results = {
        name: Result(
            statistics.median(ours.wall_ms for ours, _ in found),
            statistics.median(ours.wall_ms / base.wall_ms for ours, base in found),
            statistics.median(ours.cpu_ms / base.cpu_ms for ours, base in found),
        )
        for name, found in pairs.items()
    }
    results["yaml"] = Result(statistics.median(base.wall_ms for found in pairs.values() for _, base in found), 1.0, 1.0)
    return results


def workloads(policy_path: Path, layout_path: Path, topology: Topology) -> tuple[Callable[[], object], dict[str, Callable[[], object]]]:
    """The baseline and the measurements, on one policy file and the layout file."""
    policy, layout = load_policy(policy_path), load_layout(layout_path)
    context = KeyContext.for_model(layout.model)

    def yaml_only() -> None:
        yaml.load(policy_path.read_text(), Loader=LOADER)
        yaml.load(layout_path.read_text(), Loader=LOADER)

    def cold() -> None:
        make_plan(load_policy(policy_path), load_layout(layout_path), topology)

    def plan_only() -> None:
        make_plan(policy.model_copy(), layout, topology)  # another policy object: not in the cache

    def replan() -> None:
        make_plan(policy, layout, topology, key_context=context, demoted=frozenset({1}), store_sharding=None)

    replan()  # the first replan plans; the ones measured are answered by the cache
    return yaml_only, {"cold": cold, "plan": plan_only, "replan": replan}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=PLANS.max_plans + 8, help="unmeasured rounds per policy")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        layout_path = write_layout(Path(directory), args.groups)
        topology = Topology(tp_size=args.tp)
        for policy_name in ("default", "vllm-compat", "no-dedup"):
            baseline, measured = workloads(resolve_policy_path(policy_name), layout_path, topology)
            rows.append((policy_name, paired(measured, baseline, args.repeat, args.warmup)))
    print(f"load + validate + plan, {args.groups} groups, tp={args.tp}, median of {args.repeat}; "
          "ratios: median of paired ratios, wall time (CPU time)")
    print(f"{'policy':12} {'cold ms':>8} {'plan ms':>8} {'replan ms':>10} {'yaml C load ms':>15} "
          f"{'cold/yaml':>15} {'plan/yaml':>15} {'replan/yaml':>17}")
    for name, result in rows:
        cold, plan, replan, base = result["cold"], result["plan"], result["replan"], result["yaml"]
        print(
            f"{name:12} {cold.wall_ms:8.2f} {plan.wall_ms:8.2f} {replan.wall_ms:10.3f} {base.wall_ms:15.2f} "
            f"{cold.wall_ratio:6.2f}x ({cold.cpu_ratio:4.2f}x) {plan.wall_ratio:6.2f}x ({plan.cpu_ratio:4.2f}x) "
            f"{replan.wall_ratio:7.3f}x ({replan.cpu_ratio:5.3f}x)"
        )
    worst = max(result["cold"].cpu_ratio for _, result in rows)
    worst_wall = max(result["cold"].wall_ratio for _, result in rows)
    verdict = "met" if worst <= TARGET else "missed"
    print(f"target: cold <= {TARGET}x the C-YAML parse in CPU time: {verdict} (worst {worst:.2f}x; wall time {worst_wall:.2f}x)")


if __name__ == "__main__":
    main()
