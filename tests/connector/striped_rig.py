"""A striped load without vLLM: ``tp`` ranks with KV caches of their own (one tensor per layer), one
group replicated over replica sets of ``factor`` ranks, objects in a real Mooncake store, and each
rank's :class:`~kvpolicy.device.striped.StripedReadStore` over a real store client. The ranks are threads
(:class:`~kvpolicy.runtime.collective.ThreadExchange`) or processes (:func:`process_rank`, over gloo).
Only torch, Mooncake and kvpolicy are imported, so that a spawned rank starts fast."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy.device.striped import KVStorages, StripedReadStore
from kvpolicy.runtime.ports import PeerExchange


@dataclass(frozen=True)
class Rig:
    tp: int
    factor: int
    layers: int
    keys: int
    prefix: str
    block_bytes: int = 256
    blocks: int = 64
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16

    def replica_set(self, rank: int) -> tuple[int, ...]:
        first = rank // self.factor * self.factor
        return tuple(range(first, first + self.factor))

    def key(self, rank: int, chunk: int) -> str:
        """Members of a replica set share a namespace (``s{shard}``)."""
        return f"{self.prefix}/s{rank // self.factor}@{random.Random(f'{self.seed}/{chunk}').getrandbits(40):010x}"

    def block_ids(self) -> list[int]:
        """The blocks the load fills, the same on every rank (the scheduler's choice)."""
        return random.Random(self.seed).sample(range(self.blocks), self.keys)

    def objects(self) -> dict[str, bytes]:
        """Every object of the load, for every replica set: ``layers`` regions of ``block_bytes`` each."""
        return {
            self.key(first, chunk): random.Random(f"{self.key(first, chunk)}").randbytes(self.layers * self.block_bytes)
            for first in range(0, self.tp, self.factor)
            for chunk in range(self.keys)
        }

    def tensors(self, device: str = "cpu") -> list[torch.Tensor]:
        """One rank's KV cache: a tensor per layer, ``blocks`` blocks of ``block_bytes`` each."""
        elements = self.block_bytes // torch.empty(0, dtype=self.dtype).element_size()
        return [torch.zeros(self.blocks, elements, dtype=self.dtype, device=device) for _ in range(self.layers)]

    def request(self, rank: int, tensors: list[torch.Tensor]) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """Keys, region addresses and sizes as vLLM's receive thread hands them to the store."""
        keys, addrs, sizes = [], [], []
        for chunk, block in enumerate(self.block_ids()):
            keys.append(self.key(rank, chunk))
            addrs.append([tensor.data_ptr() + block * self.block_bytes for tensor in tensors])
            sizes.append([self.block_bytes] * self.layers)
        return keys, addrs, sizes

    def store(
        self, rank: int, client: Any, tensors: list[torch.Tensor], exchange: PeerExchange, **options: Any
    ) -> StripedReadStore:
        return StripedReadStore(
            client, tp_rank=rank, group_of_key=lambda key: 0, replica_set_of=lambda group: self.replica_set(rank),
            exchange=exchange, storages=KVStorages(tensors), **options,
        )

    def wrong(self, rank: int, tensors: list[torch.Tensor], results: list[int]) -> list[str]:
        """Keys reported loaded whose bytes on this rank are not the object's."""
        objects = self.objects()
        bad = []
        for chunk, block in enumerate(self.block_ids()):
            key = self.key(rank, chunk)
            got = b"".join(bytes(tensor[block].view(torch.uint8).cpu().numpy()) for tensor in tensors)
            if results[chunk] >= 0 and got != objects[key]:
                bad.append(key)
        return bad


def register(client: Any, tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        code = client.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if code != 0:
            raise RuntimeError(f"register_buffer returned {code}")


def unregister(client: Any, tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        client.unregister_buffer(tensor.data_ptr())


def process_rank(rank: int, rig: Rig, master_address: str, init_method: str, outcome: Any) -> None:
    """One rank in a process of its own: ``torch.distributed`` over gloo, a Mooncake client, a striped
    load exchanged with :func:`~kvpolicy.device.striped.gloo_exchange`; puts (results, wrong keys,
    counts) on ``outcome``."""
    import dataclasses

    from kvpolicy.device.striped import gloo_exchange
    from kvpolicy.mooncake.client import ClientConfig, MiB, connect_store

    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=rig.tp)
    client = connect_store(
        ClientConfig(master_server_address=master_address, global_segment_size=16 * MiB, local_buffer_size=4 * MiB)
    )
    try:
        tensors = rig.tensors()
        register(client, tensors)
        store = rig.store(rank, client, tensors, gloo_exchange(list(range(rig.tp)), timeout_s=30))
        results = store.batch_get_into_multi_buffers(*rig.request(rank, tensors))
        outcome.put((rank, results, rig.wrong(rank, tensors, results), dataclasses.asdict(store.counts)))
        torch.distributed.barrier()
        unregister(client, tensors)
    finally:
        client.close()
        torch.distributed.destroy_process_group()
