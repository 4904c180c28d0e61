"""No cost when nothing is reused: an all-miss workload on real vLLM engines (CPU), with no KV connector,
the stock ``MooncakeStoreConnector`` and ``KVPolicyConnector`` (``default`` policy), in the same run.

Three engine processes live side by side, each serving the tiny random Llama
(``kvpolicy.harness.tinymodel``) at TP=1 with prefix caching off inside the engine, so every request
computes its whole prompt: ``none`` (no ``kv_transfer_config``), ``stock`` (vLLM's
``MooncakeStoreConnector``) and ``kvpolicy`` (``KVPolicyConnector`` with the shipped ``default``
policy, the ``--kv-transfer-config`` of the README's "Point vLLM at a policy"). The connector
engines talk to a Mooncake master started here on 127.0.0.1 and store into a segment holder
process (``kvpolicy.harness.e2e.SegmentHolder``), each under its own ``cache_prefix``.
``--decompose`` adds two more kvpolicy engines that split the store path in two: ``kvpolicy-lookup``
(``kv_role: kv_consumer``: the lookup runs, nothing is saved) and ``kvpolicy-save``
(``enable_lookup: false``: every request is saved, no lookup).

Every request is a fresh random prompt: no prompt shares its first chunk with any earlier one, and
no two engines read each other's keys, so every lookup misses and every request's KV is saved. That
store path (the lookup RPC, the save's puts, kvpolicy's bookkeeping) is the cost measured. The
parent drives the engines in lockstep, one request at a time, cycling through every order of the
engines; each round sends the same new prompt(s) to all of them:

- **TTFT**: one prompt, ``max_tokens=1`` (the latency of a 1-token generation, ``LLM.generate``'s
  wall time);
- **throughput**: ``--batch`` prompts submitted at once (one ``LLM.generate`` call on a list),
  ``--max-tokens`` generated tokens each; tokens/s = (prompt + generated tokens) / wall time.

After each request the engine is stepped until its connector's saves have drained (untimed; the
drain time is reported separately, and the Mooncake master's counters, read by the parent around
each request, give the objects written, the keys probed and the RPCs the master answered). Start-up is excluded, and so are an
untimed warm-up per engine (a fresh CPU engine is slow for its first ~10 s of requests) and three
untimed lockstep TTFT rounds and one batch round.

Ratios are medians of per-round paired ratios (a round's requests ran back to back, under the same
load) with bootstrap 95% intervals: TTFT connector / none, throughput connector / none. Target
(issue 13; LMCache is reported 3-15% slower than no connector in this case): kvpolicy within 3% of
no connector, TTFT ratio <= 1.03 and throughput ratio >= 0.97. Checks: every connector engine
generated the no-connector engine's tokens (greedy), no request found a cached token, the saving
engines drained their saves and wrote objects on every request, the looking-up engines probed
keys on every request, and the no-connector engine touched the store not at all.

Where the time goes: per request the CPU time of the engine process (``time.process_time``, every
thread) and of the store's processes (master and segment holder, from ``/proc``: on this 2-core
machine they take cores from the engine while it computes; in a deployment they run elsewhere),
and per engine the CPU time of each of its threads over the timed phases. ``--profile`` adds a
cProfile of the kvpolicy engine's main thread (connector functions only) and ``--profile-dir``
dumps every engine's (profiling slows the profiled engine: its ratios then mean nothing).
``--layers``/``--hidden`` grow the random model (more compute per byte of KV saved) and
``--omp-threads`` leaves cores to the store path.

    python benchmarks/bench_all_miss.py [--pairs 2] [--prompts 60] [--batches 16] [--batch 8]
        [--prompt-len 416] [--max-tokens 32] [--warmup-seconds 8] [--decompose] [--profile]
        [--layers 2] [--hidden 64] [--omp-threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median_ci, table, verdict
from bench_e2e import Engine

from kvpolicy.documents.settings import KVPolicySettings

TTFT_TARGET = 1.03
"""kvpolicy TTFT / no-connector TTFT at most this."""
THROUGHPUT_TARGET = 0.97
"""kvpolicy tokens/s / no-connector tokens/s at least this."""
BLOCK_SIZE = 32
VOCAB = 384
LEASE_TTL_MS = 120_000
"""As in bench_e2e.py: Mooncake's default 10 s lease has expired mid-load on this loaded machine."""
TICKS = os.sysconf("SC_CLK_TCK")

