"""policy × layout × topology → :class:`~kvpolicy.planning.plan.Plan`.

Every layer spec gets a factor from the first rule that matches it; a group's factor is the gcd of
its layers' factors (the largest replica set over which every layer is identical). From the factor
follow, with the topology (decode-context parallelism keeps only ranks of equal dcp rank together),
the replica set and shard of each rank, the chunks it writes and the namespaces a lookup must find.
The engine refuses a plan it cannot prove consistent: a factor that is not a divisor of tp_size,
replica sets of unequal sizes, an expression that fails, a topology vLLM itself refuses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from kvpolicy.language.catalog import is_subclass
from kvpolicy.language.diagnostics import PlanError, PlanProblem
from kvpolicy.language.expressions import Expression, ExpressionError, Value
from kvpolicy.language.keys import KeyContext, fingerprint, template_fields
from kvpolicy.language.matcher import RuleMatch, layers_matching, layers_reason, match_spec, match_when, spec_variables
from kvpolicy.language.models import (
    Audit,
    FieldExpression,
    Group,
    KeyFormat,
    LayerHeads,
    LayerSpecs,
    Layout,
    Match,
    Member,
    Policy,
    Replication,
    Rule,
    Schedule,
    Spec,
    SpecExpressionError,
    SpecValues,
    Topology,
    thawed,
    topology_variables,
)
from kvpolicy.planning.plan import GroupPlan, LayerDecision, Plan, RankAssignment, WriteSchedule
from kvpolicy.planning.store_layout import StoreSelection, StoreSharding, select_store_layout


class GroupDecision(NamedTuple):
    """What the rules decided for one group, before ranks, write schedules and keys follow from it
    (a named tuple: a plan makes one per group, and a tuple is built several times faster)."""

    layer_decisions: tuple[LayerDecision, ...]
    """One decision per layer, in the group's layer order."""
    head_factor: int
    """Consecutive TP ranks that repeat the group's heads: the gcd of its layers' factors, or 1 when
    the group is demoted."""
    factor: int
    """Ranks per replica set: ``head_factor`` within one DCP token shard (``head_factor // dcp_size``,
    or 1 when the run is shorter than ``dcp_size``)."""
    bytes_per_token_per_rank: float
    """KV bytes one token occupies on one TP rank, summed over the group's layers."""
    signature: tuple[dict[str, object], ...]
    """Each member spec as the plan fingerprint covers it (JSON-able)."""
    chunk_tokens: int
    """Tokens per store chunk at the topology: the specs' block size, times ``dcp_size`` for a
    DCP-sharded spec (vLLM's store coordinator resolves specs for DCP first)."""


class PlanCacheInfo(NamedTuple):
    hits: int
    misses: int
    plans: int
    """Plans held now."""
    layers: int
    """Layer decisions those plans hold."""


class PlanCache:
    """The plans :func:`make_plan` made, by the identity of their policy and layout and the values of
    the topology, key context, demoted groups and store sharding; least recently used first out.

    By identity, not ``==``: documents compare like their values, and pydantic's ``==`` takes a
    field's ``true`` for ``1``, ``1.0`` for ``1`` and a mapping's order for none, which change a plan
    (its fingerprint, a rule's reasons); and comparing two layouts costs as much as planning one. An
    entry holds its policy and layout, so their ids name them while it lives. Documents and plans are
    immutable, so a plan stays right for as long as its documents live.

    Bounded by entries and by the layer decisions they hold (a plan of the largest layout has
    200,000), so a long-lived process keeps at most a few plans of big layouts."""

    def __init__(self, max_plans: int = 32, max_layers: int = 400_000) -> None:
        self.max_plans, self.max_layers = max_plans, max_layers
        self._entries: OrderedDict[Hashable, tuple[Policy, Layout, Plan, int]] = OrderedDict()
        self._layers = 0
        self._hits = self._misses = 0
        self._lock = threading.Lock()

    def plan(
        self,
        policy: Policy,
        layout: Layout,
        topology: Topology,
        context: KeyContext,
        demoted: frozenset[int],
        store_sharding: StoreSharding | None,
    ) -> Plan:
        key = (
            id(policy),
            id(layout),
            # Exact types, so that a topology or sharding built with True for 1 does not share a plan.
            _typed(topology.tp_size, topology.pp_size, topology.pcp_size, topology.dcp_size),
            _typed(context.model, context.cache_prefix, context.store_namespace),
            demoted,  # only ever asked `index in demoted`
            None if store_sharding is None else _typed(store_sharding.store_tp_size, store_sharding.store_format),
        )
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is policy and entry[1] is layout:
                self._entries.move_to_end(key)
                self._hits += 1
                return entry[2]
            self._misses += 1
        plan = _plan(policy, layout, topology, context, demoted, store_sharding)
        layers = sum(len(group.decisions) for group in plan.groups)
        with self._lock:
            if key not in self._entries and layers <= self.max_layers:
                self._entries[key] = (policy, layout, plan, layers)
                self._layers += layers
                while len(self._entries) > self.max_plans or self._layers > self.max_layers:
                    *_, dropped = self._entries.popitem(last=False)[1]
                    self._layers -= dropped
        return plan

    def info(self) -> PlanCacheInfo:
        with self._lock:
            return PlanCacheInfo(self._hits, self._misses, len(self._entries), self._layers)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._layers = self._hits = self._misses = 0


def _typed(*values: object) -> tuple[tuple[type, object], ...]:
    return tuple((type(value), value) for value in values)


PLANS = PlanCache()
"""The cache :func:`make_plan` uses."""


def make_plan(
    policy: Policy,
    layout: Layout,
    topology: Topology,
    *,
    key_context: KeyContext | None = None,
    demoted: Iterable[int] = (),
    store_sharding: StoreSharding | None = None,
) -> Plan:
    """Plan every group of ``layout``; ``demoted`` groups are forced to factor 1 (audit fallback).
    ``store_sharding``: the deployment runs vLLM's TP-sharded store layout
    (:func:`kvpolicy.planning.store_layout.select_store_layout`).

    Plans are cached (:class:`PlanCache`): asked again with the same ``policy`` and ``layout``
    objects and equal other arguments (the audit's replan after a demotion, a worker planning twice),
    this returns the plan it made before. A plan is immutable all the way down (frozen dataclasses,
    tuples, named tuples, frozen models), so every caller may share it."""
    context = key_context or KeyContext.for_model(layout.model)
    return PLANS.plan(policy, layout, topology, context, frozenset(demoted), store_sharding)


