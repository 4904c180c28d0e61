"""Instances of one model that share a Mooncake store, a prompt and a key space.

Each :class:`~kvpolicy.sim.instance.Instance` of a fleet has its own policy and TP size (a *mixed
fleet*). Every key the fleet's instances write carries its run id (as ``cache_prefix`` and in the
model name), so fleets on one master never see each other's objects.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from kvpolicy.language.models import Policy
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.pool import ClientPool
from kvpolicy.sim.archetypes import BLOCK_SIZE, Archetype, get_archetype
from kvpolicy.sim.instance import DEFAULT_TIMEOUT_S, Instance, LoadVerdict, SaveOutcome
from kvpolicy.sim.model import build_model
from kvpolicy.sim.scheduler import seed_of

__all__ = ["Fleet", "MixedReport", "run_mixed"]

_WORKER_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
SPARE_BLOCKS = 4
"""Blocks beyond what a request needs, so that a load written outside it shows up."""


class _ExceptionLog(logging.Handler):
    """Collects the exceptions vLLM's transfer threads log (their run loop catches and logs them)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(f"{record.getMessage()}: {record.exc_info[1]!r}")


class Fleet:
    """Instances of ``archetype`` on one store, with one ``num_tokens`` prompt.

    Clients come from ``clients`` (one per rank of each instance) and go back to it on :meth:`close`,
    which also removes the fleet's objects while the master serves.
    """

    def __init__(
        self,
        archetype: str | Archetype,
        *,
        master: MooncakeMaster,
        clients: ClientPool,
        num_tokens: int = 256,
        seed: int = 0,
        name: str = "kvpolicy-sim",
    ) -> None:
        self.archetype = get_archetype(archetype)
        if num_tokens < BLOCK_SIZE:
            raise ValueError(f"num_tokens must be at least one block ({BLOCK_SIZE}), got {num_tokens}")
        self.master = master
        self.clients = clients
        self.num_tokens = num_tokens
        self.seed = seed
        self.run_id = f"kvs{uuid.uuid4().hex[:12]}"
        self.model_name = f"{name}/{self.archetype.name}-{self.run_id}"
        generator = torch.Generator().manual_seed(seed_of("tokens", seed))
        self.token_ids: tuple[int, ...] = tuple(torch.randint(0, 32_000, (num_tokens,), generator=generator).tolist())
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
        policy: Policy | None,
        tp_size: int,
        *,
        name: str | None = None,
        wrap_store: Callable[[int, Any], Any] | None = None,
        blocks_needed: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        dcp_size: int = 1,
        extra_config: Mapping[str, object] = MappingProxyType({}),
        kv_cache_layout: str | None = None,
    ) -> Instance:
        """Start a ``tp_size``-rank instance under ``policy`` (None: vLLM's own ``MooncakeStoreWorker``
        rules); ``wrap_store(tp_rank, client)`` may return a wrapper (e.g.
        :class:`kvpolicy.mooncake.faults.FaultyStore`) the rank uses instead of the client.
        ``blocks_needed`` defaults to one request's blocks per group plus :data:`SPARE_BLOCKS`;
        ``dcp_size`` > 1 runs decode-context parallelism; ``extra_config`` adds connector options
        (``store_tp_size`` …) to the fleet's ``cache_prefix``; ``kv_cache_layout`` is the KV cache
        layout the attention backends declare (:func:`~kvpolicy.sim.model.build_model`)."""
        if self._closed:
            raise RuntimeError("the fleet is closed")
        chunks = math.ceil(self.num_tokens / BLOCK_SIZE)
        model = build_model(
            self.archetype,
            tp_size,
            model_name=self.model_name,
            blocks_needed=blocks_needed or SPARE_BLOCKS,
            blocks_per_group=0 if blocks_needed else chunks,
            extra_config={**extra_config, "cache_prefix": self.run_id},
            dcp_size=dcp_size,
            kv_cache_layout=kv_cache_layout,
        )
        clients = self.clients.acquire(tp_size)
        self._leased.extend(clients)
        instance = Instance(
            self, model, policy, clients, name=name or f"i{len(self.instances)}", wrap_store=wrap_store,
            timeout=timeout,
        )
        self.instances.append(instance)
        return instance

    def remove_objects(self) -> None:
        """Delete every object this fleet's instances wrote (KV chunks and audit markers)."""
        if self._leased:
            self._leased[0].remove_by_regex(f".*{self.run_id}.*", True)

    def close(self) -> None:
        """Stop every instance, remove the fleet's objects (unless the master is down: against a dead
        master that blocks ~4 s and fails, and a restarted one is empty) and return the clients."""
        if self._closed:
            return
        self._closed = True
        try:
            for instance in self.instances:
                instance.close()
            if self.master.serving:
                self.remove_objects()
        finally:
            logging.getLogger(_WORKER_LOGGER).removeHandler(self._log)
            self.clients.release(self._leased)
            self._leased = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
    archetype: str | Archetype,
    *,
    master: MooncakeMaster,
    clients: ClientPool | None = None,
    num_tokens: int = 256,
    seed: int = 0,
    extra_config: Mapping[str, object] = MappingProxyType({}),
    kv_cache_layout: str | None = None,
) -> MixedReport:
    """Save ``archetype``'s prompt from a ``saver_tp``-rank instance under ``saver_policy``, then look
    it up and load it in a new ``loader_tp``-rank instance under ``loader_policy``, on one store.
    ``extra_config`` (e.g. ``store_tp_size``) and ``kv_cache_layout`` apply to both instances.

    Without ``clients`` the run opens ``saver_tp + loader_tp`` clients and closes them (~2 s each).
    """
    pool = ClientPool(master) if clients is None else clients
    try:
        with Fleet(archetype, master=master, clients=pool, num_tokens=num_tokens, seed=seed) as fleet:
            options: dict[str, Any] = {"extra_config": extra_config, "kv_cache_layout": kv_cache_layout}
            saver = fleet.instance(saver_policy, saver_tp, name="saver", **options)
            saved = saver.save()
            loader = fleet.instance(loader_policy, loader_tp, name="loader", **options)
            lookup = loader.lookup()
            loader.load(lookup)
            return MixedReport(
                archetype=fleet.archetype.name,
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
