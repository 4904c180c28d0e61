"""A shared store nobody without the deployment's secret can poison (:mod:`kvpolicy.runtime.trust`):
keyed namespaces, sealed objects, rotation, and reading the secret. Pure: the store is :class:`HostStore`
below, Mooncake's client semantics over a dict (first write wins, a get whose buffers' total size is not
the object's fails), copying bytes from and into real host memory at the addresses it is handed.

Expected values follow from the trust model (an HMAC replaces the chunk part, a seal is 32 bytes after
the object's bytes), never from a run of the code under test.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from runtime_support import HandClock, logged

from kvpolicy.documents.settings import KVPolicySettings, SecretSource, SettingsError, StoreProtection
from kvpolicy.language.keys import split_chunk_key
from kvpolicy.mooncake import OBJECT_NOT_FOUND
from kvpolicy.runtime.trust import (
    MAX_SECRET_FILE_BYTES,
    MIN_SECRET_BYTES,
    SEAL_BYTES,
    SEAL_MISMATCH,
    DeploymentSecret,
    Keyring,
    Namespaces,
    ProtectedStore,
    SealFailures,
    SecretError,
    keyring_for,
    read_secret,
)

BUFFER_TOO_SMALL = -600
"""Mooncake's code for a get whose buffers cannot hold the object."""
BUFFER_TOO_LARGE = -800
"""The code this double gives a get whose buffers are larger than the object (the sizes differ)."""

NAMESPACE = "org/model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
KEY = f"{NAMESPACE}@0123abcd"
"""A logical chunk key: the namespace, then vLLM's chunk hash after the last '@'."""
OTHER_KEY = f"{NAMESPACE}@4567cdef"

MATERIAL = b"correct horse battery staple 123"  # 32 bytes
OTHER_MATERIAL = b"a different secret of 32 bytes!!"
SECRET = DeploymentSecret(MATERIAL)
OTHER = DeploymentSecret(OTHER_MATERIAL)

TRUST_LOGGER = "vllm.kvpolicy.runtime.trust"
MAC_TAIL = re.compile(r"[0-9a-f]{32}")


# --- the store double and host memory ----------------------------------------------------------------


class HostStore:
    """Mooncake's store client as the ports use it: ``put`` of an existing key returns 0 and keeps the
    first object; a get into buffers whose total size differs from the object's fails (-600 smaller,
    -800 larger) and copies nothing; ``get_size`` gives an object's size; bytes travel through the host
    addresses given."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.removed: list[tuple[str, bool]] = []

    def put(self, key: str, value: bytes) -> int:
        self.objects.setdefault(key, bytes(value))
        return 0

    def get(self, key: str) -> bytes:
        return self.objects.get(key, b"")

    def remove(self, key: str, force: bool = False) -> int:
        self.removed.append((key, force))
        return 0 if self.objects.pop(key, None) is not None else OBJECT_NOT_FOUND

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if key in self.objects else 0 for key in keys]

    def get_size(self, key: str) -> int:
        return len(self.objects[key]) if key in self.objects else OBJECT_NOT_FOUND

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        for key, addresses, lengths in zip(keys, addrs, sizes, strict=True):
            value = b"".join(ctypes.string_at(address, length) for address, length in zip(addresses, lengths, strict=True))
            self.objects.setdefault(key, value)
        return [0] * len(keys)

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        codes = []
        for key, addresses, lengths in zip(keys, addrs, sizes, strict=True):
            value = self.objects.get(key)
            if value is None:
                codes.append(OBJECT_NOT_FOUND)
                continue
            if sum(lengths) != len(value):
                codes.append(BUFFER_TOO_SMALL if sum(lengths) < len(value) else BUFFER_TOO_LARGE)
                continue
            offset = 0
            for address, length in zip(addresses, lengths, strict=True):
                ctypes.memmove(address, value[offset : offset + length], length)
                offset += length
            codes.append(len(value))
        return codes

    def overwrite(self, key: str, value: bytes) -> None:
        """What a client that knows ``key`` can do: remove the object (force) and put its own."""
        self.remove(key, True)
        self.put(key, value)


class Regions:
    """One object's host memory: a ctypes buffer per region (vLLM hands one address per layer)."""

    def __init__(self, *sizes: int) -> None:
        self.buffers = [ctypes.create_string_buffer(size) for size in sizes]

    @classmethod
    def holding(cls, *parts: bytes) -> Regions:
        regions = cls(*(len(part) for part in parts))
        for buffer, part in zip(regions.buffers, parts, strict=True):
            ctypes.memmove(buffer, part, len(part))
        return regions

    @property
    def addrs(self) -> list[int]:
        return [ctypes.addressof(buffer) for buffer in self.buffers]

    @property
    def sizes(self) -> list[int]:
        return [len(buffer) for buffer in self.buffers]

    def content(self) -> bytes:
        return b"".join(buffer.raw for buffer in self.buffers)


