"""policy × layout × topology → :class:`~kvpolicy.plan.Plan`.

Every layer spec gets a factor from the first rule that matches it; a group's factor is the gcd of
its layers' factors (the largest replica set over which every layer is identical). From the factor
follow, with the topology (decode-context parallelism keeps only ranks of equal dcp rank together),
the replica set and shard of each rank, the chunks it writes and the namespaces a lookup must find.
The engine refuses a plan it cannot prove consistent: a factor that is not a divisor of tp_size,
replica sets of unequal sizes, an expression that fails, a topology vLLM itself refuses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvpolicy.catalog import is_subclass
from kvpolicy.diagnostics import PlanError, PlanProblem
from kvpolicy.expressions import ExpressionError, Value
from kvpolicy.keys import KeyContext, fingerprint
from kvpolicy.matcher import layers_matching, layers_reason, match_spec, match_when, spec_variables
from kvpolicy.models import (
    Group,
    LayerSpecs,
    Layout,
    Policy,
    Replication,
    Rule,
    Schedule,
    Spec,
    SpecValues,
    Topology,
    thawed,
)
from kvpolicy.plan import GroupPlan, LayerDecision, Plan, RankAssignment, WriteSchedule
from kvpolicy.store_layout import StoreSelection, StoreSharding, select_store_layout


@dataclasses.dataclass(frozen=True)
class GroupDecision:
    """What the rules decided for one group, before ranks, write schedules and keys follow from it."""

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
    (:func:`kvpolicy.store_layout.select_store_layout`)."""
    _check_bounded(policy, layout, topology, store_sharding)
    _check_vllm_accepts(layout, topology)
    if store_sharding is not None:
        _check_store_sharding(layout, topology, store_sharding)
        _check_sharded_keys(policy)
    context = key_context or KeyContext.for_model(layout.model)
    demoted = frozenset(demoted)
    variables: dict[str, Value] = {
        "tp_size": topology.tp_size,
        "pp_size": topology.pp_size,
        "pcp_size": topology.pcp_size,
        "dcp_size": topology.dcp_size,
        "total_num_kv_heads": layout.total_num_kv_heads,
    }
    decided: list[GroupDecision] = []
    problems: list[PlanProblem] = []
    for index, group in enumerate(layout.groups):  # every group, so that one run reports every refusal
        try:
            decided.append(_decide_group(policy, group, index, variables, topology, demoted=index in demoted))
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
    )
    groups = tuple(
        _group_plan(skeleton, index, group, decision, demoted=index in demoted)
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


def _check_bounded(
    policy: Policy, layout: Layout, topology: Topology, store_sharding: StoreSharding | None = None
) -> None:
    """Refuse, before any work, a plan whose size alone would take seconds or gigabytes."""
    # Per (group, pcp, pp): a rank entry per TP rank, and a namespace per store shard under a sharded store.
    per_stage = max(topology.tp_size, store_sharding.store_tp_size if store_sharding else 0)
    entries = len(layout.groups) * per_stage * topology.pcp_size * topology.pp_size
    if entries > MAX_RANK_ENTRIES:
        shards = f" (store_tp_size {store_sharding.store_tp_size})" if store_sharding else ""
        raise PlanError(
            f"the plan would describe {entries:,} (group, rank) entries ({len(layout.groups)} groups x tp {topology.tp_size}"
            f"{shards} x pcp {topology.pcp_size} x pp {topology.pp_size}); at most {MAX_RANK_ENTRIES:,} are planned"
        )
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


def _stage_independent(decision: GroupDecision, topology: Topology) -> GroupDecision:
    """``decision`` without its layer counts under pipeline parallelism (see :func:`stored_bytes_identity`)."""
    if topology.pp_size == 1:
        return decision
    signature = tuple({name: value for name, value in spec.items() if name != "layers"} for spec in decision.signature)
    return dataclasses.replace(decision, signature=signature)


def _check_sharded_keys(policy: Policy) -> None:
    """Store-shard keys carry a shard id where rank-local keys carry a rank: without the store
    namespace or the fingerprint in the template they would collide with rank-local objects."""
    template = policy.key.template
    if "{store_namespace}" not in template and "{fingerprint}" not in template:
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


def _decide_group(
    policy: Policy,
    group: Group,
    index: int,
    variables: Mapping[str, Value],
    topology: Topology,
    *,
    demoted: bool,
) -> GroupDecision:
    label = f"group {index}" + (f" ({group.name})" if group.name else "")
    decisions: list[LayerDecision] = []
    per_rank_bytes = 0.0
    signature: list[dict[str, object]] = []
    failures: list[PlanProblem] = []
    block_sizes: list[int] = []
    chunk_tokens: list[int] = []
    for member in group.members:
        try:
            spec = member.spec.evaluate(variables)
        except ExpressionError as error:
            raise PlanError(f"{label}: {member.spec.type} at {_topology_label(topology)}: {error.message}") from None
        block_sizes.append(spec.block_size)
        chunk_tokens.append(spec.block_size * _dcp_tokens(spec, topology))
        per_rank_bytes += spec.page_size_bytes * len(member.layers) / (spec.block_size * _dcp_tokens(spec, topology))
        signature.append(
            {
                "type": spec.type,
                "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes,
                "fields": thawed(spec.fields),
                "layers": len(member.layers),
            }
        )
        try:
            decisions.extend(_decide_member(policy, member, spec, spec_variables(spec, variables), topology, label))
        except PlanError as error:
            failures.extend(error.problems)
    if failures:
        raise PlanError(failures)
    if len(set(block_sizes)) > 1:
        raise PlanError(
            f"{label}: its specs have block sizes {', '.join(map(str, block_sizes))} at {_topology_label(topology)}; "
            "the layers of one vLLM KV-cache group share one block size"
        )
    head_factor = 1 if demoted else math.gcd(*(decision.factor for decision in decisions))
    return GroupDecision(
        layer_decisions=tuple(decisions),
        head_factor=head_factor,
        factor=_replica_set_size(head_factor, topology, decisions, label),
        bytes_per_token_per_rank=per_rank_bytes,
        signature=tuple(signature),
        # A uniform group is DCP-sharded as its first spec is (vLLM's UniformTypeKVCacheSpecs).
        chunk_tokens=chunk_tokens[0],
    )


def _replica_set_size(head_factor: int, topology: Topology, decisions: Sequence[LayerDecision], label: str) -> int:
    """Ranks per replica set (:func:`_replica_set`): of ``head_factor`` consecutive ranks repeating a
    head, those holding the same tokens under decode-context parallelism."""
    sizes = {len(_replica_set(rank, head_factor, topology)) for rank in range(topology.tp_size)}
    if len(sizes) == 1:
        (size,) = sizes
        return size
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
    member: LayerSpecs,
    spec: SpecValues,
    variables: Mapping[str, Value],
    topology: Topology,
    label: str,
) -> list[LayerDecision]:
    """The decision for every layer of one spec, in layer order.

    Rules are tried in order for the layers still undecided, all at once: a rule's spec, field and
    ``when`` conditions hold for every layer of the spec alike, so only its layer globs split them.
    The layers still undecided share one history of rules passed over; work and memory are linear in
    rules plus layers (plus one glob match per layer and layer-matching rule).
    """
    pending: list[str] = list(member.layers)
    passed_over: list[tuple[str, str]] = []
    decided: dict[str, LayerDecision] = {}
    for rule_index, rule in enumerate(policy.rules):
        if not pending:
            break
        outcome = match_spec(rule, spec)
        if not outcome.matched:
            passed_over.append((rule.name, outcome.reason))
            continue
        selected = layers_matching(rule, pending)
        if not selected:
            passed_over.append((rule.name, layers_reason(rule)))
            continue
        origin = policy.rule_origin(rule_index)
        try:
            outcome = match_when(rule, spec, variables)
        except ExpressionError as error:
            raise PlanError(
                f"{label}, {_layers_label(selected)}: rule '{rule.name}' ({origin}): when: {error.message}",
                policy.expression_origin(rule_index, "when", error.column),
            ) from None
        if not outcome.matched:
            passed_over.append((rule.name, outcome.reason))
            continue
        where = f"{label}, {_layers_label(selected)}: rule '{rule.name}' ({origin})"
        factor = _rule_factor(
            rule, variables, topology, where, lambda field, offset=0: policy.expression_origin(rule_index, field, offset)
        )
        history = tuple(passed_over)
        decided.update((layer, LayerDecision(layer, spec.type, rule.name, origin, factor, history)) for layer in selected)
        if len(selected) == len(pending):
            pending = []
        else:
            chosen = set(selected)
            pending = [layer for layer in pending if layer not in chosen]
            passed_over.append((rule.name, layers_reason(rule)))
    if pending:
        if policy.strict:
            raise PlanError(
                f"{label}, {_layers_label(pending)}: no rule matches {spec.type} and the policy is strict; "
                f"add a rule for {spec.type} (or one of {', '.join(spec.classes[1:]) or 'its bases'})"
            )
        factor = topology.tp_size if policy.unmatched is Replication.REPLICATED else 1
        history = tuple(passed_over)
        origin = f"unmatched: {policy.unmatched.value}"
        decided.update((layer, LayerDecision(layer, spec.type, None, origin, factor, history)) for layer in pending)
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


