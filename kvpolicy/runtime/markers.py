"""Agreement and demotion markers in the store, the lookup gate that reads them, and the agreement of
TP ranks on published demotions: the replication audit's memory across instances (pure: the store and
the collective are the :mod:`kvpolicy.runtime.ports`).

* :class:`LookupGate`: before an instance has verified a replicated group itself, a lookup may use
  the group's shared namespace only when another instance running the same plan left an
  :func:`~kvpolicy.evidence.audit.agreement_key` there. Without it, the first request of a fresh instance
  could load objects a trusting (``audit: off``) instance wrote under a wrong rule before this
  instance's audit ever ran.
* :func:`write_demotions` / :func:`read_demotions` / :func:`agree_on_demotions`: a demotion is
  published under :func:`~kvpolicy.evidence.audit.demotion_key` of the instance's initial plan, and a fresh
  instance of that plan reads those markers at start-up, agrees on them over the TP group and
  starts demoted, so it hits the fallback's objects at once instead of missing until its own audit
  demotes again. Published demotions are rank-local reads (a store error, or a marker written between
  two ranks' reads, makes them differ), so they enter the audit only through :func:`agree_on_demotions`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from kvpolicy.evidence.audit import (
    DEMOTION_MESSAGE_LIMIT,
    UNTRUSTED,
    AuditState,
    AuditStatus,
    agreement_key,
    demotion_key,
    vouching_replicas,
)
from kvpolicy.planning.plan import Plan
from kvpolicy.runtime.ports import Gather, KVStore

# Under "vllm." so records reach vLLM's own handler when it runs in vLLM (it configures that tree only).
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = [
    "LookupGate",
    "agree_on_demotions",
    "read_demotions",
    "revoke_agreements",
    "write_agreements",
    "write_demotions",
]


def write_agreements(store: KVStore, plan: Plan, groups: Iterable[int], *, pcp_rank: int = 0, pp_rank: int = 0) -> int:
    """Put :func:`agreement_key` for ``groups`` (one tiny object each); returns how many were new.

    ``put`` keeps an existing object, so several instances vouching for one plan is harmless.
    """
    written = 0
    for group in groups:
        key = agreement_key(plan, group, pcp_rank=pcp_rank, pp_rank=pp_rank)
        written += store.put(key, f"agreed {plan.fingerprint} group {group}".encode()) == 0
    return written


def revoke_agreements(store: KVStore, plan: Plan, groups: Iterable[int], *, pcp_rank: int = 0, pp_rank: int = 0) -> None:
    """Remove agreement markers this plan's groups can no longer vouch for (best effort)."""
    for group in groups:
        store.remove(agreement_key(plan, group, pcp_rank=pcp_rank, pp_rank=pp_rank), True)


class LookupGate:
    """Keeps lookups off shared namespaces no audit has verified.

    A lookup may proceed when every group with factor > 1 under an audited policy is verified for
    every (pcp, pp) namespace the lookup reads: by this instance's own audit (its own namespace)
    or by an :func:`agreement_key` another instance left. Found markers are remembered per plan
    fingerprint. The gate only reads the :class:`AuditState`; it never changes what is audited.
    """

    def __init__(self, *, pcp_rank: int = 0, pp_rank: int = 0) -> None:
        self._own = (pcp_rank, pp_rank)
        self._vouched: set[str] = set()
        self.closed_lookups = 0
        """Lookups refused so far."""

    def required(self, state: AuditState) -> list[tuple[str, ...]]:
        """What a lookup still needs under ``state``'s current plan: per (group, pcp, pp) namespace not
        yet vouched for, the agreement markers any one of which would vouch for it (replica sets of
        the group's factor or a multiple of it, :func:`~kvpolicy.evidence.audit.vouching_replicas`)."""
        plan = state.plan
        topology = plan.topology
        needed: list[tuple[str, ...]] = []
        for group, status in state.statuses.items():
            if status not in (*UNTRUSTED, AuditStatus.AGREED):
                continue  # factor 1, demoted, or a policy that trusts itself (audit: off)
            for pcp_rank in range(topology.pcp_size):
                for pp_rank in range(topology.pp_size):
                    if status is AuditStatus.AGREED and (pcp_rank, pp_rank) == self._own:
                        continue  # this instance's own audit verified it
                    candidates = tuple(
                        agreement_key(plan, group, pcp_rank=pcp_rank, pp_rank=pp_rank, replicas=replicas)
                        for replicas in vouching_replicas(plan.groups[group].factor)
                    )
                    if candidates[0] not in self._vouched:
                        needed.append(candidates)
        return needed

    def open(self, state: AuditState, store: KVStore) -> bool:
        """Whether a lookup may run now; checks the store for the markers it still needs."""
        needed = self.required(state)
        if needed:
            keys = [key for candidates in needed for key in candidates]
            present = dict(zip(keys, store.batch_is_exist(keys), strict=True))
            vouched = [candidates for candidates in needed if any(present[key] == 1 for key in candidates)]
            self._vouched.update(candidates[0] for candidates in vouched)
            if len(vouched) < len(needed):
                self.closed_lookups += 1
                return False
        return True


