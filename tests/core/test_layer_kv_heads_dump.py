"""``dump_layout`` writes a layout's ``layer_kv_heads`` (as a captured layout file has them); they read back equal."""

from __future__ import annotations

import yaml
from core_support import full

from kvpolicy.documents.loader import check_text
from kvpolicy.language.dumper import dump_layout
from kvpolicy.language.models import Layout

ATTENTION = [f"model.layers.{index}.self_attn.attn" for index in range(8)]


def with_own_heads(*entries: tuple[int, list[str]]) -> Layout:
    return Layout.model_validate({
        "version": 1, "kind": "ModelLayout", "model": "org/own-heads", "total_num_kv_heads": 4,
        "layer_kv_heads": [{"total_num_kv_heads": heads, "layers": layers} for heads, layers in entries],
        "groups": [{"name": "full", "spec": full(), "layers": ATTENTION}],
    })


def test_layer_kv_heads_read_back_equal() -> None:
    layout = with_own_heads((2, ATTENTION[:5]), (1, [ATTENTION[7]]))
    assert check_text(dump_layout(layout)) == (layout, [])


def test_consecutive_layers_of_an_entry_are_written_as_a_range() -> None:
    data = yaml.safe_load(dump_layout(with_own_heads((2, ATTENTION[:5] + [ATTENTION[7]]))))
    assert data["layer_kv_heads"] == [
        {"total_num_kv_heads": 2, "layers": ["model.layers.{0..4}.self_attn.attn", ATTENTION[7]]}
    ]


def test_a_layout_without_own_heads_has_no_layer_kv_heads_key() -> None:
    assert "layer_kv_heads" not in yaml.safe_load(dump_layout(with_own_heads()))


def test_layer_kv_heads_follow_the_model_wide_count() -> None:
    keys = list(yaml.safe_load(dump_layout(with_own_heads((2, ATTENTION[:1])))))
    assert keys.index("layer_kv_heads") == keys.index("total_num_kv_heads") + 1
