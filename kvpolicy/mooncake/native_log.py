"""Mooncake's native logging, kept off the terminal.

Mooncake's C++ side logs through glog straight to file descriptor 2, a few lines per client; a demo
or a report printed on the terminal would drown in them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["native_stderr_to"]


@contextlib.contextmanager
def native_stderr_to(path: str | os.PathLike[str]) -> Iterator[None]:
    """Send file descriptor 2 to ``path`` (appending) while Python's ``sys.stderr`` keeps writing to
    the terminal, so tracebacks and warnings stay visible."""
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    with Path(path).open("ab") as log:
        os.dup2(log.fileno(), 2)
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
        try:
            yield
        finally:
            sys.stderr.flush()
            sys.stderr.close()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
