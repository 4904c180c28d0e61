"""One simulated vLLM instance: ``tp_size`` ranks under one policy, and the scheduler's part.

Saves, lookups and loads are separate steps, on all ranks or a subset, so a caller can act between
them (kill the master, fill the store). Each step calls what the engine calls on a worker:
``wait_for_save`` (the replication audit, then vLLM's send thread), ``lookup`` on rank 0 (the lookup
gate, then vLLM's lookup), ``start_load_kv`` (vLLM's receive threads). The ranks run in threads of
this process, concurrently, as the engine's worker processes do; their TP collective is a
:class:`~kvpolicy.sim.collective.ThreadGather`.

**The oracle** (:meth:`Instance.verdict`) judges a load the way vLLM's scheduler uses it. A load
error does not have to be prevented, it has to be *reported*: vLLM recomputes what failed. So the
bytes that count are those of the prefix the scheduler keeps — nothing when a rank reports the
request in ``failed_recving`` (multi-group models), the blocks before the first block any rank
reports in ``get_block_ids_with_load_errors`` (single-group models), else the whole hit — on every
rank. Each such block must hold exactly the bytes the *loader's own* rank would have computed
(:mod:`kvpolicy.sim.content`); every block the load did not touch must stay zero.
"""

from __future__ import annotations

import copy
import queue
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from kvpolicy.evidence.audit import AuditState
from kvpolicy.language.keys import chunk_key
from kvpolicy.language.models import Policy
from kvpolicy.planning.plan import Plan
from kvpolicy.runtime.collective import ThreadExchange
from kvpolicy.sim import content, scheduler
from kvpolicy.sim.collective import ThreadGather
from kvpolicy.sim.model import SimulatedModel
from kvpolicy.sim.rank import Rank
from kvpolicy.sim.scheduler import BlockTables, Prompt
from kvpolicy.sim.store import Put

__all__ = ["FleetRun", "Instance", "LoadVerdict", "RankLoad", "SaveOutcome", "SaveRequest", "WrongBlock"]

DEFAULT_TIMEOUT_S = 60.0
"""How long a step waits for a rank's transfer queue or collective before calling it a hang."""

_T = TypeVar("_T")


@dataclass(frozen=True)
class SaveRequest:
    """A request's store job, as the scheduler numbered and placed it."""

    num_tokens: int
    req_id: str
    job: int
    tables: BlockTables
    hashes: tuple[Any, ...]


@dataclass(frozen=True)
class SaveOutcome:
    """One store job of an instance, on the ranks that ran it."""

    num_tokens: int
    ranks: tuple[int, ...]
    puts: tuple[tuple[int, str, int], ...]
    """(tp_rank, key, result code) of every KV chunk key offered to ``batch_put_from_multi_buffers``."""
    completed_ranks: tuple[int, ...]
    """Ranks whose send thread reported the store job done (``completed_saves``)."""
    drained_ranks: tuple[int, ...]
    """Ranks whose send queue emptied within the timeout (a job that never ends is a hang)."""
    marker_puts: tuple[Put, ...] = ()
    """The audit's marker objects (agreements, demotions) the step put, outside the KV chunks."""

    @property
    def put_failures(self) -> int:
        return sum(1 for _, _, code in self.puts if code < 0)

    def codes(self, tp_rank: int | None = None) -> tuple[int, ...]:
        return tuple(code for rank, _, code in self.puts if tp_rank is None or rank == tp_rank)

    @property
    def keys_written(self) -> frozenset[str]:
        return frozenset(key for _, key, code in self.puts if code >= 0)


@dataclass(frozen=True)
class WrongBlock:
    """A block whose bytes are not what the loader's rank should hold there."""

    tp_rank: int
    group: int
    chunk: int
    layer: str
    expected: str = "own bytes"
    """``own bytes`` (a used block of the load) or ``zero`` (a block the load did not touch)."""


@dataclass(frozen=True)
class RankLoad:
    """What one rank's receive thread reported for a load, before any byte is compared."""

    tp_rank: int
    drained: bool
    """The receive queue emptied within the timeout (a load that never ends is a hang)."""
    finished: bool
    """The request is in ``finished_recving``."""
    failed: bool
    """The request is in ``failed_recving``."""
    invalid_block_ids: frozenset[int]
    """What ``get_block_ids_with_load_errors`` reported."""

    @property
    def ok(self) -> bool:
        return self.drained and self.finished and not self.failed and not self.invalid_block_ids


