"""Striped reads: objects and bytes a warm load takes out of the store, per-rank vs ``load: striped``;
what the stripes' exchange moves and copies; and what it costs in time.

**Read amplification** (simulation): for every example layout and TP size, a cold instance of
``KVPolicyStoreWorker`` ranks (``kvpolicy.sim.Fleet``, the layout's real spec classes scaled down)
saves a prompt under ``default``; then a warm instance under ``default`` (every rank reads what it
needs: vLLM's way) and one under ``default`` + ``load: striped`` load it through vLLM's receive
threads. Objects and bytes read are what each rank's store client was asked for (its own record of
``batch_get_into_multi_buffers``, the keys the master served); unique = the distinct objects among
them, with their sizes. Target: striped / unique = 1.00; per-rank reads a group replicated over
``f`` ranks ``f`` times. Every load is checked byte for byte on every rank (``Instance.verdict``).
Beside them, from each striped rank's own ``StripeCounts`` for that load: bytes received ÷ bytes
loaded (the most of any rank), exchanges, indexed copies and the host staging it held at once (the
bytes of its staging buffers, counted; not a process-wide measure). The same table gives each load's
time in the simulation, the two alternating (ranks are threads of one process there, and the stripes
go through an in-process exchange: a lower bound of the exchange's cost, not a network's).

**Shaped for GPUs** (no engine, no store): for every example layout and TP size, a ``--long-tokens``
prompt (default 128k) loaded under ``load: striped``: the plan's replicated groups, one object per
chunk and one region per layer (vLLM's layout of one KV tensor per layer), each rank's schedule from
the product's own ``kvpolicy.runtime.striping.plan_stripes`` and ``index_runs``. The old design (every
stripe all-gathered to every TP rank, pickled; one device↔host copy per region) is computed from its
code as a baseline column: it received every other TP rank's stripe, copied every region of every
replicated key once, and held every rank's stripe twice in host memory (the gathered pickles and
their unpickled dicts) — a lower bound of its peak.

**Warm TTFT on a real engine** (unless ``--no-engines``): two vLLM CPU engines at TP=2 serving a tiny random
Llama with one KV head (both ranks hold the same head: factor 2), one per policy, each with its own
``cache_prefix``, driven in lockstep as in ``bench_e2e.py`` (the engines from there), one 1-token
request at a time: per prompt a cold request on each, then warm requests, every one loading the
prompt's chunks from Mooncake. Striped: each rank reads half of them and receives the other half from
its peer over the TP group's gloo group.

    python benchmarks/bench_striped_reads.py [--layouts NAME ...] [--tp 2 4 8] [--tokens 512] [--repeat 5]
        [--long-tokens 131072] [--piece-mib 256] [--no-sim] [--no-engines] [--prompts 6] [--warm-repeats 4]
        [--prompt-len 416]
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

from _common import REPO, example_layouts, median, median_ci, table


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
    from kvpolicy.documents.loader import load_policy
    from kvpolicy.language.models import LoadMode
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
        stripes: list[Any] = []
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
                before = _stripe_counts(instance)
                started = time.perf_counter()
                instance.load(lookup)
                elapsed = time.perf_counter() - started
                instance.capture(False)
                if repetition == 0:  # counted and checked once; timed from the next on
                    counts[name] = _reads(instance)
                    if name == "striped":
                        stripes = [
                            _minus(after, was) for after, was in zip(_stripe_counts(instance), before, strict=True)
                        ]
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
        "stripes": stripes,
    }


def _stripe_counts(instance: Any) -> list[Any]:
    """Each striped rank's cumulative ``StripeCounts`` (none where striping is not installed)."""
    from kvpolicy.device.striped import StripedReadStore
    from kvpolicy.runtime.read_failures import RecordingReadStore

    found = []
    for rank in instance.ranks:
        for thread in rank.worker.kv_recv_threads:
            store = thread.store.inner if isinstance(thread.store, RecordingReadStore) else thread.store
            if isinstance(store, StripedReadStore):
                found.append(store.counts)
    return found


def _minus(after: Any, before: Any) -> Any:
    """One load's counts: the difference of two cumulative ones (peaks: the later, a load's own peak
    never exceeding it)."""
    import dataclasses

    return type(after)(
        **{
            field.name: getattr(after, field.name) if field.name.startswith("peak_")
            else getattr(after, field.name) - getattr(before, field.name)
            for field in dataclasses.fields(after)
        }
    )


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
                stripes = m["stripes"]
                received = max((c.bytes_received / c.bytes_loaded for c in stripes), default=0.0)
                rows.append(
                    (
                        stem, tp, m["factors"], m["unique_objects"], f"{m['unique_bytes'] / 2**20:.2f}",
                        f"{per_objects / m['unique_objects']:.2f}", f"{per_bytes / m['unique_bytes']:.2f}",
                        f"{ratio_objects:.2f}", f"{ratio_bytes:.2f}",
                        f"{received:.3f}" if stripes else "-",
                        f"{(top - 1) / top:.3f}" if (top := max(map(int, m["factors"].split(",")))) > 1 else "-",
                        str(max(c.exchanges for c in stripes)) if stripes else "-",
                        str(max(c.gather_ops + c.scatter_ops for c in stripes)) if stripes else "-",
                        f"{max(c.peak_host_staging_bytes for c in stripes) / 1024:.1f}" if stripes else "-",
                        f"{median(m['times']['per-rank']) * 1000:.1f}", f"{median(m['times']['striped']) * 1000:.1f}",
                        f"{median(speed):.2f}", "yes" if m["correct"] and m["same_objects"] else "NO",
                    )
                )
    return rows, met