def _plan(
    policy: Policy,
    layout: Layout,
    topology: Topology,
    context: KeyContext,
    demoted: frozenset[int],
    store_sharding: StoreSharding | None,
) -> Plan:
    """:func:`make_plan` without its cache."""
    _check_bounded(policy, layout, topology, store_sharding)
    _check_vllm_accepts(layout, topology)
    if store_sharding is not None:
        _check_store_sharding(layout, topology, store_sharding)
        _check_sharded_keys(policy)
    # A layer of its own KV-head count reads that as total_num_kv_heads instead (_SpecCache).
    variables: dict[str, Value] = dict(topology_variables(topology, layout.total_num_kv_heads))
    specs = _SpecCache(policy, variables, topology, layout.kv_heads_by_layer)
    ranks = _RankCache(topology, policy.schedule, store_sharding)
    decided: list[GroupDecision] = []
    problems: list[PlanProblem] = []
    for index in range(len(layout.groups)):  # every group, so that one run reports every refusal
        try:
            decided.append(_decide_group(policy, layout, index, specs, ranks, demoted=index in demoted))
        except PlanError as error:
            problems.extend(error.problems)
    if problems:
        raise PlanError(problems)
    if store_sharding is not None:
        for index, decision in enumerate(decided):
            _check_sharded_group_unreplicated(index, decision, store_sharding, layout.total_num_kv_heads)
    digest = fingerprint(
        stored_bytes_identity(
            policy,
            topology,
            decided,
            store_sharding=store_sharding,
            total_num_kv_heads=layout.total_num_kv_heads,
            kv_cache_layout=layout.kv_cache_layout,
        )
    )
    skeleton = Plan(
        policy=policy.name,
        model=layout.model,
        topology=topology,
        schedule=policy.schedule,
        audit_mode=policy.audit.mode,
        audit_steps=policy.audit.steps,
        key_template=policy.key.template,
        key_context=context,
        fingerprint=digest,
        groups=(),
        store_sharding=store_sharding,
        load=policy.load,
        total_num_kv_heads=layout.total_num_kv_heads,
    )
    prefixes = _PrefixCache(skeleton, ranks)
    groups = tuple(
        _group_plan(skeleton, ranks, prefixes, index, group, decision, demoted=index in demoted)
        for index, (group, decision) in enumerate(zip(layout.groups, decided, strict=True))
    )
    return dataclasses.replace(skeleton, groups=groups)


def plan_deployment(
    policy: Policy,
    layout: Layout,
    topology: Topology,
    *,
    extra_config: Mapping[str, object] | None = None,
    kv_cache_layout: str | None = None,
) -> tuple[Plan, Layout, StoreSelection]:
    """The plan an instance with these ``kv_connector_extra_config`` options would run, as the
    connector makes it: vLLM's store layout choice, the cache prefix in the keys. The layout comes
    back with ``kv_cache_layout`` (else its own, else vLLM's ``LBNHC`` preference where a sharded
    store depends on it) set, as the plan was made for it."""
    options = dict(extra_config or {})
    sharded = options.get("store_tp_size") is not None or options.get("enable_store_tp_lcm") is True
    resolved = kv_cache_layout or layout.kv_cache_layout or ("LBNHC" if sharded else None)
    if resolved != layout.kv_cache_layout:
        layout = layout.model_copy(update={"kv_cache_layout": resolved})
    store = select_store_layout(layout, topology, options, kv_cache_layout=resolved or "LBNHC")
    context = KeyContext.for_model(layout.model, str(options.get("cache_prefix", "")), store.store_namespace)
    plan = make_plan(policy, layout, topology, key_context=context, store_sharding=store.sharding)
    return plan, layout, store


MAX_RANK_ENTRIES = 1_000_000
"""Groups × TP × PCP × PP ranks a plan may describe (each is an entry of the plan); real deployments
have a few thousand."""
MAX_GLOB_MATCHES = 2_000_000
"""Layer-glob matches a plan may need (rules with ``layers`` × layers)."""


def check_topology(layout: Layout, topology: Topology) -> None:
    """Refuse what no policy can plan of ``layout`` at ``topology`` (:class:`PlanError`): more (group,
    rank) entries than a plan describes, sizes vLLM refuses together for this model. A discovery
    report of such an instance is refused for it, as a plan of it is."""
    _check_rank_entries(layout, topology)
    _check_vllm_accepts(layout, topology)


def _check_rank_entries(layout: Layout, topology: Topology, store_sharding: StoreSharding | None = None) -> None:
    # Per (group, pcp, pp): a rank entry per TP rank, and a namespace per store shard under a sharded store.
    per_stage = max(topology.tp_size, store_sharding.store_tp_size if store_sharding else 0)
    entries = len(layout.groups) * per_stage * topology.pcp_size * topology.pp_size
    if entries > MAX_RANK_ENTRIES:
        shards = f" (store_tp_size {store_sharding.store_tp_size})" if store_sharding else ""
        raise PlanError(
            f"the plan would describe {entries:,} (group, rank) entries ({len(layout.groups)} groups x tp {topology.tp_size}"
            f"{shards} x pcp {topology.pcp_size} x pp {topology.pp_size}); at most {MAX_RANK_ENTRIES:,} are planned"
        )


def _check_bounded(
    policy: Policy, layout: Layout, topology: Topology, store_sharding: StoreSharding | None = None
) -> None:
    """Refuse, before any work, a plan whose size alone would take seconds or gigabytes."""
    _check_rank_entries(layout, topology, store_sharding)
    layered = sum(1 for rule in policy.rules if rule.match.layers is not None)
    layers = sum(len(member.layers) for group in layout.groups for member in group.members)
    if layered * layers > MAX_GLOB_MATCHES:
        raise PlanError(
            f"{layered} rules with layer globs x {layers:,} layers is more than {MAX_GLOB_MATCHES:,} glob matches; "
            "match layers with fewer rules"
        )


