"""The CLI on the largest and nastiest inputs under its limits: wall time and peak memory per command.

Each command runs in a fresh process (``python -m kvpolicy.app.cli ...``), timed from spawn to exit,
its peak resident memory read from ``wait4``. The baseline, measured in the same run, is the same
process doing nothing but importing the CLI (``kvpolicy list``). Inputs are generated here:

* ``rules-1000``: a policy at the rule limit (1000), a tenth of them with layer globs, many with field
  conditions, shadowing chains included;
* ``layers-20k``: a layout of 200 groups and 20,000 layers;
* ``layers-200k``: one group of 200,000 layers (the layout limit) written as two ranges;
* ``junk-1mb``: 1 MiB of YAML (the size limit) that is a valid mapping but no document (validate only);
* ``aliases``: a document of aliases just under the node limit (validate only).

    python benchmarks/bench_cli.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, table

TARGET_SECONDS = 1.0
TARGET_MIB = 200


def write_inputs(directory: Path) -> dict[str, Path]:
    files = {}
    rules = []
    for index in range(1000):
        kind = index % 10
        if kind == 0:
            rules.append(
                f"  - name: glob-{index}\n    reason: r\n"
                f"    match: {{spec: AttentionSpec, layers: ['g{index % 200}.*']}}\n    factor: 1\n"
            )
        elif kind < 4:
            rules.append(
                f"  - name: field-{index}\n    reason: r\n"
                f"    match: {{spec: MambaSpec, fields: {{mamba_type: t{index}, tp_replicated: true}}}}\n"
                "    replication: replicated\n"
            )
        else:
            rules.append(
                f"  - name: spec-{index}\n    reason: r\n"
                f"    match: {{spec: [FullAttentionSpec, Plugin{index}Spec]}}\n    replication: sharded\n"
            )
    files["rules-1000"] = directory / "rules.yaml"
    files["rules-1000"].write_text("version: 1\nkind: ReplicationPolicy\nname: big\nrules:\n" + "".join(rules))
    groups = "".join(
        f"  - spec: {{type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096,"
        f" fields: {{num_kv_heads: 1, head_size: {64 + group}, max_tp_shards: null}}}}\n    layers: ['g{group}.{{0..99}}']\n"
        for group in range(200)
    )
    files["layers-20k"] = directory / "layout-20k.yaml"
    files["layers-20k"].write_text(f"version: 1\nkind: ModelLayout\nmodel: org/big\ntotal_num_kv_heads: 8\ngroups:\n{groups}")
    files["layers-200k"] = directory / "layout-200k.yaml"
    files["layers-200k"].write_text(
        "version: 1\nkind: ModelLayout\nmodel: org/huge\ntotal_num_kv_heads: 8\ngroups:\n"
        "  - spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096,"
        " fields: {num_kv_heads: 1, max_tp_shards: null}}\n"
        "    layers: ['a.{0..99999}', 'b.{0..99999}']\n"
    )
    line = "k{}: " + "x" * 60 + "\n"
    junk, size, index = [], 0, 0
    while size < 1024 * 1024 - 200:
        entry = line.format(index)
        junk.append(entry)
        size += len(entry)
        index += 1
    files["junk-1mb"] = directory / "junk.yaml"
    files["junk-1mb"].write_text("".join(junk))
    aliases = ["version: 1", "kind: ReplicationPolicy", 'x0: &x0 ["' + "y" * 100 + '"]']
    aliases += [f"x{i}: &x{i} [*x{i - 1}, *x{i - 1}, *x{i - 1}]" for i in range(1, 11)]
    files["aliases"] = directory / "aliases.yaml"
    files["aliases"].write_text("\n".join(aliases) + "\nname: *x10\nrules: []\n")
    return files


def measure(argv: list[str]) -> tuple[float, float, int]:
    """(seconds, peak MiB, exit code) of one CLI process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpolicy.app.cli", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    return elapsed, usage.ru_maxrss / 1024, process.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per command; the median is shown")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvpolicy-bench-cli-") as scratch:
        files = write_inputs(Path(scratch))
        commands = {
            "baseline: import + list": ["list"],
            "validate rules-1000": ["validate", str(files["rules-1000"])],
            "validate layers-200k": ["validate", str(files["layers-200k"])],
            "validate junk-1mb": ["validate", str(files["junk-1mb"])],
            "validate aliases": ["validate", str(files["aliases"])],
            "plan rules-1000 x layers-20k, tp 8": [
                "plan", "--policy", str(files["rules-1000"]), "--layout", str(files["layers-20k"]), "--tp", "8"
            ],
            "plan default x layers-200k, tp 8": ["plan", "--policy", "default", "--layout", str(files["layers-200k"]), "--tp", "8"],
            "explain rules-1000 x layers-20k, tp 8": [
                "explain", "--policy", str(files["rules-1000"]), "--layout", str(files["layers-20k"]), "--tp", "8"
            ],
            "diff default rules-1000 x layers-20k, tp 1..8": [
                "diff", "default", str(files["rules-1000"]), "--layout", str(files["layers-20k"])
            ],
        }
        rows = []
        baseline = None
        misses = []
        for label, command in commands.items():
            runs = sorted((measure(command) for _ in range(args.repeat)), key=lambda run: run[0])
            seconds, mib, code = runs[len(runs) // 2]
            baseline = baseline or seconds
            rows.append((label, code, f"{seconds:.2f}", f"{seconds / baseline:.1f}x", f"{max(run[1] for run in runs):.0f}"))
            if seconds > TARGET_SECONDS or max(run[1] for run in runs) > TARGET_MIB:
                misses.append(label)
    print(
        f"kvpolicy CLI on inputs at its limits: median of {args.repeat} fresh processes, wall seconds from spawn to exit "
        "(Python start and imports included), peak RSS from wait4; baseline = the same process importing the CLI only."
    )
    print()
    print(table(("command", "exit", "seconds", "vs baseline", "peak MiB"), rows))
    print()
    verdict = "MET" if not misses else "MISSED: " + "; ".join(misses)
    print(f"target: every command under {TARGET_SECONDS:.0f} s and {TARGET_MIB} MiB: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
