"""What the replication audit costs: per audited step and in total, next to the step time without it.

Two parts.

**engine** — real vLLM engines on CPU (``kvpolicy.harness.e2e.serve_once``, one fresh process each),
a tiny Llama with 1 KV head (so under ``default`` the attention group has factor = TP and is
audited), a 4096-token prompt, ``max_tokens=1`` so that ``generate`` is the prefill alone. For TP=2
and TP=4, one engine with ``default`` (audit: warn, 4 steps) and one with the same policy but
``audit: off`` (the same plan, so the same keys: each engine gets its own model directory name so
that none hits another's objects). The audit's own numbers come from rank 0's log line per audited
step (``kvpolicy audit step k/N: B blocks per rank …; digest X ms, gather Y ms, total Z ms``):
digest = reading and hashing this rank's capped blocks, gather = the ``all_gather_object`` over the
TP group's gloo group (it also waits for the slowest rank), total = both plus the verdict (and, on a
mismatch, the re-plan). "prefill" is ``LLM.generate``'s wall time, audit on vs off.

**digest** — the digest's cost for real models' block sizes, where it dominates: per audited group
of each example layout at ``--digest-tp`` under ``default``, the capped blocks of one step
(:data:`~kvpolicy.vllm.audit.AUDIT_REQUESTS_PER_STEP` requests x
:data:`~kvpolicy.vllm.audit.AUDIT_BLOCKS_PER_REQUEST` blocks, all layers of the group) read through
:class:`~kvpolicy.device.blocks.BlockReader` from CPU tensors and hashed by
:func:`~kvpolicy.device.blocks.local_digests`. On a GPU add one device-to-host copy of the same bytes.

    python benchmarks/bench_audit.py [--tp 2 4] [--tokens 4096] [--repeat 1] [--skip-engine] [--digest-tp 8]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, group_block_caches, table

STEP_LINE = re.compile(
    r"kvpolicy audit step (\d+)/(\d+): (\d+) blocks per rank \((.*?)\); "
    r"digest ([\d.]+) ms, gather ([\d.]+) ms, total ([\d.]+) ms"
)
BATCHED = re.compile(r"max_num_batched_tokens=(\d+)")


def _audit_off_policy(directory: Path) -> Path:
    """``default`` with ``audit: off``: the same plan and keys, no audit."""
    text = (REPO / "policies" / "default.yaml").read_text()
    text = text.replace("name: default", "name: default-audit-off").replace("  mode: warn", '  mode: "off"')
    assert 'mode: "off"' in text
    path = directory / "default-audit-off.yaml"
    path.write_text(text)
    return path


def engine_part(args: argparse.Namespace) -> None:
    from kvpolicy.documents.settings import KVPolicySettings
    from kvpolicy.harness.e2e import SegmentHolder, engine_store_config, fixed_prompt, serve_once
    from kvpolicy.harness.tinymodel import make_tiny_llama
    from kvpolicy.mooncake import MooncakeMaster

    prompt = fixed_prompt(args.tokens, seed=4096)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as scratch, MooncakeMaster(
        object_lease_ms=120_000
    ) as master:
        root = Path(scratch)
        policies = {"on": REPO / "policies" / "default.yaml", "off": _audit_off_policy(root)}
        config = engine_store_config(master.client_config(segment_mib=256), root / "engine.json")
        with SegmentHolder(master.rpc_address, segment_mib=256):
            for tp_size in args.tp:
                for repeat in range(args.repeat):
                    for mode in ("off", "on"):
                        model = make_tiny_llama(
                            root / f"bench-audit-tp{tp_size}-{mode}-{repeat}",
                            num_kv_heads=1,
                            max_position_embeddings=args.tokens + 512,
                        )
                        result = serve_once(
                            model,
                            prompt,
                            tp_size=tp_size,
                            kv_transfer_config=KVPolicySettings(kvpolicy=str(policies[mode])).kv_transfer_config(),
                            mooncake_config_path=config,
                            max_tokens=1,
                            logprobs=1,
                            max_model_len=args.tokens + 256,
                            timeout=1200,
                            extra_env={"VLLM_LOGGING_LEVEL": "INFO"},  # _common quiets vLLM; the audit lines are INFO
                        )
                        output = result.stdout + result.stderr
                        steps = [match.groups() for match in STEP_LINE.finditer(output)]
                        batched = BATCHED.search(output)
                        rows.append((tp_size, mode, result, steps, int(batched.group(1)) if batched else None))
                        print(
                            f"  tp={tp_size} audit {mode}: start-up {result.startup_s:.1f} s, prefill "
                            f"{result.generate_s * 1e3:.0f} ms, {len(steps)} audited step(s), cached "
                            f"{result.num_cached_tokens}",
                            flush=True,
                        )
    print()
    print(f"engine: tiny Llama (2 layers, 1 KV head), {args.tokens}-token prompt, vLLM CPU, 2 cores")
    body = []
    for tp_size in args.tp:
        for mode in ("off", "on"):
            runs = [row for row in rows if row[0] == tp_size and row[1] == mode]
            prefill = statistics.median(run[2].generate_s for run in runs) * 1e3
            steps = [step for run in runs for step in run[3]]
            per_run_total = statistics.median(sum(float(step[6]) for step in run[3]) for run in runs)
            verdicts = sorted({step[3] for step in steps}) or ["-"]
            chunk = runs[0][4]
            body.append(
                (
                    tp_size,
                    mode,
                    "-" if chunk is None else -(-args.tokens // chunk),
                    f"{prefill:.0f}",
                    len(steps) // max(1, len(runs)),
                    "-" if not steps else steps[0][2],
                    "-" if not steps else f"{statistics.median(float(s[4]) for s in steps):.2f}",
                    "-" if not steps else f"{statistics.median(float(s[5]) for s in steps):.2f}",
                    "-" if not steps else f"{statistics.median(float(s[6]) for s in steps):.2f}",
                    "-" if not steps else f"{per_run_total:.2f}",
                    "-" if not steps else f"{per_run_total / prefill * 100:.2f}%",
                    "; ".join(verdicts),
                )
            )
    print(
        table(
            (
                "TP",
                "audit",
                "prefill steps",
                "prefill ms",
                "audited steps",
                "blocks/rank/step",
                "digest ms",
                "gather ms",
                "audit ms/step",
                "audit total ms",
                "of prefill",
                "verdict",
            ),
            body,
        )
    )


def digest_part(args: argparse.Namespace) -> None:
    from kvpolicy.device.blocks import local_digests
    from kvpolicy.documents.loader import layouts_dir, load_layout, load_policy
    from kvpolicy.evidence.audit import audited_groups
    from kvpolicy.language.models import Topology
    from kvpolicy.planning.engine import make_plan
    from kvpolicy.vllm.audit import AUDIT_BLOCKS_PER_REQUEST, AUDIT_REQUESTS_PER_STEP

    blocks = AUDIT_REQUESTS_PER_STEP * AUDIT_BLOCKS_PER_REQUEST
    body = []
    for path in sorted(layouts_dir().glob("*.yaml")):
        layout = load_layout(path)
        the_plan = make_plan(load_policy("default"), layout, Topology(tp_size=args.digest_tp))
        for index in audited_groups(the_plan):
            group = the_plan.groups[index]
            layers = len(group.decisions)
            block_size = group.chunk_tokens
            page = int(group.bytes_per_token_per_rank * block_size / layers)
            _, database, reader = group_block_caches(group, blocks)
            timings = []
            for _ in range(args.digest_repeat):
                started = time.perf_counter()
                local_digests([database], reader, {0: list(range(1, blocks + 1))})
                timings.append(time.perf_counter() - started)
            megabytes = blocks * layers * page / 1e6
            body.append(
                (
                    path.stem,
                    group.name,
                    group.factor,
                    layers,
                    block_size,
                    f"{layers * page / 1e6:.2f}",
                    blocks,
                    f"{megabytes:.1f}",
                    f"{statistics.median(timings) * 1e3:.1f}",
                    f"{statistics.median(timings) * 1e3 * 4:.0f}",
                )
            )
    print()
    print(
        f"digest: the capped blocks of one audited step ({AUDIT_REQUESTS_PER_STEP} requests x "
        f"{AUDIT_BLOCKS_PER_REQUEST} blocks), every layer of the group, CPU tensors, tp={args.digest_tp}, "
        "policy default"
    )
    print(
        table(
            (
                "layout",
                "group",
                "factor",
                "layers",
                "block tokens",
                "MB/block/rank",
                "blocks",
                "MB digested",
                "ms/step",
                "ms for 4 steps",
            ),
            body,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1, help="engine runs per (tp, audit) configuration")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--digest-tp", type=int, default=8)
    parser.add_argument("--digest-repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if not args.skip_engine:
        engine_part(args)
    digest_part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
