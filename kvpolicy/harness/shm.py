"""Shared memory that killed engines leave in ``/dev/shm``, given back.

A vLLM engine at TP > 1 on CPU holds POSIX shared memory: its message queues
(``multiprocessing.shared_memory``, ``psm_*``, up to 256 MB each) and the CPU all-reduce buffers
(``vllm_dist_*-cpushm``). It unlinks them in its own teardown, which a process group killed with
SIGKILL never runs, so every killed engine leaves its segments behind until the machine reboots. Over
a long test run (hundreds of engines) that fills ``/dev/shm`` (a few GB on these machines) and later
engines fail or stall in ways unrelated to what they test.

:func:`kill_group` therefore notes the segments a process group has mapped or open before
killing it, and once the group is gone, unlinks those that no live process still uses: never a
segment another process (another engine, a test of its own) holds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

SHARED_MEMORY = Path("/dev/shm")
"""Where POSIX shared memory lives on Linux."""

_PROC = Path("/proc")
_GONE_WAIT_S = 5.0
"""How long to wait for a killed group's processes to leave ``/proc`` before reclaiming what is unused."""


def _pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in os.scandir(_PROC):
            if entry.name.isdigit():
                yield int(entry.name)


def _group_and_state(pid: int) -> tuple[int, str] | None:
    """``pid``'s process group and state letter, or None once it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[2]), fields[0]


def _segments_used_by(pid: int) -> set[Path]:
    """The ``/dev/shm`` files ``pid`` maps or holds open (none once it is gone or not readable)."""
    used: set[Path] = set()
    prefix = f"{SHARED_MEMORY}/"
    with contextlib.suppress(OSError):
        for line in (_PROC / str(pid) / "maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(prefix) and not path.endswith(" (deleted)"):
                used.add(Path(path))
    with contextlib.suppress(OSError):
        for fd in os.scandir(_PROC / str(pid) / "fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith(prefix) and not target.endswith(" (deleted)"):
                    used.add(Path(target))
    return used


def _members(group: int) -> list[int]:
    """The live (not zombie) processes of process group ``group``."""
    members = []
    for pid in _pids():
        found = _group_and_state(pid)
        if found is not None and found[0] == group and found[1] != "Z":
            members.append(pid)
    return members


def segments_of_group(group: int) -> set[Path]:
    """Every ``/dev/shm`` file a process of ``group`` maps or holds open now."""
    return {path for pid in _members(group) for path in _segments_used_by(pid)}


def segments_in_use(among: Iterable[Path]) -> set[Path]:
    """Those of ``among`` that some live process maps or holds open."""
    wanted = set(among)
    if not wanted:
        return set()
    return {path for pid in _pids() for path in _segments_used_by(pid) if path in wanted}


def reclaim(segments: Iterable[Path]) -> list[Path]:
    """Unlink those of ``segments`` (files under ``/dev/shm``) that no live process uses; what was unlinked."""
    candidates = {path for path in segments if path.parent == SHARED_MEMORY}
    removed = []
    for path in sorted(candidates - segments_in_use(candidates)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def kill_group(process: subprocess.Popen[Any]) -> list[Path]:
    """SIGKILL ``process``'s process group (it was started with ``start_new_session=True``: the child
    and every worker it forked), reap the child, and unlink the shared memory the group held that no
    live process still uses. Returns what was unlinked."""
    held = segments_of_group(process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)
    deadline = time.monotonic() + _GONE_WAIT_S
    while _members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return reclaim(held)
