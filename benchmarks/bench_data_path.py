"""Data path: store and load throughput through the connector vs raw Mooncake batch calls of the same bytes.

Four paths, same master, same run, alternating (the order rotates every repetition):

* **kvpolicy** — a :class:`kvpolicy.sim.Fleet` of one model: a cold instance of ``tp`` simulated ranks,
  each the production ``KVPolicyStoreWorker`` (its token databases, put schedule and lookup prefixes
  from the ``--policy`` plan), one Mooncake client per rank, the ranks running concurrently in threads.
  A *store* is ``Instance.save``: one store job per rank, each rank's ``wait_for_save`` with the
  scheduler's metadata, then vLLM's ``KVCacheStoreSendingThread`` (keys, put striping,
  ``batch_is_exist``, ``batch_put_from_multi_buffers`` from the registered KV tensors, Mamba boundary
  puts), timed until every rank's queue has drained. A *load* is ``Instance.load`` on a second (warm)
  instance of the fleet, same keys: the load metadata and ``start_load_kv`` on every rank, vLLM's
  ``KVCacheStoreRecvingThread`` until the queues drain (rank 0's ``lookup`` runs before, untimed).
* **stock** — the same in a second fleet whose instances run vLLM's own ``MooncakeStoreWorker``
  (``Fleet.instance(None, tp)``): what kvpolicy replaces.
* **raw** — per rank, ONE ``batch_put_from_multi_buffers`` with every (addresses, sizes) the kvpolicy
  send thread passed, under fresh keys; per warm rank, ONE ``batch_get_into_multi_buffers`` of the very
  objects the kvpolicy receive thread reads, into the same addresses. Ranks run concurrently in every
  path (one thread per rank).
* **raw-calls** — every Mooncake call a kvpolicy rank made (exist checks, puts, gets), replayed in
  order without vLLM's threads.

A fleet has one prompt, so every repetition stores the same prompt as a new request (new block
tables) after the previous repetition's objects were deleted (``Fleet.remove_objects``, forced past
Mooncake's leases): each store writes every object again, which the benchmark checks (the keys a store
offers Mooncake must equal the warm-up's); the raw paths use fresh keys per repetition. Before that,
untimed: the kvpolicy cold instance saves until its replication audit is over (``default``: the first
4 saves; the audit runs in ``wait_for_save``, and is not measured), and one warm-up repetition per
fleet with the KV tensors filled with each rank's bytes and the load checked byte for byte
(``Instance.verdict``) records the raw paths' argument lists. Timed stores do not refill the tensors
(the bytes do not change the transfer). A load fails the run when a warm rank's receive thread reports
it unfinished, failed or with block errors (``Instance.load``). Reported: median times, and the medians of
the per-repetition ratios kvpolicy / raw (throughput) and kvpolicy / stock.

Object sizes (``--pages``, see ``kvpolicy.sim.archetype_from_layout``): the simulation keeps 16-token
blocks, and by default (``real``) every page holds what the real model's page holds at its own block size
at that TP size (attention head sizes scaled up, Mamba states unscaled), so a chunk object is as large as
the real model's (Kimi-Linear at tp=2: 7.9 MiB, DeepSeek-V3 1.1 MiB) and a hybrid job's boundary states
are as many as a real prompt of 4 chunks has. ``scaled`` is the earlier shape: attention ``--kv-heads``
x ``--head-size`` per rank, Mamba dims cut to 4 (Kimi-Linear's objects 112 KiB). Targets: stores >= 0.95
x raw (issue 13), loads >= 0.9.

    python benchmarks/bench_data_path.py [--layouts NAME ...] [--tp 2] [--pages real|scaled]
        [--tokens 64] [--repeat 21] [--min-seconds 15] [--policy default] [--layers-per-group N]
        [--head-size 128] [--kv-heads 4]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import example_layouts, median, median_ci, table, verdict

from kvpolicy.language.keys import chunk_key, split_chunk_key

DEFAULT_LAYOUTS = (
    "llama-3.1-70b", "deepseek-v3", "gpt-oss-120b", "kimi-linear-48b-a3b", "qwen3-next-80b-a3b", "nemotron-h-8b",
)
PATHS = ("kvpolicy", "stock", "raw", "raw-calls")
TARGETS = {"store": 0.95, "load": 0.9}
"""kvpolicy throughput as a fraction of raw Mooncake: saves (issue 13: one exists check and one put per
job) and loads."""


class TransferFailed(RuntimeError):
    """A Mooncake transfer of one repetition failed."""


Call = tuple[list[str], list[list[int]], list[list[int]]]
"""Keys, per-key buffer addresses, per-key buffer sizes: the arguments of a multi-buffer batch call."""


def _concat(calls: list[tuple[Any, ...]]) -> Call:
    keys: list[str] = []
    addrs: list[list[int]] = []
    sizes: list[list[int]] = []
    for call_keys, call_addrs, call_sizes in calls:
        keys += call_keys
        addrs += call_addrs
        sizes += call_sizes
    return keys, addrs, sizes


def _rekey(key: str, marker: str) -> str:
    """The same chunk's key in a renamed namespace (still under the fleet's run id, so the fleet's
    ``remove_objects`` deletes it)."""
    namespace, chunk = split_chunk_key(key)
    return chunk_key(f"{namespace}{marker}", chunk)


class Pair:
    """A cold instance (saves) and a warm instance (loads) of one :class:`kvpolicy.sim.Fleet`, so they
    share keys; ``policy`` None runs vLLM's own ``MooncakeStoreWorker`` (the stock path)."""

    def __init__(self, fleet: Any, policy: Any, tp: int, label: str) -> None:
        self.fleet = fleet
        self.label = label
        self.tp = tp
        self.cold = fleet.instance(policy, tp, name="cold")
        self.warm = fleet.instance(policy, tp, name="warm")
        self.offered: int | None = None
        """Keys a store offers Mooncake (from the recorded warm-up): fewer means an object survived."""

    def capture(self, on: bool) -> None:
        self.cold.capture(on)
        self.warm.capture(on)

    def finish_audit(self) -> int:
        """Untimed saves until the cold instance's replication audit is over (``audit.steps`` audited
        saves under ``default``; none for the stock path or ``audit: off``), then one warm lookup, which
        opens the warm instance's lookup gate for good (it remembers the agreement markers it found).
        Returns the saves made; the objects are removed."""
        saves = 0
        audit = self.cold.audit if self.cold.policy is not None else None
        while audit is not None and audit.groups_to_audit():
            if saves > audit.steps:
                raise RuntimeError(f"{self.label}: the audit did not finish after {saves} saves")
            self.cold.save(request=f"audit{saves}")
            saves += 1
        if saves and (self.warm.lookup().hit_length == 0 or self.warm.last_lookup_gated):
            raise RuntimeError(f"{self.label}: the warm instance's lookup found nothing after the audit")
        self.fleet.remove_objects()
        return saves

    def store(self, request: str, *, fill: bool = False) -> float:
        """One store job on every cold rank (a new request for the fleet's prompt), timed from
        ``wait_for_save`` until every rank's send queue drained."""
        started = time.perf_counter()
        outcome = self.cold.save(request=request, fill=fill)
        elapsed = time.perf_counter() - started
        unfinished = sorted(set(range(self.tp)) - set(outcome.completed_ranks))
        if outcome.put_failures or unfinished:
            raise TransferFailed(
                f"store ({self.label}): {outcome.put_failures} puts failed, ranks {unfinished} did not finish"
            )
        if self.offered is None:
            self.offered = len(outcome.puts)
        elif len(outcome.puts) != self.offered:
            raise TransferFailed(
                f"store ({self.label}): offered {len(outcome.puts)} keys, the warm-up {self.offered} "
                "(objects of an earlier repetition survived their removal)"
            )
        return elapsed

    def load(self) -> tuple[float, Any]:
        """Rank 0's lookup (untimed), then the load on every warm rank through vLLM's receive threads,
        timed from ``start_load_kv`` until every rank's queue drained."""
        lookup = self.warm.lookup()
        if lookup.hit_length == 0:
            raise TransferFailed(f"load ({self.label}): the lookup found nothing")
        started = time.perf_counter()
        loads = self.warm.load(lookup)
        elapsed = time.perf_counter() - started
        failed = [load.tp_rank for load in loads if not load.ok]
        if failed:
            raise TransferFailed(f"load ({self.label}) failed on ranks {failed}: {[loads[rank] for rank in failed]}")
        return elapsed, lookup


