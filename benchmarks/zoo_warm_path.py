"""Where a zoo copy's warm engine is not bit-exact with its cold one: is it the store or the engine?

For each architecture (by default every one the zoo sweep served whose warm run was not bit-exact,
``benchmarks/results/zoo.json``), one prompt of two full blocks and one token, at one TP size:

- **bytes**: a cold engine computes the prompt and the connector (``default``) stores it; a warm engine
  loads it. Every rank digests the first blocks of every KV cache tensor after serving
  (``serve_once(digest_blocks=True)``: the blocks of the prompt's block table, per KV cache group), and
  the prompt's two full blocks are compared byte for byte, warm against cold;
- **warm vs cold**: the largest logprob difference between the two;
- **vLLM's own prefix hit**: one engine with no KV connector and prefix caching on serves the prompt
  twice, alone, and then four prompts twice, together; the second run hits vLLM's own cache. Its
  difference from the first run is what a prefix hit changes in the engine itself, with no store.

Writes ``benchmarks/results/zoo_warm_path.json`` (rewritten after every architecture; ``--force`` redoes
those already in it); the Model coverage page renders it.

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/zoo_warm_path.py [--tp 2] [--only Lfm2 ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "benchmarks" / "results" / "zoo.json"
RESULT = REPO / "benchmarks" / "results" / "zoo_warm_path.json"
PROMPT_BLOCKS = 2
"""Full blocks in the prompt (then one token more)."""


def not_bit_exact(sweep: Path = SWEEP) -> list[str]:
    """The architectures the sweep served whose warm run was not bit-exact with the cold one."""
    entries = json.loads(sweep.read_text())["entries"].values()
    return sorted({entry["architecture"] for entry in entries
                   if entry.get("status") == "served" and not (entry.get("warm") or {}).get("exact")})


def compare_blocks(cold: Any, warm: Any) -> dict[str, Any]:
    """The prompt's full blocks warm vs cold, on every rank and KV cache tensor."""
    from kvpolicy.harness.zoo.observe import prompt_blocks_unlike

    differing, compared = prompt_blocks_unlike(cold, warm, full_blocks=PROMPT_BLOCKS)
    return {"compared": compared, "identical": compared - len(differing), "differing": differing[:20]}


def measure(architecture: str, tp_size: int, timeout: float) -> dict[str, Any]:
    from kvpolicy.documents.settings import KVPolicySettings
    from kvpolicy.harness.e2e import EngineFailed, serve_once
    from kvpolicy.harness.zoo import shrink
    from kvpolicy.harness.zoo.observe import ZooStore, build, engine_options, error_line, in_bfloat16

    started = time.monotonic()
    copy = shrink(architecture)
    swept = json.loads(SWEEP.read_text())["entries"].get(f"{architecture}@tp{tp_size}", {})
    if swept.get("dtype") == "bfloat16" and copy.dtype != "bfloat16":
        copy = in_bfloat16(copy, "as the sweep served it")
    with tempfile.TemporaryDirectory(prefix="kvpolicy-warm-path-") as scratch:
        model = build(copy, Path(scratch) / "model")
        with ZooStore(Path(scratch) / "store") as store:
            def common(count: int) -> dict[str, Any]:
                return engine_options(copy, store, tp_size=tp_size, prompts=count, timeout=timeout)

            connector = KVPolicySettings(kvpolicy="default").kv_transfer_config(
                upstream_extra={"cache_prefix": f"warm-path-{uuid.uuid4().hex[:8]}"})
            try:
                cold = serve_once(model, [], kv_transfer_config=connector, digest_blocks=True, **common(1))
                warm = serve_once(model, [], kv_transfer_config=connector, digest_blocks=True, **common(1))
                alone = serve_once(model, [], kv_transfer_config=None, repeat=True, **common(1))
                together = serve_once(model, [], kv_transfer_config=None, repeat=True, **common(4))
            except EngineFailed as failure:
                return {"architecture": architecture, "tp_size": tp_size,
                        "error": error_line(failure.stdout, failure.stderr)[:300],
                        "wall_s": round(time.monotonic() - started, 1)}
    assert alone.repeat is not None and together.repeat is not None
    return {
        "architecture": architecture, "tp_size": tp_size, "dtype": copy.dtype, "block_size": cold.block_size,
        "blocks": compare_blocks(cold, warm),
        "warm": {"cached_tokens": warm.num_cached_tokens, "same_tokens": warm.tokens == cold.tokens,
                 "max_logprob_diff": warm.max_logprob_diff(cold)},
        "vllm_prefix_alone": {"cached_tokens": alone.repeat.num_cached_tokens,
                              "same_tokens": alone.repeat.tokens == alone.tokens,
                              "max_logprob_diff": alone.repeat.max_logprob_diff(alone)},
        "vllm_prefix_together": {"cached_tokens": together.repeat.num_cached_tokens,
                                 "same_tokens": together.repeat.tokens == together.tokens,
                                 "max_logprob_diff": together.repeat.max_logprob_diff(together)},
        "wall_s": round(time.monotonic() - started, 1),
    }


def _row(entry: dict[str, Any]) -> str:
    if "error" in entry:
        return f"{entry['architecture']:34s} tp {entry['tp_size']}  error: {entry['error'][:80]}"
    blocks = entry["blocks"]
    return (f"{entry['architecture']:34s} tp {entry['tp_size']}  bytes {blocks['identical']}/{blocks['compared']}  "
            f"warm {entry['warm']['max_logprob_diff']:.2g}  vLLM alone {entry['vllm_prefix_alone']['max_logprob_diff']:.2g}"
            f"  together {entry['vllm_prefix_together']['max_logprob_diff']:.2g}  {entry['wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="TP size (default 2)")
    parser.add_argument("--only", nargs="+", help="architectures (exact names; default: the sweep's not bit-exact ones)")
    parser.add_argument("--force", action="store_true", help="redo architectures already in the result file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per engine (default 600)")
    parser.add_argument("--result", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    data: dict[str, Any] = json.loads(args.result.read_text()) if args.result.is_file() else {}
    entries = data.setdefault("entries", {})
    started = time.monotonic()
    for name in args.only or not_bit_exact():
        key = f"{name}@tp{args.tp}"
        if key in entries and not args.force:
            continue
        entry = measure(name, args.tp, args.timeout)
        entry["measured_at"] = datetime.datetime.now().isoformat(timespec="seconds")
        entries[key] = entry
        print(_row(entry), flush=True)
        args.result.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    data.setdefault("wall_s", {})[datetime.datetime.now().isoformat(timespec="seconds")] = round(time.monotonic() - started, 1)
    args.result.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
