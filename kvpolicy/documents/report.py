"""Plans rendered for people (a table, an explanation) and for machines (JSON), and the kinds and
versions of every JSON document kvpolicy writes."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvpolicy.evidence.audit import AuditStatus, initial_statuses
from kvpolicy.language.models import LoadMode
from kvpolicy.planning.contract import KeyContract
from kvpolicy.planning.plan import GroupPlan, LayerDecision, Plan
from kvpolicy.planning.traffic import PromptTraffic

DOCUMENT_VERSIONS: Mapping[str, int] = MappingProxyType(
    {
        "KeyContract": 1,
        "ReplicationPlan": 2,
        "ValidationReport": 1,
        "PolicyDiff": 1,
        "AuditReport": 1,
        "DoctorReport": 1,
    }
)
"""Kind → format version of each JSON document kvpolicy writes, each carrying both as ``kind`` and
``version`` (as the documents it reads do): ``KeyContract`` (``kvpolicy keys``, the connector's key
file), ``ReplicationPlan`` (``kvpolicy plan``, the connector's plan and status file), and the reports
of ``kvpolicy validate``, ``diff``, ``audit`` and ``doctor``. A change a reader must notice (a field
renamed, removed or meaning something else) bumps the version; adding a field does not."""


def versioned(kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` as a document of ``kind``: ``version`` and ``kind`` first, then its fields."""
    return {"version": DOCUMENT_VERSIONS[kind], "kind": kind, **body}


def _writers(group: GroupPlan) -> str:
    if group.factor == 1:
        return "every rank"
    kind = group.ranks[0].schedule.kind.value
    return {"striped": f"1 of {group.factor}, striped", "leader": "replica-set leader", "all": f"all {group.factor}"}[
        kind
    ]


def format_bytes(value: float) -> str:
    """``value`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _audit_statuses(plan: Plan, audit: Mapping[int, AuditStatus | str] | None) -> dict[int, str]:
    """Per group the replication audit's status: given by a running instance, else what a fresh one
    starts with (``pending`` for groups it will audit, ``off``, ``-`` for factor 1, ``demoted``)."""
    statuses = initial_statuses(plan) if audit is None else audit
    return {
        group.index: AuditStatus(statuses.get(group.index, AuditStatus.NOT_NEEDED)).value for group in plan.groups
    }


def format_plan_table(plan: Plan, *, audit: Mapping[int, AuditStatus | str] | None = None) -> str:
    """A readable table: one row per group, then totals and the fingerprint.

    ``audit`` gives each group's replication-audit status (see :class:`~kvpolicy.evidence.audit.AuditStatus`);
    without it the column shows what an instance starting with this plan knows.
    """
    topology = plan.topology
    statuses = _audit_statuses(plan, audit)
    header = ("group", "spec", "chunk", "rule", "factor", "shards", "writers", "written/token", "no dedup/token", "audit")
    rows = [header]
    for group in plan.groups:
        rule = ", ".join(group.rules)
        rows.append(
            (
                f"{group.index} {group.name}",
                "+".join(group.spec_types) if not group.uniform else "uniform{" + ",".join(group.spec_types) + "}",
                str(group.chunk_tokens),
                rule,
                str(group.factor),
                str(group.shards),
                _writers(group),
                format_bytes(group.written_bytes_per_token),
                format_bytes(group.undeduplicated_bytes_per_token),
                statuses[group.index],
            )
        )
    written = sum(group.written_bytes_per_token for group in plan.groups)
    baseline = sum(group.undeduplicated_bytes_per_token for group in plan.groups)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [
        f"plan: policy {plan.policy}, model {plan.model}, tp={topology.tp_size} pp={topology.pp_size} "
        f"pcp={topology.pcp_size} dcp={topology.dcp_size}, schedule {plan.schedule.value}"
        # Shown only when not the default, so that plans of per-rank policies read as before.
        + (f", load {plan.load.value}" if plan.load is LoadMode.STRIPED else "")
        + f", fingerprint {plan.fingerprint}"
    ]
    sharding = plan.store_sharding
    if sharding is not None:
        lines.append(
            f"store: TP-sharded ({sharding.store_format}), {sharding.store_tp_size} store shards, "
            f"{sharding.shards_per_rank(topology.tp_size)} objects per chunk on each rank"
        )
    elif plan.key_context.store_namespace:
        lines.append(f"store namespace: {plan.key_context.store_namespace}")
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    ratio = f" ({baseline / written:.2f}x less than no dedup)" if written else ""
    lines.append(f"total written per token: {format_bytes(written)} vs {format_bytes(baseline)} without dedup{ratio}")
    lines.extend(_own_kv_heads_lines(plan))
    return "\n".join(lines)


def _own_kv_heads_lines(plan: Plan) -> list[str]:
    """A line per group some of whose layers have their own KV-head count."""
    return [
        f"group {group.index} {group.name}: "
        + ", ".join(f"{layers} layer{'s' * (layers != 1)} with {heads} KV heads" for heads, layers in group.own_kv_heads)
        + f" (model-wide: {plan.total_num_kv_heads})"
        for group in plan.groups
        if group.own_kv_heads
    ]


def format_explanation(plan: Plan) -> str:
    """For each layer: which rule matched, and why every earlier rule did not."""
    lines: list[str] = []
    for group in plan.groups:
        lines.append(f"group {group.index} ({group.name}): factor {group.factor} = gcd of its layers' factors")
        # Layers decided identically are said once, at the first of them (one pass: a group may have
        # thousands of layers). Decisions of one spec share their history tuple, so keys hash fast.
        alike: dict[tuple[object, ...], list[LayerDecision]] = {}
        for decision in group.decisions:
            key = (decision.spec_type, decision.rule, decision.factor, decision.passed_over, decision.kv_heads)
            alike.setdefault(key, []).append(decision)
        for same in alike.values():
            decision = same[0]
            layers = decision.layer if len(same) == 1 else f"{decision.layer} (+{len(same) - 1} more layers alike)"
            heads = (
                "" if decision.kv_heads is None
                else f", {decision.kv_heads} KV heads of its own (model-wide: {plan.total_num_kv_heads})"
            )
            lines.append(f"  {layers}: {decision.spec_type}{heads}")
            for rule, reason in decision.passed_over:
                lines.append(f"    - {rule}: skipped, {reason}")
            verdict = f"rule {decision.rule} ({decision.origin})" if decision.rule else decision.origin
            lines.append(f"    = {verdict}: factor {decision.factor}")
    return "\n".join(lines)


def plan_to_json(plan: Plan, *, audit: Mapping[int, AuditStatus | str] | None = None) -> dict[str, Any]:
    """The plan as JSON; each group's ``audit`` field is its audit status (as in :func:`format_plan_table`)."""
    topology = plan.topology
    statuses = _audit_statuses(plan, audit)
    # Each rank names its replica set by index into its group's list: written out per rank, the sets of a
    # group replicated over every rank would be tp² numbers (300 MB at TP 4096).
    # The engine shares one tuple among the ranks of a set: keyed by identity, not hashed (tp numbers a hash).
    replica_sets = {
        group.index: tuple({id(rank.replica_set): rank.replica_set for rank in group.ranks}.values()) for group in plan.groups
    }
    set_index = {
        index: {id(members): position for position, members in enumerate(sets)} for index, sets in replica_sets.items()
    }
    return versioned("ReplicationPlan", {
        "policy": plan.policy,
        "model": plan.model,
        "topology": topology.model_dump(),
        "schedule": plan.schedule.value,
        "load": plan.load.value,
        "fingerprint": plan.fingerprint,
        "audit": {"mode": plan.audit_mode.value, "steps": plan.audit_steps},
        "store": {
            "namespace": plan.key_context.store_namespace,
            "sharding": None
            if plan.store_sharding is None
            else {"store_tp_size": plan.store_sharding.store_tp_size, "format": plan.store_sharding.store_format},
        },
        "groups": [
            {
                "index": group.index,
                "name": group.name,
                "spec_types": list(group.spec_types),
                "uniform": group.uniform,
                "factor": group.factor,
                "shards": group.shards,
                "rule": ", ".join(group.rules),
                "rules": list(group.rules),
                "origins": list(group.origins),
                "demoted": group.demoted,
                "audit": statuses[group.index],
                "chunk_tokens": group.chunk_tokens,
                "own_kv_heads": [{"total_num_kv_heads": heads, "layers": layers} for heads, layers in group.own_kv_heads],
                "lookup_namespaces": list(group.lookup_namespaces),
                "replica_sets": [list(members) for members in replica_sets[group.index]],
                "ranks": [
                    {
                        "tp_rank": rank.tp_rank,
                        "shard": rank.shard,
                        "replica_set": set_index[group.index][id(rank.replica_set)],
                        "stripe_rank": rank.stripe_rank,
                        "store_shards": list(rank.store_shards),
                        "writes": {
                            "schedule": rank.schedule.kind.value,
                            "step": rank.schedule.step,
                            "phase": rank.schedule.phase,
                            "active": rank.schedule.active,
                        },
                    }
                    for rank in group.ranks
                ],
                "bytes_per_token": {
                    "per_rank": group.bytes_per_token_per_rank,
                    "written": group.written_bytes_per_token,
                    "without_dedup": group.undeduplicated_bytes_per_token,
                },
            }
            for group in plan.groups
        ],
    })


def format_traffic(traffic: PromptTraffic) -> str:
    """One prompt's store traffic: totals, then one line per group."""
    lines = [
        f"a prompt of {traffic.prompt_tokens} tokens (chunks of {traffic.chunk_tokens}): a cold instance writes "
        f"{traffic.objects_written} objects; a warm one loads {traffic.hit_tokens} tokens, reading "
        f"{traffic.objects_read} objects"
    ]
    width = max(len(f"{group.group} {group.name}") for group in traffic.groups)
    for group in traffic.groups:
        label = f"{group.group} {group.name}"
        lines.append(
            f"  {label.ljust(width)}  {group.stores.value:14}  written {group.objects_written}, read {group.objects_read}"
        )
    return "\n".join(lines)


def traffic_to_json(traffic: PromptTraffic) -> dict[str, Any]:
    return {
        "prompt_tokens": traffic.prompt_tokens,
        "chunk_tokens": traffic.chunk_tokens,
        "hit_tokens": traffic.hit_tokens,
        "objects_written": traffic.objects_written,
        "objects_read": traffic.objects_read,
        "groups": [
            {
                "index": group.group,
                "name": group.name,
                "stores": group.stores.value,
                "objects_written": group.objects_written,
                "objects_read": group.objects_read,
            }
            for group in traffic.groups
        ],
    }


def format_key_contract(contract: KeyContract) -> str:
    """The key contract for people: per group its lookup prefixes, then each worker's prefixes and the
    chunks it writes."""
    topology = contract.topology
    lines = [
        f"keys: policy {contract.policy}, model {contract.model}, tp={topology.tp_size} pp={topology.pp_size} "
        f"pcp={topology.pcp_size} dcp={topology.dcp_size}, fingerprint {contract.fingerprint}, "
        f"key version {contract.key_version}",
        f"chunk key: {contract.chunk_key.format} ({contract.chunk_key.chunk_hash})",
    ]
    for group in contract.groups:
        demoted = ", demoted" if group.demoted else ""
        lines.append(
            f"group {group.index} {group.name}: {group.stores}, chunks of {group.chunk_tokens} tokens, factor {group.factor}{demoted}"
        )
        lines.append("  lookup needs: " + ", ".join(group.lookup_prefixes))
        for rank in group.ranks:
            writes = rank.writes
            chunks = "nothing" if not writes.active else "every chunk" if writes.step == 1 else (
                f"chunks c with c % {writes.step} == {writes.phase}"
            )
            lines.append(
                f"  tp {rank.tp_rank} pcp {rank.pcp_rank} pp {rank.pp_rank}: {', '.join(rank.prefixes)} (writes {chunks})"
            )
    return "\n".join(lines)
