"""KV caches on more than one device: vLLM hands host tensors beside device ones where a sparse-attention
backend keeps a group in host memory (HiSparse, vLLM 0.33). The production ``KVPolicyStoreWorker`` must
start on them as upstream's worker does (the audit's block reader, built when the audit first reads, reads
tensors where they lie: ``tests/device/test_device_paths.py``), and striped loads, which stage on one
device, fall back to reads on every rank.

Simulated instances on a real Mooncake master, one group's KV tensors on the ``meta`` device: a CPU
machine has no second real device, and what matters here is that the tensors are on two."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

import torch  # noqa: E402

from kvpolicy.device.striped import StripedReadStore  # noqa: E402
from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.language.models import LoadMode  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.runtime.read_failures import RecordingReadStore  # noqa: E402
from kvpolicy.sim import Fleet  # noqa: E402
from kvpolicy.sim import rank as sim_rank  # noqa: E402

NUM_TOKENS = 128


def _on_meta(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [tensor.to("meta") for tensor in value]
    return value.to("meta")


@pytest.fixture
def last_group_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runner hands the last KV-cache group's tensors on another device than the rest's."""
    allocate = sim_rank.allocate_kv_cache

    def mixed(kv_cache_config: Any, device: torch.device, layout: Any) -> dict[str, Any]:
        caches = allocate(kv_cache_config, device, layout)
        elsewhere = set(kv_cache_config.kv_cache_groups[-1].layer_names)
        return {name: _on_meta(value) if name in elsewhere else value for name, value in caches.items()}

    monkeypatch.setattr(sim_rank, "allocate_kv_cache", mixed)


def devices_of(kv_caches: dict[str, Any]) -> set[str]:
    return {str(tensor.device) for value in kv_caches.values() for tensor in (value if isinstance(value, list) else [value])}


@pytest.mark.parametrize("policy", ["vllm-compat", "default"], ids=["audit-off", "audit-warn"])
def test_a_worker_starts_on_kv_caches_on_two_devices(
    mooncake_master: MooncakeMaster, clients: ClientPool, last_group_on_meta: None, policy: str
) -> None:
    with Fleet("gqa-gdn", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        instance = fleet.instance(load_policy(policy), 2, name="mixed")
        assert all(devices_of(rank.kv_caches) == {"cpu", "meta"} for rank in instance.ranks)  # as registered
        assert instance.lookup().hit_length == 0  # nothing stored: it looks up, and misses


def test_striped_loads_over_kv_caches_on_two_devices_fall_back_to_reads_on_every_rank(
    mooncake_master: MooncakeMaster, clients: ClientPool, last_group_on_meta: None
) -> None:
    striped = load_policy("default").model_copy(update={"load": LoadMode.STRIPED})
    with Fleet("kimi-linear", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        instance = fleet.instance(striped, 2, name="mixed")
        assert max(instance.plan.factors) > 1  # the MLA group is replicated: striping would apply
        stores = [thread.store for rank in instance.ranks for thread in rank.worker.kv_recv_threads]
        inner = [store.inner if isinstance(store, RecordingReadStore) else store for store in stores]
        assert inner and not any(isinstance(store, StripedReadStore) for store in inner)
