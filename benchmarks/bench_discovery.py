"""What discovery (``kvpolicy_discover``) costs per observed step, next to the step without it.

Two parts.

**engine** — real vLLM engines on CPU (``kvpolicy.harness.e2e.serve_once``, one fresh process each) at
TP=2: a tiny Llama (1 KV head) and a tiny Qwen3-Next (1 KV head, Gated DeltaNet state), four prompts
of ``--tokens`` tokens in one batch, ``max_tokens=1`` so that ``generate`` is the prefill. One engine
with discovery on (4 steps), one with it off, the same policy (``default``): the baseline is measured
in the same run. Discovery's own numbers come from rank 0's line per observed step (``kvpolicy discover
step k/N: B layer blocks per rank; digest X ms, gather Y ms, report Z ms``): digest = reading and
hashing this rank's blocks per layer, gather = the ``all_gather_object`` of every rank's digests over
the TP group's gloo group (it also waits for the slowest rank), report = rank 0 folding them into its
observation and rewriting the report file.

**digest** — the per-layer digest against the audit's per-group digest of the same bytes, for real
models' block sizes: every group of each example layout at ``--digest-tp``, the blocks of one step
(:data:`~kvpolicy.vllm.audit.AUDIT_REQUESTS_PER_STEP` requests x
:data:`~kvpolicy.vllm.audit.AUDIT_BLOCKS_PER_REQUEST` blocks, every layer of the group) read from CPU
tensors by :func:`~kvpolicy.device.blocks.local_layer_digests` (discovery) and
:func:`~kvpolicy.device.blocks.local_digests` (the audit). On a GPU add one device-to-host copy per
layer and block (the audit copies once per group).

**report** — rank 0's rewrite of the report after an observed step, for each example layout (all its
layers) at ``--digest-tp``: what the tiny engines above cannot show for a real model's layer count.

    python benchmarks/bench_discovery.py [--tokens 896] [--repeat 1] [--skip-engine] [--digest-tp 8]
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

from _common import group_block_caches, table

STEP_LINE = re.compile(
    r"kvpolicy discover step (\d+)/(\d+): (\d+) layer blocks per rank; digest ([\d.]+) ms, gather ([\d.]+) ms, "
    r"report ([\d.]+) ms"
)
MODELS = ("llama", "qwen3-next")


def engine_part(args: argparse.Namespace) -> None:
    from kvpolicy.documents.settings import KVPolicySettings
    from kvpolicy.harness.e2e import SegmentHolder, engine_store_config, fixed_prompt, serve_once
    from kvpolicy.harness.tinymodel import ARCHITECTURES, make_tiny_model
    from kvpolicy.mooncake import MooncakeMaster

    prompts = [fixed_prompt(args.tokens, seed=seed) for seed in range(4)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-discovery-") as scratch, MooncakeMaster(
        object_lease_ms=120_000
    ) as master:
        root = Path(scratch)
        config = engine_store_config(master.client_config(segment_mib=256), root / "engine.json")
        with SegmentHolder(master.rpc_address, segment_mib=256):
            for arch in MODELS:
                entry = ARCHITECTURES[arch]
                for repeat in range(args.repeat):
                    for mode in ("off", "on"):
                        run = root / f"{arch}-{mode}-{repeat}"
                        model = make_tiny_model(arch, run / "model", num_kv_heads=1)
                        settings = KVPolicySettings(
                            kvpolicy="default", kvpolicy_discover=run / "report.yaml" if mode == "on" else None
                        )
                        result = serve_once(
                            model, prompts[0], extra_prompts=prompts[1:], tp_size=2,
                            kv_transfer_config=settings.kv_transfer_config(
                                upstream_extra={"cache_prefix": f"bench-{arch}-{mode}-{repeat}"}
                            ),
                            mooncake_config_path=config, max_tokens=1, logprobs=1, dtype=entry.dtype,
                            hybrid=entry.hybrid, max_model_len=args.tokens + 64, timeout=1200,
                            extra_env={"VLLM_LOGGING_LEVEL": "INFO"},  # _common quiets vLLM; the step lines are INFO
                        )
                        steps = [match.groups() for match in STEP_LINE.finditer(result.stdout + result.stderr)]
                        rows.append((arch, mode, result, steps))
                        print(f"  {arch} discovery {mode}: prefill {result.generate_s * 1e3:.0f} ms, "
                              f"{len(steps)} observed step(s)", flush=True)
    print()
    print(f"engine: tiny models at TP=2, 4 prompts x {args.tokens} tokens in one batch, vLLM CPU, 2 cores")
    body = []
    for arch in MODELS:
        baseline = statistics.median(row[2].generate_s for row in rows if row[0] == arch and row[1] == "off") * 1e3
        for mode in ("off", "on"):
            runs = [row for row in rows if row[0] == arch and row[1] == mode]
            prefill = statistics.median(run[2].generate_s for run in runs) * 1e3
            steps = [step for run in runs for step in run[3]]
            digest = statistics.median(float(step[3]) for step in steps) if steps else 0.0
            gather = statistics.median(float(step[4]) for step in steps) if steps else 0.0
            written = statistics.median(float(step[5]) for step in steps) if steps else 0.0
            body.append((
                arch, mode, f"{prefill:.0f}", f"{prefill / baseline:.3f}", len(steps) // max(1, len(runs)),
                "-" if not steps else steps[0][2], "-" if not steps else f"{digest:.2f}",
                "-" if not steps else f"{gather:.2f}", "-" if not steps else f"{written:.2f}",
                "-" if not steps else f"{(digest + gather + written) / prefill * 100:.2f}%",
            ))
    print(table(("model", "discovery", "prefill ms", "vs off", "observed steps", "layer blocks/rank/step",
                 "digest ms/step", "gather ms/step", "report ms/step", "of prefill"), body))


def digest_part(args: argparse.Namespace) -> None:
    from kvpolicy.device.blocks import local_digests, local_layer_digests
    from kvpolicy.documents.loader import layouts_dir, load_layout, load_policy
    from kvpolicy.language.models import Topology
    from kvpolicy.planning.engine import make_plan
    from kvpolicy.vllm.audit import AUDIT_BLOCKS_PER_REQUEST, AUDIT_REQUESTS_PER_STEP

    blocks = AUDIT_REQUESTS_PER_STEP * AUDIT_BLOCKS_PER_REQUEST
    body = []
    for path in sorted(layouts_dir().glob("*.yaml")):
        layout = load_layout(path)
        the_plan = make_plan(load_policy("default"), layout, Topology(tp_size=args.digest_tp))
        for group in the_plan.groups:
            layers = len(group.decisions)
            block_size = group.chunk_tokens
            page = int(group.bytes_per_token_per_rank * block_size / layers)
            names = [decision.layer for decision in group.decisions]
            _, database, reader = group_block_caches(group, blocks)
            chosen = {0: list(range(1, blocks + 1))}
            timings: dict[str, list[float]] = {"group": [], "layer": []}
            for _ in range(args.digest_repeat):
                started = time.perf_counter()
                local_digests([database], reader, chosen)
                timings["group"].append(time.perf_counter() - started)
                started = time.perf_counter()
                local_layer_digests([database], reader, chosen, {0: names})
                timings["layer"].append(time.perf_counter() - started)
            audit_ms = statistics.median(timings["group"]) * 1e3
            discovery_ms = statistics.median(timings["layer"]) * 1e3
            body.append((
                path.stem, group.name, layers, block_size, f"{blocks * layers * page / 1e6:.1f}",
                f"{audit_ms:.1f}", f"{discovery_ms:.1f}", f"{discovery_ms / audit_ms:.2f}",
            ))
    print()
    print(f"digest: one step's blocks ({AUDIT_REQUESTS_PER_STEP} requests x {AUDIT_BLOCKS_PER_REQUEST} blocks), every "
          f"layer of each group, CPU tensors, tp={args.digest_tp}")
    print(table(("layout", "group", "layers", "block tokens", "MB digested", "audit (per group) ms",
                 "discovery (per layer) ms", "ratio"), body))


def report_part(args: argparse.Namespace) -> None:
    from kvpolicy.documents.loader import layouts_dir, load_layout
    from kvpolicy.evidence.discovery import Observer, dump_report, group_layers
    from kvpolicy.language.models import Topology

    body = []
    for path in sorted(layouts_dir().glob("*.yaml")):
        layout = load_layout(path)
        layers = group_layers(layout)
        observer = Observer(args.digest_tp, layers)
        step = [{group: {layer: [(f"{layer}/{block}/{rank}", False) for block in range(8)] for layer in names}
                 for group, names in enumerate(layers)} for rank in range(args.digest_tp)]
        timings = []
        for _ in range(args.digest_repeat):
            started = time.perf_counter()
            observer.observe(step)
            text = dump_report(observer.report(model=layout.model, source="engine",
                                               topology=Topology(tp_size=args.digest_tp), layout=layout))
            timings.append(time.perf_counter() - started)
        body.append((path.stem, sum(map(len, layers)), f"{len(text) / 1e3:.0f}", f"{statistics.median(timings) * 1e3:.1f}"))
    print()
    print(f"report: rank 0 folding one step's digests (8 blocks per layer) into its observation and rewriting the "
          f"report, tp={args.digest_tp}")
    print(table(("layout", "layers", "report KB", "ms/step"), body))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=int, default=896, help="tokens per prompt (4 prompts per engine; the tiny models take 1024 positions)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="engine runs per (model, discovery) configuration")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--digest-tp", type=int, default=8)
    parser.add_argument("--digest-repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.skip_engine:
        engine_part(args)
    digest_part(args)
    report_part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
