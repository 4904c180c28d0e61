"""vLLM's TP-sharded store layouts on the production worker: ``vllm-compat`` is key-for-key vLLM's own
worker, and a TP 4 prefill and a TP 2 decode instance share one store with every byte right.

Upstream's side is vLLM's ``MooncakeStoreWorker`` built by the same standalone path as kvpolicy's
(:func:`kvpolicy.vllm.internals.init_standalone`), over vLLM's own ``KVCacheConfig`` for the model
(:func:`kvpolicy.sim.build_model`): its ``_select_store_layout``, token databases and lookup prefixes
run unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import NoPublishedDemotions, require

require("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash  # noqa: E402

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.language.models import Topology  # noqa: E402
from kvpolicy.planning.store_layout import select_store_layout  # noqa: E402
from kvpolicy.runtime.binding import RankPlace  # noqa: E402
from kvpolicy.sim.model import SimulatedModel, build_model  # noqa: E402
from kvpolicy.vllm.internals import init_standalone  # noqa: E402
from kvpolicy.vllm.worker import KVPolicyStoreWorker  # noqa: E402

HASHES = [BlockHash(bytes([value]) * 32) for value in (1, 2)]

SELECTION_CASES = [
    pytest.param(archetype, tp, extra, kv_layout, id=f"{archetype}-tp{tp}-{kv_layout}-{label}")
    for archetype, tp, extra, kv_layout, label in [
        ("gqa-8kv", 1, {"store_tp_size": 8}, "LBHNC", "st8"),
        ("gqa-8kv", 2, {"store_tp_size": 4}, "LBNHC", "st4"),
        ("gqa-8kv", 4, {"store_tp_size": 2}, "LBHNC", "st2-below-tp"),
        ("gqa-8kv", 2, {"store_tp_size": 16}, "LBHNC", "st16-beyond-heads"),
        ("gqa-8kv", 2, {"store_tp_size": 6}, "LBHNC", "st6-not-a-divisor"),
        ("gqa-8kv", 2, {"enable_store_tp_lcm": True, "prefill_tp_sizes": [4, 2]}, "LBHNC", "lcm4"),
        ("gqa-8kv", 2, {"enable_store_tp_lcm": True, "prefill_tp_sizes": "4"}, "LBHNC", "lcm-bad"),
        ("gqa-8kv", 2, {"store_tp_size": "4"}, "LBHNC", "st-string"),
        ("gqa-8kv", 2, {"store_tp_size": 4, "enable_cross_layers_blocks": "true"}, "LBHNC", "cross-layers"),
        ("gqa-8kv", 2, {}, "LBHNC", "none"),
        ("gqa-kv-lt-tp", 2, {"store_tp_size": 4}, "LBHNC", "mqa"),
        ("mla", 2, {"store_tp_size": 2}, "LBHNC", "mla"),
        ("gqa-mamba", 2, {"store_tp_size": 2}, "LBHNC", "hybrid"),
        ("sliding-window-full", 2, {"store_tp_size": 2}, "LBNHC", "two-groups"),
    ]
]


def model_for(archetype: str, tp: int, extra: dict[str, Any], kv_layout: str, pp: int = 1) -> SimulatedModel:
    return build_model(
        archetype, tp, model_name="org/store-tp", blocks_needed=8, extra_config=extra, kv_cache_layout=kv_layout,
        pp_size=pp,
    )


def place(model: SimulatedModel, tp_rank: int, pp_rank: int) -> RankPlace:
    pp_size = model.vllm_config.parallel_config.pipeline_parallel_size
    return RankPlace(tp_rank=tp_rank, tp_size=model.tp_size, pp_rank=pp_rank, pp_size=pp_size)


def upstream_worker(model: SimulatedModel, tp_rank: int, pp_rank: int = 0) -> MooncakeStoreWorker:
    worker = MooncakeStoreWorker.__new__(MooncakeStoreWorker)
    init_standalone(
        worker, model.vllm_config, model.kv_cache_config, place=place(model, tp_rank, pp_rank),
        store=NoPublishedDemotions(), model=model.name, total_num_kv_heads=model.total_num_kv_heads,
    )
    return worker


def policy_worker(model: SimulatedModel, tp_rank: int, policy: str = "vllm-compat", pp_rank: int = 0) -> KVPolicyStoreWorker:
    return KVPolicyStoreWorker.standalone(
        model.vllm_config, model.kv_cache_config, policy=load_policy(policy),
        place=place(model, tp_rank, pp_rank), store=NoPublishedDemotions(), model=model.name,
        total_num_kv_heads=model.total_num_kv_heads, gather=lambda payload: [payload] * model.tp_size,
    )


def store_view(worker: MooncakeStoreWorker) -> list[Any]:
    """What a worker's store traffic is made of: per group, the store shards it writes, their chunk
    keys, the lookup prefixes and the metadata vLLM reports in events."""
    view = []
    for group, database in enumerate(worker.token_dbs):
        layout = database.store_layout
        metadata = database.metadata
        view.append(
            {
                "layout": [cls.__name__ for cls in type(layout).__mro__ if cls.__module__.startswith("vllm.")][0],
                "shards": tuple(layout.local_shard_ids),
                "keys": [layout.key_for(shard, chunk) for shard in layout.local_shard_ids for chunk in HASHES],
                "lookup": tuple(worker._lookup_key_prefixes[group]),
                "metadata": (metadata.tp_rank, metadata.group_id, metadata.store_namespace),
            }
        )
    return view


@pytest.mark.parametrize("archetype, tp, extra, kv_layout", SELECTION_CASES)
def test_the_store_layout_kvpolicy_predicts_is_the_one_vllm_selects(
    archetype: str, tp: int, extra: dict[str, Any], kv_layout: str
) -> None:
    model = model_for(archetype, tp, extra, kv_layout)
    store_tp, namespace, layout_cls = upstream_worker(model, 0)._select_store_layout(dict(extra))
    predicted = select_store_layout(model.layout, Topology(tp_size=tp), extra, kv_cache_layout=kv_layout)
    assert predicted.store_namespace == namespace
    if layout_cls is None:
        assert predicted.sharding is None
    else:
        assert predicted.sharding is not None
        assert (predicted.sharding.store_tp_size, predicted.sharding.store_format) == (store_tp, layout_cls.store_format)


@pytest.mark.parametrize("archetype, tp, extra, kv_layout", SELECTION_CASES)
def test_compat_keys_lookups_and_metadata_equal_upstream_on_every_rank(
    archetype: str, tp: int, extra: dict[str, Any], kv_layout: str
) -> None:
    model = model_for(archetype, tp, extra, kv_layout)
    for tp_rank in range(tp):
        upstream, ours = upstream_worker(model, tp_rank), policy_worker(model, tp_rank)
        assert ours._group_tp_replication_factors == upstream._group_tp_replication_factors
        assert store_view(ours) == store_view(upstream)


@pytest.mark.parametrize(
    "archetype, tp, extra",
    [("gqa-8kv", 2, {"store_tp_size": 4}), ("gqa-kv-lt-tp", 2, {"store_tp_size": 4}), ("mla", 2, {"store_tp_size": 2})],
    ids=["sharded", "mqa", "rank-local-fallback"],
)
def test_compat_equals_upstream_on_every_tp_and_pp_rank_under_pipeline_parallelism(
    archetype: str, tp: int, extra: dict[str, Any]
) -> None:
    model = model_for(archetype, tp, extra, "LBHNC", pp=2)
    for pp_rank in range(2):
        for tp_rank in range(tp):
            upstream, ours = upstream_worker(model, tp_rank, pp_rank), policy_worker(model, tp_rank, pp_rank=pp_rank)
            assert store_view(ours) == store_view(upstream)


def test_the_equivalence_check_sees_a_store_shard_keyed_wrongly() -> None:
    """The comparison above has teeth: a worker whose rank 1 claims rank 0's store shards differs."""
    model = model_for("gqa-8kv", 2, {"store_tp_size": 4}, "LBHNC")
    ours, upstream = policy_worker(model, 1), upstream_worker(model, 1)
    layout = ours.token_dbs[0].store_layout
    layout._plan_prefixes = dict.fromkeys((2, 3), layout._plan_prefixes[2].replace("tp_rank:2", "tp_rank:0"))
    assert store_view(ours) != store_view(upstream)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_default_plans_the_sharded_layout_vllm_selects_and_shares_it_across_tp(tp: int) -> None:
    extra = {"store_tp_size": 8}
    here = policy_worker(model_for("gqa-8kv", tp, extra, "LBHNC"), 0, "default")
    reference = policy_worker(model_for("gqa-8kv", 8, extra, "LBHNC"), 0, "default")
    assert here.plan is not None and reference.plan is not None
    assert here.plan.store_sharding is not None and here.plan.fingerprint == reference.plan.fingerprint
    assert set(store_view(here)[0]["lookup"]) == set(store_view(reference)[0]["lookup"])
