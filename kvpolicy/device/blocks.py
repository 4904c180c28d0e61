"""Reading KV-cache blocks out of device memory, for the replication audit: torch only, no vLLM.

:class:`BlockReader` slices uint8 views of the registered KV-cache tensors' storage at the (address, size)
regions a token database names, the regions the store would write. On a GPU only the audited blocks are
copied to the host, in one copy per group and device, on the current stream (so after the forward that wrote
them); discovery's per-layer digests read a group's blocks in that same one copy. The tensors may lie on
several devices (HiSparse keeps some groups in host memory beside the device ones).
:mod:`kvpolicy.vllm.audit` feeds it vLLM's ``ChunkedTokenDatabase``; ``scripts/gpu_check.py`` runs it on a
GPU without vLLM.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from kvpolicy.device.storages import KVStorages
from kvpolicy.evidence.audit import DEFAULT_COMPARISON, Digest, ValueComparison, digest_blocks
from kvpolicy.runtime.ports import TokenDatabase

__all__ = ["SAMPLE_VALUES", "BlockReader", "block_regions", "local_digests", "local_layer_digests",
           "local_samples", "tensor_distance"]

SAMPLE_VALUES = 16_384
"""Values per rank and group sent when a replica set's digests differ (64 KiB as float32): an
evenly strided sample of the audited blocks' values, compared with a tolerance for rounding."""


class BlockReader:
    """Reads byte ranges of registered KV-cache tensors by address.

    Built from the ``kv_caches`` dict the model runner hands to ``register_kv_caches`` (a tensor,
    or a list of tensors sharing one storage, per layer); every address a token database produces
    lies in one of their storages.
    """

    def __init__(self, kv_caches: Mapping[str, Any], *, copy_to_host: bool = False) -> None:
        """``copy_to_host`` takes the device path (one copy of a read's regions to the host) on CPU
        tensors too, where they are otherwise read in place: tests use it to count that path's copies."""
        self._kv_caches = dict(kv_caches)
        self._storages = KVStorages.of_kv_caches(kv_caches)
        self._copy_to_host = copy_to_host
        self.host_copies = 0
        """Copies to host memory made so far (one per :meth:`read` and device, on the device path)."""

    def region(self, address: int, size: int) -> torch.Tensor:
        """A uint8 view (shared memory: writable) of ``size`` bytes of a registered tensor at ``address``."""
        return self._storages.region(address, size)

    def tensors(self, layer_names: Iterable[str]) -> list[torch.Tensor]:
        """The registered tensors of these layers (a Mamba layer has one per state)."""
        found: list[torch.Tensor] = []
        for name in layer_names:
            value = self._kv_caches[name]
            found.extend(value if isinstance(value, (list, tuple)) else (value,))
        return found

    def values(
        self,
        database: TokenDatabase,
        block_ids: Sequence[int],
        tensors: Sequence[torch.Tensor],
        *,
        element: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The blocks' values as numbers (on the tensors' device), for comparing with a tolerance.

        Given ``element`` (the number type of the stored bytes, e.g. ``torch.float8_e4m3fn`` for an
        fp8 cache vLLM stores as ``uint8``: :func:`value_comparisons`), the token database's regions
        are read as that type. Else, with one dtype among the group's tensors (attention), they are
        read as that dtype, whatever the tensors' shape; with several (a Mamba layer's states), each
        state tensor is indexed by block id along its first dimension, vLLM's layout for state tensors.
        """
        dtypes = {tensor.dtype for tensor in tensors}
        if element is not None or len(dtypes) == 1:
            dtype = element if element is not None else next(iter(dtypes))
            addresses, sizes = block_regions(database, block_ids)
            raw = torch.cat([self.region(address, size) for address, size in zip(addresses, sizes, strict=True)])
            itemsize = torch.empty(0, dtype=dtype).element_size()
            return raw[: raw.numel() // itemsize * itemsize].view(dtype).reshape(-1)
        parts = []
        for tensor in tensors:
            index = torch.tensor(list(block_ids), device=tensor.device, dtype=torch.long)
            parts.append(tensor.index_select(0, index).reshape(-1).float())
        return torch.cat(parts)

    def spans(self, layer_names: Iterable[str]) -> list[tuple[int, int, str]]:
        """(first address, end address, layer) of the memory each layer's tensors reach, by address.

        The layers of one KV-cache group never share memory (vLLM shares a buffer only between layers
        of different groups), so within a group every region a token database names starts in exactly
        one layer's span. A region may run past its tensor's view (a Mamba state's region is the whole
        padded page), so regions are attributed by where they start."""
        found = []
        for name in layer_names:
            reaches = [
                (tensor.data_ptr(),
                 tensor.data_ptr() + tensor.element_size()
                 * (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))))
                for tensor in self.tensors((name,))
                if tensor.numel()
            ]
            if reaches:
                found.append((min(start for start, _ in reaches), max(end for _, end in reaches), name))
        return sorted(found)

    def read(self, addresses: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
        """The bytes at ``addresses`` (``sizes`` each) on the host, one view per region, in order.

        CPU tensors are read in place; the regions on a device are sliced there and copied to the
        host once, all of that device's regions together (stream-ordered: after the forward pass that
        wrote them).
        """
        slices = [self.region(address, size) for address, size in zip(addresses, sizes, strict=True)]
        views: list[memoryview | None] = [None] * len(slices)
        by_device: dict[torch.device, list[int]] = {}
        for index, piece in enumerate(slices):
            if piece.device.type == "cpu" and not self._copy_to_host:
                views[index] = memoryview(piece.numpy())
            else:
                by_device.setdefault(piece.device, []).append(index)
        for indices in by_device.values():
            host = torch.cat([slices[index].reshape(-1) for index in indices]).cpu()  # cat always copies
            self.host_copies += 1
            whole = memoryview(host.numpy())
            offset = 0
            for index in indices:
                length = slices[index].numel()
                views[index] = whole[offset : offset + length]
                offset += length
        return [view for view in views if view is not None]


def block_regions(database: TokenDatabase, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(addresses, sizes) of every region of every block, in order: what the store would write."""
    addresses: list[int] = []
    sizes: list[int] = []
    for block_id in block_ids:
        block_addresses, block_sizes = database.prepare_value_for_block(block_id)
        addresses.extend(block_addresses)
        sizes.extend(block_sizes)
    return addresses, sizes


