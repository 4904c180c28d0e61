"""Simulated vLLM instances that run the production connector on one machine.

Every rank is a :class:`~kvpolicy.vllm.worker.KVPolicyStoreWorker` built without vLLM's distributed
runtime (:meth:`~kvpolicy.vllm.worker.KVPolicyStoreWorker.standalone`), with vLLM's own KV-cache
config, CPU KV tensors, send and receive threads, and a real Mooncake client on 127.0.0.1. What
the simulation adds is only what an engine would: the scheduler's metadata, the bytes a forward
pass writes, the TP collective between ranks, and a check of what was loaded.

One concept per module:

* :mod:`~kvpolicy.sim.archetypes` — model shapes as vLLM spec objects (layers may have KV heads of
  their own), and :func:`physical_factor`, the ground truth of which ranks hold identical bytes;
* :mod:`~kvpolicy.sim.model` — an archetype at one TP size as vLLM's ``KVCacheConfig``;
* :mod:`~kvpolicy.sim.scheduler` — block hashes, block tables, Mamba boundary states, save/load metadata;
* :mod:`~kvpolicy.sim.content` — the bytes each rank holds for a chunk;
* :mod:`~kvpolicy.sim.store` — the store client with a record of its puts;
* :mod:`~kvpolicy.sim.collective` — the TP collective among rank threads;
* :mod:`~kvpolicy.sim.rank`, :mod:`~kvpolicy.sim.instance`, :mod:`~kvpolicy.sim.fleet` — a rank, an
  instance of ranks, instances sharing a store (and :func:`run_mixed`);
* :mod:`~kvpolicy.sim.consistency` — :func:`run_consistency`: one cold save, one warm load, judged.

Importing this package imports vLLM, torch and Mooncake.
"""

from kvpolicy.sim.archetypes import (
    ARCHETYPES,
    BLOCK_SIZE,
    HYBRIDS,
    LAYER_HEADS_ARCHETYPES,
    Archetype,
    archetype_from_layout,
    get_archetype,
    physical_factor,
)
from kvpolicy.sim.collective import CollectiveTimeout, ThreadGather
from kvpolicy.sim.consistency import ConsistencyReport, GroupOutcome, audited_policy, run_consistency
from kvpolicy.sim.fleet import Fleet, MixedReport, run_mixed
from kvpolicy.sim.instance import Instance, LoadVerdict, RankLoad, SaveOutcome, SaveRequest, WrongBlock
from kvpolicy.sim.model import SimulatedModel, build_model
from kvpolicy.sim.rank import Rank
from kvpolicy.sim.scheduler import Prompt
from kvpolicy.sim.store import Put, RecordingStore

__all__ = [
    "ARCHETYPES",
    "BLOCK_SIZE",
    "HYBRIDS",
    "LAYER_HEADS_ARCHETYPES",
    "Archetype",
    "CollectiveTimeout",
    "ConsistencyReport",
    "Fleet",
    "GroupOutcome",
    "Instance",
    "LoadVerdict",
    "MixedReport",
    "Prompt",
    "Put",
    "Rank",
    "RankLoad",
    "RecordingStore",
    "SaveOutcome",
    "SaveRequest",
    "SimulatedModel",
    "ThreadGather",
    "WrongBlock",
    "archetype_from_layout",
    "audited_policy",
    "build_model",
    "get_archetype",
    "physical_factor",
    "run_consistency",
    "run_mixed",
]
