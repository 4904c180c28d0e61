"""Fault injection and mixed fleets for the multi-rank harness.

:mod:`kvpolicy.vllm.harness` answers one question — does a policy load every rank's own bytes back
— for one instance that saves and one that loads, under the same policy, on a healthy store. This
module breaks those assumptions on purpose, with the same real parts (vLLM's
``MooncakeStoreWorker`` and its send/receive threads, real Mooncake clients and master):

* :class:`Fleet` — instances of one model that share a Mooncake store, a prompt and a key space.
  Each :class:`Instance` has its own policy and TP size (a *mixed fleet*), and its saves, lookups
  and loads are separate steps, run on all ranks or on a subset, so a test can act between them:
  kill the master, fill the store, remove one namespace's objects.
* :class:`FaultyStore` — a store client that runs a callback inside a chosen call (e.g. kill the
  master after a rank's ``batch_is_exist`` and before its ``batch_put_from_multi_buffers``).
* :class:`RestartableMaster` — a master that can be killed and started again, empty, on the same
  ports, so store clients survive it (a client whose master is gone blocks ~15 s on ``close``).
* :func:`run_mixed` — save with one (policy, tp) and look up and load with another.

**The oracle** (:meth:`Instance.verdict`) judges a load the way vLLM's scheduler uses it. A load
error does not have to be prevented, it has to be *reported*: vLLM recomputes what failed. So the
bytes that count are those of the prefix the scheduler keeps — nothing when a rank reports the
request in ``failed_recving`` (multi-group models), the blocks before the first block any rank
reports in ``get_block_ids_with_load_errors`` (single-group models), else the whole hit — on every
rank. Each such block must hold exactly the bytes the *loader's own* rank would have computed;
blocks outside the request must stay zero.

**Ground truth across policies and TP sizes.** A cold rank's block holds bytes that depend only on
the *content* it represents: ``(seed, layer, tensor part, N, s, chunk hash, size)``, where a layer
with true replication factor ``T`` at ``tp`` splits into ``N = tp // T`` distinct shards and the
rank holds shard ``s = tp_rank // T``. Two instances hold the same content when ``N`` and ``s`` are
equal: an MLA latent (``N = 1``) is the same at any TP size; a 2-KV-head GQA layer (``N = 2``,
one head per shard) is the same at TP 2 and TP 4; Mamba / linear-attention state is split into
``N = tp`` shards, so shard ``s`` at TP 2 is *not* shard ``s`` at TP 4 and any cross-TP load of it
counts as wrong. The factor is per layer (not per group), so a uniform group's MLA layer is
identical on every rank even when the group's factor is smaller. "Correct bytes" for a loader rank
therefore means: exactly what a cold instance with the *loader's* policy-independent layout would
have held — equal to what was saved only where the saver held the same content.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import queue
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from kvpolicy.engine import make_plan
from kvpolicy.keys import KeyContext, chunk_key
from kvpolicy.models import Policy, Topology
from kvpolicy.mooncake import master as master_module
from kvpolicy.mooncake.client import MiB
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.metrics import read_metrics
from kvpolicy.plan import Plan
from kvpolicy.vllm import harness
from kvpolicy.vllm.harness import BLOCK_SIZE, ClientPool
from kvpolicy.vllm.layout import layout_from_kv_cache_config

__all__ = [
    "NO_AVAILABLE_HANDLE",
    "FaultyStore",
    "Fleet",
    "Instance",
    "KillSwitch",
    "LoadVerdict",
    "MixedReport",
    "RestartableMaster",
    "SaveOutcome",
    "WrongBlock",
    "fill_store",
    "run_mixed",
]

NO_AVAILABLE_HANDLE = -200
"""What Mooncake returns for a put that finds no free space (vLLM's ``MOONCAKE_NO_AVAILABLE_HANDLE``)."""

_WORKER_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
_DEFAULT_TIMEOUT_S = 60.0


# --- the master ----------------------------------------------------------------------------------


class RestartableMaster(MooncakeMaster):
    """A loopback master that can be killed and started again, empty, on the same ports.

    Store clients keep their master's address, so after :meth:`restart` they re-register their
    segments with the new process (about 2 s) and keep working; ``close()`` on them is fast again.
    That is what lets one pool of clients serve a *fresh* master per test.
    """

    _restart_lock = threading.Lock()

    @property
    def serving(self) -> bool:
        """The metrics endpoint answers (the process is up)."""
        if self._process is None or self._process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=1.0) as response:
                response.read()
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def restart(self) -> None:
        """SIGKILL the running master (if any) and start a new, empty one on the same ports."""
        if not self.rpc_port:
            raise RuntimeError("the master was never started")
        if self._process is not None and self._process.poll() is None:
            self.kill()
        self.stop()  # forgets the reaped process and removes its log
        ports = [self.rpc_port, self.metrics_port]
        # MooncakeMaster.start() picks fresh ports with kvpolicy.mooncake.master.free_ports and has
        # no parameter for fixed ones; reusing its start path (and so its loopback-only flags)
        # beats copying its command line. Nothing else picks ports while the lock is held.
        with self._restart_lock, mock.patch.object(master_module, "free_ports", lambda count: ports[:count]):
            self.start()

    def wait_for_capacity(self, capacity_bytes: int, timeout: float = 30.0) -> None:
        """Wait until the master has ``capacity_bytes`` of mounted segments (clients re-registered)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                capacity = int(read_metrics(self.metrics_url, timeout=2.0).get("master_total_capacity_bytes", 0))
            except OSError:
                capacity = -1
            if capacity >= capacity_bytes:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the master has {capacity} bytes of segments after {timeout:g} s, expected {capacity_bytes}"
                )
            time.sleep(0.05)


class KillSwitch:
    """Kills a master once, from wherever it is called (a :class:`FaultyStore` hook, a test)."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.master = master
        self._lock = threading.Lock()
        self.fired = False

    def __call__(self, *_: Any) -> None:
        with self._lock:
            if not self.fired:
                self.master.kill()
                self.fired = True


