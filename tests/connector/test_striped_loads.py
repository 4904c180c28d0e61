"""``load: striped``: each replicated object leaves the store once per replica set, every rank still
ends with every block byte for byte, and a failed read anywhere makes vLLM recompute instead of using
wrong bytes.

Ranks are the production ``KVPolicyStoreWorker`` (the simulation), reading through vLLM's own receive
threads from a real Mooncake master; objects read are the master's own counters. The second half
drives :class:`StripedReadStore` alone (``striped_rig``: KV caches of one tensor per layer, a real
Mooncake client per rank) to count what a load copies and to run it over gloo between processes."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from conftest import require
from striped_rig import Rig, process_rank, register, unregister
from torch.utils._python_dispatch import TorchDispatchMode

require("vllm")
require("mooncake.store")

from kvpolicy.device.striped import StripedReadStore, allocate_staging  # noqa: E402
from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.language.models import LoadMode, Policy  # noqa: E402
from kvpolicy.mooncake import MasterCounters  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.runtime.collective import ThreadExchange  # noqa: E402
from kvpolicy.runtime.ports import PeerExchange, Transfer  # noqa: E402
from kvpolicy.runtime.read_failures import RecordingReadStore  # noqa: E402
from kvpolicy.runtime.striping import StripeCounts  # noqa: E402
from kvpolicy.sim import ARCHETYPES, Fleet, Instance  # noqa: E402

NUM_TOKENS = 256
CASES = [
    pytest.param(name, tp, id=f"{name}-tp{tp}")
    for name in ARCHETYPES
    for tp in (2, 4)
]


def striped(name: str = "default") -> Policy:
    return load_policy(name).model_copy(update={"load": LoadMode.STRIPED})


def objects_read(master: MooncakeMaster, instance: Instance, lookup: Any) -> int:
    before = MasterCounters.read(master.metrics_url)
    instance.load(lookup)
    return MasterCounters.read(master.metrics_url).objects_read - before.objects_read


def loaded(fleet: Fleet, policy: Policy, tp_size: int, master: MooncakeMaster) -> tuple[Instance, Any, int]:
    """A cold save under ``policy``, then a warm instance's lookup and load: (warm, lookup, objects read)."""
    fleet.instance(policy, tp_size, name=f"cold-{policy.load.value}").save()
    warm = fleet.instance(policy, tp_size, name=f"warm-{policy.load.value}")
    lookup = warm.lookup()
    assert lookup.hit_length > 0 and not warm.last_lookup_gated
    return warm, lookup, objects_read(master, warm, lookup)


def receive_store(thread: Any) -> Any:
    """The receive thread's striping view of the store if it has one, else its store as the worker left
    it, under the read-failure recorder every receive thread gets."""
    store = thread.store
    return store.inner if isinstance(store, RecordingReadStore) else store