def write_demotions(
    store: KVStore, initial_plan: Plan, demotions: Mapping[int, str], *, pcp_rank: int = 0, pp_rank: int = 0
) -> int:
    """Put :func:`demotion_key` of ``initial_plan`` for each demoted group, its :func:`describe` line
    (cut to :data:`DEMOTION_MESSAGE_LIMIT` characters) as the value; returns how many puts succeeded.

    ``put`` keeps an existing object, so a second instance demoting the same group changes nothing.
    """
    written = 0
    for group, message in demotions.items():
        key = demotion_key(initial_plan, group, pcp_rank=pcp_rank, pp_rank=pp_rank)
        written += store.put(key, message[:DEMOTION_MESSAGE_LIMIT].encode()) == 0
    return written


def read_demotions(
    store: KVStore, initial_plan: Plan, groups: Iterable[int], *, pcp_rank: int = 0, pp_rank: int = 0
) -> dict[int, str]:
    """The demotions another instance of ``initial_plan`` published for ``groups``: group → its
    :func:`describe` line. A store error counts as nothing found (logged): the instance then audits
    the groups itself, as one that came first would."""
    wanted = list(groups)
    if not wanted:
        return {}
    keys = [demotion_key(initial_plan, group, pcp_rank=pcp_rank, pp_rank=pp_rank) for group in wanted]
    try:
        present = store.batch_is_exist(keys)
        if any(exists < 0 for exists in present):
            logger.warning(
                "kvpolicy audit: the store could not tell whether plan %s's groups %s were demoted elsewhere "
                "(codes %s); auditing them here",
                initial_plan.fingerprint,
                ",".join(str(group) for group, exists in zip(wanted, present, strict=True) if exists < 0),
                ",".join(str(exists) for exists in present if exists < 0),
            )
        found: dict[int, str] = {}
        for group, key, exists in zip(wanted, keys, present, strict=True):
            if exists != 1:
                continue
            value = store.get(key)
            # The marker's existence is the claim; its text only says why (empty: evicted since).
            message = bytes(value).decode("utf-8", "replace")[:DEMOTION_MESSAGE_LIMIT] if value else ""
            found[group] = message or f"group {group} was demoted (the marker's message could not be read)"
        return found
    except Exception:
        logger.exception(
            "kvpolicy audit: could not read the published demotions of plan %s; auditing as if there were none",
            initial_plan.fingerprint,
        )
        return {}


def agree_on_demotions(found: Mapping[int, str], *, gather: Gather) -> dict[int, str]:
    """The union of what every TP rank's :func:`read_demotions` found, identical on every rank
    (a group's message is the lowest rank's; a rank that sent nothing adds nothing). ``gather`` is
    one collective, which every TP rank must make, in the same place."""
    gathered = gather(dict(found))
    agreed: dict[int, str] = {}
    for rank_found in gathered:
        for group, message in (rank_found or {}).items():
            agreed.setdefault(int(group), str(message))
    return dict(sorted(agreed.items()))
