"""The plugin's model (imported by vLLM when it resolves the architecture; see zoo_state_plugin.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.models.lfm2 import Lfm2ForCausalLM
from vllm.v1.kv_cache_interface import MambaSpec


@dataclasses.dataclass(frozen=True)
class ZooConvStateSpec(MambaSpec):
    """LFM2's short-conv state under a spec class of the plugin's own."""


class ZooStateLfm2ForCausalLM(Lfm2ForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        for module in self.modules():
            if isinstance(module, ShortConv):
                module.get_kv_cache_spec = _own_spec(module.get_kv_cache_spec)  # type: ignore[method-assign]


def _own_spec(original: Any) -> Any:
    def get_kv_cache_spec(vllm_config: Any) -> Any:
        spec = original(vllm_config)
        values = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec) if field.init}
        return ZooConvStateSpec(**values)

    return get_kv_cache_spec
