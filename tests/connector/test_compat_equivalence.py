"""``vllm-compat`` against vLLM's own ``MooncakeStoreWorker``; ``default`` against ``vllm-compat``;
``kvpolicy.vllm.store`` and ``kvpolicy.runtime.binding`` against vLLM's send-thread arithmetic.

The upstream side is the real class. ``object.__new__(MooncakeStoreWorker)`` skips only its
``__init__`` (which mounts a Mooncake segment and needs torch.distributed); the attributes that
``__init__`` would set and the methods under test read are set by hand, and then the real
``_compute_group_tp_replication_factors`` / ``_spec_tp_replication_factor``,
``_build_token_databases`` and ``_init_lookup_key_prefixes`` run unchanged. Nothing is mocked.

Why by hand here, and not through :func:`kvpolicy.vllm.standalone.init_standalone` as everywhere
else: this module compares the override points' arithmetic for *every* spec class vLLM ships, and
``MooncakeStoreCoordinator`` refuses the classes that have no KV-cache manager (a bare
``AttentionSpec``, for one), so the groups are set as the coordinator would keep them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import NoPublishedDemotions, alone

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("vllm is not installed", allow_module_level=True)

import torch
import vllm.v1.kv_cache_interface as kv_cache_interface
from vllm.config import CacheConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    PoolKey,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.v1.core.kv_cache_utils import BlockHash, resolve_dcp_kv_cache_spec
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvpolicy.documents.loader import load_policy
from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.language.keys import KeyContext, chunk_key, split_chunk_key
from kvpolicy.language.models import Policy, Schedule, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.plan import Plan
from kvpolicy.runtime import binding
from kvpolicy.vllm import store
from kvpolicy.vllm.config import WorkerSetup
from kvpolicy.vllm.layout import layout_from_kv_cache_config
from kvpolicy.vllm.worker import KVPolicyStoreWorker

BLOCK = 16
MODEL = "org/Tiny-Model"
HASH = BlockHash(bytes(range(32)))
COMPAT = load_policy("vllm-compat")
DEFAULT = load_policy("default")
PLAIN = KeyContext.for_model(MODEL)
PREFIXED = KeyContext.for_model(MODEL, "tenant-a", "@store_pp:1@store_format:tp_shared_mqa")
KEY_CONTEXTS = {"plain": PLAIN, "prefixed": PREFIXED}

# Values for the fields a spec class requires (no default). A class needing a field missing here
# fails collection with its name, so a new vLLM spec class cannot go unnoticed.
REQUIRED_FIELD_VALUES: dict[str, Any] = {
    "block_size": BLOCK,
    "num_kv_heads": 1,
    "head_size": 64,
    "dtype": torch.bfloat16,
    "sliding_window": 64,
    "attention_chunk_size": 64,
    "rswa_window": 64,
    "shapes": ((2, 8), (4, 4, 2)),
    "dtypes": (torch.bfloat16, torch.float32),
    "page_size": 4096,
    "blocks_per_request": 4,
}


@dataclass(frozen=True)
class PluginStateSpec(KVCacheSpec):
    """A spec class from a plugin: neither attention nor Mamba, unknown to every shipped policy."""

    state_bytes: int = 1024

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes


# --- building real vLLM specs -------------------------------------------------------------------


def shipped_spec_classes() -> list[type[KVCacheSpec]]:
    """Every subclass of KVCacheSpec that vLLM's kv_cache_interface defines, breadth first."""
    found: list[type[KVCacheSpec]] = []
    pending: list[type[KVCacheSpec]] = [KVCacheSpec]
    while pending:
        for subclass in pending.pop(0).__subclasses__():
            if subclass.__module__ == kv_cache_interface.__name__ and subclass not in found:
                found.append(subclass)
                pending.append(subclass)
    return found


def build(cls: type[KVCacheSpec], **overrides: Any) -> KVCacheSpec:
    required = [
        field.name
        for field in dataclasses.fields(cls)
        if field.init and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    ]
    unknown = [name for name in required if name not in REQUIRED_FIELD_VALUES and name not in overrides]
    if unknown:
        raise LookupError(f"{cls.__name__} requires {unknown}; add values to REQUIRED_FIELD_VALUES")
    return cls(**{**{name: REQUIRED_FIELD_VALUES[name] for name in required}, **overrides})


