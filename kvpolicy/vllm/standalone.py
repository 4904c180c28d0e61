"""A Mooncake store worker built without vLLM's distributed runtime: :class:`Ranks` and
:func:`init_standalone`, which live with vLLM's other internals in :mod:`kvpolicy.vllm.internals`
(it repeats upstream's ``__init__``, and the drift check there holds it to it)."""

from __future__ import annotations

from kvpolicy.vllm.internals import Ranks, init_standalone

__all__ = ["Ranks", "init_standalone"]
