"""Fixtures every end-to-end module shares: its own Mooncake master, and the engines' store config.

Each test module gets a master of its own (module scope), so no module hits on another's objects,
and a segment-holder process that owns the store's memory: engines run in Mooncake's
``standalone-store`` mode and mount nothing, so a warm engine can read what a cold one wrote after
that one exited (:mod:`kvpolicy.vllm.e2e`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvpolicy.mooncake.master import MooncakeMaster

LEASE_TTL_MS = 120_000
"""Mooncake's default object lease is 10 s. On a loaded 2-core machine a warm engine's batch get
has been seen to take longer than that (both ranks at once), which fails the load with
LEASE_EXPIRED; the test master gets a lease that no healthy run comes near."""
CLIENT_TTL_S = 120
"""Mooncake drops a client's segment (and every object in it) after 10 s without a heartbeat; the
segment holder starves that long while two TP engines saturate both cores."""
SEGMENT_MIB = 256
"""The segment holder's memory: the largest module stores a few MiB; room to spare."""


@pytest.fixture(scope="module")
def e2e_master() -> Iterator[MooncakeMaster]:
    """A loopback master for this module only, with a long object lease and client TTL."""
    from kvpolicy.mooncake.master import MooncakeMaster

    with MooncakeMaster(object_lease_ms=LEASE_TTL_MS, client_ttl_s=CLIENT_TTL_S) as master:
        yield master


@pytest.fixture(scope="module")
def store_config(e2e_master: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The engines' ``MOONCAKE_CONFIG_PATH``, with a segment holder keeping the objects alive."""
    from kvpolicy.mooncake.testing import small_client_config
    from kvpolicy.vllm.e2e import SegmentHolder, engine_store_config

    path = engine_store_config(small_client_config(e2e_master), tmp_path_factory.mktemp("mooncake") / "engine.json")
    with SegmentHolder(e2e_master.rpc_address, segment_mib=SEGMENT_MIB):
        yield path
