"""How KVPolicyConnector reads ``kv_connector_extra_config["kvpolicy"]``.

Full connector construction needs a Mooncake master and torch.distributed and is left to the e2e
tests; here the policy resolution runs directly, and through the real connector class only as far
as a bad policy stops it, which is before anything else happens.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("vllm is not installed", allow_module_level=True)

from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvpolicy.documents.loader import load_policy, policies_dir
from kvpolicy.language.diagnostics import DocumentError, PlanError
from kvpolicy.language.models import Group, Layout, Spec, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.vllm.config import KVPolicyConfigError
from kvpolicy.vllm.connector import KVPolicyConnector, resolve_policy

INVALID_POLICY = """\
version: 1
kind: ReplicationPolicy
name: Bad_Name
rulez: []
rules:
  - name: mla
    reason: latent
    match:
      spec: MLAAttentionSpec
    replication: replicated
    factor: 2
  - name: heads
    reason: heads
    factor: max(1, tp_size // kv_heads)
"""

STRICT_POLICY = """\
version: 1
kind: ReplicationPolicy
name: strict-mla
strict: true
rules:
  - name: mla-latent
    reason: The MLA latent cache has no head dimension.
    match:
      spec: MLAAttentionSpec
    replication: replicated
"""


@pytest.fixture
def invalid_policy(tmp_path: Path) -> Path:
    path = tmp_path / "invalid.yaml"
    path.write_text(INVALID_POLICY, encoding="utf-8")
    return path


@pytest.fixture
def strict_policy(tmp_path: Path) -> Path:
    path = tmp_path / "strict.yaml"
    path.write_text(STRICT_POLICY, encoding="utf-8")
    return path


def config_error(setting: object) -> KVPolicyConfigError:
    with pytest.raises(KVPolicyConfigError) as raised:
        resolve_policy({"kvpolicy": setting})
    return raised.value


def plugin_layout() -> Layout:
    spec = Spec(type="PluginStateSpec", bases=("KVCacheSpec",), block_size=16, page_size_bytes=1024)
    return Layout(
        version=1, kind="ModelLayout", model="tiny", total_num_kv_heads=1,
        groups=(Group(name="plugin", spec=spec, layers=("l.0",)),),
    )


EMPTY_KV_CACHE_CONFIG = KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])


def vllm_config(setting: object) -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPolicyConnector",
            kv_connector_module_path="kvpolicy.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"kvpolicy": setting},
        )
    )


# --- names and paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "no-dedup", "vllm-compat"])
def test_a_shipped_policy_name_selects_that_policy(name: str) -> None:
    assert resolve_policy({"kvpolicy": name}).name == name


def test_a_policy_file_path_selects_that_file() -> None:
    assert resolve_policy({"kvpolicy": str(policies_dir() / "no-dedup.yaml")}).name == "no-dedup"


def test_a_misspelled_policy_name_is_a_config_error_suggesting_the_shipped_name() -> None:
    assert "did you mean 'default'?" in str(config_error("defualt"))


def test_a_missing_policy_error_is_the_loader_message_verbatim() -> None:
    with pytest.raises(DocumentError) as loader_error:
        load_policy("vllm-compt")
    assert str(config_error("vllm-compt")) == str(loader_error.value)


def test_a_config_error_is_a_value_error_so_vllm_start_up_stops_with_it() -> None:
    assert isinstance(config_error("nope"), ValueError)


def test_a_config_error_carries_no_chained_traceback() -> None:
    error = config_error("defualt")
    assert (error.__cause__, error.__suppress_context__) == (None, True)


# --- invalid files ------------------------------------------------------------------------------


def test_an_invalid_policy_file_reports_every_located_error(invalid_policy: Path) -> None:
    lines = str(config_error(str(invalid_policy))).splitlines()
    assert [line.split(": error: ")[0] for line in lines] == [
        f"{invalid_policy}:3:7",
        f"{invalid_policy}:4:1",
        f"{invalid_policy}:6:5",
        f"{invalid_policy}:14:31",
    ]


def test_an_invalid_policy_error_message_is_the_validator_text(invalid_policy: Path) -> None:
    with pytest.raises(DocumentError) as loader_error:
        load_policy(invalid_policy)
    assert str(config_error(str(invalid_policy))) == str(loader_error.value)


def test_an_invalid_policy_error_keeps_the_diagnostics(invalid_policy: Path) -> None:
    assert len(config_error(str(invalid_policy)).diagnostics) == 4


# --- the mapping form ---------------------------------------------------------------------------


def test_the_mapping_form_selects_its_policy() -> None:
    assert resolve_policy({"kvpolicy": {"policy": "no-dedup"}}).name == "no-dedup"


def test_strict_true_in_the_mapping_makes_the_policy_strict() -> None:
    assert resolve_policy({"kvpolicy": {"policy": "default", "strict": True}}).strict is True


def test_strict_false_in_the_mapping_relaxes_a_strict_policy(strict_policy: Path) -> None:
    assert resolve_policy({"kvpolicy": {"policy": str(strict_policy), "strict": False}}).strict is False


def test_the_mapping_without_strict_keeps_the_file_setting(strict_policy: Path) -> None:
    assert resolve_policy({"kvpolicy": {"policy": str(strict_policy)}}).strict is True


def test_a_strict_override_keeps_the_rule_origins() -> None:
    loaded = load_policy("default")
    overridden = resolve_policy({"kvpolicy": {"policy": "default", "strict": True}})
    origins = [overridden.rule_origin(index) for index in range(len(overridden.rules))]
    assert origins == [loaded.rule_origin(index) for index in range(len(loaded.rules))]
    assert origins[0].endswith("default.yaml:16")


def test_a_strict_override_changes_nothing_but_strict() -> None:
    overridden = resolve_policy({"kvpolicy": {"policy": "default", "strict": True}})
    assert overridden.model_dump() == {**load_policy("default").model_dump(), "strict": True}


def test_a_strict_override_takes_effect_in_planning() -> None:
    policy = resolve_policy({"kvpolicy": {"policy": "default", "strict": True}})
    with pytest.raises(PlanError, match="strict"):
        make_plan(policy, plugin_layout(), Topology(tp_size=2))


def test_an_unknown_mapping_key_suggests_the_known_one() -> None:
    assert "did you mean 'strict'?" in str(config_error({"policy": "default", "strikt": True}))


def test_a_non_boolean_strict_is_a_config_error() -> None:
    assert "must be true or false" in str(config_error({"policy": "default", "strict": "yes"}))


def test_a_mapping_without_policy_is_a_config_error() -> None:
    assert "lacks 'policy'" in str(config_error({"strict": True}))


def test_a_policy_named_inside_the_mapping_is_checked_like_a_bare_name() -> None:
    assert "did you mean 'no-dedup'?" in str(config_error({"policy": "no-dedupe", "strict": True}))


# --- missing or malformed settings ----------------------------------------------------------------


def test_no_policy_setting_is_a_config_error_naming_the_shipped_policies() -> None:
    with pytest.raises(KVPolicyConfigError, match="default, no-dedup, vllm-compat"):
        resolve_policy({})


def test_a_setting_of_the_wrong_type_is_a_config_error() -> None:
    assert "is a int" in str(config_error(3))


# --- through the real connector class -------------------------------------------------------------


@pytest.mark.parametrize("role", list(KVConnectorRole), ids=lambda role: role.name.lower())
def test_the_connector_stops_on_a_bad_policy_in_either_role_before_anything_else(role: KVConnectorRole) -> None:
    # Nothing but the policy is configured (no model, no store): reaching anything else would fail differently.
    with pytest.raises(KVPolicyConfigError, match="did you mean 'default'"):
        KVPolicyConnector(vllm_config("defualt"), role, EMPTY_KV_CACHE_CONFIG)


@pytest.mark.parametrize("ttl", [-1, "30", float("nan"), float("inf"), True, None])
@pytest.mark.parametrize("role", list(KVConnectorRole), ids=lambda role: role.name.lower())
def test_the_connector_stops_on_a_bad_read_failure_ttl_naming_the_key(role: KVConnectorRole, ttl: object) -> None:
    config = vllm_config("default")
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config["kvpolicy_read_failure_ttl_s"] = ttl
    message = (
        "kv_connector_extra_config.kvpolicy_read_failure_ttl_s: error: must be a number of seconds >= 0 (0 turns it off), "
        f"got {ttl!r}"
    )
    with pytest.raises(KVPolicyConfigError) as raised:
        KVPolicyConnector(config, role, EMPTY_KV_CACHE_CONFIG)
    assert str(raised.value) == message


@pytest.mark.parametrize("role", list(KVConnectorRole), ids=lambda role: role.name.lower())
def test_the_connector_stops_on_an_unknown_kvpolicy_key_with_a_suggestion(role: KVConnectorRole) -> None:
    config = vllm_config("default")
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config["kvpolicy_plan_jsn"] = "plan.json"
    unknown = r"^kv_connector_extra_config.kvpolicy_plan_jsn: error: unknown key; did you mean 'kvpolicy_plan_json'\?$"
    with pytest.raises(KVPolicyConfigError, match=unknown):
        KVPolicyConnector(config, role, EMPTY_KV_CACHE_CONFIG)


def test_the_first_worker_rank_stops_on_a_side_file_in_a_missing_directory_naming_the_key(tmp_path: Path) -> None:
    config = vllm_config("default")
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config["kvpolicy_discover"] = str(tmp_path / "absent" / "report.yaml")
    assert config.parallel_config.rank == 0
    with pytest.raises(KVPolicyConfigError, match=r"^kv_connector_extra_config.kvpolicy_discover: error: "):
        KVPolicyConnector(config, KVConnectorRole.WORKER, EMPTY_KV_CACHE_CONFIG)


@pytest.mark.parametrize("role", list(KVConnectorRole), ids=lambda role: role.name.lower())
def test_only_the_rank_writing_side_files_judges_them_against_its_host(role: KVConnectorRole, tmp_path: Path) -> None:
    """Other ranks (and the scheduler) may run on hosts without rank 0's directories: a path there
    is not theirs to refuse. Nothing else is configured: reaching the store would fail differently."""
    config = vllm_config("defualt")  # stops right after the settings, on the policy, if they pass
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config["kvpolicy_discover"] = str(tmp_path / "absent" / "report.yaml")
    if role == KVConnectorRole.WORKER:
        config.parallel_config.rank = 1
    with pytest.raises(KVPolicyConfigError, match="did you mean 'default'"):
        KVPolicyConnector(config, role, EMPTY_KV_CACHE_CONFIG)


def test_the_connector_reports_every_bad_setting_at_once() -> None:
    config = vllm_config("default")
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config.update(
        kvpolicy_read_failure_ttl_s=-1, kvpolicy_striped_exchange="mpi"
    )
    with pytest.raises(KVPolicyConfigError) as raised:
        KVPolicyConnector(config, KVConnectorRole.WORKER, EMPTY_KV_CACHE_CONFIG)
    assert [line.split(": error: ")[0] for line in str(raised.value).splitlines()] == [
        "kv_connector_extra_config.kvpolicy_read_failure_ttl_s", "kv_connector_extra_config.kvpolicy_striped_exchange",
    ]


def test_vllm_accepts_the_builders_kv_transfer_config() -> None:
    from kvpolicy.documents.settings import KVPolicySettings

    built = KVPolicySettings(kvpolicy="default", kvpolicy_read_failure_ttl_s=5).kv_transfer_config(
        upstream_extra={"cache_prefix": "run"}
    )
    config = KVTransferConfig(**built)
    assert KVConnectorFactory.get_connector_class(config) is KVPolicyConnector
    assert resolve_policy(config.kv_connector_extra_config).name == "default"
    # The scheduler recomputes a load that failed (an object evicted between lookup and load), not fails it.
    assert config.kv_load_failure_policy == "recompute"


# --- what vLLM's connector base (0.32, 0.33) leaves a connector to decide -----------------------------


@contextlib.contextmanager
def scheduler_connector(load_failure: str = "recompute") -> Iterator[KVPolicyConnector]:
    """The connector in the scheduler role, as vLLM's scheduler builds it (a one-group model's config);
    its lookup client's socket closed after (an unclosed one can block the interpreter in zmq)."""
    from kvpolicy.documents.settings import KVPolicySettings
    from kvpolicy.sim.model import build_model

    model = build_model("mla", 1, model_name="tiny-contract", blocks_needed=8)
    config = model.vllm_config
    config.kv_transfer_config = KVTransferConfig(
        **KVPolicySettings(kvpolicy="default").kv_transfer_config(kv_load_failure_policy=load_failure)
    )
    connector = KVPolicyConnector(config, KVConnectorRole.SCHEDULER, model.kv_cache_config)
    try:
        yield connector
    finally:
        connector.connector_scheduler.client.close()