def _group_plan(
    skeleton: Plan,
    index: int,
    group: Group,
    decision: GroupDecision,
    *,
    demoted: bool,
) -> GroupPlan:
    head_factor, factor, per_rank_bytes = decision.head_factor, decision.factor, decision.bytes_per_token_per_rank
    topology, sharding = skeleton.topology, skeleton.store_sharding
    tp_size = topology.tp_size
    shards = tp_size // factor
    replica_sets = [_replica_set(rank, head_factor, topology) for rank in range(tp_size)]
    ranks = tuple(
        RankAssignment(
            tp_rank=rank,
            shard=rank // head_factor,
            replica_set=replica_sets[rank],
            schedule=_schedule(
                skeleton.schedule, _stripe_rank(rank, topology), index, factor, leader=replica_sets[rank][0] == rank
            ),
            stripe_rank=_stripe_rank(rank, topology),
            store_shards=() if sharding is None else sharding.shards_of(rank, tp_size),
        )
        for rank in range(tp_size)
    )
    if sharding is None:
        # One namespace per replica set, named by its first rank: (head shard, dcp rank) tell sets apart.
        leaders = sorted({replica_set[0] for replica_set in replica_sets})
        namespaces = [(leader // head_factor, leader) for leader in leaders]
    else:
        # One namespace per store shard, whichever rank holds it (no PCP or DCP: dcp rank 0).
        namespaces = [(store_shard, 0) for store_shard in range(sharding.store_tp_size)]
    lookup = tuple(
        skeleton._prefix(index, shard, tp_rank, pcp_rank, pp_rank, demoted)
        for pcp_rank in range(topology.pcp_size)
        for shard, tp_rank in namespaces
        for pp_rank in range(topology.pp_size)
    )
    copies = factor if skeleton.schedule is Schedule.ALL else 1
    return GroupPlan(
        index=index,
        name=group.name or f"group-{index}",
        spec_types=tuple(dict.fromkeys(member.spec.type for member in group.members)),
        uniform=group.is_uniform,
        decisions=decision.layer_decisions,
        factor=factor,
        shards=shards,
        ranks=ranks,
        lookup_namespaces=lookup,
        bytes_per_token_per_rank=per_rank_bytes,
        written_bytes_per_token=shards * copies * per_rank_bytes,
        undeduplicated_bytes_per_token=tp_size * per_rank_bytes,
        chunk_tokens=decision.chunk_tokens,
        demoted=demoted,
    )


def _replica_set(tp_rank: int, head_factor: int, topology: Topology) -> tuple[int, ...]:
    """The ranks holding ``tp_rank``'s bytes: of its run of ``head_factor`` ranks repeating the same
    heads, those of its dcp rank (:meth:`Topology.dcp_rank`; the same at every PCP rank in every
    topology vLLM allows)."""
    start = tp_rank - tp_rank % head_factor
    own = topology.dcp_rank(tp_rank)
    return tuple(rank for rank in range(start, start + head_factor) if topology.dcp_rank(rank) == own)


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

