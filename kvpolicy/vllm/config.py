"""The connector's settings as vLLM hands them over: the one parse of ``kv_connector_extra_config``
(:func:`parse_settings`) and its one error type (:class:`KVPolicyConfigError`), for the connector and
the standalone worker alike; what the store worker is set up with (:class:`WorkerSetup`,
:class:`StoreTarget`); and what Dynamo's descriptor states of the deployment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvpolicy.documents.settings import KVPolicySettings, SettingsError
from kvpolicy.evidence.routers import DynamoDeployment, DynamoHashContract
from kvpolicy.language.diagnostics import Diagnostic
from kvpolicy.language.models import Policy
from kvpolicy.planning.store_layout import StoreSharding
from kvpolicy.runtime.ports import Gather, PeerExchange
from kvpolicy.runtime.trust import Keyring, keyring_for

if TYPE_CHECKING:
    from vllm.config import CacheConfig, ModelConfig

__all__ = ["KVPolicyConfigError", "StoreTarget", "WorkerSetup", "dynamo_deployment", "parse_settings", "read_keyring"]


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


def read_keyring(settings: KVPolicySettings, policy: Policy) -> Keyring | None:
    """The deployment's secrets, read, for what ``settings`` and the policy's ``key`` section ask
    (None: neither keyed namespaces nor verified objects); :class:`KVPolicyConfigError` with every
    problem: a requirement of the policy the settings do not meet, a secret that cannot be read."""
    try:
        return keyring_for(settings, settings.protection(policy.key))
    except SettingsError as error:
        raise KVPolicyConfigError(str(error)) from None


def dynamo_deployment(cache_config: CacheConfig) -> DynamoDeployment:
    """What Dynamo's descriptor states of this instance: its vLLM, hash algorithm and hash seed."""
    import vllm

    seed = os.environ.get("PYTHONHASHSEED")
    # Unset, vLLM seeds a cryptographic hash with its own default and any other at random.
    seed_policy = f"pythonhashseed-{seed}" if seed is not None else "pythonhashseed-unset"
    return DynamoDeployment(
        vllm_revision=vllm.__version__,
        hash=DynamoHashContract(algorithm=str(cache_config.prefix_caching_hash_algo), seed_policy=seed_policy),
    )


@dataclass(frozen=True)
class WorkerSetup:
    """What the override points read besides upstream's own attributes, fixed before upstream's ``__init__``."""

    policy: Policy
    settings: KVPolicySettings
    model: str
    """The model as upstream reads it for ``KeyMetadata``."""
    cache_prefix: str
    """vLLM's ``cache_prefix`` key, read as upstream reads it."""
    gather: Gather
    """The collective over the TP ranks (the audit's, discovery's and start-up's)."""
    model_config: ModelConfig | None = None
    """Per-layer KV heads for the layout (None in a simulation)."""
    exchange: PeerExchange | None = None
    """The striped loads' exchange (None: over vLLM's TP group)."""
    source: Literal["engine", "simulation"] = "engine"
    """What a discovery report says observed it."""
    keyring: Keyring | None = None
    """The deployment's secrets (:func:`read_keyring`); None: keys and objects as vLLM writes them."""


@dataclass(frozen=True)
class StoreTarget:
    """The store namespace and TP-sharded layout upstream selected (``_select_store_layout``)."""

    namespace: str = ""
    sharding: StoreSharding | None = None