PARTS = (bytes(range(100)), b"second region of 28 bytes!!!")
"""An object of two regions, 128 bytes."""


def save(store: object, key: str, *parts: bytes) -> list[int]:
    regions = Regions.holding(*parts)
    return list(store.batch_put_from_multi_buffers([key], [regions.addrs], [regions.sizes]))  # type: ignore[attr-defined]


def load(store: object, key: str, *sizes: int) -> tuple[int, bytes]:
    """(the code, the bytes the regions hold after the get) of one key read into fresh regions."""
    regions = Regions(*sizes)
    (code,) = store.batch_get_into_multi_buffers([key], [regions.addrs], [regions.sizes])  # type: ignore[attr-defined]
    return code, regions.content()


def protected(
    store: HostStore, secret: DeploymentSecret = SECRET, *, keyed: bool = True, sealed: bool = False,
    previous: DeploymentSecret | None = None, until: float | None = None, clock: Callable[[], float] = time.time,
    failures: SealFailures | None = None,
) -> ProtectedStore:
    keyring = Keyring(
        Namespaces(secret, keyed=keyed, sealed=sealed),
        None if previous is None else Namespaces(previous, keyed=keyed, sealed=sealed),
        previous_until=until,
        clock=clock,
    )
    return ProtectedStore(store, keyring, failures=failures)


def flip_one_byte(value: bytes, index: int = 7) -> bytes:
    return value[:index] + bytes([value[index] ^ 0x01]) + value[index + 1 :]


# --- keyed namespaces ------------------------------------------------------------------------------------


def test_a_keyed_key_keeps_its_namespace_and_ends_in_32_hex_digits_instead_of_the_chunk_hash() -> None:
    physical = Namespaces(SECRET, keyed=True, sealed=False).physical(KEY)
    namespace, tail = split_chunk_key(physical)
    assert namespace == NAMESPACE
    assert MAC_TAIL.fullmatch(tail) and tail != "0123abcd"


def test_the_keyed_part_depends_on_the_whole_logical_key_not_only_its_chunk_hash() -> None:
    namespaces = Namespaces(SECRET, keyed=True, sealed=False)
    elsewhere = KEY.replace("group:0", "group:1")
    assert split_chunk_key(namespaces.physical(KEY))[1] != split_chunk_key(namespaces.physical(elsewhere))[1]
    assert namespaces.physical(KEY) != namespaces.physical(OTHER_KEY)


def test_an_unkeyed_namespace_leaves_the_key_as_vllm_spells_it() -> None:
    assert Namespaces(SECRET, keyed=False, sealed=True).physical(KEY) == KEY


def test_different_secrets_give_different_physical_keys() -> None:
    assert Namespaces(SECRET, keyed=True, sealed=False).physical(KEY) != Namespaces(OTHER, keyed=True, sealed=False).physical(KEY)


def test_one_secret_gives_the_same_physical_keys_in_every_instance() -> None:
    again = DeploymentSecret(bytes(MATERIAL))
    assert Namespaces(SECRET, keyed=True, sealed=False).physical(KEY) == Namespaces(again, keyed=True, sealed=False).physical(KEY)


def test_sealed_and_unsealed_keyed_namespaces_never_share_a_key() -> None:
    sealed, plain = Namespaces(SECRET, keyed=True, sealed=True), Namespaces(SECRET, keyed=True, sealed=False)
    assert sealed.physical(KEY) != plain.physical(KEY)
    assert MAC_TAIL.fullmatch(split_chunk_key(sealed.physical(KEY))[1])


# --- a client without the secret ---------------------------------------------------------------------------


