"""A test-only vLLM plugin: a model architecture of its own whose recurrent state has a KV cache spec
class of its own, as a plugin package bringing a new state type would.

``ZooStateLfm2ForCausalLM`` is vLLM's LFM2 whose short-convolution layers declare ``ZooConvStateSpec``
(a ``MambaSpec`` subclass no kvpolicy rule names) instead of ``MambaSpec``; vLLM finds the manager of a
spec class by walking its MRO, so nothing else needs registering. The tests serve a configuration that
names this architecture with ``kvpolicy discover --model``, with this directory on ``PYTHONPATH`` (vLLM
loads every ``vllm.general_plugins`` entry point in the engine and in each TP worker).
"""

from __future__ import annotations

ARCHITECTURE = "ZooStateLfm2ForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "zoo_state_model:ZooStateLfm2ForCausalLM")
