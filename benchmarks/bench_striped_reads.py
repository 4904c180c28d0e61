"""Striped reads: objects and bytes a warm load takes out of the store, per-rank vs ``load: striped``,
and what it costs in time.

**Read amplification** (simulation): for every example layout and TP size, a cold instance of
``KVPolicyStoreWorker`` ranks (``kvpolicy.sim.Fleet``, the layout's real spec classes scaled down)
saves a prompt under ``default``; then a warm instance under ``default`` (every rank reads what it
needs: vLLM's way) and one under ``default`` + ``load: striped`` load it through vLLM's receive
threads. Objects and bytes read are what each rank's store client was asked for (its own record of
``batch_get_into_multi_buffers``, the keys the master served); unique = the distinct objects among
them, with their sizes. Target: striped / unique = 1.00; per-rank reads a group replicated over
``f`` ranks ``f`` times. Every load is checked byte for byte on every rank (``Instance.verdict``).
The same table gives each load's time in the simulation, the two alternating (ranks are threads of
one process there, and the stripes go through an in-process collective: a lower bound of the
exchange's cost, not a network's).

**Warm TTFT on a real engine** (unless ``--no-engines``): two vLLM CPU engines at TP=2 serving a tiny random
Llama with one KV head (both ranks hold the same head: factor 2), one per policy, each with its own
``cache_prefix``, driven in lockstep as in ``bench_e2e.py`` (the engines from there), one 1-token
request at a time: per prompt a cold request on each, then warm requests, every one loading the
prompt's chunks from Mooncake. Striped: each rank reads half of them and receives the other half from
its peer over the TP group's gloo group.

    python benchmarks/bench_striped_reads.py [--layouts NAME ...] [--tp 2 4 8] [--tokens 512] [--repeat 5]
        [--no-engines] [--prompts 6] [--warm-repeats 4] [--prompt-len 416]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, example_layouts, median, median_ci, table  # noqa: E402


def _reads(instance: Any) -> tuple[dict[str, int], int, int]:
    """{key: bytes} of the distinct objects the instance's ranks read, and objects and bytes read in all."""
    distinct: dict[str, int] = {}
    objects = size = 0
    for rank in instance.ranks:
        for keys, _, sizes in rank.store.calls_of("batch_get_into_multi_buffers"):
            for key, buffers in zip(keys, sizes, strict=True):
                distinct[key] = sum(buffers)
                objects += 1
                size += sum(buffers)
    return distinct, objects, size


def measure_layout(stem: str, layout: Any, tp: int, args: argparse.Namespace, master: Any, pool: Any) -> dict[str, Any]:
    from kvpolicy.loader import load_policy
    from kvpolicy.models import LoadMode
    from kvpolicy.sim import Fleet, archetype_from_layout

    policies = {
        "per-rank": load_policy("default"),
        "striped": load_policy("default").model_copy(update={"load": LoadMode.STRIPED}),
    }
    archetype = archetype_from_layout(layout, name=f"bench-striped-{stem}", layers_per_group=1, head_size=16)
    with Fleet(archetype, master=master, clients=pool, num_tokens=args.tokens, seed=args.seed) as fleet:
        fleet.instance(policies["per-rank"], tp, name="cold").save()
        warm = {name: fleet.instance(policy, tp, name=name) for name, policy in policies.items()}
        counts: dict[str, tuple[dict[str, int], int, int]] = {}
        times: dict[str, list[float]] = {name: [] for name in warm}
        correct = True
        for repetition in range(args.repeat + 1):
            order = list(warm) if repetition % 2 == 0 else list(warm)[::-1]
            for name in order:
                instance = warm[name]
                lookup = instance.lookup()
                if lookup.hit_length == 0:
                    raise RuntimeError(f"{stem} tp={tp} {name}: the warm lookup found nothing")
                instance.capture(repetition == 0)
                started = time.perf_counter()
                instance.load(lookup)
                elapsed = time.perf_counter() - started
                instance.capture(False)
                if repetition == 0:  # counted and checked once; timed from the next on
                    counts[name] = _reads(instance)
                    verdict = instance.verdict(lookup)
                    correct = correct and verdict.correct and verdict.used_tokens == lookup.hit_length
                else:
                    times[name].append(elapsed)
        factors = ",".join(str(factor) for factor in warm["per-rank"].plan.factors)
    unique, _, _ = counts["per-rank"]
    return {
        "factors": factors,
        "unique_objects": len(unique),
        "unique_bytes": sum(unique.values()),
        "counts": {name: (objects, size) for name, (_, objects, size) in counts.items()},
        "same_objects": set(counts["striped"][0]) == set(unique),
        "times": times,
        "correct": correct,
    }