# --- store clients -------------------------------------------------------------------------------


class FaultyStore:
    """A real store client with callbacks run before chosen methods.

    ``before`` maps a method name (``batch_put_from_multi_buffers``, ``batch_get_into_multi_buffers``,
    ``batch_is_exist`` …) to a callable run just before the real call, every time; everything else
    is forwarded untouched. The transfer threads call it like the client they were given.
    """

    def __init__(self, client: Any, *, before: Mapping[str, Callable[[], None]]) -> None:
        self._client = client
        self._before = dict(before)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        hook = self._before.get(name)
        if hook is None:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            hook()
            return attribute(*args, **kwargs)

        return call


def fill_store(client: Any, prefix: str) -> int:
    """Fill every mounted segment with hard-pinned objects (never evicted) until no put of even 64
    bytes fits; return how many objects that took. Keys start with ``prefix``."""
    from mooncake.store import ReplicateConfig

    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    count = 0
    for size in (MiB, 64 * 1024, 4096, 256, 64):
        value = b"\xa5" * size
        while True:
            code = client.put(f"{prefix}-junk-{size}-{count}", value, pinned)
            if code == NO_AVAILABLE_HANDLE:
                break
            if code != 0:
                raise RuntimeError(f"filling the store: put returned {code}")
            count += 1
    return count


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveOutcome:
    """One store job of an instance, on the ranks that ran it."""

    num_tokens: int
    ranks: tuple[int, ...]
    puts: tuple[tuple[int, str, int], ...]
    """(tp_rank, key, result code) of every key offered to ``batch_put_from_multi_buffers``."""
    completed_ranks: tuple[int, ...]
    """Ranks whose send thread reported the store job done (``completed_saves``)."""
    drained_ranks: tuple[int, ...]
    """Ranks whose send queue emptied within the timeout (a job that never ends is a hang)."""

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
    """A block the scheduler would use whose bytes are not the loader rank's own."""

    tp_rank: int
    group: int
    chunk: int
    layer: str


