"""Builders shared by the core tests: layouts and policies written as plain data, validated by the real models."""

from __future__ import annotations

import textwrap
from typing import Any

from kvpolicy.documents.loader import check_text
from kvpolicy.language.catalog import SPEC_CLASSES
from kvpolicy.language.models import Layout, Policy

MODEL = "deepseek-ai/DeepSeek-V2-Lite"
MODEL_BASENAME = "DeepSeek-V2-Lite"


def spec(type_: str, *, bases: tuple[str, ...] | None = None, block_size: int = 16,
         page_size_bytes: int | str = 4096, **fields: Any) -> dict[str, Any]:
    """A spec as a layout file states it; bases default to vLLM 0.32's MRO for known classes."""
    return {
        "type": type_,
        "bases": list(SPEC_CLASSES.get(type_, ("KVCacheSpec",)) if bases is None else bases),
        "block_size": block_size,
        "page_size_bytes": page_size_bytes,
        "fields": fields,
    }


def mla(**fields: Any) -> dict[str, Any]:
    return spec("MLAAttentionSpec", **{"max_tp_shards": 1, "num_kv_heads": 1, **fields})


def full(**fields: Any) -> dict[str, Any]:
    return spec("FullAttentionSpec", **{"max_tp_shards": None, "num_kv_heads": 1, **fields})


def mamba(**fields: Any) -> dict[str, Any]:
    return spec("MambaSpec", **{"tp_replicated": False, "mamba_type": "mamba2", **fields})


def layout(*groups: dict[str, Any] | list[dict[str, Any]], heads: int, model: str = MODEL) -> Layout:
    """One group per argument: a spec dict is a plain group, a list of spec dicts a uniform group."""
    built = []
    for index, group in enumerate(groups):
        if isinstance(group, list):
            built.append({"uniform": [{"spec": member, "layers": [f"g{index}.m{m}.l0", f"g{index}.m{m}.l1"]}
                                      for m, member in enumerate(group)]})
        else:
            built.append({"spec": group, "layers": [f"g{index}.l0", f"g{index}.l1"]})
    return Layout.model_validate(
        {"version": 1, "kind": "ModelLayout", "model": model, "total_num_kv_heads": heads, "groups": built}
    )


def policy(text: str) -> Policy:
    """A policy from inline YAML; fails the test on any error."""
    document, problems = check_text(textwrap.dedent(text), "inline.yaml")
    errors = [str(problem) for problem in problems if problem.severity == "error"]
    assert document is not None and not errors, errors
    assert isinstance(document, Policy)
    return document


def upstream_factor(group: Any, *, tp_size: int, dcp_size: int, total_num_kv_heads: int) -> int:
    """vLLM 0.32/0.33's ``_spec_tp_replication_factor`` re-written rule by rule (its five rules, numbered
    below), independently of the engine.

    ``group`` is a layout group; a class "is" X when X is its type or one of the bases the layout states.
    """
    # 1. dcp_size > 1 → 1
    if dcp_size > 1:
        return 1
    # 2. inner specs: the per-layer specs of a uniform group, else the group's one spec
    inner = [member.spec for member in group.uniform] if group.uniform is not None else [group.spec]

    def isinstance_(spec_: Any, *names: str) -> bool:
        return any(name == spec_.type or name in spec_.bases for name in names)

    # 3. any inner MambaSpec → 1 (tp_replicated ignored)
    if any(isinstance_(inner_spec, "MambaSpec") for inner_spec in inner):
        return 1
    # 4. all inner MLA or sliding-window MLA (or subclasses) → tp_size
    if all(isinstance_(inner_spec, "MLAAttentionSpec", "SlidingWindowMLASpec") for inner_spec in inner):
        return tp_size
    # 5. otherwise max(1, tp_size // total_num_kv_heads)
    return max(1, tp_size // total_num_kv_heads)


# An MLA group (replicated) and a Mamba group (sharded): the two sides of the replication audit.
HYBRID_AUDIT_LAYOUT = textwrap.dedent(
    """\
    version: 1
    kind: ModelLayout
    model: org/hybrid
    total_num_kv_heads: 1
    groups:
      - name: mla
        spec: {type: MLAAttentionSpec, bases: [FullAttentionSpec, AttentionSpec, KVCacheSpec], block_size: 16,
               page_size_bytes: 1024, fields: {max_tp_shards: 1}}
        layers: [l.0.attn]
      - name: state
        spec: {type: MambaSpec, bases: [KVCacheSpec], block_size: 16, page_size_bytes: 512, fields: {tp_replicated: false}}
        layers: [l.1.mixer]
    """
)