@dataclass(frozen=True)
class LoadVerdict:
    """What a warm instance's lookup and load amount to, judged as vLLM's scheduler uses them."""

    hit_tokens: int
    """``lookup``'s hit on rank 0."""
    used_tokens: int
    """The prefix the scheduler keeps after load errors; the rest is recomputed."""
    failed_ranks: tuple[int, ...]
    """Ranks that reported the request in ``failed_recving``."""
    invalid_block_ids: tuple[tuple[int, tuple[int, ...]], ...]
    """(tp_rank, block ids) each rank reported through ``get_block_ids_with_load_errors``."""
    blocks_checked: int
    """(rank, group, chunk) blocks of the used prefix compared with the truth."""
    wrong: tuple[WrongBlock, ...]
    stray: tuple[tuple[int, int], ...]
    """(tp_rank, block id) outside the request (the null block included) that a load wrote into."""
    stray_groups: tuple[tuple[int, int], ...]
    """(tp_rank, group) whose layers hold a :attr:`stray` block."""
    problems: tuple[str, ...]
    """Ways the load would break vLLM: a rank that never drained its queue or never reported the
    load finished, block-level errors on a multi-group model (the scheduler raises on those)."""
    thread_errors: tuple[str, ...]
    """Exceptions vLLM's transfer threads logged (``logger.exception``) during the fleet's life."""
    checked_by_group: tuple[int, ...] = ()
    """:attr:`blocks_checked` per group."""

    @property
    def correct(self) -> bool:
        """No used block differs from the truth and nothing outside the load was written."""
        return not self.wrong and not self.stray

    @property
    def crashed(self) -> bool:
        return bool(self.problems or self.thread_errors)

    @property
    def reported_errors(self) -> bool:
        return bool(self.failed_ranks or any(ids for _, ids in self.invalid_block_ids))

    def mismatched_ranks(self, group: int) -> tuple[int, ...]:
        """Ranks with a wrong or stray block in ``group``."""
        ranks = {block.tp_rank for block in self.wrong if block.group == group}
        ranks.update(rank for rank, stray_group in self.stray_groups if stray_group == group)
        return tuple(sorted(ranks))