KVPOLICY = KVPolicySettings(kvpolicy="default").kv_transfer_config()
ENGINES: dict[str, dict[str, Any]] = {
    "none": {"config": None, "lookups": False, "saves": False},
    "stock": {
        "config": {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}},
        "lookups": True,
        "saves": True,
    },
    "kvpolicy": {"config": KVPOLICY, "lookups": True, "saves": True},
}
DECOMPOSED: dict[str, dict[str, Any]] = {
    "kvpolicy-lookup": {"config": {**KVPOLICY, "kv_role": "kv_consumer"}, "lookups": True, "saves": False},
    "kvpolicy-save": {
        "config": {**KVPOLICY, "kv_connector_extra_config": {"kvpolicy": "default", "enable_lookup": False}},
        "lookups": False,
        "saves": True,
    },
}


# --- the child: one engine, requests on demand ----------------------------------------------------


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of every live thread of this process, by thread name: Python's name
    for Python threads, the kernel's ``comm`` for native ones (OpenMP's and Mooncake's say ``python``)."""
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    totals: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
        tid = int(task.name)
        name = "MainThread" if tid == os.getpid() else python_names.get(tid, comm)
        name = name.rstrip("0123456789-_/ ") or name  # pool threads of one kind together
        totals[name] = totals.get(name, 0.0) + seconds
    return totals


