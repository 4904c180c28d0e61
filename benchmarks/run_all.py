"""Run every benchmark, one process each, and print their tables as Markdown (what benchmarks/README.md shows).

    python benchmarks/run_all.py [--only NAME ...] [--skip NAME ...]

NAME is one of plan, cli, write_amplification, cross_tp, data_path, seal_cost, lookup, striped_reads, e2e,
all_miss, audit, discovery, hybrid_engines, fleet_load (e.g. ``--skip e2e``).

Each benchmark starts and stops its own Mooncake master (``bench_plan`` needs none); they run one after
the other, so none measures while another loads the machine. Default arguments throughout: about
30 minutes on 2 cores (5 of them the hybrid engines, 6 the fleet across hosts). The exit status is 1
when a benchmark fails to run (a missed target is reported in its output, not in the exit status).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BENCHMARKS = (
    "plan", "cli", "write_amplification", "cross_tp", "data_path", "seal_cost", "lookup", "striped_reads", "e2e",
    "all_miss", "audit", "discovery", "hybrid_engines", "fleet_load",
)
FENCED = {"plan"}
"""Benchmarks whose output is a plain-text table, shown in a code block."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS)
    parser.add_argument("--skip", nargs="+", choices=BENCHMARKS, default=[])
    args = parser.parse_args(argv)
    selected = [name for name in (args.only or BENCHMARKS) if name not in args.skip]

    env = dict(os.environ)
    paths = [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {' '.join(f'{value:.1f}' for value in os.getloadavg())} at start;"
        f" {time.strftime('%Y-%m-%d %H:%M')}"
    )
    failed = []
    for name in selected:
        script = HERE / f"bench_{name}.py"
        print()
        print(f"### {script.name}")
        print()
        print(f"`python benchmarks/{script.name}`")
        print(flush=True)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, check=False
        )
        output = result.stdout.rstrip()
        if name in FENCED:
            output = f"```text\n{output}\n```"
        print(output)
        print()
        print(f"_{name}: {time.monotonic() - started:.0f} s wall, exit {result.returncode}_", flush=True)
        if result.returncode != 0 or not output:
            failed.append(name)
    if failed:
        print(f"\nFAILED to run: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
