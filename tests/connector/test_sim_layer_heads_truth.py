"""The simulation's ground truth per layer: a layer's heads repeat over ``tp // its own KV heads``
ranks, rank ``r`` holding head ``r * heads // tp`` as vLLM's ``QKVParallelLinear`` places them; a
simulated model carries those counts in vLLM's own per-layer architecture config, where the
connector's layout adapter reads them into ``layer_kv_heads`` as on an engine. No store: vLLM's spec
and config objects, and the bytes :mod:`kvpolicy.sim.content` says each rank holds."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import require

require("vllm")

from vllm.v1.core.kv_cache_utils import BlockHash  # noqa: E402

from kvpolicy.language.models import Layout  # noqa: E402
from kvpolicy.sim.archetypes import (  # noqa: E402
    ARCHETYPES,
    LAYER_HEADS_ARCHETYPES,
    Archetype,
    archetype_from_layout,
    get_archetype,
    spec_physical_factor,
)
from kvpolicy.sim.content import rank_truth  # noqa: E402
from kvpolicy.sim.model import SimulatedModel, build_model  # noqa: E402

NAS = get_archetype("nas-like")
GEMMA = get_archetype("gemma4-like")
CHUNK = BlockHash(bytes(range(32)))
SIZE = 64


def attn(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def model(archetype: Archetype | str, tp_size: int) -> SimulatedModel:
    return build_model(archetype, tp_size, model_name="org/layer-heads", blocks_needed=8)


def head_bytes(simulated: SimulatedModel, layer: str, tp_rank: int, local_head: int) -> Any:
    """What ``tp_rank`` holds in its KV head ``local_head`` of ``layer`` (K, tensor part 0)."""
    local_heads = simulated.archetype.specs(simulated.tp_size)[layer].num_kv_heads  # type: ignore[attr-defined]
    return rank_truth(
        0, simulated.layer_true_factors, tp_rank, simulated.tp_size, layer, 0, CHUNK, SIZE,
        local_head=local_head, local_heads=local_heads,
    )


def nas_layout(**extra: Any) -> Layout:
    """``nas-like`` as a layout document: one full-attention group; the model-wide count is the first
    block's 2, blocks 1 and 3 have 8 heads of their own."""
    return Layout.model_validate({
        "version": 1, "kind": "ModelLayout", "model": "org/nas-like", "total_num_kv_heads": 2,
        "layer_kv_heads": [{"total_num_kv_heads": 8, "layers": [attn(1), attn(3)]}],
        "groups": [{
            "name": "full",
            "spec": {
                "type": "FullAttentionSpec", "bases": ["AttentionSpec", "KVCacheSpec"], "block_size": 16,
                "page_size_bytes": "2 * block_size * max(1, total_num_kv_heads // tp_size) * 64 * 2",
                "fields": {
                    "num_kv_heads": {"expr": "max(1, total_num_kv_heads // tp_size)"}, "head_size": 64,
                    "head_size_v": 64, "dtype": "bfloat16", "dcp_sharded": True, "max_tp_shards": None,
                },
            },
            "layers": "model.layers.{0..3}.self_attn.attn",
        }],
        **extra,
    })


# --- physical factors -----------------------------------------------------------------------------


def test_a_layers_physical_factor_comes_from_its_own_kv_heads() -> None:
    # Heads 2, 8, 4, 8 at TP 8: each repeats over 8 // heads ranks.
    assert NAS.true_factors(8) == {attn(0): 4, attn(1): 1, attn(2): 2, attn(3): 1}


def test_a_group_of_layers_with_different_heads_repeats_over_the_gcd_of_their_factors() -> None:
    assert model(NAS, 8).true_factors == (1,)


def test_gemma_like_groups_repeat_over_their_own_layers_heads() -> None:
    # Sliding layers: 1 head on all 4 ranks; full layers: 2 heads, each on 2 ranks.
    assert model(GEMMA, 4).true_factors == (4, 2)


@pytest.mark.parametrize("tp_size", [1, 2, 4])  # the hybrids' 4 state heads do not split over 8 ranks
@pytest.mark.parametrize("name", ARCHETYPES)
def test_archetypes_without_own_heads_keep_the_model_wide_truth(name: str, tp_size: int) -> None:
    archetype = ARCHETYPES[name]
    model_wide = archetype.kv_heads(tp_size)
    assert not archetype.layer_kv_heads
    assert archetype.true_factors(tp_size) == {
        layer: spec_physical_factor(spec, model_wide, tp_size) for layer, spec in archetype.specs(tp_size).items()
    }


