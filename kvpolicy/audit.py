"""The replication audit: do the ranks of a replica set really hold the same bytes?

A rule that calls a sharded group replicated is silent corruption: warm hits load another rank's
bytes. Before trusting a group with factor > 1, each rank digests the blocks it is about to save for
it; the digests of one replica set must agree. This module is the pure half — digesting bytes and
judging digests; the connector gathers them over vLLM's TP group and the harness over its simulated
ranks, and both re-plan with ``demoted=`` what disagreed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvpolicy.models import AuditMode
from kvpolicy.plan import Plan


@dataclass(frozen=True)
class Digest:
    """What one rank saw of one group in one step."""

    value: str
    all_zero: bool
    """All-zero blocks prove nothing: an uninitialised cache is identical everywhere."""


def digest_blocks(blocks: Iterable[bytes | memoryview]) -> Digest:
    """Digest the bytes of the blocks a rank is about to save, in save order."""
    hasher = hashlib.blake2b(digest_size=16)
    all_zero = True
    for block in blocks:
        hasher.update(block)
        if all_zero and any(bytes(block)):
            all_zero = False
    return Digest(hasher.hexdigest(), all_zero)


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


def audited_groups(plan: Plan) -> tuple[int, ...]:
    """Groups whose replication the audit must confirm: factor > 1, audit not off, not demoted already."""
    if plan.audit_mode is AuditMode.OFF:
        return ()
    return tuple(group.index for group in plan.groups if group.factor > 1 and not group.demoted)


def judge(plan: Plan, digests_by_rank: Sequence[Mapping[int, Digest]], groups: Iterable[int]) -> tuple[GroupAudit, ...]:
    """Compare, within each replica set, the digests every TP rank reported for ``groups``.

    ``digests_by_rank[tp_rank][group]``; a rank that saves nothing for a group omits it. A replica set
    counts as evidence only when at least one of its ranks saw non-zero bytes; then all its ranks must
    report the same digest.
    """
    audits = []
    for index in groups:
        group = plan.groups[index]
        disagreeing: list[tuple[int, ...]] = []
        evidence = False
        for replica_set in dict.fromkeys(rank.replica_set for rank in group.ranks):
            seen = [digests_by_rank[rank].get(index) for rank in replica_set]
            if all(digest is None or digest.all_zero for digest in seen):
                continue
            evidence = True
            if len({None if digest is None else digest.value for digest in seen}) > 1:
                disagreeing.append(replica_set)
        if disagreeing:
            audits.append(GroupAudit(index, Verdict.DISAGREED, tuple(disagreeing)))
        else:
            audits.append(GroupAudit(index, Verdict.AGREED if evidence else Verdict.NO_EVIDENCE))
    return tuple(audits)


def describe(plan: Plan, audit: GroupAudit) -> str:
    """One error line: the group, the rule(s) with ``file:line``, the ranks that disagree."""
    group = plan.groups[audit.group]
    rules = ", ".join(
        f"'{decision.rule}' ({decision.origin})"
        for decision in {d.rule: d for d in group.decisions if d.factor > 1}.values()
    )
    sets = "; ".join("ranks " + ",".join(map(str, ranks)) for ranks in audit.disagreeing)
    return (
        f"replication audit: group {group.index} ({group.name}) is declared replicated over {group.factor} ranks "
        f"by rule {rules or '(unknown)'}, but the bytes differ across {sets}; "
        "the rule is wrong for this model — fix it (e.g. 'replication: sharded')"
    )