# --- shaped for GPUs: the product's schedule on long prompts, old design as a baseline ----------------


def gpu_shape(stem: str, layout: Any, tp: int, tokens: int, budget: int) -> tuple[Any, ...]:
    """One row: a ``tokens``-token striped load on every rank of ``layout`` at ``tp``, from the plan."""
    from kvpolicy.documents.loader import load_policy
    from kvpolicy.language.models import LoadMode, Topology
    from kvpolicy.planning.engine import plan_deployment
    from kvpolicy.runtime.striping import StorageMap, index_runs, plan_stripes

    policy = load_policy("default").model_copy(update={"load": LoadMode.STRIPED})
    plan, _, _ = plan_deployment(policy, layout, Topology(tp_size=tp))
    groups = [group for group in plan.groups if group.factor > 1]
    factors = ",".join(str(group.factor) for group in plan.groups)
    if not groups:
        return (stem, tp, factors, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "striping not installed")
    shapes = {}  # group -> (chunks, layers, region bytes)
    for group in groups:
        layers = len(group.decisions)
        shapes[group.index] = (
            tokens // group.chunk_tokens, layers, round(group.bytes_per_token_per_rank * group.chunk_tokens / layers)
        )

    def request(rank: int) -> tuple[list[str], list[list[int]], list[list[int]], StorageMap]:
        keys, sizes, addresses = [], [], []
        starts, lengths = [], []
        for group in groups:
            chunks, layers, region = shapes[group.index]
            shard = group.ranks[rank].replica_set[0]
            first_tensor = len(starts)
            for _ in range(layers):  # one KV tensor per layer, a block per chunk
                starts.append((len(starts) + 1) << 40)
                lengths.append(chunks * region)
            for chunk in range(chunks):
                keys.append(f"g{group.index}/s{shard}@{chunk:08x}")
                sizes.append([region] * layers)
                addresses.append([starts[first_tensor + layer] + chunk * region for layer in range(layers)])
        return keys, sizes, addresses, StorageMap(starts, lengths)

    schedules = []
    for rank in range(tp):
        keys, sizes, _, _ = request(rank)
        schedules.append(
            plan_stripes(
                keys, sizes, tp_rank=rank, group_of_key=lambda key: int(key[1 : key.index("/")]),
                replica_set_of=lambda group, rank=rank: plan.groups[group].ranks[rank].replica_set,
                budget_bytes=budget,
            )
        )
    load = schedules[0].load_bytes  # the same on every rank
    stripe = [sum(unit.nbytes for unit in schedule.units_read) for schedule in schedules]
    new_received = [schedule.bytes_received / load for schedule in schedules]
    old_received = [(sum(stripe) - own) / load for own in stripe]  # every other rank's stripe, all-gathered
    bound = sum(
        (group.factor - 1) / group.factor * chunks * layers * region
        for group in groups
        for chunks, layers, region in [shapes[group.index]]
    ) / load
    regions = sum(chunks * layers for chunks, layers, _ in shapes.values())
    # On CUDA, per piece: the send staging to the host, the received staging back, two index uploads.
    keys, sizes, addresses, storages = request(0)
    pieces = schedules[0].pieces
    copies = sum(2 * (bool(piece.outgoing) + bool(piece.incoming)) for piece in pieces)
    indexed = sum(
        len(index_runs(piece.outgoing, addresses, storages)) + len(index_runs(piece.incoming, addresses, storages))
        for piece in pieces
    )
    old_host = 2 * sum(stripe) + 2 * max(stripe)  # gathered pickles + their dicts, own bytes + own pickle
    new_host = max(schedule.peak_staged_bytes for schedule in schedules)
    within = all(
        schedule.bytes_received <= bound * load + sum(shapes[g.index][1] * shapes[g.index][2] for g in groups)
        for schedule in schedules
    )
    return (
        stem, tp, factors, f"{load / 2**30:.2f}", f"{max(old_received):.3f}", f"{max(new_received):.3f}",
        f"{statistics.mean(new_received):.3f}", f"{bound:.3f}", f"{regions:,}", f"{copies}", f"{indexed:,}",
        len(pieces), f"{old_host / 2**30:.2f}", f"{new_host / 2**20:.0f}",
        "yes" if within else "NO", "",
    )


