"""A fleet across hosts: vLLM servers on two network hosts share a Mooncake store whose master and
memory sit on three others, all network namespaces this module makes (addresses that exist only inside
them). Every completion is compared with the cold one: zero wrong tokens under every fault.

The tests run in order on one fleet (servers take a minute to start on 2 cores): A (TP=2) stores
prompts cold; B (TP=2) on another host reuses them (both ``kv_load_failure_policy: recompute``); a server
with another plan loads nothing of them; a segment host dies while B loads; the master restarts; A is
killed while it saves; then 8 concurrent clients load B.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (pip install 'kvpolicy[cpu]')")
require("mooncake.store")

from kvpolicy.harness.e2e import DEFAULT_BLOCK_SIZE, fixed_prompt  # noqa: E402
from kvpolicy.harness.fleet.hosts import HostFleet, kv_transfer_config  # noqa: E402
from kvpolicy.harness.fleet.load import run_load, shared_prefix_prompts  # noqa: E402
from kvpolicy.harness.fleet.netns import NetnsUnavailable, require_netns  # noqa: E402
from kvpolicy.harness.server import Completion, OpenAIServer, metric_value, wait_until  # noqa: E402
from kvpolicy.harness.tinymodel import make_tiny_llama  # noqa: E402
from kvpolicy.mooncake import MasterCounters, delta  # noqa: E402

TP_SIZE = 2
PROMPT_TOKENS = 200
FULL_CHUNK_TOKENS = PROMPT_TOKENS // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
LOGPROB_TOLERANCE = 1e-4
CLIENT_TTL_S = 120
"""Seconds the master keeps a segment holder without a heartbeat. These machines are VMs that the host
freezes whole while both TP 2 servers load their 2 cores (docs/known-limits.md says for how long). The
monotonic clock runs on through a freeze, so on waking the master finds every holder's heartbeat stale:
with Mooncake's default (10 s) it dropped both holders, and every object, mid-test. 120 s, like the
other test masters, rides those freezes out; the segment host killed below is dropped within it."""
# Prefix caching off: every prompt token a server does not compute came from the Mooncake store.
SERVER_ARGS = ("--no-enable-prefix-caching", "--enable-prompt-tokens-details")


def prompts(first_seed: int, count: int = 3) -> list[list[int]]:
    return [fixed_prompt(PROMPT_TOKENS, seed=seed) for seed in range(first_seed, first_seed + count)]


REUSED, LOST, AFTER_RESTART, SAVING = prompts(100), prompts(200, 4), prompts(300), prompts(400)


def assert_same(warm: list[Completion], cold: list[Completion]) -> None:
    assert [completion.tokens for completion in warm] == [completion.tokens for completion in cold]
    worst = max(abs(a - b) for w, c in zip(warm, cold, strict=True) for a, b in zip(w.logprobs, c.logprobs, strict=True))
    assert worst <= LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostFleet]:
    try:
        require_netns()
    except NetnsUnavailable as missing:
        unavailable(f"network namespaces: {missing}")
    with HostFleet(tmp_path_factory.mktemp("fleet"), client_ttl_s=CLIENT_TTL_S) as made:
        yield made


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One KV head at TP 2: both ranks hold the same bytes, so each chunk is one object in the store.
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama", num_kv_heads=1)


@pytest.fixture(scope="module")
def server_a(fleet: HostFleet, model: Path) -> OpenAIServer:
    # Both servers recompute what the store fails to load: the fleet's faults must never fail a request.
    return fleet.server(
        "vllma", model, tp_size=TP_SIZE, kv_transfer_config=kv_transfer_config(load_failure="recompute"),
        extra_args=SERVER_ARGS,
    )


@pytest.fixture(scope="module")
def server_b(fleet: HostFleet, model: Path, server_a: OpenAIServer) -> OpenAIServer:
    return fleet.server(
        "vllmb", model, tp_size=TP_SIZE, kv_transfer_config=kv_transfer_config(load_failure="recompute"),
        extra_args=SERVER_ARGS,
    )


def serve_cold(
    fleet: HostFleet, server: OpenAIServer, batch: list[list[int]], *, chunks: int | None = None, timeout: float = 60
) -> tuple[list[Completion], bool]:
    """Serve ``batch`` (prompts sharing no chunk, unless ``chunks`` says how many distinct ones) cold on
    ``server``; also whether the store then took every full chunk of it within ``timeout`` seconds."""
    before = fleet.counters()
    cold = [server.complete(prompt) for prompt in batch]
    if chunks is None:
        assert all(completion.cached_tokens == 0 for completion in cold)
    return cold, stored_since(fleet, before, chunks if chunks is not None else full_chunks(batch), timeout=timeout)


def full_chunks(batch: list[list[int]]) -> int:
    """Full chunks of ``batch``, for prompts sharing none."""
    return len(batch) * FULL_CHUNK_TOKENS // DEFAULT_BLOCK_SIZE


def stored_since(fleet: HostFleet, before: MasterCounters, chunks: int, *, timeout: float) -> bool:
    """Whether the store wrote ``chunks`` objects since ``before`` within ``timeout`` seconds."""
    return wait_until(lambda: delta(before, fleet.counters()).objects_written >= chunks, timeout=timeout)


def store_cold(
    fleet: HostFleet, server: OpenAIServer, batch: list[list[int]], *, chunks: int | None = None, attempts: int = 3
) -> list[Completion]:
    """:func:`serve_cold`, after which the store holds every full chunk of ``batch``. A put the store
    failed (a master RPC timed out across a VM freeze) is not retried by vLLM, so the batch is served
    again, up to ``attempts`` times in all, until the store has them all: the server loads what is
    there and puts what is not. The cold answers are the first serve's."""
    before = fleet.counters()
    cold, stored = serve_cold(fleet, server, batch, chunks=chunks)
    for _ in range(attempts - 1):
        if stored:
            break
        assert_same([server.complete(prompt) for prompt in batch], cold)
        stored = stored_since(fleet, before, chunks if chunks is not None else full_chunks(batch), timeout=60)
    assert stored, f"the store did not take the cold server's chunks in {attempts} serves: {fleet.describe_store()}"
    return cold


