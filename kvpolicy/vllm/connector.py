"""``KVPolicyConnector``: vLLM's Mooncake store connector, run under a kvpolicy replication policy.

Configure it with::

    {"kv_connector": "KVPolicyConnector", "kv_connector_module_path": "kvpolicy.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"kvpolicy": "default"}}

``kvpolicy`` is a shipped policy name, a policy file path, or ``{"policy": <name or path>,
"strict": <bool>}``; the other ``kvpolicy*`` keys are :class:`kvpolicy.documents.settings.KVPolicySettings`.
The policy is loaded and validated first, in both roles, so a bad policy stops start-up with the
validator's located messages before any store connection is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import vllm

from kvpolicy.vllm.version import check_vllm_version

check_vllm_version(vllm.__version__)  # before any class of vLLM's connector is imported

from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.documents.settings import EXTRA_CONFIG, KVPolicySettings, policy_usage  # noqa: E402
from kvpolicy.language.diagnostics import DocumentError  # noqa: E402
from kvpolicy.language.models import Policy  # noqa: E402
from kvpolicy.planning.plan import Plan  # noqa: E402
from kvpolicy.vllm import internals  # noqa: E402
from kvpolicy.vllm.config import KVPolicyConfigError, parse_settings  # noqa: E402
from kvpolicy.vllm.metrics import KVPolicyConnectorStats, KVPolicyPromMetrics  # noqa: E402
from kvpolicy.vllm.worker import KVPolicyStoreWorker  # noqa: E402

logger = init_logger(f"vllm.{__name__}")

__all__ = [
    "HIT_SOURCE",
    "POLICY_KEY",
    "KVPolicyConnector",
    "resolve_policy",
]

POLICY_KEY = "kvpolicy"
"""The ``kv_connector_extra_config`` key that selects the policy."""

HIT_SOURCE = CacheHitSource.HOST
"""The tier vLLM's ``vllm:prompt_tokens_cached_by_source`` counts a store hit under: Mooncake's store
keeps objects in host memory (DRAM segments, this host's or another's), and vLLM's own tiering maps a
tier on the CPU medium to ``host`` whatever its locality. (vLLM's fallback, ``external_unspecified``,
is for connectors that do not say.)"""


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
    """``MooncakeStoreConnector`` whose worker takes factors, keys, put schedules and lookups from a plan.

    The members vLLM's connector base (0.32 and 0.33) lets a connector decide are decided here, not
    inherited: no divergent local hybrid hits, no reliable delivery (a best-effort cache), store hits
    counted as :data:`HIT_SOURCE`. ``kv_load_failure_policy`` is the deployment's: ``kvpolicy vllm-config``
    writes ``recompute``, and the scheduler role warns at start-up when it is ``fail``.
    """

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """False, pinned: the store restores a recurrent (Mamba) state only at the boundaries it saved,
        so it cannot complete a local hit whose attention reaches past the state it holds."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache. A save dropped when a request is preempted is a future miss, so a
        preempted request keeps its in-flight output (vLLM's default is True for every producer role)."""
        return False

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Every external hit token under :data:`HIT_SOURCE` (all of them come from the store)."""
        return {HIT_SOURCE: num_external_tokens} if num_external_tokens else {}

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
            warn_on_failing_loads(vllm_config.kv_transfer_config.kv_load_failure_policy)
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


LOAD_FAILURE_WARNING = (
    "kvpolicy: kv_load_failure_policy is 'fail': a request fails whenever the store loses an object between "
    "its lookup and its load (eviction under memory pressure, a segment host gone); set "
    '"kv_load_failure_policy": "recompute" in --kv-transfer-config (kvpolicy vllm-config writes it)'
)


def warn_on_failing_loads(policy: str) -> bool:
    """Log :data:`LOAD_FAILURE_WARNING` when ``policy`` (``kv_load_failure_policy``) fails requests on a
    failed load; whether it did. The scheduler reads the policy right after building the connector."""
    if policy == "fail":
        logger.warning(LOAD_FAILURE_WARNING)
        return True
    return False


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
