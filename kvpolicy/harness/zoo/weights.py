"""Seeded weights for a tiny copy, saved as a checkpoint vLLM loads like a real one.

Why not vLLM's dummy loader (``load_format="dummy"``): it fills every tensor from the same seed, so
the shard of a TP-split weight each rank holds is drawn alike on every rank. Two KV heads at TP=2
then compute identical keys on both ranks, and discovery observes replicated bytes where the model
holds a distinct head per rank (measured on a 2-KV-head Llama: partition ``[[0, 1]]``, where the
model's is ``[[0], [1]]``). A checkpoint holds each full tensor once, and vLLM's loader gives each rank
its own shard of it, as it does for a real model.

The weights are drawn as :mod:`kvpolicy.harness.tinymodel` draws them: normal with std 0.2 (every part
of the model moves the logits), norm weights 1, Mamba-style ``A_log ~ U[0, 1.5)`` and ``dt_bias = 0``,
one generator in a fixed parameter order, so the same configuration always gives the same weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvpolicy.harness.tinymodel import seeded_model
from kvpolicy.harness.zoo.families import FIXES, CheckpointFix

INIT_STD = 0.2


def write_checkpoint(directory: str | os.PathLike[str], *, dtype: str, seed: int = 0, init_std: float = INIT_STD) -> Path:
    """Instantiate the model of ``directory/config.json`` with transformers, redraw its weights and
    save them beside it (``model.safetensors``); return the directory."""
    from transformers import AutoConfig

    target = Path(directory)
    model = seeded_model(AutoConfig.from_pretrained(target), dtype=dtype, init_std=init_std, seed=seed)
    written = (target / "config.json").read_text()
    model.save_pretrained(target, safe_serialization=True)
    # save_pretrained rewrites config.json (transformers' class name, its own defaults): keep the copy's.
    (target / "config.json").write_text(written)
    family = FIXES.get(json.loads(written).get("model_type", ""))
    if family is not None and family.checkpoint is not None:
        _edit_checkpoint(target, family.checkpoint, json.loads(written))
    return target


def _edit_checkpoint(target: Path, edits: Callable[[Mapping[str, Any], Mapping[str, Any]], CheckpointFix],
                     config: Mapping[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    path = target / "model.safetensors"
    if not path.is_file():
        raise RuntimeError(f"{target}: a family's checkpoint edits need one model.safetensors (a tiny copy's)")
    tensors = load_file(path)
    for name, tensor, _reason in list(edits(tensors, config)):
        if tensor is None:
            tensors.pop(name, None)
        else:
            tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})
