"""The "Model coverage" page, rendered from the zoo sweep's result file (``benchmarks/zoo_sweep.py``
writes ``benchmarks/results/zoo.json``) when the documentation site builds. Pure: reads JSON only."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "zoo.json"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _groups(entry: dict[str, Any]) -> str:
    parts = []
    for group in entry.get("groups", ()):
        types = "/".join(group["spec_types"])
        parts.append(f"{types} x{group['layers']}: {group['partition'] or 'none compared'}")
    return "; ".join(parts)


def _agreement(entry: dict[str, Any], key: str) -> str:
    if entry.get("status") != "served":
        return ""
    differences = entry.get(key) or []
    return "agrees" if not differences else f"{len(differences)} differences"


def _warm(entry: dict[str, Any]) -> str:
    warm = entry.get("warm")
    if not warm:
        return ""
    same = "same tokens" if warm["same_tokens"] else "other tokens"
    return f"{warm['cached_tokens']}/{warm['prompt_tokens']} loaded, {same}, diff {warm['max_logprob_diff']:.2g}"


def _objects(entry: dict[str, Any]) -> str:
    if entry.get("status") != "served" or entry.get("objects_written") is None:
        return ""
    planned = entry.get("objects_planned")
    return f"{entry['objects_written']} / {planned if isinstance(planned, int) else 'not modelled'}"


def coverage_markdown(path: Path = RESULT) -> str:
    """The page's generated part: the counts, then one row per architecture and TP size."""
    if not path.is_file():
        return "*No sweep result yet: run `benchmarks/zoo_sweep.py`.*\n"
    data = json.loads(path.read_text(encoding="utf-8"))
    entries: dict[str, dict[str, Any]] = data.get("entries", {})
    names: list[str] = data.get("architectures", [])
    swept = {entry["architecture"] for entry in entries.values()}
    served = [entry for entry in entries.values() if entry.get("status") == "served"]
    agreeing = [e for e in served if not e.get("default") and not e.get("degenerate")]
    exact = [e for e in served if (e.get("warm") or {}).get("exact")]
    same = [e for e in served if (e.get("warm") or {}).get("same_tokens")]
    reasons = Counter(entry.get("status") for entry in entries.values() if entry.get("status") != "served")
    versions = data.get("versions", {})
    lines = [
        (f"Swept with vLLM {versions.get('vllm', '?')} and transformers {versions.get('transformers', '?')} on "
         f"{data.get('machine', {}).get('cores', '?')} cores: {len(swept)} of {len(names)} architectures "
         f"({len(entries)} architecture and TP cells)."),
        "",
        f"- served on CPU: {len(served)} cells ({len({e['architecture'] for e in served})} architectures)",
        f"- observed partitions agree with `default`'s plan, with evidence in every group: {len(agreeing)}",
        f"- warm engine: same tokens in {len(same)}, bit-exact logprobs in {len(exact)}",
        "- not served: " + (", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items())) or "none"),
    ]
    for stamp, seconds in sorted(data.get("sweep_wall_s", {}).items()):
        lines.append(f"- sweep run ending {stamp}: {seconds / 60:.1f} min wall")
    header = ("| architecture | TP | status | groups: spec x layers: observed partition | `default` | `vllm-compat` "
              "| warm vs cold | objects written / planned | block | s | first error line |")
    lines += ["", header, "|---|---:|---|---|---|---|---|---|---:|---:|---|"]
    order = {name: index for index, name in enumerate(names)}
    for key in sorted(entries, key=lambda k: (order.get(entries[k]["architecture"], 1 << 20), entries[k]["tp_size"])):
        entry = entries[key]
        lines.append("| " + " | ".join(_cell(value) for value in (
            entry["architecture"], entry["tp_size"], entry.get("status", "?"), _groups(entry),
            _agreement(entry, "default"), _agreement(entry, "vllm_compat"), _warm(entry), _objects(entry),
            entry.get("block_size") or "",
            f"{entry.get('wall_s', 0):.0f}", (entry.get("error") or "")[:160],
        )) + " |")
    missing = [name for name in names if name not in swept]
    if missing:
        lines += ["", f"Not swept yet ({len(missing)}): " + ", ".join(f"`{name}`" for name in missing) + "."]
    return "\n".join(lines) + "\n"