def test_every_layer_of_own_heads_builds_a_spec_of_those_heads() -> None:
    for archetype in LAYER_HEADS_ARCHETYPES.values():
        for tp_size in (1, 2, 4, 8):
            per_rank = {layer: spec.num_kv_heads for layer, spec in archetype.specs(tp_size).items()}  # type: ignore[attr-defined]
            assert per_rank == {
                layer: max(1, archetype.layer_heads(layer, tp_size) // tp_size) for layer, _ in archetype.layers
            }


def test_an_archetype_refuses_own_heads_for_a_layer_it_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"layer_kv_heads names layers it does not have: \['model.layers.9"):
        Archetype("bad", "", 2, NAS.layers, NAS.kinds, {attn(9): 8})


# --- what each rank holds ---------------------------------------------------------------------------


@pytest.mark.parametrize("index, heads", [(0, 2), (1, 8), (2, 4)])
def test_rank_r_holds_head_r_times_heads_over_tp(index: int, heads: int) -> None:
    simulated, layer = model(NAS, 8), attn(index)
    held = [head_bytes(simulated, layer, rank, 0) for rank in range(8)]
    for rank in range(8):
        for other in range(8):
            same_head = rank * heads // 8 == other * heads // 8
            assert held[rank].equal(held[other]) is same_head, (rank, other)


@pytest.mark.parametrize("index, heads", [(0, 2), (1, 8), (2, 4)])
def test_a_head_holds_the_same_bytes_at_tp_8_as_at_tp_2(index: int, heads: int) -> None:
    # At TP 2 a rank holds heads // 2 consecutive heads; at TP 8 rank r holds head r * heads // 8.
    tp8, tp2, layer = model(NAS, 8), model(NAS, 2), attn(index)
    per_rank_at_2 = heads // 2
    for rank in range(8):
        head = rank * heads // 8
        at_2 = head_bytes(tp2, layer, head // per_rank_at_2, head % per_rank_at_2)
        assert head_bytes(tp8, layer, rank, 0).equal(at_2), rank


# --- the layout the connector gets ----------------------------------------------------------------


@pytest.mark.parametrize("archetype, tp_size", [(NAS, 8), (NAS, 2), (GEMMA, 2)], ids=["nas-tp8", "nas-tp2", "gemma-tp2"])
def test_a_simulated_models_layout_states_each_layers_own_kv_heads(archetype: Archetype, tp_size: int) -> None:
    layout = model(archetype, tp_size).layout
    assert (layout.total_num_kv_heads, dict(layout.kv_heads_by_layer)) == (2, dict(archetype.layer_kv_heads))


def test_a_model_without_own_heads_has_a_layout_without_layer_kv_heads() -> None:
    assert model("gqa-8kv", 4).layout.layer_kv_heads == ()


def test_a_simulated_model_config_gives_each_layer_its_heads_as_vllms_architecture_config_does() -> None:
    arch_config = model(NAS, 8).vllm_config.model_config.model_arch_config  # type: ignore[union-attr]
    assert arch_config.total_num_kv_heads == 2
    assert [arch_config[index].total_num_kv_heads for index in range(4)] == [2, 8, 4, 8]


def test_a_model_without_own_heads_runs_without_a_model_config() -> None:
    assert model("gqa-8kv", 4).vllm_config.model_config is None


# --- archetypes from layout documents -------------------------------------------------------------


def test_an_archetype_from_a_layout_keeps_each_layers_own_kv_heads() -> None:
    archetype = archetype_from_layout(nas_layout())
    assert dict(archetype.layer_kv_heads) == {attn(1): 8, attn(3): 8}
    assert archetype.true_factors(8) == {attn(0): 4, attn(1): 1, attn(2): 4, attn(3): 1}


def test_layers_per_group_keeps_layers_of_every_kv_head_count() -> None:
    archetype = archetype_from_layout(nas_layout(), layers_per_group=1)
    assert [layer for layer, _ in archetype.layers] == [attn(0), attn(1)]
    assert dict(archetype.layer_kv_heads) == {attn(1): 8}


def test_a_layout_spec_has_its_layers_own_heads_per_rank() -> None:
    specs = archetype_from_layout(nas_layout(), num_kv_heads=None).specs(2)
    assert {layer: spec.num_kv_heads for layer, spec in specs.items()} == {  # type: ignore[attr-defined]
        attn(0): 1, attn(1): 4, attn(2): 1, attn(3): 4
    }
