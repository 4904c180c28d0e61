"""Tiny copies of vLLM's own architectures, built from a model's configuration alone.

A tiny copy keeps every field that decides what the TP ranks hold (KV heads model-wide and per layer,
head sizes, the order of layer types, sliding windows and chunked-local attention, KV-sharing targets,
MLA ranks, recurrent-state heads and groups, dense vs MoE placement) and shrinks what does not (width,
depth to whole layer-pattern periods with every per-layer list cut alike, vocabulary, experts):

- :mod:`~kvpolicy.harness.zoo.shrink`: the source (a ``config.json``, a directory holding one, a
  transformers model type or a vLLM architecture name) to a shrunk configuration and the record of
  what was kept and what shrunk, and why (:class:`~kvpolicy.harness.zoo.shrink.TinyCopy`);
- :mod:`~kvpolicy.harness.zoo.weights`: seeded weights saved as a checkpoint, so that each TP rank
  loads its own shard of one full tensor (vLLM's dummy loader draws every rank's shard alike);
- :mod:`~kvpolicy.harness.zoo.observe`: the copy served through ``KVPolicyConnector`` with discovery
  on, at each TP size, and optionally a warm engine against the cold one.

Tooling beside the simulation: it imports transformers (and, in the engine's child, vLLM); nothing in
the product imports it.
"""

from kvpolicy.harness.zoo.shrink import (
    FieldChange,
    SourceError,
    TinyCopy,
    load_source,
    shrink,
    tp_refusal,
)

__all__ = ["FieldChange", "SourceError", "TinyCopy", "load_source", "shrink", "tp_refusal"]
