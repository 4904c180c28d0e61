"""What the replication audit compares on quantized KV caches: vLLM's own answer, pinned.

vLLM allocates fp8 KV caches as ``uint8`` tensors, so the audit reads the values' type from vLLM
(:func:`kvpolicy.vllm.audit.fp8_element_type`, vLLM's private ``_get_fp8_dtype``) and the cache
dtype setting. These tests build each layer's spec the way vLLM's attention layers do for a cache
dtype (``STR_DTYPE_TO_TORCH_DTYPE``, ``get_kv_quant_mode``) and pin what the audit makes of it, so a
vLLM release that changes the mapping or drops the function fails here. They run against vLLM 0.32
(the venv) and, through ``tests/connector/test_vllm_033.py``, against 0.33.
"""

from __future__ import annotations

import typing

import pytest
from conftest import require

require("vllm")

import torch  # noqa: E402
from vllm.config.cache import CacheDType  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    get_kv_quant_mode,
)

from kvpolicy.evidence.audit import (  # noqa: E402
    FLOAT_MANTISSA_BITS,
    REPLICA_TOLERANCE,
    ValueComparison,
    relative_distance,
    rounding_tolerance,
)
from kvpolicy.vllm.audit import fp8_element_type, value_comparisons  # noqa: E402

MODEL_DTYPE = torch.bfloat16
"""The model dtype ``auto`` resolves to in these specs."""
DS_MLA_BYTES_PER_TOKEN = 656
"""``fp8_ds_mla``'s packed row (vLLM's MLA layer sets ``state_content_bytes`` to it): 512 fp8 NoPE
values, 16 bytes of scales, 128 bytes of bf16 RoPE."""


def attention_spec(cache_dtype: str) -> FullAttentionSpec:
    """A full-attention layer's spec as vLLM's ``Attention.get_kv_cache_spec`` builds it for ``cache_dtype``."""
    dtype = MODEL_DTYPE if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    return FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype)
    )


def mla_spec(cache_dtype: str) -> MLAAttentionSpec:
    """An MLA layer's spec as vLLM's ``MLAAttention.get_kv_cache_spec`` builds it for ``cache_dtype``."""
    dtype = MODEL_DTYPE if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    return MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=576,
        dtype=dtype,
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes=DS_MLA_BYTES_PER_TOKEN if cache_dtype == "fp8_ds_mla" else None,
    )


def comparison(cache_dtype: str, spec: object) -> ValueComparison:
    return value_comparisons(cache_dtype, [spec])[0]  # type: ignore[list-item]


# --- the formats the audit reads as numbers ------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("build", [attention_spec, mla_spec], ids=["attention", "mla"])
def test_an_e4m3_cache_stored_as_uint8_is_compared_as_float8_e4m3fn(build, cache_dtype: str) -> None:
    spec = build(cache_dtype)
    assert spec.dtype == torch.uint8  # what vLLM allocates: the tensor's dtype is not the values' type
    found = comparison(cache_dtype, spec)
    assert (found.element, found.exact) == ("float8_e4m3fn", False)
    assert found.tolerance == 2.0**-3  # one ulp of a 3-bit mantissa


@pytest.mark.parametrize("build", [attention_spec, mla_spec], ids=["attention", "mla"])
def test_an_e5m2_cache_stored_as_uint8_is_compared_as_float8_e5m2(build) -> None:
    found = comparison("fp8_e5m2", build("fp8_e5m2"))
    assert (found.element, found.exact, found.tolerance) == ("float8_e5m2", False, 2.0**-2)


def test_fp8_follows_the_platforms_fp8_type_as_vllm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # A ROCm GPU with fnuz fp8 (MI300) cannot exist on a CPU machine: its platform's answer is stood in for.
    monkeypatch.setattr(current_platform, "fp8_dtype", lambda: torch.float8_e4m3fnuz)
    assert comparison("fp8", attention_spec("fp8")).element == "float8_e4m3fnuz"
    assert comparison("fp8_e4m3", mla_spec("fp8_e4m3")).element == "float8_e4m3fnuz"
    assert comparison("fp8_e5m2", attention_spec("fp8_e5m2")).element == "float8_e5m2"


def test_the_cache_dtype_setting_decides_for_layers_that_do_not_name_their_own() -> None:
    # A full-attention spec carries no cache dtype string: the same uint8 spec is e4m3 or e5m2 by the setting.
    spec = attention_spec("fp8")
    assert comparison("fp8_e4m3", spec).element == "float8_e4m3fn"
    assert comparison("fp8_e5m2", spec).element == "float8_e5m2"


def test_an_mla_layer_names_its_own_cache_dtype() -> None:
    # vLLM's sparse MLA backends turn the "fp8" setting into fp8_ds_mla on the layer (cache_dtype_str).
    assert comparison("fp8", mla_spec("fp8_ds_mla")).exact