def _topology_label(topology: Topology) -> str:
    return f"tp_size {topology.tp_size}, pp_size {topology.pp_size}, pcp_size {topology.pcp_size}, dcp_size {topology.dcp_size}"


def _dcp_tokens(spec: SpecValues, topology: Topology) -> int:
    """Tokens of a chunk per token a rank's block holds: ``dcp_size`` for a DCP-sharded spec (vLLM's
    ``dcp_sharded``, true for attention specs by default), 1 otherwise."""
    sharded = spec.fields.get("dcp_sharded", _is_attention(spec))
    return topology.dcp_size if sharded is True else 1


def _is_attention(spec: Spec | SpecValues) -> bool:
    """An attention spec, by its stated bases or vLLM's known class hierarchy."""
    return "AttentionSpec" in spec.classes or bool(is_subclass(spec.type, "AttentionSpec"))


def _is_mla(spec: Spec) -> bool:
    return any(
        name in spec.classes or bool(is_subclass(spec.type, name)) for name in ("MLAAttentionSpec", "SlidingWindowMLASpec")
    )


def _check_vllm_accepts(layout: Layout, topology: Topology) -> None:
    """Refuse a topology vLLM itself refuses for this model, naming vLLM's constraint, rather than
    plan a deployment that cannot start (``ModelConfig``'s DCP checks, vLLM 0.32): decode-context
    parallelism on GQA/MQA attention needs more TP ranks than KV heads, and at most
    ``tp_size // total_num_kv_heads`` DCP ranks (each splits the tokens of one repeated head)."""
    dcp, tp, heads = topology.dcp_size, topology.tp_size, layout.total_num_kv_heads
    if dcp == 1 or heads == 0:
        return
    for index, group in enumerate(layout.groups):
        for member in group.members:
            if _is_attention(member.spec) and not _is_mla(member.spec):
                if tp <= heads or dcp > tp // heads:
                    raise PlanError(
                        f"group {index}: vLLM refuses dcp_size {dcp} at tp_size {tp} for GQA/MQA attention "
                        f"({member.spec.type}) with {heads} KV heads: decode-context parallelism needs tp_size > "
                        f"total_num_kv_heads and dcp_size <= tp_size // total_num_kv_heads "
                        f"({max(0, tp // heads)} here)"
                    )
                return


def stored_bytes_identity(
    policy: Policy,
    topology: Topology,
    decided: Iterable[GroupDecision],
    *,
    store_sharding: StoreSharding | None = None,
    total_num_kv_heads: int = 0,
    kv_cache_layout: str | None = None,
) -> dict[str, object]:
    """What the plan fingerprint hashes: everything that decides which bytes a stored object holds
    and where it is addressed, and nothing else.

    * the key template (how namespaces are spelled);
    * per group, in order: its runs of ranks repeating the same heads (``tp_size // head_factor``:
      the key's ``{shard}`` names a run, and run ``s`` holds the same heads under every TP size with
      that many runs), its replica sets (``tp_size // factor``; with the pp, pcp and dcp sizes they
      fix which tokens a set holds), and each member spec's signature (class, block size, per-rank
      page size, fields, layer count);
    * the pp, pcp and dcp sizes (which layers and which tokens a rank holds);
    * the KV cache layout where known (``LBHNC``, ``LBNHC`` …): a rank-local object is a block's
      bytes in memory order, so the same heads in another layout are other bytes.

    Under pipeline parallelism the layer counts are left out: each stage plans its own layers, and
    an uneven split (80 layers over 3 stages) would give the stages different fingerprints, while
    rank 0 looks up every stage's namespaces under its own.

    Under vLLM's TP-sharded store layout an object is one store shard, the same whatever TP size
    wrote it, so a group is identified instead by the store TP size and format, the heads per store
    shard, and each spec's signature per store shard (page size divided among a rank's store shards,
    without the per-rank head count): a TP 4 and a TP 2 instance with one ``store_tp_size`` share.

    Not the TP size or the factor themselves: an MQA model at TP 4 and at TP 2 stores one shard of
    identical bytes, so both instances share objects. Not the write schedule: it decides which rank
    writes a chunk, not what the chunk holds. Not the policy's name, rules or audit settings.
    """
    identity: dict[str, object] = {
        "template": policy.key.template,
        "topology": {"pp": topology.pp_size, "pcp": topology.pcp_size, "dcp": topology.dcp_size},
    }
    if kv_cache_layout is not None:
        identity["kv_cache_layout"] = kv_cache_layout
    decided = [_stage_independent(decision, topology) for decision in decided]
    if store_sharding is None:
        identity["groups"] = [
            {
                "head_runs": topology.tp_size // decision.head_factor,
                "shards": topology.tp_size // decision.factor,
                "specs": decision.signature,
            }
            for decision in decided
        ]
        return identity
    per_rank = store_sharding.shards_per_rank(topology.tp_size)
    identity["store"] = {"store_tp": store_sharding.store_tp_size, "format": store_sharding.store_format}
    identity["groups"] = [
        {
            "heads_per_store_shard": total_num_kv_heads // store_sharding.store_tp_size,
            "specs": [_per_store_shard(spec, per_rank) for spec in decision.signature],
        }
        for decision in decided
    ]
    return identity


_DOCUMENT = "the document format, not the plan"
_WORDS = "words for people"
_DECIDED_BY_THE_RULES = "the factors the rules decide are hashed, not the rule's wording"