@dataclass(frozen=True)
class _RankLoad:
    drained: bool
    finished: bool
    failed: bool
    invalid_block_ids: frozenset[int]


@dataclass(frozen=True)
class LoadVerdict:
    """What a warm instance's lookup and load amount to, judged as vLLM's scheduler uses them."""

    hit_tokens: int
    """``MooncakeStoreWorker.lookup``'s hit on rank 0."""
    used_tokens: int
    """The prefix the scheduler keeps after load errors; the rest is recomputed."""
    failed_ranks: tuple[int, ...]
    """Ranks that reported the request in ``failed_recving``."""
    invalid_block_ids: tuple[tuple[int, tuple[int, ...]], ...]
    """(tp_rank, block ids) each rank reported through ``get_block_ids_with_load_errors``."""
    blocks_checked: int
    """(rank, group, chunk, layer) blocks compared with the truth."""
    wrong: tuple[WrongBlock, ...]
    stray: tuple[tuple[int, int], ...]
    """(tp_rank, block id) outside the request that a load wrote into."""
    problems: tuple[str, ...]
    """Ways the load would break vLLM: a rank that never drained its queue or never reported the
    load finished, block-level errors on a multi-group model (the scheduler raises on those)."""
    thread_errors: tuple[str, ...]
    """Exceptions vLLM's transfer threads logged (``logger.exception``) during the fleet's life."""

    @property
    def correct(self) -> bool:
        """No used block differs from the truth and nothing outside the request was written."""
        return not self.wrong and not self.stray

    @property
    def crashed(self) -> bool:
        return bool(self.problems or self.thread_errors)

    @property
    def reported_errors(self) -> bool:
        return bool(self.failed_ranks or any(ids for _, ids in self.invalid_block_ids))


# --- the fleet -----------------------------------------------------------------------------------


