"""kvpolicy's own series in vLLM's ``/metrics``, through vLLM's KV-connector stats and Prometheus hooks.

Each worker counts, per KV-cache group, what its send thread wrote (objects, bytes), what a policy
without dedup would have written, and the puts it skipped because the key was already stored; the
replication audit's outcomes and demotions; and lookups the audit gate refused. vLLM aggregates the
workers' :class:`KVPolicyConnectorStats` (the stock Mooncake store telemetry travels inside them,
unchanged) and hands them to :class:`KVPolicyPromMetrics`, which the connector's
``build_prom_metrics`` returns (also as a child of ``MultiConnector``). Rank 0 adds the plan itself,
exported as one ``vllm:kvpolicy_group_info`` series per group.

:data:`METRICS` names every series; the README lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
    MooncakeStoreConnectorStats,
    MooncakeStorePromMetrics,
)

from kvpolicy.runtime.ports import SendStore
from kvpolicy.runtime.tally import GROUP_COUNTERS, Tally, empty_tally
from kvpolicy.vllm import internals

METRICS: dict[str, str] = {
    "vllm:kvpolicy_group_info": "One series per KV-cache group of the plan running (value 1): group, name, spec, "
    "rule, factor, shards, policy, fingerprint.",
    "vllm:kvpolicy_objects_written_total": "Objects the connector put into the store, per group.",
    "vllm:kvpolicy_bytes_written_total": "Bytes the connector put into the store, per group.",
    "vllm:kvpolicy_undeduplicated_objects_total": "Objects a policy without dedup (every rank its own copy) would "
    "have put for the same saves, per group.",
    "vllm:kvpolicy_undeduplicated_bytes_total": "Bytes a policy without dedup would have put, per group.",
    "vllm:kvpolicy_puts_skipped_existing_total": "Puts skipped because the store already held the key, per group.",
    "vllm:kvpolicy_audit_steps_total": "Replication-audit steps, by outcome (agreed, mismatch).",
    "vllm:kvpolicy_demotions_total": "Groups the replication audit demoted to factor 1, per group.",
    "vllm:kvpolicy_lookups_gated_total": "Lookups answered as a miss because the audit gate was closed.",
    "vllm:kvpolicy_objects_refused_total": "Loads refused because the object's seal did not match its key and bytes "
    "(kvpolicy_verify_objects): recomputed, never loaded.",
}
"""Every series kvpolicy adds to vLLM's ``/metrics``, with its help text."""


class CountingStore:
    """vLLM's Mooncake store client as the send thread sees it (a :class:`~kvpolicy.runtime.ports.SendStore`),
    counting per group what it puts and what it finds already stored. ``group_of(key)`` is a key's
    group (None: not a plan key), ``multiplier(group)`` the copies a policy without dedup would write."""

    def __init__(
        self, store: SendStore, tally: Tally, group_of: Callable[[str], int | None], multiplier: Callable[[int], int]
    ) -> None:
        self._store, self._tally, self._group_of, self._multiplier = store, tally, group_of, multiplier

    @property
    def inner(self) -> SendStore:
        """The client this wraps."""
        return self._store

    def batch_is_exist(self, keys: list[str]) -> Sequence[int]:
        found = self._store.batch_is_exist(keys)
        skipped: dict[int, int] = {}
        for key, exists in zip(keys, found, strict=False):
            group = self._group_of(key)
            if group is not None and exists == 1:
                skipped[group] = skipped.get(group, 0) + 1
        for group, count in skipped.items():
            self._tally.add(group, puts_skipped_existing=count)
        return found

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any = None
    ) -> Sequence[int]:
        results = self._store.batch_put_from_multi_buffers(keys, addrs, sizes, config)
        written: dict[int, list[int]] = {}
        for key, size, result in zip(keys, sizes, results, strict=False):
            group = self._group_of(key)
            if group is not None and result >= 0:
                entry = written.setdefault(group, [0, 0])
                entry[0] += 1
                entry[1] += sum(size)
        for group, (objects, size) in written.items():
            copies = self._multiplier(group)
            self._tally.add(
                group,
                objects_written=objects,
                bytes_written=size,
                undeduplicated_objects=objects * copies,
                undeduplicated_bytes=size * copies,
            )
        return results