def test_an_object_pre_written_under_the_logical_key_by_a_client_without_the_secret_is_never_read() -> None:
    store = HostStore()
    save(store, KEY, b"p" * 128)  # the attacker guessed the prompt, so the key
    store.put(KEY, b"poison")
    victim = protected(store)

    assert victim.batch_is_exist([KEY]) == [0]
    assert victim.get(KEY) == b""
    assert load(victim, KEY, 128)[0] < 0


def test_a_keyed_write_beside_an_attackers_object_under_the_logical_key_reads_back_the_writers_bytes() -> None:
    store = HostStore()
    save(store, KEY, b"p" * 128)
    victim = protected(store)

    assert save(victim, KEY, *PARTS) == [0]

    assert load(victim, KEY, 100, 28) == (128, b"".join(PARTS))


def test_a_client_without_the_secret_cannot_find_a_keyed_object_by_its_logical_key() -> None:
    store = HostStore()
    save(protected(store), KEY, *PARTS)
    assert store.batch_is_exist([KEY]) == [0]
    assert len(store.objects) == 1


# --- sealed objects ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_a_sealed_round_trip_returns_the_bytes_and_codes_without_the_seals_32_bytes(keyed: bool) -> None:
    store = HostStore()
    victim = protected(store, keyed=keyed, sealed=True)

    assert save(victim, KEY, *PARTS) == [0]

    (stored,) = store.objects.values()
    assert len(stored) == 128 + SEAL_BYTES and stored.startswith(b"".join(PARTS))
    assert load(victim, KEY, 100, 28) == (128, b"".join(PARTS))


def test_a_sealed_batch_reads_every_key_into_its_own_regions() -> None:
    store = HostStore()
    victim = protected(store, sealed=True)
    values = {KEY: b"a" * 64, OTHER_KEY: b"b" * 16 + b"c" * 48}
    for key, value in values.items():
        save(victim, key, value)
    targets = [Regions(64) for _ in values]

    codes = victim.batch_get_into_multi_buffers(list(values), [t.addrs for t in targets], [t.sizes for t in targets])

    assert list(codes) == [64, 64]
    assert [t.content() for t in targets] == list(values.values())


def test_a_sealed_small_object_round_trips_through_put_and_get() -> None:
    victim = protected(HostStore(), sealed=True)
    assert victim.put(KEY, b"an audit marker") == 0
    assert victim.get(KEY) == b"an audit marker"


def test_a_tampered_object_is_refused_with_seal_mismatch() -> None:
    store = HostStore()
    victim = protected(store, sealed=True)
    save(victim, KEY, *PARTS)
    (physical,) = store.objects
    store.overwrite(physical, flip_one_byte(store.objects[physical]))

    assert load(victim, KEY, 100, 28)[0] == SEAL_MISMATCH


def test_an_object_whose_seal_itself_was_changed_is_refused() -> None:
    store = HostStore()
    victim = protected(store, sealed=True)
    save(victim, KEY, *PARTS)
    (physical,) = store.objects
    store.overwrite(physical, flip_one_byte(store.objects[physical], index=128 + SEAL_BYTES - 1))

    assert load(victim, KEY, 100, 28)[0] == SEAL_MISMATCH


def test_a_sealed_object_copied_under_another_key_is_refused() -> None:
    # Unkeyed, anyone can name both keys: the seal binds the object to its own key.
    store = HostStore()
    victim = protected(store, keyed=False, sealed=True)
    save(victim, KEY, b"a" * 64)
    store.put(OTHER_KEY, store.objects[KEY])

    assert load(victim, OTHER_KEY, 64)[0] == SEAL_MISMATCH


def test_each_refused_load_is_counted_and_reported_to_on_refused() -> None:
    store = HostStore()
    calls: list[None] = []
    failures = SealFailures(on_refused=lambda: calls.append(None))
    victim = protected(store, sealed=True, failures=failures)
    save(victim, KEY, *PARTS)
    (physical,) = store.objects
    good = store.objects[physical]

    for _ in range(2):
        store.overwrite(physical, flip_one_byte(good))
        assert load(victim, KEY, 100, 28)[0] == SEAL_MISMATCH

    assert (failures.refused, len(calls)) == (2, 2)