@pytest.mark.parametrize(("archetype", "tp_size"), CASES)
def test_a_striped_load_reads_each_object_once_and_every_rank_gets_every_block(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, tp_size: int
) -> None:
    with Fleet(archetype, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        per_rank, per_rank_lookup, read_per_rank = loaded(fleet, load_policy("default"), tp_size, mooncake_master)
        assert per_rank.verdict(per_rank_lookup).correct
        fleet.remove_objects()
        warm, lookup, read_striped = loaded(fleet, striped(), tp_size, mooncake_master)
        verdict = warm.verdict(lookup)
        assert verdict.correct and verdict.used_tokens == lookup.hit_length
        # Per rank, a group replicated over f ranks is read f times; striped, once: the unique objects.
        factors = warm.plan.factors
        assert lookup.hit_length == per_rank_lookup.hit_length
        stores = [receive_store(thread) for rank in warm.ranks for thread in rank.worker.kv_recv_threads]
        # Without a replica set there is nothing to stripe: the receive threads keep their store as it was.
        assert all(isinstance(store, StripedReadStore) for store in stores) == (max(factors) > 1)
        received = sum(store.counts.keys_received for store in stores if isinstance(store, StripedReadStore))
        assert read_striped == read_per_rank - received
        if max(factors) > 1:
            assert received > 0 and read_striped < read_per_rank
        else:
            assert received == 0 and read_striped == read_per_rank


def test_objects_read_striped_equal_the_unique_objects_of_the_plan(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """MLA at tp 4: one namespace, 15 chunks loaded (a 256-token hit of 240 tokens): 15 objects, not 60."""
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        _, lookup, read = loaded(fleet, striped(), 4, mooncake_master)
        assert lookup.hit_length == 240
        assert read == 240 // 16
        fleet.remove_objects()
        _, _, read_per_rank = loaded(fleet, load_policy("default"), 4, mooncake_master)
        assert read_per_rank == 4 * 240 // 16


def test_a_read_that_fails_on_one_rank_makes_the_ranks_it_was_read_for_recompute(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """The objects of rank 1's stripe vanish between lookup and load (evicted, their segment lost):
    rank 1's gets fail, and so do rank 0's chunks that rank 1 was to send it."""
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(striped(), 2, name="cold").save()
        warm = fleet.instance(striped(), 2, name="warm")
        lookup = warm.lookup()
        loaded_keys = sorted(warm.key(0, 0, chunk) for chunk in range(lookup.hit_length // 16))
        for key in loaded_keys[1::2]:  # rank 1's stripe: odd positions in key order
            assert fleet.client.remove(key, True) == 0
        loads = warm.load(lookup)
        verdict = warm.verdict(lookup)
        assert verdict.correct  # no wrong byte is used
        assert all(load.failed or load.invalid_block_ids for load in loads)  # both ranks report it
        assert verdict.used_tokens < lookup.hit_length


def test_a_dead_exchange_fails_the_load_instead_of_hanging(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(striped(), 2, name="cold").save()
        warm = fleet.instance(striped(), 2, name="warm", timeout=5.0)
        lookup = warm.lookup()
        # Only rank 0 loads: its exchange partner never arrives.
        (load,) = warm.load(lookup, ranks=[0])
        assert load.drained and (load.failed or load.invalid_block_ids)
        # After a failed exchange a rank reads every chunk itself; its peer's next exchange fails in turn
        # (it finds no partner), and from then on every load is whole instead of failing its stripes.
        warm.load(lookup)
        assert warm.verdict(lookup).correct
        warm.load(lookup)
        verdict = warm.verdict(lookup)
        assert verdict.correct and verdict.used_tokens == lookup.hit_length
        stores = [receive_store(thread) for rank in warm.ranks for thread in rank.worker.kv_recv_threads]
        assert all(isinstance(store, StripedReadStore) and store.broken for store in stores)


def test_more_than_one_receive_thread_falls_back_to_reads_on_every_rank(
    mooncake_master: MooncakeMaster, clients: ClientPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_MOONCAKE_LOAD_RECV_THREADS", "2")
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        warm, lookup, read = loaded(fleet, striped(), 2, mooncake_master)
        assert not any(isinstance(receive_store(t), StripedReadStore) for r in warm.ranks for t in r.worker.kv_recv_threads)
        assert read == 2 * lookup.hit_length // 16
        assert warm.verdict(lookup).correct


def test_under_torchcomms_striping_falls_back_to_reads_on_every_rank_instead_of_breaking_start_up(
    mooncake_master: MooncakeMaster, clients: ClientPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TorchComms (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``) makes a new group a split of the world's, which
    refuses the TP-local group creation striping needs (``use_local_synchronization``) at start-up."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_USE_TORCHCOMMS", "1")
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        warm, lookup, read = loaded(fleet, striped(), 2, mooncake_master)
        assert not any(isinstance(receive_store(t), StripedReadStore) for r in warm.ranks for t in r.worker.kv_recv_threads)
        assert read == 2 * lookup.hit_length // 16
        assert warm.verdict(lookup).correct


def test_a_plan_carries_the_policys_load_mode_into_its_json(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    from kvpolicy.documents.report import plan_to_json

    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        assert plan_to_json(fleet.instance(striped(), 2).plan)["load"] == "striped"
        assert plan_to_json(fleet.instance(load_policy("default"), 2).plan)["load"] == "per-rank"


def test_striping_does_not_change_the_fingerprint(mooncake_master: MooncakeMaster, clients: ClientPool) -> None:
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        assert fleet.instance(striped(), 2).fingerprint == fleet.instance(load_policy("default"), 2).fingerprint


def rank_counts(instance: Instance) -> list[StripeCounts]:
    return [
        store.counts
        for rank in instance.ranks
        for thread in rank.worker.kv_recv_threads
        if isinstance(store := receive_store(thread), StripedReadStore)
    ]


@pytest.mark.parametrize(("archetype", "tp_size"), [("mla", 4), ("gqa-gdn", 4), ("kimi-linear", 2)])
def test_a_load_in_many_pieces_arrives_byte_for_byte_and_no_piece_stages_more_than_the_budget(
    mooncake_master: MooncakeMaster, clients: ClientPool, archetype: str, tp_size: int
) -> None:
    budget = 16 * 1024  # 2 to 4 objects of these archetypes
    with Fleet(archetype, master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(striped(), tp_size, name="cold").save()
        warm = fleet.instance(striped(), tp_size, name="warm", extra_config={"kvpolicy_striped_piece_mib": budget / 2**20})
        lookup = warm.lookup()
        warm.load(lookup)
        verdict = warm.verdict(lookup)
        assert verdict.correct and verdict.used_tokens == lookup.hit_length
        counts = rank_counts(warm)
        assert counts and all(count.exchanges > 2 for count in counts)  # the load went in pieces
        assert all(0 < count.peak_host_staging_bytes <= budget for count in counts)
        assert all(count.keys_failed == 0 and count.keys_received > 0 for count in counts)


def test_a_failed_owner_fails_only_its_keys_when_the_load_goes_in_pieces(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    with Fleet("mla", master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS) as fleet:
        fleet.instance(striped(), 2, name="cold").save()
        warm = fleet.instance(striped(), 2, name="warm", extra_config={"kvpolicy_striped_piece_mib": 4096 / 2**20})
        lookup = warm.lookup()
        loaded_keys = sorted(warm.key(0, 0, chunk) for chunk in range(lookup.hit_length // 16))
        assert fleet.client.remove(loaded_keys[9], True) == 0  # rank 1's, in a later piece
        warm.load(lookup)
        verdict = warm.verdict(lookup)
        assert verdict.correct and 0 < verdict.used_tokens < lookup.hit_length
        counts = rank_counts(warm)
        assert sum(count.keys_failed for count in counts) == 1  # rank 0 fails the key rank 1 could not read
        assert not any(receive_store(t).broken for r in warm.ranks for t in r.worker.kv_recv_threads)


# --- StripedReadStore alone: copies, peers, gloo between processes ---------------------------------------


class CountOps(TorchDispatchMode):
    """The torch operations run in this thread, by name (what a load costs, seen from torch's side), and
    the element types the indexed copies of rows (2-D operands) run on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.row_dtypes: collections.Counter[tuple[str, torch.dtype]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in ("aten.index_select", "aten.index_copy_") and args and args[0].dim() == 2:
            self.row_dtypes[(name, args[0].dtype)] += 1
        return func(*args, **(kwargs or {}))


class RecordingExchange:
    """An exchange that records the peers and bytes of every transfer it passes on."""

    def __init__(self, inner: PeerExchange) -> None:
        self._inner = inner
        self.device_buffers = inner.device_buffers
        self.received: list[tuple[int, int]] = []
        self.sent: list[tuple[int, int]] = []

    def __call__(self, sends: Sequence[Transfer], receives: Sequence[Transfer]) -> None:
        self.sent += [(peer, len(buffer)) for peer, buffer in sends]
        self.received += [(peer, len(buffer)) for peer, buffer in receives]
        self._inner(sends, receives)


@dataclasses.dataclass
class RankRun:
    results: list[int]
    wrong: list[str]
    counts: StripeCounts
    ops: collections.Counter[str]
    exchange: RecordingExchange
    broken: bool
    row_dtypes: collections.Counter[tuple[str, torch.dtype]] = dataclasses.field(default_factory=collections.Counter)


@contextlib.contextmanager
def stored(rig: Rig, client: Any) -> Iterator[None]:
    for key, value in rig.objects().items():
        assert client.put(key, value) == 0
    try:
        yield
    finally:
        client.remove_by_regex(f"{rig.prefix}.*", True)


def run_rig(rigs: Sequence[Rig], clients: ClientPool, **options: Any) -> list[RankRun]:
    """One striped load on every rank (rank ``r`` runs ``rigs[r]``'s keys), threads over a ThreadExchange."""
    tp = rigs[0].tp
    leased = clients.acquire(tp)
    exchange = ThreadExchange(tp, timeout=10, device_buffers=options.pop("device_buffers", False))
    runs: list[RankRun | None] = [None] * tp
    tensors = [rigs[rank].tensors() for rank in range(tp)]
    try:
        with contextlib.ExitStack() as stack:
            for rig in {rig.prefix: rig for rig in rigs}.values():
                stack.enter_context(stored(rig, leased[0]))
            for rank in range(tp):
                register(leased[rank], tensors[rank])

            def rank_main(rank: int) -> None:
                recording = RecordingExchange(exchange.member(rank))
                store = rigs[rank].store(rank, leased[rank], tensors[rank], recording, **options)
                request = rigs[rank].request(rank, tensors[rank])
                with CountOps() as counter:
                    results = store.batch_get_into_multi_buffers(*request)
                wrong = rigs[rank].wrong(rank, tensors[rank], results)
                runs[rank] = RankRun(
                    results, wrong, store.counts, counter.ops, recording, store.broken, counter.row_dtypes
                )

            threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(tp)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            for rank in range(tp):
                unregister(leased[rank], tensors[rank])
    finally:
        clients.release(leased)
    assert all(run is not None for run in runs), "a rank did not finish its load"
    return [run for run in runs if run is not None]


def rig(tp: int = 2, factor: int = 2, layers: int = 3, keys: int = 8, **fields: Any) -> Rig:
    return Rig(tp, factor, layers, keys, prefix=f"striped-rig-{uuid.uuid4().hex[:8]}", **fields)


@pytest.mark.parametrize("through_host", [False, True], ids=["cpu-tensors", "device-path-on-cpu"])
def test_the_torch_operations_of_a_load_do_not_grow_with_its_keys(
    mooncake_master: MooncakeMaster, clients: ClientPool, through_host: bool
) -> None:
    few, many = (run_rig([rig(keys=keys)] * 2, clients, stage_through_host=through_host) for keys in (2, 24))
    for small, large in zip(few, many, strict=True):
        assert small.wrong == large.wrong == [] and min(small.results + large.results) == 0
        assert small.ops == large.ops  # every torch operation, by name and count
        assert large.counts.keys_received == 12


@pytest.mark.parametrize("through_host", [False, True], ids=["cpu-tensors", "device-path-on-cpu"])
def test_copies_per_load_do_not_grow_with_regions_and_indexed_copies_are_one_per_kv_tensor(
    mooncake_master: MooncakeMaster, clients: ClientPool, through_host: bool
) -> None:
    index_selects_besides_gathers = set()
    for layers in (1, 4, 12):
        for run in run_rig([rig(layers=layers, keys=10)] * 2, clients, stage_through_host=through_host):
            assert run.wrong == [] and min(run.results) == 0
            # Bulk copies: the send staging to the host and the received staging back, once each, on
            # the device path; none where the KV cache is host memory. One header written per block.
            assert (run.counts.device_to_host_copies, run.counts.host_to_device_copies) == (
                (1, 1) if through_host else (0, 0)
            )
            assert run.ops["aten.copy_"] == 1 + 1 + 2 * through_host  # header, the exchange's own, bulk
            assert run.counts.gather_ops == run.counts.scatter_ops == run.ops["aten.index_copy_"] == layers
            # torch's repeat_interleave (building the row indices) runs index_select too: a constant.
            index_selects_besides_gathers.add(run.ops["aten.index_select"] - layers)
    assert len(index_selects_besides_gathers) == 1


def test_a_rank_exchanges_with_its_replica_set_only_and_receives_f_minus_1_over_f_of_its_load(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    runs = run_rig([rig(tp=4, factor=2, keys=10)] * 4, clients)
    for rank, run in enumerate(runs):
        peer = rank ^ 1  # replica sets (0, 1) and (2, 3)
        assert run.wrong == [] and min(run.results) == 0
        assert {p for p, _ in run.exchange.received} == {p for p, _ in run.exchange.sent} == {peer}
        assert run.counts.bytes_received == run.counts.bytes_loaded // 2


def test_device_buffers_take_the_same_bytes_without_host_staging(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    for run in run_rig([rig(keys=7, layers=2)] * 2, clients, device_buffers=True):
        assert run.wrong == [] and min(run.results) == 0
        assert run.counts.peak_host_staging_bytes == 0 and run.counts.peak_device_staging_bytes > 0


def test_ranks_out_of_step_use_none_of_what_they_received_and_stop_exchanging(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """Rank 1 loads other keys than rank 0 (same count and sizes): every header is another block's."""
    first = rig(keys=6)
    runs = run_rig([first, dataclasses.replace(first, seed=1, prefix=first.prefix + "-other")], clients)
    for run in runs:
        assert run.wrong == []
        assert sorted(code >= 0 for code in run.results) == [False] * 3 + [True] * 3  # own stripe only
        assert run.counts.keys_failed == 3 and run.broken


def test_a_load_over_gloo_between_processes_arrives_byte_for_byte_within_replica_sets(
    mooncake_master: MooncakeMaster, clients: ClientPool, tmp_path: Any
) -> None:
    """Four processes, replica sets (0, 1) and (2, 3), raw bytes over one gloo group's send/recv."""
    spec = rig(tp=4, factor=2, layers=3, keys=9)
    (client,) = clients.acquire(1)
    context = multiprocessing.get_context("spawn")
    outcome = context.Queue()
    try:
        with stored(spec, client):
            init = f"file://{tmp_path / 'gloo-init'}"
            processes = [
                context.Process(target=process_rank, args=(rank, spec, mooncake_master.rpc_address, init, outcome))
                for rank in range(spec.tp)
            ]
            for process in processes:
                process.start()
            reports = sorted(outcome.get(timeout=120) for _ in processes)
            for process in processes:
                process.join(60)
    finally:
        clients.release([client])
    assert [process.exitcode for process in processes] == [0] * spec.tp
    for rank, results, wrong, counts in reports:
        assert wrong == [] and min(results) == 0
        own = 5 if rank % 2 == 0 else 4  # 9 keys over 2 members: positions 0, 2, ... go to the first
        assert counts["keys_read"] == own and counts["keys_received"] == 9 - own
        assert counts["bytes_received"] == (9 - own) * 3 * spec.block_bytes


@pytest.mark.parametrize("through_host", [False, True], ids=["cpu-tensors", "device-path-on-cpu"])
def test_the_indexed_copies_move_kv_rows_as_eight_byte_words_not_bytes(
    mooncake_master: MooncakeMaster, clients: ClientPool, through_host: bool
) -> None:
    # Blocks of 256 bytes and 7 keys (a header of 8 + 4 flags, padded): every row at an 8-byte offset.
    for run in run_rig([rig(keys=7, layers=3)] * 2, clients, stage_through_host=through_host):
        assert run.wrong == [] and min(run.results) == 0
        assert run.row_dtypes == {("aten.index_select", torch.int64): 3, ("aten.index_copy_", torch.int64): 3}


# --- staging that cannot be allocated ----------------------------------------------------------------


class StagingRefused:
    """A staging allocator that raises ``OutOfMemoryError`` its first ``failures`` times: device memory
    short under vLLM's KV cache cannot be had on a CPU machine, so the allocator's answer is stood in for."""

    def __init__(self, failures: int = 1) -> None:
        self.left = failures

    def __call__(self, nbytes: int, **where: Any) -> torch.Tensor:
        if self.left:
            self.left -= 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes (injected)")
        return allocate_staging(nbytes, **where)


def run_loads(
    spec: Rig, clients: ClientPool, loads: int, *, refuse: dict[int, int] | None = None, timeout: float = 30.0,
    **options: Any,
) -> list[tuple[list[RankRun], float]]:
    """``loads`` striped loads in a row through the same stores, threads over one ThreadExchange; rank ``r``'s
    staging refused ``refuse[r]`` times. Per load: each rank's run, and the load's wall time."""
    tp = spec.tp
    leased = clients.acquire(tp)
    exchange = ThreadExchange(tp, timeout=timeout, device_buffers=options.pop("device_buffers", False))
    tensors = [spec.tensors() for _ in range(tp)]
    out: list[tuple[list[RankRun], float]] = []
    try:
        with stored(spec, leased[0]):
            for rank in range(tp):
                register(leased[rank], tensors[rank])
            recordings = [RecordingExchange(exchange.member(rank)) for rank in range(tp)]
            refused = {rank: {"allocate": StagingRefused(failures)} for rank, failures in (refuse or {}).items()}
            stores = [
                spec.store(rank, leased[rank], tensors[rank], recordings[rank], **{**options, **refused.get(rank, {})})
                for rank in range(tp)
            ]
            for _ in range(loads):
                runs: list[RankRun | None] = [None] * tp
                for tensor in (t for rank_tensors in tensors for t in rank_tensors):
                    tensor.zero_()

                def rank_main(rank: int, runs: list[RankRun | None]) -> None:
                    results = stores[rank].batch_get_into_multi_buffers(*spec.request(rank, tensors[rank]))
                    wrong = spec.wrong(rank, tensors[rank], results)
                    runs[rank] = RankRun(results, wrong, stores[rank].counts, collections.Counter(), recordings[rank],
                                         stores[rank].broken)

                started = time.monotonic()
                threads = [threading.Thread(target=rank_main, args=(rank, runs)) for rank in range(tp)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(2 * timeout)
                assert all(run is not None for run in runs), "a rank did not finish its load"
                out.append(([run for run in runs if run is not None], time.monotonic() - started))
            for rank in range(tp):
                unregister(leased[rank], tensors[rank])
    finally:
        clients.release(leased)
    return out


def test_a_rank_out_of_memory_for_its_staging_fails_nothing_and_its_peer_sees_it_at_once(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """Rank 1 cannot allocate its first piece's staging: it says so in that piece's headers, both ranks read
    that piece's keys and the rest of the load themselves, and nobody waits out the exchange's timeout."""
    spec = rig(keys=12, layers=2)
    ((first, seconds), (second, _)) = run_loads(spec, clients, 2, refuse={1: 1}, piece_budget_bytes=2048)
    assert seconds < 10  # the exchange's timeout is 30 s: no rank waited for a transfer that never came
    for run in first:
        assert run.wrong == [] and min(run.results) >= 0  # every key loaded: nothing for vLLM to recompute
        assert run.counts.keys_failed == 0 and run.broken
    assert (first[1].counts.staging_failures, first[0].counts.staging_failures) == (1, 0)
    assert first[0].counts.peer_quits >= 1
    # From the next load both read per rank: no exchange, every key whole.
    calls = [len(run.exchange.sent) + len(run.exchange.received) for run in first]
    assert [len(run.exchange.sent) + len(run.exchange.received) for run in second] == calls
    assert all(run.wrong == [] and min(run.results) >= 0 for run in second)


def test_a_quit_in_the_first_piece_reaches_a_rank_that_owns_nothing_of_it_later_in_the_load(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """Replica set of four, pieces of about two keys: rank 3 quits in the first piece, where ranks 2 and 3
    own nothing to send; the quit headers keep going for the rest of the load, so every rank learns."""
    spec = rig(tp=4, factor=4, keys=12, layers=1)
    ((runs, seconds),) = run_loads(spec, clients, 1, refuse={3: 1}, piece_budget_bytes=1024)
    assert seconds < 10
    assert all(run.wrong == [] and min(run.results) >= 0 and run.broken for run in runs)
    assert sum(run.counts.peer_quits for run in runs) >= 3


def test_device_buffer_staging_is_reserved_once_when_the_store_is_built(
    mooncake_master: MooncakeMaster, clients: ClientPool
) -> None:
    """An NCCL exchange takes device buffers: a piece within the budget stages in the reservation made at
    registration, so a load allocates nothing (and cannot fail to, halfway through an exchange)."""
    allocated: list[int] = []

    def counting(nbytes: int, **where: Any) -> torch.Tensor:
        allocated.append(nbytes)
        return allocate_staging(nbytes, **where)

    loads = run_loads(rig(keys=9, layers=2), clients, 2, device_buffers=True, piece_budget_bytes=4096, allocate=counting)
    assert allocated == [4096, 4096]  # one reservation per rank, at construction
    for runs, _ in loads:
        assert all(run.wrong == [] and min(run.results) >= 0 and not run.broken for run in runs)
        assert all(0 < run.counts.peak_device_staging_bytes <= 4096 for run in runs)
