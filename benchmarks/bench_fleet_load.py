"""A fleet across hosts under load: N concurrent clients on a vLLM server that reuses what a server on
another host stored, with kvpolicy and with the stock connector, in the same run.

The hosts are network namespaces (``kvpolicy.fleet``): a Mooncake master, two segment holders, two
vLLM hosts and a client host, on private addresses that exist only inside them. For each connector in
turn (``kvpolicy``: ``KVPolicyConnector`` with the ``default`` policy; ``stock``: vLLM's
``MooncakeStoreConnector``), server A (TP=2) on host ``vllma`` serves every prompt once, cold (the
reference, and what the store then holds), and server B (TP=2) on host ``vllmb`` is loaded by
``--clients`` concurrent clients from the client host for ``--seconds``: shared-prefix prompts
(``--prefixes`` prefixes x ``--variants`` suffixes), greedy, 8 tokens, every completion compared with
A's. Prefix caching is off inside the servers: every hit is a load from the store, across the network.

Reported per connector: requests, errors, mismatches (tokens or logprobs off the cold reference), hit
rate (prompt tokens not computed ÷ prompt tokens), throughput and latency percentiles; and the ratio
kvpolicy / stock. Target (issue 14): 0 errors, 0 mismatches.

    python benchmarks/bench_fleet_load.py [--clients 8] [--seconds 60] [--prefixes 4] [--variants 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import table  # noqa: E402

from kvpolicy.fleet.hosts import HostFleet, kv_transfer_config  # noqa: E402
from kvpolicy.fleet.load import LoadReport, run_load, shared_prefix_prompts  # noqa: E402
from kvpolicy.vllm.tinymodel import make_tiny_llama  # noqa: E402

SERVER_ARGS = ("--no-enable-prefix-caching", "--enable-prompt-tokens-details")


def connector_config(name: str) -> str:
    config = json.loads(
        kv_transfer_config(connector="MooncakeStoreConnector") if name == "stock" else kv_transfer_config()
    )
    # Each connector under its own prefix: neither reads the other's objects.
    config.setdefault("kv_connector_extra_config", {})["cache_prefix"] = f"fleet-{name}-{uuid.uuid4().hex[:8]}"
    return json.dumps(config)


def measure(fleet: HostFleet, model: Path, name: str, args: argparse.Namespace) -> LoadReport:
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
        report = run_load(warm_server, prompts, references, clients=args.clients, duration_s=args.seconds)
        if report.errors or report.percentile(0.99) > 5:
            Path(f"/tmp/bench-fleet-{name}-server.log").write_text(warm_server.log)
        return report
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
    parser.add_argument("--connectors", default="kvpolicy,stock")
    args = parser.parse_args()
    reports: dict[str, LoadReport] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:
        model = make_tiny_llama(Path(scratch) / "tiny-llama", num_kv_heads=1)
        with HostFleet(Path(scratch) / "fleet") as fleet:
            for name in args.connectors.split(","):
                reports[name] = measure(fleet, model, name, args)
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
    if {"kvpolicy", "stock"} <= reports.keys() and reports["stock"].throughput:
        ours, stock = reports["kvpolicy"], reports["stock"]
        print(
            f"kvpolicy / stock: throughput {ours.throughput / stock.throughput:.2f},"
            f" p50 latency {ours.percentile(0.5) / stock.percentile(0.5):.2f}"
        )
    for name, report in reports.items():
        for sample in report.error_samples:
            print(f"{name} error: {sample}")
    failed = any(report.errors or report.mismatches for report in reports.values())
    print("target (0 errors, 0 mismatches): " + ("MISSED" if failed else "met"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