def test_a_refused_key_is_logged_once_however_often_its_loads_are_refused() -> None:
    store = HostStore()
    victim = protected(store, sealed=True)
    save(victim, KEY, *PARTS)
    save(victim, OTHER_KEY, *PARTS)
    good = dict(store.objects)

    with logged(TRUST_LOGGER) as records:
        for key in (KEY, KEY, OTHER_KEY):
            physical = victim.keyring.current.physical(key)
            store.overwrite(physical, flip_one_byte(good[physical]))
            load(victim, key, 100, 28)

    warnings = [record.getMessage() for record in records if record.levelno == logging.WARNING]
    assert len(warnings) == 2 and victim.failures.refused == 3
    assert KEY in warnings[0] and OTHER_KEY in warnings[1]


def test_a_refused_object_is_removed_so_the_next_save_stores_a_good_one() -> None:
    store = HostStore()
    victim = protected(store, sealed=True)
    save(victim, KEY, *PARTS)
    (physical,) = store.objects
    store.overwrite(physical, flip_one_byte(store.objects[physical]))

    load(victim, KEY, 100, 28)

    assert store.batch_is_exist([physical]) == [0]
    save(victim, KEY, *PARTS)
    assert load(victim, KEY, 100, 28) == (128, b"".join(PARTS))


def test_a_tampered_small_object_is_refused_by_get_and_counted() -> None:
    store = HostStore()
    victim = protected(store, sealed=True)
    victim.put(KEY, b"an audit marker")
    (physical,) = store.objects
    store.overwrite(physical, flip_one_byte(store.objects[physical], index=0))

    assert victim.get(KEY) == b""
    assert victim.failures.refused == 1


def test_a_tampered_small_object_is_removed_so_the_next_put_stores_a_good_one() -> None:
    store = HostStore()
    victim = protected(store, sealed=True)
    victim.put(KEY, b"an audit marker")
    (physical,) = store.objects
    store.overwrite(physical, flip_one_byte(store.objects[physical], index=0))
    victim.get(KEY)

    victim.put(KEY, b"an audit marker")

    assert victim.get(KEY) == b"an audit marker"


def test_an_object_without_a_seal_is_refused_with_seal_mismatch() -> None:
    # An unsealed writer's object is 32 bytes shorter than what a sealed reader asks for.
    store = HostStore()
    save(protected(store, keyed=False, sealed=False), KEY, *PARTS)
    reader = protected(store, keyed=False, sealed=True)

    assert load(reader, KEY, 100, 28)[0] == SEAL_MISMATCH
    assert reader.failures.refused == 1


def test_an_object_without_a_seal_is_removed_so_the_next_save_stores_a_sealed_one() -> None:
    store = HostStore()
    save(protected(store, keyed=False, sealed=False), KEY, *PARTS)
    reader = protected(store, keyed=False, sealed=True)
    load(reader, KEY, 100, 28)

    assert store.batch_is_exist([KEY]) == [0]
    save(reader, KEY, *PARTS)
    assert load(reader, KEY, 100, 28) == (128, b"".join(PARTS))


def test_a_store_client_without_get_size_still_refuses_an_object_without_a_seal() -> None:
    class OlderClient(HostStore):
        get_size = None  # type: ignore[assignment]

    store = OlderClient()
    save(protected(store, keyed=False, sealed=False), KEY, *PARTS)

    code, content = load(protected(store, keyed=False, sealed=True), KEY, 100, 28)

    assert code < 0 and content == bytes(128)


def test_a_missing_object_is_a_miss_not_a_seal_mismatch() -> None:
    reader = protected(HostStore(), sealed=True)
    assert load(reader, KEY, 100, 28)[0] == OBJECT_NOT_FOUND
    assert reader.failures.refused == 0


def test_a_small_object_without_a_seal_is_refused_by_get() -> None:
    store = HostStore()
    store.put(KEY, b"x" * 100)
    reader = protected(store, keyed=False, sealed=True)
    assert reader.get(KEY) == b""


def test_a_sealed_reader_never_finds_an_unsealed_writers_keyed_objects() -> None:
    store = HostStore()
    save(protected(store, sealed=False), KEY, *PARTS)
    reader = protected(store, sealed=True)
    assert reader.batch_is_exist([KEY]) == [0]
    assert load(reader, KEY, 100, 28)[0] == OBJECT_NOT_FOUND


