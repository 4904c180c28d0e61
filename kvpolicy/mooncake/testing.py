"""Test helpers: a running loopback master and small client configs for it.

Plain context managers, so the project's ``conftest.py`` decides fixture scopes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvpolicy.mooncake.client import MiB, ClientConfig
from kvpolicy.mooncake.master import MooncakeMaster


@contextlib.contextmanager
def running_master() -> Iterator[MooncakeMaster]:
    """A started :class:`MooncakeMaster`, stopped on exit."""
    with MooncakeMaster() as master:
        yield master


def small_client_config(
    master: MooncakeMaster, *, segment_mib: int = 64, buffer_mib: int = 16
) -> ClientConfig:
    """A loopback :class:`ClientConfig` for *master* with sizes that fit a CI machine."""
    return ClientConfig(
        master_server_address=master.rpc_address,
        global_segment_size=segment_mib * MiB,
        local_buffer_size=buffer_mib * MiB,
    )
