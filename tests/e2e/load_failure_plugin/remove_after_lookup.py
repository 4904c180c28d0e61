"""A vLLM general plugin for the e2e tests only: the store loses a prompt's objects between the lookup
that hit them and the load that reads them, as under Mooncake's eviction or a lost segment host.

With ``KVPOLICY_E2E_REMOVE_AFTER_LOOKUP=1`` in the engine's environment, the first lookup of
``KVPolicyStoreWorker`` that hits removes every object of its lookup namespaces from the store (Mooncake's
``remove_by_regex``, forced) before returning the hit, and prints ``KVPOLICY_E2E_REMOVED <count>`` on
stderr. The scheduler has the hit; the load that follows finds nothing. Found only when this directory is
on the engine's ``PYTHONPATH`` (the entry point is declared by the distribution beside this file).
"""

from __future__ import annotations

import os
import re
import sys

ENV = "KVPOLICY_E2E_REMOVE_AFTER_LOOKUP"
MARKER = "KVPOLICY_E2E_REMOVED"


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from kvpolicy.vllm import internals
    from kvpolicy.vllm.worker import KVPolicyStoreWorker

    original = KVPolicyStoreWorker.lookup
    if getattr(original, "_kvpolicy_e2e_removes", False):
        return
    done: list[bool] = []

    def lookup(self, num_tokens, block_hashes):  # type: ignore[no-untyped-def]
        result = original(self, num_tokens, block_hashes)
        if result.hit_length > 0 and not done:
            done.append(True)
            prefixes = {prefix for group in internals.lookup_key_prefixes(self) for prefix in group}
            removed = sum(self.store.remove_by_regex(f"^{re.escape(prefix)}@", True) for prefix in sorted(prefixes))
            print(f"{MARKER} {removed} after a hit of {result.hit_length} tokens", file=sys.stderr, flush=True)
        return result

    lookup._kvpolicy_e2e_removes = True  # type: ignore[attr-defined]
    KVPolicyStoreWorker.lookup = lookup  # type: ignore[method-assign]
