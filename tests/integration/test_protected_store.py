"""The poisoning :mod:`kvpolicy.runtime.trust` defends against, on a real Mooncake master: an attacker is a
plain store client on the same master (Mooncake authenticates nobody and keeps the first write of a key),
the victim a :class:`~kvpolicy.runtime.trust.ProtectedStore` around another client. Regions are
registered host memory, written and read the way vLLM's transfer threads do (batch puts and gets)."""

from __future__ import annotations

import ctypes
import os
import uuid
from collections.abc import Iterator

import pytest

try:
    import mooncake.store
except ImportError as error:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"mooncake.store does not import: {error}", allow_module_level=True)

from kvpolicy.mooncake import OBJECT_NOT_FOUND, MooncakeMaster, store_client
from kvpolicy.runtime.trust import SEAL_BYTES, SEAL_MISMATCH, DeploymentSecret, Keyring, Namespaces, ProtectedStore

Client = mooncake.store.MooncakeDistributedStore

SECRET = DeploymentSecret(b"the deployment's secret, 32 B.!!")
SIZES = (96, 32)
"""One object's regions (two layers' blocks): 128 bytes."""
GOOD = bytes(range(96)) + b"second layer's block, 32 bytes.!"
POISON = b"\xee" * 128


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as started:
        yield started


# Closing a client takes about 2 s: the module shares one attacker and one victim client.
@pytest.fixture(scope="module")
def attacker(master: MooncakeMaster) -> Iterator[Client]:
    with store_client(master.client_config()) as store:
        yield store


@pytest.fixture(scope="module")
def victim_client(master: MooncakeMaster) -> Iterator[Client]:
    with store_client(master.client_config()) as store:
        yield store


class Regions:
    """One object's regions in host memory registered with a client while in a ``with``."""

    def __init__(self, client: Client | ProtectedStore, sizes: tuple[int, ...] = SIZES, content: bytes | None = None):
        self.client = client
        self.raw = ctypes.create_string_buffer(sum(sizes))
        self.sizes = list(sizes)
        if content is not None:
            assert len(content) == sum(sizes)
            ctypes.memmove(self.raw, content, len(content))

    def __enter__(self) -> Regions:
        assert self.client.register_buffer(ctypes.addressof(self.raw), len(self.raw)) == 0
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self.client.unregister_buffer(ctypes.addressof(self.raw)) == 0

    @property
    def addrs(self) -> list[int]:
        base = ctypes.addressof(self.raw)
        return [base + sum(self.sizes[:index]) for index in range(len(self.sizes))]

    def content(self) -> bytes:
        return self.raw.raw


def save(client: Client | ProtectedStore, key: str, content: bytes, sizes: tuple[int, ...] = SIZES) -> int:
    with Regions(client, sizes, content) as regions:
        (code,) = client.batch_put_from_multi_buffers([key], [regions.addrs], [regions.sizes])
    return code


def load(client: Client | ProtectedStore, key: str, sizes: tuple[int, ...] = SIZES) -> tuple[int, bytes]:
    with Regions(client, sizes) as regions:
        (code,) = client.batch_get_into_multi_buffers([key], [regions.addrs], [regions.sizes])
        return code, regions.content()


def logical_key() -> str:
    """A chunk key as vLLM spells it: the namespace, then the chunk hash the attacker computed from a guessed prompt."""
    return f"org/model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{uuid.uuid4().hex}"


def protected(client: Client, *, sealed: bool) -> ProtectedStore:
    return ProtectedStore(client, Keyring(Namespaces(SECRET, keyed=True, sealed=sealed)))


def test_without_protection_the_attackers_pre_written_object_is_what_the_victim_loads(
    attacker: Client, victim_client: Client
) -> None:
    key = logical_key()
    assert save(attacker, key, POISON) == 0

    assert save(victim_client, key, GOOD) == 0  # Mooncake keeps the first write

    assert load(victim_client, key) == (128, POISON)


def test_keyed_the_attackers_object_under_the_logical_key_is_never_read(attacker: Client, victim_client: Client) -> None:
    key = logical_key()
    save(attacker, key, POISON)
    victim = protected(victim_client, sealed=False)

    assert victim.batch_is_exist([key]) == [0]
    assert load(victim, key)[0] == OBJECT_NOT_FOUND
    assert save(victim, key, GOOD) == 0
    assert load(victim, key) == (128, GOOD)


def test_keyed_the_attacker_cannot_find_the_victims_object_by_its_logical_key(attacker: Client, victim_client: Client) -> None:
    key = logical_key()
    victim = protected(victim_client, sealed=False)
    assert save(victim, key, GOOD) == 0

    assert attacker.batch_is_exist([key]) == [0]
    assert victim.batch_is_exist([key]) == [1]


def test_sealed_an_overwritten_object_is_refused_and_removed_so_the_next_save_stores_one_that_loads(
    attacker: Client, victim_client: Client
) -> None:
    key = logical_key()
    victim = protected(victim_client, sealed=True)
    assert save(victim, key, GOOD) == 0
    physical = victim.keyring.current.physical(key)  # say the attacker learnt it
    stored = bytes(attacker.get(physical))
    assert len(stored) == 128 + SEAL_BYTES
    tampered = stored[:5] + bytes([stored[5] ^ 0x01]) + stored[6:]
    assert attacker.remove(physical, True) == 0
    assert save(attacker, physical, tampered, (len(tampered),)) == 0

    assert load(victim, key)[0] == SEAL_MISMATCH
    assert victim.failures.refused == 1
    assert attacker.batch_is_exist([physical]) == [0]

    assert save(victim, key, GOOD) == 0
    assert load(victim, key) == (128, GOOD)


def test_sealed_an_object_without_a_seal_under_the_victims_key_is_refused_and_removed(
    attacker: Client, victim_client: Client
) -> None:
    # Unkeyed (kvpolicy_keyed_namespaces: false) the attacker computes the key; its object lacks the seal.
    key = logical_key()
    assert save(attacker, key, POISON) == 0
    victim = ProtectedStore(victim_client, Keyring(Namespaces(SECRET, keyed=False, sealed=True)))

    code, content = load(victim, key)

    assert code == SEAL_MISMATCH and POISON not in content
    assert attacker.batch_is_exist([key]) == [0]
    assert save(victim, key, GOOD) == 0
    assert load(victim, key) == (128, GOOD)
