"""``kvpolicy vllm-config``'s line, shared with ``kvpolicy doctor``: vLLM's ``--kv-transfer-config`` running a
policy with the connector, and the warnings ``kvpolicy validate`` reports for that policy."""

from __future__ import annotations

from typing import Any

from kvpolicy.documents.loader import check_file, load_policy, resolve_policy_path
from kvpolicy.documents.settings import KVPolicySettings, PolicySelection
from kvpolicy.language.diagnostics import Diagnostic


def kv_transfer_config(policy: str, *, role: str = "kv_both", strict: bool = False) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` running ``policy`` (a shipped name or a path) with the connector;
    :class:`DocumentError` with every problem when the policy is invalid (it would fail at start-up)."""
    load_policy(policy)
    setting = policy if not strict else PolicySelection(policy=policy, strict=True)
    return KVPolicySettings(kvpolicy=setting).kv_transfer_config(role=role)


def policy_warnings(policy: str) -> list[Diagnostic]:
    """The warnings ``kvpolicy validate`` reports for ``policy`` (a shipped name or a path) that loads."""
    _, problems = check_file(resolve_policy_path(policy))
    return [problem for problem in problems if problem.severity == "warning"]