def run_layout(stem: str, layout: Any, args: argparse.Namespace, master: Any, pool: Any) -> dict[str, Any]:
    from mooncake.store import ReplicateConfig

    from kvpolicy.documents.loader import load_policy
    from kvpolicy.sim import Fleet, archetype_from_layout

    policy = load_policy(args.policy)
    real = args.pages == "real"
    archetype = archetype_from_layout(
        layout,
        name=f"bench-data-{stem}",
        layers_per_group=args.layers_per_group,
        head_size=None if real else args.head_size,
        num_kv_heads=None if real else args.kv_heads,
    )
    tp = args.tp
    executor = ThreadPoolExecutor(max_workers=tp)
    with contextlib.ExitStack() as stack:
        stack.callback(executor.shutdown)
        fleets = {
            name: stack.enter_context(
                Fleet(archetype, master=master, clients=pool, num_tokens=args.tokens, seed=args.seed, name=name)
            )
            for name in ("kvpolicy", "stock")
        }
        pairs = {
            "kvpolicy": Pair(fleets["kvpolicy"], policy, tp, "kvpolicy"),
            "stock": Pair(fleets["stock"], None, tp, "stock"),
        }
        kv = pairs["kvpolicy"]
        raw_put_clients = [rank.store.client for rank in kv.cold.ranks]
        raw_get_clients = [rank.store.client for rank in kv.warm.ranks]
        audit_saves = kv.finish_audit()
        pairs["stock"].finish_audit()

        # Warm-up: both pairs once, the KV tensors filled with each rank's bytes, the load checked
        # byte for byte, recording what the threads pass to Mooncake.
        checks = {}
        for name, pair in pairs.items():
            pair.capture(True)
            pair.store("warmup", fill=True)
            _, lookup = pair.load()
            pair.capture(False)
            result = pair.warm.verdict(lookup)
            checks[name] = (
                result.correct and not result.crashed and not result.reported_errors
                and result.used_tokens == result.hit_tokens
            )
            pair.fleet.remove_objects()
        puts = [_concat(rank.store.calls_of("batch_put_from_multi_buffers")) for rank in kv.cold.ranks]
        gets = [_concat(rank.store.calls_of("batch_get_into_multi_buffers")) for rank in kv.warm.ranks]
        calls_per_rank = {
            "store": max(len(rank.store.calls) for rank in kv.cold.ranks),
            "load": max(len(rank.store.calls_of("batch_get_into_multi_buffers")) for rank in kv.warm.ranks),
        }
        # The fixed cost of one extra Mooncake call: a batch_is_exist of one rank's keys.
        probe = []
        for _ in range(15):
            started = time.perf_counter()
            raw_put_clients[0].batch_is_exist(puts[0][0])
            probe.append(time.perf_counter() - started)
        stock_objects = sum(
            len(keys)
            for rank in pairs["stock"].cold.ranks
            for keys, _, _ in rank.store.calls_of("batch_put_from_multi_buffers")
        )

        def raw_store(marker: str) -> Callable[[], float]:
            config = ReplicateConfig()
            calls = [
                functools.partial(
                    client.batch_put_from_multi_buffers, [_rekey(key, marker) for key in keys], addrs, sizes, config
                )
                for client, (keys, addrs, sizes) in zip(raw_put_clients, puts, strict=True)
            ]
            return lambda: _timed(executor, calls, "raw put")

        store_calls = [list(rank.store.calls) for rank in kv.cold.ranks]
        # Rank 0's lookup (its batch_is_exist) is not part of the load.
        load_calls = [
            [call for call in rank.store.calls if call[0] == "batch_get_into_multi_buffers"] for rank in kv.warm.ranks
        ]

        def replay(
            clients: list[Any], recorded: list[list[tuple[str, tuple[Any, ...]]]], marker: str
        ) -> Callable[[], float]:
            """Every Mooncake call one kvpolicy rank made, in its order; puts and exist checks under keys
            renamed with ``marker``, gets of the kvpolicy store's own objects."""
            config = ReplicateConfig()
            prepared = []
            for client, calls in zip(clients, recorded, strict=True):
                steps = []
                for method, arguments in calls:
                    keys = arguments[0]
                    if method != "batch_get_into_multi_buffers":
                        keys = [_rekey(key, marker) for key in keys]
                    extra = (config,) if method == "batch_put_from_multi_buffers" else ()
                    steps.append((getattr(client, method), (keys, *arguments[1:], *extra), method))
                prepared.append(steps)

            def rank_calls(steps: list[Any]) -> list[int]:
                codes: list[int] = []
                for function, arguments, method in steps:
                    result = function(*arguments)
                    if method != "batch_is_exist":
                        codes += list(result)
                return codes

            calls = [functools.partial(rank_calls, steps) for steps in prepared]
            return lambda: _timed(executor, calls, "raw call replay")

        def raw_load() -> Callable[[], float]:
            calls = [
                functools.partial(client.batch_get_into_multi_buffers, keys, addrs, sizes)
                for client, (keys, addrs, sizes) in zip(raw_get_clients, gets, strict=True)
            ]
            return lambda: _timed(executor, calls, "raw get")

        times: dict[str, dict[str, list[float]]] = {op: {path: [] for path in PATHS} for op in ("store", "load")}
        failures: list[str] = []
        attempt = 0
        deadline = time.monotonic() + args.min_seconds

        def done() -> int:
            return len(times["store"]["raw"])

        while done() < args.repeat or (time.monotonic() < deadline and done() < 50 * args.repeat):
            attempt += 1
            request = f"rep{attempt}"
            turn = len(times["store"]["raw"])
            order = PATHS[turn % len(PATHS) :] + PATHS[: turn % len(PATHS)]
            stores = {
                "kvpolicy": lambda request=request: kv.store(request),
                "stock": lambda request=request: pairs["stock"].store(request),
                "raw": raw_store(f"#raw{attempt}"),
                "raw-calls": replay(raw_put_clients, store_calls, f"#rawc{attempt}"),
            }
            # The raw loads read the objects the kvpolicy store wrote, so every store precedes the loads.
            loads = {
                "kvpolicy": lambda: kv.load()[0],
                "stock": lambda: pairs["stock"].load()[0],
                "raw": raw_load(),
                "raw-calls": replay(raw_get_clients, load_calls, ""),
            }
            try:
                measured = {("store", path): stores[path]() for path in order}
                measured.update({("load", path): loads[path]() for path in order})
            except TransferFailed as error:
                # Mooncake's TCP transport rejects transfers when a peer's queue stays full (seen on this
                # 2-core machine under load from other processes); any path can hit it. The repetition
                # is dropped and counted, and a new one takes its place.
                failures.append(f"{stem}: {error}")
                if len(failures) > args.repeat:
                    raise
            else:
                for (op, path), value in measured.items():
                    times[op][path].append(value)
            finally:
                for fleet in fleets.values():
                    fleet.remove_objects()
        return {
            "times": times,
            "bytes": {
                "store": sum(sum(map(sum, sizes)) for _, _, sizes in puts),
                "load": sum(sum(map(sum, sizes)) for _, _, sizes in gets),
            },
            "objects": {"store": sum(len(keys) for keys, _, _ in puts), "load": sum(len(keys) for keys, _, _ in gets)},
            "stock_objects": stock_objects,
            "calls": calls_per_rank,
            "exist_ms": median(probe) * 1000,
            "factors": ",".join(str(factor) for factor in kv.cold.plan.factors),
            "audit_saves": audit_saves,
            "checks": checks,
            "failures": failures,
        }


