"""Process environment changes that last only as long as the work that needs them.

The CLI's commands also run in-process (``kvpolicy.app.cli.main`` from tests, notebooks, other tools), so
a command that sets a variable for what it imports must put it back: a leaked ``VLLM_LOGGING_LEVEL=ERROR``
silences every vLLM process the caller starts afterwards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["environment"]


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set, and as it was before once the block ends."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
