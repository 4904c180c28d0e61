"""The libraries' log lines kept out of a command's results.

``kvpolicy audit`` and ``kvpolicy discover`` run vLLM, torch and Mooncake in-process. Each of them
writes to the terminal on its own: vLLM's logger (to stdout by default), torch's and Triton's import
warnings and vLLM's notes to ``sys.stderr``, Mooncake's glog to file descriptor 2. Inside
:func:`libraries_logging_to` all of that goes to one log file, the command's results stay on stdout,
and the command's own words reach the terminal through the stream it yields.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from kvpolicy.app.environment import environment

__all__ = ["libraries_logging_to"]


@contextlib.contextmanager
def libraries_logging_to(path: str | os.PathLike[str]) -> Iterator[TextIO]:
    """Send file descriptor 2, ``sys.stderr`` and vLLM's logger (configured when vLLM is first imported
    inside the block) to ``path``, appending; yield the terminal's standard error for the command's
    own messages. Everything is as it was once the block ends, and the log's path is printed to the
    terminal's standard error if anything was written to it."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    log_path = Path(path)
    with log_path.open("ab") as log, environment(
        VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
        VLLM_LOGGING_STREAM="ext://sys.stderr",
    ):
        os.dup2(log.fileno(), 2)
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
        terminal = os.fdopen(os.dup(saved), "w", buffering=1, encoding=python_stderr.encoding or "utf-8",
                             errors="backslashreplace")
        try:
            yield terminal
        finally:
            sys.stderr.flush()
            sys.stderr.close()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            if log_path.stat().st_size:
                terminal.write(f"(the log lines of vLLM, torch and Mooncake: {log_path})\n")
            terminal.close()
