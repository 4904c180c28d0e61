"""Does a policy load every rank's own bytes back? One cold save, one warm load, every byte compared.

:func:`run_consistency` runs two instances of an archetype under one policy on one Mooncake store,
both of them :class:`~kvpolicy.vllm.worker.KVPolicyStoreWorker` ranks (:mod:`kvpolicy.sim.instance`):

* a *cold* instance saves a prompt: each rank's ``wait_for_save`` runs the connector's replication
  audit on the step (digests over the simulated TP collective, a demotion and its published marker,
  the agreement markers) and hands the save to vLLM's send thread with the plan's put schedule;
* a *new warm* instance (other clients, zeroed tensors) starts as a fresh engine would — reading
  the demotions the cold one published — and runs the connector's ``lookup`` on rank 0 (the lookup
  gate, then vLLM's lookup) and loads through vLLM's receive threads.

Then, on every rank and for every group, each block the load used must hold that rank's own bytes
(:mod:`kvpolicy.sim.content`), and every other block must still be zero. Writes are measured from
the master's counters and from each rank's record of its puts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvpolicy.language.keys import split_chunk_key
from kvpolicy.language.models import Audit, AuditMode, Policy
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.metrics import MasterCounters, delta, read_metrics
from kvpolicy.mooncake.pool import ClientPool
from kvpolicy.planning.plan import Plan
from kvpolicy.sim.archetypes import BLOCK_SIZE, Archetype, get_archetype
from kvpolicy.sim.fleet import Fleet
from kvpolicy.sim.instance import Instance, LoadVerdict
from kvpolicy.vllm.audit import AUDIT_STATS_OPERATION
from kvpolicy.vllm.store import chunk_bytes_per_rank

__all__ = ["ConsistencyReport", "GroupOutcome", "run_consistency"]

_ALLOCATED_BYTES = "master_allocated_bytes"


@dataclass(frozen=True)
class GroupOutcome:
    """What one cache group did under the policy, measured against the ground truth."""

    index: int
    """The group's index: its ``@group:`` number in store keys."""
    name: str
    factor: int
    """The replication factor the instances ran (after any audit demotion)."""
    true_factor: int
    """TP ranks that really hold identical bytes for the group (the archetype's ground truth)."""
    consistent: bool
    """Every rank loaded its own cold bytes into every block the load used, and nothing else."""
    mismatched_ranks: tuple[int, ...]
    """TP ranks whose loaded bytes differ from their own (or that were written outside the load)."""
    objects_written: int
    """Distinct keys of this group the cold instance put."""
    bytes_written: int
    """Bytes of those objects."""
    unique_bytes: int
    """Bytes the written chunks hold once each distinct shard is counted once:
    ``tp // true_factor`` objects per chunk."""
    blocks_checked: int = 0
    """(rank, block) pairs compared after the load; 0 when nothing was loaded."""
    audit: str = "-"
    """The replication audit's status for the group after the cold instance's audited save (a
    :class:`kvpolicy.evidence.audit.AuditStatus` value: ``agreed``, ``demoted``, ``pending`` …); ``-`` for a
    group with factor 1, ``off`` when the run did not audit."""
    audit_message: str = ""
    """For a demoted group: the error the connector's rank 0 logs (group, rule ``file:line``, ranks)."""
    declared_factor: int = 0
    """The factor the policy declared, before any demotion."""


