"""One audited step across the TP ranks: what each rank sends in the collectives, and the conclusion
every rank draws alike from what all sent (pure: the collective is a callable, the distance between
sampled values is injected — :func:`kvpolicy.device.blocks.tensor_distance` on an engine).

Every TP rank must make the same collective calls in the same steps: whether a step is audited
depends only on the connector metadata and the :class:`~kvpolicy.evidence.audit.AuditState`, both identical on
every rank; whether the second gather happens is decided from the first gather's result, which every
rank holds identically, and from the value comparisons, a function of the configuration.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvpolicy.evidence.audit import (
    AuditState,
    Digest,
    StepOutcome,
    ValueComparison,
    distances_to_reference,
    relative_distance,
)

__all__ = ["Report", "Samples", "conclude_step", "decode_report", "decode_samples", "encode_report"]

Report = dict[int, tuple[str, bool]] | None
"""What one rank sends in the first collective: group → (digest hex, all zero); None when it failed."""
Samples = dict[int, bytes] | None
"""What one rank sends in the second collective: group → float32 values; None when it failed."""


def decode_samples(samples: Samples) -> dict[int, array[float]] | None:
    if samples is None:
        return None
    decoded: dict[int, array[float]] = {}
    for group, data in samples.items():
        values = array("f")
        values.frombytes(data)
        decoded[int(group)] = values
    return decoded


def encode_report(digests: Mapping[int, Digest] | None) -> Report:
    """A rank's digests as plain, picklable data for the collective."""
    if digests is None:
        return None
    return {group: (digest.value, digest.all_zero) for group, digest in digests.items()}


def decode_report(report: Report) -> dict[int, Digest] | None:
    if report is None:
        return None
    return {int(group): Digest(str(value), bool(all_zero)) for group, (value, all_zero) in report.items()}


def conclude_step(
    state: AuditState,
    collect_reports: Callable[[], Sequence[Report]],
    collect_samples: Callable[[tuple[int, ...]], Sequence[Samples]],
    *,
    comparisons: Mapping[int, ValueComparison] | None = None,
    distance: Callable[[Any, Any], float] = relative_distance,
) -> StepOutcome:
    """One audited step, given how to collect every rank's digests and, if needed, samples.

    ``collect_reports()`` returns every TP rank's :data:`Report` (the connector: one gather over
    the TP group); when some replica set's digests differ, ``collect_samples(groups)``
    returns every rank's :data:`Samples` for those groups (a second gather), so that rounding
    differences (:func:`kvpolicy.evidence.audit.rounding_tolerance`) are not mistaken for a wrong rule.
    ``comparisons`` (the adapter's ``value_comparisons``) gives each group's tolerance; groups compared by
    exact digests only are never sampled; ``distance`` compares two ranks' samples. Whether the second gather happens is decided from the
    first one's result and the configuration, which every rank holds identically. Raises
    :class:`~kvpolicy.evidence.audit.ReplicationAuditError` under ``enforce``.
    """
    reports = [decode_report(report) for report in collect_reports()]
    need = state.groups_needing_values(reports, comparisons)
    distances = None
    if need:
        samples = [decode_samples(sample) for sample in collect_samples(need)]
        distances = distances_to_reference(state.plan, samples, need, distance=distance)
    return state.conclude(reports, distances=distances, comparisons=comparisons)
