"""A fleet across hosts under load: N concurrent clients on a vLLM server that reuses what a server on
another host stored, with kvpolicy and with the stock connector, in the same run.

The hosts are network namespaces (``kvpolicy.harness.fleet``): a Mooncake master, two segment holders, two
vLLM hosts and a client host, on private addresses that exist only inside them. For each connector in
turn (``kvpolicy``: ``KVPolicyConnector`` with the ``default`` policy; ``vllm-compat``: the same
connector with vLLM's own rules; ``stock``: vLLM's ``MooncakeStoreConnector``), server A (TP=2) on
host ``vllma`` serves every prompt once, cold (the reference, and what the store then holds), and
server B (TP=2) on host ``vllmb`` is loaded by ``--clients`` concurrent clients from the client host
for ``--seconds``: shared-prefix prompts (``--prefixes`` prefixes x ``--variants`` suffixes), greedy,
8 tokens, every completion compared with A's. Prefix caching is off inside the servers: every hit is
a load from the store, across the network.

Reported per connector: requests, errors, mismatches (tokens or logprobs off the cold reference), hit
rate (prompt tokens not computed / prompt tokens), throughput and latency percentiles, and each
kvpolicy row's ratios to stock. Target (issue 14): 0 errors, 0 mismatches. A second table says where
slow requests' time went, from the warm server's own ``/metrics`` around the load: requests that
queued, prefilled or decoded longer than 5 s, and Mooncake operations (lookups, loads, saves) longer
than 4 s (the last bucket of vLLM's histogram); and from the kernel, TCP retransmits of the client host
and connection attempts the server's host dropped.

    python benchmarks/bench_fleet_load.py [--clients 8] [--seconds 60] [--connectors kvpolicy,vllm-compat,stock]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import table

from kvpolicy.harness.fleet.hosts import HostFleet, kv_transfer_config
from kvpolicy.harness.fleet.load import LoadReport, run_load, shared_prefix_prompts
from kvpolicy.harness.server import metric_value
from kvpolicy.harness.tinymodel import make_tiny_llama

SERVER_ARGS = ("--no-enable-prefix-caching", "--enable-prompt-tokens-details")


CONNECTORS: dict[str, dict[str, str]] = {
    "kvpolicy": {"policy": "default"},
    "vllm-compat": {"policy": "vllm-compat"},
    "stock": {"connector": "MooncakeStoreConnector"},
}
"""What each ``--connectors`` name runs: ``KVPolicyConnector`` with the ``default`` policy, the same
connector with ``vllm-compat`` (vLLM's own rules, through kvpolicy's worker), or vLLM's stock
``MooncakeStoreConnector``."""


def connector_config(name: str) -> str:
    config = json.loads(kv_transfer_config(**CONNECTORS[name]))
    # Each connector under its own prefix: neither reads the other's objects.
    config.setdefault("kv_connector_extra_config", {})["cache_prefix"] = f"fleet-{name}-{uuid.uuid4().hex[:8]}"
    return json.dumps(config)


PHASES = {"queued": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
          "decode": "vllm:request_decode_time_seconds"}
STORE_OPERATIONS = ("lookup_exists", "load_get", "save_exists", "save_put")
STORE_TIME = "vllm:mooncake_store_operation_time_seconds"


def slower_than(metrics_text: str, histogram: str, bound: str, **labels: str) -> tuple[int, int]:
    """(observations above ``bound`` seconds, observations) of a histogram, over its label sets with ``labels``."""
    total = metric_value(metrics_text, histogram + "_bucket", le="+Inf", **labels)
    return int(total - metric_value(metrics_text, histogram + "_bucket", le=bound, **labels)), int(total)


def time_breakdown(metrics_text: str) -> dict[str, tuple[int, int]]:
    """Per request phase (> 5 s) and per Mooncake operation (> 4 s): (slow, all)."""
    breakdown = {phase: slower_than(metrics_text, series, "5.0") for phase, series in PHASES.items()}
    for operation in STORE_OPERATIONS:
        breakdown[operation] = slower_than(metrics_text, STORE_TIME, "4.0", operation=operation)
    return breakdown


TCP_COUNTERS = {"client SYN retransmits": ("client", "TCPSynRetrans"), "client retransmits": ("client", "RetransSegs"),
                "server listen drops": ("vllmb", "ListenDrops")}
"""Kernel TCP counters of the client host and the warm server's host (a dropped connection attempt
costs a client 1 s, then 3 s, 7 s... before its retry)."""


def tcp_counts(fleet: HostFleet) -> dict[str, int]:
    counters = {host: fleet[host].tcp_counters() for host in {host for host, _ in TCP_COUNTERS.values()}}
    return {label: counters[host][name] for label, (host, name) in TCP_COUNTERS.items()}


@dataclass(frozen=True)
class Measured:
    """One connector's load, where its slow requests' time went ((slow, all) per phase and operation),
    and the TCP counters' growth over the load."""

    report: LoadReport
    slow: dict[str, tuple[int, int]]
    tcp: dict[str, int]