def test_the_connector_pins_divergent_local_hybrid_hits_off() -> None:
    """The store restores a Mamba state only at the boundaries it saved: it cannot complete a local hybrid
    hit whose attention reaches further. Pinned here, so that no upstream default can turn it on."""
    assert "supports_divergent_local_hybrid_hits" in vars(KVPolicyConnector)
    with scheduler_connector() as connector:
        assert connector.supports_divergent_local_hybrid_hits is False


def test_the_connector_is_a_best_effort_cache_that_needs_no_reliable_delivery() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    with scheduler_connector() as connector:
        assert KVConnectorBase_V1.requires_kv_delivery.fget(connector) is True  # vLLM's default for kv_both
        assert connector.requires_kv_delivery is False


def test_store_hits_count_under_host_memory_in_vllms_cache_hit_metrics() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.stats import PrefixCacheStats

    stats = PrefixCacheStats()
    with scheduler_connector() as connector:
        # What vLLM's scheduler records at admission for a request whose 96 of 128 tokens the store supplied.
        stats.record(num_tokens=128, num_hits=96, preempted=False,
                     hits_by_source=connector.get_external_cache_hit_sources(None, 96))  # type: ignore[arg-type]
        assert connector.get_external_cache_hit_sources(None, 0) == {}  # type: ignore[arg-type]
    assert stats.hits_by_source == {CacheHitSource.HOST: 96}


@pytest.mark.parametrize(("policy", "warned"), [("fail", True), ("recompute", False)])
def test_the_scheduler_warns_at_start_up_when_a_failed_load_would_fail_the_request(policy: str, warned: bool) -> None:
    import logging

    from kvpolicy.vllm.connector import LOAD_FAILURE_WARNING

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.kvpolicy.vllm.connector")
    logger.addHandler(handler)
    try:
        with scheduler_connector(policy):
            pass
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == ([LOAD_FAILURE_WARNING] if warned else [])


def test_vllm_factory_loads_the_connector_from_its_module_path() -> None:
    config = vllm_config("default").kv_transfer_config
    assert config is not None and KVConnectorFactory.get_connector_class(config) is KVPolicyConnector


def test_vllm_factory_accepts_the_connector_for_hybrid_models() -> None:
    config = vllm_config("default").kv_transfer_config
    assert config is not None and KVConnectorFactory.supports_hma_config(config)


def test_importing_kvpolicy_vllm_loads_neither_vllm_nor_mooncake() -> None:
    code = textwrap.dedent(
        """
        import sys
        import kvpolicy.vllm
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "mooncake", "torch")))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert result.stdout.strip() == "[]"
