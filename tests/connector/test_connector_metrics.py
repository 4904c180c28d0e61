"""kvpolicy's metrics: counted by the production worker on simulated ranks through a real Mooncake
master, carried in vLLM's KV-connector stats, exported by the connector's Prometheus hooks (alone and
as a child of ``MultiConnector``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: E402

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.language.keys import parse_key  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import BLOCK_SIZE, Fleet  # noqa: E402
from kvpolicy.sim.instance import Instance  # noqa: E402
from kvpolicy.vllm.connector import KVPolicyConnector  # noqa: E402
from kvpolicy.vllm.metrics import METRICS, KVPolicyConnectorStats  # noqa: E402

NUM_TOKENS = 4 * BLOCK_SIZE + 1


def stats_of(instance: Instance) -> KVPolicyConnectorStats:
    """Every rank's stats since the last call, aggregated as vLLM's executor aggregates them."""
    total = KVPolicyConnector.build_kv_connector_stats()
    for rank in instance.ranks:
        stats = rank.worker.get_kv_connector_stats()
        if stats is not None:
            total = total.aggregate(stats)
    assert isinstance(total, KVPolicyConnectorStats)
    return total


def written_per_group(puts: Any, template: str) -> dict[str, int]:
    """Chunk keys written (not audit markers), per the group their namespace names."""
    counts: dict[str, int] = {}
    for _, key, code in puts:
        parsed = parse_key(key, template)
        if parsed.chunk_hash is not None and code >= 0:
            group = str(parsed.prefix.group)
            counts[group] = counts.get(group, 0) + 1
    return counts


@pytest.fixture
def fleet(mooncake_master: MooncakeMaster, clients: ClientPool):
    with Fleet("kimi-linear", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        yield fleet


def test_objects_written_are_counted_per_group_as_the_store_saw_them(fleet: Fleet) -> None:
    instance = fleet.instance(load_policy("default"), 2)
    stats_of(instance)  # the plan, published at start-up
    outcome = instance.save()
    groups = stats_of(instance).data["kvpolicy"]["groups"]
    assert {group: counts["objects_written"] for group, counts in groups.items()} == written_per_group(
        outcome.puts, instance.plan.key_template
    )


def test_what_no_dedup_would_write_is_each_object_times_its_replica_set(fleet: Fleet) -> None:
    instance = fleet.instance(load_policy("default"), 2)
    instance.save()
    groups = stats_of(instance).data["kvpolicy"]["groups"]
    factors = {str(group.index): group.factor for group in instance.plan.groups}
    assert {2} <= set(factors.values())  # the MLA group is shared by both ranks
    for group, counts in groups.items():
        assert counts["undeduplicated_objects"] == counts["objects_written"] * factors[group], group
        assert counts["undeduplicated_bytes"] == counts["bytes_written"] * factors[group], group


def test_a_second_save_of_stored_chunks_counts_puts_skipped(fleet: Fleet) -> None:
    instance = fleet.instance(load_policy("no-dedup"), 2)
    first = instance.save()
    stats_of(instance)
    instance.save(request="again")
    groups = stats_of(instance).data["kvpolicy"]["groups"]
    assert {group: counts["puts_skipped_existing"] for group, counts in groups.items()} == written_per_group(
        first.puts, instance.plan.key_template
    )
    assert all(counts["objects_written"] == 0 for counts in groups.values())


def test_rank_zero_publishes_the_plan_once(fleet: Fleet) -> None:
    instance = fleet.instance(load_policy("default"), 2)
    first, second = stats_of(instance), stats_of(instance)
    info = first.data["kvpolicy"]["plan"]
    assert [entry["factor"] for entry in info] == [str(group.factor) for group in instance.plan.groups]
    assert {entry["fingerprint"] for entry in info} == {instance.plan.fingerprint}
    assert second.data["kvpolicy"]["plan"] is None


def test_a_gated_lookup_and_an_audited_step_are_counted(fleet: Fleet) -> None:
    instance = fleet.instance(load_policy("default"), 2)
    instance.lookup()
    assert instance.last_lookup_gated
    instance.save()
    kvpolicy = stats_of(instance).data["kvpolicy"]
    assert (kvpolicy["lookups_gated"], kvpolicy["audit"]) == (1, {"agreed": 1})


# --- Prometheus ----------------------------------------------------------------------------------


def metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """vLLM's metric classes, registered in ``registry`` instead of the process-wide default."""

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry, **k)})

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def kvpolicy_config() -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(**KVPolicySettings(kvpolicy="default").kv_transfer_config())
    )


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in:\n{text}")


