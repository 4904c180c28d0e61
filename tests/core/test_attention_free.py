"""Attention-free models: vLLM reports 0 KV heads for ``mamba``, ``mamba2`` and ``falcon_mamba``."""

from __future__ import annotations

import textwrap

import pytest
from core_support import full, layout, mamba, upstream_factor

from kvpolicy.documents.loader import check_text, load_policy, shipped_policy_names
from kvpolicy.language.models import Topology
from kvpolicy.planning.engine import make_plan


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("policy_name", shipped_policy_names())
def test_an_attention_free_model_plans_under_every_shipped_policy(policy_name: str, tp_size: int) -> None:
    plan = make_plan(load_policy(policy_name), layout(mamba(), mamba(), heads=0), Topology(tp_size=tp_size))
    assert plan.factors == (1, 1)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_an_attention_free_model_gets_upstreams_factors_under_vllm_compat(tp_size: int) -> None:
    model = layout(mamba(), heads=0)
    expected = tuple(
        upstream_factor(group, tp_size=tp_size, dcp_size=1, total_num_kv_heads=0) for group in model.groups
    )
    assert make_plan(load_policy("vllm-compat"), model, Topology(tp_size=tp_size)).factors == expected == (1,)


def test_a_declared_replicated_state_of_an_attention_free_model_is_shared() -> None:
    plan = make_plan(load_policy("default"), layout(mamba(tp_replicated=True), heads=0), Topology(tp_size=4))
    assert plan.factors == (4,)


def test_zero_heads_with_an_attention_group_is_refused_naming_the_group() -> None:
    with pytest.raises(ValueError, match=r"total_num_kv_heads is 0 .* group 1 holds attention \(FullAttentionSpec\)"):
        layout(mamba(), full(), heads=0)


def test_zero_heads_with_an_attention_group_is_a_located_validation_error() -> None:
    text = textwrap.dedent(
        """\
        version: 1
        kind: ModelLayout
        model: state-spaces/mamba2-130m
        total_num_kv_heads: 0
        groups:
          - spec: {type: FullAttentionSpec, bases: [AttentionSpec, KVCacheSpec], block_size: 16, page_size_bytes: 4096}
            layers: [model.layers.0.attn]
        """
    )
    document, problems = check_text(text, "inline.yaml")
    assert document is None and [str(problem) for problem in problems] == [
        "inline.yaml:6:3: error: groups: total_num_kv_heads is 0 (an attention-free model) but group 0 holds attention "
        "(FullAttentionSpec); set the model's KV-head count [KVP104]"
    ]


def test_negative_heads_stay_invalid() -> None:
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        layout(mamba(), heads=-1)