def local_digests(
    token_dbs: Sequence[TokenDatabase], reader: BlockReader, blocks: Mapping[int, Sequence[int]]
) -> dict[int, Digest]:
    """This rank's digest of ``blocks`` per group: every region of every block, in order."""
    return {
        group: digest_blocks(reader.read(*block_regions(token_dbs[group], block_ids))) for group, block_ids in blocks.items()
    }


def local_layer_digests(
    token_dbs: Sequence[TokenDatabase],
    reader: BlockReader,
    blocks: Mapping[int, Sequence[int]],
    layer_names: Mapping[int, Sequence[str]],
) -> dict[int, dict[str, list[tuple[str, bool]]]]:
    """This rank's digests per group, layer and block (discovery): each block's regions, attributed
    to the group's layers by address (:meth:`BlockReader.spans`), digested per layer in the order the
    store writes them, as (hex digest, all zero). A group's blocks are read in one :meth:`BlockReader.read`
    (one copy to the host per device), not one per layer and block. Raises ``ValueError`` for a region
    in no layer's span."""
    found: dict[int, dict[str, list[tuple[str, bool]]]] = {}
    for group, block_ids in blocks.items():
        names = list(layer_names[group])
        spans = reader.spans(names)
        starts = [start for start, _, _ in spans]
        addresses: list[int] = []
        sizes: list[int] = []
        # Per block, per layer: the positions of its regions in the group's one read.
        positions: list[dict[str, list[int]]] = []
        for block_id in block_ids:
            block_addresses, block_sizes = token_dbs[group].prepare_value_for_block(block_id)
            layers: dict[str, list[int]] = {}
            for address, size in zip(block_addresses, block_sizes, strict=True):
                where = bisect.bisect_right(starts, address) - 1
                if where < 0 or address >= spans[where][1]:
                    raise ValueError(f"group {group}: block {block_id}'s region at {address:#x} lies in none of its layers")
                layers.setdefault(spans[where][2], []).append(len(addresses))
                addresses.append(address)
                sizes.append(size)
            positions.append(layers)
        regions = reader.read(addresses, sizes)
        per_layer: dict[str, list[tuple[str, bool]]] = {name: [] for name in names}
        for layers in positions:
            for name in names:
                if name in layers:
                    digest = digest_blocks(regions[index] for index in layers[name])
                    per_layer[name].append((digest.value, digest.all_zero))
        found[group] = per_layer
    return found


def local_samples(
    token_dbs: Sequence[TokenDatabase],
    reader: BlockReader,
    blocks: Mapping[int, Sequence[int]],
    layer_names: Mapping[int, Sequence[str]],
    groups: Iterable[int],
    *,
    limit: int = SAMPLE_VALUES,
    comparisons: Mapping[int, ValueComparison] | None = None,
) -> dict[int, bytes]:
    """This rank's sampled values of ``blocks`` for ``groups``, as float32 bytes: every
    ``ceil(n / limit)``-th value, so every rank of a group samples the same positions. Each group's
    bytes are read as its :class:`~kvpolicy.evidence.audit.ValueComparison`'s ``element`` type
    (``comparisons``, from :func:`value_comparisons`); a group compared by exact digests only has
    no values to sample, and asking for it is an error."""
    samples: dict[int, bytes] = {}
    for group in groups:
        comparison = (comparisons or {}).get(group, DEFAULT_COMPARISON)
        if comparison.exact:
            raise ValueError(f"group {group} is compared by exact digests only: {comparison.reason}")
        element = None if comparison.element is None else getattr(torch, comparison.element)
        values = reader.values(token_dbs[group], blocks[group], reader.tensors(layer_names[group]), element=element)
        step = max(1, -(-values.numel() // limit))
        samples[group] = values[::step][:limit].to(device="cpu", dtype=torch.float32).numpy().tobytes()
    return samples


def tensor_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """:func:`kvpolicy.evidence.audit.relative_distance`, vectorised with torch (float64)."""
    if len(a) != len(b):
        return math.inf
    if not len(a):
        return 0.0
    x = torch.as_tensor(a, dtype=torch.float64)
    y = torch.as_tensor(b, dtype=torch.float64)
    keep = ~(x.isnan() & y.isnan())
    x, y = x[keep], y[keep]
    scale = max(float(x.dot(x)), float(y.dot(y)))
    if scale == 0:
        return 0.0
    return math.sqrt(float((x - y).square().sum()) / scale)
