"""The connector's prefix lookup, probing only the keys vLLM's hit search reads.

vLLM's ``MooncakeStoreWorker.lookup`` checks, in one ``batch_is_exist``, every candidate chunk of every
group in every namespace of its lookup set, and then runs the hybrid hit search
(``MooncakeStoreCoordinator.find_longest_cache_hit``) over the answers. The search reads far fewer of
them: full attention walks up from the first chunk until one is missing; Mamba and sliding-window
groups walk down from the attention hit until they find a state (a window). A Mamba group stores only
boundary states, so nearly every one of its probes finds nothing and is never read: Kimi-Linear at
tp=8 probes 49,152 state keys of a 32k-token prompt to use a handful.

:func:`lookup` runs vLLM's very search over :class:`ProbingBlockPool`, which answers each question the
search asks from the store, probing on first use, in batches shaped by the direction the group's
search walks (:class:`_Probe`). A chunk that is no candidate of vLLM's lookup (outside its lookup mask,
past the prompt) is absent without a probe, as it is absent from vLLM's answers. Every answer therefore
equals the one vLLM's single batch gives for the same store, and so do the hit length and the tail
boundaries; what changes is how many keys are probed (the keys the search reads, plus the rest of the
batch they came in) and in how many calls (a few, instead of one). vLLM's connector telemetry still
gets one ``lookup_exists`` operation per lookup, as from vLLM's own: its duration the calls' time
summed, its keys every key probed (:attr:`LookupProbes.calls` says how many calls).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    ExternalCachedBlockPool,
    MooncakeStoreCoordinator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult, PoolKey
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager, SlidingWindowManager

from kvpolicy.runtime.read_failures import ReadFailures
from kvpolicy.vllm import internals
from kvpolicy.vllm.internals import StoreWorker

logger = init_logger(f"vllm.{__name__}")

__all__ = [
    "ASCENDING_FIRST_BATCH",
    "EVERYTHING",
    "LookupProbes",
    "ProbingBlockPool",
    "SearchReads",
    "Walk",
    "lookup",
    "search_reads",
    "walks",
]

ASCENDING_FIRST_BATCH = 8
"""Chunks a full-attention group probes first (its search walks up from chunk 0); the rest of its
candidates follow in one batch if all of those are stored. A prompt nobody stored costs this many
keys per namespace, not every chunk."""


class _ProbeFailed(Exception):
    """The store could not answer a ``batch_is_exist`` of the lookup."""


@dataclasses.dataclass
class LookupProbes:
    """What one lookup asked the store (for metrics and the benchmark)."""

    keys: int = 0
    calls: int = 0
    masked: int = 0
    """Stored keys reported missing because reading them had just failed (:mod:`kvpolicy.runtime.read_failures`)."""
    gated: bool = False
    """The lookup missed because the lookup gate was closed, not for want of objects (it probed nothing)."""


class Walk(NamedTuple):
    """How a group's hit search reads its chunks."""

    ascending: bool
    """Up from the first chunk until one is missing (full attention), or down from the longest
    candidate (Mamba: one state; sliding window: a window of chunks)."""
    first_window: int = 1
    """Chunks a descending search needs at one position (a sliding window's, 1 for a Mamba state)."""


EVERYTHING = Walk(ascending=True, first_window=0)
"""A search whose walk is not known here: all of its candidates in one batch, as vLLM's lookup does."""


def walks(coord: MooncakeStoreCoordinator) -> dict[int, Walk]:
    """Per group id, how the coordinator's hit search walks, by its manager class: full attention up,
    Mamba and sliding window down; any other manager (chunked local attention, a plugin's) gets every
    candidate in one batch."""
    found: dict[int, Walk] = {}
    for group in coord.attention_groups:
        # The exact classes: a subclass may search its own way (RSWA, circular buffers, sinks).
        manager = group.manager_cls
        if manager is FullAttentionManager:
            walk = Walk(ascending=True)
        elif manager is MambaManager:
            walk = Walk(ascending=False)
        elif manager is SlidingWindowManager:
            spec = group.spec
            needed = internals.contiguous_blocks_for_hit(manager, spec.sliding_window, spec.block_size, group.use_eagle)
            walk = Walk(ascending=False, first_window=max(1, needed))
        else:
            walk = EVERYTHING
        found.update(dict.fromkeys(group.group_ids, walk))
    return found


