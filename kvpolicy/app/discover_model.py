"""``kvpolicy discover --model CONFIG_OR_DIR --tp N [--tp M] [--out DIR] [--check-warm]``: observe a
model on a real vLLM engine from its configuration alone.

A tiny copy of the model (:mod:`kvpolicy.harness.zoo`) keeps every field that decides what TP ranks
hold and shrinks the rest; it is served with seeded weights and no tokenizer through
``KVPolicyConnector`` with ``kvpolicy_discover`` on, once per TP size, and rank 0's reports go to
``--out``. Bad input (a missing file, an unknown model type, a TP size the heads or this machine's
cores do not allow) is refused before torch or vLLM is imported.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

from kvpolicy.language.diagnostics import printable_path

DEFAULT_OUT = Path("discovery")


def _stem(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "model"


def run_discover_model(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    from kvpolicy.harness.zoo.shrink import HEAD_KEYS, SourceError, cores_refusal, load_source, tp_refusal

    if args.reports:
        parser.error("REPORT files go with --propose or --check")
    given = [flag for flag, value in (("--output", args.output), ("--name", args.name)) if value is not None]
    if given:
        parser.error(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --propose")
    if not args.tp:
        parser.error("give the TP sizes to observe at: --tp N (repeat for several)")
    tp_sizes = list(dict.fromkeys(args.tp))
    steps = 4 if args.steps is None else args.steps
    if not 1 <= steps <= 64:
        parser.error(f"--steps must be between 1 and 64, got {steps}")
    for size in tp_sizes:
        reason = cores_refusal(size)
        if reason:
            parser.error(f"--tp {size}: {reason}")
    try:
        raw, _, _ = load_source(args.model)
    except SourceError as error:
        parser.error(f"--model {error}")
    if any(key in raw for key in HEAD_KEYS):  # a config file: judged before transformers (and torch) load
        for size in tp_sizes:
            reason = tp_refusal(raw, size)
            if reason:
                parser.error(f"--tp {size}: {reason}")
    out: Path = DEFAULT_OUT if args.out is None else args.out
    return _observe_model(args.model, tp_sizes, out, check_warm=bool(args.check_warm))


def _observe_model(source: str, tp_sizes: list[int], out: Path, *, check_warm: bool) -> int:
    from kvpolicy.documents.propose import head_factor_of
    from kvpolicy.harness.zoo.observe import BuildError, ZooStore, check_policy, degenerate, observe_copy, summarize
    from kvpolicy.harness.zoo.shrink import SourceError, shrink, tp_refusal

    try:
        copy = shrink(source)
    except SourceError as error:
        print(f"kvpolicy discover: error: --model {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - transformers refusing the configuration, whatever it raises
        print(f"kvpolicy discover: error: --model {source}: transformers cannot build its configuration: "
              f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr)
        return 2
    for size in tp_sizes:
        reason = tp_refusal(copy.config, size)
        if reason:
            print(f"kvpolicy discover: error: --tp {size}: {reason}", file=sys.stderr)
            return 2
    stem = _stem(copy.architecture)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"error: cannot create '{printable_path(str(out))}': {error.strerror or error}")
        return 1
    for line in copy.summary():
        print(line)
    (out / f"{stem}-tiny.json").write_text(json.dumps(
        {"source": copy.source, "architecture": copy.architecture, "model_type": copy.model_type,
         "layers": list(copy.layers), "prefix": copy.prefix, "period": copy.period, "dtype": copy.dtype,
         "plugins": list(copy.plugins), "notes": list(copy.notes),
         "kept": [asdict(change) for change in copy.kept], "shrunk": [asdict(change) for change in copy.shrunk]},
        indent=2, default=str) + "\n")
    failed = False
    with ZooStore(out / f"{stem}-store") as store:
        try:
            observed = list(observe_copy(copy, out / f"{stem}-copy", tp_sizes, out, store=store, check_warm=check_warm,
                                         stem=stem))
        except BuildError as error:
            print(f"kvpolicy discover: error: --model {source}: transformers cannot build the tiny copy: {error}",
                  file=sys.stderr)
            return 1
        for served, seen in observed:
            if served is not copy:
                print(f"tp {seen.tp_size}: {served.notes[-1]}")
            if seen.report is None:
                failed = True
                print(f"tp {seen.tp_size}: not served ({seen.wall_s:.0f} s): {seen.error}")
                continue
            report, groups = summarize(seen.report)
            print(f"{printable_path(str(seen.report))}: tp {seen.tp_size}, block {seen.block_size} tokens, "
                  f"prompts of {seen.prompt_tokens}, {seen.wall_s:.0f} s")
            for group in groups:
                factor = head_factor_of(tuple(tuple(c) for c in group.partition), report.topology) if group.partition else None
                said = f"factor {factor}" if factor is not None else "no factor expresses it"
                print(f"  group {group.index} {group.name} ({', '.join(group.spec_types)}): equal bytes in "
                      f"{group.partition or 'nothing compared'} ({said}); {group.blocks} blocks compared, "
                      f"{group.zero_blocks} all-zero")
            for line in degenerate(groups):
                failed = True
                print(f"  no evidence: {line}")
            differences = check_policy("default", report)
            print(f"  default: {'agrees' if not differences else f'{len(differences)} differences'}")
            for line in differences:
                print(f"    {line}")
            if seen.error:
                failed = True
                print(f"  {seen.error}")
            if seen.warm is not None:
                warm = seen.warm
                print(f"  warm: {warm.cached_tokens} of {warm.prompt_tokens} prompt tokens loaded, "
                      f"{'same' if warm.same_tokens else 'different'} tokens, logprobs within {warm.max_logprob_diff:.3g}")
                failed |= not warm.same_tokens or warm.cached_tokens == 0
    return 1 if failed else 0


__all__ = ["run_discover_model"]
