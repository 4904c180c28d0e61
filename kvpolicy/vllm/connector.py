"""``KVPolicyConnector``: vLLM's Mooncake store connector, run under a kvpolicy replication policy.

Configure it with::

    {"kv_connector": "KVPolicyConnector", "kv_connector_module_path": "kvpolicy.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"kvpolicy": "default"}}

``kvpolicy`` is a shipped policy name, a policy file path, or ``{"policy": <name or path>,
"strict": <bool>}``; the other ``kvpolicy*`` keys are :class:`kvpolicy.settings.KVPolicySettings`. The policy is loaded and validated first, in both roles, so a bad policy stops
start-up with the validator's located messages before any store connection is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import vllm

from kvpolicy.vllm.version import check_vllm_version

check_vllm_version(vllm.__version__)  # before any class of vLLM's connector is imported

from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402

from kvpolicy.diagnostics import Diagnostic, DocumentError  # noqa: E402
from kvpolicy.loader import load_policy  # noqa: E402
from kvpolicy.models import Policy  # noqa: E402
from kvpolicy.plan import Plan  # noqa: E402
from kvpolicy.settings import EXTRA_CONFIG, KVPolicySettings, SettingsError, policy_usage  # noqa: E402
from kvpolicy.vllm import internals  # noqa: E402
from kvpolicy.vllm.metrics import KVPolicyConnectorStats, KVPolicyPromMetrics  # noqa: E402
from kvpolicy.vllm.worker import KVPolicyStoreWorker  # noqa: E402

__all__ = ["POLICY_KEY", "KVPolicyConfigError", "KVPolicyConnector", "parse_settings", "resolve_policy"]

POLICY_KEY = "kvpolicy"
"""The ``kv_connector_extra_config`` key that selects the policy."""


class KVPolicyConfigError(ValueError):
    """``kv_connector_extra_config`` does not name a usable policy or holds bad kvpolicy settings.

    The message is the validator's text (``path:line:col: error: ...``, one line per problem) or one
    located line per bad setting (``kv_connector_extra_config.<key>: error: ...``).
    """

    def __init__(self, message: str, diagnostics: tuple[Diagnostic, ...] = ()) -> None:
        super().__init__(message)
        self.diagnostics = diagnostics


def parse_settings(extra_config: Mapping[str, Any], *, check_side_files: bool = False) -> KVPolicySettings:
    """The connector's settings in ``extra_config``; :class:`KVPolicyConfigError` with every problem.
    With ``check_side_files`` (the first worker rank, the one that writes them) the side files' paths
    are also judged against this host's files: a directory, a missing or unwritable parent."""
    try:
        return KVPolicySettings.parse(extra_config, check_side_files=check_side_files)
    except SettingsError as error:
        raise KVPolicyConfigError(str(error)) from None


def resolve_policy(settings: KVPolicySettings | Mapping[str, Any]) -> Policy:
    """The policy ``settings`` (or a ``kv_connector_extra_config`` holding them) selects, loaded and
    validated; raise :class:`KVPolicyConfigError`."""
    if not isinstance(settings, KVPolicySettings):
        settings = parse_settings(settings)
    name = settings.policy_name
    if name is None:
        raise KVPolicyConfigError(f"{EXTRA_CONFIG}.{POLICY_KEY}: error: no policy selected; {policy_usage()}")
    try:
        policy = load_policy(name)
    except DocumentError as error:
        # No chained traceback: the located messages are the whole story.
        raise KVPolicyConfigError(str(error), error.diagnostics) from None
    strict = settings.strict
    if strict is None or strict == policy.strict:
        return policy
    origins = tuple(policy.rule_origin(index) for index in range(len(policy.rules)))
    # Re-attach origins explicitly: they are private state that errors cite as file:line.
    return policy.model_copy(update={"strict": strict}).with_origins(origins)


class KVPolicyConnector(MooncakeStoreConnector, SupportsHMA):
    """``MooncakeStoreConnector`` whose worker takes factors, keys, put schedules and lookups from a plan."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        if vllm_config.kv_transfer_config is None:
            raise KVPolicyConfigError("KVPolicyConnector needs a kv_transfer_config")
        # Parsed once, here, in both roles: a bad setting stops start-up before any store connection.
        # The first worker rank writes the side files (plan, keys, layout, discovery report, Dynamo
        # descriptor): their paths are judged there, against its host's files, before anything is served.
        writes_side_files = role == KVConnectorRole.WORKER and vllm_config.parallel_config.rank == 0
        self.settings: KVPolicySettings = parse_settings(
            vllm_config.kv_transfer_config.kv_connector_extra_config, check_side_files=writes_side_files
        )
        self.policy: Policy = resolve_policy(self.settings)
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler side needs no plan: lookups run on worker rank 0.
            super().__init__(vllm_config, role, kv_cache_config)
            return
        self._init_worker_role(vllm_config, role, kv_cache_config)

    def _init_worker_role(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # Upstream's __init__ would build its own worker (no hook): internals repeats its lines instead.
        internals.init_connector_worker_role(
            self,
            vllm_config,
            role,
            kv_cache_config,
            lambda: KVPolicyStoreWorker(vllm_config, kv_cache_config, policy=self.policy, settings=self.settings),
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPolicyConnectorStats(data=data) if data is not None else KVPolicyConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVPolicyPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def plan(self) -> Plan | None:
        """The worker's plan; None on the scheduler role and on a capacity-only worker."""
        worker = self.connector_worker
        return worker.plan if isinstance(worker, KVPolicyStoreWorker) else None


def _register_by_name() -> None:
    """Make ``KVPolicyConnector`` a name vLLM's factory knows. Loaded by module path, a connector is
    unknown to ``KVConnectorFactory.get_connector_class_by_name``, which ``MultiConnector`` calls to
    rebuild its children's stats in the API server: without this, kvpolicy's stats would stop vLLM's
    stats logger there (as vllm#43828 did for the stock connector)."""
    try:
        KVConnectorFactory.get_connector_class_by_name(KVPolicyConnector.__name__)
    except ValueError:
        KVConnectorFactory.register_connector(KVPolicyConnector.__name__, __name__, KVPolicyConnector.__name__)


_register_by_name()