class _ExceptionLog(logging.Handler):
    """Collects the exceptions vLLM's transfer threads log (their run loop catches and logs them)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(f"{record.getMessage()}: {record.exc_info[1]!r}")


class Fleet:
    """Instances of one archetype sharing a Mooncake store, a prompt and a key space.

    Every key the fleet's instances write carries its run id (as ``cache_prefix`` and in the model
    name), so fleets on one master never see each other's objects; :meth:`close` removes them when
    the master is up. Clients come from ``clients`` (a :class:`ClientPool`; one client per rank of
    each instance) and go back to it on :meth:`close`.
    """

    def __init__(
        self,
        archetype: str,
        *,
        master: MooncakeMaster,
        clients: ClientPool,
        num_tokens: int = 256,
        seed: int = 0,
    ) -> None:
        if archetype not in harness.ARCHETYPES:
            raise ValueError(f"unknown archetype {archetype!r}; known: {', '.join(harness.ARCHETYPES)}")
        if num_tokens < BLOCK_SIZE:
            raise ValueError(f"num_tokens must be at least one block ({BLOCK_SIZE}), got {num_tokens}")
        self.archetype = archetype
        self.master = master
        self.clients = clients
        self.num_tokens = num_tokens
        self.seed = seed
        self.run_id = f"kvf{uuid.uuid4().hex[:12]}"
        self.model_name = f"kvpolicy-faults/{archetype}-{self.run_id}"
        self.key_context = KeyContext.for_model(self.model_name, cache_prefix=self.run_id)
        generator = torch.Generator().manual_seed(harness._seed_of("tokens", seed))
        self.token_ids: list[int] = torch.randint(0, 32_000, (num_tokens,), generator=generator).tolist()
        self.instances: list[Instance] = []
        self._leased: list[Any] = []
        self._log = _ExceptionLog()
        logging.getLogger(_WORKER_LOGGER).addHandler(self._log)
        self._closed = False

    @property
    def thread_errors(self) -> tuple[str, ...]:
        return tuple(self._log.records)

    @property
    def client(self) -> Any:
        """A store client of the fleet (the first one leased), for direct store operations."""
        if not self._leased:
            raise RuntimeError("no instance yet: the fleet has no clients")
        return self._leased[0]

    def instance(
        self,
        policy: Policy,
        tp_size: int,
        *,
        name: str | None = None,
        wrap_store: Callable[[int, Any], Any] | None = None,
    ) -> Instance:
        """Start a ``tp_size``-rank instance under ``policy``; ``wrap_store(tp_rank, client)`` may
        return a wrapper (e.g. :class:`FaultyStore`) the rank uses instead of the client."""
        if self._closed:
            raise RuntimeError("the fleet is closed")
        clients = self.clients.acquire(tp_size)
        self._leased.extend(clients)
        instance = Instance(self, policy, tp_size, name=name or f"i{len(self.instances)}")
        self.instances.append(instance)
        instance._start(clients, wrap_store)
        return instance

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for instance in self.instances:
                instance._stop()
            # Against a dead master remove_by_regex blocks ~4 s and fails; a restart empties it anyway.
            serving = self.master.serving if isinstance(self.master, RestartableMaster) else True
            if self._leased and serving:
                self._leased[0].remove_by_regex(f".*{self.run_id}.*", True)
        finally:
            logging.getLogger(_WORKER_LOGGER).removeHandler(self._log)
            self.clients.release(self._leased)
            self._leased = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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


@dataclass
class _SaveRequest:
    num_tokens: int
    req_id: str
    job: int
    tables: tuple[list[int], ...]
    hashes: list[Any]


class Instance:
    """One simulated vLLM instance of a :class:`Fleet`: ``tp_size`` ranks under one policy.

    Built like :func:`kvpolicy.vllm.harness.run_consistency` builds its cold and warm instances
    (real ``KVCacheConfig``, CPU KV tensors, ``MooncakeStoreWorker`` with the plan's databases,
    put schedule and lookup prefixes, vLLM's own send and receive threads); the scheduler's part
    (metadata, block tables) is played by this class.
    """

    def __init__(self, fleet: Fleet, policy: Policy, tp_size: int, *, name: str) -> None:
        self.fleet = fleet
        self.policy = policy
        self.tp_size = tp_size
        self.name = name
        shape = harness._ARCHETYPES[fleet.archetype]
        chunks = math.ceil(fleet.num_tokens / BLOCK_SIZE)
        shape_groups = len({kind for _, kind in shape.layers})
        # A few spare blocks beyond the request, so a load written outside it shows up.
        self.model = harness._build_model(
            fleet.archetype, tp_size, model_name=fleet.model_name, blocks_needed=4 + shape_groups * chunks
        )
        layout = layout_from_kv_cache_config(
            self.model.kv_cache_config, model=self.model.name, total_num_kv_heads=self.model.total_num_kv_heads
        )
        self.plan: Plan = make_plan(policy, layout, Topology(tp_size=tp_size), key_context=fleet.key_context)
        self.hashes = harness._block_hashes(fleet.token_ids, self.model.hash_block_size)
        kind_of = dict(shape.layers)
        self._true_factor = {layer: shape.kinds[kind_of[layer]].true_factor(tp_size) for layer in kind_of}
        self.ranks: list[Any] = []
        self._saves: dict[tuple[int, str], _SaveRequest] = {}
        self._load_req_id = f"{fleet.run_id}-{name}-load"
        self.load_tables: tuple[list[int], ...] = harness._block_tables(
            self.model, fleet.num_tokens, seed=fleet.seed, salt=f"{fleet.run_id}/{name}/load", mamba_nulls=False
        )
        self._loads: dict[int, _RankLoad] = {}

    # --- lifecycle ---

    def _start(self, clients: Sequence[Any], wrap_store: Callable[[int, Any], Any] | None) -> None:
        for tp_rank, client in enumerate(clients):
            store = wrap_store(tp_rank, client) if wrap_store is not None else client
            self.ranks.append(harness._start_rank(self.model, self.plan, tp_rank, store))

    def _stop(self) -> None:
        for rank in self.ranks:
            harness._stop_rank(rank)
        self.ranks = []

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
        block_size = self.model.kv_cache_config.prefix_cacheable_groups[group].kv_cache_spec.block_size
        chunk_hash = harness._chunk_hash(self.hashes, chunk, block_size, self.model.hash_block_size)
        if chunk_hash is None:
            raise ValueError(f"chunk {chunk} is beyond the prompt")
        return chunk_key(self.plan.groups[group].lookup_namespaces[shard], chunk_hash.hex())

    # --- ground truth ---

    def _content(self, layer: str, part: int, tp_rank: int) -> str:
        true_factor = self._true_factor[layer]
        return f"{layer}#{part}/of{self.tp_size // true_factor}/{tp_rank // true_factor}"

    def _truth(self, layer: str, part: int, tp_rank: int, chunk_hash: Any, size: int) -> torch.Tensor:
        content = self._content(layer, part, tp_rank)
        digest = hashlib.blake2b(
            f"{self.fleet.seed}/{content}/{size}/".encode() + bytes(chunk_hash), digest_size=8
        ).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)

    def _fill(self, rank: Any, request: _SaveRequest) -> None:
        """The forward pass's result: every block of the request holds its truth."""
        for index, group in enumerate(self.model.kv_cache_config.prefix_cacheable_groups):
            block_size = group.kv_cache_spec.block_size
            for chunk, block_id in enumerate(request.tables[index]):
                chunk_hash = harness._chunk_hash(request.hashes, chunk, block_size, self.model.hash_block_size)
                if block_id == NULL_BLOCK_ID or chunk_hash is None:
                    continue
                for layer in group.layer_names:
                    for part, view in enumerate(harness._layer_tensors(rank.kv_caches[layer])):
                        target = harness._block_bytes(view, block_id)
                        truth = self._truth(layer, part, rank.tp_rank, chunk_hash, target.numel())
                        target.copy_(truth.view(target.shape))

    # --- save, lookup, load ---

    def _selected(self, ranks: Iterable[int] | None) -> list[Any]:
        wanted = range(self.tp_size) if ranks is None else list(ranks)
        return [self.ranks[tp_rank] for tp_rank in wanted]

    def save(
        self,
        num_tokens: int | None = None,
        *,
        ranks: Iterable[int] | None = None,
        request: str = "prompt",
        timeout: float = _DEFAULT_TIMEOUT_S,
    ) -> SaveOutcome:
        """Save the first ``num_tokens`` prompt tokens (default: all) as one store job of the
        request named ``request``, on ``ranks`` (default: all). Calling it again for other ranks
        continues the same job, as when the ranks reach it at different times; a new ``request``
        name is a new request for the same tokens (vLLM saves only what a request has not saved)."""
        num_tokens = self.fleet.num_tokens if num_tokens is None else num_tokens
        saving = self._saves.get((num_tokens, request))
        if saving is None:
            saving = _SaveRequest(
                num_tokens=num_tokens,
                req_id=f"{self.fleet.run_id}-{self.name}-{request}-save{num_tokens}",
                job=len(self._saves),
                tables=harness._block_tables(
                    self.model,
                    num_tokens,
                    seed=self.fleet.seed,
                    salt=f"{self.fleet.run_id}/{self.name}/{request}/save{num_tokens}",
                    mamba_nulls=True,
                ),
                hashes=self.hashes[: num_tokens // self.model.hash_block_size],
            )
            self._saves[(num_tokens, request)] = saving
        selected = self._selected(ranks)
        marks = {rank.tp_rank: len(rank.store.puts) for rank in selected}
        for rank in selected:
            self._fill(rank, saving)
            metadata = harness._save_meta(
                self.model, saving.tables, saving.hashes, num_tokens, saving.req_id, saving.job, rank.worker.coord
            )
            for meta in metadata.requests:
                # MooncakeStoreWorker.wait_for_save records a torch.cuda.Event here (CUDA-only).
                meta.current_event = harness._NoCudaEvent()  # type: ignore[assignment]
                rank.worker.kv_send_thread.add_request(meta)
        completed, drained = [], []
        for rank in selected:
            if _drain(rank.worker.kv_send_thread.request_queue, timeout):
                drained.append(rank.tp_rank)
            done = rank.worker.build_connector_worker_meta()
            if done is not None and saving.job in done.completed_saves:
                completed.append(rank.tp_rank)
        puts = tuple(
            (rank.tp_rank, key, code)
            for rank in selected
            for key, _, code in rank.store.puts[marks[rank.tp_rank] :]
        )
        return SaveOutcome(
            num_tokens=num_tokens,
            ranks=tuple(rank.tp_rank for rank in selected),
            puts=puts,
            completed_ranks=tuple(completed),
            drained_ranks=tuple(drained),
        )

    def lookup(self) -> Any:
        """vLLM's lookup for the whole prompt, on rank 0 (``LookupKeyServer`` calls it there)."""
        return self.ranks[0].worker.lookup(self.fleet.num_tokens, self.hashes)

    def load(self, lookup: Any, *, ranks: Iterable[int] | None = None, timeout: float = _DEFAULT_TIMEOUT_S) -> None:
        """Load ``lookup``'s hit into ``ranks`` (default: all, concurrently) through their receive
        threads, as ``start_load_kv`` does for an async load; results go to :meth:`verdict`."""
        if lookup.hit_length <= 0:
            return  # the scheduler issues no load without a hit
        selected = self._selected(ranks)
        metas = []
        for rank in selected:
            metadata = harness._load_meta(
                self.model,
                self.load_tables,
                self.hashes,
                self.fleet.num_tokens,
                self._load_req_id,
                copy.deepcopy(lookup),
            )
            rank.worker.start_load_kv(metadata)
            metas.append(metadata)
        for rank, metadata in zip(selected, metas, strict=True):
            drained = _drain(rank.worker.recv_request_queue, timeout)
            results = rank.worker.get_transfer_results(set(), metadata)
            self._loads[rank.tp_rank] = _RankLoad(
                drained=drained,
                finished=self._load_req_id in results.finished_recving,
                failed=self._load_req_id in results.failed_recving,
                invalid_block_ids=frozenset(rank.worker.get_block_ids_with_load_errors()),
            )

    def verdict(self, lookup: Any, *, honour_errors: bool = True) -> LoadVerdict:
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
        if honour_errors and failed:
            used = 0
        elif honour_errors and all_invalid:
            (table,) = self.load_tables  # one group: block ids are unique
            first = next((index for index, block in enumerate(table) if block in all_invalid), len(table))
            used = min(hit, first * self.model.kv_cache_config.prefix_cacheable_groups[0].kv_cache_spec.block_size)
        wrong, checked = self._check(lookup, used)
        return LoadVerdict(
            hit_tokens=hit,
            used_tokens=used,
            failed_ranks=failed,
            invalid_block_ids=invalid,
            blocks_checked=checked,
            wrong=tuple(wrong),
            stray=tuple(self._stray()),
            problems=tuple(problems),
            thread_errors=self.fleet.thread_errors,
        )

    def _check(self, lookup: Any, used: int) -> tuple[list[WrongBlock], int]:
        if used <= 0:
            return [], 0
        hit = lookup.hit_length
        masks = self.ranks[0].worker.coord.load_mask(self.hashes, hit)
        tails = {boundary.group_id: boundary.num_tokens for boundary in lookup.tail_key_boundaries}
        wrong: list[WrongBlock] = []
        checked = 0
        hash_block_size = self.model.hash_block_size
        for index, group in enumerate(self.model.kv_cache_config.prefix_cacheable_groups):
            block_size = group.kv_cache_spec.block_size
            for chunk, block_id in enumerate(self.load_tables[index]):
                if chunk >= len(masks[index]) or not masks[index][chunk] or (chunk + 1) * block_size > used:
                    continue
                # The key the receive thread read: a tail boundary replaces the last chunk's hash.
                if (chunk + 1) * block_size == hit and index in tails:
                    chunk_hash = self.hashes[tails[index] // hash_block_size - 1]
                else:
                    chunk_hash = harness._chunk_hash(self.hashes, chunk, block_size, hash_block_size)
                for rank in self.ranks:
                    for layer in group.layer_names:
                        for part, view in enumerate(harness._layer_tensors(rank.kv_caches[layer])):
                            got = harness._block_bytes(view, block_id).reshape(-1)
                            checked += 1
                            if not torch.equal(got, self._truth(layer, part, rank.tp_rank, chunk_hash, got.numel())):
                                wrong.append(WrongBlock(rank.tp_rank, index, chunk, layer))
        return wrong, checked

    def _stray(self) -> list[tuple[int, int]]:
        """Blocks outside the load request (the null block included) that are not all zero."""
        inside = {block for table in self.load_tables for block in table}
        outside = [block for block in range(self.model.kv_cache_config.num_blocks) if block not in inside]
        stray = set()
        for rank in self.ranks:
            for group in self.model.kv_cache_config.prefix_cacheable_groups:
                for layer in group.layer_names:
                    for view in harness._layer_tensors(rank.kv_caches[layer]):
                        for block in outside:
                            if harness._block_bytes(view, block).any():
                                stray.add((rank.tp_rank, block))
        return sorted(stray)


# --- mixed fleets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixedReport:
    """One instance saves a prompt under (policy, tp); another looks it up and loads it under its own."""

    archetype: str
    saver_policy: str
    saver_tp: int
    loader_policy: str
    loader_tp: int
    saver_fingerprint: str
    loader_fingerprint: str
    save: SaveOutcome
    verdict: LoadVerdict

    @property
    def hit_tokens(self) -> int:
        return self.verdict.hit_tokens


def run_mixed(
    saver_policy: Policy,
    saver_tp: int,
    loader_policy: Policy,
    loader_tp: int,
    archetype: str,
    *,
    master: MooncakeMaster,
    clients: ClientPool | None = None,
    num_tokens: int = 256,
    seed: int = 0,
) -> MixedReport:
    """Save ``archetype``'s prompt from a ``saver_tp``-rank instance under ``saver_policy``, then look
    it up and load it in a new ``loader_tp``-rank instance under ``loader_policy``, on one store.

    Without ``clients`` the run opens ``saver_tp + loader_tp`` clients and closes them (~2 s each).
    """
    pool = ClientPool(master) if clients is None else clients
    try:
        with Fleet(archetype, master=master, clients=pool, num_tokens=num_tokens, seed=seed) as fleet:
            saver = fleet.instance(saver_policy, saver_tp, name="saver")
            saved = saver.save()
            loader = fleet.instance(loader_policy, loader_tp, name="loader")
            lookup = loader.lookup()
            loader.load(lookup)
            return MixedReport(
                archetype=archetype,
                saver_policy=saver_policy.name,
                saver_tp=saver_tp,
                loader_policy=loader_policy.name,
                loader_tp=loader_tp,
                saver_fingerprint=saver.fingerprint,
                loader_fingerprint=loader.fingerprint,
                save=saved,
                verdict=loader.verdict(lookup),
            )
    finally:
        if clients is None:
            pool.close()
