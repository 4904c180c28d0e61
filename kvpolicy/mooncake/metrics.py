"""Read the Mooncake master's Prometheus metrics, and the counters that measure store traffic.

The master counts every batch item it handles, so the difference of two snapshots tells exactly
how many objects a piece of code wrote, read and probed. vLLM's store connector only uses the
batch APIs (``batch_put_from_multi_buffers``, ``batch_get_into_multi_buffers``,
``batch_is_exist``); single ``put``/``get`` calls land in other counters
(``master_put_start_requests_total``, ``master_get_replica_list_requests_total``).
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Self


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, by name.

    A labelled sample is kept under its full ``name{labels}`` key and also summed into the bare
    ``name``. Comments and blank lines are skipped; a trailing timestamp is ignored.
    """
    samples: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:
            close = line.rindex("}")
            key, name, rest = line[: close + 1], line[:brace], line[close + 1 :]
        else:
            key, _, rest = line.partition(" ")
            name = key
        value = float(rest.split()[0])
        samples[key] = value
        if key != name:
            samples[name] = samples.get(name, 0.0) + value
    return samples


def read_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Fetch *url* (a ``/metrics`` endpoint) and parse it with :func:`parse_metrics`."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_metrics(response.read().decode())


@dataclass(frozen=True)
class MasterCounters:
    """The master metrics that measure store traffic; a snapshot, or a :func:`delta`."""

    batch_put_start_items: int
    """``master_batch_put_start_items_total``: keys offered to batch puts, *including* keys that
    already existed (the client reports success for those, but nothing is written)."""
    batch_put_start_failed_items: int
    """``master_batch_put_start_failed_items_total``: offered keys the master refused, e.g. because
    they already existed or no segment had room."""
    batch_put_end_items: int
    """``master_batch_put_end_items_total``: objects a batch put actually wrote."""
    batch_get_replica_list_items: int
    """``master_batch_get_replica_list_items_total``: keys looked up by batch gets, misses
    included."""
    batch_get_replica_list_failed_items: int
    """``master_batch_get_replica_list_failed_items_total``: batch-get keys that were missing."""
    batch_exist_key_items: int
    """``master_batch_exist_key_items_total``: keys probed by ``batch_is_exist``."""
    key_count: int
    """``master_key_count`` (a gauge): objects stored now; drops when a client holding them
    closes."""

    @property
    def objects_written(self) -> int:
        """Objects stored by batch puts."""
        return self.batch_put_end_items

    @property
    def objects_read(self) -> int:
        """Objects found by batch gets."""
        return self.batch_get_replica_list_items - self.batch_get_replica_list_failed_items

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> Self:
        """Pick the counters out of parsed metrics; a missing one raises ``KeyError``."""
        values = {}
        for field in dataclasses.fields(cls):
            name = f"master_{field.name}" + ("" if field.name == "key_count" else "_total")
            if name not in metrics:
                raise KeyError(f"metric {name!r} missing from the master's /metrics")
            values[field.name] = int(metrics[name])
        return cls(**values)

    @classmethod
    def read(cls, url: str) -> Self:
        """Snapshot the counters of the master serving *url*."""
        return cls.from_metrics(read_metrics(url))


def delta(before: MasterCounters, after: MasterCounters) -> MasterCounters:
    """Counts between two snapshots, field by field (``key_count`` may be negative)."""
    return MasterCounters(
        **{
            field.name: getattr(after, field.name) - getattr(before, field.name)
            for field in dataclasses.fields(MasterCounters)
        }
    )