def test_the_prometheus_series_carry_the_counts_and_the_plan(fleet: Fleet) -> None:
    instance = fleet.instance(load_policy("default"), 2)
    outcome = instance.save()
    data = stats_of(instance).data
    registry = CollectorRegistry()
    prom = KVPolicyConnector.build_prom_metrics(kvpolicy_config(), metric_types(registry), ["engine"], {0: ["0"]})
    prom.observe(data, 0)
    text = generate_latest(registry).decode()
    for group, count in written_per_group(outcome.puts, instance.plan.key_template).items():
        assert sample(text, "vllm:kvpolicy_objects_written_total", group=group) == count
    mla = next(group for group in instance.plan.groups if group.factor == 2)
    assert sample(text, "vllm:kvpolicy_group_info", group=str(mla.index), factor="2", fingerprint=instance.plan.fingerprint) == 1
    assert sample(text, "vllm:kvpolicy_audit_steps_total", outcome="agreed") == 1
    assert sample(text, "vllm:mooncake_store_operation_total", operation="save_put") >= 1  # the stock series too


def test_a_new_plan_replaces_the_info_series() -> None:
    registry = CollectorRegistry()
    prom = KVPolicyConnector.build_prom_metrics(kvpolicy_config(), metric_types(registry), ["engine"], {0: ["0"]})
    info = {"group": "0", "name": "mla", "spec": "MLAAttentionSpec", "rule": "r", "shards": "1", "policy": "p"}
    prom.observe({"kvpolicy": {"plan": [{**info, "factor": "2", "fingerprint": "old"}]}}, 0)
    prom.observe({"kvpolicy": {"plan": [{**info, "factor": "1", "fingerprint": "new"}]}}, 0)
    text = generate_latest(registry).decode()
    assert 'fingerprint="old"' not in text and sample(text, "vllm:kvpolicy_group_info", fingerprint="new") == 1


def test_every_series_is_named_in_the_documentations_metrics_reference() -> None:
    from kvpolicy.app.reference import metrics_markdown

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
    reference = metrics_markdown()
    assert "<!-- kvpolicy-reference: metrics -->" in page
    assert [name for name in METRICS if f"| `{name}` | {METRICS[name]}" not in reference] == []


def test_inside_multiconnector_the_stats_rebuild_and_reach_prometheus(fleet: Fleet) -> None:
    instance = fleet.instance(load_policy("default"), 2)
    instance.save()
    data = stats_of(instance).data
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both",
            kv_connector_extra_config={"connectors": [KVPolicySettings(kvpolicy="default").kv_transfer_config()]},
        )
    )
    # What the API server does with the payload it receives: rebuild each child's stats by connector name.
    rebuilt = MultiConnector.build_kv_connector_stats({"KVPolicyConnector": data})
    assert isinstance(rebuilt.data["KVPolicyConnector"], KVPolicyConnectorStats)
    assert rebuilt.reduce()["KVPolicyConnector"]["kvpolicy_objects_written"] > 0
    registry = CollectorRegistry()
    prom = MultiConnector.build_prom_metrics(config, metric_types(registry), ["engine"], {0: ["0"]})
    prom.observe({"KVPolicyConnector": data}, 0)
    assert "vllm:kvpolicy_objects_written_total" in generate_latest(registry).decode()
