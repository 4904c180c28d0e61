"""Read-failure memory now lives in the vLLM-free runtime (:mod:`kvpolicy.runtime.read_failures`);
these names stay importable from here for the adapter's callers."""

from __future__ import annotations

from kvpolicy.runtime.read_failures import (
    DEFAULT_LIMIT,
    DEFAULT_TTL_S,
    READ_FAILURE_TTL_KEY,
    ReadFailures,
    RecordingReadStore,
)

__all__ = ["DEFAULT_LIMIT", "DEFAULT_TTL_S", "READ_FAILURE_TTL_KEY", "ReadFailures", "RecordingReadStore"]
