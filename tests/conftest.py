"""Fixtures and helpers shared by every test directory.

``require(module)`` imports an optional dependency (vLLM, Mooncake) for a test module: missing, it
skips the module on a developer machine but fails it under ``CI=true``, where a skip would hide a
broken install. ``mooncake_master`` is one loopback Mooncake master for the whole session.

Test modules reach ``require`` with ``from conftest import require``: pytest puts this directory on
``sys.path`` when it loads this file (the tests are not a package).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:
    from kvpolicy.mooncake.master import MooncakeMaster


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


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A ``mooncake_master`` on 127.0.0.1 for the whole session, stopped at the end.

    Fixtures that open store clients on it must close them first (depend on this fixture, so
    pytest tears them down before it): a client that outlives its master blocks ~30 s on close.
    """
    require("mooncake.store")
    from kvpolicy.mooncake.master import MooncakeUnavailable
    from kvpolicy.mooncake.testing import running_master

    try:
        context = running_master()
        master = context.__enter__()
    except MooncakeUnavailable as error:
        unavailable(f"no Mooncake master: {error}")
    try:
        yield master
    finally:
        context.__exit__(None, None, None)
