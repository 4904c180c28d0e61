"""A rank's KV-cache tensors as flat byte views, found by the addresses the store calls list."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from kvpolicy.runtime.striping import StorageMap

__all__ = ["KVStorages"]


class KVStorages:
    """The storages of a rank's KV-cache tensors as flat byte tensors, found by address (every
    address a token database produces lies in one of them)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        storages: dict[int, torch.Tensor] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in storages:
                # A flat uint8 view of the whole storage (shares memory; nothing is copied).
                storages[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        if not storages:
            raise ValueError("no KV-cache tensors")
        devices = {view.device for view in storages.values()}
        if len(devices) != 1:
            raise ValueError(f"KV-cache tensors on several devices: {sorted(map(str, devices))}")
        starts = sorted(storages)
        self._views = [storages[start] for start in starts]
        self.device: torch.device = devices.pop()
        self.map = StorageMap(starts, [view.numel() for view in self._views])
        """Where each storage lies (the numbering :meth:`rows` takes)."""

    @classmethod
    def of_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> KVStorages:
        """From the ``kv_caches`` dict the model runner hands ``register_kv_caches`` (a tensor, or a
        list of tensors sharing one storage, per layer)."""
        return cls(
            tensor
            for value in kv_caches.values()
            for tensor in (value if isinstance(value, (list, tuple)) else (value,))
        )

    def rows(self, storage: int, row_bytes: int) -> torch.Tensor:
        """Storage ``storage`` as rows of ``row_bytes`` (a view; a tail shorter than a row is left out)."""
        view = self._views[storage]
        return view[: view.numel() // row_bytes * row_bytes].view(-1, row_bytes)

    def region(self, address: int, size: int) -> torch.Tensor:
        """A uint8 view (shared memory: writable) of ``size`` bytes at ``address``; ``ValueError`` when they
        do not lie inside one registered tensor."""
        where, offset = self.map.locate(address, size)
        return self._views[where][offset : offset + size]