@dataclasses.dataclass
class _Probe:
    """One group's candidates in chunk order, what is known of them, and how its search walks."""

    hashes: list[bytes]
    position: dict[bytes, int]
    prefixes: Sequence[str]
    walk: Walk
    known: dict[int, bool] = dataclasses.field(default_factory=dict)
    misses: int = 0
    """Windows in a row whose first candidate was missing."""

    def window(self, index: int) -> list[int]:
        """The candidates to probe with ``index``: onward for an ascending search, downward (doubling
        each time) for a descending one; stops at the first already known."""
        if self.walk is EVERYTHING:
            indices = range(len(self.hashes))
        elif self.walk.ascending:
            size = ASCENDING_FIRST_BATCH if not self.known else len(self.hashes)
            indices = range(index, min(len(self.hashes), index + size))
        else:
            # A window's worth below what is already known to be there; after misses in a row, it
            # doubles (a Mamba search walking down past positions no prompt ended at).
            above = 0
            while self.known.get(index + 1 + above):
                above += 1
            size = max(1, self.walk.first_window - above) * (2 ** (self.misses - 1) if self.misses > 1 else 1)
            indices = range(index, max(-1, index - size), -1)
        kept = []
        for candidate in indices:
            if candidate in self.known:
                break
            kept.append(candidate)
        return kept

    def probed(self, index: int) -> None:
        """After the window probed for ``index``: count the misses in a row."""
        self.misses = 0 if self.known[index] else self.misses + 1


class ProbingBlockPool(ExternalCachedBlockPool):
    """vLLM's ``ExternalCachedBlockPool`` whose answers come from the store on first use.

    ``candidates[g]`` lists group ``g``'s candidate chunk hashes in chunk order (those vLLM's lookup
    would probe), ``prefixes[g]`` its lookup namespaces; ``probe(keys)`` is ``batch_is_exist``. A
    (group, hash) is present only if every namespace has it (vLLM's all-or-nothing rule).
    """

    def __init__(
        self,
        hash_block_size: int,
        candidates: dict[int, list[bytes]],
        prefixes: Sequence[Sequence[str]],
        group_walks: dict[int, Walk],
        probe: Callable[[list[str]], Sequence[int]],
    ) -> None:
        super().__init__(hash_block_size, set())
        self._probe = probe
        self._groups = {
            group: _Probe(
                hashes,
                {value: index for index, value in enumerate(hashes)},
                prefixes[group],
                group_walks.get(group, EVERYTHING),
            )
            for group, hashes in candidates.items()
        }
        self.probes = LookupProbes()

    def _present(self, group_ids: Sequence[int], block_hash: BlockHash) -> bool:
        # Called once per chunk the search reads (thousands per lookup): kept to dict lookups.
        value = bytes(block_hash)
        answers = []
        unknown = []
        for group in group_ids:
            state = self._groups.get(group)
            index = None if state is None else state.position.get(value)
            if index is None:
                return False  # no candidate of vLLM's lookup: absent from its answers too
            answer = state.known.get(index)
            if answer is False:
                return False
            if answer is None:
                unknown.append((group, index))
            answers.append((state, index))
        if unknown:
            self._fetch(unknown)
            return all(state.known[index] for state, index in answers)
        return True

    def _fetch(self, wanted: Sequence[tuple[int, int]]) -> None:
        """One ``batch_is_exist`` for the windows of ``wanted`` (group, candidate index) pairs."""
        windows = [(group, index, self._groups[group].window(index)) for group, index in wanted]
        self._probe_exactly([(group, candidate) for group, _, window in windows for candidate in window])
        for group, index, _ in windows:
            self._groups[group].probed(index)

    def probe_everything(self) -> None:
        """Every candidate of every group in one ``batch_is_exist``, as vLLM's lookup does."""
        self._probe_exactly(
            [(group, index) for group, state in self._groups.items() for index in range(len(state.hashes))]
        )

    def _probe_exactly(self, batch: Sequence[tuple[int, int]]) -> None:
        keys: list[str] = []
        for group, candidate in batch:
            state = self._groups[group]
            hash_hex = state.hashes[candidate].hex()
            keys.extend(PoolKey.build_key_string(prefix, hash_hex) for prefix in state.prefixes)
        if not keys:
            return
        results = self._probe(keys)
        self.probes.keys += len(keys)
        self.probes.calls += 1
        position = 0
        for group, candidate in batch:
            count = len(self._groups[group].prefixes)
            answers = results[position : position + count]
            self._groups[group].known[candidate] = answers[0] == 1 if count == 1 else all(code == 1 for code in answers)
            position += count

    def get_cached_block(self, block_hash: BlockHash, group_ids: list[int]) -> list[KVCacheBlock] | None:
        if self._present(group_ids, block_hash):
            return [internals.present_block(self)] * len(group_ids)
        return None

    def contains(self, group_id: int, block_hash: BlockHash) -> bool:
        return self._present([group_id], block_hash)


