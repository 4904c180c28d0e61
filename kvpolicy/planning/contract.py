"""The key contract: every store key a plan reads and writes, as a versioned document for routers.

Routers and cache-aware schedulers rebuild store keys to know where a prefix lives, so a key is an
interface, not an implementation detail. :func:`key_contract` states, for one plan, the namespace
(key prefix) of every (group, rank), which chunks each rank writes, the prefixes a lookup needs, how
a chunk's hash is appended, and the plan fingerprint. ``kvpolicy keys`` prints it; the connector
writes it at start-up. :data:`KEY_VERSION` names the recipe: a change that would rename any stored
object must bump it (the golden keys in ``tests/golden/`` hold each version fixed).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvpolicy.language.diagnostics import PlanError
from kvpolicy.language.keys import CHUNK_KEY_FORMAT, KEY_VERSION
from kvpolicy.language.models import DocumentVersion, Layout, StrictModel, Topology
from kvpolicy.planning.plan import Plan
from kvpolicy.planning.traffic import Stores, group_stores

MAX_CONTRACT_PREFIXES = 100_000
"""Prefixes one contract may list (every worker's, per group); real deployments list a few thousand."""


class ChunkKey(StrictModel):
    """How a chunk's store key is spelled from a namespace prefix."""

    format: Literal["{prefix}@{chunk_hash}"] = CHUNK_KEY_FORMAT
    """The key of one chunk: its namespace's prefix, ``@``, then the chunk hash."""
    chunk_hash: Literal["block-hash-hex", "keyed-hmac-hex"] = "block-hash-hex"
    """What ``{chunk_hash}`` is. ``block-hash-hex``: the lowercase hex of vLLM's block hash
    (``BlockHash.hex()``) of the chunk's last hash block, i.e. the chained prefix-cache hash of the
    tokens up to the chunk's end (``--prefix-caching-hash-algo``, sha256 by default). A boundary state
    is keyed by the chunk that ends at the checkpoint. ``keyed-hmac-hex`` (keyed namespaces): 32 hex
    digits of an HMAC-SHA256, under a key derived from the deployment's secret, of the key spelled with
    the block hash; nobody without the secret (routers included) can compute it."""


class RankWrites(StrictModel):
    """Which chunks of a group one rank writes: chunk ``c`` when ``active`` and ``c % step == phase``."""

    schedule: Literal["striped", "leader", "all"]
    """The policy's write schedule."""
    step: int = Field(ge=1)
    """Chunks between two this rank writes."""
    phase: int = Field(ge=0)
    """The first chunk index this rank writes."""
    active: bool
    """False when the rank writes nothing for the group."""


class RankKeys(StrictModel):
    """One worker's namespaces for one group."""

    tp_rank: int = Field(ge=0)
    """TP rank of the worker."""
    pcp_rank: int = Field(ge=0)
    """Prefill context-parallel rank."""
    dcp_rank: int = Field(ge=0)
    """Decode context-parallel rank, as the key spells it."""
    pp_rank: int = Field(ge=0)
    """Pipeline stage."""
    prefixes: tuple[str, ...] = Field(min_length=1)
    """The namespace of every object this worker writes per chunk (one, or one per store shard it owns)."""
    writes: RankWrites
    """Which chunks it writes."""


class GroupKeys(StrictModel):
    """One KV-cache group's keys."""

    index: int = Field(ge=0)
    """Position among the prefix-cacheable groups; the key's ``group`` field."""
    name: str
    """Group name in the plan."""
    stores: Literal["chunks", "boundary-state"]
    """``chunks``: every full chunk of a prompt is stored; ``boundary-state``: only the state at the
    prompt's checkpoint (Mamba / linear attention)."""
    chunk_tokens: int = Field(ge=1)
    """Tokens per chunk: the spec's block size, times ``dcp_size`` for a DCP-sharded spec."""
    factor: int = Field(ge=1)
    """Ranks holding byte-identical bytes (one replica set); each chunk is stored once per set."""
    demoted: bool
    """Forced to factor 1 by the replication audit; its keys are those of factor 1."""
    lookup_prefixes: tuple[str, ...] = Field(min_length=1)
    """A chunk is a hit only when every one of these namespaces holds it."""
    ranks: tuple[RankKeys, ...]
    """Every worker's namespaces, ordered by pp, pcp, then tp rank."""


class KeyContract(StrictModel):
    """Every store key of one plan: what a router may rely on."""

    version: DocumentVersion
    """Document format version."""
    kind: Literal["KeyContract"]
    """Document kind."""
    key_version: int = Field(ge=1)
    """Version of the key recipe (:data:`KEY_VERSION`); keys of different versions never match."""
    policy: str
    """Policy name."""
    model: str
    """The model's name in keys (its last path component)."""
    cache_prefix: str
    """``kv_connector_extra_config.cache_prefix``, rendered with a trailing ``@`` when set."""
    store_namespace: str
    """vLLM's store-format namespace, empty for the historical rank-local layout."""
    store_tp_size: int | None
    """Store shards per chunk under vLLM's TP-sharded store layout; None for rank-local objects."""
    topology: Topology
    """The instance's parallel sizes."""
    fingerprint: str
    """The plan fingerprint: instances share objects only with equal fingerprints (and templates)."""
    template: str
    """The policy's key prefix template."""
    chunk_key: ChunkKey = ChunkKey()
    """How a chunk key is made from a prefix."""
    groups: tuple[GroupKeys, ...]
    """Per group, in the plan's order."""


def key_contract(plan: Plan, layout: Layout, *, keyed: bool = False) -> KeyContract:
    """The key contract of ``plan``, the plan of ``layout``; ``keyed``: the deployment keys its chunk
    keys with a secret. Raises :class:`PlanError` for a contract of more than
    :data:`MAX_CONTRACT_PREFIXES` prefixes, before building any."""
    topology = plan.topology
    stages = topology.pcp_size * topology.pp_size
    listed = sum(stages * len(rank.key_shards) for group in plan.groups for rank in group.ranks)
    if listed > MAX_CONTRACT_PREFIXES:
        raise PlanError(
            f"the key contract would list {listed:,} key prefixes ({len(plan.groups)} groups x {topology.tp_size} TP "
            f"ranks x {stages} pcp/pp stages, per store shard); at most {MAX_CONTRACT_PREFIXES:,} are listed"
        )
    dcp_of = topology.dcp_rank
    groups = []
    for group_plan, group in zip(plan.groups, layout.groups, strict=True):
        ranks = tuple(
            RankKeys(
                tp_rank=rank.tp_rank,
                pcp_rank=pcp_rank,
                dcp_rank=dcp_of(rank.tp_rank, pcp_rank),
                pp_rank=pp_rank,
                prefixes=plan.key_prefixes(group_plan.index, rank.tp_rank, pcp_rank, pp_rank),
                writes=RankWrites(
                    schedule=rank.schedule.kind.value,
                    step=rank.schedule.step,
                    phase=rank.schedule.phase,
                    active=rank.schedule.active,
                ),
            )
            for pp_rank in range(topology.pp_size)
            for pcp_rank in range(topology.pcp_size)
            for rank in group_plan.ranks
        )
        groups.append(
            GroupKeys(
                index=group_plan.index,
                name=group_plan.name,
                stores="boundary-state" if group_stores(group) is Stores.BOUNDARY_STATE else "chunks",
                chunk_tokens=group_plan.chunk_tokens,
                factor=group_plan.factor,
                demoted=group_plan.demoted,
                lookup_prefixes=group_plan.lookup_namespaces,
                ranks=ranks,
            )
        )
    sharding = plan.store_sharding
    return KeyContract(
        version=1,
        kind="KeyContract",
        key_version=KEY_VERSION,
        policy=plan.policy,
        model=plan.key_context.model,
        cache_prefix=plan.key_context.cache_prefix,
        store_namespace=plan.key_context.store_namespace,
        store_tp_size=None if sharding is None else sharding.store_tp_size,
        topology=topology,
        fingerprint=plan.fingerprint,
        template=plan.key_template,
        chunk_key=ChunkKey(chunk_hash="keyed-hmac-hex") if keyed else ChunkKey(),
        groups=tuple(groups),
    )