def measure(fleet: HostFleet, model: Path, name: str, args: argparse.Namespace) -> Measured:
    prompts = shared_prefix_prompts(
        prefixes=args.prefixes, variants=args.variants, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens
    )
    config = connector_config(name)
    cold_server = fleet.server("vllma", model, tp_size=2, kv_transfer_config=config, extra_args=SERVER_ARGS)
    try:
        references = [cold_server.complete(prompt) for prompt in prompts]
        time.sleep(3)  # the last saves drain
    finally:
        cold_server.stop()
    warm_server = fleet.server("vllmb", model, tp_size=2, kv_transfer_config=config, extra_args=SERVER_ARGS)
    try:
        run_load(warm_server, prompts[:2], references[:2], clients=2, duration_s=5)  # warm-up, untimed
        slow_before, tcp_before = time_breakdown(warm_server.metrics()), tcp_counts(fleet)
        report = run_load(warm_server, prompts, references, clients=args.clients, duration_s=args.seconds)
        slow_after, tcp_after = time_breakdown(warm_server.metrics()), tcp_counts(fleet)
        if report.errors or report.percentile(0.99) > 5:
            Path(f"/tmp/bench-fleet-{name}-server.log").write_text(warm_server.log)
        slow = {
            key: (slow_after[key][0] - slow_before[key][0], slow_after[key][1] - slow_before[key][1])
            for key in slow_after
        }
        return Measured(report, slow, {label: tcp_after[label] - tcp_before[label] for label in tcp_after})
    finally:
        warm_server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--variants", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=160)
    parser.add_argument("--suffix-tokens", type=int, default=40)
    parser.add_argument("--connectors", default="kvpolicy,vllm-compat,stock", help=f"comma-separated, of {', '.join(CONNECTORS)}")
    args = parser.parse_args()
    unknown = sorted(set(args.connectors.split(",")) - CONNECTORS.keys())
    if unknown:
        parser.error(f"unknown connector {', '.join(unknown)}: choose from {', '.join(CONNECTORS)}")
    measured: dict[str, Measured] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:
        model = make_tiny_llama(Path(scratch) / "tiny-llama", num_kv_heads=1)
        with HostFleet(Path(scratch) / "fleet") as fleet:
            for name in args.connectors.split(","):
                measured[name] = measure(fleet, model, name, args)
    reports = {name: result.report for name, result in measured.items()}
    rows = [
        [
            name, report.clients, f"{report.duration_s:.0f}", report.requests, report.errors, report.mismatches,
            f"{report.hit_rate:.2f}", f"{report.throughput:.2f}", f"{report.percentile(0.5) * 1000:.0f}",
            f"{report.percentile(0.9) * 1000:.0f}", f"{report.percentile(0.99) * 1000:.0f}",
        ]
        for name, report in reports.items()
    ]
    print(table(
        ["connector", "clients", "s", "requests", "errors", "mismatches", "hit rate", "req/s", "p50 ms", "p90 ms",
         "p99 ms"],
        rows,
    ))
    print()
    print(table(
        ["connector", "requests > 5 s", *(f"{phase} > 5 s" for phase in PHASES),
         *(f"{op} > 4 s" for op in STORE_OPERATIONS), *TCP_COUNTERS],
        [
            [name, sum(latency > 5 for latency in result.report.latencies_s),
             *(f"{slow}/{count}" for slow, count in result.slow.values()), *result.tcp.values()]
            for name, result in measured.items()
        ],
    ))
    print()
    stock = reports.get("stock")
    for name, ours in reports.items():
        if name != "stock" and stock is not None and stock.throughput:
            print(
                f"{name} / stock: throughput {ours.throughput / stock.throughput:.2f},"
                f" p50 latency {ours.percentile(0.5) / stock.percentile(0.5):.2f},"
                f" p99 latency {ours.percentile(0.99) / stock.percentile(0.99):.2f}"
            )
    for name, report in reports.items():
        for sample in report.error_samples:
            print(f"{name} error: {sample}")
    failed = any(report.errors or report.mismatches for report in reports.values())
    print("target (0 errors, 0 mismatches): " + ("MISSED" if failed else "met"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
