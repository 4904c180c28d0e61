"""A shared store nobody without the deployment's secret can poison: keyed namespaces and sealed objects.

Mooncake authenticates nobody: any client that reaches the master may put, get, probe and remove any key,
and it keeps the first write of a key. vLLM's chunk hashes start from a public seed, so without a secret a
store key is computable from a guessed prompt. This module puts the deployment's secret into the store
traffic, in one wrapper around the Mooncake client (:class:`ProtectedStore`):

- **keyed namespaces**: a key's chunk part (everything after its last ``@``) becomes an HMAC of the whole
  logical key under a key derived from the secret (:meth:`Namespaces.physical`), so a client without the
  secret can neither compute, probe nor pre-write a key; the namespace part stays readable;
- **sealed objects** (verified objects): each stored object carries, after its bytes, an HMAC-SHA256 of its
  physical key and bytes (:data:`SEAL_BYTES` bytes) under another derived key; a load whose seal does not
  match (or is missing: the object's size then differs, and Mooncake refuses the read) reports that key
  failed (:data:`SEAL_MISMATCH`), so vLLM recomputes the blocks (``kv_load_failure_policy: recompute``); the
  object is removed so that the next save can store a good one; each key is logged once.

Rotation: a :class:`Keyring` holds the current secret's :class:`Namespaces` and, for a grace period, the
previous one's. Writes go to the current namespace only; lookups and loads fall back to the previous one.

Pure of vLLM, torch and Mooncake: the store is the ports' (:class:`~kvpolicy.runtime.ports.KVStore`,
``SendStore``, ``ReadStore``), host memory is read through ``ctypes`` at the addresses vLLM's transfer
threads hand over (sealing is for host-resident KV caches; see the trust-boundary page for the GPU path).
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import os
import re
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.documents.settings import EXTRA_CONFIG, KVPolicySettings, SecretSource, SettingsError, StoreProtection
from kvpolicy.language.keys import chunk_key, split_chunk_key

__all__ = [
    "MAX_SECRET_FILE_BYTES",
    "MIN_SECRET_BYTES",
    "SEAL_BYTES",
    "SEAL_MISMATCH",
    "DeploymentSecret",
    "Keyring",
    "Namespaces",
    "ProtectedStore",
    "SealFailures",
    "SecretError",
    "host_memory",
    "keyring_for",
    "read_secret",
]

logger = logging.getLogger("vllm.kvpolicy.runtime.trust")

MIN_SECRET_BYTES = 16
"""A secret shorter than this (128 bits) is refused: it could be guessed."""
MAX_SECRET_FILE_BYTES = 64 * 1024
"""A secret file longer than this is refused unread (bounded memory whatever the path names)."""
SEAL_BYTES = 32
"""Bytes of the seal after a sealed object's bytes (an HMAC-SHA256)."""
SEAL_MISMATCH = -2001
"""The code a sealed read reports for a key whose seal did not verify (vLLM treats any code < 0 as a
failed load; Mooncake's own codes lie between -1 and -1100)."""
MAC_HEX_DIGITS = 32
"""Hex digits of a keyed chunk part (128 bits)."""
_LABEL = b"kvpolicy/trust/v1/"


class SecretError(ValueError):
    """The secret a setting names cannot be used: the message says what is wrong and the fix."""


