"""The Model coverage page (kvpolicy.app.coverage), rendered from the zoo sweep's result and the warm-path
benchmark's (benchmarks/zoo_warm_path.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpolicy.app.coverage import DIAGNOSES, RESULT, coverage_markdown, warm_path_markdown


def _group(spec: str, partition: list[list[int]] | None) -> dict[str, Any]:
    return {"spec_types": [spec], "layers": 2, "partition": partition}


def _warm(*, same: bool, diff: float) -> dict[str, Any]:
    return {"cached_tokens": 64, "prompt_tokens": 65, "same_tokens": same, "max_logprob_diff": diff,
            "exact": same and diff == 0.0}


SWEEP = {
    "architectures": ["ExactForCausalLM", "MlaForCausalLM", "GpuForCausalLM"],
    "versions": {"vllm": "0.32.0", "transformers": "5"},
    "machine": {"cores": 2},
    "entries": {
        "ExactForCausalLM@tp2": {
            "architecture": "ExactForCausalLM", "tp_size": 2, "status": "served", "block_size": 32,
            "groups": [_group("SlidingWindowSpec", [[0], [1]])] * 5 + [_group("FullAttentionSpec", [[0], [1]])],
            "warm": _warm(same=True, diff=0.0), "objects_written": 16, "objects_planned": 16,
        },
        "MlaForCausalLM@tp2": {
            "architecture": "MlaForCausalLM", "tp_size": 2, "status": "served", "block_size": 32,
            "groups": [_group("MLAAttentionSpec", [[0, 1]]), _group("MLAAttentionSpec", [[0, 1]])],
            "warm": _warm(same=False, diff=0.9), "objects_written": 8, "objects_planned": 8,
        },
        "GpuForCausalLM@tp2": {
            "architecture": "GpuForCausalLM", "tp_size": 2, "status": "gpu-only",
            "error": "NotImplementedError: Sparse Attention is not supported on CPU.",
        },
    },
}


def _measured(same: bool, diff: float) -> dict[str, Any]:
    return {"cached_tokens": 64, "same_tokens": same, "max_logprob_diff": diff}


WARM_PATH = {
    "entries": {
        "LikeVllmForCausalLM@tp2": {
            "architecture": "LikeVllmForCausalLM", "tp_size": 2,
            "blocks": {"compared": 8, "identical": 8, "differing": []},
            "warm": _measured(True, 8e-06), "vllm_prefix_alone": _measured(True, 8e-06),
            "vllm_prefix_together": _measured(True, 0.0),
        },
        "CorruptForCausalLM@tp2": {
            "architecture": "CorruptForCausalLM", "tp_size": 2,
            "blocks": {"compared": 8, "identical": 7, "differing": ["rank 1 cache 3.0 block 2"]},
            "warm": _measured(False, 0.4), "vllm_prefix_alone": _measured(True, 1e-06),
            "vllm_prefix_together": _measured(True, 0.0),
        },
        "BrokenForCausalLM@tp2": {"architecture": "BrokenForCausalLM", "tp_size": 2, "error": "RuntimeError: no"},
    },
}


def _page(tmp_path: Path) -> str:
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps(SWEEP))
    return coverage_markdown(path)


def _warm_path(tmp_path: Path) -> str:
    path = tmp_path / "zoo_warm_path.json"
    path.write_text(json.dumps(WARM_PATH))
    return warm_path_markdown(path)


def _row(page: str, architecture: str) -> str:
    return next(line for line in page.splitlines() if line.startswith(f"| {architecture} |"))


def test_alike_groups_are_counted_once_and_the_partition_shown_once(tmp_path: Path) -> None:
    page = _page(tmp_path)
    assert "| SlidingWindow x5, FullAttention | [[0], [1]] |" in _row(page, "ExactForCausalLM")
    assert "| MLAAttention x2 | [[0, 1]] |" in _row(page, "MlaForCausalLM")


def test_a_copy_not_served_is_in_its_own_table_with_its_reason(tmp_path: Path) -> None:
    served, not_served = _page(tmp_path).split("### Not served")
    assert "GpuForCausalLM" not in served
    assert "| GpuForCausalLM | 2 | gpu-only | NotImplementedError: Sparse Attention is not supported on CPU. |" in not_served


def test_a_copy_not_served_shows_why_or_that_nobody_has_diagnosed_it(tmp_path: Path) -> None:
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps(SWEEP))
    assert _row(coverage_markdown(path, {"GpuForCausalLM": "a CUDA kernel"}), "GpuForCausalLM").endswith(
        "| a CUDA kernel |")
    assert _row(coverage_markdown(path, {}), "GpuForCausalLM").endswith("| not diagnosed yet |")


def test_every_architecture_the_sweep_did_not_serve_is_diagnosed_and_no_diagnosis_is_stale() -> None:
    # A TP size the heads do not allow ("heads") explains itself, unless no TP size served the model.
    entries = list(json.loads(RESULT.read_text())["entries"].values())
    served = {entry["architecture"] for entry in entries if entry.get("status") == "served"}
    unserved = {entry["architecture"] for entry in entries
                if entry.get("status") not in ("served", "heads") or entry["architecture"] not in served}
    assert (sorted(unserved - DIAGNOSES.keys()), sorted(DIAGNOSES.keys() - unserved)) == ([], [])


def test_the_counts_name_the_served_and_the_bit_exact_cells(tmp_path: Path) -> None:
    page = _page(tmp_path)
    assert "- served on CPU: 2 cells (2 architectures)" in page
    assert "- warm engine: same tokens in 1, bit-exact logprobs in 1" in page


def test_a_copy_whose_prompt_blocks_came_back_otherwise_names_them(tmp_path: Path) -> None:
    row = _row(_warm_path(tmp_path), "CorruptForCausalLM")
    assert "| 7 / 8: rank 1 cache 3.0 block 2 |" in row


def test_the_warm_path_counts_exact_bytes_and_differences_like_vllms_own(tmp_path: Path) -> None:
    page = _warm_path(tmp_path)
    assert "byte-identical warm vs cold, on every rank and KV cache tensor: 1 of 2 copies; 1 failed to serve" in page
    assert "by no more than vLLM's own prefix hit does, alone: 1 of 2" in page


def test_a_copy_with_no_full_block_held_by_both_engines_says_so(tmp_path: Path) -> None:
    entries = WARM_PATH["entries"]
    state_only = {**entries["LikeVllmForCausalLM@tp2"], "architecture": "StateForCausalLM",
                  "blocks": {"compared": 0, "identical": 0, "differing": []}}
    path = tmp_path / "zoo_warm_path.json"
    path.write_text(json.dumps({"entries": {**entries, "StateForCausalLM@tp2": state_only}}))
    page = warm_path_markdown(path)
    assert "none held by both" in _row(page, "StateForCausalLM")
    assert ": 1 of 2 copies (1 with no full block held by both); 1 failed to serve" in page


def test_a_copy_whose_engines_failed_shows_the_error(tmp_path: Path) -> None:
    assert "RuntimeError: no" in _row(_warm_path(tmp_path), "BrokenForCausalLM")