def amplification(args: argparse.Namespace) -> tuple[list[tuple[Any, ...]], bool]:
    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.mooncake.native_log import native_stderr_to
    from kvpolicy.mooncake.pool import ClientPool

    rows = []
    met = True
    log = Path(tempfile.gettempdir()) / "kvpolicy-bench-mooncake.log"
    with native_stderr_to(log), MooncakeMaster() as master, ClientPool(master, segment_mib=64) as pool:
        for stem, layout in example_layouts(args.layouts):
            for tp in args.tp:
                m = measure_layout(stem, layout, tp, args, master, pool)
                per_objects, per_bytes = m["counts"]["per-rank"]
                objects, size = m["counts"]["striped"]
                ratio_objects = objects / m["unique_objects"]
                ratio_bytes = size / m["unique_bytes"]
                met = met and f"{ratio_objects:.2f}" == "1.00" and f"{ratio_bytes:.2f}" == "1.00" and m["correct"]
                speed = [p / s for p, s in zip(m["times"]["per-rank"], m["times"]["striped"], strict=True)]
                rows.append(
                    (
                        stem, tp, m["factors"], m["unique_objects"], f"{m['unique_bytes'] / 2**20:.2f}",
                        f"{per_objects / m['unique_objects']:.2f}", f"{per_bytes / m['unique_bytes']:.2f}",
                        f"{ratio_objects:.2f}", f"{ratio_bytes:.2f}",
                        f"{median(m['times']['per-rank']) * 1000:.1f}", f"{median(m['times']['striped']) * 1000:.1f}",
                        f"{median(speed):.2f}", "yes" if m["correct"] and m["same_objects"] else "NO",
                    )
                )
    return rows, met


# --- real engines -----------------------------------------------------------------------------------