def _merge_kvpolicy(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for group, counts in other.get("groups", {}).items():
        entry = into["groups"].setdefault(group, dict.fromkeys(GROUP_COUNTERS, 0))
        for name in GROUP_COUNTERS:
            entry[name] += int(counts.get(name, 0))
    for section in ("audit", "demotions"):
        for key, value in other.get(section, {}).items():
            into[section][key] = into[section].get(key, 0) + int(value)
    into["lookups_gated"] += int(other.get("lookups_gated", 0))
    into["objects_refused"] += int(other.get("objects_refused", 0))
    if other.get("plan") is not None:
        into["plan"] = other["plan"]


@dataclass
class KVPolicyConnectorStats(KVConnectorStats):
    """``{"mooncake": <the stock store connector's stats data>, "kvpolicy": <kvpolicy's counters>}``."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self.data.setdefault("mooncake", {})
        kvpolicy = self.data.setdefault("kvpolicy", empty_tally())
        for key, value in empty_tally().items():
            kvpolicy.setdefault(key, value)

    def reset(self) -> None:
        self.data = {"mooncake": {}, "kvpolicy": empty_tally()}

    def is_empty(self) -> bool:
        kvpolicy = self.data["kvpolicy"]
        return not self.data["mooncake"] and not any(
            (kvpolicy["groups"], kvpolicy["audit"], kvpolicy["demotions"], kvpolicy["lookups_gated"],
             kvpolicy["objects_refused"], kvpolicy["plan"])
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        data = other.data if isinstance(other, KVPolicyConnectorStats) else {"mooncake": other.data}
        for operation, records in data.get("mooncake", {}).items():
            self.data["mooncake"].setdefault(operation, []).extend(records)
        _merge_kvpolicy(self.data["kvpolicy"], data.get("kvpolicy", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = dict(MooncakeStoreConnectorStats(data=self.data["mooncake"]).reduce())
        groups = self.data["kvpolicy"]["groups"].values()
        written = sum(entry["bytes_written"] for entry in groups)
        undeduplicated = sum(entry["undeduplicated_bytes"] for entry in groups)
        reduced["kvpolicy_objects_written"] = sum(entry["objects_written"] for entry in groups)
        reduced["kvpolicy_bytes_written"] = written
        reduced["kvpolicy_bytes_saved_by_dedup"] = undeduplicated - written
        reduced["kvpolicy_puts_skipped_existing"] = sum(entry["puts_skipped_existing"] for entry in groups)
        reduced["kvpolicy_lookups_gated"] = self.data["kvpolicy"]["lookups_gated"]
        reduced["kvpolicy_objects_refused"] = self.data["kvpolicy"]["objects_refused"]
        return reduced


class KVPolicyPromMetrics(MooncakeStorePromMetrics):
    """The stock Mooncake store series, and kvpolicy's (:data:`METRICS`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._info_labels = ["group", "name", "spec", "rule", "factor", "shards", "policy", "fingerprint"]
        self._info = internals.gauge_class(self)(
            name="vllm:kvpolicy_group_info",
            documentation=METRICS["vllm:kvpolicy_group_info"],
            labelnames=labelnames + self._info_labels,
            multiprocess_mode="mostrecent",
        )
        self._info_shown: dict[int, list[list[object]]] = {}
        self._group_counters = {
            name: internals.counter_class(self)(
                name=f"vllm:kvpolicy_{name}", documentation=METRICS[f"vllm:kvpolicy_{name}_total"],
                labelnames=labelnames + ["group"],
            )
            for name in GROUP_COUNTERS
        }
        self._audit = internals.counter_class(self)(
            name="vllm:kvpolicy_audit_steps", documentation=METRICS["vllm:kvpolicy_audit_steps_total"],
            labelnames=labelnames + ["outcome"],
        )
        self._demotions = internals.counter_class(self)(
            name="vllm:kvpolicy_demotions", documentation=METRICS["vllm:kvpolicy_demotions_total"],
            labelnames=labelnames + ["group"],
        )
        self._gated = internals.counter_class(self)(
            name="vllm:kvpolicy_lookups_gated", documentation=METRICS["vllm:kvpolicy_lookups_gated_total"],
            labelnames=labelnames,
        )
        self._refused = internals.counter_class(self)(
            name="vllm:kvpolicy_objects_refused", documentation=METRICS["vllm:kvpolicy_objects_refused_total"],
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        super().observe(transfer_stats_data.get("mooncake") or {}, engine_idx)
        kvpolicy = transfer_stats_data.get("kvpolicy") or {}
        engine = list(self.per_engine_labelvalues[engine_idx])
        if kvpolicy.get("plan") is not None:
            remove = getattr(self._info, "remove", None)  # vLLM's Ray wrappers have none: the series stay
            for labels in self._info_shown.pop(engine_idx, []):
                if remove is not None:
                    remove(*labels)
            shown = [engine + [str(entry.get(name, "")) for name in self._info_labels] for entry in kvpolicy["plan"]]
            for labels in shown:
                self._info.labels(*labels).set(1)
            self._info_shown[engine_idx] = shown
        for group, counts in kvpolicy.get("groups", {}).items():
            for name, counter in self._group_counters.items():
                if counts.get(name):
                    counter.labels(*engine, group).inc(counts[name])
        for outcome, count in kvpolicy.get("audit", {}).items():
            self._audit.labels(*engine, outcome).inc(count)
        for group, count in kvpolicy.get("demotions", {}).items():
            self._demotions.labels(*engine, group).inc(count)
        if kvpolicy.get("lookups_gated"):
            self._gated.labels(*engine).inc(kvpolicy["lookups_gated"])
        if kvpolicy.get("objects_refused"):
            self._refused.labels(*engine).inc(kvpolicy["objects_refused"])
