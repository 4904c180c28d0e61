"""End to end: a shared store an attacker writes to, with and without kvpolicy's trust options.

A real Mooncake master and segment holder, TP=1 engines in fresh processes (about 20 s each on 2 cores)
and, in this test process, an attacker: a plain Mooncake client on the same master, knowing what anyone
knows (the prompt it guesses, the public key contract a router reads, vLLM's public hash seed) and not the
deployment's secret. Each scenario has its own ``cache_prefix``, so their keys never meet.

- **No option**: the attacker computes the prompt's keys and pre-writes garbage of the right size; the
  victim's lookup hits it, loads it, and serves other tokens than cold (the corruption, shown).
- **Keyed namespaces** (``kvpolicy_secret``): the same pre-written garbage is never read (a miss, tokens
  equal cold), and a second engine with the same secret hits what the first stored.
- **Verified objects** (``kvpolicy_verify_objects``, keys left readable): the attacker knows the keys and
  overwrites every stored object with one byte flipped; the next engine refuses each (one warning per
  key), recomputes (tokens equal cold) and stores good objects in their place.
- **Tenants** (vLLM's ``cache_salt``, no option): requests salted differently share no object; the same
  salt hits; the keys are the salted block hashes an attacker who knows the salt computes.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")

from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.harness.e2e import DEFAULT_BLOCK_SIZE, EngineResult, fixed_prompt, serve_once  # noqa: E402
from kvpolicy.harness.tinymodel import make_tiny_llama  # noqa: E402
from kvpolicy.language.keys import chunk_key  # noqa: E402
from kvpolicy.mooncake import MooncakeMaster, store_client  # noqa: E402

PROMPT = fixed_prompt(109)
MAX_TOKENS = 8
LOGPROBS = 5
LOGPROB_TOLERANCE = 1e-4
"""Recomputed vs cold at the same TP: the same kernels on the same tokens (observed 0.0)."""
SECRET_ENV = "KVPOLICY_E2E_STORE_SECRET"
SECRET = {SECRET_ENV: os.urandom(32).hex()}
REFUSAL = "kvpolicy: refused a store object that failed verification"


def prompt_block_hashes(cache_salt: str | None = None) -> list[str]:
    """What the attacker computes from the prompt alone: vLLM's block hashes of its full blocks, from the
    public seed, with the engine's default hash (sha256), one per chunk (a chunk is one block here). A
    request's ``cache_salt`` enters the first block's extra keys, as vLLM's ``generate_block_hash_extra_keys``
    puts it there."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    hashes, parent = [], None
    for start in range(0, len(PROMPT) - DEFAULT_BLOCK_SIZE + 1, DEFAULT_BLOCK_SIZE):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, PROMPT[start : start + DEFAULT_BLOCK_SIZE], extra)
        hashes.append(bytes(parent).hex())
    return hashes


def settings(cache_prefix: str, tmp_path: Path, **trust: Any) -> dict[str, Any]:
    keys_json = tmp_path / f"{cache_prefix}.keys.json"
    return KVPolicySettings(kvpolicy="default", kvpolicy_keys_json=keys_json, **trust).kv_transfer_config(
        upstream_extra={"cache_prefix": cache_prefix}
    )


def serve(model: Path, config: dict[str, Any], store_config: Path, **options: Any) -> EngineResult:
    return serve_once(
        model, PROMPT, tp_size=1, kv_transfer_config=config, mooncake_config_path=store_config,
        max_tokens=MAX_TOKENS, logprobs=LOGPROBS, **options,
    )


def keys_of(contract_path: Path, cache_prefix: str, reference_prefix: str, cache_salt: str | None = None) -> list[str]:
    """The prompt's chunk keys under ``cache_prefix``, from the key contract an instance published under
    ``reference_prefix`` (what routers read; the prefix is its first field), for requests salted ``cache_salt``."""
    contract = json.loads(contract_path.read_text())
    assert contract["chunk_key"]["chunk_hash"] == "block-hash-hex"
    (group,) = contract["groups"]
    (prefix,) = group["lookup_prefixes"]
    assert prefix.startswith(f"{reference_prefix}@")
    namespace = f"{cache_prefix}@{prefix.removeprefix(f'{reference_prefix}@')}"
    return [chunk_key(namespace, block_hash) for block_hash in prompt_block_hashes(cache_salt)]


@pytest.fixture(scope="module")
def attacker(e2e_master: MooncakeMaster) -> Iterator[Any]:
    with store_client(e2e_master.client_config()) as client:
        yield client


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("poisoned") / "llama", num_kv_heads=1)


