"""What runs on KV-cache tensors when vLLM hands it devices, threads and memory that a CPU test cannot
have: KV tensors on more than one device, a receive thread whose current device is 0, staging read off the
device in few copies, rows moved in wide words. Torch and kvpolicy.device only (no vLLM, no Mooncake)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from conftest import require

torch = require("torch")

from exchange_rig import nccl_exchange_rank  # noqa: E402

from kvpolicy.device.blocks import BlockReader, local_digests, local_layer_digests  # noqa: E402
from kvpolicy.device.storages import KVStorages  # noqa: E402
from kvpolicy.device.striped import exchange_group, torchcomms_enabled  # noqa: E402

LAYERS = 3
BLOCKS = 8
BLOCK_BYTES = 512


class LayerOutermostBlocks:
    """The regions of one block in a layer-outermost cache, as vLLM's token database gives them."""

    def __init__(self, layers: list[Any]) -> None:
        self._layers = layers

    def prepare_value_for_block(self, block_id: int) -> tuple[list[int], list[int]]:
        return [layer[block_id].data_ptr() for layer in self._layers], [BLOCK_BYTES] * len(self._layers)


def host_cache(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layer.{index}": torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=generator)
        for index in range(LAYERS)
    }


# --- KV tensors on several devices (HiSparse keeps some groups in host memory) ------------------------


def test_kv_tensors_on_two_devices_are_read_where_they_lie() -> None:
    # 'meta' stands in for the GPU beside the host tensors: a CPU machine has no second real device.
    host = host_cache()
    caches = {**host, "offloaded.0": torch.empty(BLOCKS, BLOCK_BYTES, dtype=torch.uint8, device="meta")}
    layers = list(host.values())
    digests = local_digests([LayerOutermostBlocks(layers)], BlockReader(caches), {0: [1, 5]})
    assert digests == local_digests([LayerOutermostBlocks(layers)], BlockReader(host), {0: [1, 5]})


def test_one_device_is_asked_of_kv_tensors_on_two_only_where_striping_needs_it() -> None:
    storages = KVStorages([torch.zeros(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8, device="meta")])
    assert sorted(map(str, storages.devices)) == ["cpu", "meta"]
    with pytest.raises(ValueError, match="several devices: "):
        _ = storages.device


# --- reading for discovery ----------------------------------------------------------------------------


def test_discovery_reads_a_groups_blocks_off_the_device_in_one_copy_not_one_per_layer_and_block() -> None:
    caches = host_cache()
    layers = list(caches.values())
    blocks = {0: [0, 2, 3, 7]}
    # The device path (one copy of the regions to the host) taken on host tensors, to count its copies.
    reader = BlockReader(caches, copy_to_host=True)
    per_layer = local_layer_digests([LayerOutermostBlocks(layers)], reader, blocks, {0: list(caches)})
    in_place = local_layer_digests([LayerOutermostBlocks(layers)], BlockReader(caches), blocks, {0: list(caches)})
    assert per_layer == in_place and len(per_layer[0]) == LAYERS and all(len(d) == 4 for d in per_layer[0].values())
    assert reader.host_copies == 1


# --- indexed copies in words --------------------------------------------------------------------------


@pytest.mark.parametrize(("row_bytes", "word"), [(4096, torch.int64), (12, torch.int32), (6, torch.int16), (3, torch.uint8)])
def test_kv_rows_are_moved_in_the_widest_word_that_divides_them(row_bytes: int, word: torch.dtype) -> None:
    storages = KVStorages([torch.zeros(row_bytes * 4, dtype=torch.uint8)])
    rows = storages.rows(0, row_bytes)
    assert (rows.dtype, tuple(rows.shape)) == (word, (4, row_bytes // word.itemsize))


# --- the NCCL exchange on vLLM's receive thread --------------------------------------------------------


def test_the_nccl_exchange_enters_its_kv_device_on_the_receive_thread_and_leaves_device_0_alone(tmp_path: Path) -> None:
    """Two ranks, KV caches on cuda:0 and cuda:1, each exchange called on a new thread (current device 0).
    The device API is a stand-in (no CUDA here); the transfers are real, over gloo."""
    context = multiprocessing.get_context("spawn")
    outcome = context.Queue()
    init = f"file://{tmp_path / 'gloo-init'}"
    processes = [context.Process(target=nccl_exchange_rank, args=(rank, init, outcome)) for rank in range(2)]
    for process in processes:
        process.start()
    reports = sorted(outcome.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0], reports
    for rank, events, contexts, after, received in reports:
        assert events == [
            ("enter", rank),                   # the KV cache's device made current on the receive thread
            ("batch_isend_irecv", rank),       # the transfers queued on it
            ("synchronize", rank, rank),       # its stream, named, waited for
            ("leave", 0),                      # the thread's device as it was, with no context made there
        ]
        assert contexts == [rank]              # rank 1 never touches cuda:0
        assert after == 0
        assert received == [2 - rank] * 16     # what the other rank sent


# --- TorchComms ---------------------------------------------------------------------------------------


def test_an_exchange_group_under_torchcomms_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_USE_TORCHCOMMS", "1")
    assert torchcomms_enabled()
    with pytest.raises(RuntimeError, match="TorchComms .* cannot make"):
        exchange_group([0, 1], "gloo", __import__("datetime").timedelta(seconds=1))