class DeploymentSecret:
    """The secret's bytes, kept out of every ``repr``, log and document: only :attr:`key_id` (a digest
    that reveals nothing of it) is ever shown."""

    __slots__ = ("_material", "key_id")

    def __init__(self, material: bytes) -> None:
        if len(material) < MIN_SECRET_BYTES:
            raise SecretError(f"is {len(material)} bytes long; a secret needs at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
        self._material = bytes(material)
        self.key_id = self.derive("key-id").hex()[:12]
        """Names the secret in logs and status documents: equal ids, equal secrets."""

    def derive(self, label: str) -> bytes:
        """A key for one use of the secret (domain separation: keys and seals never share a key)."""
        return hmac.digest(self._material, _LABEL + label.encode(), "sha256")

    def __repr__(self) -> str:
        return f"DeploymentSecret(key_id={self.key_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeploymentSecret) and hmac.compare_digest(self._material, other._material)

    def __hash__(self) -> int:
        return hash(self.key_id)


def read_secret(source: SecretSource, *, environ: dict[str, str] | None = None) -> DeploymentSecret:
    """The secret at ``source``; :class:`SecretError` saying what is wrong and the fix (unset, empty, too
    short, a file others may read, not a regular file, too large). One trailing newline is not part of it."""
    if source.kind == "env":
        value = (os.environ if environ is None else environ).get(source.name)
        if value is None:
            raise SecretError(f"{_variable(source.name)} is not set; export it on every host of the deployment")
        return DeploymentSecret(value.encode().removesuffix(b"\n"))
    path = Path(source.name)
    shown = _shown(source.name)
    try:
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise SecretError(f"{shown} is not a regular file; give the path of a file holding the secret")
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecretError(
                    f"{shown} may be read or written by others (mode {stat.S_IMODE(mode):04o}); `chmod 600` it"
                )
            material = handle.read(MAX_SECRET_FILE_BYTES + 1)
    except FileNotFoundError:
        raise SecretError(f"{shown} does not exist; write the secret there (e.g. `openssl rand -hex 32 > FILE`)") from None
    except OSError as error:
        raise SecretError(f"cannot read {shown}: {error.strerror or error}") from None
    if len(material) > MAX_SECRET_FILE_BYTES:
        raise SecretError(f"{shown} is larger than {MAX_SECRET_FILE_BYTES} bytes; a secret file holds one secret")
    return DeploymentSecret(material.removesuffix(b"\n"))


def keyring_for(
    settings: KVPolicySettings, protection: StoreProtection, *, environ: dict[str, str] | None = None,
    clock: Callable[[], float] = time.time,
) -> Keyring | None:
    """The keyring the settings configure (None when they protect nothing); :class:`SettingsError` with
    one located line per secret that cannot be read."""
    if not (protection.keyed or protection.verified):
        return None
    current_source, previous_source = settings.secret_sources
    assert current_source is not None, "KVPolicySettings.parse refuses protection without kvpolicy_secret"
    problems: list[str] = []
    secrets: list[DeploymentSecret | None] = []
    for key, source in (("kvpolicy_secret", current_source), ("kvpolicy_previous_secret", previous_source)):
        if source is None:
            secrets.append(None)
            continue
        try:
            secrets.append(read_secret(source, environ=environ))
        except SecretError as error:
            problems.append(f"{EXTRA_CONFIG}.{key}: error: {error}")
            secrets.append(None)
    if problems:
        raise SettingsError(tuple(problems))
    current, previous = secrets
    assert current is not None
    if previous == current:
        raise SettingsError((
            f"{EXTRA_CONFIG}.kvpolicy_previous_secret: error: holds the same secret as kvpolicy_secret "
            f"(key id {current.key_id}); a rotation needs a new secret",
        ))
    until = settings.kvpolicy_previous_secret_until
    return Keyring(
        Namespaces(current, keyed=protection.keyed, sealed=protection.verified),
        None if previous is None else Namespaces(previous, keyed=protection.keyed, sealed=protection.verified),
        previous_until=None if until is None else until.timestamp(),
        clock=clock,
    )


# --- one secret's namespaces --------------------------------------------------------------------


@dataclass(frozen=True)
class Namespaces:
    """What one secret does to the store traffic: keys keyed or not, objects sealed or not."""

    secret: DeploymentSecret
    keyed: bool
    sealed: bool
    _key_key: bytes = field(init=False, repr=False, compare=False)
    _seal_key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Sealed and unsealed objects differ in size: their keyed keys differ too, so neither finds the other.
        object.__setattr__(self, "_key_key", self.secret.derive("keys/sealed" if self.sealed else "keys/plain"))
        object.__setattr__(self, "_seal_key", self.secret.derive("seal"))

    def physical(self, key: str) -> str:
        """The store key of logical ``key``: unchanged when not keyed; else its namespace (all before the
        last ``@``), ``@``, and the HMAC of the whole logical key (:data:`MAC_HEX_DIGITS` hex digits)."""
        if not self.keyed:
            return key
        namespace, _ = split_chunk_key(key)
        return chunk_key(namespace, hmac.digest(self._key_key, key.encode(), "sha256").hex()[:MAC_HEX_DIGITS])

    def seal(self, physical_key: str, regions: Iterable[memoryview]) -> bytes:
        """The seal of an object: HMAC-SHA256 of its physical key's length and text, then its bytes."""
        encoded = physical_key.encode()
        mac = hmac.new(self._seal_key, len(encoded).to_bytes(4, "big") + encoded, hashlib.sha256)
        for region in regions:
            mac.update(region)
        return mac.digest()


@dataclass(frozen=True)
class Keyring:
    """The current secret's namespaces, and the previous one's while its grace period lasts."""

    current: Namespaces
    previous: Namespaces | None = None
    previous_until: float | None = None
    """Seconds since the epoch after which the previous secret is no longer read; None: while configured."""
    clock: Callable[[], float] = field(default=time.time, compare=False)

    def readable(self) -> tuple[Namespaces, ...]:
        """The namespaces reads try, in order."""
        if self.previous is None or (self.previous_until is not None and self.clock() >= self.previous_until):
            return (self.current,)
        return (self.current, self.previous)

    def describe(self) -> str:
        """What the keyring does, for the start-up log: the options on and the secrets' key ids (never the secrets)."""
        current = self.current
        options = [name for name, on in (("keyed namespaces", current.keyed), ("verified objects", current.sealed)) if on]
        text = f"{' and '.join(options)} with the secret of key id {current.secret.key_id}"
        if self.previous is not None:
            until = "" if self.previous_until is None else f" until {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(self.previous_until))}"
            text += f"; the previous secret (key id {self.previous.secret.key_id}) is read{until}"
        return text

    @property
    def writes_only(self) -> Keyring:
        """This keyring without the previous secret: what the send thread uses (writes never go to it)."""
        return Keyring(self.current, clock=self.clock)


# --- host memory ----------------------------------------------------------------------------------

MemoryView = Callable[[int, int], memoryview]
"""``view(address, size)``: the bytes at a host address, without a copy."""


def host_memory(address: int, size: int) -> memoryview:
    """The ``size`` bytes at host ``address`` (a KV cache region vLLM registered with Mooncake)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class _SealSlots:
    """Host memory for the seals of one batch, registered with the store client when it registers
    buffers (Mooncake: an RDMA transport reads and writes registered memory only). Grows, never shrinks."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._buffers: list[ctypes.Array[ctypes.c_char]] = []
        self._capacity = 0

    def addresses(self, count: int) -> list[int]:
        if count > self._capacity:
            capacity = max(count, 2 * self._capacity, 64)
            buffer = ctypes.create_string_buffer(capacity * SEAL_BYTES)
            register = getattr(self._inner, "register_buffer", None)
            if register is not None:
                if register(ctypes.addressof(buffer), len(buffer)) != 0:
                    raise RuntimeError("the store client refused to register the seal buffer")
                # Unregistered before the memory is freed: Mooncake refuses a region overlapping a registered one.
                weakref.finalize(self, _unregister, self._inner, buffer)
            self._buffers.append(buffer)  # an older buffer stays alive: a transfer may still hold it
            self._capacity = capacity
        base = ctypes.addressof(self._buffers[-1])
        return [base + index * SEAL_BYTES for index in range(count)]


def _unregister(inner: Any, buffer: ctypes.Array[ctypes.c_char]) -> None:
    inner.unregister_buffer(ctypes.addressof(buffer))


class SealFailures:
    """Loads refused because their seal did not verify: counted, and each key logged once (a bounded
    memory of keys logged: the oldest are forgotten first)."""

    def __init__(self, on_refused: Callable[[], None] | None = None, *, limit: int = 65_536) -> None:
        self._lock = threading.Lock()
        self._logged: OrderedDict[str, None] = OrderedDict()
        self._limit = limit
        self._on_refused = on_refused
        self.refused = 0
        """Loads refused so far."""

    def record(self, key: str, reason: str) -> None:
        """One load of logical ``key`` refused: counted (and ``on_refused`` called), logged if first."""
        if self._on_refused is not None:
            self._on_refused()
        with self._lock:
            self.refused += 1
            first = key not in self._logged
            self._logged[key] = None
            self._logged.move_to_end(key)
            while len(self._logged) > self._limit:
                self._logged.popitem(last=False)
        if first:
            logger.warning("kvpolicy: refused a store object that failed verification (%s); recomputing it: %s", reason, key)


# --- the store wrapper ----------------------------------------------------------------------------


class ProtectedStore:
    """A Mooncake client that speaks logical keys and stores physical ones (:class:`Namespaces`):
    every port the run time and vLLM's transfer threads use (``KVStore``, ``SendStore``, ``ReadStore``),
    plus the client calls vLLM makes on the worker's own client, forwarded as they are."""

    def __init__(
        self, inner: Any, keyring: Keyring, *, failures: SealFailures | None = None, memory: MemoryView = host_memory,
    ) -> None:
        self._inner = inner
        self.keyring = keyring
        self.failures = failures if failures is not None else SealFailures()
        self._memory = memory
        self._lock = threading.Lock()
        self._slots = _SealSlots(inner)

    @property
    def inner(self) -> Any:
        return self._inner

    def sibling(self, *, writes_only: bool = False) -> ProtectedStore:
        """Another wrapper of the same client, keyring and failures with its own seal buffers (one per
        transfer thread). ``writes_only``: without the previous secret, for the send thread, whose
        existence checks decide what to write and so must ask the current namespace only."""
        keyring = self.keyring.writes_only if writes_only else self.keyring
        return ProtectedStore(self._inner, keyring, failures=self.failures, memory=self._memory)

    # --- existence and small objects (lookups, audit markers) ----------------------------------------

    def batch_is_exist(self, keys: list[str]) -> Sequence[int]:
        readable = self.keyring.readable()
        answers = list(self._inner.batch_is_exist([readable[0].physical(key) for key in keys]))
        for namespaces in readable[1:]:
            absent = [index for index, answer in enumerate(answers) if answer != 1]
            if not absent:
                break
            found = self._inner.batch_is_exist([namespaces.physical(keys[index]) for index in absent])
            for index, answer in zip(absent, found, strict=True):
                if answer == 1:
                    answers[index] = 1
        return answers

    def put(self, key: str, value: bytes) -> int:
        namespaces = self.keyring.current
        physical = namespaces.physical(key)
        if namespaces.sealed:
            value = bytes(value) + namespaces.seal(physical, (memoryview(value),))
        return int(self._inner.put(physical, value))

    def get(self, key: str) -> bytes:
        for namespaces in self.keyring.readable():
            physical = namespaces.physical(key)
            value = bytes(self._inner.get(physical))
            if not value:
                continue
            if not namespaces.sealed:
                return value
            body, seal = value[:-SEAL_BYTES], value[-SEAL_BYTES:]
            if len(value) > SEAL_BYTES and hmac.compare_digest(seal, namespaces.seal(physical, (memoryview(body),))):
                return body
            self.failures.record(key, "its seal does not match")
            self._inner.remove(physical, True)  # as in batch_get_into_multi_buffers: else never replaced
        return b""

    def remove(self, key: str, force: bool = False) -> int:
        codes = [int(self._inner.remove(namespaces.physical(key), force)) for namespaces in self.keyring.readable()]
        return codes[0]

    # --- chunks (vLLM's transfer threads) -----------------------------------------------------------

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any = None
    ) -> Sequence[int]:
        namespaces = self.keyring.current
        physical = [namespaces.physical(key) for key in keys]
        if not namespaces.sealed:
            return self._put(physical, addrs, sizes, config)
        with self._lock:
            slots = self._slots.addresses(len(keys))
            for index, key in enumerate(physical):
                seal = namespaces.seal(key, self._regions(addrs[index], sizes[index]))
                ctypes.memmove(slots[index], seal, SEAL_BYTES)
            return self._put(
                physical,
                [[*regions, slot] for regions, slot in zip(addrs, slots, strict=True)],
                [[*lengths, SEAL_BYTES] for lengths in sizes],
                config,
            )

    def _put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], config: Any) -> Sequence[int]:
        if config is None:
            return list(self._inner.batch_put_from_multi_buffers(keys, addrs, sizes))
        return list(self._inner.batch_put_from_multi_buffers(keys, addrs, sizes, config))

    def batch_get_into_multi_buffers(self, keys: list[str], *args: Any) -> Sequence[int]:
        addrs, sizes, *rest = args
        codes: list[int] = [-1] * len(keys)
        pending = list(range(len(keys)))
        refused: list[tuple[int, str]] = []
        for namespaces in self.keyring.readable():
            if not pending:
                break
            answers = self._get(namespaces, [keys[index] for index in pending],
                                [addrs[index] for index in pending], [sizes[index] for index in pending], rest)
            for index, answer in zip(pending, answers, strict=True):
                codes[index] = answer
                if answer == SEAL_MISMATCH:
                    refused.append((index, namespaces.physical(keys[index])))
            pending = [index for index in pending if codes[index] < 0]
        for index, physical in refused:
            self.failures.record(keys[index], "it carries no seal that matches its key and bytes")
            # Mooncake keeps the first write of a key: a bad object left there would be refused on every
            # load (and, under the current secret, never replaced by a save) until evicted.
            self._inner.remove(physical, True)
        return codes

    def _get(self, namespaces: Namespaces, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], rest: list[Any]) -> list[int]:
        physical = [namespaces.physical(key) for key in keys]
        if not namespaces.sealed:
            return list(self._inner.batch_get_into_multi_buffers(physical, addrs, sizes, *rest))
        with self._lock:
            slots = self._slots.addresses(len(keys))
            if keys:  # a seal left from an earlier read must never pass for this one's
                ctypes.memset(slots[0], 0, len(keys) * SEAL_BYTES)
            answers = list(self._inner.batch_get_into_multi_buffers(
                physical,
                [[*regions, slot] for regions, slot in zip(addrs, slots, strict=True)],
                [[*lengths, SEAL_BYTES] for lengths in sizes],
                *rest,
            ))
            for index, answer in enumerate(answers):
                if answer < 0:
                    if self._unsealed(physical[index], sum(sizes[index])):
                        answers[index] = SEAL_MISMATCH
                    continue
                expected = namespaces.seal(physical[index], self._regions(addrs[index], sizes[index]))
                if not hmac.compare_digest(expected, bytes(self._memory(slots[index], SEAL_BYTES))):
                    answers[index] = SEAL_MISMATCH
                else:
                    answers[index] = answer - SEAL_BYTES
            return answers

    def _unsealed(self, physical: str, length: int) -> bool:
        """The object at ``physical`` exists but is not ``length`` bytes and a seal: written without one
        (or by someone else). Mooncake refuses such a read for its size; without this check the object
        would stay, and its key's saves would keep being skipped as present."""
        get_size = getattr(self._inner, "get_size", None)
        if get_size is None:
            return False
        size = int(get_size(physical))
        return size >= 0 and size != length + SEAL_BYTES

    def batch_get_replica_desc(self, keys: list[str]) -> Any:
        physical = [self.keyring.current.physical(key) for key in keys]
        found = self._inner.batch_get_replica_desc(physical)
        if isinstance(found, dict):
            logical = dict(zip(physical, keys, strict=True))
            return {logical.get(key, key): value for key, value in found.items()}
        return found

    def _regions(self, addresses: Sequence[int], lengths: Sequence[int]) -> list[memoryview]:
        return [self._memory(address, length) for address, length in zip(addresses, lengths, strict=True)]

    # --- what vLLM calls on the worker's own client, unchanged ----------------------------------------

    def register_buffer(self, address: int, length: int) -> int:
        return int(self._inner.register_buffer(address, length))

    def unregister_buffer(self, address: int) -> int:
        return int(self._inner.unregister_buffer(address))

    def remove_all(self, force: bool = False) -> int:
        return int(self._inner.remove_all(force))

    def close(self) -> Any:
        return self._inner.close()


_CONVENTIONAL_VARIABLE = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")
_HEX_DIGITS = frozenset("0123456789ABCDEF")


def _variable(name: str) -> str:
    # A secret pasted where its variable's name belongs ('env:<secret>') must not reach a log; names are
    # shown only when they look like one (upper case, not all hex digits), which secrets rarely do.
    if _CONVENTIONAL_VARIABLE.fullmatch(name) and not set(name) <= _HEX_DIGITS:
        return f"the environment variable {name}"
    return "the environment variable it names (not shown: the name does not look like one and may be the secret)"


def _shown(value: str, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
