"""Shared by the benchmarks that drive simulated vLLM ranks: ground truth, tables, and :class:`Instance`.

:class:`Instance` runs the pieces of :func:`kvpolicy.vllm.harness.run_consistency` one at a time (save,
lookup, load), so a benchmark can time each: it is built from the harness's own helpers (the same
``MooncakeStoreWorker`` objects, token databases from :mod:`kvpolicy.vllm.store`, vLLM's send and
receive threads, one store client per rank). Those helpers are private to the harness; this module is
the one place the benchmarks depend on them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import statistics
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_POLICIES = ("default", "vllm-compat", "no-dedup")


# --- output --------------------------------------------------------------------------------------


# vLLM's warnings (e.g. "CPU backend prefers block_size is multiples of 32", once per simulated
# instance) would bury the tables.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
logging.getLogger("vllm").setLevel(logging.ERROR)


@contextlib.contextmanager
def native_stderr_to(path: str | os.PathLike[str]) -> Iterator[None]:
    """Send file descriptor 2 to *path* (Mooncake's C++ logging writes there, a few lines per client)
    while Python's ``sys.stderr`` keeps writing to the terminal, so tracebacks stay visible."""
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
        try:
            yield
        finally:
            sys.stderr.flush()
            sys.stderr.close()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None) -> str:
    """A GitHub-flavoured Markdown table (readable as plain text too). ``align``: one of ``l``/``r`` per
    column; numbers default to right, text to left."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(header), *(len(row[i]) for row in cells)) for i, header in enumerate(headers)]
    if align is None:
        align = "".join(
            "r" if cells and all(_numeric(row[i]) for row in cells) else "l" for i in range(len(headers))
        )

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(
            value.rjust(width) if side == "r" else value.ljust(width)
            for value, width, side in zip(values, widths, align, strict=True)
        ) + " |"

    rule = "|" + "|".join(
        "-" * (width + 1) + ":" if side == "r" else "-" * (width + 2) for width, side in zip(widths, align, strict=True)
    ) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in cells)])


def _numeric(text: str) -> bool:
    stripped = text.rstrip("x%").replace(",", "").strip()
    if not stripped or stripped in ("-", "n/a"):
        return True
    try:
        float(stripped)
    except ValueError:
        return False
    return True


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def median_ci(values: Sequence[float], *, level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """Bootstrap confidence interval of the median of *values* (percentile method, fixed seed)."""
    if len(values) < 2:
        return (math.nan, math.nan)
    generator = random.Random(0)
    medians = sorted(statistics.median(generator.choices(values, k=len(values))) for _ in range(resamples))
    low = medians[int((1 - level) / 2 * resamples)]
    high = medians[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return low, high


def verdict(value: float, interval: tuple[float, float], target: float) -> str:
    """MET / MISSED against a lower bound, saying when the miss is inside the noise."""
    if value >= target:
        return "MET"
    if interval[1] >= target:
        return f"MISSED by {target - value:.2f}, but within the 95% interval ({interval[0]:.2f}-{interval[1]:.2f})"
    return f"MISSED by {target - value:.2f} (95% interval {interval[0]:.2f}-{interval[1]:.2f})"


# --- ground truth --------------------------------------------------------------------------------


def physical_factor(classes: Sequence[str], fields: dict[str, Any], total_num_kv_heads: int) -> Callable[[int], int]:
    """tp_size → TP ranks that really hold byte-identical bytes for a spec (the brief's table, section 1).

    Stated from what the model computes, not from a policy: an MLA latent has no head dimension (whole
    on every rank); Mamba/linear-attention state is split by heads (distinct per rank) unless vLLM marks
    it ``tp_replicated``; GQA heads repeat on ``tp // heads`` consecutive ranks once TP exceeds them.
    """
    def factor(tp_size: int) -> int:
        if "MambaSpec" in classes:
            return tp_size if fields.get("tp_replicated") else 1
        if "MLAAttentionSpec" in classes or "SlidingWindowMLASpec" in classes:
            return tp_size
        return max(1, tp_size // total_num_kv_heads)

    return factor


def true_factors(layout: Any) -> dict[str, Callable[[int], int]]:
    """Per group name of a kvpolicy ``Layout``: its physical replication factor (gcd over a uniform
    group's entries)."""
    result: dict[str, Callable[[int], int]] = {}
    for index, group in enumerate(layout.groups):
        members = [
            physical_factor(member.spec.classes, member.spec.fields, layout.total_num_kv_heads)
            for member in group.members
        ]
        result[group.name or f"group-{index}"] = (
            lambda tp_size, members=members: math.gcd(*(member(tp_size) for member in members))
        )
    return result


def example_layouts(names: Sequence[str] | None = None) -> list[Any]:
    """The layouts in ``examples/layouts/`` (all, or those whose file stem is in *names*)."""
    from kvpolicy.loader import layouts_dir, load_layout

    paths = sorted(layouts_dir().glob("*.yaml"))
    if names:
        paths = [path for path in paths if path.stem in names]
        missing = set(names) - {path.stem for path in paths}
        if missing:
            raise SystemExit(f"unknown layout(s): {', '.join(sorted(missing))}")
    return [(path.stem, load_layout(path)) for path in paths]


# --- simulated instances -------------------------------------------------------------------------


class CapturingStore:
    """Forwards to a Mooncake client; while :attr:`capturing`, records the batch calls' arguments."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.capturing = False
        self.puts: list[tuple[list[str], list[list[int]], list[list[int]]]] = []
        self.gets: list[tuple[list[str], list[list[int]], list[list[int]]]] = []
        self.exists: list[list[str]] = []
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        """Every recorded call in order: (method name, (keys, [addrs, sizes]))."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> Any:
        if self.capturing:
            with self._lock:
                self.puts.append((list(keys), [list(a) for a in addrs], [list(s) for s in sizes]))
                self.calls.append(("batch_put_from_multi_buffers", self.puts[-1]))
        return self._client.batch_put_from_multi_buffers(keys, addrs, sizes, *args)

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], *args: Any
    ) -> Any:
        if self.capturing:
            with self._lock:
                self.gets.append((list(keys), [list(a) for a in addrs], [list(s) for s in sizes]))
                self.calls.append(("batch_get_into_multi_buffers", self.gets[-1]))
        return self._client.batch_get_into_multi_buffers(keys, addrs, sizes, *args)

    def batch_is_exist(self, keys: list[str]) -> Any:
        if self.capturing:
            with self._lock:
                self.exists.append(list(keys))
                self.calls.append(("batch_is_exist", (self.exists[-1],)))
        return self._client.batch_is_exist(keys)