FINGERPRINTED: Mapping[type, frozenset[str]] = MappingProxyType({
    Policy: frozenset({"rules", "unmatched", "combine", "key"}),
    Rule: frozenset({"match", "when", "replication", "factor", "shards"}),
    Match: frozenset({"spec", "layers", "fields"}),
    KeyFormat: frozenset({"template"}),
    Audit: frozenset(),
    Layout: frozenset({"total_num_kv_heads", "layer_kv_heads", "kv_cache_layout", "groups"}),
    LayerHeads: frozenset({"total_num_kv_heads", "layers"}),
    Group: frozenset({"spec", "layers", "uniform"}),
    LayerSpecs: frozenset({"spec", "layers"}),
    Spec: frozenset({"type", "bases", "block_size", "page_size_bytes", "fields"}),
    FieldExpression: frozenset({"expr"}),
    Expression: frozenset({"source"}),
    Topology: frozenset({"tp_size", "pp_size", "pcp_size", "dcp_size"}),
    KeyContext: frozenset(),
    StoreSharding: frozenset({"store_tp_size", "store_format"}),
})
"""Per document that :func:`make_plan` reads, the fields whose value reaches the plan fingerprint:
hashed by :func:`stored_bytes_identity`, or through the decisions they make (a rule's factor, a
spec's base classes a rule matches, the TP size in the runs and replica sets; an expression by the
value it gives). Every other field is
in :data:`NOT_FINGERPRINTED` with the reason; ``tests/core/test_fingerprint_coverage.py`` holds the
two to the models' fields and to the fingerprint itself."""

NOT_FINGERPRINTED: Mapping[type, Mapping[str, str]] = MappingProxyType({
    Policy: {
        "version": _DOCUMENT,
        "kind": _DOCUMENT,
        "name": "two policies that store the same bytes under the same keys share objects",
        "description": _WORDS,
        "strict": "it refuses a plan or not; a plan it makes is the one without it",
        "schedule": "it decides which rank writes a chunk, not what the chunk holds",
        "load": "it decides which rank reads a chunk, not which objects exist",
        "audit": "an audit's demotion re-plans with the group demoted (hashed); its settings are not",
        "spec_fields": "names expressions may read; the values they read are the specs' fields (hashed)",
    },
    Rule: {"name": _DECIDED_BY_THE_RULES, "reason": _DECIDED_BY_THE_RULES},
    Match: {},
    KeyFormat: {
        "keyed": "a requirement on the deployment; its secret keys the chunk part of every key it writes",
        "verified": "a requirement on the deployment; sealed objects get their own keyed keys",
    },
    Audit: {"mode": "see Policy.audit", "steps": "see Policy.audit"},
    Layout: {
        "version": _DOCUMENT,
        "kind": _DOCUMENT,
        "model": "the model is in the keys by name ({model}); layouts of one shape store the same bytes",
        "description": _WORDS,
        "source": "where the layout came from, not what it states",
    },
    Group: {"name": _WORDS},
    LayerSpecs: {},
    LayerHeads: {},
    Spec: {},
    FieldExpression: {},
    Expression: {},
    Topology: {},
    KeyContext: {
        "model": "in the keys themselves ({model}), not the fingerprint",
        "cache_prefix": "in the keys themselves ({cache_prefix}), not the fingerprint",
        "store_namespace": "in the keys themselves ({store_namespace}); the sharding it names is hashed",
    },
    StoreSharding: {},
})
"""Per document that :func:`make_plan` reads, the fields left out of the plan fingerprint, and why."""


def _stage_independent(decision: GroupDecision, topology: Topology) -> GroupDecision:
    """``decision`` without its layer counts under pipeline parallelism (see :func:`stored_bytes_identity`)."""
    if topology.pp_size == 1:
        return decision
    signature = tuple({name: value for name, value in spec.items() if name != "layers"} for spec in decision.signature)
    return decision._replace(signature=signature)


def _check_sharded_keys(policy: Policy) -> None:
    """Store-shard keys carry a shard id where rank-local keys carry a rank: without the store
    namespace or the fingerprint in the template they would collide with rank-local objects."""
    template = policy.key.template
    if not template_fields(template) & {"store_namespace", "fingerprint"}:
        raise PlanError(
            f"key template '{template}' has neither {{store_namespace}} nor {{fingerprint}}: under vLLM's TP-sharded "
            "store layout its keys would name store shards exactly as rank-local keys name ranks, and load each "
            "other's objects; add {store_namespace} (vLLM's) or {fingerprint}"
        )


def _per_store_shard(signature: Mapping[str, object], shards_per_rank: int) -> dict[str, object]:
    """A spec signature of :class:`GroupDecision` as one store shard holds it."""
    fields = signature["fields"]
    assert isinstance(fields, dict)
    page_size = signature["page_size_bytes"]
    assert isinstance(page_size, int)
    return {
        **signature,
        "page_size_bytes": page_size // shards_per_rank,
        "fields": {name: value for name, value in fields.items() if name != "num_kv_heads"},
    }


def _check_store_sharding(layout: Layout, topology: Topology, sharding: StoreSharding) -> None:
    """Refuse a TP-sharded store layout whose objects would not be whole head shards, naming the
    constraint vLLM's ``TPShardedStoreLayout`` relies on."""
    tp, store_tp, heads = topology.tp_size, sharding.store_tp_size, layout.total_num_kv_heads
    if store_tp % tp:
        raise PlanError(
            f"store_tp_size {store_tp} is not a multiple of tp_size {tp}: vLLM's TP-sharded store layout gives "
            "every rank a whole number of store shards"
        )
    if topology.pcp_size != 1 or topology.dcp_size != 1:
        raise PlanError(
            "vLLM's TP-sharded store layout splits heads only; with prefill or decode context parallelism a "
            "rank holds a part of the tokens too (pcp_size and dcp_size must be 1)"
        )
    if heads == 0 or heads % store_tp:
        raise PlanError(
            f"{heads} KV heads do not split into store_tp_size {store_tp} store shards: vLLM's TP-sharded store "
            "layout needs total_num_kv_heads to be a multiple of store_tp_size"
        )
    for index, group in enumerate(layout.groups):
        for member in group.members:
            if not _is_attention(member.spec) or _is_mla(member.spec):
                raise PlanError(
                    f"group {index}: vLLM's TP-sharded store layout cuts KV heads, but {member.spec.type} "
                    "is not a per-head attention cache (vLLM uses the layout for FullAttentionSpec only)"
                )


def _check_sharded_group_unreplicated(
    index: int, decision: GroupDecision, sharding: StoreSharding, total_num_kv_heads: int
) -> None:
    """Under a TP-sharded store every rank holds distinct heads (``total_num_kv_heads >=
    store_tp_size >= tp_size``); a rule saying ranks repeat them contradicts the layout."""
    if decision.head_factor == 1:
        return
    culprit = next(d for d in decision.layer_decisions if d.factor > 1)
    raise PlanError(
        f"group {index}, layer {culprit.layer}: rule '{culprit.rule}' ({culprit.origin}) says {culprit.factor} TP ranks "
        f"repeat the same heads, but under vLLM's TP-sharded store layout (store_tp_size {sharding.store_tp_size}) "
        f"the {total_num_kv_heads} KV heads are split over the ranks and each holds its own; give this spec factor 1"
    )