def _timed(executor: ThreadPoolExecutor, calls: list[Callable[[], Any]], what: str) -> float:
    started = time.perf_counter()
    results = list(executor.map(lambda call: call(), calls))
    elapsed = time.perf_counter() - started
    bad = [code for result in results for code in result if code < 0]
    if bad:
        raise TransferFailed(f"{what} failed for {len(bad)} keys (codes {sorted(set(bad))})")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument(
        "--pages", choices=("real", "scaled"), default="real",
        help="real: every chunk object as large as the real model's at its own block size (attention pages "
        "scaled up to hold the real block's bytes in 16 tokens, real Mamba states); scaled: --kv-heads x "
        "--head-size attention, Mamba dims cut to 4",
    )
    parser.add_argument("--tokens", type=int, default=None, help="prompt length (block size 16); default 64 real, 512 scaled")
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--policy", default="default")
    parser.add_argument("--layers-per-group", type=int, default=None, help="default: all of the layout's layers")
    parser.add_argument("--head-size", type=int, default=128, help="per-rank attention head size")
    parser.add_argument("--kv-heads", type=int, default=4, help="per-rank attention KV heads")
    parser.add_argument(
        "--min-seconds", type=float, default=15.0, help="per layout: keep repeating until this much time has passed"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--segment-mib", type=int, default=256, help="store segment per client")
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = 64 if args.pages == "real" else 512

    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.mooncake.native_log import native_stderr_to
    from kvpolicy.mooncake.pool import ClientPool

    started = time.monotonic()
    layouts = example_layouts(args.layouts)
    results = []
    log = Path(tempfile.gettempdir()) / "kvpolicy-bench-mooncake.log"
    with native_stderr_to(log), MooncakeMaster() as master, ClientPool(master, segment_mib=args.segment_mib) as pool:
        for stem, layout in layouts:
            results.append((stem, run_layout(stem, layout, args, master, pool)))
    elapsed = time.monotonic() - started

    rows = []
    misses = []
    for stem, result in results:
        for op in ("store", "load"):
            t = result["times"][op]
            size = result["bytes"][op]
            vs_raw = [r / k for k, r in zip(t["kvpolicy"], t["raw"], strict=True)]
            vs_stock = [s / k for k, s in zip(t["kvpolicy"], t["stock"], strict=True)]
            vs_calls = [r / k for k, r in zip(t["kvpolicy"], t["raw-calls"], strict=True)]
            interval = median_ci(vs_raw)
            if median(vs_raw) < TARGETS[op]:
                misses.append(f"{stem} {op}: {verdict(median(vs_raw), interval, TARGETS[op])}")
            rows.append(
                (
                    stem,
                    op,
                    len(t["raw"]),
                    result["objects"][op],
                    f"{size / max(1, result['objects'][op]) / 1024:.0f}",
                    f"{size / 2**20:.1f}",
                    result["calls"][op],
                    f"{size / median(t['kvpolicy']) / 2**20:.0f}",
                    f"{size / median(t['raw']) / 2**20:.0f}",
                    f"{median(t['kvpolicy']) * 1000:.1f}",
                    f"{median(t['stock']) * 1000:.1f}",
                    f"{median(t['raw']) * 1000:.1f}",
                    f"{median(t['raw-calls']) * 1000:.1f}",
                    f"{median(vs_raw):.2f} ({interval[0]:.2f}-{interval[1]:.2f})",
                    f"{median(vs_calls):.2f}",
                    f"{median(vs_stock):.2f}",
                )
            )
    print(
        f"Data path, policy {args.policy}, tp={args.tp} simulated ranks (one thread each), {args.tokens}-token prompt, "
        f"block 16, {args.layers_per_group or 'all'} layers per group, "
        + (
            "real chunk objects (each 16-token page as large as the real model's page at its own block size, "
            "real Mamba states)"
            if args.pages == "real"
            else f"attention {args.kv_heads} KV heads x {args.head_size} per rank, Mamba dims <= 4"
        )
        + f"; median of >= {args.repeat} repetitions (and >= {args.min_seconds:g} s) "
        "per layout, "
        "the four paths alternating in rotation. "
        "x/raw = raw time / kvpolicy time (kvpolicy throughput as a fraction of raw Mooncake: ONE batch call "
        "per rank); x/raw-calls = the same against replaying the kvpolicy rank's own Mooncake calls (calls/rank: "
        "exist checks and puts, or gets) without vLLM's threads; x/stock = stock vLLM connector time / kvpolicy "
        "time; all medians of per-repetition ratios (95% CI: bootstrap of the median)."
    )
    print()
    print(
        table(
            (
                "layout", "op", "reps", "objects", "KiB/obj", "MiB", "calls/rank", "kvpolicy MiB/s", "raw MiB/s",
                "kvpolicy ms", "stock ms", "raw ms", "raw-calls ms", "x/raw (95% CI)", "x/raw-calls", "x/stock",
            ),
            rows,
        )
    )
    print()
    print(
        f"target: kvpolicy connector >= {TARGETS['store']} of raw for stores, >= {TARGETS['load']} for loads: "
        + ("MET" if not misses else "MISSED")
    )
    for miss in misses:
        print(f"  {miss}")
    print(
        "one extra Mooncake call (batch_is_exist of one rank's keys, median): "
        + ", ".join(f"{stem} {result['exist_ms']:.2f} ms" for stem, result in results)
    )
    wrong = [f"{stem} {path}" for stem, result in results for path, ok in result["checks"].items() if not ok]
    print(
        "warm-up load byte for byte (every rank's own bytes, nothing else written): "
        + ("yes" if not wrong else "NO for " + ", ".join(wrong))
        + "; untimed audited saves before it (kvpolicy): "
        + ", ".join(f"{stem} {result['audit_saves']}" for stem, result in results)
    )
    mismatched = [stem for stem, result in results if result["stock_objects"] != result["objects"]["store"]]
    if mismatched:
        print(f"note: stock wrote a different number of objects than kvpolicy for {', '.join(mismatched)}")
    dropped = [failure for _, result in results for failure in result["failures"]]
    if dropped:
        print(f"{len(dropped)} repetition(s) dropped after a Mooncake transfer failure, and replaced:")
        for failure in dropped:
            print(f"  {failure}")
    print(f"({elapsed:.0f} s; Mooncake client log: {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
