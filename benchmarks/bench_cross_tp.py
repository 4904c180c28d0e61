"""Cross-TP sharing: how much of a prompt an instance of one TP size loads from another's store, and
whether every byte is right.

For each example layout vLLM stores TP-sharded (one full-attention group whose KV heads divide into
``--store-tp`` store shards), one simulated instance saves a prompt and another, at another TP size,
looks it up and loads it (:func:`kvpolicy.sim.run_mixed`: each rank the production
``KVPolicyStoreWorker`` with vLLM's send and receive threads, on a Mooncake master started here),
once with vLLM's rank-local store and once with ``store_tp_size``. The layout's own per-rank KV
heads, head size 32, block size 16, all layers.

* hit = tokens the loader's lookup found, of the prompt's full blocks;
* used = tokens the scheduler keeps after load errors (vLLM recomputes the rest);
* wrong = loaded blocks whose bytes are not the loader's own heads' (:mod:`kvpolicy.sim.content`).

    python benchmarks/bench_cross_tp.py [--pairs 4:2 2:4 8:2] [--store-tp 8] [--tokens 256] [--layouts NAME ...]
        [--policies default vllm-compat]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import example_layouts, table


def _pair(text: str) -> tuple[int, int]:
    saver, _, loader = text.partition(":")
    return int(saver), int(loader)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=_pair, nargs="+", default=[(4, 2), (2, 4), (8, 2)], help="saver:loader TP sizes")
    parser.add_argument("--store-tp", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="prompt length (block size 16)")
    parser.add_argument("--layouts", nargs="*", help="layout file stems (default: those vLLM stores TP-sharded)")
    parser.add_argument("--policies", nargs="+", default=["default", "vllm-compat"], help="shipped names or paths")
    args = parser.parse_args(argv)

    from kvpolicy.documents.loader import load_policy
    from kvpolicy.language.models import Topology
    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.mooncake.native_log import native_stderr_to
    from kvpolicy.mooncake.pool import ClientPool
    from kvpolicy.planning.store_layout import select_store_layout
    from kvpolicy.sim import BLOCK_SIZE, archetype_from_layout, run_mixed

    policies = [load_policy(name) for name in args.policies]
    full_hit = (args.tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    sharded = {"store_tp_size": args.store_tp}
    rows = []
    problems = []
    started = time.monotonic()
    log = Path(tempfile.gettempdir()) / "kvpolicy-bench-mooncake.log"
    with native_stderr_to(log), MooncakeMaster() as master, ClientPool(master, segment_mib=32) as pool:
        for stem, layout in example_layouts(args.layouts):
            pairs = [
                (saver, loader)
                for saver, loader in args.pairs
                if all(
                    select_store_layout(layout, Topology(tp_size=tp), sharded, kv_cache_layout="LBHNC").sharding
                    for tp in (saver, loader)
                )
            ]
            if not pairs:
                continue
            archetype = archetype_from_layout(layout, num_kv_heads=None)
            for saver, loader in pairs:
                for store_label, extra in (("rank-local", {}), (f"store_tp {args.store_tp}", sharded)):
                    for policy in policies:
                        report = run_mixed(
                            policy, saver, policy, loader, archetype, master=master, clients=pool,
                            num_tokens=args.tokens, extra_config=extra, kv_cache_layout="LBHNC",
                        )
                        verdict = report.verdict
                        errors = sum(len(ids) for _, ids in verdict.invalid_block_ids) + len(verdict.failed_ranks)
                        if not verdict.correct or verdict.crashed:
                            problems.append(f"{stem} tp{saver}->tp{loader} {store_label} {policy.name}")
                        rows.append(
                            (
                                stem,
                                f"{saver} -> {loader}",
                                store_label,
                                policy.name,
                                f"{100 * verdict.hit_tokens / full_hit:.0f}%",
                                f"{100 * verdict.used_tokens / full_hit:.0f}%",
                                errors,
                                len(verdict.wrong),
                                "yes" if verdict.correct and not verdict.crashed else "NO",
                            )
                        )
    elapsed = time.monotonic() - started
    print(
        f"Cross-TP sharing of a {args.tokens}-token prompt (hit and used: % of its {full_hit} tokens in full blocks): "
        "a saver instance, then a loader instance at another TP size on one Mooncake store; simulated ranks "
        "through vLLM's send and receive threads, the layout's own per-rank KV heads, head size 32, LBHNC."
    )
    print()
    print(
        table(
            ("layout", "tp saver -> loader", "store", "policy", "hit", "used", "blocks failed to load", "wrong blocks", "correct"),
            rows,
        )
    )
    print()
    print("target: every load correct (a miss or the right bytes): " + ("MET" if not problems else "MISSED: " + "; ".join(problems)))
    print(f"({elapsed:.0f} s; Mooncake client log: {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