class Request:
    """One prompt as the scheduler would hand it over: token ids, block hashes, ids for the store job."""

    def __init__(self, num_tokens: int, hash_block_size: int, *, seed: int, req_id: str, job_id: int) -> None:
        import torch

        from kvpolicy.vllm import harness

        generator = torch.Generator().manual_seed(harness._seed_of("bench-tokens", seed))
        self.num_tokens = num_tokens
        self.token_ids = torch.randint(0, 32_000, (num_tokens,), generator=generator).tolist()
        self.hashes = harness._block_hashes(self.token_ids, hash_block_size)
        self.req_id = req_id
        self.job_id = job_id


class Instance:
    """``tp_size`` simulated ranks of one vLLM instance under a policy (or only ``ranks`` of them).

    Every rank is a ``MooncakeStoreWorker`` set up by the harness exactly as for
    :func:`~kvpolicy.vllm.harness.run_consistency`, its store client wrapped in a
    :class:`CapturingStore`. Keys carry a per-instance cache prefix (:attr:`run_id`), so
    :meth:`remove_objects` deletes this instance's objects only. Two instances built with the same
    ``run_id`` share keys (a cold and a warm instance of one model).
    """

    def __init__(
        self,
        policy: Any,
        archetype: str,
        tp_size: int,
        *,
        clients: Sequence[Any],
        blocks_needed: int,
        run_id: str | None = None,
        ranks: Sequence[int] | None = None,
        stock: bool = False,
    ) -> None:
        from kvpolicy.engine import make_plan
        from kvpolicy.keys import KeyContext
        from kvpolicy.models import Topology
        from kvpolicy.vllm import harness
        from kvpolicy.vllm.layout import layout_from_kv_cache_config

        if "{cache_prefix}" not in policy.key.template:
            raise ValueError(f"policy {policy.name}: the benchmarks need {{cache_prefix}} in the key template")
        self.run_id = run_id or f"kvb{uuid.uuid4().hex[:12]}"
        self.model = harness._build_model(
            archetype, tp_size, model_name=f"kvpolicy-bench/{archetype}", blocks_needed=blocks_needed
        )
        layout = layout_from_kv_cache_config(
            self.model.kv_cache_config, model=self.model.name, total_num_kv_heads=self.model.total_num_kv_heads
        )
        context = KeyContext.for_model(self.model.name, cache_prefix=self.run_id)
        self.plan = make_plan(policy, layout, Topology(tp_size=tp_size), key_context=context)
        rank_ids = list(range(tp_size)) if ranks is None else list(ranks)
        if len(clients) < len(rank_ids):
            raise ValueError(f"{len(rank_ids)} ranks need as many clients, got {len(clients)}")
        self.stock = stock
        self.stores = [CapturingStore(client) for client in clients[: len(rank_ids)]]
        self.ranks: list[Any] = []
        try:
            for rank, store in zip(rank_ids, self.stores, strict=True):
                if stock:
                    self.ranks.append(self._start_stock_rank(rank, store))
                else:
                    self.ranks.append(harness._start_rank(self.model, self.plan, rank, store))
        except BaseException:
            self.close()
            raise

    def _start_stock_rank(self, tp_rank: int, client: Any) -> Any:
        """A rank running vLLM's own ``MooncakeStoreWorker`` rules: the harness's worker, then upstream's
        three override points (factors, token databases, lookup prefixes) in place of the plan's, and
        upstream's send-thread put schedule. Keys are upstream's, under this instance's cache prefix."""
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvpolicy.vllm import harness

        store = harness._RecordingStore(client)
        worker = harness._rank_worker(self.model, self.plan, tp_rank, store)
        metadata = KeyMetadata(
            model_name=self.plan.key_context.model,
            tp_rank=tp_rank,
            pcp_rank=0,
            dcp_rank=0,
            pp_rank=0,
            cache_prefix=self.run_id,
            store_namespace="",
        )
        worker._group_tp_replication_factors = worker._compute_group_tp_replication_factors()
        worker.token_dbs = worker._build_token_databases(metadata, None)
        worker._init_lookup_key_prefixes()
        layout = self.model.vllm_config.cache_config.get_resolved_kv_cache_layout()
        kv_caches = allocate_kv_cache(self.model.kv_cache_config, torch.device("cpu"), layout)
        worker.register_kv_caches(kv_caches)
        return harness._Rank(tp_rank, worker, store, kv_caches)

    @property
    def group_names(self) -> list[str]:
        return [group.name for group in self.plan.groups]

    def block_tables(self, num_tokens: int, *, salt: str, cold: bool) -> tuple[list[int], ...]:
        """Block ids per group for a prompt (Mamba groups hold real blocks only at kept states when
        *cold*, as the engine allocates them in align mode)."""
        from kvpolicy.vllm import harness

        return harness._block_tables(self.model, num_tokens, seed=0, salt=f"{self.run_id}/{salt}", mamba_nulls=cold)

    def request(self, num_tokens: int, *, seed: int, job_id: int = 0) -> Request:
        return Request(
            num_tokens, self.model.hash_block_size, seed=seed, req_id=f"{self.run_id}-req{seed}", job_id=job_id
        )

    def capture(self, on: bool) -> None:
        for store in self.stores:
            store.capturing = on

    def fill(self, tables: Sequence[list[int]], request: Request, seed: int = 0) -> None:
        """Write deterministic, rank-dependent bytes into every block holding a chunk of *request*."""
        from kvpolicy.vllm import harness

        for rank in self.ranks:
            harness._fill_cold(rank, self.model, tables, request.hashes, seed)

    def save(self, tables: Sequence[list[int]], request: Request) -> None:
        """The store job for *request* on every rank through vLLM's send threads; returns when all are done."""
        from kvpolicy.vllm import harness

        for rank in self.ranks:
            metadata = harness._save_meta(
                self.model,
                tuple(tables),
                request.hashes,
                request.num_tokens,
                request.req_id,
                request.job_id,
                rank.worker.coord,
            )
            for meta in metadata.requests:
                meta.current_event = harness._NoCudaEvent()
                rank.worker.kv_send_thread.add_request(meta)
        for rank in self.ranks:
            rank.worker.kv_send_thread.request_queue.join()
        for rank in self.ranks:
            completed = rank.worker.build_connector_worker_meta()
            if completed is None or request.job_id not in completed.completed_saves:
                raise RuntimeError(f"rank {rank.tp_rank}: the send thread did not finish store job {request.job_id}")
            failed = [key for key, _, code in rank.store.puts if code < 0]
            if failed:
                raise RuntimeError(f"rank {rank.tp_rank}: {len(failed)} puts failed, e.g. {failed[0]}")
            rank.store.puts.clear()

    def lookup(self, request: Request) -> Any:
        """vLLM's ``MooncakeStoreWorker.lookup`` on the lowest rank (rank 0 answers for the scheduler)."""
        return self.ranks[0].worker.lookup(request.num_tokens, request.hashes)

    def load_metadata(self, tables: Sequence[list[int]], request: Request, lookup: Any) -> list[Any]:
        import copy

        from kvpolicy.vllm import harness

        return [
            harness._load_meta(
                self.model, tuple(tables), request.hashes, request.num_tokens, request.req_id, copy.deepcopy(lookup)
            )
            for _ in self.ranks
        ]

    def load(self, metadata: Sequence[Any]) -> list[int]:
        """Start the loads on every rank's receive thread, wait for all; the ranks that reported failures."""
        for rank, meta in zip(self.ranks, metadata, strict=True):
            rank.worker.start_load_kv(meta)
        for rank in self.ranks:
            rank.worker.recv_request_queue.join()
        failed = []
        for rank, meta in zip(self.ranks, metadata, strict=True):
            results = rank.worker.get_transfer_results(set(), meta)
            req_ids = {request.req_id for request in meta.requests}
            if req_ids & results.failed_recving or rank.worker.get_block_ids_with_load_errors():
                failed.append(rank.tp_rank)
        return failed

    def remove_objects(self) -> None:
        self.stores[0].remove_by_regex(f".*{self.run_id}.*", True)

    def close(self) -> None:
        from kvpolicy.vllm import harness

        for rank in self.ranks:
            harness._stop_rank(rank)
        self.ranks = []

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
