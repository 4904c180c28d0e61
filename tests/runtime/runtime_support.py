"""What the pure runtime tests plug into the ports: an in-memory store, a list collective, a hand
clock, and a small hybrid model's plans (an MLA group replicated at TP 4, a Mamba group sharded)."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.models import Audit, AuditMode, Layout, Policy, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.plan import Plan

TP = 4

HYBRID = textwrap.dedent(
    """\
    version: 1
    kind: ModelLayout
    model: org/hybrid
    total_num_kv_heads: 1
    groups:
      - name: mla
        spec: {type: MLAAttentionSpec, bases: [FullAttentionSpec, AttentionSpec, KVCacheSpec], block_size: 16,
               page_size_bytes: 1024, fields: {max_tp_shards: 1}}
        layers: [l.0.attn]
      - name: state
        spec: {type: MambaSpec, bases: [KVCacheSpec], block_size: 16, page_size_bytes: 512, fields: {tp_replicated: false}}
        layers: [l.1.mixer]
    """
)


class MemoryStore:
    """The :class:`~kvpolicy.runtime.ports.KVStore` port in a dict, with Mooncake's codes: ``put``
    keeps an existing object; ``fail`` makes every call raise (a store that cannot answer)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.fail = False
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail:
            raise ConnectionError("store unreachable")

    def put(self, key: str, value: bytes) -> int:
        self._call("put")
        self.objects.setdefault(key, bytes(value))
        return 0

    def get(self, key: str) -> bytes:
        self._call("get")
        return self.objects.get(key, b"")

    def remove(self, key: str, force: bool = False) -> int:
        self._call("remove")
        return 0 if self.objects.pop(key, None) is not None else -704

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._call("batch_is_exist")
        return [1 if key in self.objects else 0 for key in keys]


class ListGather:
    """A collective over TP ranks played by one caller: ``gather(payload)`` returns ``payload`` at this
    rank's index and what the other ranks sent (``others[rank]``, default ``default``) elsewhere.
    ``fail`` makes it raise (a collective that broke); every payload it was given is kept."""

    def __init__(self, rank: int = 0, size: int = TP, others: Mapping[int, Any] | None = None, default: Any = None):
        self.rank, self.size = rank, size
        self.others = dict(others or {})
        self.default = default
        self.sent: list[Any] = []
        self.fail = False

    def __call__(self, payload: Any) -> Sequence[Any]:
        self.sent.append(payload)
        if self.fail:
            raise TimeoutError("collective timed out")
        return [payload if rank == self.rank else self.others.get(rank, self.default) for rank in range(self.size)]


class HandClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def hybrid_layout(tmp_path: Path, model: str = "org/hybrid") -> Layout:
    path = tmp_path / f"{model.replace('/', '_')}.yaml"
    path.write_text(HYBRID.replace("model: org/hybrid", f"model: {model}"), encoding="utf-8")
    return load_layout(path)


def audited_policy(mode: AuditMode = AuditMode.WARN, steps: int = 4) -> Policy:
    policy = load_policy("default")
    origins = tuple(policy.rule_origin(index) for index in range(len(policy.rules)))
    return policy.model_copy(update={"audit": Audit(mode=mode, steps=steps)}).with_origins(origins)


def planner(policy: Policy, layout: Layout, tp_size: int = TP) -> tuple[Plan, Callable[[frozenset[int]], Plan]]:
    """(the declared plan, replan) for ``policy`` on ``layout`` at ``tp_size``."""

    def replan(demoted: frozenset[int]) -> Plan:
        return make_plan(policy, layout, Topology(tp_size=tp_size), demoted=demoted)

    return replan(frozenset()), replan


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def logged(name: str = "vllm.kvpolicy.runtime") -> Iterator[list[logging.LogRecord]]:
    """The run-time's log records while the block runs, every level: caught on its own logger, which
    sits under vLLM's (whose handler may not propagate to pytest's)."""
    handler, logger = _Records(), logging.getLogger(name)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