@pytest.fixture(scope="module")
def reference(model: Path, e2e_store_config: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[EngineResult, Path]:
    """A cold engine without any option, publishing its key contract: the cold tokens, and what the attacker reads."""
    directory = tmp_path_factory.mktemp("reference")
    cold = serve(model, settings("reference", directory), e2e_store_config)
    assert cold.num_cached_tokens == 0
    return cold, directory / "reference.keys.json"


@pytest.fixture(scope="module")
def object_size(reference: tuple[EngineResult, Path], attacker: Any) -> int:
    """The size of one of the prompt's objects, asked of the master by the attacker. That the keys it
    computed from the prompt exist is the proof that it computes the real keys."""
    _, contract = reference
    keys = keys_of(contract, "reference", "reference")
    assert list(attacker.batch_is_exist(keys)) == [1] * len(keys)
    sizes = {int(attacker.get_size(key)) for key in keys}
    (size,) = sizes
    assert size > 0
    return size


def test_without_protection_an_attackers_pre_written_objects_are_served(
    model: Path, e2e_store_config: Path, reference: tuple[EngineResult, Path], attacker: Any, object_size: int,
    tmp_path: Path,
) -> None:
    cold, contract = reference
    for key in keys_of(contract, "open", "reference"):
        assert attacker.put(key, os.urandom(object_size)) == 0
    victim = serve(model, settings("open", tmp_path), e2e_store_config)
    assert victim.num_cached_tokens == len(prompt_block_hashes()) * DEFAULT_BLOCK_SIZE  # it loaded the garbage
    assert victim.tokens != cold.tokens or victim.max_logprob_diff(cold) > 1.0


def test_keyed_namespaces_leave_an_attackers_pre_written_objects_unread(
    model: Path, e2e_store_config: Path, reference: tuple[EngineResult, Path], attacker: Any, object_size: int,
    tmp_path: Path,
) -> None:
    cold, contract = reference
    guessed = keys_of(contract, "keyed", "reference")
    garbage = {key: os.urandom(object_size) for key in guessed}
    for key, value in garbage.items():
        assert attacker.put(key, value) == 0
    config = settings("keyed", tmp_path, kvpolicy_secret=f"env:{SECRET_ENV}")
    first = serve(model, config, e2e_store_config, extra_env=SECRET)
    assert first.num_cached_tokens == 0  # the guessed keys are not the keyed ones
    assert first.tokens == cold.tokens and first.max_logprob_diff(cold) <= LOGPROB_TOLERANCE
    assert all(attacker.get(key) == value for key, value in garbage.items())  # its objects stayed, unused
    published = json.loads((tmp_path / "keyed.keys.json").read_text())
    assert published["chunk_key"]["chunk_hash"] == "keyed-hmac-hex"
    second = serve(model, config, e2e_store_config, extra_env=SECRET)  # the same secret: one fleet, one cache
    assert second.num_cached_tokens == len(guessed) * DEFAULT_BLOCK_SIZE
    assert second.tokens == cold.tokens and second.max_logprob_diff(cold) <= LOGPROB_TOLERANCE


def test_verified_objects_refuse_a_tampered_object_and_recompute_it(
    model: Path, e2e_store_config: Path, reference: tuple[EngineResult, Path], attacker: Any, object_size: int,
    tmp_path: Path,
) -> None:
    cold, contract = reference
    config = settings("sealed", tmp_path, kvpolicy_secret=f"env:{SECRET_ENV}", kvpolicy_verify_objects=True,
                      kvpolicy_keyed_namespaces=False)
    writer = serve(model, config, e2e_store_config, extra_env=SECRET)
    assert writer.num_cached_tokens == 0
    keys = keys_of(contract, "sealed", "reference")  # readable keys: the attacker knows them
    tampered = {}
    for key in keys:
        stored = bytes(attacker.get(key))
        assert len(stored) == object_size + 32  # the object and its seal
        flipped = bytearray(stored)
        flipped[len(flipped) // 3] ^= 0x01
        tampered[key] = bytes(flipped)
        assert attacker.remove(key, True) == 0 and attacker.put(key, tampered[key]) == 0
    reader = serve(model, config, e2e_store_config, extra_env=SECRET)
    assert reader.tokens == cold.tokens and reader.max_logprob_diff(cold) <= LOGPROB_TOLERANCE
    log = reader.stdout + reader.stderr  # vLLM's log handler writes to stdout
    refusals = [line for line in log.splitlines() if REFUSAL in line]
    assert len(refusals) == len(keys), log[-3000:]  # one per key, each logged once
    assert all(bytes(attacker.get(key)) != value for key, value in tampered.items())  # removed, stored again


def test_requests_with_different_cache_salts_share_no_object_and_the_same_salt_hits(
    model: Path, e2e_store_config: Path, reference: tuple[EngineResult, Path], attacker: Any, tmp_path: Path
) -> None:
    # Tenants apart with no kvpolicy option: vLLM's cache_salt enters the block hashes the keys end in.
    cold, contract = reference
    config = settings("tenants", tmp_path)
    tenant_a = serve(model, config, e2e_store_config, cache_salt="tenant-a")
    assert tenant_a.num_cached_tokens == 0
    assert tenant_a.tokens == cold.tokens and tenant_a.max_logprob_diff(cold) <= LOGPROB_TOLERANCE
    salted, unsalted = keys_of(contract, "tenants", "reference", "tenant-a"), keys_of(contract, "tenants", "reference")
    assert (list(attacker.batch_is_exist(salted)), list(attacker.batch_is_exist(unsalted))) == (
        [1] * len(salted), [0] * len(unsalted)
    )
    tenant_b = serve(model, config, e2e_store_config, cache_salt="tenant-b")
    assert tenant_b.num_cached_tokens == 0  # the same prompt, another salt: nothing of tenant A's is read
    assert tenant_b.tokens == cold.tokens and tenant_b.max_logprob_diff(cold) <= LOGPROB_TOLERANCE
    again = serve(model, config, e2e_store_config, cache_salt="tenant-a")
    assert again.num_cached_tokens == len(salted) * DEFAULT_BLOCK_SIZE
    assert again.tokens == cold.tokens and again.max_logprob_diff(cold) <= LOGPROB_TOLERANCE