def wait_for_reuse(fleet: HostFleet, writer: OpenAIServer, reader: OpenAIServer, *, first_seed: int, timeout: float) -> float:
    """Seconds until the fleet reuses again after a fault: fresh prompts ``writer`` serves cold, then
    ``reader`` loads in full, twice in a row (Mooncake clients reconnect to a restarted master at their
    own pace). Every answer meanwhile must be right; fails after ``timeout`` seconds."""
    started = time.monotonic()
    seed, in_a_row = first_seed, 0
    while in_a_row < 2:
        assert time.monotonic() - started < timeout, f"no reuse across hosts {timeout:g} s after the fault"
        probe = fixed_prompt(PROMPT_TOKENS, seed=seed)
        seed += 1
        (cold,), _ = serve_cold(fleet, writer, [probe], timeout=20)
        warm = reader.complete(probe)
        assert_same([warm], [cold])
        in_a_row = in_a_row + 1 if warm.cached_tokens == FULL_CHUNK_TOKENS else 0
    return time.monotonic() - started


@pytest.fixture(scope="module")
def reused_cold(fleet: HostFleet, server_a: OpenAIServer) -> list[Completion]:
    return store_cold(fleet, server_a, REUSED)


def test_the_fleet_runs_on_private_addresses_of_separate_hosts(fleet: HostFleet, server_a: OpenAIServer) -> None:
    addresses = {fleet[name].address for name in ("master", "seg1", "seg2", "vllma", "vllmb", "client")}
    assert len(addresses) == 6
    assert all(ipaddress.ip_address(address) in fleet.network.subnet for address in addresses)
    assert not any(ipaddress.ip_address(address).is_loopback for address in addresses)
    assert fleet.master is not None and fleet.master.rpc_address.startswith(fleet["master"].address + ":")
    config = fleet.store_config("vllma").read_text()
    assert fleet["vllma"].address in config and "127.0.0.1" not in config and "0.0.0.0" not in config
    assert server_a.url.startswith(f"http://{fleet['vllma'].address}:")