class _SpecWork:
    """What one spec at the plan's topology gives every layer that has it: its values, the variables
    its expressions read, its fingerprint signature (without the layer count; shared, never
    modified), and each rule's outcome on it, worked out once (a failure is not remembered, so that
    each group reports its own)."""

    __slots__ = (
        "_factors", "_matches", "_whens", "chunk_tokens", "every_layer", "kv_heads", "signature", "values", "variables"
    )

    def __init__(
        self, values: SpecValues, variables: dict[str, Value], topology: Topology, kv_heads: int | None = None
    ) -> None:
        self.values, self.variables, self.kv_heads = values, variables, kv_heads
        self.chunk_tokens = values.block_size * _dcp_tokens(values, topology)
        self.signature: dict[str, object] = {
            "type": values.type,
            "block_size": values.block_size,
            "page_size_bytes": values.page_size_bytes,
            "fields": thawed(values.fields),
        }
        if kv_heads is not None:  # only then, so that plans of layouts without layer_kv_heads keep their fingerprint
            self.signature["total_num_kv_heads"] = kv_heads
        self._matches: dict[int, RuleMatch] = {}
        self._whens: dict[int, RuleMatch] = {}
        self._factors: dict[int, int] = {}
        self.every_layer: tuple[str | None, str, int, tuple[tuple[str, str], ...]] | None = None
        """(rule, origin, factor, rules passed over) of every layer, once known, under a policy
        without layer globs: then no layer of the spec is decided otherwise."""

    def matches(self, index: int, rule: Rule) -> RuleMatch:
        """:func:`~kvpolicy.language.matcher.match_spec` of rule ``index``."""
        found = self._matches.get(index)
        if found is None:
            found = self._matches[index] = match_spec(rule, self.values)
        return found

    def when(self, index: int, rule: Rule) -> RuleMatch:
        """:func:`~kvpolicy.language.matcher.match_when` of rule ``index``."""
        found = self._whens.get(index)
        if found is None:
            found = self._whens[index] = match_when(rule, self.values, self.variables)
        return found

    def factor(self, index: int, compute: Callable[[], int]) -> int:
        """Rule ``index``'s factor, ``compute()`` the first time."""
        found = self._factors.get(index)
        if found is None:
            found = self._factors[index] = compute()
        return found


class _SpecCache:
    """What one plan's rules give each distinct spec (its :class:`_SpecWork`) and, without layer
    globs, each distinct group: a layout states the same few specs in many groups. Specs are told
    apart by :meth:`Spec.exact_key`, not ``==``, which takes a field's ``true`` for ``1`` and would
    give one spec the other's signature."""

    def __init__(
        self,
        policy: Policy,
        variables: Mapping[str, Value],
        topology: Topology,
        kv_heads_by_layer: Mapping[str, int] = MappingProxyType({}),
    ) -> None:
        self._variables, self._topology = variables, topology
        self.kv_heads_by_layer = kv_heads_by_layer
        """The layout's layers of their own KV-head count (:attr:`Layout.kv_heads_by_layer`)."""
        self._work: dict[tuple[object, ...], _SpecWork] = {}
        self.rule_origins = tuple(policy.rule_origin(index) for index in range(len(policy.rules)))
        """:meth:`Policy.rule_origin` of every rule (a private attribute of the policy, slow to read)."""
        self.layer_globs = any(rule.match.layers is not None for rule in policy.rules)
        """Whether any rule tells the layers of one spec apart."""
        self.shapes: dict[tuple[object, ...], GroupDecision] = {}
        """Without layer globs, a group's decision but for its layer names, by its specs' work, its
        members' layer counts and whether it is demoted: a layout repeats a few groups many times."""

    def work(self, spec: Spec, kv_heads: int | None = None) -> _SpecWork:
        """``spec`` on layers of ``kv_heads`` KV heads (None: the model-wide count). Raises
        :class:`ExpressionError` as :meth:`Spec.evaluate` does."""
        key = (*spec.exact_key(), kv_heads)
        found = self._work.get(key)
        if found is None:
            variables = self._variables if kv_heads is None else {**self._variables, "total_num_kv_heads": kv_heads}
            values = spec.evaluate(variables)
            found = self._work[key] = _SpecWork(values, spec_variables(values, variables), self._topology, kv_heads)
        return found

    def by_kv_heads(self, members: Sequence[Member]) -> tuple[list[Member], list[int | None]]:
        """``members`` split where their layers' KV heads differ: a member per spec and count (None
        for the model-wide one), in order of first appearance; the members as they are when every
        layer has the model-wide count."""
        heads_of = self.kv_heads_by_layer
        if not heads_of:
            return list(members), [None] * len(members)
        split: list[Member] = []
        counts: list[int | None] = []
        for member in members:
            runs: dict[int | None, list[str]] = {}
            for layer in member.layers:
                runs.setdefault(heads_of.get(layer), []).append(layer)
            for heads, layers in runs.items():
                split.append(Member(member.spec, tuple(layers)) if len(runs) > 1 else member)
                counts.append(heads)
        return split, counts


