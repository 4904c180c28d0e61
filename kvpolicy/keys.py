"""Store key spelling and the plan fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

FINGERPRINT_LENGTH = 12


@dataclass(frozen=True)
class KeyContext:
    """What the deployment, not the policy, puts into keys (vLLM's ``KeyMetadata`` fields)."""

    model: str
    """Model basename, as vLLM uses it (``model.rstrip('/').split('/')[-1]``)."""
    cache_prefix: str = ""
    """``kv_connector_extra_config.cache_prefix``; rendered with a trailing ``@`` when set."""
    store_namespace: str = ""
    """vLLM's opt-in store-format namespace; empty for the historical layout."""

    @classmethod
    def for_model(cls, model: str, cache_prefix: str = "", store_namespace: str = "") -> KeyContext:
        return cls(model_basename(model), cache_prefix, store_namespace)


def model_basename(model: str) -> str:
    return model.rstrip("/").split("/")[-1]


def render_prefix(
    template: str,
    context: KeyContext,
    *,
    fingerprint: str,
    group: int,
    shard: int,
    pcp_rank: int,
    dcp_rank: int,
    pp_rank: int,
) -> str:
    """The key prefix of one namespace; chunk keys are ``f"{prefix}@{chunk_hash_hex}"``."""
    return template.format(
        cache_prefix=f"{context.cache_prefix}@" if context.cache_prefix else "",
        model=context.model,
        store_namespace=context.store_namespace,
        fingerprint=fingerprint,
        group=group,
        shard=shard,
        pcp_rank=pcp_rank,
        dcp_rank=dcp_rank,
        pp_rank=pp_rank,
    )


def chunk_key(prefix: str, chunk_hash_hex: str) -> str:
    return f"{prefix}@{chunk_hash_hex}"


def fingerprint(payload: Any) -> str:
    """A short, stable digest of a JSON-able description of the effective plan."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_LENGTH]
