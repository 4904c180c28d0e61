"""What a plan means for one rank, computed once per plan, without vLLM or torch.

:class:`RankPlace` is where a rank sits in its instance's parallel groups. :class:`RankBinding` is a
plan seen from that place: the values vLLM's store worker and its transfer threads run with (factors,
lookup prefixes, the send thread's stripe rank, put steps and participation) and the lookups the
store wrappers make per key (which group a key belongs to, a group's replica set, its dedup
multiplier). A re-plan makes a new binding (:meth:`RankBinding.for_plan`); nothing is recomputed in
place. The functions below are the plan's answers to vLLM's send-thread arithmetic, checked against
vLLM's own by ``tests/connector/test_compat_equivalence.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpolicy.language.keys import split_chunk_key
from kvpolicy.language.models import LoadMode, Schedule
from kvpolicy.planning.plan import GroupPlan, Plan

__all__ = [
    "RankBinding",
    "RankPlace",
    "dedup_multiplier",
    "group_participates",
    "group_put_steps",
    "lookup_key_prefixes",
    "send_thread_rank",
]


@dataclass(frozen=True)
class RankPlace:
    """One worker's place in its instance's parallel groups (what vLLM's worker asks torch.distributed)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    dp_rank: int = 0
    """The data-parallel replica: every replica is an instance of its own."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dcp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name} rank {rank} is outside a group of size {size}")

    @property
    def is_first(self) -> bool:
        """Global rank 0 of the instance (``parallel_config.rank == 0``): it writes the status documents,
        reports plans and layouts, and counts instance-wide stats."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.pcp_rank == 0 and self.dcp_rank == 0

    @property
    def speaks(self) -> bool:
        """TP rank 0 of its (pcp, pp) stage: it logs, writes markers and records each step's stats."""
        return self.tp_rank == 0


def _send_thread_step(group: GroupPlan) -> int:
    """The put step vLLM's send thread must use for ``group``, checked against every rank.

    The send thread derives a rank's phase as ``(tp_rank + group) % step`` from its own ``tp_rank``
    attribute, which the worker sets to the plan's stripe rank (:func:`send_thread_rank`); a schedule
    whose phases follow another rule cannot be expressed, so it is refused rather than mis-striped.
    """
    steps = {rank.schedule.step for rank in group.ranks}
    if len(steps) != 1:
        raise ValueError(f"group {group.index}: ranks use different put steps {sorted(steps)}")
    (step,) = steps
    for rank in group.ranks:
        if rank.schedule.phase != (rank.stripe_rank + group.index) % step:
            raise ValueError(
                f"group {group.index}: rank {rank.tp_rank} has phase {rank.schedule.phase}, but vLLM's send "
                f"thread uses (stripe rank + group) % step = {(rank.stripe_rank + group.index) % step}"
            )
    return step


def send_thread_rank(plan: Plan, tp_rank: int) -> int:
    """What ``KVCacheStoreSendingThread.tp_rank`` must hold for ``tp_rank`` (the thread reads it only
    to compute its put phase): the plan's stripe rank, the same in every group. Under DCP it is
    ``tp_rank // dcp_size``, so the members of a strided replica set get consecutive phases."""
    stripe_ranks = {group.ranks[tp_rank].stripe_rank for group in plan.groups}
    if len(stripe_ranks) != 1:
        raise ValueError(f"tp_rank {tp_rank} has different stripe ranks {sorted(stripe_ranks)} across groups")
    (stripe_rank,) = stripe_ranks
    return stripe_rank


def group_put_steps(plan: Plan) -> tuple[int, ...]:
    """``KVCacheStoreSendingThread.group_put_steps``: the factor under ``striped``, 1 otherwise."""
    return tuple(_send_thread_step(group) for group in plan.groups)


def group_participates(plan: Plan, tp_rank: int, prefix_cacheable: Sequence[bool]) -> list[bool]:
    """``KVCacheStoreSendingThread.group_participates`` for ``tp_rank``.

    A group is written by this rank when vLLM would write it at all (prefix-cacheable) and the
    plan's schedule keeps the rank active (under ``leader`` only replica-set leaders are).
    """
    if len(prefix_cacheable) != len(plan.groups):
        raise ValueError(f"the plan has {len(plan.groups)} groups but {len(prefix_cacheable)} flags were given")
    return [
        bool(cacheable) and group.ranks[tp_rank].schedule.active
        for group, cacheable in zip(plan.groups, prefix_cacheable, strict=True)
    ]


def lookup_key_prefixes(plan: Plan) -> tuple[tuple[str, ...], ...]:
    """``MooncakeStoreWorker._lookup_key_prefixes``: per group, every namespace a hit needs."""
    return tuple(group.lookup_namespaces for group in plan.groups)


def dedup_multiplier(plan: Plan, group: int) -> int:
    """Copies a policy without dedup writes for each object this plan writes in ``group``: a replica
    set of ``factor`` ranks writes each chunk once (striped, leader), or every member does (all)."""
    return 1 if plan.schedule is Schedule.ALL else plan.groups[group].factor


@dataclass(frozen=True)
class RankBinding:
    """One plan as one rank runs it. Build it with :meth:`of`; a re-plan makes another (:meth:`for_plan`)."""

    plan: Plan
    """The plan bound."""
    place: RankPlace
    """The rank it is bound for."""
    prefix_cacheable: tuple[bool, ...]
    """Per group, whether vLLM writes it at all (its spec's ``prefix_cacheable``)."""
    group_of_prefix: Mapping[str, int]
    """Every key namespace this rank writes, with its group."""
    replica_sets: tuple[tuple[int, ...], ...]
    """Per group, the TP ranks holding this rank's bytes (itself included)."""
    lookup_key_prefixes: tuple[tuple[str, ...], ...]
    """Per group, every namespace a lookup hit needs (:func:`lookup_key_prefixes`)."""
    send_rank: int
    """The send thread's ``tp_rank`` (:func:`send_thread_rank`)."""
    put_steps: tuple[int, ...]
    """The send thread's ``group_put_steps`` (:func:`group_put_steps`)."""
    participates: tuple[bool, ...]
    """The send thread's ``group_participates`` (:func:`group_participates`)."""
    dedup_multipliers: tuple[int, ...]
    """Per group, :func:`dedup_multiplier`."""

    @classmethod
    def of(cls, plan: Plan, place: RankPlace, prefix_cacheable: Sequence[bool] | None = None) -> RankBinding:
        """``plan`` for the rank at ``place``; ``prefix_cacheable`` per group (None: every group)."""
        flags = tuple(True for _ in plan.groups) if prefix_cacheable is None else tuple(map(bool, prefix_cacheable))
        if len(flags) != len(plan.groups):
            raise RuntimeError(
                f"kvpolicy planned {len(plan.groups)} groups but the store coordinator has {len(flags)}; "
                "the layout adapter and vLLM disagree on the group selection"
            )
        tp_rank = place.tp_rank
        return cls(
            plan=plan,
            place=place,
            prefix_cacheable=flags,
            group_of_prefix={
                prefix: group.index
                for group in plan.groups
                for prefix in plan.key_prefixes(group.index, tp_rank, place.pcp_rank, place.pp_rank)
            },
            replica_sets=tuple(group.ranks[tp_rank].replica_set for group in plan.groups),
            lookup_key_prefixes=lookup_key_prefixes(plan),
            send_rank=send_thread_rank(plan, tp_rank),
            put_steps=group_put_steps(plan),
            participates=tuple(group_participates(plan, tp_rank, flags)),
            dedup_multipliers=tuple(dedup_multiplier(plan, group.index) for group in plan.groups),
        )

    def for_plan(self, plan: Plan) -> RankBinding:
        """``plan`` bound for the same rank and groups."""
        return RankBinding.of(plan, self.place, self.prefix_cacheable)

    @property
    def factors(self) -> tuple[int, ...]:
        """Per group, the replication factor (upstream's ``_group_tp_replication_factors``)."""
        return self.plan.factors

    @property
    def stripes_loads(self) -> bool:
        """``load: striped`` with a replicated group: loads may be striped over replica sets (the same
        answer on every rank: it depends on the plan alone)."""
        replicated = any(len(rank.replica_set) > 1 for group in self.plan.groups for rank in group.ranks)
        return self.plan.load is LoadMode.STRIPED and replicated

    def group_of_key(self, key: str) -> int | None:
        """The group a store key of this rank belongs to (None for a key of no namespace it writes)."""
        try:
            namespace, _ = split_chunk_key(key)
        except ValueError:
            return None
        return self.group_of_prefix.get(namespace)

    def replica_set_of(self, group: int) -> tuple[int, ...]:
        """This rank's replica set in ``group``."""
        return self.replica_sets[group]