def engines(args: argparse.Namespace) -> dict[str, Any]:
    """Warm latency of two TP=2 engines, per-rank vs striped, driven in lockstep."""
    from bench_e2e import LEASE_TTL_MS, Engine, _engine_env, _prompts

    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.vllm.e2e import SegmentHolder, engine_env, engine_store_config
    from kvpolicy.vllm.tinymodel import make_tiny_llama

    results: dict[str, list[dict[str, Any]]] = {"per-rank": [], "striped": []}
    with tempfile.TemporaryDirectory(prefix="kvpolicy-bench-striped-") as directory:
        scratch = Path(directory)
        model = make_tiny_llama(scratch / "tiny-llama-kv1", num_kv_heads=1)
        policy_files = {
            "per-rank": REPO / "policies" / "default.yaml",
            "striped": scratch / "default-striped.yaml",
        }
        policy_files["striped"].write_text(policy_files["per-rank"].read_text(encoding="utf-8") + "load: striped\n")
        with MooncakeMaster(object_lease_ms=LEASE_TTL_MS, client_ttl_s=120) as master:
            store_config = engine_store_config(master.client_config(), scratch / "engine.json")
            with SegmentHolder(master.rpc_address, segment_mib=256):
                running: dict[str, Engine] = {}
                try:
                    for name, path in policy_files.items():
                        spec = {
                            "model": str(model),
                            "tp": 2,
                            "kv_transfer_config": {
                                "kv_connector": "KVPolicyConnector",
                                "kv_connector_module_path": "kvpolicy.vllm",
                                "kv_role": "kv_both",
                                "kv_connector_extra_config": {
                                    "kvpolicy": str(path), "cache_prefix": f"bench-{name}-{uuid.uuid4().hex[:8]}",
                                },
                            },
                            "max_tokens": 1,
                            "max_model_len": 512,
                            "warmup_prompts": _prompts(4, args.prompt_len, seed=30_000),
                            "warmup_s": args.warmup_seconds,
                        }
                        env = {**_engine_env(store_config), **engine_env(2, store_config)}
                        running[name] = Engine(name, spec, env, scratch, 600.0)
                        ready = running[name].ready()
                        print(f"  {name} engine ready (start-up {ready['startup_s']:.1f} s)", file=sys.stderr)
                    turn = 0
                    for prompt in _prompts(args.prompts, args.prompt_len, seed=40_000):
                        for phase in ["cold"] + ["warm"] * args.warm_repeats:
                            order = list(running) if turn % 2 == 0 else list(running)[::-1]
                            turn += 1
                            replies = {name: running[name].request(prompt) for name in order}
                            for name, reply in replies.items():
                                results[name].append({"phase": phase, **reply})
                finally:
                    for engine in running.values():
                        engine.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="*")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-engines", dest="engines", action="store_false", help="skip warm TTFT on two real TP=2 engines"
    )
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--warm-repeats", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=416)
    parser.add_argument("--warmup-seconds", type=float, default=8.0)
    args = parser.parse_args(argv)

    started = time.monotonic()
    rows, met = amplification(args)
    print(
        f"Warm load of a {args.tokens}-token prompt stored under `default`, per-rank vs `load: striped` (simulated "
        "KVPolicyStoreWorker ranks through vLLM's receive threads, real Mooncake master). unique = distinct objects "
        "read (and their MiB); x unique = objects (bytes) read / unique; load ms = the simulated load (ranks are "
        f"threads, the exchange in-process), median of {args.repeat}, alternating; speedup = per-rank ms / striped "
        "ms; checked = every rank's blocks byte for byte, and striped read exactly the distinct objects."
    )
    print()
    print(
        table(
            (
                "layout", "tp", "factors", "unique", "unique MiB", "per-rank x unique", "per-rank bytes x",
                "striped x unique", "striped bytes x", "per-rank ms", "striped ms", "speedup", "checked",
            ),
            rows,
        )
    )
    print()
    print("target: striped reads = 1.00 x unique objects and bytes everywhere: " + ("MET" if met else "MISSED"))
    if args.engines:
        results = engines(args)
        warm = {name: [r for r in records if r["phase"] == "warm"] for name, records in results.items()}
        pairs = [p["s"] / s["s"] for p, s in zip(warm["per-rank"], warm["striped"], strict=True)]
        low, high = median_ci(pairs)
        same = all(
            a["tokens"] == b["tokens"] for a, b in zip(results["per-rank"], results["striped"], strict=True)
        )
        cached = {name: sorted({r["cached"] for r in records}) for name, records in warm.items()}
        print()
        print(
            f"Warm TTFT, real vLLM CPU engines at TP=2 (tiny Llama, 1 KV head, {args.prompt_len}-token prompts, "
            f"1 generated token), {len(pairs)} warm requests per engine in lockstep:"
        )
        print()
        print(
            table(
                ("load", "warm requests", "warm TTFT ms (median)", "range ms", "cached tokens"),
                [
                    (
                        name, len(records), f"{statistics.median(r['s'] for r in records) * 1000:.1f}",
                        f"{min(r['s'] for r in records) * 1000:.0f}-{max(r['s'] for r in records) * 1000:.0f}",
                        ",".join(map(str, cached[name])),
                    )
                    for name, records in warm.items()
                ],
            )
        )
        print()
        print(
            f"per-rank TTFT / striped TTFT (median of paired requests): {median(pairs):.3f} "
            f"(95% CI {low:.3f}-{high:.3f}); the same tokens: {'yes' if same else 'NO'}"
        )
        failed = {name: sum(1 for r in records if not r["tokens"]) for name, records in results.items()}
        if any(failed.values()):
            print(f"requests that failed (no tokens): {failed}")
    print(f"({time.monotonic() - started:.0f} s)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