# --- real engines -----------------------------------------------------------------------------------


def engines(args: argparse.Namespace) -> dict[str, Any]:
    """Warm latency of two TP=2 engines, per-rank vs striped, driven in lockstep."""
    from bench_e2e import LEASE_TTL_MS, Engine, _engine_env, _prompts

    from kvpolicy.documents.settings import KVPolicySettings
    from kvpolicy.harness.e2e import SegmentHolder, engine_env, engine_store_config
    from kvpolicy.harness.tinymodel import make_tiny_llama
    from kvpolicy.mooncake import MooncakeMaster

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
                            "kv_transfer_config": KVPolicySettings(kvpolicy=str(path)).kv_transfer_config(
                                upstream_extra={"cache_prefix": f"bench-{name}-{uuid.uuid4().hex[:8]}"}
                            ),
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
    parser.add_argument("--no-sim", dest="sim", action="store_false", help="skip the simulated loads")
    parser.add_argument("--long-tokens", type=int, default=131072, help="prompt of the shaped-for-GPUs table")
    parser.add_argument("--piece-mib", type=float, default=256.0, help="staging budget per exchange (MiB)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--warm-repeats", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=416)
    parser.add_argument("--warmup-seconds", type=float, default=8.0)
    args = parser.parse_args(argv)

    started = time.monotonic()
    met = True
    if args.sim:
        rows, met = amplification(args)
        print(
            f"Warm load of a {args.tokens}-token prompt stored under `default`, per-rank vs `load: striped` (simulated "
            "KVPolicyStoreWorker ranks through vLLM's receive threads, real Mooncake master). unique = distinct "
            "objects read (and their MiB); x unique = objects (bytes) read / unique; recv/load = bytes a striped rank "
            "received / bytes it loaded, the most of any rank (whole objects: above (f-1)/f by up to one object when f "
            "does not divide the chunks, below it where groups without replicas load too); exchanges, indexed copies "
            "(gather + scatter) and host staging KiB (its staging buffers' bytes at once) per load, the most of any "
            "rank, from its StripeCounts (no device-host copies: the simulation's KV caches are host memory); "
            "load ms = the simulated load (ranks are threads, the exchange in-process), median of "
            f"{args.repeat}, alternating; speedup = per-rank ms / striped ms; checked = every rank's blocks byte "
            "for byte, and striped read exactly the distinct objects."
        )
        print()
        print(
            table(
                (
                    "layout", "tp", "factors", "unique", "unique MiB", "per-rank x unique", "per-rank bytes x",
                    "striped x unique", "striped bytes x", "recv/load", "(f-1)/f", "exchanges", "indexed copies",
                    "staging KiB", "per-rank ms", "striped ms", "speedup", "checked",
                ),
                rows,
            )
        )
        print()
        print("target: striped reads = 1.00 x unique objects and bytes everywhere: " + ("MET" if met else "MISSED"))
        print()
    budget = int(args.piece_mib * 2**20)
    shaped = [
        gpu_shape(stem, layout, tp, args.long_tokens, budget)
        for stem, layout in example_layouts(args.layouts)
        for tp in args.tp
    ]
    print(
        f"Shaped for GPUs: a {args.long_tokens:,}-token prompt loaded striped, per rank, from the plan and the "
        f"product's schedule (plan_stripes, index_runs; {args.piece_mib:g} MiB pieces; one region per layer and "
        "chunk). load = the rank's bytes of the replicated groups; recv/load = bytes received / load, the most of "
        "any rank (old: every other rank's stripe, all-gathered to every TP rank; new: from the replica set only), "
        "and the mean over ranks; (f-1)/f = the bound for whole replica sets; copies = device<->host copies per "
        "load on a GPU (old: one per region; new: per piece the staging each way and its row indices); indexed = "
        "index_select/index_copy_ calls per load (one per KV tensor and block); host GiB/MiB = host memory the "
        "exchange holds at once (old: >= every rank's stripe twice, from its code; new: the largest piece's "
        "staging, pinned on CUDA); within = every rank's recv <= (f-1)/f x load + one object per group."
    )
    print()
    print(
        table(
            (
                "layout", "tp", "factors", "load GiB", "old recv/load", "new recv/load", "new mean", "(f-1)/f",
                "old copies", "new copies", "new indexed", "pieces", "old host GiB", "new host MiB", "within",
                "note",
            ),
            shaped,
        )
    )
    striped_rows = [row for row in shaped if row[-2] != "-"]
    within = all(row[-2] == "yes" for row in striped_rows)
    met = met and within
    print()
    print(
        f"target: bytes received per rank <= (f-1)/f of the load (+ one object per group when f does not divide the "
        f"chunks) on every replicated row: {'MET' if within else 'MISSED'} ({len(striped_rows)} rows)"
    )
    print()
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