# --- rotation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sealed", [False, True], ids=["keyed", "keyed-and-sealed"])
def test_lookups_and_loads_fall_back_to_the_previous_secret_during_a_rotation(sealed: bool) -> None:
    store = HostStore()
    save(protected(store, SECRET, sealed=sealed), KEY, *PARTS)
    rotated = protected(store, OTHER, sealed=sealed, previous=SECRET)

    assert rotated.batch_is_exist([KEY, OTHER_KEY]) == [1, 0]
    assert load(rotated, KEY, 100, 28) == (128, b"".join(PARTS))


def test_small_objects_fall_back_to_the_previous_secret_during_a_rotation() -> None:
    store = HostStore()
    protected(store, SECRET, sealed=True).put(KEY, b"marker")
    assert protected(store, OTHER, sealed=True, previous=SECRET).get(KEY) == b"marker"


def test_saves_during_a_rotation_go_to_the_current_secret_only() -> None:
    store = HostStore()
    rotated = protected(store, OTHER, previous=SECRET)

    save(rotated, KEY, *PARTS)
    rotated.put(OTHER_KEY, b"marker")

    assert protected(store, SECRET).batch_is_exist([KEY, OTHER_KEY]) == [0, 0]
    assert protected(store, OTHER).batch_is_exist([KEY, OTHER_KEY]) == [1, 1]


def test_the_current_secrets_object_is_read_before_the_previous_ones() -> None:
    store = HostStore()
    save(protected(store, SECRET), KEY, b"o" * 64)
    save(protected(store, OTHER), KEY, b"n" * 64)
    assert load(protected(store, OTHER, previous=SECRET), KEY, 64) == (64, b"n" * 64)


def test_the_send_threads_sibling_asks_the_current_secret_only() -> None:
    store = HostStore()
    save(protected(store, SECRET), KEY, *PARTS)
    rotated = protected(store, OTHER, previous=SECRET)

    assert rotated.sibling(writes_only=True).batch_is_exist([KEY]) == [0]
    assert rotated.sibling().batch_is_exist([KEY]) == [1]


def test_after_the_grace_period_the_previous_secret_is_not_read() -> None:
    store = HostStore()
    save(protected(store, SECRET), KEY, *PARTS)
    clock = HandClock(1000.0)
    rotated = protected(store, OTHER, previous=SECRET, until=1500.0, clock=clock)

    clock.now = 1499.0
    assert rotated.batch_is_exist([KEY]) == [1]
    clock.now = 1500.0
    assert rotated.batch_is_exist([KEY]) == [0]
    assert load(rotated, KEY, 100, 28)[0] == OBJECT_NOT_FOUND


# --- reading the secret ------------------------------------------------------------------------------------


def secret_file(tmp_path: Path, content: bytes, mode: int = 0o600, name: str = "secret") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_an_unset_environment_variable_is_refused_naming_it() -> None:
    with pytest.raises(SecretError, match="KVPOLICY_TEST_SECRET is not set"):
        read_secret(SecretSource("env", "KVPOLICY_TEST_SECRET"), environ={})


def test_a_secret_shorter_than_the_minimum_is_refused() -> None:
    with pytest.raises(SecretError, match=f"at least {MIN_SECRET_BYTES}"):
        read_secret(SecretSource("env", "S"), environ={"S": "x" * (MIN_SECRET_BYTES - 1)})


def test_a_secret_of_exactly_the_minimum_length_is_read() -> None:
    assert read_secret(SecretSource("env", "S"), environ={"S": "x" * MIN_SECRET_BYTES}) == DeploymentSecret(b"x" * 16)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602], ids=oct)
def test_a_secret_file_others_may_read_or_write_is_refused_with_the_chmod_that_fixes_it(mode: int, tmp_path: Path) -> None:
    path = secret_file(tmp_path, b"x" * 32, mode)
    with pytest.raises(SecretError, match="chmod 600") as raised:
        read_secret(SecretSource("file", str(path)))
    assert f"{mode:04o}" in str(raised.value)


def test_a_secret_file_only_its_owner_may_read_is_read(tmp_path: Path) -> None:
    path = secret_file(tmp_path, b"y" * 32, 0o400)
    assert read_secret(SecretSource("file", str(path))) == DeploymentSecret(b"y" * 32)