@dataclass(frozen=True)
class ConsistencyReport:
    """One cold save and warm load of an archetype under a policy."""

    policy: str
    archetype: str
    tp_size: int
    hit_tokens: int
    """Prefix tokens the warm instance's lookup found (``MooncakeLookupResult.hit_length``)."""
    groups: tuple[GroupOutcome, ...]
    objects_written: int
    """KV objects the cold save stored, from the master's ``master_batch_put_end_items_total``."""
    bytes_written: int
    """KV bytes the cold save stored: the master's ``master_allocated_bytes`` growth, less the audit's
    marker objects (recorded puts)."""
    unique_bytes: int
    """Sum of the groups' ``unique_bytes``."""
    num_tokens: int = 0
    """Prompt length."""
    load_failed_ranks: tuple[int, ...] = ()
    """Warm ranks whose receive thread reported the load as failed."""
    put_failures: int = 0
    """Keys whose put the store refused during the cold save."""
    audited: bool = False
    """The cold instance ran the replication audit on its save (see ``run_consistency(audit=)``)."""
    warm_gated: bool = False
    """The warm instance's lookup gate refused the store: a replicated group no audit had vouched for."""
    audit_stats: dict[str, float] = field(default_factory=dict)
    """The audit's entries (``kvpolicy_audit_*``) of cold rank 0's reduced connector stats."""

    @property
    def consistent(self) -> bool:
        """Every group consistent (vacuously true for groups nothing was loaded into)."""
        return all(group.consistent for group in self.groups)

    @property
    def write_amplification(self) -> float:
        """``bytes_written / unique_bytes``: 1.0 when each distinct byte was written once, below 1.0
        when the store holds fewer shards than exist (bytes were lost); NaN when nothing was written."""
        return self.bytes_written / self.unique_bytes if self.unique_bytes else math.nan

    def group(self, name_or_index: str | int) -> GroupOutcome:
        """The outcome of the group with this name or index."""
        for outcome in self.groups:
            if name_or_index in (outcome.name, outcome.index):
                return outcome
        raise KeyError(name_or_index)


def audited_policy(policy: Policy, audit: bool | None) -> Policy:
    """``policy`` as the run uses it: ``None`` follows its ``audit``; ``True`` audits even under
    ``off`` (with ``warn``'s fallback, at least one step); ``False`` never audits. The audit settings
    are outside the plan fingerprint, so the keys do not change."""
    if audit is None:
        return policy
    if audit is False:
        return policy.model_copy(update={"audit": Audit(mode=AuditMode.OFF, steps=policy.audit.steps)})
    if policy.audit.mode is AuditMode.OFF or policy.audit.steps == 0:
        return policy.model_copy(update={"audit": Audit(mode=AuditMode.WARN, steps=max(1, policy.audit.steps))})
    return policy