def _decide_group(
    policy: Policy,
    layout: Layout,
    index: int,
    specs: _SpecCache,
    ranks: _RankCache,
    *,
    demoted: bool,
) -> GroupDecision:
    group = layout.groups[index]
    members, kv_heads = specs.by_kv_heads(group.members)
    works = []
    for member, heads in zip(members, kv_heads, strict=True):
        try:
            works.append(specs.work(member.spec, heads))
        except ExpressionError as error:
            raise PlanError(
                f"{_group_label(index, group)}: {member.spec.type} at {_topology_label(ranks.topology)}: {error.message}",
                _spec_expression_origin(layout, index, member, error),
            ) from None
    shape_key = (*map(id, works), *[len(member.layers) for member in members], demoted)
    shape = specs.shapes.get(shape_key)
    if shape is not None:  # a group like one before: only its layer names are its own
        decisions = [
            LayerDecision(layer, work.values.type, *work.every_layer, kv_heads=work.kv_heads)  # type: ignore[misc]
            for member, work in zip(members, works, strict=True)
            for layer in member.layers
        ]
        decision = shape._replace(layer_decisions=tuple(decisions))
    else:
        decision = _decide_new_group(policy, specs, members, works, ranks, _group_label(index, group), demoted=demoted)
        if not specs.layer_globs:
            specs.shapes[shape_key] = decision
    if len(members) != len(group.members):  # split by KV heads: back to the group's layer order
        order = {layer: position for position, layer in enumerate(layer for m in group.members for layer in m.layers)}
        decision = decision._replace(
            layer_decisions=tuple(sorted(decision.layer_decisions, key=lambda d: order[d.layer]))
        )
    return decision


def _spec_expression_origin(layout: Layout, index: int, member: Member, error: ExpressionError) -> str | None:
    """``file:line:col`` of the expression of group ``index``'s ``member`` that ``error`` is about, when
    the layout was loaded from a file."""
    if not isinstance(error, SpecExpressionError):
        return None
    # A member split by KV heads keeps its spec: the group's member of that spec is the one in the file.
    position = next(
        (position for position, candidate in enumerate(layout.groups[index].members) if candidate.spec is member.spec), 0
    )
    return layout.spec_origin(index, position, error.attribute, error.column)


def _group_label(index: int, group: Group) -> str:
    return f"group {index}" + (f" ({group.name})" if group.name else "")


def _decide_new_group(
    policy: Policy,
    specs: _SpecCache,
    members: Sequence[Member],
    works: Sequence[_SpecWork],
    ranks: _RankCache,
    label: str,
    *,
    demoted: bool,
) -> GroupDecision:
    """:func:`_decide_group` of a group unlike any before in the plan."""
    topology = ranks.topology
    decisions: list[LayerDecision] = []
    per_rank_bytes = 0.0
    signature: list[dict[str, object]] = []
    failures: list[PlanProblem] = []
    for member, work in zip(members, works, strict=True):
        spec = work.values
        per_rank_bytes += spec.page_size_bytes * len(member.layers) / work.chunk_tokens
        signature.append({**work.signature, "layers": len(member.layers)})
        try:
            decisions.extend(_decide_member(policy, specs, member, work, topology, label))
        except PlanError as error:
            failures.extend(error.problems)
    if failures:
        raise PlanError(failures)
    block_sizes = [work.values.block_size for work in works]
    if len(set(block_sizes)) > 1:
        raise PlanError(
            f"{label}: its specs have block sizes {', '.join(map(str, block_sizes))} at {_topology_label(topology)}; "
            "the layers of one vLLM KV-cache group share one block size"
        )
    head_factor = 1 if demoted else math.gcd(*[decision.factor for decision in decisions])
    return GroupDecision(
        layer_decisions=tuple(decisions),
        head_factor=head_factor,
        factor=_replica_set_size(head_factor, ranks, decisions, label),
        bytes_per_token_per_rank=per_rank_bytes,
        signature=tuple(signature),
        # A uniform group is DCP-sharded as its first spec is (vLLM's UniformTypeKVCacheSpecs).
        chunk_tokens=works[0].chunk_tokens,
    )


def _replica_set_size(head_factor: int, ranks: _RankCache, decisions: Sequence[LayerDecision], label: str) -> int:
    """Ranks per replica set (:func:`rank_replica_sets`): of ``head_factor`` consecutive ranks repeating a
    head, those holding the same tokens under decode-context parallelism."""
    size = ranks.replica_set_size(head_factor)
    if size is not None:
        return size
    topology = ranks.topology
    culprit = next((d for d in decisions if d.factor > 1), decisions[0])
    raise PlanError(
        f"{label}: rule '{culprit.rule}' ({culprit.origin}) repeats heads over {head_factor} consecutive TP ranks "
        f"with dcp_size {topology.dcp_size}: the ranks of equal dcp rank among them would form replica sets of "
        "different sizes; give a factor that divides dcp_size or that dcp_size divides"
    )


def _layers_label(layers: Sequence[str]) -> str:
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]} (+{len(layers) - 1} alike)"


def _decide_member(
    policy: Policy,
    specs: _SpecCache,
    member: Member,
    work: _SpecWork,
    topology: Topology,
    label: str,
) -> list[LayerDecision]:
    """The decision for every layer of one spec, in layer order.

    Rules are tried in order for the layers still undecided, all at once: a rule's spec, field and
    ``when`` conditions hold for every layer of the spec alike, so only its layer globs split them.
    The layers still undecided share one history of rules passed over; work and memory are linear in
    rules plus layers (plus one glob match per layer and layer-matching rule).
    """
    spec = work.values
    if work.every_layer is not None:
        rule_name, origin, factor, history = work.every_layer
        return [
            LayerDecision(layer, spec.type, rule_name, origin, factor, history, work.kv_heads) for layer in member.layers
        ]
    decisions = _decide_layers(policy, specs.rule_origins, member, work, topology, label)
    if not specs.layer_globs:
        first = decisions[0]
        work.every_layer = (first.rule, first.origin, first.factor, first.passed_over)
    return decisions