def test_a_directory_is_refused_as_a_secret_file_naming_it(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="(?i)directory") as raised:
        read_secret(SecretSource("file", str(tmp_path)))
    assert str(tmp_path) in str(raised.value)


def test_a_fifo_is_refused_as_a_secret_file_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "secret"
    os.mkfifo(fifo, 0o600)
    started = time.monotonic()
    with pytest.raises(SecretError, match="not a regular file"):
        read_secret(SecretSource("file", str(fifo)))
    assert time.monotonic() - started < 5


def test_a_device_is_refused_as_a_secret_file() -> None:
    with pytest.raises(SecretError, match="not a regular file"):
        read_secret(SecretSource("file", "/dev/zero"))


def test_a_missing_secret_file_is_refused_saying_it_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="does not exist"):
        read_secret(SecretSource("file", str(tmp_path / "absent")))


def test_a_secret_file_larger_than_the_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "huge"
    with path.open("wb") as stream:
        stream.truncate(1 << 40)  # sparse: reading it whole would need a terabyte
    path.chmod(0o600)
    started = time.monotonic()
    with pytest.raises(SecretError, match=f"larger than {MAX_SECRET_FILE_BYTES} bytes"):
        read_secret(SecretSource("file", str(path)))
    assert time.monotonic() - started < 5


def test_a_secret_file_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    path = secret_file(tmp_path, b"z" * MAX_SECRET_FILE_BYTES)
    assert read_secret(SecretSource("file", str(path))) == DeploymentSecret(b"z" * MAX_SECRET_FILE_BYTES)


def test_one_trailing_newline_is_not_part_of_the_secret(tmp_path: Path) -> None:
    from_file = read_secret(SecretSource("file", str(secret_file(tmp_path, b"x" * 32 + b"\n"))))
    from_env = read_secret(SecretSource("env", "S"), environ={"S": "x" * 32})
    assert from_file == from_env
    assert from_file.key_id == from_env.key_id


def test_a_second_trailing_newline_is_part_of_the_secret(tmp_path: Path) -> None:
    from_file = read_secret(SecretSource("file", str(secret_file(tmp_path, b"x" * 32 + b"\n\n"))))
    assert from_file != DeploymentSecret(b"x" * 32)


# --- the secret is never shown ---------------------------------------------------------------------------

SHOWN_SECRET = "never-show-me-0123456789abcdef"


def test_a_secrets_repr_and_its_namespaces_repr_do_not_show_it() -> None:
    secret = DeploymentSecret(SHOWN_SECRET.encode())
    keyring = Keyring(Namespaces(secret, keyed=True, sealed=True), Namespaces(OTHER, keyed=True, sealed=True))
    for text in (repr(secret), str(secret), repr(keyring), repr(ProtectedStore(HostStore(), keyring))):
        assert SHOWN_SECRET not in text and MATERIAL.decode() not in text
        assert OTHER_MATERIAL.decode() not in text