def run_consistency(
    policy: Policy,
    archetype: str | Archetype,
    tp_size: int,
    *,
    master: MooncakeMaster,
    num_tokens: int = 256,
    seed: int = 0,
    clients: ClientPool | None = None,
    save: bool = True,
    audit: bool | None = None,
    dcp_size: int = 1,
    extra_config: Mapping[str, object] = MappingProxyType({}),
    kv_cache_layout: str | None = None,
) -> ConsistencyReport:
    """Save a ``num_tokens`` prompt from a cold ``tp_size``-rank instance of ``archetype`` under
    ``policy``, load it into a new warm instance, and compare every rank's bytes.

    ``clients`` lends the store clients (:class:`~kvpolicy.mooncake.pool.ClientPool`); without it the
    run opens ``2 * tp_size`` fresh clients and closes them at the end (1–2 s each). ``save=False``
    skips the cold save, so the warm lookup meets a store without this prompt. ``audit``: see
    :func:`audited_policy`; ``enforce`` raises :class:`kvpolicy.evidence.audit.ReplicationAuditError` from the
    cold save, as it stops an engine. ``dcp_size`` > 1 runs decode-context parallelism;
    ``extra_config`` (e.g. ``store_tp_size``) and ``kv_cache_layout`` configure both instances
    (:meth:`kvpolicy.sim.Fleet.instance`).
    """
    shape = get_archetype(archetype)
    if tp_size < 1:
        raise ValueError(f"tp_size must be positive, got {tp_size}")
    if num_tokens < BLOCK_SIZE:
        raise ValueError(f"num_tokens must be at least one block ({BLOCK_SIZE}), got {num_tokens}")
    effective = audited_policy(policy, audit)
    pool = ClientPool(master) if clients is None else clients
    try:
        with Fleet(shape, master=master, clients=pool, num_tokens=num_tokens, seed=seed, name="kvpolicy-consistency") as fleet:
            options: dict[str, Any] = {
                "dcp_size": dcp_size, "extra_config": extra_config, "kv_cache_layout": kv_cache_layout
            }
            cold = fleet.instance(effective, tp_size, name="cold", **options)
            before, allocated_before = _counters(master)
            marker_bytes = 0
            put_failures = 0
            if save:
                saved = cold.save()
                marker_bytes = sum(put.size for put in saved.marker_puts if put.ok)
                put_failures = saved.put_failures
            after, allocated_after = _counters(master)
            warm = fleet.instance(effective, tp_size, name="warm", **options)
            lookup = warm.lookup()
            warm.load(lookup)
            verdict = warm.verdict(lookup)
            groups = _group_outcomes(cold, verdict)
            return ConsistencyReport(
                policy=policy.name,
                archetype=shape.name,
                tp_size=tp_size,
                hit_tokens=lookup.hit_length,
                groups=groups,
                objects_written=delta(before, after).objects_written,
                bytes_written=allocated_after - allocated_before - marker_bytes,
                unique_bytes=sum(group.unique_bytes for group in groups),
                num_tokens=num_tokens,
                load_failed_ranks=tuple(
                    sorted(set(verdict.failed_ranks) | {rank for rank, ids in verdict.invalid_block_ids if ids})
                ),
                put_failures=put_failures,
                audited=save and effective.audit.mode is not AuditMode.OFF and effective.audit.steps > 0,
                warm_gated=warm.last_lookup_gated,
                audit_stats={
                    name: value
                    for name, value in cold.ranks[0].worker.kv_connector_stats.reduce().items()
                    if name.startswith(AUDIT_STATS_OPERATION)
                },
            )
    finally:
        if clients is None:
            pool.close()


def _counters(master: MooncakeMaster) -> tuple[MasterCounters, int]:
    metrics = read_metrics(master.metrics_url)
    return MasterCounters.from_metrics(metrics), int(metrics.get(_ALLOCATED_BYTES, 0))


def _writes_by_group(plan: Plan, cold: Instance) -> list[dict[str, int]]:
    """Per group: each distinct key some cold rank put successfully → its bytes."""
    group_of = {namespace: group.index for group in plan.groups for namespace in group.lookup_namespaces}
    writes: list[dict[str, int]] = [{} for _ in plan.groups]
    for rank in cold.ranks:
        for put in rank.store.puts:
            if put.batched and put.ok:
                namespace, _ = split_chunk_key(put.key)
                writes[group_of[namespace]][put.key] = put.size
    return writes


def _group_outcomes(cold: Instance, verdict: LoadVerdict) -> tuple[GroupOutcome, ...]:
    state = cold.audit
    assert state is not None
    plan = cold.plan
    writes = _writes_by_group(plan, cold)
    messages = {
        group: message
        for step in state.history
        for group, message in zip(step.demoted, step.messages, strict=True)
    }
    outcomes = []
    for group in plan.groups:
        index = group.index
        true_factor = cold.model.true_factors[index]
        mismatched = verdict.mismatched_ranks(index)
        chunks = {split_chunk_key(key)[1] for key in writes[index]}
        status = state.statuses[index]
        outcomes.append(
            GroupOutcome(
                index=index,
                name=group.name,
                factor=group.factor,
                true_factor=true_factor,
                consistent=not mismatched,
                mismatched_ranks=mismatched,
                objects_written=len(writes[index]),
                bytes_written=sum(writes[index].values()),
                unique_bytes=(cold.tp_size // true_factor) * len(chunks) * chunk_bytes_per_rank(cold.ranks[0].worker.token_dbs[index]),
                blocks_checked=verdict.checked_by_group[index],
                audit=status.value,
                audit_message=messages.get(index, ""),
                declared_factor=state.initial_plan.groups[index].factor,
            )
        )
    return tuple(outcomes)
