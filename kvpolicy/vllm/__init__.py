"""kvpolicy inside vLLM: the ``KVPolicyConnector`` and the pieces it is built from.

vLLM's connector factory loads ``getattr(importlib.import_module("kvpolicy.vllm"), "KVPolicyConnector")``.
The connector is imported on that first attribute access, not here: importing this package loads
neither vLLM nor Mooncake and starts nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpolicy.vllm.config import KVPolicyConfigError
    from kvpolicy.vllm.connector import KVPolicyConnector, resolve_policy

__all__ = ["KVPolicyConfigError", "KVPolicyConnector", "resolve_policy"]


def __getattr__(name: str) -> Any:
    if name == "KVPolicyConfigError":
        from kvpolicy.vllm import config

        return config.KVPolicyConfigError
    if name in __all__:
        from kvpolicy.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
