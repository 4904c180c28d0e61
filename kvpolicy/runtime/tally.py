"""kvpolicy's counters of one worker since they were last drained (the ``kvpolicy`` half of the
connector stats vLLM reduces and exports; :mod:`kvpolicy.vllm.metrics` turns them into series)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TypedDict

from kvpolicy.planning.plan import Plan

__all__ = ["GROUP_COUNTERS", "Tally", "TallyData", "empty_tally", "plan_info"]

GROUP_COUNTERS = (
    "objects_written",
    "bytes_written",
    "undeduplicated_objects",
    "undeduplicated_bytes",
    "puts_skipped_existing",
)
"""Per-group counters a worker keeps, in the order of :data:`kvpolicy.vllm.metrics.METRICS`."""


class TallyData(TypedDict):
    """What :meth:`Tally.drain` hands over: a plain dict (picklable, merged across workers)."""

    groups: dict[str, dict[str, int]]
    """Per group (its index as a string), :data:`GROUP_COUNTERS`."""
    audit: dict[str, int]
    """Audited steps per outcome (``agreed``, ``mismatch``)."""
    demotions: dict[str, int]
    """Per group (its index as a string), the audits that demoted it."""
    lookups_gated: int
    objects_refused: int
    """Loads refused because the object's seal did not verify (verified objects)."""
    plan: list[dict[str, str]] | None
    """:func:`plan_info` of the plan last published, None when none was."""


def empty_tally() -> TallyData:
    """No counts yet."""
    return {"groups": {}, "audit": {}, "demotions": {}, "lookups_gated": 0, "objects_refused": 0, "plan": None}


class Tally:
    """One worker's kvpolicy counters since they were last drained; safe to update from vLLM's send
    thread and read from the model runner's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_tally()
        self._dirty = False

    def _group(self, group: int) -> dict[str, int]:
        return self._data["groups"].setdefault(str(group), dict.fromkeys(GROUP_COUNTERS, 0))

    def add(self, group: int, **counts: int) -> None:
        with self._lock:
            entry = self._group(group)
            for name, value in counts.items():
                entry[name] += value
            self._dirty = True

    def audit_step(self, *, demoted: Sequence[int]) -> None:
        with self._lock:
            outcome = "mismatch" if demoted else "agreed"
            self._data["audit"][outcome] = self._data["audit"].get(outcome, 0) + 1
            for group in demoted:
                key = str(group)
                self._data["demotions"][key] = self._data["demotions"].get(key, 0) + 1
            self._dirty = True

    def lookup_gated(self) -> None:
        with self._lock:
            self._data["lookups_gated"] += 1
            self._dirty = True

    def object_refused(self) -> None:
        """One load refused: the object's seal did not verify."""
        with self._lock:
            self._data["objects_refused"] += 1
            self._dirty = True

    def plan(self, plan: Plan) -> None:
        """Publish ``plan`` (rank 0): the info series follow it from the next stats on."""
        with self._lock:
            self._data["plan"] = plan_info(plan)
            self._dirty = True

    def drain(self) -> TallyData | None:
        with self._lock:
            if not self._dirty:
                return None
            data, self._data, self._dirty = self._data, empty_tally(), False
            return data


def plan_info(plan: Plan) -> list[dict[str, str]]:
    """The labels of each group's ``vllm:kvpolicy_group_info`` series."""
    return [
        {
            "group": str(group.index),
            "name": group.name,
            "spec": "+".join(group.spec_types),
            "rule": ", ".join(group.rules),
            "factor": str(group.factor),
            "shards": str(group.shards),
            "policy": plan.policy,
            "fingerprint": plan.fingerprint,
        }
        for group in plan.groups
    ]
