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


def chunk_key(namespace: str, chunk_hash_hex: str) -> str:
    """The store key of one chunk: its namespace's prefix and the chunk hash, as vLLM spells it."""
    return f"{namespace}@{chunk_hash_hex}"


def split_chunk_key(key: str) -> tuple[str, str]:
    """(namespace, chunk hash) of a :func:`chunk_key`; the namespace may itself contain ``@``."""
    namespace, separator, chunk_hash_hex = key.rpartition("@")
    if not separator:
        raise ValueError(f"{key!r} is not a chunk key (no '@')")
    return namespace, chunk_hash_hex


AGREEMENT_MARKER = "kvpolicy-audit-agreed"
DEMOTION_MARKER = "kvpolicy-audit-demoted"


def marker_key(namespace: str, marker: str, fingerprint: str, *, replicas: int | None = None) -> str:
    """An audit marker in ``namespace``: ``marker`` (:data:`AGREEMENT_MARKER` or
    :data:`DEMOTION_MARKER`) about the plan with ``fingerprint``, and for an agreement the size of the
    replica sets it verified. It sits beside the namespace's chunk keys but never collides with one:
    a chunk hash is hex, a marker name is not."""
    return f"{namespace}@{marker}@{fingerprint}" + (f"@x{replicas}" if replicas is not None else "")


def fingerprint(payload: Any) -> str:
    """A short, stable digest of a JSON-able description of the effective plan."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_LENGTH]
