"""Which model types and architectures exist, read from the installed transformers' and vLLM's source
files without importing either (importing transformers imports torch: seconds), so that a wrong name is
refused at once.

- :func:`causal_lm_types`: transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (model type → its
  causal-LM class names), a literal in ``transformers/models/auto/modeling_auto.py``;
- :func:`vllm_text_architectures`: vLLM's ``_TEXT_GENERATION_MODELS`` keys, a literal in
  ``vllm/model_executor/models/registry.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path


def _package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


def _assigned_literal(path: Path, name: str) -> ast.expr | None:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
    return None


@functools.cache
def causal_lm_types() -> dict[str, tuple[str, ...]]:
    """Model type → the causal-LM class names transformers maps it to; empty without transformers."""
    path = _package_file("transformers", "models/auto/modeling_auto.py")
    node = None if path is None else _assigned_literal(path, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if not isinstance(node, ast.Call) or not node.args:
        return {}
    found: dict[str, tuple[str, ...]] = {}
    for pair in ast.literal_eval(node.args[0]):
        model_type, classes = pair
        found[model_type] = tuple(classes) if isinstance(classes, (list, tuple)) else (classes,)
    return found


@functools.cache
def vllm_text_architectures() -> frozenset[str]:
    """vLLM's text-generation architecture names; empty without vLLM."""
    path = _package_file("vllm", "model_executor/models/registry.py")
    node = None if path is None else _assigned_literal(path, "_TEXT_GENERATION_MODELS")
    if not isinstance(node, ast.Dict):
        return frozenset()
    return frozenset(key.value for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str))


def model_types_of(architecture: str) -> tuple[str, ...]:
    """The model types whose causal-LM class is *architecture*, text-only ones first (``*_text``: a
    composite's language model, which vLLM's ``...ForCausalLM`` serves alone)."""
    types = [model_type for model_type, classes in causal_lm_types().items() if architecture in classes]
    return tuple(sorted(types, key=lambda name: (not name.endswith("_text"), name)))