@pytest.mark.parametrize("cache_dtype, element", [("auto", "bfloat16"), ("float16", "float16"), ("fp8_inc", "float8_e4m3fn")])
def test_caches_stored_in_a_float_type_are_compared_in_it(cache_dtype: str, element: str) -> None:
    found = comparison(cache_dtype, attention_spec(cache_dtype))
    assert (found.element, found.exact) == (element, False)
    assert found.tolerance == max(REPLICA_TOLERANCE, 2.0 ** -FLOAT_MANTISSA_BITS[element])


def test_a_layer_kept_unquantized_under_an_fp8_setting_is_compared_in_its_own_dtype() -> None:
    # kv_cache_dtype_skip_layers: vLLM builds such a layer's spec with cache dtype "auto".
    assert comparison("fp8", attention_spec("auto")).element == "bfloat16"


# --- the formats only exact digests can judge ----------------------------------------------------


@pytest.mark.parametrize(
    "cache_dtype, build",
    [("fp8_per_token_head", attention_spec), ("int8_per_token_head", attention_spec), ("fp8_ds_mla", mla_spec)],
)
def test_caches_with_scales_in_their_blocks_require_exact_digests(cache_dtype: str, build) -> None:
    found = comparison(cache_dtype, build(cache_dtype))
    assert found.exact and found.element is None
    assert f"'{cache_dtype}'" in found.reason and "scales inside its blocks" in found.reason


def test_a_uint8_cache_vllm_reads_as_no_fp8_type_requires_exact_digests() -> None:
    # e.g. DeepSeek-V3.2's indexer cache: uint8 with no quantization mode on the spec.
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    found = comparison("auto", spec)
    assert found.exact and "uint8 codes" in found.reason


def test_every_cache_dtype_vllm_offers_is_read_as_a_float_type_or_by_exact_digests() -> None:
    # The drift check over vLLM's whole list: no format's stored integer codes are ever compared as numbers.
    for cache_dtype in typing.get_args(CacheDType):
        for build in (attention_spec, mla_spec):
            spec = build(cache_dtype)
            found = comparison(cache_dtype, spec)
            assert found.exact or found.element in FLOAT_MANTISSA_BITS, (cache_dtype, build.__name__, found)
            if spec.dtype in (torch.uint8, torch.int8):
                quantized = spec.kv_quant_mode is not KVQuantMode.NONE
                assert quantized and (found.exact or found.element.startswith("float8")), (cache_dtype, found)


def test_vllms_answer_is_the_one_the_audit_uses() -> None:
    assert fp8_element_type(attention_spec("fp8_e5m2"), "fp8_e5m2") is torch.float8_e5m2
    assert fp8_element_type(attention_spec("fp8_per_token_head"), "fp8_per_token_head") is None


# --- groups the cache dtype does not govern ------------------------------------------------------


def test_mamba_state_keeps_its_own_dtypes() -> None:
    spec = MambaSpec(block_size=16, shapes=((4, 4), (2, 8)), dtypes=(torch.bfloat16, torch.float32))
    assert comparison("fp8", spec) == ValueComparison()


# --- the tolerance rule on fp8 values: one ulp everywhere is rounding, two is not -----------------

FP8_FORMATS = [("float8_e4m3fn", 0x7E), ("float8_e5m2", 0x7B)]
"""fp8 types with their largest finite magnitude code (above it: NaN for e4m3fn, inf and NaN for e5m2)."""


def away_from_zero(codes: torch.Tensor, steps: int) -> torch.Tensor:
    """``codes`` moved ``steps`` representable values away from zero: fp8 is sign-magnitude, so that
    is the code plus ``steps`` for either sign."""
    return codes + steps


@pytest.mark.parametrize("element, largest", FP8_FORMATS)
def test_every_normal_fp8_value_is_within_the_tolerance_of_its_neighbour_one_ulp_away(element: str, largest: int) -> None:
    dtype = getattr(torch, element)
    codes = torch.arange(256, dtype=torch.uint8)
    magnitude = codes & 0x7F
    normal = (magnitude >> FLOAT_MANTISSA_BITS[element] > 0) & (magnitude < largest)
    for code in codes[normal]:
        value, neighbour = code.view(dtype).float().item(), away_from_zero(code, 1).view(dtype).float().item()
        assert 0 < relative_distance([value], [neighbour]) <= rounding_tolerance(element), (element, int(code))


@pytest.mark.parametrize("element, largest", FP8_FORMATS)
def test_fp8_values_two_ulps_apart_everywhere_are_beyond_the_tolerance(element: str, largest: int) -> None:
    dtype = getattr(torch, element)
    codes = torch.randn(4096, generator=torch.Generator().manual_seed(5)).to(dtype).view(torch.uint8)
    codes = codes[(codes & 0x7F) + 2 <= largest]
    moved = away_from_zero(codes, 2)
    values, shifted = codes.view(dtype).float().tolist(), moved.view(dtype).float().tolist()
    assert relative_distance(values, shifted) > rounding_tolerance(element)
    # Read as byte codes the same pair looks like rounding: the reason codes are never compared as numbers.
    assert relative_distance(codes.float().tolist(), moved.float().tolist()) < REPLICA_TOLERANCE