def _decide_layers(
    policy: Policy,
    origins: Sequence[str],
    member: Member,
    work: _SpecWork,
    topology: Topology,
    label: str,
) -> list[LayerDecision]:
    """:func:`_decide_member`, rule by rule."""
    spec, variables = work.values, work.variables
    pending: list[str] = list(member.layers)
    passed_over: list[tuple[str, str]] = []
    decided: dict[str, LayerDecision] = {}
    for rule_index, rule in enumerate(policy.rules):
        if not pending:
            break
        outcome = work.matches(rule_index, rule)
        if not outcome.matched:
            passed_over.append((rule.name, outcome.reason))
            continue
        selected = layers_matching(rule, pending)
        if not selected:
            passed_over.append((rule.name, layers_reason(rule)))
            continue
        origin = origins[rule_index]
        try:
            outcome = work.when(rule_index, rule)
        except ExpressionError as error:
            raise PlanError(
                f"{label}, {_layers_label(selected)}: rule '{rule.name}' ({origin}): when: {error.message}",
                policy.expression_origin(rule_index, "when", error.column),
            ) from None
        if not outcome.matched:
            passed_over.append((rule.name, outcome.reason))
            continue
        where = f"{label}, {_layers_label(selected)}: rule '{rule.name}' ({origin})"
        locate = functools.partial(policy.expression_origin, rule_index)  # (field, offset) -> file:line:col
        factor = work.factor(rule_index, functools.partial(_rule_factor, rule, variables, topology, where, locate))
        history = tuple(passed_over)
        decided.update(
            (layer, LayerDecision(layer, spec.type, rule.name, origin, factor, history, work.kv_heads))
            for layer in selected
        )
        if len(selected) == len(pending):
            pending = []
        else:
            chosen = set(selected)
            pending = [layer for layer in pending if layer not in chosen]
            passed_over.append((rule.name, layers_reason(rule)))
    if pending:
        if policy.strict:
            raise PlanError(
                f"{label}, {_layers_label(pending)} at {_topology_label(topology)}: no rule matches {spec.type} and "
                f"the policy is strict; add a rule for {spec.type} (or one of {', '.join(spec.classes[1:]) or 'its bases'})",
                policy.strict_origin,
            )
        factor = topology.tp_size if policy.unmatched is Replication.REPLICATED else 1
        history = tuple(passed_over)
        origin = f"unmatched: {policy.unmatched.value}"
        decided.update(
            (layer, LayerDecision(layer, spec.type, None, origin, factor, history, work.kv_heads)) for layer in pending
        )
    return [decided[layer] for layer in member.layers]


def _rule_factor(
    rule: Rule,
    variables: Mapping[str, Value],
    topology: Topology,
    where: str,
    locate: Callable[..., str | None],
) -> int:
    """The factor ``rule`` gives; ``locate(field, offset)`` is where its expression stands."""
    tp_size = topology.tp_size
    if rule.replication is not None:
        return tp_size if rule.replication is Replication.REPLICATED else 1
    expression = rule.factor if rule.factor is not None else rule.shards
    assert expression is not None
    quantity = "factor" if rule.factor is not None else "shards"
    missing = sorted(expression.names - variables.keys())
    if missing:
        raise PlanError(
            f"{where}: {quantity} reads '{missing[0]}', which this spec does not state; "
            f"add '{missing[0]}' to the layout's spec fields (null when vLLM leaves it unset)",
            locate(quantity),
        )
    try:
        value = expression.evaluate(variables)
    except ExpressionError as error:
        raise PlanError(f"{where}: {quantity}: {error.message}", locate(quantity, error.column)) from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(f"{where}: {quantity} '{expression.source}' gave {value!r}, not an integer", locate(quantity))
    if value < 1 or tp_size % value:
        raise PlanError(
            f"{where}: {quantity} '{expression.source}' = {value}, which is not a divisor of tp_size {tp_size}; "
            "replica sets must tile the TP ranks exactly",
            locate(quantity),
        )
    return value if rule.factor is not None else tp_size // value


