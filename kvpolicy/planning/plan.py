"""The engine's output: per group, who holds what, who writes which chunk, and which keys a lookup needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvpolicy.language.keys import KeyContext, prefix_pieces, render_prefix
from kvpolicy.language.models import AuditMode, LoadMode, Schedule, Topology
from kvpolicy.planning.store_layout import StoreSharding


class LayerDecision(NamedTuple):
    """The rule that set one layer's factor, and why each earlier rule did not apply.

    A named tuple, not a frozen dataclass: a plan holds one per layer (200,000 in the largest layouts
    accepted), and a tuple is built several times faster."""

    layer: str
    spec_type: str
    rule: str | None
    """Matching rule's name; None when no rule matched and the policy's ``unmatched`` applied."""
    origin: str
    """``file:line`` of the rule, or ``unmatched``."""
    factor: int
    passed_over: tuple[tuple[str, str], ...] = ()
    """(rule name, reason it did not match) for every earlier rule."""
    kv_heads: int | None = None
    """The layer's own KV heads where they differ from the model-wide count (the layout's
    ``layer_kv_heads``); None where the layer has the model-wide count."""


@dataclass(frozen=True)
class WriteSchedule:
    """Which absolute chunk indices one rank writes for one group."""

    kind: Schedule
    step: int
    phase: int
    active: bool
    """False when this rank writes nothing for the group (a non-leader under ``leader``)."""

    def writes(self, chunk_index: int) -> bool:
        return self.active and chunk_index % self.step == self.phase


@dataclass(frozen=True)
class RankAssignment:
    """One TP rank's view of a group."""

    tp_rank: int
    shard: int
    """Index of the run of ranks repeating this rank's heads (``tp_rank // head factor``); the key's
    ``tp_rank`` field. With the dcp rank it names the rank's replica set."""
    replica_set: tuple[int, ...]
    """TP ranks holding byte-identical bytes for this group, this rank included: consecutive ranks
    repeating the same heads, and under decode-context parallelism only those of equal dcp rank."""
    schedule: WriteSchedule
    stripe_rank: int
    """The rank vLLM's send thread stripes chunks by (``tp_rank``, or ``tp_rank // dcp_size`` under DCP
    without PCP): consecutive within a replica set, so ``(stripe_rank + group) % factor`` gives every
    member its own phase."""
    store_shards: tuple[int, ...] = ()
    """Under vLLM's TP-sharded store layout, the store shards whose heads this rank holds: it writes
    and reads one object per shard and chunk, keyed by the shard (the key's ``{shard}``). Empty for
    the rank-local layout, where the rank's one object per chunk is keyed by :attr:`shard`."""

    @property
    def key_shards(self) -> tuple[int, ...]:
        """The ``{shard}`` of every object this rank writes per chunk of the group."""
        return self.store_shards or (self.shard,)


@dataclass(frozen=True)
class GroupPlan:
    index: int
    """Position among the prefix-cacheable groups; the key's ``group`` field."""
    name: str
    spec_types: tuple[str, ...]
    uniform: bool
    decisions: tuple[LayerDecision, ...]
    factor: int
    """TP ranks that hold byte-identical bytes for this group: the size of each replica set."""
    shards: int
    """Distinct byte sets (replica sets) over TP: tp_size // factor."""
    ranks: tuple[RankAssignment, ...]
    lookup_namespaces: tuple[str, ...]
    """Key prefixes that must all hold a chunk for it to count as a hit."""
    bytes_per_token_per_rank: float
    written_bytes_per_token: float
    """Bytes written to the store per token, summed over all TP ranks."""
    undeduplicated_bytes_per_token: float
    """The same if every rank wrote its own copy (factor 1)."""
    chunk_tokens: int
    """Tokens per store chunk at the plan's topology: the specs' block size, times ``dcp_size`` for a
    DCP-sharded spec (vLLM's store coordinator resolves specs for DCP)."""
    demoted: bool = False
    """Forced to factor 1 because the replication audit found the replica set disagreeing."""

    @property
    def rules(self) -> tuple[str, ...]:
        """Distinct rules that decided this group's layers, in first-use order."""
        return tuple(dict.fromkeys(decision.rule or "(unmatched)" for decision in self.decisions))

    @property
    def origins(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(decision.origin for decision in self.decisions))

    @property
    def own_kv_heads(self) -> tuple[tuple[int, int], ...]:
        """(KV heads, layers) for the layers whose own KV-head count differs from the model-wide one,
        by count in first-use order; empty when every layer has the model-wide count."""
        counts: dict[int, int] = {}
        for decision in self.decisions:
            if decision.kv_heads is not None:
                counts[decision.kv_heads] = counts.get(decision.kv_heads, 0) + 1
        return tuple(counts.items())

    def writers(self, chunk_index: int) -> tuple[int, ...]:
        return tuple(rank.tp_rank for rank in self.ranks if rank.schedule.writes(chunk_index))


@dataclass(frozen=True)
class Plan:
    policy: str
    model: str
    topology: Topology
    schedule: Schedule
    audit_mode: AuditMode
    audit_steps: int
    key_template: str
    key_context: KeyContext
    fingerprint: str
    groups: tuple[GroupPlan, ...]
    store_sharding: StoreSharding | None = None
    """vLLM's TP-sharded store layout, when the deployment opted into it; None for rank-local objects."""
    load: LoadMode = LoadMode.PER_RANK
    """How replica sets read their chunks on a hit (the policy's ``load``)."""
    total_num_kv_heads: int = 0
    """The layout's model-wide KV heads (a layer's own count is in its :class:`LayerDecision`)."""

    @property
    def factors(self) -> tuple[int, ...]:
        return tuple(group.factor for group in self.groups)

    def key_prefix(self, group: int, tp_rank: int, pcp_rank: int = 0, pp_rank: int = 0) -> str:
        """The namespace ``tp_rank`` reads and writes for ``group`` (its first, under a TP-sharded
        store layout: see :meth:`key_prefixes`)."""
        return self.key_prefixes(group, tp_rank, pcp_rank, pp_rank)[0]

    def key_prefixes(self, group: int, tp_rank: int, pcp_rank: int = 0, pp_rank: int = 0) -> tuple[str, ...]:
        """The namespace of every object ``tp_rank`` writes per chunk of ``group``, in
        :attr:`RankAssignment.key_shards` order."""
        group_plan = self.groups[group]
        return tuple(
            self._prefix(group, shard, tp_rank, pcp_rank, pp_rank, group_plan.demoted)
            for shard in group_plan.ranks[tp_rank].key_shards
        )

    def _prefix_pieces(self, shard: int, tp_rank: int, pcp_rank: int, pp_rank: int, demoted: bool) -> list[str] | None:
        """:func:`~kvpolicy.language.keys.prefix_pieces` of one namespace: its prefix cut where the group index goes."""
        return prefix_pieces(
            self.key_template,
            self.key_context,
            fingerprint=self.fingerprint,
            shard=shard,
            pcp_rank=pcp_rank,
            dcp_rank=self.topology.dcp_rank(tp_rank, pcp_rank),
            pp_rank=pp_rank,
            demoted=demoted,
        )

    def _prefix(self, group: int, shard: int, tp_rank: int, pcp_rank: int, pp_rank: int, demoted: bool) -> str:
        return render_prefix(
            self.key_template,
            self.key_context,
            fingerprint=self.fingerprint,
            group=group,
            shard=shard,
            pcp_rank=pcp_rank,
            dcp_rank=self.topology.dcp_rank(tp_rank, pcp_rank),
            pp_rank=pp_rank,
            demoted=demoted,
        )
