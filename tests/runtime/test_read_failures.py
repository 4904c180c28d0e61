"""A chunk whose read just failed is missing to the next lookups, for a while, and only that chunk."""

from __future__ import annotations

import pytest

from kvpolicy.runtime.read_failures import ReadFailures, RecordingReadStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """A store client whose gets answer the codes it is given (or raise)."""

    def __init__(self, codes: dict[str, int] | None = None, *, raises: bool = False) -> None:
        self.codes = codes or {}
        self.raises = raises
        self.gets: list[list[str]] = []

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: object, sizes: object) -> list[int]:
        self.gets.append(keys)
        if self.raises:
            raise RuntimeError("transfer engine gone")
        return [self.codes.get(key, 16) for key in keys]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1] * len(keys)


def test_a_key_whose_read_failed_is_reported_missing() -> None:
    failures = ReadFailures(30)
    failures.record(["a"])
    assert failures.mask(["a", "b"], [1, 1]) == [0, 1]


def test_keys_that_were_not_stored_stay_missing_and_are_not_counted_as_masked() -> None:
    failures = ReadFailures(30)
    failures.record(["a"])
    assert failures.mask(["a", "b"], [0, 0]) == [0, 0]
    assert failures.masked == 0


def test_a_failed_key_is_reported_stored_again_once_its_ttl_has_passed() -> None:
    clock = Clock()
    failures = ReadFailures(10, clock=clock)
    failures.record(["a"])
    clock.now += 9.9
    assert failures.mask(["a"], [1]) == [0]
    clock.now += 0.2
    assert failures.mask(["a"], [1]) == [1]
    assert len(failures) == 0


def test_a_second_failure_restarts_the_ttl() -> None:
    clock = Clock()
    failures = ReadFailures(10, clock=clock)
    failures.record(["a"])
    clock.now += 8
    failures.record(["a"])
    clock.now += 8
    assert failures.mask(["a"], [1]) == [0]


def test_memory_is_bounded_by_forgetting_the_oldest_failures() -> None:
    failures = ReadFailures(30, limit=3)
    failures.record(["a", "b", "c", "d"])
    assert len(failures) == 3
    assert failures.mask(["a", "b", "c", "d"], [1, 1, 1, 1]) == [1, 0, 0, 0]


def test_a_zero_ttl_remembers_nothing() -> None:
    failures = ReadFailures(0)
    failures.record(["a"])
    assert failures.mask(["a"], [1]) == [1]


def test_a_get_records_exactly_the_keys_it_failed_to_read() -> None:
    failures = ReadFailures(30)
    store = RecordingReadStore(Store({"b": -800, "c": -707}), failures)
    assert store.batch_get_into_multi_buffers(["a", "b", "c"], [], []) == [16, -800, -707]
    assert failures.mask(["a", "b", "c"], [1, 1, 1]) == [1, 0, 0]


def test_a_get_that_raises_records_every_key_and_still_raises() -> None:
    failures = ReadFailures(30)
    store = RecordingReadStore(Store(raises=True), failures)
    with pytest.raises(RuntimeError, match="transfer engine gone"):
        store.batch_get_into_multi_buffers(["a", "b"], [], [])
    assert failures.mask(["a", "b"], [1, 1]) == [0, 0]


def test_the_recording_store_offers_the_read_port_and_nothing_else() -> None:
    class Described(Store):
        def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[str]]:
            return {key: ["memory"] for key in keys}

    inner = Described()
    store = RecordingReadStore(inner, ReadFailures(30))
    assert store.batch_get_replica_desc(["a"]) == {"a": ["memory"]}
    assert not hasattr(store, "batch_is_exist")  # a receive thread makes no other call: none is forwarded
    assert store.inner is inner