class FleetRun(Protocol):
    """What an instance reads of the fleet that started it (:class:`~kvpolicy.sim.fleet.Fleet`, which
    imports this module, not the other way round): the prompt, key space and seed its instances share, and
    the errors vLLM's transfer threads logged."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def run_id(self) -> str: ...

    @property
    def thread_errors(self) -> tuple[str, ...]: ...


class Instance:
    """``tp_size`` ranks of one model under one policy (None: vLLM's own rules), started by a
    :class:`~kvpolicy.sim.fleet.Fleet`, which owns the store clients, the prompt and the key space."""

    def __init__(
        self,
        fleet: FleetRun,
        model: SimulatedModel,
        policy: Policy | None,
        clients: Sequence[Any],
        *,
        name: str,
        wrap_store: Callable[[int, Any], Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.fleet = fleet
        self.model = model
        self.policy = policy
        self.name = name
        self.tp_size = model.tp_size
        self.timeout = timeout
        self.prompt = Prompt(fleet.token_ids, tuple(scheduler.block_hashes(fleet.token_ids, model.hash_block_size)))
        self._collective = ThreadGather(self.tp_size, timeout=timeout)
        # Striped loads exchange stripes from the receive threads: point to point within replica sets, on
        # a collective of their own as on an engine (a dedicated gloo group), never the audit's. Its timeout
        # is shorter than a load's drain wait: a rank alone in an exchange fails its load, and is seen to.
        self._exchange = ThreadExchange(self.tp_size, timeout=timeout / 2)
        # One thread per rank for the instance's life, as the engine has one process per rank.
        self._pool = ThreadPoolExecutor(max_workers=self.tp_size, thread_name_prefix=f"sim-{name}")
        self._saves: dict[tuple[int, str], SaveRequest] = {}
        self._loads: dict[int, RankLoad] = {}
        self._load_req_id = f"{fleet.run_id}-{name}-load"
        self.load_tables: BlockTables = scheduler.block_tables(
            model, fleet.num_tokens, seed=fleet.seed, salt=f"{fleet.run_id}/{name}/load", mamba_nulls=False
        )
        stores = [wrap_store(tp_rank, client) if wrap_store else client for tp_rank, client in enumerate(clients)]
        self.ranks: list[Rank] = []
        try:
            started = self._on_ranks(
                range(self.tp_size),
                lambda tp_rank: Rank.start(
                    model, policy, tp_rank, stores[tp_rank], gather=self._collective.member(tp_rank),
                    exchange=self._exchange.member(tp_rank),
                ),
                cleanup=Rank.stop,
            )
        except BaseException:
            self._pool.shutdown(wait=True)
            raise
        self.ranks = list(started)

    # --- lifecycle ---

    def _on_ranks(
        self, tp_ranks: Iterable[int], work: Callable[[int], _T], *, cleanup: Callable[[_T], None] | None = None
    ) -> list[_T]:
        """``work(tp_rank)`` on every rank at once (one thread each, as the ranks are processes on an
        engine); the first exception is raised after every rank finished, after ``cleanup`` of the
        results that succeeded."""
        futures = [self._pool.submit(work, tp_rank) for tp_rank in tp_ranks]
        errors = [future.exception() for future in futures]
        failure = next((error for error in errors if error is not None), None)
        if failure is not None:
            if cleanup is not None:
                for future, error in zip(futures, errors, strict=True):
                    if error is None:
                        cleanup(future.result())
            raise failure
        return [future.result() for future in futures]

    def close(self) -> None:
        for rank in self.ranks:
            rank.stop()
        self.ranks = []
        self._pool.shutdown(wait=True)

    # --- what the instance runs ---

    @property
    def plan(self) -> Plan:
        """The plan rank 0 runs now (after any audit demotion)."""
        plan = self.ranks[0].policy_worker.plan
        assert plan is not None
        return plan

    @property
    def audit(self) -> AuditState | None:
        return self.ranks[0].policy_worker.audit

    @property
    def fingerprint(self) -> str:
        return self.plan.fingerprint

    @property
    def multi_group(self) -> bool:
        """More than one KV-cache group: vLLM reports load errors per request, not per block."""
        return len(self.model.kv_cache_config.kv_cache_groups) > 1

    def group_index(self, name: str) -> int:
        """The index of the plan group called ``name`` (``mla``, ``mamba``, ``attn`` …)."""
        for group in self.plan.groups:
            if group.name == name:
                return group.index
        raise KeyError(f"no group {name!r}; groups: {[group.name for group in self.plan.groups]}")

    def key(self, group: int, shard: int, chunk: int) -> str:
        """The store key of ``chunk`` in ``group``'s namespace ``shard`` (a chunk ends a block)."""
        block_size = self.model.group_block_size(group)
        hashed = scheduler.chunk_hash(self.prompt.hashes, chunk, block_size, self.model.hash_block_size)
        if hashed is None:
            raise ValueError(f"chunk {chunk} is beyond the prompt")
        return chunk_key(self.plan.groups[group].lookup_namespaces[shard], hashed.hex())

    # --- ground truth ---

    def truth(
        self,
        tp_rank: int,
        layer: str,
        part: int,
        chunk_hash: Any,
        size: int,
        *,
        local_head: int | None = None,
        local_heads: int = 1,
    ) -> Any:
        """The bytes rank ``tp_rank`` of this instance holds in ``layer``'s tensor ``part`` for a chunk
        (in its KV head ``local_head`` of ``local_heads``, for an attention layer)."""
        return content.rank_truth(
            self.fleet.seed, self.model.layer_true_factors, tp_rank, self.tp_size, layer, part, chunk_hash, size,
            self.model.dcp_size, local_head=local_head, local_heads=local_heads,
        )

    def _pieces(self, rank: Rank, layer: str, block_id: int) -> list[tuple[int, int | None, int, Any]]:
        """(tensor part, local head, local heads, bytes) of ``layer``'s block ``block_id`` on ``rank``:
        per KV head for an attention layer (:mod:`kvpolicy.sim.content`)."""
        headed = layer in self.model.attention_layers
        pieces = []
        for part, view in enumerate(content.layer_tensors(rank.kv_caches[layer])):
            for head, data in content.block_pieces(view, block_id, headed=headed):
                pieces.append((part, head, view.shape[1] if headed else 1, data))
        return pieces

    def fill(self, rank: Rank, request: SaveRequest) -> None:
        """The forward pass's result: every block of ``request`` holds the rank's truth."""
        for index, group in enumerate(self.model.kv_cache_config.prefix_cacheable_groups):
            block_size = self.model.group_block_size(index)
            for chunk, block_id in enumerate(request.tables[index]):
                hashed = scheduler.chunk_hash(request.hashes, chunk, block_size, self.model.hash_block_size)
                if block_id == NULL_BLOCK_ID or hashed is None:
                    continue
                for layer in group.layer_names:
                    for part, head, heads, target in self._pieces(rank, layer, block_id):
                        expected = self.truth(
                            rank.tp_rank, layer, part, hashed, target.numel(), local_head=head, local_heads=heads
                        )
                        target.copy_(expected.view(target.shape))

    # --- save, lookup, load ---

    def _selected(self, ranks: Iterable[int] | None) -> list[Rank]:
        wanted = range(self.tp_size) if ranks is None else list(ranks)
        return [self.ranks[tp_rank] for tp_rank in wanted]

    def save_request(self, num_tokens: int | None = None, *, request: str = "prompt") -> SaveRequest:
        """The store job saving the first ``num_tokens`` prompt tokens (default: all) for the request
        named ``request``: the same job every time it is asked for again."""
        num_tokens = self.fleet.num_tokens if num_tokens is None else num_tokens
        saving = self._saves.get((num_tokens, request))
        if saving is None:
            salt = f"{self.fleet.run_id}/{self.name}/{request}/save{num_tokens}"
            saving = SaveRequest(
                num_tokens=num_tokens,
                req_id=f"{self.fleet.run_id}-{self.name}-{request}-save{num_tokens}",
                job=len(self._saves),
                tables=scheduler.block_tables(self.model, num_tokens, seed=self.fleet.seed, salt=salt, mamba_nulls=True),
                hashes=self.prompt.hashes[: num_tokens // self.model.hash_block_size],
            )
            self._saves[(num_tokens, request)] = saving
        return saving

    def save(
        self,
        num_tokens: int | None = None,
        *,
        ranks: Iterable[int] | None = None,
        request: str = "prompt",
        fill: bool = True,
    ) -> SaveOutcome:
        """Save the first ``num_tokens`` prompt tokens (default: all) as one store job of the
        request named ``request``, on ``ranks`` (default: all): each rank's ``wait_for_save`` with
        the scheduler's metadata, then its send thread until the job is done. Calling it again for
        other ranks continues the same job, as when ranks reach it at different times; a new
        ``request`` name is a new request for the same tokens (vLLM saves only what a request has
        not saved). ``fill=False`` keeps whatever the caller wrote into the KV tensors.

        A subset of ranks cannot take an audited step — on an engine, the others would hang in the
        collective — so that is refused; use a policy with ``audit: off`` for such a test."""
        saving = self.save_request(num_tokens, request=request)
        selected = self._selected(ranks)
        if len(selected) < self.tp_size:
            audit = self.ranks[0].policy_worker.audit if self.policy is not None else None
            if audit is not None and audit.groups_to_audit():
                raise ValueError(
                    f"instance {self.name}: saving on ranks {[rank.tp_rank for rank in selected]} only, but the "
                    f"replication audit still audits groups {list(audit.groups_to_audit())}: every TP rank must "
                    "take an audited step (use a policy with audit: off)"
                )
        marks = {rank.tp_rank: len(rank.store.puts) for rank in selected}

        def save_on(rank: Rank) -> None:
            if fill:
                self.fill(rank, saving)
            metadata = scheduler.save_metadata(
                self.model, saving.tables, saving.hashes, saving.num_tokens, req_id=saving.req_id,
                store_job_id=saving.job, coord=rank.worker.coord,
            )
            rank.worker.wait_for_save(metadata)

        self._on_ranks((rank.tp_rank for rank in selected), lambda tp_rank: save_on(self.ranks[tp_rank]))
        completed, drained = [], []
        for rank in selected:
            assert rank.worker.kv_send_thread is not None
            if _drain(rank.worker.kv_send_thread.request_queue, self.timeout):
                drained.append(rank.tp_rank)
            done = rank.worker.build_connector_worker_meta()
            if done is not None and saving.job in done.completed_saves:
                completed.append(rank.tp_rank)
        new_puts = [(rank.tp_rank, put) for rank in selected for put in rank.store.puts[marks[rank.tp_rank] :]]
        return SaveOutcome(
            num_tokens=saving.num_tokens,
            ranks=tuple(rank.tp_rank for rank in selected),
            puts=tuple((tp_rank, put.key, put.code) for tp_rank, put in new_puts if put.batched),
            completed_ranks=tuple(completed),
            drained_ranks=tuple(drained),
            marker_puts=tuple(put for _, put in new_puts if not put.batched),
        )

    def lookup(self, prompt: Prompt | None = None) -> MooncakeLookupResult:
        """The connector's lookup for the whole prompt on rank 0 (``LookupKeyServer`` calls it there)."""
        prompt = prompt or self.prompt
        return self.ranks[0].worker.lookup(prompt.num_tokens, list(prompt.hashes))

    @property
    def last_lookup_gated(self) -> bool:
        """Rank 0's last lookup missed because the lookup gate was closed."""
        return self.policy is not None and self.ranks[0].policy_worker.last_lookup_gated

    def capture(self, on: bool) -> None:
        """Start or stop recording the batch calls of every rank's store (:attr:`RecordingStore.calls`)."""
        for rank in self.ranks:
            rank.store.capturing = on

    def load(self, lookup: MooncakeLookupResult, *, ranks: Iterable[int] | None = None) -> tuple[RankLoad, ...]:
        """Load ``lookup``'s hit into ``ranks`` (default: all, concurrently) through their receive
        threads, as ``start_load_kv`` does for an async load; returns what each rank reported (and
        keeps it for :meth:`verdict`, which also compares the bytes)."""
        if lookup.hit_length <= 0:
            return ()  # the scheduler issues no load without a hit
        selected = self._selected(ranks)
        metas = []
        for rank in selected:
            metadata = scheduler.load_metadata(
                self.model, self.load_tables, self.prompt.hashes, self.fleet.num_tokens, req_id=self._load_req_id,
                lookup=copy.deepcopy(lookup),
            )
            rank.worker.start_load_kv(metadata)
            metas.append(metadata)
        for rank, metadata in zip(selected, metas, strict=True):
            drained = _drain(rank.worker.recv_request_queue, self.timeout)
            results = rank.worker.get_transfer_results(set(), metadata)
            self._loads[rank.tp_rank] = RankLoad(
                tp_rank=rank.tp_rank,
                drained=drained,
                finished=self._load_req_id in results.finished_recving,
                failed=self._load_req_id in results.failed_recving,
                invalid_block_ids=frozenset(rank.worker.get_block_ids_with_load_errors()),
            )
        return tuple(self._loads[rank.tp_rank] for rank in selected)

    def verdict(self, lookup: MooncakeLookupResult, *, honour_errors: bool = True) -> LoadVerdict:
        """Judge the loads so far (see the module docstring). ``honour_errors=False`` judges every
        loaded block as if no error had been reported — what a connector that swallowed load
        errors would hand the model; it exists to show the check has teeth."""
        hit = lookup.hit_length
        problems: list[str] = []
        failed = tuple(sorted(rank for rank, load in self._loads.items() if load.failed))
        invalid = tuple(sorted((rank, tuple(sorted(load.invalid_block_ids))) for rank, load in self._loads.items()))
        all_invalid = frozenset().union(*(load.invalid_block_ids for load in self._loads.values()))
        if hit > 0:
            for tp_rank in range(self.tp_size):
                load = self._loads.get(tp_rank)
                if load is None:
                    problems.append(f"rank {tp_rank} never loaded")
                elif not load.drained:
                    problems.append(f"rank {tp_rank}: the receive queue did not drain (a hung load)")
                elif not load.finished:
                    problems.append(f"rank {tp_rank}: the load never reported finished_recving")
        if self.multi_group and all_invalid:
            problems.append("block-level load errors on a multi-group model: vLLM's scheduler raises on those")
        used = hit
        if honour_errors and (failed or (all_invalid and self.multi_group)):
            used = 0  # the request is recomputed (on a multi-group model vLLM's scheduler raises)
        elif honour_errors and all_invalid:
            (table,) = self.load_tables  # one group: block ids are unique
            first = next((index for index, block in enumerate(table) if block in all_invalid), len(table))
            used = min(hit, first * self.model.group_block_size(0))
        wrong, checked = self._check(lookup, used)
        stray = self._stray()
        return LoadVerdict(
            hit_tokens=hit,
            used_tokens=used,
            failed_ranks=failed,
            invalid_block_ids=invalid,
            blocks_checked=sum(checked),
            wrong=tuple(wrong),
            stray=tuple(sorted({(rank, block) for rank, _, block in stray})),
            stray_groups=tuple(sorted({(rank, group) for rank, group, _ in stray})),
            problems=tuple(problems),
            thread_errors=self.fleet.thread_errors,
            checked_by_group=tuple(checked),
        )

    def _check(self, lookup: MooncakeLookupResult, used: int) -> tuple[list[WrongBlock], list[int]]:
        """Every block of the load tables: a used one holds the rank's truth, an untouched one zero."""
        hit = lookup.hit_length
        groups = self.model.kv_cache_config.prefix_cacheable_groups
        masks = self.ranks[0].worker.coord.load_mask(list(self.prompt.hashes), hit) if hit > 0 else [[] for _ in groups]
        tails = {boundary.group_id: boundary.num_tokens for boundary in lookup.tail_key_boundaries}
        hash_block_size = self.model.hash_block_size
        wrong: list[WrongBlock] = []
        checked = [0] * len(groups)
        for index, group in enumerate(groups):
            block_size = self.model.group_block_size(index)
            for chunk, block_id in enumerate(self.load_tables[index]):
                loaded = chunk < len(masks[index]) and masks[index][chunk]
                if loaded and (chunk + 1) * block_size > used:
                    continue  # loaded, then dropped by the scheduler after an error: recomputed
                # The key the receive thread read: a tail boundary replaces the last chunk's hash.
                if (chunk + 1) * block_size == hit and index in tails:
                    hashed = self.prompt.hashes[tails[index] // hash_block_size - 1]
                else:
                    hashed = scheduler.chunk_hash(self.prompt.hashes, chunk, block_size, hash_block_size)
                for rank in self.ranks:
                    checked[index] += loaded
                    for layer in group.layer_names:
                        wrong_parts = set()
                        for part, head, heads, data in self._pieces(rank, layer, block_id):
                            got = data.reshape(-1)
                            if loaded:
                                expected = self.truth(
                                    rank.tp_rank, layer, part, hashed, got.numel(), local_head=head, local_heads=heads
                                )
                                same = got.equal(expected)
                            else:
                                same = not bool(got.any())
                            if not same:
                                wrong_parts.add(part)
                        wrong.extend(
                            WrongBlock(rank.tp_rank, index, chunk, layer, "own bytes" if loaded else "zero")
                            for _ in sorted(wrong_parts)
                        )
        return wrong, checked

    def _stray(self) -> list[tuple[int, int, int]]:
        """(tp_rank, group, block) outside the load tables (the null block included) not all zero."""
        inside = {block for table in self.load_tables for block in table}
        outside = [block for block in range(self.model.kv_cache_config.num_blocks) if block not in inside]
        stray = set()
        for rank in self.ranks:
            for index, group in enumerate(self.model.kv_cache_config.prefix_cacheable_groups):
                for layer in group.layer_names:
                    for view in content.layer_tensors(rank.kv_caches[layer]):
                        for block in outside:
                            if content.block_bytes(view, block).any():
                                stray.add((rank.tp_rank, index, block))
        return sorted(stray)


def _drain(work: queue.Queue[Any], timeout: float) -> bool:
    """``work.join()`` with a deadline: False when tasks are still unfinished after ``timeout``."""
    deadline = time.monotonic() + timeout
    with work.all_tasks_done:
        while work.unfinished_tasks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            work.all_tasks_done.wait(remaining)
    return True