def test_a_server_on_another_host_answers_from_the_store_as_the_cold_one_did(
    fleet: HostFleet, server_b: OpenAIServer, reused_cold: list[Completion]
) -> None:
    before = fleet.counters()
    warm = [server_b.complete(prompt) for prompt in REUSED]
    assert_same(warm, reused_cold)
    assert [completion.cached_tokens for completion in warm] == [FULL_CHUNK_TOKENS] * len(REUSED), fleet.describe_store()
    # The hits were reads from the store (every chunk's object read at least once).
    assert delta(before, fleet.counters()).objects_read >= len(REUSED) * FULL_CHUNK_TOKENS // DEFAULT_BLOCK_SIZE


def test_a_server_with_another_plan_never_loads_those_objects(
    fleet: HostFleet, model: Path, server_b: OpenAIServer, reused_cold: list[Completion]
) -> None:
    # Same store, same model, another policy (at TP 1, which starts faster): another plan, so other keys.
    # (Under `default`, TP 1 would hit here, rightly: one KV head makes TP 1's bytes those of each TP 2 rank.)
    before = fleet.counters()
    other = fleet.server(
        "vllmb", model, tp_size=1, kv_transfer_config=kv_transfer_config(policy="vllm-compat"), extra_args=SERVER_ARGS
    )
    try:
        answered = [other.complete(prompt) for prompt in REUSED]
    finally:
        other.stop()
    assert [completion.cached_tokens for completion in answered] == [0] * len(REUSED)
    assert delta(before, fleet.counters()).objects_read == 0
    assert [completion.tokens for completion in answered] == [completion.tokens for completion in reused_cold]


def test_a_segment_host_lost_while_b_loads_makes_b_recompute_with_no_wrong_token(
    fleet: HostFleet, server_a: OpenAIServer, server_b: OpenAIServer
) -> None:
    cold = store_cold(fleet, server_a, LOST)
    stored = fleet.counters().key_count
    # The master still lists seg1's objects until its heartbeat lapses: B's lookups hit, its reads of
    # seg1 fail, and B recomputes those blocks (and stores them again, on seg2).
    fleet["seg1"].kill_all()
    log_before = len(server_b.log)
    started = time.monotonic()
    during = [server_b.complete(prompt) for prompt in LOST[:2]]
    took = time.monotonic() - started
    assert_same(during, cold[:2])
    # A failed read is remembered: the request's next lookup stops short of those chunks and vLLM
    # computes them, instead of finding the same dead objects again until the master forgets seg1.
    rescheduled = server_b.log[log_before:].count("Recovered from KV load failure")
    print(f"seg1 lost: {len(during)} requests in {took:.1f} s, rescheduled {rescheduled} times after failed reads")
    assert rescheduled <= len(during)
    # Once the master has dropped seg1, its objects are plain misses, and seg2's are still hits.
    assert wait_until(lambda: fleet.counters().key_count < stored, timeout=4 * CLIENT_TTL_S)
    after = [server_b.complete(prompt) for prompt in LOST[2:]]
    assert_same(after, cold[2:])
    loaded = sum(completion.cached_tokens or 0 for completion in after)
    print(f"seg1 lost: {stored} -> {fleet.counters().key_count} objects; tokens loaded afterwards {loaded}")
    assert loaded < len(after) * FULL_CHUNK_TOKENS
    fleet.start_segment_host("seg1")