class _RankCache:
    """Per plan, what depends only on a group's factors (and, for the write phase, on its index modulo
    the factor): replica sets, rank assignments, lookup namespaces. Groups with the same factors share
    one tuple of :class:`RankAssignment` (immutable)."""

    def __init__(self, topology: Topology, schedule: Schedule, sharding: StoreSharding | None) -> None:
        self.topology, self._schedule, self._sharding = topology, schedule, sharding
        self._replica_sets: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._sizes: dict[int, int | None] = {}
        self._assignments: dict[tuple[int, int, int], tuple[RankAssignment, ...]] = {}
        self._namespaces: dict[int, tuple[tuple[int, int], ...]] = {}

    def replica_sets(self, head_factor: int) -> tuple[tuple[int, ...], ...]:
        """:func:`rank_replica_sets`, once per head factor."""
        found = self._replica_sets.get(head_factor)
        if found is None:
            found = self._replica_sets[head_factor] = rank_replica_sets(head_factor, self.topology)
        return found

    def replica_set_size(self, head_factor: int) -> int | None:
        """The size of every replica set, or None when they differ."""
        found = self._sizes.get(head_factor, 0)  # 0: not worked out yet (a size is at least 1)
        if found == 0:
            sizes = {len(replica_set) for replica_set in self.replica_sets(head_factor)}
            found = self._sizes[head_factor] = sizes.pop() if len(sizes) == 1 else None
        return found

    def assignments(self, head_factor: int, factor: int, group: int) -> tuple[RankAssignment, ...]:
        key = (head_factor, factor, group % factor)
        found = self._assignments.get(key)
        if found is None:
            found = self._assignments[key] = self._assign(head_factor, factor, group)
        return found

    def _assign(self, head_factor: int, factor: int, group: int) -> tuple[RankAssignment, ...]:
        topology, sharding = self.topology, self._sharding
        tp_size = topology.tp_size
        replica_sets = self.replica_sets(head_factor)
        return tuple(
            RankAssignment(
                tp_rank=rank,
                shard=rank // head_factor,
                replica_set=replica_sets[rank],
                schedule=_schedule(
                    self._schedule, _stripe_rank(rank, topology), group, factor, leader=replica_sets[rank][0] == rank
                ),
                stripe_rank=_stripe_rank(rank, topology),
                store_shards=() if sharding is None else sharding.shards_of(rank, tp_size),
            )
            for rank in range(tp_size)
        )

    def namespaces(self, head_factor: int) -> tuple[tuple[int, int], ...]:
        """(shard, tp rank) of every namespace a lookup of a group with this head factor needs."""
        found = self._namespaces.get(head_factor)
        if found is None:
            if self._sharding is None:
                # One namespace per replica set, named by its first rank: (head shard, dcp rank) tell sets apart.
                leaders = sorted({replica_set[0] for replica_set in self.replica_sets(head_factor)})
                found = tuple((leader // head_factor, leader) for leader in leaders)
            else:
                # One namespace per store shard, whichever rank holds it (no PCP or DCP: dcp rank 0).
                found = tuple((store_shard, 0) for store_shard in range(self._sharding.store_tp_size))
            self._namespaces[head_factor] = found
        return found


class _PrefixCache:
    """A plan's lookup prefixes: each namespace rendered once (:meth:`Plan._prefix_pieces`) and joined
    with the index of every group that needs it (a plan of 100 groups at tp 8 has 800 prefixes)."""

    def __init__(self, skeleton: Plan, ranks: _RankCache) -> None:
        self._skeleton, self._ranks = skeleton, ranks
        self._pieces: dict[tuple[int, bool], list[list[str]] | None] = {}

    def lookup(self, group: int, head_factor: int, demoted: bool) -> tuple[str, ...]:
        """The prefixes a lookup of ``group`` needs, in upstream's order (pcp rank, namespace, pp rank)."""
        key = (head_factor, demoted)
        if key in self._pieces:
            pieces = self._pieces[key]
        else:
            pieces = self._pieces[key] = self._cut(head_factor, demoted)
        if pieces is None:
            return tuple(self._skeleton._prefix(group, *namespace, demoted) for namespace in self._namespaces(head_factor))
        index = str(group)
        return tuple([index.join(cut) for cut in pieces])

    def _namespaces(self, head_factor: int) -> list[tuple[int, int, int, int]]:
        """(shard, tp rank, pcp rank, pp rank) of each lookup prefix."""
        topology = self._skeleton.topology
        return [
            (shard, tp_rank, pcp_rank, pp_rank)
            for pcp_rank in range(topology.pcp_size)
            for shard, tp_rank in self._ranks.namespaces(head_factor)
            for pp_rank in range(topology.pp_size)
        ]

    def _cut(self, head_factor: int, demoted: bool) -> list[list[str]] | None:
        cuts = []
        for namespace in self._namespaces(head_factor):
            pieces = self._skeleton._prefix_pieces(*namespace, demoted)
            if pieces is None:
                return None
            cuts.append(pieces)
        return cuts


def _group_plan(
    skeleton: Plan,
    ranks: _RankCache,
    prefixes: _PrefixCache,
    index: int,
    group: Group,
    decision: GroupDecision,
    *,
    demoted: bool,
) -> GroupPlan:
    head_factor, factor, per_rank_bytes = decision.head_factor, decision.factor, decision.bytes_per_token_per_rank
    topology = skeleton.topology
    tp_size = topology.tp_size
    shards = tp_size // factor
    copies = factor if skeleton.schedule is Schedule.ALL else 1
    return GroupPlan(
        index=index,
        name=group.name or f"group-{index}",
        spec_types=_spec_types(group.members),
        uniform=group.is_uniform,
        decisions=decision.layer_decisions,
        factor=factor,
        shards=shards,
        ranks=ranks.assignments(head_factor, factor, index),
        lookup_namespaces=prefixes.lookup(index, head_factor, demoted),
        bytes_per_token_per_rank=per_rank_bytes,
        written_bytes_per_token=shards * copies * per_rank_bytes,
        undeduplicated_bytes_per_token=tp_size * per_rank_bytes,
        chunk_tokens=decision.chunk_tokens,
        demoted=demoted,
    )


def _spec_types(members: Sequence[Member]) -> tuple[str, ...]:
    if len(members) == 1:
        return (members[0].spec.type,)
    return tuple(dict.fromkeys(member.spec.type for member in members))


def replica_partition(head_factor: int, topology: Topology) -> tuple[tuple[int, ...], ...]:
    """The replica sets a head factor gives the TP ranks (each set ascending, sets by first rank):
    the partitions of ranks into equal bytes a plan can express. Work and memory linear in
    ``tp_size``, whatever the factor."""
    # Told apart by their first rank, not hashed: hashing a set of tp_size ranks costs tp_size.
    firsts = {members[0]: members for members in rank_replica_sets(head_factor, topology)}
    return tuple(firsts[first] for first in sorted(firsts))


def rank_replica_sets(head_factor: int, topology: Topology) -> tuple[tuple[int, ...], ...]:
    """The replica set of every TP rank, in rank order: the ranks holding its bytes, of its run of
    ``head_factor`` ranks repeating the same heads those of its dcp rank (:meth:`Topology.dcp_rank`;
    the same at every PCP rank in every topology vLLM allows). Each set is one tuple its members share.

    Built run by run (each run split by dcp rank once), so work and memory are linear in ``tp_size``:
    a set worked out rank by rank costs ``tp_size`` x ``head_factor``, 16.8 million dcp ranks and
    hundreds of MB for a group replicated over TP 4096."""
    tp_size = topology.tp_size
    by_rank: list[tuple[int, ...]] = []
    for start in range(0, tp_size, head_factor):
        own = [topology.dcp_rank(rank) for rank in range(start, start + head_factor)]
        classes: dict[int, list[int]] = {}
        for offset, dcp_rank in enumerate(own):
            classes.setdefault(dcp_rank, []).append(start + offset)
        shared = {dcp_rank: tuple(members) for dcp_rank, members in classes.items()}
        by_rank.extend(shared[dcp_rank] for dcp_rank in own[: tp_size - start])
    return tuple(by_rank)


def _stripe_rank(tp_rank: int, topology: Topology) -> int:
    """A rank number that is consecutive within every replica set, for vLLM's put phase: the TP
    rank, or without PCP under DCP ``tp_rank // dcp_size`` (a set is every ``dcp_size``-th rank)."""
    if topology.pcp_size == 1 and topology.dcp_size > 1:
        return tp_rank // topology.dcp_size
    return tp_rank


def _schedule(kind: Schedule, stripe_rank: int, group: int, factor: int, *, leader: bool) -> WriteSchedule:
    """``stripe_rank`` (:func:`_stripe_rank`) numbers the members of a replica set consecutively:
    vLLM's send thread writes chunk ``c`` of a group from the member with ``(stripe_rank + group) %
    factor == c % factor``."""
    if kind is Schedule.STRIPED:
        return WriteSchedule(kind, step=factor, phase=(stripe_rank + group) % factor, active=True)
    if kind is Schedule.LEADER:
        return WriteSchedule(kind, step=1, phase=0, active=leader)
    return WriteSchedule(kind, step=1, phase=0, active=True)

