"""Tiny copies from a configuration alone (:mod:`kvpolicy.harness.zoo.shrink`): what they keep is what
decides what TP ranks hold, stated here from each model's own configuration.

Every architecture vLLM serves whose configuration class transformers ships is shrunk, and each copy
must keep every TP-deciding field and every kept layer's kind (:func:`tp_deciding_changes`, which the
shrinker also runs on itself); the checker itself must see a changed field. Then named cases: Gemma-3's
five sliding layers and one full in order, DeepSeek-V3's three dense layers before MoE and its MLA
ranks, Gemma-3n's KV-sharing suffix, Nemotron-H's Mamba heads and groups against TP, Llama-4's
chunked-local layers, and the refusals of bad sources before anything heavy loads.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
from conftest import require

require("transformers")

from kvpolicy.harness.zoo import shrink  # noqa: E402
from kvpolicy.harness.zoo.names import causal_lm_types, model_types_of, vllm_text_architectures  # noqa: E402
from kvpolicy.harness.zoo.shrink import (  # noqa: E402
    TP_DECIDING,
    SourceError,
    cores_refusal,
    find_period,
    full_config,
    load_source,
    tp_deciding_changes,
    tp_refusal,
)

warnings.filterwarnings("ignore")

ARCHITECTURES = sorted(name for name in vllm_text_architectures() if model_types_of(name))


def test_the_names_are_read_from_the_installed_packages() -> None:
    import transformers.models.auto.modeling_auto as auto
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    assert set(causal_lm_types()) == set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert vllm_text_architectures() == frozenset(_TEXT_GENERATION_MODELS)
    assert len(ARCHITECTURES) >= 70  # 74 with vLLM 0.32.0 and transformers 5.19


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_copy_keeps_what_decides_what_tp_ranks_hold(architecture: str) -> None:
    copy = shrink(architecture)
    original = copy.original
    assert tp_deciding_changes(original, copy.config, copy.layers) == []
    for key in TP_DECIDING:
        if original.get(key) is not None and not isinstance(original[key], list):
            if key in ("first_k_dense_replace", "num_dense_layers", "num_kv_shared_layers", "moe_layer_start_index",
                       "prefix_dense_sliding_window_pattern"):
                continue  # recounted over the kept layers (checked through the layers' kinds)
            assert copy.config.get(key) == original[key], key
    assert copy.config["architectures"] == [architecture]
    assert 1 <= len(copy.layers) <= copy.model_layers
    # Something was shrunk: a copy as big as the model would not serve on 2 cores.
    assert copy.shrunk


def test_the_checker_sees_a_changed_kv_head_count_and_a_reordered_layer_pattern() -> None:
    copy = shrink("Gemma3ForCausalLM")
    original = full_config({"model_type": "gemma3_text"}, "gemma3_text")
    wrong = dict(copy.config, num_key_value_heads=1)
    assert any("num_key_value_heads" in problem for problem in tp_deciding_changes(original, wrong, copy.layers))
    reordered = dict(copy.config, layer_types=list(reversed(copy.config["layer_types"])))
    assert tp_deciding_changes(original, reordered, copy.layers)
    mla = shrink("DeepseekV3ForCausalLM")
    mla_original = full_config({"model_type": "deepseek_v3"}, "deepseek_v3")
    assert tp_deciding_changes(mla_original, dict(mla.config, kv_lora_rank=256), mla.layers)
    uneven_mla = dict(mla.config, v_head_dim=64)  # one head size halved, the others not
    assert tp_deciding_changes(mla_original, uneven_mla, mla.layers)


def test_gemma3_keeps_one_period_of_five_sliding_layers_and_one_full_in_order() -> None:
    copy = shrink("Gemma3ForCausalLM")
    original = full_config({"model_type": "gemma3_text"}, "gemma3_text")
    assert original["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert copy.config["num_hidden_layers"] == 6
    assert copy.config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert copy.config["sliding_window"] == original["sliding_window"]
    assert copy.config["num_key_value_heads"] == original["num_key_value_heads"]
    assert copy.config["head_dim"] == original["head_dim"]
    assert copy.config["hidden_size"] < original["hidden_size"] and copy.config["vocab_size"] < original["vocab_size"]


def test_deepseek_v3_keeps_its_dense_prefix_mla_ranks_and_shrinks_its_experts() -> None:
    copy = shrink("DeepseekV3ForCausalLM")
    original = full_config({"model_type": "deepseek_v3"}, "deepseek_v3")
    assert original["first_k_dense_replace"] == 3
    assert copy.layers == (0, 1, 2, 3, 4) and copy.config["first_k_dense_replace"] == 3
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                "num_attention_heads", "num_key_value_heads"):
        assert copy.config[key] == original[key], key
    assert copy.config["n_routed_experts"] < original["n_routed_experts"]
    experts_per_group = copy.config["n_routed_experts"] // copy.config["n_group"]
    assert copy.config["num_experts_per_tok"] <= copy.config["topk_group"] * experts_per_group


def test_gemma3n_keeps_its_kv_sharing_suffix_as_one_period() -> None:
    copy = shrink("Gemma3nForCausalLM")
    original = full_config({"model_type": "gemma3n_text"}, "gemma3n_text")
    period = original["layer_types"].index("full_attention") + 1
    assert copy.period == period
    assert copy.config["num_hidden_layers"] == 2 * period and copy.config["num_kv_shared_layers"] == period
    assert copy.config["layer_types"] == original["layer_types"][:period] + original["layer_types"][-period:]
    for key in ("intermediate_size", "activation_sparsity_pattern"):
        assert len(copy.config[key]) == copy.config["num_hidden_layers"], key


def test_nemotron_h_keeps_its_mamba_heads_and_groups_against_tp() -> None:
    copy = shrink("NemotronHForCausalLM")
    original = full_config({"model_type": "nemotron_h"}, "nemotron_h")
    assert (copy.config["mamba_num_heads"], copy.config["n_groups"]) == (original["mamba_num_heads"], original["n_groups"])
    assert copy.config["layers_block_type"] == original["layers_block_type"]
    assert copy.config["mamba_head_dim"] < original["mamba_head_dim"]  # a state size, not a head count
    assert copy.recurrent and copy.plugins == ("mamba2-cpu-prefill",)
    assert tp_refusal(copy.config, 2) is None and tp_refusal(copy.config, 4) is None
    assert tp_refusal(dict(copy.config, n_groups=2), 4) == "4 does not divide n_groups = 2"


def test_llama4_keeps_its_chunked_local_layers_and_moe_interleave() -> None:
    copy = shrink("Llama4ForCausalLM")
    original = full_config({"model_type": "llama4_text"}, "llama4_text")
    assert copy.config["attention_chunk_size"] == original["attention_chunk_size"]
    kept = list(copy.layers)
    assert copy.config["no_rope_layers"] == [original["no_rope_layers"][i] for i in kept]
    assert copy.config["layer_types"] == [original["layer_types"][i] for i in kept]
    assert set(copy.config["layer_types"]) == set(original["layer_types"])  # both kinds kept


def test_tp_refusals_name_the_field_that_does_not_split() -> None:
    config = {"num_attention_heads": 32, "num_key_value_heads": 8}
    assert tp_refusal(config, 2) is None and tp_refusal(config, 16) is None
    assert tp_refusal(config, 3) == "3 does not divide num_attention_heads = 32"
    assert tp_refusal({"num_attention_heads": 12, "num_key_value_heads": 8}, 12) == (
        "12 and num_key_value_heads = 8: neither divides the other"
    )
    assert tp_refusal({"num_attention_heads": 8, "linear_num_value_heads": 6}, 4) == "4 does not divide linear_num_value_heads = 6"
    assert cores_refusal(8, cores=2) == "this machine has 2 cores and hosts at most 4 TP ranks (two a core)"
    assert cores_refusal(4, cores=2) is None


def test_find_period_finds_a_prefix_and_a_body_cut_short() -> None:
    assert find_period(list("aaaa")) == (0, 1)
    assert find_period(list("sssssfsssssfss")) == (0, 6)
    assert find_period(list("dddmmmmmmm")) == (3, 1)
    assert find_period(list("abcd")) == (0, 4)


def test_bad_sources_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        load_source(tmp_path / "missing" / "config.json")
    with pytest.raises(SourceError, match="without config.json"):
        load_source(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama",\n  oops}')
    with pytest.raises(SourceError, match=r"bad.json:2:3: not JSON"):
        load_source(bad)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(SourceError, match="model_type 'no-such-model' is not a causal LM"):
        load_source(unknown)
    with pytest.raises(SourceError, match="did you mean llama"):
        load_source("lama")
    assert load_source("LlamaForCausalLM")[1:] == ("llama", "LlamaForCausalLM")


REFUSALS = """
import contextlib, io, json, sys
from kvpolicy.app.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    results.append([code, err.getvalue().strip().splitlines()[-1]])
print(json.dumps({"results": results, "imported": sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules)}))
"""


def test_discover_model_refuses_bad_input_in_one_line_before_importing_torch_or_vllm(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8}))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"model_type": "llama", "num_attention_heads": 24, "num_key_value_heads": 3}))
    cases = [
        (["--model", str(tmp_path / "missing.json"), "--tp", "2"], "no such file"),
        (["--model", "nosuchtype", "--tp", "2"], "is no config.json, directory, transformers model type or vLLM"),
        (["--model", str(config), "--tp", "3"], "--tp 3: 3 does not divide num_attention_heads = 32"),
        (["--model", str(odd), "--tp", "2"], "--tp 2: 2 and num_key_value_heads = 3: neither divides the other"),
        (["--model", str(config), "--tp", str(4 * (os.cpu_count() or 1))], "TP ranks (two a core)"),
        (["--model", str(config)], "give the TP sizes to observe at"),
        (["--archetype", "mla", "--tp", "2", "--check-warm"], "--check-warm goes with --model"),
    ]
    argv = [["discover", *case] for case, _ in cases]
    done = subprocess.run([sys.executable, "-c", REFUSALS, json.dumps(argv)], capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for (code, line), (_, expected) in zip(found["results"], cases, strict=True):
        assert code == 2 and expected in line and line.startswith("kvpolicy discover: error: "), line
    assert found["imported"] == []
