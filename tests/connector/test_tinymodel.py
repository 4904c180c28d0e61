"""The tiny models the e2e tests serve: what each architecture writes, and that it is reproducible.

Whether a model's outputs depend on its recurrent state is checked where it matters, on a real
engine: tests/e2e/test_hybrid_engine.py loads another rank's state and requires the logprobs to move.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import require

require("transformers")
require("safetensors")

from safetensors.torch import load_file  # noqa: E402

from kvpolicy.harness.tinymodel import ARCHITECTURES, HYBRIDS, make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[tuple[str, int], Path] = {}

    def get(name: str, kv_heads: int = 1) -> Path:
        if (name, kv_heads) not in cache:
            cache[name, kv_heads] = make_tiny_model(name, root / f"{name}-kv{kv_heads}", num_kv_heads=kv_heads)
        return cache[name, kv_heads]

    return get


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_config_names_the_architecture_dtype_and_kv_heads(written, name: str) -> None:
    config = json.loads((written(name, 2) / "config.json").read_text())
    entry = ARCHITECTURES[name]
    assert (config["architectures"], config["dtype"], config["num_key_value_heads"]) == (
        [entry.architecture],
        entry.dtype,
        2,
    )


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_same_arguments_write_the_same_weights(written, name: str, tmp_path: Path) -> None:
    again = make_tiny_model(name, tmp_path / name, num_kv_heads=1)
    assert (again / "model.safetensors").read_bytes() == (written(name) / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_state_parameters_keep_the_state_alive(written, name: str) -> None:
    weights = load_file(written(name) / "model.safetensors")
    decays = [tensor for key, tensor in weights.items() if key.endswith("A_log")]
    biases = [tensor for key, tensor in weights.items() if key.endswith("dt_bias")]
    norms = [tensor for key, tensor in weights.items() if "norm" in key and key.endswith("weight")]
    assert norms and all(bool((tensor.float() == 1).all()) for tensor in norms)
    assert all(bool(((tensor.float() >= 0) & (tensor.float() < 1.5)).all()) for tensor in decays)
    assert all(bool((tensor.float() == 0).all()) for tensor in biases)
    if name != "lfm2":  # a short convolution has no decay
        assert decays and biases


def test_lfm2_states_the_fields_vllm_reads(written) -> None:
    config = json.loads((written("lfm2") / "config.json").read_text())
    assert config["conv_dim"] == config["block_dim"] == config["hidden_size"]


def test_kv_heads_must_divide_the_attention_heads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be positive and divide"):
        make_tiny_model("qwen3-next", tmp_path / "bad", num_kv_heads=3)


def test_unknown_architecture_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: llama, qwen3-next, nemotron-h, lfm2"):
        make_tiny_model("jamba", tmp_path / "jamba", num_kv_heads=1)
