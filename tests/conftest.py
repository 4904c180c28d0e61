"""Fixtures and helpers shared by every test directory.

``require(module)`` imports an optional dependency (vLLM, Mooncake) for a test module: missing, it
skips the module on a developer machine but fails it under ``CI=true``, where a skip would hide a
broken install. ``mooncake_master`` is one loopback Mooncake master for the whole session; the
end-to-end modules get one each (``e2e_master``, module scope, so no module hits on another's
objects) and ``e2e_store_config``, the engines' ``MOONCAKE_CONFIG_PATH`` with a segment-holder
process that owns the store's memory (engines mount nothing, so a warm engine reads what a cold one
wrote after it exited; :mod:`kvpolicy.harness.e2e`).

Test modules reach ``require`` with ``from conftest import require``: pytest puts this directory on
``sys.path`` when it loads this file (the tests are not a package).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

import pytest
import tiers
from hypothesis import settings

if TYPE_CHECKING:
    from kvpolicy.mooncake.master import MooncakeMaster


DEV_EXAMPLES = 25
"""Hypothesis examples per property in the developer's loop (the ``dev`` profile, the default)."""
CI_EXAMPLES = 200
"""Hypothesis examples per property under ``CI=true`` (the ``ci`` profile); ``HYPOTHESIS_PROFILE``
or ``--hypothesis-profile`` picks either anywhere."""


def in_ci() -> bool:
    """True under the CI runner (``CI=true``), where missing dependencies are failures."""
    return os.environ.get("CI") == "true"


def unavailable(reason: str) -> NoReturn:
    """Fail under CI, skip elsewhere; usable at module level and inside fixtures and tests."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: required dependencies must be installed)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str) -> ModuleType:
    """Import ``module`` or stop: skipped locally, failed under ``CI=true``.

    Catches ``OSError`` too: ``mooncake.store`` raises it when the system library ``libibverbs``
    is missing.
    """
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as error:
        unavailable(f"{module} does not import: {error}")


# --- hypothesis budgets -----------------------------------------------------------------------------

settings.register_profile("dev", max_examples=DEV_EXAMPLES, deadline=None)
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if in_ci() else "dev"))


# --- tiers (tests/tiers.py) ------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        default=None,
        metavar="TIER[,TIER...]",
        help=f"run only these tiers ({', '.join(tiers.TIER_NAMES)}; tests/tiers.py) and import no module of another",
    )


def selected_tiers(config: pytest.Config) -> frozenset[str] | None:
    option = config.getoption("--tier")
    if option is None:
        return None
    chosen = frozenset(name.strip() for name in option.split(",") if name.strip())
    unknown = sorted(chosen - set(tiers.TIER_NAMES))
    if unknown or not chosen:
        raise pytest.UsageError(f"--tier {option}: unknown tier {', '.join(unknown) or '(none)'}; tiers are {', '.join(tiers.TIER_NAMES)}")
    return chosen


def test_file(path: Path) -> str | None:
    """``path`` relative to tests/ when it is a test module of this suite."""
    if not (path.name.startswith("test_") and path.suffix == ".py"):
        return None
    try:
        return path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None


def pytest_configure(config: pytest.Config) -> None:
    selected_tiers(config)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Modules of unselected tiers are not imported at all (``-m`` would import every one)."""
    chosen = selected_tiers(config)
    file = test_file(collection_path)
    if chosen is None or file is None:
        return None
    declared = tiers.declared(file)
    return True if declared is not None and not chosen.intersection(declared) else None


class Untiered(pytest.File):
    """A test module with no tier: fails collection until tests/tiers.py gives it one."""

    def collect(self) -> list[pytest.Item]:
        raise self.CollectError(
            f"tests/{test_file(self.path)} has no tier: add it to TIERS in tests/tiers.py "
            f"({', '.join(tiers.TIER_NAMES)})"
        )


class MissingNeeds(pytest.Module):
    """A test module whose tier needs packages that are not installed: skipped without importing it
    (failed under ``CI=true``)."""

    def collect(self) -> list[pytest.Item]:
        tier = tiers.default_tier(test_file(self.path) or "")
        unavailable(f"tests/{test_file(self.path)}: tier {tier} needs {', '.join(tiers.missing(tier))}, not installed")


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    file = test_file(module_path)
    if file is not None and tiers.declared(file) is not None and tiers.missing(tiers.default_tier(file)):
        return MissingNeeds.from_parent(parent, path=module_path)
    return None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    file = test_file(file_path)
    if file is not None and tiers.declared(file) is None:
        return Untiered.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier, move cells outside a covering subset to ``exhaustive``, and keep
    only the ``--tier`` chosen. Runs before ``-m`` so ``-m contract`` sees the markers."""
    assigned: dict[int, str] = {}
    groups: dict[tuple[str, str], list[int]] = {}
    wrong = []
    for index, item in enumerate(items):
        file = test_file(item.path)
        if file is None or tiers.declared(file) is None:
            continue
        function = getattr(item, "originalname", item.name)
        assigned[index] = tiers.tier_of(file, function, getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        if file in tiers.COVERED and callspec is not None:
            groups.setdefault((file, function), []).append(index)
    for (file, _), members in groups.items():
        cells = [tiers.facets(items[i].callspec.params, items[i].callspec.indices) for i in members]
        kept = {members[i] for i in tiers.covering(cells, tiers.COVERED[file])}
        for index in members:
            if index not in kept:
                assigned[index] = "exhaustive"
    for index, tier in assigned.items():
        item = items[index]
        declared = tiers.declared(test_file(item.path) or "") or ()
        if tier not in declared:
            wrong.append(f"{item.nodeid} is in tier {tier} (its fixtures), not in {', '.join(declared)}: list it in tests/tiers.py")
        item.add_marker(getattr(pytest.mark, tier))
        absent = tiers.missing(tier)
        if absent and not in_ci():  # under CI the test runs and fails on what is missing
            item.add_marker(pytest.mark.skip(reason=f"tier {tier} needs {', '.join(absent)}, not installed"))
    if wrong:
        raise pytest.UsageError("\n".join(wrong))
    chosen = selected_tiers(config)
    if chosen is not None:
        keep = [item for index, item in enumerate(items) if assigned.get(index) in chosen]
        dropped = [item for index, item in enumerate(items) if assigned.get(index) not in chosen]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A ``mooncake_master`` on 127.0.0.1 for the whole session, stopped at the end.

    Fixtures that open store clients on it must close them first (depend on this fixture, so
    pytest tears them down before it): a client that outlives its master blocks ~30 s on close.
    """
    require("mooncake.store")
    from kvpolicy.mooncake.master import MooncakeMaster, MooncakeUnavailable

    master = MooncakeMaster()
    try:
        master.start()
    except MooncakeUnavailable as error:
        unavailable(f"no Mooncake master: {error}")
    try:
        yield master
    finally:
        master.stop()