def ineligibility(cls: type[KVCacheSpec]) -> str | None:
    """Why the store can never key a group of this class, or None when it can."""
    if cls is UniformTypeKVCacheSpecs:
        return "a container of per-layer specs; covered by the uniform-group cases"
    spec = build(cls)
    try:
        spec.page_size_bytes  # noqa: B018
    except NotImplementedError:
        return "abstract: page_size_bytes is not implemented"
    if not spec.prefix_cacheable:
        return "not prefix-cacheable: the store never transfers such a group"
    return None


def hint_variants(cls: type[KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The class with default fields, plus the replication hints vLLM computes and its store ignores."""
    variants = {cls.__name__: build(cls)}
    if issubclass(cls, MambaSpec):
        variants[f"{cls.__name__}(tp_replicated)"] = build(cls, tp_replicated=True)
    if issubclass(cls, AttentionSpec):
        variants[f"{cls.__name__}(max_tp_shards=2)"] = build(cls, max_tp_shards=2)
    return variants


SHIPPED = shipped_spec_classes()
ELIGIBLE = [cls for cls in SHIPPED if ineligibility(cls) is None]


def spec_class_params() -> Iterator[Any]:
    for cls in SHIPPED:
        reason = ineligibility(cls)
        marks = [pytest.mark.skip(reason=f"{cls.__name__}: {reason}")] if reason else []
        yield pytest.param(cls, id=cls.__name__, marks=marks)


def full(**overrides: Any) -> KVCacheSpec:
    return build(FullAttentionSpec, **overrides)


def mla() -> KVCacheSpec:
    return build(MLAAttentionSpec, head_size=576)


def mamba(**overrides: Any) -> KVCacheSpec:
    return build(MambaSpec, **overrides)


def uniform(*specs: KVCacheSpec) -> UniformTypeKVCacheSpecs:
    return UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs={f"u.{i}": spec for i, spec in enumerate(specs)})


# --- cases --------------------------------------------------------------------------------------


Rank = tuple[int, int, int]
"""(tp_rank, pcp_rank, pp_rank)"""


@dataclass(frozen=True)
class Case:
    """One model (one spec per prefix-cacheable group) on one topology."""

    groups: tuple[KVCacheSpec, ...]
    tp: int
    heads: int
    dcp: int = 1
    pcp: int = 1
    pp: int = 1

    @property
    def topology(self) -> Topology:
        return Topology(tp_size=self.tp, pp_size=self.pp, pcp_size=self.pcp, dcp_size=self.dcp)

    def ranks(self) -> Iterator[Rank]:
        """(tp_rank, pcp_rank, pp_rank) of every worker."""
        for pcp_rank in range(self.pcp):
            for pp_rank in range(self.pp):
                for tp_rank in range(self.tp):
                    yield tp_rank, pcp_rank, pp_rank


MIXES: dict[str, tuple[KVCacheSpec, ...]] = {
    "mla+full+mamba": (mla(), full(), mamba()),
    "full+swa+chunked+mamba": (full(), build(SlidingWindowSpec), build(ChunkedLocalAttentionSpec), mamba()),
    "every-eligible-class": tuple(build(cls) for cls in ELIGIBLE),
    "uniform{mla,full}": (uniform(mla(), full()),),
    "uniform{mla,swmla}": (uniform(mla(), build(SlidingWindowMLASpec)),),
    "uniform{hidden-state,mla}": (uniform(build(HiddenStateCacheSpec), mla()),),
    "uniform{mla,mamba}": (uniform(mla(), mamba()),),
    "uniform{full,swa}+mamba": (uniform(full(), build(SlidingWindowSpec)), mamba()),
    "uniform{mla,full}+mla+plugin": (uniform(mla(), full()), mla(), PluginStateSpec(block_size=BLOCK)),
}

TP_HEADS = [(tp, heads) for tp in (1, 2, 4, 8) for heads in (1, 2, 3, 8)]
PARALLEL: dict[str, dict[str, int]] = {
    "tp2-dcp2": {"tp": 2, "dcp": 2},
    "tp4-dcp2": {"tp": 4, "dcp": 2},
    "tp8-dcp4": {"tp": 8, "dcp": 4},
    "tp2-pcp2": {"tp": 2, "pcp": 2},
    "tp4-pp2": {"tp": 4, "pp": 2},
    "tp2-pcp2-pp2": {"tp": 2, "pcp": 2, "pp": 2},
    "tp2-pcp2-dcp2": {"tp": 2, "pcp": 2, "dcp": 2},
}


def all_cases() -> Iterator[Any]:
    singles = {name: (spec,) for cls in ELIGIBLE for name, spec in hint_variants(cls).items()}
    singles["PluginStateSpec"] = (PluginStateSpec(block_size=BLOCK),)
    for name, groups in {**singles, **MIXES}.items():
        for tp, heads in TP_HEADS:
            yield pytest.param(Case(groups, tp, heads), id=f"{name}-tp{tp}-heads{heads}")
        for label, sizes in PARALLEL.items():
            yield pytest.param(Case(groups, heads=1, **sizes), id=f"{name}-{label}")


CASES = list(all_cases())


# --- the two sides ------------------------------------------------------------------------------


def kv_cache_config(case: Case) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(layer_names(spec, index), spec) for index, spec in enumerate(case.groups)
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def layer_names(spec: KVCacheSpec, index: int) -> list[str]:
    return list(spec.kv_cache_specs) if isinstance(spec, UniformTypeKVCacheSpecs) else [f"l.{index}"]


def plan_for(policy: Policy, case: Case, context: KeyContext = PLAIN) -> Plan:
    layout = layout_from_kv_cache_config(kv_cache_config(case), model=context.model, total_num_kv_heads=case.heads)
    return make_plan(policy, layout, case.topology, key_context=context)


def vllm_dcp_rank(case: Case, tp_rank: int, pcp_rank: int) -> int:
    """``get_dcp_group().rank_in_group`` as ``initialize_model_parallel`` builds the DCP groups (vLLM
    0.32): ranks laid out [pp, pcp, tp]; with DCP the last two axes are swapped and consecutive runs
    of ``dcp_size`` form the groups."""
    if case.dcp == 1:
        return 0
    ranks = torch.arange(case.pp * case.pcp * case.tp).reshape(case.pp, case.pcp, case.tp)
    me = int(ranks[0, pcp_rank, tp_rank])
    for group in ranks.transpose(-1, -2).reshape(-1, case.dcp).tolist():
        if me in group:
            return group.index(me)
    raise AssertionError("every rank is in a DCP group")


def metadata_for(case: Case, rank: Rank, context: KeyContext = PLAIN) -> KeyMetadata:
    """The KeyMetadata MooncakeStoreWorker.__init__ builds on this rank."""
    tp_rank, pcp_rank, pp_rank = rank
    return KeyMetadata(
        model_name=context.model,
        tp_rank=tp_rank,
        pcp_rank=pcp_rank,
        # vLLM's DCP group subdivides TP: rank_in_group == tp_rank % dcp_size.
        dcp_rank=vllm_dcp_rank(case, tp_rank, pcp_rank),
        pp_rank=pp_rank,
        cache_prefix=context.cache_prefix,
        store_namespace=context.store_namespace,
    )


def resolved_cache_config() -> CacheConfig:
    """A CacheConfig whose KV layout is resolved, as the engine core leaves it before workers start."""
    config = CacheConfig()
    config.kv_cache_layout = "LBHNC"
    return config


def set_upstream_state(worker: MooncakeStoreWorker, case: Case, rank: Rank) -> None:
    """The attributes MooncakeStoreWorker.__init__ sets before its override points run."""
    tp_rank, pcp_rank, pp_rank = rank
    worker.store = NoPublishedDemotions()
    worker.dp_rank = 0
    worker.tp_rank, worker.tp_size = tp_rank, case.tp
    worker.pcp_rank, worker.pcp_size = pcp_rank, case.pcp
    worker.dcp_size = case.dcp
    worker.dcp_rank = vllm_dcp_rank(case, tp_rank, pcp_rank)
    worker.pp_rank, worker.pp_size = pp_rank, case.pp
    worker.num_kv_head = case.heads
    worker.hash_block_size = BLOCK
    worker.store_tp_size = None
    worker.cache_config = resolved_cache_config()
    config = kv_cache_config(case)
    worker._kv_cache_config = config
    # What MooncakeStoreCoordinator.from_kv_cache_config keeps: prefix-cacheable groups, DCP-resolved.
    worker._kv_cache_groups = [
        dataclasses.replace(group, kv_cache_spec=resolve_dcp_kv_cache_spec(group.kv_cache_spec, case.dcp))
        for group in config.prefix_cacheable_groups
    ]


def run_override_points(worker: MooncakeStoreWorker, metadata: KeyMetadata) -> None:
    """The last three statements of MooncakeStoreWorker.__init__, in its order."""
    worker._group_tp_replication_factors = worker._compute_group_tp_replication_factors()
    worker.token_dbs = worker._build_token_databases(metadata, None)
    worker._init_lookup_key_prefixes()


def upstream(case: Case, rank: Rank = (0, 0, 0), context: KeyContext = PLAIN) -> MooncakeStoreWorker:
    """A real MooncakeStoreWorker for one rank, its __init__ replaced by set_upstream_state."""
    worker = object.__new__(MooncakeStoreWorker)
    set_upstream_state(worker, case, rank)
    run_override_points(worker, metadata_for(case, rank, context))
    return worker


def plan_databases(plan: Plan, case: Case, rank: Rank, context: KeyContext = PLAIN) -> list[ChunkedTokenDatabase]:
    tp_rank, pcp_rank, pp_rank = rank
    return store.build_token_databases(
        plan,
        tp_rank=tp_rank,
        pcp_rank=pcp_rank,
        pp_rank=pp_rank,
        block_sizes=[BLOCK] * len(plan.groups),
        hash_block_sizes=[BLOCK] * len(plan.groups),
        metadata=metadata_for(case, rank, context),
    )


def upstream_keys(case: Case, context: KeyContext = PLAIN) -> list[str]:
    keys = []
    for rank in case.ranks():
        for database in upstream(case, rank, context).token_dbs:
            key = database.key_for(HASH)
            assert key == PoolKey(database.metadata, HASH.hex()).to_string()
            keys.append(key)
    return keys


def plan_keys(policy: Policy, case: Case, context: KeyContext = PLAIN) -> list[str]:
    plan = plan_for(policy, case, context)
    return [database.key_for(HASH) for rank in case.ranks() for database in plan_databases(plan, case, rank, context)]


def policy_worker(
    policy: Policy, case: Case, rank: Rank, cache_prefix: str = "", extra_config: dict[str, Any] | None = None
) -> KVPolicyStoreWorker:
    """A real KVPolicyStoreWorker for one rank, built like upstream() plus its own pre-init state."""
    worker = object.__new__(KVPolicyStoreWorker)
    set_upstream_state(worker, case, rank)
    worker._setup = WorkerSetup(policy, KVPolicySettings(), model=MODEL, cache_prefix=cache_prefix, gather=alone)
    # Upstream's own selection, through the override, as MooncakeStoreWorker.__init__ calls it.
    _, store_namespace, _ = worker._select_store_layout(extra_config or {})
    run_override_points(worker, metadata_for(case, rank, KeyContext.for_model(MODEL, cache_prefix, store_namespace)))
    return worker


def factors(case: Case) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(default, vllm-compat, upstream) factors."""
    return plan_for(DEFAULT, case).factors, plan_for(COMPAT, case).factors, upstream(case)._group_tp_replication_factors


# --- the enumeration itself ---------------------------------------------------------------------


def test_enumeration_finds_the_spec_classes_vllm_ships() -> None:
    names = {cls.__name__ for cls in SHIPPED}
    assert {
        "AttentionSpec", "FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec", "RSWASpec",
        "HiddenStateCacheSpec", "SlidingWindowSpec", "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec",
        "CrossAttentionSpec", "EncoderOnlyAttentionSpec", "CircularBufferSpec", "MambaSpec", "UniformTypeKVCacheSpecs",
    } <= names


@pytest.mark.parametrize("cls", list(spec_class_params()))
def test_every_eligible_spec_class_builds_into_a_layout_and_a_compat_plan(cls: type[KVCacheSpec]) -> None:
    case = Case((build(cls),), tp=4, heads=2)
    assert len(plan_for(COMPAT, case).groups) == 1


# --- vllm-compat equals upstream ----------------------------------------------------------------


def test_upstream_reference_values_from_the_brief_hold_for_compat() -> None:
    cases = [
        Case((mla(), full(), mamba()), tp=4, heads=2),
        Case((uniform(mla(), full()),), tp=4, heads=2),
        Case((full(), mamba()), tp=2, heads=1),
    ]
    expected = [(4, 2, 1), (2,), (2, 1)]
    assert [upstream(case)._group_tp_replication_factors for case in cases] == expected
    assert [plan_for(COMPAT, case).factors for case in cases] == expected


@pytest.mark.parametrize("case", CASES)
def test_compat_factors_equal_upstream_spec_tp_replication_factor(case: Case) -> None:
    worker = upstream(case)
    per_spec = tuple(worker._spec_tp_replication_factor(group.kv_cache_spec) for group in worker._kv_cache_groups)
    assert plan_for(COMPAT, case).factors == worker._group_tp_replication_factors == per_spec


@pytest.mark.parametrize("context", KEY_CONTEXTS.values(), ids=KEY_CONTEXTS.keys())
@pytest.mark.parametrize("case", CASES)
def test_compat_chunk_keys_equal_upstream_on_every_rank(case: Case, context: KeyContext) -> None:
    assert plan_keys(COMPAT, case, context) == upstream_keys(case, context)


@pytest.mark.parametrize("case", CASES)
def test_compat_token_database_metadata_equals_upstream_on_every_rank(case: Case) -> None:
    plan = plan_for(COMPAT, case)
    ours = [db.metadata for rank in case.ranks() for db in plan_databases(plan, case, rank)]
    theirs = [db.metadata for rank in case.ranks() for db in upstream(case, rank).token_dbs]
    assert ours == theirs


def pcp_with_dcp(param: Any) -> bool:
    return "pcp2-dcp" in param.id


@pytest.mark.parametrize("context", KEY_CONTEXTS.values(), ids=KEY_CONTEXTS.keys())
@pytest.mark.parametrize("case", [param for param in CASES if not pcp_with_dcp(param)])
def test_compat_lookup_prefixes_equal_upstream(case: Case, context: KeyContext) -> None:
    theirs = upstream(case, context=context)._lookup_key_prefixes
    assert binding.lookup_key_prefixes(plan_for(COMPAT, case, context)) == theirs


# Head counts 1 and 2 already give every factor the worker can see; the full grid is covered above.
# (Under PCP with DCP upstream's lookup set is broken; see the dedicated test.)
@pytest.mark.parametrize("case", [param for param in CASES if param.values[0].heads <= 2 and not pcp_with_dcp(param)])
def test_policy_worker_override_points_answer_like_upstream_under_compat(case: Case) -> None:
    for rank in case.ranks():
        ours = policy_worker(COMPAT, case, rank, "tenant-a")
        theirs = upstream(case, rank, KeyContext.for_model(MODEL, "tenant-a"))
        assert (
            ours._group_tp_replication_factors,
            [db.key_for(HASH) for db in ours.token_dbs],
            [db.metadata for db in ours.token_dbs],
            ours._lookup_key_prefixes,
        ) == (
            theirs._group_tp_replication_factors,
            [db.key_for(HASH) for db in theirs.token_dbs],
            [db.metadata for db in theirs.token_dbs],
            theirs._lookup_key_prefixes,
        )


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_an_attention_free_model_gets_upstreams_factors_and_keys_under_compat(tp: int) -> None:
    # vLLM reports 0 KV heads for mamba, mamba2 and falcon_mamba.
    case = Case((mamba(), mamba()), tp=tp, heads=0)
    assert plan_for(COMPAT, case).factors == upstream(case)._group_tp_replication_factors == (1, 1)
    assert plan_keys(COMPAT, case) == upstream_keys(case)


@pytest.mark.parametrize("case", [param for param in CASES if pcp_with_dcp(param)])
def test_under_pcp_with_dcp_upstreams_lookup_misses_its_own_keys_and_compats_finds_them(case: Case) -> None:
    # vLLM 0.32 writes with the DCP group's rank (the PCP axis first) but looks up with
    # tp_rank % dcp_size, so no stock instance ever hits there; vllm-compat writes the same keys and
    # looks up the namespaces it writes.
    written = {split_chunk_key(key)[0] for key in upstream_keys(case)}
    theirs = {prefix for group in upstream(case)._lookup_key_prefixes for prefix in group}
    ours = {prefix for group in binding.lookup_key_prefixes(plan_for(COMPAT, case)) for prefix in group}
    assert theirs - written and ours == written


def test_policy_worker_exposes_the_plan_it_keyed_with() -> None:
    # DEFAULT audits the MLA group, so planning reads published demotions (none in the store
    # set_upstream_state gives) and agrees on them over TP: one rank alone here.
    case = Case((mla(), full(), mamba()), tp=4, heads=2)
    worker = policy_worker(DEFAULT, case, (1, 0, 0))
    assert worker.plan is not None and worker.token_dbs[0].key_for(HASH) == chunk_key(
        worker.plan.key_prefix(0, 1), HASH.hex()
    )


def test_policy_worker_keys_carry_the_store_namespace_upstream_selects() -> None:
    case, rank, extra_config = Case((full(),), tp=2, heads=4), (1, 0, 0), {"store_tp_size": 3}
    reference = object.__new__(MooncakeStoreWorker)
    set_upstream_state(reference, case, rank)
    _, namespace, _ = reference._select_store_layout(extra_config)
    theirs = upstream(case, rank, KeyContext.for_model(MODEL, store_namespace=namespace))
    ours = policy_worker(COMPAT, case, rank, extra_config=extra_config)
    assert namespace and [db.key_for(HASH) for db in ours.token_dbs] == [db.key_for(HASH) for db in theirs.token_dbs]


# --- default differs from compat only where vLLM 0.32 has no rule ---------------------------------------


def hint_free(param: Any) -> bool:
    """No replication hint set, no plugin class and no DCP: the cases where default must equal compat.
    (Under DCP vLLM's rule makes every factor 1, vllm#51386; default keeps ranks of equal dcp rank
    together, see the DCP tests below.)"""
    return not any(hint in param.id for hint in ("tp_replicated", "max_tp_shards", "plugin", "Plugin", "dcp"))


HINT_FREE_CASES = [param for param in CASES if hint_free(param)]


@pytest.mark.parametrize("case", HINT_FREE_CASES)
def test_default_factors_equal_compat_when_no_hint_is_set_and_every_class_is_known(case: Case) -> None:
    assert plan_for(DEFAULT, case).factors == plan_for(COMPAT, case).factors


@pytest.mark.parametrize("case", HINT_FREE_CASES)
def test_default_keys_differ_from_compat_only_by_the_plan_fingerprint(case: Case) -> None:
    fingerprint = plan_for(DEFAULT, case, PREFIXED).fingerprint
    compat = plan_keys(COMPAT, case, PREFIXED)
    assert plan_keys(DEFAULT, case, PREFIXED) == [
        key.replace("@tp_rank:", f"@plan:{fingerprint}@tp_rank:") for key in compat
    ]


@pytest.mark.parametrize("case", HINT_FREE_CASES)
def test_default_lookup_prefixes_differ_from_compat_only_by_the_plan_fingerprint(case: Case) -> None:
    default = plan_for(DEFAULT, case)
    assert binding.lookup_key_prefixes(default) == tuple(
        tuple(prefix.replace("@tp_rank:", f"@plan:{default.fingerprint}@tp_rank:") for prefix in group)
        for group in binding.lookup_key_prefixes(plan_for(COMPAT, case))
    )


@pytest.mark.parametrize("tp, dcp, expected", [(2, 2, 1), (4, 2, 2), (8, 2, 4), (8, 4, 2)])
def test_default_writes_mla_once_per_dcp_rank_where_compat_and_upstream_write_it_on_every_rank(
    tp: int, dcp: int, expected: int
) -> None:
    case = Case((mla(),), tp=tp, heads=1, dcp=dcp)
    assert factors(case) == ((expected,), (1,), (1,))
    assert len(plan_for(DEFAULT, case).groups[0].lookup_namespaces) == dcp


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_default_replicates_mamba_state_declared_tp_replicated_where_compat_and_upstream_shard_it(tp: int) -> None:
    case = Case((mamba(tp_replicated=True),), tp=tp, heads=1)
    assert factors(case) == ((tp,), (1,), (1,))


@pytest.mark.parametrize("tp, heads, expected", [(8, 8, 4), (4, 4, 2), (2, 2, 1), (8, 1, 4)])
def test_default_replicates_attention_beyond_max_tp_shards_where_compat_and_upstream_use_kv_heads(
    tp: int, heads: int, expected: int
) -> None:
    case = Case((full(max_tp_shards=2),), tp=tp, heads=heads)
    upstream_factor = max(1, tp // heads)
    assert factors(case) == ((expected,), (upstream_factor,), (upstream_factor,))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_default_shards_a_spec_class_no_rule_knows_where_compat_and_upstream_apply_kv_heads(tp: int) -> None:
    case = Case((PluginStateSpec(block_size=BLOCK),), tp=tp, heads=1)
    assert factors(case) == ((1,), (tp,), (tp,))


# --- store.py against vLLM's send-thread arithmetic ---------------------------------------------

NUM_CHUNKS = 11
HASHES = [BlockHash(index.to_bytes(4, "big") * 8) for index in range(NUM_CHUNKS)]
SCHEDULE_CASES = {
    "mla+full+mamba-tp4-heads2": Case((mla(), full(), mamba()), tp=4, heads=2),
    "mla+full+mamba-tp8-heads2": Case((mla(), full(), mamba()), tp=8, heads=2),
    "uniform{mla,full}+mla-tp4-heads1": Case((uniform(mla(), full()), mla()), tp=4, heads=1),
    "full-tp2-dcp2": Case((full(),), tp=2, heads=1, dcp=2),
    "mla+full+mamba-tp8-dcp2": Case((mla(), full(), mamba()), tp=8, heads=1, dcp=2),
    "mla+full-tp8-dcp4-heads2": Case((mla(), full()), tp=8, heads=2, dcp=4),
}


def scheduled(policy: Policy, schedule: Schedule) -> Policy:
    return policy.model_copy(update={"schedule": schedule})


def send_thread_chunks(plan: Plan, case: Case, tp_rank: int, group: int, mask_num: int) -> set[int]:
    """The chunk indices KVCacheStoreSendingThread._handle_request stores for (rank, group), with its
    ``tp_rank`` attribute as the worker sets it (``binding.send_thread_rank``)."""
    steps = binding.group_put_steps(plan)
    if not binding.group_participates(plan, tp_rank, [True] * len(plan.groups))[group]:
        return set()
    database = plan_databases(plan, case, (tp_rank, 0, 0))[group]
    step = steps[group]
    return {
        start // database.block_size
        for start, _, _ in database.process_tokens(
            NUM_CHUNKS * BLOCK, HASHES, mask_num, put_step=step,
            put_step_rank=(binding.send_thread_rank(plan, tp_rank) + group) % step
        )
    }


@pytest.mark.parametrize("mask_num", [0, 3 * BLOCK], ids=["from-start", "resumed"])
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda schedule: schedule.value)
@pytest.mark.parametrize("case", SCHEDULE_CASES.values(), ids=SCHEDULE_CASES.keys())
def test_send_thread_writes_exactly_the_chunks_the_plan_schedules(
    case: Case, schedule: Schedule, mask_num: int
) -> None:
    plan = plan_for(scheduled(DEFAULT, schedule), case)
    first = mask_num // BLOCK
    for group, group_plan in enumerate(plan.groups):
        for rank in group_plan.ranks:
            expected = {chunk for chunk in range(first, NUM_CHUNKS) if rank.schedule.writes(chunk)}
            assert send_thread_chunks(plan, case, rank.tp_rank, group, mask_num) == expected, (group, rank.tp_rank)


def test_every_chunk_has_one_writer_per_replica_set_under_dcp() -> None:
    case = SCHEDULE_CASES["mla+full+mamba-tp8-dcp2"]
    plan = plan_for(DEFAULT, case)
    for group, group_plan in enumerate(plan.groups):
        chunks = {rank.tp_rank: send_thread_chunks(plan, case, rank.tp_rank, group, 0) for rank in group_plan.ranks}
        for replica_set in {rank.replica_set for rank in group_plan.ranks}:
            written = sorted(chunk for member in replica_set for chunk in chunks[member])
            assert written == list(range(NUM_CHUNKS)), (group, replica_set)


def test_the_send_thread_rank_is_the_tp_rank_without_dcp_and_its_dcp_stripe_with_it() -> None:
    plain = plan_for(DEFAULT, Case((mla(),), tp=4, heads=1))
    strided = plan_for(DEFAULT, Case((mla(),), tp=8, heads=1, dcp=2))
    assert [binding.send_thread_rank(plain, rank) for rank in range(4)] == [0, 1, 2, 3]
    assert [binding.send_thread_rank(strided, rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda schedule: schedule.value)
def test_put_steps_are_the_factors_under_striped_and_one_otherwise(schedule: Schedule) -> None:
    plan = plan_for(scheduled(DEFAULT, schedule), Case((mla(), full(), mamba()), tp=4, heads=2))
    assert binding.group_put_steps(plan) == ((4, 2, 1) if schedule is Schedule.STRIPED else (1, 1, 1))


def test_only_replica_set_leaders_participate_under_leader() -> None:
    plan = plan_for(scheduled(DEFAULT, Schedule.LEADER), Case((mla(), full(), mamba()), tp=4, heads=2))
    assert [binding.group_participates(plan, rank, [True] * 3) for rank in range(4)] == [
        [True, True, True],
        [False, False, True],
        [False, True, True],
        [False, False, True],
    ]


def test_a_group_vllm_would_not_save_never_participates() -> None:
    plan = plan_for(scheduled(DEFAULT, Schedule.ALL), Case((mla(), full(), mamba()), tp=2, heads=2))
    assert binding.group_participates(plan, 0, [True, False, True]) == [True, False, True]


def test_plan_store_layout_keys_are_chunk_keys_in_the_plan_namespace() -> None:
    case = Case((mla(), full(), mamba()), tp=4, heads=2, pcp=2, pp=2)
    plan = plan_for(DEFAULT, case)
    databases = plan_databases(plan, case, (3, 1, 1))
    assert [db.store_layout.key_for(0, HASH) for db in databases] == [
        chunk_key(plan.key_prefix(group, 3, 1, 1), HASH.hex()) for group in range(3)
    ]


def test_plan_store_layout_lookup_prefixes_are_the_plan_namespaces() -> None:
    case = Case((mla(), full(), mamba()), tp=4, heads=2, pp=2)
    plan = plan_for(DEFAULT, case)
    assert [db.store_layout.lookup_key_prefixes([(0, 0, 0, 0)]) for db in plan_databases(plan, case, (2, 0, 1))] == [
        group.lookup_namespaces for group in plan.groups
    ]


def test_token_database_metadata_carries_group_index_and_shard() -> None:
    case = Case((mla(), full(), mamba()), tp=4, heads=2)
    databases = plan_databases(plan_for(DEFAULT, case), case, (3, 0, 0))
    assert [(db.metadata.group_id, db.metadata.tp_rank) for db in databases] == [(0, 0), (1, 1), (2, 3)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_name", "Other-Model"),
        ("cache_prefix", "tenant-b"),
        ("store_namespace", "@x"),
        ("dcp_rank", 1),
        ("pp_rank", 1),
    ],
)
def test_metadata_that_disagrees_with_the_plan_is_refused(field: str, value: object) -> None:
    case = Case((full(),), tp=2, heads=1)
    metadata = dataclasses.replace(metadata_for(case, (0, 0, 0)), **{field: value})
    with pytest.raises(ValueError, match=field):
        store.build_token_databases(
            plan_for(COMPAT, case),
            tp_rank=0,
            pcp_rank=0,
            pp_rank=0,
            block_sizes=[BLOCK],
            hash_block_sizes=[BLOCK],
            metadata=metadata,
        )


def test_block_sizes_must_cover_every_plan_group() -> None:
    case = Case((mla(), full()), tp=2, heads=1)
    with pytest.raises(ValueError, match="2 groups"):
        store.build_token_databases(
            plan_for(COMPAT, case), tp_rank=0, pcp_rank=0, pp_rank=0, block_sizes=[BLOCK], hash_block_sizes=[BLOCK],
            metadata=metadata_for(case, (0, 0, 0)),
        )


def test_lookup_key_prefixes_are_per_group_in_plan_order() -> None:
    plan = plan_for(COMPAT, Case((mla(), full(), mamba()), tp=4, heads=2))
    assert [len(prefixes) for prefixes in binding.lookup_key_prefixes(plan)] == [1, 2, 4]

