"""A rank's KV-cache tensors as flat byte views, found by the addresses the store calls list."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from kvpolicy.runtime.striping import StorageMap

__all__ = ["KVStorages", "as_words", "word_for"]

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
"""Integer types an indexed copy may move rows in, widest first (a row of ``n`` bytes as ``n / 8``
int64 words is 8 times fewer elements for the kernel than ``n`` uint8 ones)."""


def word_for(row_bytes: int, *addresses: int) -> torch.dtype:
    """The widest integer word that divides ``row_bytes`` and every one of ``addresses``."""
    for dtype in _WORDS:
        size = dtype.itemsize
        if row_bytes % size == 0 and all(address % size == 0 for address in addresses):
            return dtype
    return torch.uint8


def as_words(flat: torch.Tensor, row_bytes: int, word: torch.dtype | None = None) -> torch.Tensor:
    """A flat ``uint8`` view of whole rows of ``row_bytes`` as a 2-D view of ``word`` (by default the
    widest that divides the row and the view's address: :func:`word_for`). Shares memory: an indexed copy
    into it writes the bytes in place. The same view operations whatever the word."""
    word = word_for(row_bytes, flat.data_ptr()) if word is None else word
    return flat.view(word).view(-1, row_bytes // word.itemsize)


class KVStorages:
    """The storages of a rank's KV-cache tensors as flat byte tensors, found by address (every
    address a token database produces lies in one of them).

    The tensors may lie on several devices: vLLM hands host tensors beside device ones where a
    sparse-attention backend keeps some groups in host memory (HiSparse). Reading regions works on any
    mix; :attr:`device` (what a striped load stages on) is asked only where one device is required."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        storages: dict[int, torch.Tensor] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in storages:
                # A flat uint8 view of the whole storage (shares memory; nothing is copied).
                storages[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        if not storages:
            raise ValueError("no KV-cache tensors")
        starts = sorted(storages)
        self._views = [storages[start] for start in starts]
        self.devices: tuple[torch.device, ...] = tuple(dict.fromkeys(view.device for view in self._views))
        """Every device the tensors lie on, in address order of their first storage."""
        self.map = StorageMap(starts, [view.numel() for view in self._views])
        """Where each storage lies (the numbering :meth:`rows` takes)."""

    @property
    def device(self) -> torch.device:
        """The one device every tensor lies on; ``ValueError`` naming them when there are several."""
        if len(self.devices) != 1:
            raise ValueError(f"KV-cache tensors on several devices: {', '.join(map(str, self.devices))}")
        return self.devices[0]

    @classmethod
    def of_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> KVStorages:
        """From the ``kv_caches`` dict the model runner hands ``register_kv_caches`` (a tensor, or a
        list of tensors sharing one storage, per layer)."""
        return cls(
            tensor
            for value in kv_caches.values()
            for tensor in (value if isinstance(value, (list, tuple)) else (value,))
        )

    def rows(self, storage: int, row_bytes: int, word: torch.dtype | None = None) -> torch.Tensor:
        """Storage ``storage`` as rows of ``row_bytes`` (a view; a tail shorter than a row is left out),
        each row in words of ``word`` (by default the widest integer word that divides it: :func:`as_words`)."""
        view = self._views[storage]
        return as_words(view[: view.numel() // row_bytes * row_bytes], row_bytes, word)

    def address(self, storage: int) -> int:
        """Where storage ``storage`` starts."""
        return self.map.starts[storage]

    def region(self, address: int, size: int) -> torch.Tensor:
        """A uint8 view (shared memory: writable) of ``size`` bytes at ``address``; ``ValueError`` when they
        do not lie inside one registered tensor."""
        where, offset = self.map.locate(address, size)
        return self._views[where][offset : offset + size]