@pytest.fixture(scope="module")
def clients(mooncake_master: MooncakeMaster) -> Iterator[Any]:
    """Store clients on the session master, lent to this module's simulated instances
    (:class:`kvpolicy.mooncake.pool.ClientPool`): opening and closing one costs 1-2 s, so a module's
    runs share them, and they are closed before the master stops."""
    from kvpolicy.mooncake.pool import ClientPool

    with ClientPool(mooncake_master) as pool:
        yield pool


# --- a KVPolicyStoreWorker up to its plan, without vLLM's distributed runtime ----------------------


class NoPublishedDemotions:
    """The store as a fresh fleet's, for workers built without one: planning finds no demotion that
    another instance published (the only store call planning makes)."""

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [0] * len(keys)


@functools.cache
def engine_config(
    tp_size: int, *, pp_size: int = 1, dcp_size: int = 1, extra_config: tuple[tuple[str, Any], ...] = ()
) -> Any:
    """The ``VllmConfig`` an engine hands its store workers: block size 16, LBHNC layout resolved,
    ``kv_connector_extra_config`` from ``extra_config`` pairs. Cached (building one takes ~0.25 s);
    the workers only read it. PCP is not set: vLLM's CPU platform rejects it, and the workers take
    their PCP rank and size from ``Ranks``. The CPU platform also resets DCP to 1 on validation; a
    GPU engine keeps it, and the coordinator reads it, so it is set back."""
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig

    config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size),
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeStoreConnector", kv_role="kv_both", kv_connector_extra_config=dict(extra_config)
        ),
    )
    config.parallel_config.decode_context_parallel_size = dcp_size
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


def alone(payload: Any) -> list[Any]:
    """The TP collective as rank 0 sees it when the other ranks report nothing."""
    return [payload]


def planning_worker(policy: Any, model: Any, store: Any, *, gather: Any = alone, tp_rank: int = 0) -> Any:
    """Rank ``tp_rank``'s ``KVPolicyStoreWorker`` for a simulated model (``kvpolicy.sim.build_model``),
    through its standalone construction: planned, its token databases built, no KV registered."""
    from kvpolicy.runtime.binding import RankPlace
    from kvpolicy.vllm.worker import KVPolicyStoreWorker

    return KVPolicyStoreWorker.standalone(
        model.vllm_config,
        model.kv_cache_config,
        policy=policy,
        place=RankPlace(tp_rank=tp_rank, tp_size=model.tp_size),
        store=store,
        model=model.name,
        total_num_kv_heads=model.total_num_kv_heads,
        gather=gather,
    )

# --- end to end: one master per module, and the engines' store ---------------------------------

LEASE_TTL_MS = 120_000
"""Mooncake's default object lease is 10 s. On a loaded 2-core machine a warm engine's batch get
has been seen to take longer than that (both ranks at once), which fails the load with
LEASE_EXPIRED; the test master gets a lease that no healthy run comes near."""
CLIENT_TTL_S = 120
"""Mooncake drops a client's segment (and every object in it) after 10 s without a heartbeat; these
2-core VMs are frozen whole by their host for longer (docs/known-limits.md) while two TP engines saturate both cores, and
the master wakes to stale heartbeats."""
SEGMENT_MIB = 256
"""The segment holder's memory: the largest module stores a few MiB; room to spare."""


@pytest.fixture(scope="module")
def e2e_master() -> Iterator[MooncakeMaster]:
    """A loopback master for this module only, with a long object lease and client TTL."""
    from kvpolicy.mooncake.master import MooncakeMaster

    with MooncakeMaster(object_lease_ms=LEASE_TTL_MS, client_ttl_s=CLIENT_TTL_S) as master:
        yield master


@pytest.fixture(scope="module")
def e2e_store_config(e2e_master: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The engines' ``MOONCAKE_CONFIG_PATH``, with a segment holder keeping the objects alive."""
    from kvpolicy.harness.e2e import SegmentHolder, engine_store_config

    path = engine_store_config(e2e_master.client_config(), tmp_path_factory.mktemp("mooncake") / "engine.json")
    with SegmentHolder(e2e_master.rpc_address, segment_mib=SEGMENT_MIB):
        yield path