def _candidates(worker: StoreWorker, token_len: int, block_hashes: Sequence[BlockHash]) -> dict[int, list[bytes]]:
    """Per group, the chunk hashes vLLM's lookup probes, in chunk order (its candidate list)."""
    coord = worker.coord
    fine_grained = coord.enable_partial_hash_hits
    lookup_masks = None if fine_grained else coord.lookup_mask(token_len)
    candidates: dict[int, list[bytes]] = {}
    for g_idx, db in enumerate(worker.token_dbs):
        spec = internals.kv_cache_groups(worker)[g_idx].kv_cache_spec
        if not spec.prefix_cacheable:
            continue
        if fine_grained:
            max_units = min(len(block_hashes), token_len // worker.hash_block_size)
            candidates[g_idx] = [bytes(block_hashes[unit]) for unit in range(max_units)]
            continue
        lookup_mask = lookup_masks[g_idx]  # type: ignore[index]
        group_hashes = coord.block_hashes_for_spec(block_hashes, spec)
        max_chunks = min(len(group_hashes), cdiv(token_len, db.block_size))
        mask_limit = max_chunks if lookup_mask is None else min(max_chunks, len(lookup_mask))
        candidates[g_idx] = [
            bytes(group_hashes[chunk]) for chunk in range(mask_limit) if lookup_mask is None or lookup_mask[chunk]
        ]
    return candidates


def lookup(
    worker: StoreWorker, num_tokens: int, block_hashes: Sequence[BlockHash], *, read_failures: ReadFailures | None = None
) -> tuple[MooncakeLookupResult, LookupProbes]:
    """``MooncakeStoreWorker.lookup`` of ``worker`` (same hit length, same tail boundaries on the same
    store), over a :class:`ProbingBlockPool`; also what it probed. Keys in ``read_failures`` are
    answered missing, as if the store had lost them."""
    probes = LookupProbes()
    if internals.capacity_only(worker):
        return MooncakeLookupResult(0), probes
    coord = worker.coord
    token_len = coord.align_lookup_length(num_tokens)
    if not block_hashes or token_len <= 0:
        return MooncakeLookupResult(0), probes
    candidates = _candidates(worker, token_len, block_hashes)
    if not any(candidates.values()):
        return MooncakeLookupResult(0), probes

    probed = _ProbeTime()

    def probe(keys: list[str]) -> Sequence[int]:
        started = time.perf_counter()
        try:
            results = worker.store.batch_is_exist(keys)
        except Exception as error:
            probed.add(time.perf_counter() - started, len(keys), failed=len(keys))
            raise _ProbeFailed(error) from error
        probed.add(time.perf_counter() - started, len(keys))
        if read_failures is None:
            return results
        masked_before = read_failures.masked
        answers = read_failures.mask(keys, results)
        pool.probes.masked += read_failures.masked - masked_before
        return answers

    pool = ProbingBlockPool(
        worker.hash_block_size, candidates, internals.lookup_key_prefixes(worker), walks(coord), probe
    )
    try:
        _, hit_length = coord.find_longest_cache_hit(block_hashes, token_len, pool)
        if hit_length >= num_tokens:
            usable_length = coord.align_lookup_length(num_tokens - 1)
            if usable_length <= 0:
                return MooncakeLookupResult(0), pool.probes
            _, hit_length = coord.find_longest_cache_hit(block_hashes, usable_length, pool)
        boundaries = internals.tail_key_boundaries(worker, block_hashes, hit_length, pool)
    except _ProbeFailed as error:
        # As vLLM's lookup: a store that cannot answer is a miss. Anything else is a bug, and raises.
        logger.error("Remote connection failed in lookup: %s", error.__cause__)
        return MooncakeLookupResult(0), pool.probes
    finally:
        probed.record(worker)
    return MooncakeLookupResult(hit_length, boundaries), pool.probes


@dataclasses.dataclass
class _ProbeTime:
    """One lookup's ``batch_is_exist`` calls, summed: vLLM's telemetry gets one ``lookup_exists`` per
    lookup, as its own lookup records (one batch), whatever the number of batches probed."""

    seconds: float = 0.0
    keys: int = 0
    failed: int = 0
    calls: int = 0

    def add(self, seconds: float, keys: int, *, failed: int = 0) -> None:
        self.seconds += seconds
        self.keys += keys
        self.failed += failed
        self.calls += 1

    def record(self, worker: StoreWorker) -> None:
        """The lookup's one ``lookup_exists`` (none when it probed nothing, as vLLM's lookup records none)."""
        if self.calls:
            internals.record_operation(
                worker, "lookup_exists", self.seconds, self.keys,
                status="error" if self.failed else "ok", num_failed_keys=self.failed,
            )


class _ReadRecorder(ProbingBlockPool):
    """A :class:`ProbingBlockPool` that already knows every answer and records which the search reads."""

    def __init__(self, pool: ProbingBlockPool) -> None:
        self.__dict__.update(pool.__dict__)
        self.read: set[tuple[int, int]] = set()

    def _present(self, group_ids: Sequence[int], block_hash: BlockHash) -> bool:
        value = bytes(block_hash)
        for group in group_ids:
            index = self._groups[group].position.get(value) if group in self._groups else None
            if index is not None:
                self.read.add((group, index))
        return super()._present(group_ids, block_hash)


@dataclasses.dataclass(frozen=True)
class SearchReads:
    """What vLLM's hit search reads of one lookup, per group: candidates (chunks) it read, candidates
    vLLM's lookup probes, and namespaces per candidate."""

    read: Mapping[int, int]
    candidates: Mapping[int, int]
    namespaces: Mapping[int, int]

    @property
    def keys_read(self) -> int:
        """The least any lookup that answers as vLLM's does can probe without knowing the store."""
        return sum(count * self.namespaces[group] for group, count in self.read.items())

    @property
    def keys_vllm_probes(self) -> int:
        """vLLM's one batch: every candidate in every namespace."""
        return sum(count * self.namespaces[group] for group, count in self.candidates.items())


def search_reads(worker: StoreWorker, num_tokens: int, block_hashes: Sequence[BlockHash]) -> SearchReads:
    """:class:`SearchReads` of this lookup on ``worker``'s store now: every candidate is probed (vLLM's
    one batch), then vLLM's search runs over those answers and records each (group, chunk) it reads."""
    coord = worker.coord
    token_len = coord.align_lookup_length(num_tokens)
    prefixes = internals.lookup_key_prefixes(worker)
    nothing = internals.capacity_only(worker) or not block_hashes or token_len <= 0
    candidates = {} if nothing else _candidates(worker, token_len, block_hashes)
    everything = ProbingBlockPool(
        worker.hash_block_size, candidates, prefixes, walks(coord), worker.store.batch_is_exist
    )
    everything.probe_everything()
    recorder = _ReadRecorder(everything)
    if candidates:
        _, hit_length = coord.find_longest_cache_hit(block_hashes, token_len, recorder)
        if hit_length >= num_tokens:
            usable_length = coord.align_lookup_length(num_tokens - 1)
            hit_length = 0
            if usable_length > 0:
                _, hit_length = coord.find_longest_cache_hit(block_hashes, usable_length, recorder)
        if hit_length > 0:
            internals.tail_key_boundaries(worker, block_hashes, hit_length, recorder)
    read: dict[int, int] = dict.fromkeys(candidates, 0)
    for group, _ in recorder.read:
        read[group] += 1
    return SearchReads(
        read=read,
        candidates={group: len(hashes) for group, hashes in candidates.items()},
        namespaces={group: len(prefixes[group]) for group in candidates},
    )
