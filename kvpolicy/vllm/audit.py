"""The vLLM half of the replication audit: which blocks a step saves, what number type their values
are, and one rank's part in an audited step's collectives.

What an audited step concludes and what follows from it (re-plan, markers, the lookup gate, status
documents) is :class:`kvpolicy.runtime.policy.RankPolicy`, without vLLM; the digests, verdicts and
:class:`~kvpolicy.evidence.audit.AuditState` are :mod:`kvpolicy.evidence.audit`; reading blocks out of the KV tensors is
:mod:`kvpolicy.device.blocks`. Here, what needs vLLM's objects:

* :func:`blocks_to_audit` picks, from the connector metadata alone, the blocks of each audited group
  that this step saves. The metadata is broadcast by the scheduler and identical on every TP rank,
  so every rank picks the same block ids, and every rank decides the same way whether this step
  is audited at all — the decision that must never differ between ranks (see "Deadlocks" below).
* :func:`value_comparisons` says, per group, what number type the values are
  (:class:`~kvpolicy.evidence.audit.ValueComparison`): vLLM allocates fp8 KV caches (``fp8``, ``fp8_e4m3``,
  ``fp8_e5m2``) as ``uint8`` tensors, so the tensor's dtype is not the values' type. vLLM's own
  answer (:func:`fp8_element_type`) names the fp8 type, and the values are compared in it, within one
  unit in the last place (:func:`kvpolicy.evidence.audit.rounding_tolerance`). Caches that keep scales inside
  their blocks, or hold any other codes, are compared by exact digests only.
* :func:`step_collectors` is one rank's part in the step's collectives (:func:`gather_over_tp`:
  ``all_gather_object`` over the TP group's gloo group): first every rank's digests, then, where a
  replica set's digests differ, an evenly strided sample of each rank's values
  (:data:`~kvpolicy.device.blocks.SAMPLE_VALUES`), compared with
  :data:`kvpolicy.evidence.audit.REPLICA_TOLERANCE` (vLLM's CPU all-reduce at TP=4 sums in a rank-dependent
  order, so replicas may differ in the last bits).
* :func:`record_stats` records an audited step in vLLM's connector stats.

**The cap.** At most :data:`AUDIT_REQUESTS_PER_STEP` saving requests per step (in metadata order)
and the last :data:`AUDIT_BLOCKS_PER_REQUEST` blocks each request saves for a group are digested:
at most 8 blocks per group per audited step, whatever the prompt length, and audited steps stop
after the policy's ``audit.steps``. The last blocks are the ones this step computed.

**Deadlocks.** Every TP rank must make the same collective calls in the same steps. Whether a
step is audited depends only on (a) the connector metadata, identical on all ranks, and (b) the
:class:`~kvpolicy.evidence.audit.AuditState`, which changes only from the gathered digests of *all* ranks,
so it is identical on all ranks too. Nothing rank-local feeds the decision: not the put schedule,
not whether a digest succeeded (a rank that fails to digest still joins the collective and reports
``None``; then nobody judges that step), not the lookup gate, not the rank (rank 0 alone logs, writes
markers and records stats — after the collective). The second gather happens or not by a decision
taken from the first gather's result, which every rank holds identically, and from
:func:`value_comparisons`, a function of the cache configuration every rank shares. Published
demotions enter the audit state only through :func:`kvpolicy.runtime.markers.agree_on_demotions`, one
gather at start-up that every rank makes whenever the plan has a group to audit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeStoreConnectorMetadata,
    ReqMeta,
)
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec, KVQuantMode, UniformTypeKVCacheSpecs

from kvpolicy.device.blocks import BlockReader, local_digests, local_layer_digests, local_samples
from kvpolicy.evidence.audit import DEFAULT_COMPARISON, ValueComparison, value_comparison
from kvpolicy.runtime.audit_step import Report, Samples, encode_report
from kvpolicy.runtime.discovery import RankDiscovery
from kvpolicy.runtime.ports import Gather
from kvpolicy.vllm import internals
from kvpolicy.vllm.internals import StoreWorker

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator

# Under "vllm." so records reach vLLM's own handler (it configures only the "vllm" logger tree).
logger = init_logger(f"vllm.{__name__}")

__all__ = [
    "AUDIT_BLOCKS_PER_REQUEST",
    "AUDIT_DEMOTED_OPERATION",
    "AUDIT_REQUESTS_PER_STEP",
    "AUDIT_STATS_OPERATION",
    "KVCacheReader",
    "blocks_to_audit",
    "discovery_step",
    "fp8_element_type",
    "gather_over_tp",
    "record_stats",
    "step_collectors",
    "value_comparisons",
]

AUDIT_REQUESTS_PER_STEP = 4
"""Saving requests per step whose blocks are digested (the first ones in the metadata)."""
AUDIT_BLOCKS_PER_REQUEST = 2
"""Blocks per request and group digested: the last ones the request saves this step."""

AUDIT_STATS_OPERATION = "kvpolicy_audit"
"""Connector-stats operation recorded (by TP rank 0) once per audited step, in the same
``MooncakeStoreConnectorStats`` as the store's own operations: ``num_keys`` = blocks digested per
rank, ``num_bytes`` = bytes digested per rank, ``num_failed_keys`` = groups demoted, status ``ok``
or ``mismatch``. vLLM reduces it to ``kvpolicy_audit_count`` (audited steps), ``…_avg_ms`` and
``…_p90_ms`` (cost per step) and ``…_failed_keys``; Prometheus gets it as one more ``operation``."""
AUDIT_DEMOTED_OPERATION = "kvpolicy_audit_demoted"
"""Recorded once per demoted group: ``kvpolicy_audit_demoted_count`` counts the demoted groups."""

# --- which blocks ----------------------------------------------------------------------------------


def blocks_to_audit(
    metadata: MooncakeStoreConnectorMetadata,
    coord: MooncakeStoreCoordinator,
    groups: Iterable[int],
    *,
    max_requests: int = AUDIT_REQUESTS_PER_STEP,
    per_request: int = AUDIT_BLOCKS_PER_REQUEST,
) -> dict[int, list[int]]:
    """Per audited group, the block ids this step saves whose bytes the replica sets compare.

    A pure function of the metadata and the store coordinator (both identical on every TP rank).
    Mirrors what the send thread saves: the positional chunks from the request's previous save
    point to its block-aligned length, under the coordinator's store mask, skipping null blocks;
    and the boundary puts (Mamba states, partial tails), which are blocks handed over by id.
    Groups with nothing to save this step are absent; an empty result means "not an audited step".
    """
    wanted = tuple(groups)
    if not wanted:
        return {}
    selected: dict[int, list[int]] = {}
    requests = 0
    for request in metadata.requests:
        if requests >= max_requests:
            break
        if not request.can_save or not request.block_hashes:
            continue
        per_group = _request_blocks(request, coord, wanted)
        if not any(per_group.values()):
            continue
        requests += 1
        for group, block_ids in per_group.items():
            if block_ids:
                selected.setdefault(group, []).extend(block_ids[-per_request:])
    return selected


def _request_blocks(request: ReqMeta, coord: MooncakeStoreCoordinator, groups: tuple[int, ...]) -> dict[int, list[int]]:
    lcm_block_size = coord.lcm_block_size
    token_len = request.token_len_chunk // lcm_block_size * lcm_block_size
    start = request.token_ids_start
    hash_block_size = coord.hash_block_size
    num_hashes = len(request.block_hashes)
    masks = coord.store_mask(token_len, start, num_prompt_tokens=request.prefill_end_tokens) if token_len else None
    found: dict[int, list[int]] = {group: [] for group in groups}
    for group in groups:
        if token_len == 0 or masks is None:
            break
        block_size = coord.kv_cache_groups[group].kv_cache_spec.block_size
        table = request.block_ids[group]
        mask = masks[group]
        first = cdiv(start, block_size)
        last = cdiv(token_len, block_size)
        if mask is not None:
            last = min(last, first + len(mask))
        for chunk in range(first, last):
            if mask is not None and not mask[chunk - first]:
                continue
            end = min((chunk + 1) * block_size, token_len)
            if end // hash_block_size > num_hashes or chunk >= len(table) or table[chunk] == NULL_BLOCK_ID:
                continue
            found[group].append(table[chunk])
    for group, block_id, num_tokens in request.boundary_puts or ():
        if group not in found or block_id == NULL_BLOCK_ID or num_tokens <= 0:
            continue
        if num_tokens // hash_block_size > num_hashes:
            continue
        found[group].append(block_id)
    return found


# --- what the values are -------------------------------------------------------------------------


def fp8_element_type(spec: KVCacheSpec, cache_dtype: str) -> torch.dtype | None:
    """The fp8 type vLLM reads a layer's ``uint8`` KV cache as, or None (not a plain fp8 cache).

    vLLM's own function, ``_get_fp8_dtype`` of its decode-bench connector
    (:func:`kvpolicy.vllm.internals.fp8_dtype`): the one place in vLLM 0.32 and 0.33 that answers this
    from a layer's spec and the cache dtype setting, as the attention backends do — ``fp8``/``fp8_e4m3``
    → ``current_platform.fp8_dtype()`` (``float8_e4m3fn``; ``float8_e4m3fnuz`` on ROCm GPUs that use
    it), ``fp8_e5m2`` → ``float8_e5m2``, and None for layouts with scales or other metadata in the
    block (``fp8_ds_mla``, per-token-head formats). ``tests/connector/test_audit_cache_dtypes.py`` pins its
    answers under both releases; should a release drop it, every ``uint8`` cache is compared by exact
    digests.
    """
    return internals.fp8_dtype(spec, cache_dtype)


def _layer_comparison(spec: KVCacheSpec, cache_dtype: str) -> ValueComparison:
    if not isinstance(spec, AttentionSpec):
        return DEFAULT_COMPARISON  # Mamba state: the cache dtype setting does not govern it
    element = fp8_element_type(spec, cache_dtype)
    return value_comparison(
        getattr(spec, "cache_dtype_str", None) or cache_dtype,
        stored=str(spec.dtype).removeprefix("torch."),
        element=None if element is None else str(element).removeprefix("torch."),
        scales_in_block=spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR)
        or spec.state_content_bytes is not None,
    )


def value_comparisons(cache_dtype: str, specs: Sequence[KVCacheSpec]) -> dict[int, ValueComparison]:
    """Per group (the index into ``specs``, the groups' ``kv_cache_spec`` in plan order): how the
    audit compares its values when digests differ, under vLLM's cache dtype setting
    ``cache_dtype`` (``cache_config.cache_dtype``). The same on every rank: it depends on the
    configuration alone, so it may decide which groups the second gather carries."""
    comparisons: dict[int, ValueComparison] = {}
    for index, spec in enumerate(specs):
        layers = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else (spec,)
        found = list(dict.fromkeys(_layer_comparison(layer, cache_dtype) for layer in layers))
        if len(found) == 1:
            comparisons[index] = found[0]
        else:
            elements = ", ".join(comparison.element or "codes" for comparison in found)
            comparisons[index] = ValueComparison(
                cache_dtype, exact=True, reason=f"the group's layers hold values of several types ({elements})"
            )
    return comparisons


# --- reading them ----------------------------------------------------------------------------------


def gather_over_tp(payload: Any) -> list[Any]:
    """Every TP rank's payload, indexed by TP rank: one ``all_gather_object`` over the TP group's
    CPU (gloo) group. Every rank of the group must call it, in the same step."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, payload, group=group.cpu_group)
    return gathered


def step_collectors(
    worker: StoreWorker,
    blocks: Mapping[int, Sequence[int]],
    *,
    comparisons: Mapping[int, ValueComparison],
    gather: Gather,
    reader: BlockReader | None,
    timings: dict[str, float],
) -> tuple[Callable[[], list[Report]], Callable[[tuple[int, ...]], list[Samples]]]:
    """How one rank of ``worker`` takes part in an audited step's collectives: its digests of
    ``blocks`` (``reader`` reads its registered KV tensors), then, if asked, its samples. A rank that
    cannot digest or sample still joins the collective with None: a rank that skipped it would hang
    every other rank. ``timings`` receives ``digest``, ``gather`` and ``values`` in seconds."""
    started = time.perf_counter()

    def collect_reports() -> list[Report]:
        report: Report = None
        try:
            if reader is None:
                raise RuntimeError("no KV caches registered")
            report = encode_report(local_digests(worker.token_dbs, reader, blocks))
        except Exception:
            logger.exception("kvpolicy audit: tp rank %d could not digest its blocks", worker.tp_rank)
        timings["digest"] = time.perf_counter() - started
        gathered = list(gather(report))
        timings["gather"] = time.perf_counter() - started - timings["digest"]
        return gathered

    def collect_samples(groups: tuple[int, ...]) -> list[Samples]:
        began = time.perf_counter()
        samples: Samples = None
        try:
            assert reader is not None
            layer_names = {group: internals.kv_cache_groups(worker)[group].layer_names for group in groups}
            samples = local_samples(worker.token_dbs, reader, blocks, layer_names, groups, comparisons=comparisons)
        except Exception:
            logger.exception("kvpolicy audit: tp rank %d could not sample its blocks", worker.tp_rank)
        gathered = list(gather(samples))
        timings["values"] = time.perf_counter() - began
        return gathered

    return collect_reports, collect_samples


def record_stats(worker: StoreWorker, blocks: Mapping[int, Sequence[int]], seconds: float, *, demoted: int) -> None:
    """Record one audited step (and its demoted groups) in the worker's connector stats."""
    num_bytes = sum(
        sum(worker.token_dbs[group].prepare_value_for_block(block_id)[1])
        for group, block_ids in blocks.items()
        for block_id in block_ids
    )
    internals.record_operation(
        worker,
        AUDIT_STATS_OPERATION,
        seconds,
        sum(len(block_ids) for block_ids in blocks.values()),
        num_bytes=num_bytes,
        status="mismatch" if demoted else "ok",
        num_failed_keys=demoted,
    )
    for _ in range(demoted):
        internals.record_operation(worker, AUDIT_DEMOTED_OPERATION, 0.0, 1)


# --- the KV tensors, read on first use ------------------------------------------------------------


class KVCacheReader:
    """The block reader of a rank's registered KV tensors, built when the audit or discovery first reads:
    an engine running neither never scans them, whatever devices they lie on."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], tp_rank: int) -> None:
        self._kv_caches = dict(kv_caches)
        self._tp_rank = tp_rank
        self._reader: BlockReader | None = None

    def get(self) -> BlockReader | None:
        """The reader; None where the tensors cannot be read (logged once; the audit then joins its
        collectives empty)."""
        if self._reader is None and self._kv_caches:
            try:
                self._reader = BlockReader(self._kv_caches)
            except Exception:
                logger.exception("kvpolicy: tp rank %d cannot read its KV caches for the audit or discovery", self._tp_rank)
                self._kv_caches = {}
        return self._reader


def discovery_step(
    worker: StoreWorker, discovery: RankDiscovery, metadata: MooncakeStoreConnectorMetadata, kv: KVCacheReader | None
) -> None:
    """Under ``kvpolicy_discover``, one observed step if this step saves blocks: every rank decides
    alike from the metadata and the count of steps observed (:mod:`kvpolicy.runtime.discovery`)."""
    if not discovery.observing:
        return
    groups = internals.kv_cache_groups(worker)
    blocks = blocks_to_audit(metadata, worker.coord, range(len(groups)))
    if not blocks:
        return
    reader = None if kv is None else kv.get()

    def collect() -> dict[int, dict[str, list[tuple[str, bool]]]]:
        if reader is None:
            raise RuntimeError("no KV caches registered")
        return local_layer_digests(worker.token_dbs, reader, blocks, {group: groups[group].layer_names for group in blocks})

    discovery.observe_step(collect)