def child(spec_path: str) -> int:
    """Build the engine, warm it up, answer ``ready``, then serve one JSON command per stdin line."""
    # vLLM and Mooncake print to stdout too; the replies get a private copy of it.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvpolicy.harness.e2e import drain_saves

    spec = json.loads(Path(spec_path).read_text())
    config = spec["kv_transfer_config"]
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        tensor_parallel_size=1,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=BLOCK_SIZE,
        max_model_len=int(spec["max_model_len"]),
        max_num_seqs=int(spec["max_num_seqs"]),
        seed=0,
        kv_transfer_config=KVTransferConfig(**config) if config else None,
    )
    startup = time.monotonic() - started

    def generate(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
        requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
        began, began_cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(requests, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - began, time.process_time() - began_cpu
        began, began_cpu = time.perf_counter(), time.process_time()
        drained = drain_saves(llm) if config else True
        return {
            "s": elapsed,
            "cpu": cpu,
            "drain_s": time.perf_counter() - began,
            "drain_cpu": time.process_time() - began_cpu,
            "drained": drained,
            "cached": [int(output.num_cached_tokens or 0) for output in outputs],
            "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        }

    # Warm-up: untimed fresh prompts, one TTFT request then one batch, for at least `warmup_s` seconds.
    warmup = iter(spec["warmup_prompts"])
    warmup_until = time.monotonic() + float(spec["warmup_s"])
    for index in itertools.count():
        if index >= 2 and time.monotonic() > warmup_until:
            break
        try:
            generate([next(warmup)], 1)
            generate([next(warmup) for _ in range(int(spec["batch"]))], int(spec["max_tokens"]))
        except StopIteration:
            break
    replies.write(json.dumps({"ready": True, "startup_s": startup}) + "\n")
    threads_before: dict[str, float] = {}
    profiler = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        if op == "mark":  # start of a timed phase
            threads_before = _thread_cpu()
            if command.get("cprofile") and profiler is None:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            replies.write(json.dumps({"ok": True}) + "\n")
        elif op == "report":  # end of a timed phase: CPU per thread since the mark
            after = _thread_cpu()
            report: dict[str, Any] = {"threads": {name: after[name] - threads_before.get(name, 0.0) for name in after}}
            if command.get("final") and profiler is not None:
                profiler.disable()
                report["cprofile"] = _profile_lines(profiler, 25)
                if command.get("dump"):
                    profiler.dump_stats(command["dump"])
            replies.write(json.dumps(report) + "\n")
        else:
            replies.write(json.dumps(generate(command["prompts"], int(command["max_tokens"]))) + "\n")
    replies.flush()
    os._exit(0)


def _profile_lines(profiler: Any, top: int) -> list[str]:
    """The profiled connector functions (kvpolicy's, vLLM's KV connector code, Mooncake's Python), by
    cumulative time: ``cumulative s, own s, calls, function``."""
    import pstats

    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, function), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if ("kvpolicy" in path and "e2e.py" not in path) or "mooncake" in path.lower() or "kv_connector" in path:
            short = path.split("site-packages/")[-1].split("/work/main/")[-1]
            rows.append((cumulative, own, calls, f"{short}:{line}({function})"))
    rows.sort(reverse=True)
    return [f"{cum:7.3f} {own:7.3f} {calls:6d}  {name}" for cum, own, calls, name in rows[:top]]


# --- the parent -----------------------------------------------------------------------------------


class Prompts:
    """Fresh random prompts: no two share their first chunk, so none is a prefix hit on another."""

    def __init__(self, length: int, seed: int) -> None:
        self._length = length
        self._random = random.Random(seed)
        self._seen: set[tuple[int, ...]] = set()

    def take(self, count: int) -> list[list[int]]:
        prompts = []
        while len(prompts) < count:
            prompt = [self._random.randrange(3, VOCAB) for _ in range(self._length)]
            head = tuple(prompt[:BLOCK_SIZE])
            if head not in self._seen:
                self._seen.add(head)
                prompts.append(prompt)
        return prompts


class StoreCpu:
    """CPU seconds used so far by the store's processes: the master and the segment holder (found as
    the child of this process that runs ``connect_store``), all their threads, from ``/proc``."""

    def __init__(self, master_pid: int) -> None:
        self.pids = [master_pid, *self._holders()]

    @staticmethod
    def _holders() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parent = int(stat[stat.rindex(")") + 2 :].split()[1])
                if parent == os.getpid() and b"connect_store" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
        return found

    def seconds(self) -> float:
        total = 0
        for pid in self.pids:
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                total += int(fields[11]) + int(fields[12])
        return total / TICKS


def _engine_environment(store_config: Path, omp_threads: int | None) -> dict[str, str]:
    from kvpolicy.harness.e2e import child_env, engine_env

    env = engine_env(1, store_config)  # unbound OpenMP threads, one per core unless --omp-threads
    if omp_threads:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    # The engine core in the child itself, so the child can step it until its saves have drained.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return child_env(env, ())


def run_set(
    index: int,
    args: argparse.Namespace,
    engines_spec: dict[str, dict[str, Any]],
    model: Path,
    store_config: Path,
    scratch: Path,
    metrics_url: str,
    store_cpu: StoreCpu,
) -> dict[str, Any]:
    """The engines, started one after the other, then the rounds in lockstep."""
    from kvpolicy.mooncake import MasterCounters, delta, read_metrics

    def store_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
        """The master's traffic counters between two snapshots, and the RPCs it answered (pings aside)."""
        counts = dict(delta(MasterCounters.from_metrics(before), MasterCounters.from_metrics(after)).__dict__)
        counts["rpcs"] = int(
            sum(
                after[key] - before.get(key, 0.0)
                for key in after
                if key.endswith("_requests_total") and "{" not in key and "ping" not in key
            )
        )
        return counts

    prompts = Prompts(args.prompt_len, seed=1_000_003 * (index + 1))
    names = list(engines_spec)
    engines: dict[str, Engine] = {}
    rounds: dict[str, list[dict[str, Any]]] = {"ttft": [], "batch": []}
    profiles: dict[str, Any] = {}
    try:
        for name in names:
            config = json.loads(json.dumps(engines_spec[name]["config"]))
            if config is not None:
                config["kv_connector_extra_config"]["cache_prefix"] = f"allmiss-{name}-{uuid.uuid4().hex[:8]}"
            spec = {
                "model": str(model),
                "kv_transfer_config": config,
                "max_tokens": args.max_tokens,
                "batch": args.batch,
                "max_model_len": args.max_model_len,
                "max_num_seqs": max(4, args.batch),
                "warmup_prompts": prompts.take(20 * (1 + args.batch)),
                "warmup_s": args.warmup_seconds,
            }
            engines[name] = Engine(
                name, spec, _engine_environment(store_config, args.omp_threads), scratch, timeout=600.0,
                script=Path(__file__).resolve(), quit_command={"op": "quit"},
            )
            # One at a time: start-up and warm-up of several would compete for the cores.
            ready = engines[name].ready()
            print(f"  set {index + 1}: {name} engine ready (start-up {ready['startup_s']:.1f} s)", file=sys.stderr)

        orders = itertools.cycle(list(itertools.permutations(names)))

        def one_round(count: int, max_tokens: int) -> dict[str, Any]:
            batch = prompts.take(count)
            order = next(orders)
            record: dict[str, Any] = {"order": list(order), "prompt_tokens": sum(map(len, batch))}
            for name in order:
                before, before_cpu = read_metrics(metrics_url), store_cpu.seconds()
                reply = engines[name].send({"prompts": batch, "max_tokens": max_tokens})
                reply["store_cpu"] = store_cpu.seconds() - before_cpu
                reply["store"] = store_counts(before, read_metrics(metrics_url))
                record[name] = reply
            return record

        # Untimed lockstep rounds: the engines started first have been idle meanwhile.
        for _ in range(3):
            one_round(1, 1)
        one_round(args.batch, args.max_tokens)
        cprofile = {name: args.profile and (name == "kvpolicy" or bool(args.profile_dir)) for name in names}
        for name in names:
            engines[name].send({"op": "mark", "cprofile": cprofile[name]})
        for _ in range(args.prompts):
            rounds["ttft"].append(one_round(1, 1))
        for name in names:
            profiles.setdefault(name, {})["ttft"] = engines[name].send({"op": "report"})["threads"]
            engines[name].send({"op": "mark"})
        for _ in range(args.batches):
            rounds["batch"].append(one_round(args.batch, args.max_tokens))
        for name in names:
            dump = str(args.profile_dir / f"set{index + 1}-{name}.pstats") if args.profile_dir else None
            report = engines[name].send({"op": "report", "final": True, "dump": dump})
            profiles[name]["batch"] = report["threads"]
            profiles[name]["cprofile"] = report.get("cprofile")
        ttft = {name: statistics.median(r[name]["s"] for r in rounds["ttft"]) * 1000 for name in names}
        tput = {name: statistics.median(r[name]["s"] for r in rounds["batch"]) * 1000 for name in names}
        print(
            f"  set {index + 1}: TTFT median " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in ttft.items())
            + "; batch median " + ", ".join(f"{name} {ms:.0f} ms" for name, ms in tput.items()),
            file=sys.stderr,
        )
        return {"rounds": rounds, "profiles": profiles}
    finally:
        for engine in engines.values():
            engine.stop()


def verdict_at_most(value: float, interval: tuple[float, float], target: float) -> str:
    """MET / MISSED against an upper bound, saying when the miss is inside the noise (as ``verdict``)."""
    if value <= target:
        return "MET"
    if interval[0] <= target:
        return f"MISSED by {value - target:.2f}, but within the 95% interval ({interval[0]:.2f}-{interval[1]:.2f})"
    return f"MISSED by {value - target:.2f} (95% interval {interval[0]:.2f}-{interval[1]:.2f})"


def _ratio(values: list[float]) -> tuple[float, tuple[float, float]]:
    return statistics.median(values), median_ci(values)


def _cell(value: tuple[float, tuple[float, float]]) -> str:
    return f"{value[0]:.3f} ({value[1][0]:.3f}-{value[1][1]:.3f})"


THREAD_GROUPS = (
    ("main (engine core, model, connector calls)", ("MainThread",)),
    ("native (OpenMP, Mooncake client)", ("python",)),
    ("send thread (puts)", ("KVCacheStoreSendingThread",)),
    ("lookup (client pool, key server)", ("MooncakeLookupClient", "Thread (process_request)")),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=2, help="engine sets, one after the other")
    parser.add_argument("--prompts", type=int, default=60, help="TTFT rounds per set (one fresh prompt each)")
    parser.add_argument("--batches", type=int, default=16, help="throughput rounds per set")
    parser.add_argument("--batch", type=int, default=8, help="prompts per throughput round, submitted at once")
    parser.add_argument("--prompt-len", type=int, default=416, help="tokens per prompt (13 chunks of 32)")
    parser.add_argument("--max-tokens", type=int, default=32, help="generated tokens per prompt, throughput phase")
    parser.add_argument("--warmup-seconds", type=float, default=8.0, help="untimed warm-up per engine")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the random Llama")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the random Llama (MLP: 2x)")
    parser.add_argument("--omp-threads", type=int, help="OpenMP threads per engine (default: one per core)")
    parser.add_argument("--decompose", action="store_true", help="add lookup-only and save-only kvpolicy engines")
    parser.add_argument("--profile", action="store_true", help="cProfile the kvpolicy engine's main thread")
    parser.add_argument("--profile-dir", type=Path, help="with --profile: every engine's pstats dump here")
    parser.add_argument("--json", type=Path, help="also write every request's measurements here")
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    if args.prompt_len + args.max_tokens > args.max_model_len:
        parser.error("--prompt-len + --max-tokens must not exceed --max-model-len")
    if args.prompt_len < BLOCK_SIZE:
        parser.error(f"--prompt-len must be at least one chunk ({BLOCK_SIZE} tokens): shorter prompts are never saved")

    from kvpolicy.harness.e2e import SegmentHolder, engine_store_config
    from kvpolicy.harness.tinymodel import make_tiny_llama
    from kvpolicy.mooncake import MooncakeMaster

    engines_spec = {**ENGINES, **(DECOMPOSED if args.decompose else {})}
    names = list(engines_spec)
    started = time.monotonic()
    ttft: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvpolicy-bench-all-miss-") as directory:
        scratch = Path(directory)
        model = make_tiny_llama(
            scratch / "tiny-llama",
            num_kv_heads=args.kv_heads,
            num_layers=args.layers,
            hidden=args.hidden,
            intermediate=2 * args.hidden,
        )
        with MooncakeMaster(object_lease_ms=LEASE_TTL_MS, client_ttl_s=120) as master:
            store_config = engine_store_config(master.client_config(), scratch / "engine.json")
            with SegmentHolder(master.rpc_address, segment_mib=512):
                store_cpu = StoreCpu(master.pid)
                for index in range(args.pairs):
                    result = run_set(
                        index, args, engines_spec, model, store_config, scratch, master.metrics_url, store_cpu
                    )
                    ttft += result["rounds"]["ttft"]
                    batches += result["rounds"]["batch"]
                    profiles.append(result["profiles"])
    elapsed = time.monotonic() - started
    if args.json:
        args.json.write_text(json.dumps({"ttft": ttft, "batches": batches, "profiles": profiles}))
    every = ttft + batches

    # --- checks ---
    problems: dict[str, list[str]] = {name: [] for name in names}
    for name, spec in engines_spec.items():
        if any(c != 0 for r in every for c in r[name]["cached"]):
            problems[name].append("a request found cached tokens")
        if name != "none" and not all(r[name]["tokens"] == r["none"]["tokens"] for r in every):
            problems[name].append("tokens differ from the no-connector engine's")
        if not all(r[name]["drained"] for r in every):
            problems[name].append("saves did not drain")
        written = [r[name]["store"]["batch_put_end_items"] for r in every]
        probed = [r[name]["store"]["batch_exist_key_items"] for r in every]
        if spec["saves"] and not all(written):
            problems[name].append("a request wrote no object")
        if not spec["saves"] and any(written):
            problems[name].append("wrote objects")
        if spec["lookups"] and not all(probed):
            problems[name].append("a request probed no key")
        if spec["config"] is None and any(probed):
            problems[name].append("probed keys")

    # --- per engine ---
    rows = []
    for name, spec in engines_spec.items():
        t = [r[name]["s"] * 1000 for r in ttft]
        tps = [(r["prompt_tokens"] + sum(map(len, r[name]["tokens"]))) / r[name]["s"] for r in batches]
        cached = sum(c for r in every for c in r[name]["cached"])
        rows.append(
            (
                name,
                len(t),
                f"{statistics.median(t):.2f}",
                f"{min(t):.0f}-{max(t):.0f}",
                f"{statistics.median(r[name]['cpu'] * 1000 for r in ttft):.1f}",
                f"{statistics.fmean(r[name]['store_cpu'] * 1000 for r in ttft):.1f}",
                f"{statistics.median(r[name]['drain_s'] * 1000 for r in ttft):.1f}" if spec["config"] else "-",
                (
                    f"{statistics.median(r[name]['store']['batch_put_end_items'] for r in ttft):.0f} / "
                    f"{statistics.median(r[name]['store']['batch_exist_key_items'] for r in ttft):.0f} / "
                    f"{statistics.median(r[name]['store']['rpcs'] for r in ttft):.0f}"
                ),
                len(tps),
                f"{statistics.median(tps):.0f}",
                f"{statistics.median(r[name]['cpu'] * 1000 for r in batches):.0f}",
                f"{statistics.fmean(r[name]['store_cpu'] * 1000 for r in batches):.0f}",
                f"{statistics.median(r[name]['store']['rpcs'] for r in batches):.0f}",
                str(cached),
                "yes" if not problems[name] else "NO",
            )
        )

    # --- paired ratios: a round's requests ran back to back on the same prompts ---
    def ratios(a: str, b: str) -> dict[str, tuple[float, tuple[float, float]]]:
        return {
            "ttft": _ratio([r[a]["s"] / r[b]["s"] for r in ttft]),
            "ttft_cpu": _ratio([r[a]["cpu"] / r[b]["cpu"] for r in ttft]),
            # tokens/s ratio = inverse wall-time ratio (every engine got the same tokens).
            "tput": _ratio([r[b]["s"] / r[a]["s"] for r in batches]),
            "tput_cpu": _ratio([r[b]["cpu"] / r[a]["cpu"] for r in batches]),
        }

    pairs = [(name, "none") for name in names if name != "none"] + [("kvpolicy", "stock")]
    paired = {pair: ratios(*pair) for pair in pairs}
    ratio_rows = [
        (f"{a} / {b}", _cell(v["ttft"]), _cell(v["ttft_cpu"]), _cell(v["tput"]), _cell(v["tput_cpu"]))
        for (a, b), v in paired.items()
    ]
    kv = paired[("kvpolicy", "none")]
    stock = paired[("stock", "none")]
    ttft_verdict = verdict_at_most(kv["ttft"][0], kv["ttft"][1], TTFT_TARGET)
    tput_verdict = verdict(kv["tput"][0], kv["tput"][1], THROUGHPUT_TARGET)
    met = ttft_verdict == "MET" and tput_verdict == "MET"
    kv_bytes = args.layers * 2 * args.kv_heads * 32 * 4  # K and V, head_dim 32, float32

    print(
        f"vLLM (CPU) end to end, TP=1, tiny random Llama ({args.layers} layers, hidden {args.hidden}, "
        f"{args.kv_heads} KV heads, {kv_bytes // 1024} KiB of KV per token), "
        f"{args.omp_threads or os.cpu_count()} OpenMP thread(s) per engine, all-miss workload: every "
        f"request a fresh random {args.prompt_len}-token prompt ({args.prompt_len // BLOCK_SIZE} chunks of "
        f"{BLOCK_SIZE}), prefix caching off in the engine. {args.pairs} set(s) of {len(names)} engines driven in "
        f"lockstep (rotating order), per set {args.prompts} TTFT rounds (1 prompt, max_tokens=1) and "
        f"{args.batches} throughput rounds ({args.batch} prompts at once, {args.max_tokens} generated tokens "
        "each). none = no KV connector, stock = MooncakeStoreConnector, kvpolicy = KVPolicyConnector (default)"
        + (
            ", kvpolicy-lookup = kv_consumer (lookup, no save), kvpolicy-save = enable_lookup false (save, no lookup)"
            if args.decompose
            else ""
        )
        + ". Start-up and warm-up excluded; saves drained after every request, untimed. store CPU = the Mooncake "
        "master's and segment holder's CPU time (mean), which shares the 2 cores."
    )
    print()
    print(
        table(
            (
                "engine", "TTFT requests", "TTFT ms", "TTFT range ms", "TTFT CPU ms", "TTFT store CPU ms",
                "save drain ms", "objects written / keys probed / master RPCs per request", "batches",
                "tokens/s", "batch CPU ms", "batch store CPU ms", "master RPCs per batch", "cached tokens", "checks",
            ),
            rows,
        )
    )
    print()
    print(
        table(
            ("paired ratio (95% CI)", "TTFT", "TTFT CPU", "throughput (tokens/s)", "throughput by CPU time"),
            ratio_rows,
        )
    )
    print()
    def thread_ms(name: str, phase: str, records: list[dict[str, Any]], wanted: Any) -> str:
        seconds = sum(v for p in profiles for k, v in p[name][phase].items() if wanted(k))
        return f"{seconds * 1000 / len(records):.1f}"

    known = {k for _, prefixes in THREAD_GROUPS for k in prefixes}
    groups = [(label, lambda k, prefixes=prefixes: k in prefixes) for label, prefixes in THREAD_GROUPS]
    groups.append(("other threads", lambda k: k not in known))
    thread_rows = [
        (label, *(f"{thread_ms(n, 'ttft', ttft, wanted)} / {thread_ms(n, 'batch', batches, wanted)}" for n in names))
        for label, wanted in groups
    ]
    thread_rows.append(
        (
            "store processes (master, holder)",
            *(
                f"{statistics.fmean(r[n]['store_cpu'] for r in ttft) * 1000:.1f} / "
                f"{statistics.fmean(r[n]['store_cpu'] for r in batches) * 1000:.1f}"
                for n in names
            ),
        )
    )
    print("CPU ms per request by thread over the timed phases (mean per TTFT request / per batch):")
    print()
    print(table(("where", *names), thread_rows, align="l" + "r" * len(names)))
    print()
    print(
        f"kvpolicy / none: TTFT {kv['ttft'][0]:.3f} (95% CI {kv['ttft'][1][0]:.3f}-{kv['ttft'][1][1]:.3f}, "
        f"{len(ttft)} pairs), throughput {kv['tput'][0]:.3f} (95% CI {kv['tput'][1][0]:.3f}-{kv['tput'][1][1]:.3f}, "
        f"{len(batches)} pairs); stock / none: TTFT {stock['ttft'][0]:.3f}, throughput {stock['tput'][0]:.3f}; "
        f"kvpolicy / stock: TTFT {paired[('kvpolicy', 'stock')]['ttft'][0]:.3f}, "
        f"throughput {paired[('kvpolicy', 'stock')]['tput'][0]:.3f}"
    )
    print(
        f"target: TTFT ratio <= {TTFT_TARGET}: {ttft_verdict}; throughput ratio >= {THROUGHPUT_TARGET}: "
        f"{tput_verdict}"
    )
    failed = {name: issues for name, issues in problems.items() if issues}
    print(
        "checks: "
        + (
            "every request missed (0 cached tokens); the connector engines generated the no-connector engine's "
            "tokens, drained their saves, wrote objects on every request they save and probed keys on every "
            "request they look up; the no-connector engine touched no store"
            if not failed
            else "FAILED: " + "; ".join(f"{name}: {', '.join(issues)}" for name, issues in failed.items())
        )
    )
    if args.profile:
        for index, profile in enumerate(profiles):
            lines = profile.get("kvpolicy", {}).get("cprofile")
            if lines:
                print()
                print(f"kvpolicy engine, set {index + 1}, main thread, connector functions (cumulative s, own s, calls):")
                print()
                print("```text")
                print("\n".join(lines))
                print("```")
    print(f"({elapsed:.0f} s{'' if met and not failed else '; target missed' if not failed else '; CHECKS FAILED'})")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
