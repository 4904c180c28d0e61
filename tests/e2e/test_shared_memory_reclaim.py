"""Killing an engine's process group gives back the shared memory it held (kvpolicy.harness.shm), and
never a segment another live process still uses."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from multiprocessing import shared_memory
from pathlib import Path

from kvpolicy.harness.shm import SHARED_MEMORY, kill_group

# A child that forks a worker (as vLLM's engine core does); the worker creates a segment, or attaches to
# the one named on the command line, says its name and waits to be killed.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from multiprocessing import shared_memory
    if os.fork() == 0:
        name = sys.argv[1] if len(sys.argv) > 1 else None
        segment = shared_memory.SharedMemory(name=name, create=name is None, size=0 if name else 4096)
        print(segment.name, flush=True)
        time.sleep(120)
        os._exit(0)
    time.sleep(120)
""")


def _start_holder(*argv: str) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *argv], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert process.stdout is not None
    name = process.stdout.readline().strip()
    assert name, "the holder said no segment name"
    return process, SHARED_MEMORY / name


def test_a_killed_groups_segment_is_unlinked() -> None:
    process, segment = _start_holder()
    try:
        assert segment.exists()
        removed = kill_group(process)
    finally:
        if process.poll() is None:
            kill_group(process)
    assert segment in removed
    assert not segment.exists()


def test_a_segment_another_live_process_maps_is_kept() -> None:
    mine = shared_memory.SharedMemory(create=True, size=4096)
    try:
        process, segment = _start_holder(mine.name)
        try:
            assert segment == SHARED_MEMORY / mine.name
            removed = kill_group(process)
        finally:
            if process.poll() is None:
                kill_group(process)
        assert removed == []
        assert segment.exists()
    finally:
        mine.close()
        mine.unlink()