def secret_errors(tmp_path: Path) -> list[SecretError]:
    """Every refusal read_secret gives where the secret (or part of it) is at hand."""
    readable = secret_file(tmp_path, SHOWN_SECRET.encode(), 0o644, "readable")
    short = secret_file(tmp_path, SHOWN_SECRET[:10].encode(), 0o600, "short")
    huge = secret_file(tmp_path, SHOWN_SECRET.encode() * (MAX_SECRET_FILE_BYTES // len(SHOWN_SECRET) + 1), 0o600, "huge")
    sources = [
        (SecretSource("env", "S"), {"S": SHOWN_SECRET[:10]}),
        (SecretSource("file", str(readable)), None),
        (SecretSource("file", str(short)), None),
        (SecretSource("file", str(huge)), None),
    ]
    errors = []
    for source, environ in sources:
        with pytest.raises(SecretError) as raised:
            read_secret(source, environ=environ)
        errors.append(raised.value)
    return errors


def test_no_secret_error_shows_the_secret_or_part_of_it(tmp_path: Path) -> None:
    errors = secret_errors(tmp_path)
    assert len(errors) == 4
    for error in errors:
        assert SHOWN_SECRET[:10] not in str(error) and SHOWN_SECRET[:10] not in repr(error)


def test_a_secret_written_where_the_variables_name_belongs_is_not_shown() -> None:
    misuse = "deadbeef" + "0123456789abcdef" * 3  # `openssl rand -hex 32` output that starts with a letter
    with pytest.raises(SecretError) as raised:
        read_secret(SecretSource.parse(f"env:{misuse}"), environ={})
    assert misuse not in str(raised.value)


# --- the keyring the settings configure --------------------------------------------------------------------


def settings_with(**keys: object) -> KVPolicySettings:
    return KVPolicySettings.parse(keys)


def test_settings_that_protect_nothing_build_no_keyring() -> None:
    assert keyring_for(settings_with(), StoreProtection()) is None


def test_the_keyring_keys_and_seals_as_the_protection_says() -> None:
    settings = settings_with(kvpolicy_secret="env:S", kvpolicy_verify_objects=True)
    keyring = keyring_for(settings, StoreProtection(keyed=False, verified=True), environ={"S": MATERIAL.decode()})
    assert keyring is not None and keyring.previous is None
    assert (keyring.current.keyed, keyring.current.sealed, keyring.current.secret) == (False, True, SECRET)


def test_an_unreadable_secret_is_one_located_line_at_its_key() -> None:
    settings = settings_with(kvpolicy_secret="env:UNSET_SECRET")
    with pytest.raises(SettingsError) as raised:
        keyring_for(settings, StoreProtection(keyed=True), environ={})
    (line,) = raised.value.problems
    assert line.startswith("kv_connector_extra_config.kvpolicy_secret: error: ") and "UNSET_SECRET" in line


def test_both_unreadable_secrets_are_reported_at_once_each_at_its_key() -> None:
    settings = settings_with(kvpolicy_secret="env:A", kvpolicy_previous_secret="env:B")
    with pytest.raises(SettingsError) as raised:
        keyring_for(settings, StoreProtection(keyed=True), environ={"A": "tiny-secret"})
    assert [line.split(": error: ")[0] for line in raised.value.problems] == [
        "kv_connector_extra_config.kvpolicy_secret", "kv_connector_extra_config.kvpolicy_previous_secret",
    ]
    assert not any("tiny-secret" in line for line in raised.value.problems)


def test_a_previous_secret_equal_to_the_current_one_is_refused_at_the_previous_key(tmp_path: Path) -> None:
    previous = secret_file(tmp_path, MATERIAL + b"\n")  # the same secret, written with a newline
    settings = settings_with(kvpolicy_secret="env:A", kvpolicy_previous_secret=f"file:{previous}")
    with pytest.raises(SettingsError) as raised:
        keyring_for(settings, StoreProtection(keyed=True), environ={"A": MATERIAL.decode()})
    (line,) = raised.value.problems
    assert line.startswith("kv_connector_extra_config.kvpolicy_previous_secret: error: ")
    assert MATERIAL.decode() not in line


def test_the_settings_grace_period_ends_the_previous_secrets_reads() -> None:
    settings = settings_with(
        kvpolicy_secret="env:A", kvpolicy_previous_secret="env:B", kvpolicy_previous_secret_until="2030-01-01T00:00:00+01:00",
    )
    end = 1_893_452_400.0  # 2029-12-31T23:00:00Z
    clock = HandClock(end - 1)
    keyring = keyring_for(
        settings, StoreProtection(keyed=True), environ={"A": MATERIAL.decode(), "B": OTHER_MATERIAL.decode()}, clock=clock,
    )
    assert keyring is not None and keyring.previous is not None and keyring.previous.secret == OTHER
    assert len(keyring.readable()) == 2
    clock.now = end
    assert keyring.readable() == (keyring.current,)


def test_the_secret_files_checks_hold_for_the_secret_the_settings_name(tmp_path: Path) -> None:
    path = secret_file(tmp_path, MATERIAL, 0o644)
    with pytest.raises(SettingsError, match=r"kvpolicy_secret: error: .*chmod 600"):
        keyring_for(settings_with(kvpolicy_secret=f"file:{path}"), StoreProtection(keyed=True))


def test_environment_values_default_to_the_processs_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOLICY_TEST_SECRET", MATERIAL.decode())
    assert read_secret(SecretSource("env", "KVPOLICY_TEST_SECRET")) == SECRET