def test_after_a_master_restart_everything_recomputes_and_the_store_fills_again(
    fleet: HostFleet, server_a: OpenAIServer, server_b: OpenAIServer, reused_cold: list[Completion]
) -> None:
    fleet.restart_master()
    assert fleet.counters().key_count == 0
    emptied = [server_b.complete(prompt) for prompt in REUSED]
    assert_same(emptied, reused_cold)
    assert [completion.cached_tokens for completion in emptied] == [0] * len(REUSED)
    # The segment holders remount their memory and the servers' clients find the new master; from
    # then on what A stores is there for B, in full.
    assert wait_until(lambda: fleet.capacity_bytes() == fleet.full_capacity_bytes, timeout=6 * CLIENT_TTL_S)
    recovered_s = wait_for_reuse(fleet, server_a, server_b, first_seed=500, timeout=120)
    print(f"master restart: reuse across hosts again after {recovered_s:.1f} s")
    cold = store_cold(fleet, server_a, AFTER_RESTART)
    warm = [server_b.complete(prompt) for prompt in AFTER_RESTART]
    assert_same(warm, cold)
    assert [completion.cached_tokens for completion in warm] == [FULL_CHUNK_TOKENS] * len(AFTER_RESTART), fleet.describe_store()


def test_eight_concurrent_clients_get_every_completion_right(
    fleet: HostFleet, server_a: OpenAIServer, server_b: OpenAIServer
) -> None:
    batch = shared_prefix_prompts(prefixes=3, variants=3, prefix_tokens=160, suffix_tokens=40)
    # Each prompt's first 5 chunks are its prefix's, the sixth its own.
    references = store_cold(fleet, server_a, batch, chunks=3 * 5 + len(batch))
    report = run_load(server_b, batch, references, clients=8, duration_s=30.0)
    print(
        f"load: {report.requests} requests, {report.errors} errors, {report.mismatches} mismatches, hit rate"
        f" {report.hit_rate:.2f}, p50 {report.percentile(0.5):.2f} s, p99 {report.percentile(0.99):.2f} s"
    )
    assert (report.errors, report.mismatches) == (0, 0)
    assert report.requests >= 8 and report.hit_rate > 0.5, fleet.describe_store()


def test_a_vllm_host_killed_mid_save_leaves_the_other_serving(
    fleet: HostFleet, server_a: OpenAIServer, server_b: OpenAIServer, reused_cold: list[Completion]
) -> None:
    answers: list[object] = []
    senders = [threading.Thread(target=lambda p=p: answers.append(_try(server_a, p))) for p in SAVING]
    for sender in senders:
        sender.start()
    # Killed while it generates (and saves): not before its requests arrived, not after they finished.
    # The running gauge keeps its last value once A is idle, so it is read only while no answer is back.
    def generating() -> bool:
        return not answers and metric_value(server_a.metrics(), "vllm:num_requests_running") >= 1

    started = time.monotonic()
    assert wait_until(generating, timeout=60, interval=0.1), f"A answered before it could be killed: {answers}"
    fleet["vllma"].kill_all()
    print(f"A killed {time.monotonic() - started:.1f} s after its {len(SAVING)} requests were sent")
    for sender in senders:
        sender.join(150)
    assert wait_until(lambda: fleet["vllma"].pids() == [], timeout=10)
    server_a.stop()  # reaps the server process
    # The requests A still had running (300 tokens each) failed at their clients: A was gone.
    assert any(isinstance(answer, Exception) for answer in answers), answers
    # B keeps serving, right: what A saved whole is a hit, what it did not is a miss.
    served = [server_b.complete(prompt) for prompt in REUSED + SAVING]
    assert_same(served[: len(REUSED)], reused_cold)
    assert all(len(completion.tokens) == 8 for completion in served)
    # Only whole chunks are ever loaded: an object A had not finished is not visible.
    assert all((completion.cached_tokens or 0) % DEFAULT_BLOCK_SIZE == 0 for completion in served)


def _try(server: OpenAIServer, prompt: list[int]) -> object:
    try:
        return server.complete(prompt, max_tokens=300, timeout=60)
    except Exception as error:  # noqa: BLE001 - the server is being killed
        return error
