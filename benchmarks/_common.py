"""What the benchmark scripts share: output helpers (tables, medians, verdicts) and their inputs.

The simulated vLLM instances the benchmarks drive come from :mod:`kvpolicy.sim` (``Fleet``,
``Instance``, ``run_consistency``) and Mooncake's helpers from :mod:`kvpolicy.mooncake`; nothing here
simulates a rank or wraps a store.
"""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_POLICIES = ("default", "vllm-compat", "no-dedup")


# --- output --------------------------------------------------------------------------------------


# vLLM's warnings (e.g. "CPU backend prefers block_size is multiples of 32", once per simulated
# instance) would bury the tables.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
logging.getLogger("vllm").setLevel(logging.ERROR)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None) -> str:
    """A GitHub-flavoured Markdown table (readable as plain text too). ``align``: one of ``l``/``r`` per
    column; numbers default to right, text to left."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(header), *(len(row[i]) for row in cells)) for i, header in enumerate(headers)]
    if align is None:
        align = "".join(
            "r" if cells and all(_numeric(row[i]) for row in cells) else "l" for i in range(len(headers))
        )

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(
            value.rjust(width) if side == "r" else value.ljust(width)
            for value, width, side in zip(values, widths, align, strict=True)
        ) + " |"

    rule = "|" + "|".join(
        "-" * (width + 1) + ":" if side == "r" else "-" * (width + 2) for width, side in zip(widths, align, strict=True)
    ) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in cells)])


def _numeric(text: str) -> bool:
    stripped = text.rstrip("x%").replace(",", "").strip()
    if not stripped or stripped in ("-", "n/a"):
        return True
    try:
        float(stripped)
    except ValueError:
        return False
    return True


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def median_ci(values: Sequence[float], *, level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """Bootstrap confidence interval of the median of *values* (percentile method, fixed seed)."""
    if len(values) < 2:
        return (math.nan, math.nan)
    generator = random.Random(0)
    medians = sorted(statistics.median(generator.choices(values, k=len(values))) for _ in range(resamples))
    low = medians[int((1 - level) / 2 * resamples)]
    high = medians[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return low, high


def verdict(value: float, interval: tuple[float, float], target: float) -> str:
    """MET / MISSED against a lower bound, saying when the miss is inside the noise."""
    if value >= target:
        return "MET"
    if interval[1] >= target:
        return f"MISSED by {target - value:.2f}, but within the 95% interval ({interval[0]:.2f}-{interval[1]:.2f})"
    return f"MISSED by {target - value:.2f} (95% interval {interval[0]:.2f}-{interval[1]:.2f})"


# --- inputs --------------------------------------------------------------------------------------


def example_layouts(names: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """The layouts in ``examples/layouts/`` (all, or those whose file stem is in *names*)."""
    from kvpolicy.documents.loader import layouts_dir, load_layout

    paths = sorted(layouts_dir().glob("*.yaml"))
    if names:
        paths = [path for path in paths if path.stem in names]
        missing = set(names) - {path.stem for path in paths}
        if missing:
            raise SystemExit(f"unknown layout(s): {', '.join(sorted(missing))}")
    return [(path.stem, load_layout(path)) for path in paths]


def group_block_caches(group: Any, blocks: int) -> tuple[dict[str, Any], Any, Any]:
    """CPU KV tensors holding ``blocks`` random blocks of every layer of a planned group (real page
    sizes: the group's bytes per token per rank over its chunk), with vLLM's token database over them
    and kvpolicy's block reader: ``(caches by layer name, database, reader)``, blocks 1..``blocks``."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ChunkedTokenDatabase, KeyMetadata

    from kvpolicy.device.blocks import BlockReader

    layers = [decision.layer for decision in group.decisions]
    page = int(group.bytes_per_token_per_rank * group.chunk_tokens / len(layers))
    generator = torch.Generator().manual_seed(group.index)
    caches = {name: torch.randint(0, 256, (blocks + 1, page), dtype=torch.uint8, generator=generator) for name in layers}
    database = ChunkedTokenDatabase(KeyMetadata("bench", 0, 0, 0, 0), group.chunk_tokens)
    database.set_kv_caches_base_addr([tensor.data_ptr() for tensor in caches.values()])
    database.set_block_len([page] * len(layers))
    return caches, database, BlockReader(caches)
