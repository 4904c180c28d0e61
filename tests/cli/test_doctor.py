"""``kvpolicy doctor``: every failing check names what is wrong and the fix; the CI environment passes.

Faults are injected for real where this machine allows it: a copy of the installed ``mooncake/store.so``
with one NEEDED name rewritten (the loader then really cannot find a library), a config file pointing
at a closed port or at a socket that never answers, a bad JSON file, a directory as the config path. What
cannot exist on a CPU machine (a CUDA torch, GPUs, a vLLM release outside the supported ones) is given
to the checks as values or as a stand-in ``vllm`` package, each said so where it is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require, unavailable

from kvpolicy.app.cli import main
from kvpolicy.app.doctor import (
    MAX_MOONCAKE_CONFIG_BYTES,
    MOONCAKE_BUILDS,
    SYSTEM_LIBRARIES,
    CheckResult,
    DoctorReport,
    MasterAddress,
    SharedLibrary,
    TorchFacts,
    check_master,
    check_mooncake_config,
    check_policy,
    check_torch,
    master_answers,
    missing_libraries_fix,
    wrong_build,
)
from kvpolicy.app.elf import read_dynamic_file
from kvpolicy.documents.loader import check_file
from kvpolicy.documents.report import DOCUMENT_VERSIONS
from kvpolicy.vllm.version import SUPPORTED_SERIES, supported_range

REPO = Path(__file__).resolve().parents[2]
CHECKS = ("kvpolicy", "python", "vllm", "torch", "mooncake", "mooncake-config", "mooncake-master")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_subprocess(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh process (for imports that must not meet this process's modules)."""
    env = {key: value for key, value in os.environ.items() if key != "MOONCAKE_CONFIG_PATH"}
    env["HF_HUB_OFFLINE"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=180, cwd=REPO)


# --- the command line stays light ----------------------------------------------------------------


def test_the_cli_and_the_doctor_module_import_neither_vllm_torch_nor_mooncake() -> None:
    probe = (
        "import sys; import kvpolicy.app.cli as cli, kvpolicy.app.doctor; cli.build_parser(); "
        "print(sorted(m for m in ('vllm', 'torch', 'mooncake') if m in sys.modules))"
    )
    result = run_subprocess("-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- the passing run, in CI's own environment ------------------------------------------------------


@pytest.fixture(scope="module")
def store_config(tmp_path_factory: pytest.TempPathFactory, mooncake_master: object) -> Path:
    """A MOONCAKE_CONFIG_PATH for the session's real master on 127.0.0.1."""
    return mooncake_master.client_config().write(tmp_path_factory.mktemp("doctor") / "mooncake.json")  # type: ignore[attr-defined]


def test_doctor_passes_every_check_in_the_ci_environment(
    store_config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require("vllm")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(store_config))
    code, out, _ = run(capsys, "doctor", "--policy", "default")
    lines = out.strip().splitlines()
    assert code == 0, out
    assert [line.split(":", 1)[0].split()[-1] for line in lines[:-1]] == [*CHECKS, "policy"]
    assert all(line.startswith("ok ") for line in lines[:-1]), out
    assert lines[-1] == f"doctor: all {len(CHECKS) + 1} checks passed"


def test_doctor_json_is_a_versioned_report_of_the_same_checks(
    store_config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require("vllm")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(store_config))
    code, out, _ = run(capsys, "doctor", "--format", "json")
    document = json.loads(out)
    report = DoctorReport.model_validate(document)
    assert code == 0
    assert list(document)[:2] == ["version", "kind"]
    assert (document["kind"], document["version"]) == ("DoctorReport", DOCUMENT_VERSIONS["DoctorReport"])
    assert document["passed"] is True
    assert [check.name for check in report.checks] == list(CHECKS)
    assert {check.status for check in report.checks} == {"ok"}


# --- vLLM ------------------------------------------------------------------------------------------


def stand_in_vllm(root: Path, init: str) -> Path:
    """A package named ``vllm`` with the given ``__init__``: a stand-in for vLLM releases that cannot be
    installed here (none outside the supported series is, and a broken install is made, not found)."""
    package = root / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    (package / "config.py").write_text("")
    return root


def doctor_json(result: subprocess.CompletedProcess[str]) -> dict[str, CheckResult]:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    report = DoctorReport.model_validate_json(result.stdout)
    return {check.name: check for check in report.checks}


def test_an_unsupported_vllm_release_fails_naming_the_supported_ones(tmp_path: Path) -> None:
    newer = f"{max(SUPPORTED_SERIES)[0]}.{max(SUPPORTED_SERIES)[1] + 1}.0"
    site = stand_in_vllm(tmp_path, f"__version__ = {newer!r}\n")
    result = run_subprocess("-m", "kvpolicy.app.cli", "doctor", "--format", "json", pythonpath=site)
    vllm = doctor_json(result)["vllm"]
    assert result.returncode == 1
    assert vllm.status == "fail"
    assert newer in vllm.message and supported_range() in vllm.message
    low, high = min(SUPPORTED_SERIES), max(SUPPORTED_SERIES)
    assert vllm.fix is not None and f"'vllm>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'" in vllm.fix


def test_a_vllm_that_does_not_import_is_a_failed_check_not_a_traceback(tmp_path: Path) -> None:
    site = stand_in_vllm(tmp_path, "raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    result = run_subprocess("-m", "kvpolicy.app.cli", "doctor", pythonpath=site)
    line = next(line for line in result.stdout.splitlines() if " vllm: " in line)
    assert result.returncode == 1
    assert line.startswith("FAIL  vllm: vLLM does not import: ImportError: libcudart.so.13: cannot open")
    assert "; fix: pip install " in line


# --- torch (values: a CUDA torch and GPUs cannot exist on this machine) -----------------------------


def test_a_cuda_torch_that_sees_no_gpu_fails_and_points_at_the_driver() -> None:
    result = check_torch(TorchFacts(version="2.14.0", cuda="13.0", device_count=0))
    assert result.status == "fail"
    assert "CUDA 13.0" in result.message and "no GPU" in result.message
    assert result.fix is not None and "nvidia-smi" in result.fix


def test_a_cuda_torch_with_gpus_reports_its_cuda_version_and_device_count() -> None:
    result = check_torch(TorchFacts(version="2.14.0", cuda="13.0", device_count=8))
    assert (result.status, result.message) == ("ok", "2.14.0, CUDA 13.0, 8 GPU(s)")


def test_a_torch_that_does_not_import_fails() -> None:
    result = check_torch(TorchFacts(version=None, cuda=None, device_count=0, error="OSError: libtorch_cpu.so"))
    assert result.status == "fail" and "libtorch_cpu.so" in result.message


# --- Mooncake ------------------------------------------------------------------------------------


def installed_mooncake() -> Path:
    return Path(require("mooncake").__path__[0])


def patched_mooncake(root: Path, old: str, new: str, *, distribution: str | None = None) -> Path:
    """A ``mooncake`` package under ``root`` whose ``store.so`` is the installed one with the NEEDED name
    ``old`` rewritten to ``new`` in its string table (NUL-padded when shorter), everything else the
    installed files; with ``distribution``, a dist-info claiming the files for that distribution."""
    source = installed_mooncake()
    package = root / "mooncake"
    package.mkdir(parents=True)
    data = (source / "store.so").read_bytes()
    before, after = f"\0{old}\0".encode(), f"\0{new}".encode().ljust(len(old) + 2, b"\0")
    assert len(new) <= len(old) and data.count(before) == 1
    (package / "store.so").write_bytes(data.replace(before, after))
    (package / "__init__.py").write_text("")
    for name in ("engine.so", "libetcd_wrapper.so", "libasio.so"):
        (package / name).symlink_to(source / name)
    for bundled in source.parent.glob("mooncake_transfer_engine*.libs"):
        (root / bundled.name).symlink_to(bundled)
    if distribution is not None:
        info = root / f"{distribution.replace('-', '_')}-0.3.13.post1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.3.13.post1\n")
        (info / "top_level.txt").write_text("mooncake\n")
        (info / "RECORD").write_text("mooncake/__init__.py,,\nmooncake/store.so,,\n")
    assert new in read_dynamic_file(package / "store.so").needed
    return root


def mooncake_check(site: Path | None) -> CheckResult:
    """The doctor's Mooncake check in a fresh process that finds ``site``'s ``mooncake`` first, after
    importing torch as the doctor (and vLLM) do."""
    probe = (
        "from kvpolicy.app.doctor import check_mooncake, probe_torch; "
        "print(check_mooncake(probe_torch()).model_dump_json())"
    )
    result = run_subprocess("-c", probe, pythonpath=site)
    assert result.returncode == 0, result.stderr[-3000:]
    return CheckResult.model_validate_json(result.stdout.strip().splitlines()[-1])


def loads(name: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def test_the_installed_mooncake_passes_beside_a_cpu_torch() -> None:
    installed_mooncake()
    result = mooncake_check(None)
    assert result.status == "ok", result
    assert "mooncake.store imports" in result.message


def test_a_missing_library_is_named_with_what_provides_it(tmp_path: Path) -> None:
    """store.so made to NEED libcuda.so.1 (in place of libcurl.so.4, same length): the NVIDIA driver's
    library, absent from a machine without one, so the loader really fails."""
    if loads("libcuda.so.1"):
        unavailable("this host has the NVIDIA driver (libcuda.so.1 loads); the fault needs a host without it")
    site = patched_mooncake(tmp_path, "libcurl.so.4", "libcuda.so.1")
    result = mooncake_check(site)
    libraries = {library.name: library for library in result.libraries}
    assert result.status == "fail"
    assert "libcuda.so.1: cannot open shared object file" in result.message  # the loader's own words
    assert libraries["libcuda.so.1"].found is None
    assert libraries["libcuda.so.1"].needed_by == ("store.so",)
    assert "NVIDIA driver" in (libraries["libcuda.so.1"].provided_by or "")
    assert result.fix is not None and result.fix.startswith("libcuda.so.1: the NVIDIA driver")
    assert [detail.split(" ")[0] for detail in result.details] == ["libcuda.so.1"]
    # every other library store.so NEEDS was located, by the module's RPATH or by the loader
    needed = set(read_dynamic_file(site / "mooncake" / "store.so").needed)
    assert needed <= set(libraries)
    assert {name for name, library in libraries.items() if library.found is None} == {"libcuda.so.1"}
    assert libraries["libetcd_wrapper.so"].how == "rpath"
    assert libraries["libnuma.so.1"].how == "loader"


def test_a_mooncake_built_for_another_cuda_names_the_build_to_install(tmp_path: Path) -> None:
    """A stand-in for the CUDA 12 build (mooncake-transfer-engine): the installed store.so made to NEED
    libcudart.so.12 as that wheel's does (read from it by tests/packaging/test_gpu_extra.py), claimed by
    a dist-info of that name. Beside this CPU torch the right build is the non-CUDA one."""
    if loads("libcudart.so.12"):
        unavailable("this host has a CUDA 12 runtime; the fault needs a host without it")
    site = patched_mooncake(tmp_path, "liburing-2907b6bc.so.1.0.7", "libcudart.so.12",
                            distribution="mooncake-transfer-engine")
    result = mooncake_check(site)
    assert result.status == "fail"
    assert "the wrong Mooncake build" in result.message
    assert "libcudart.so.12" in result.message and "CPU build" in result.message
    assert result.fix is not None
    assert re.fullmatch(
        r"pip uninstall -y mooncake-transfer-engine && pip install 'mooncake-transfer-engine-non-cuda(==[\w.]+)?'",
        result.fix,
    ), result.fix


@pytest.mark.parametrize(
    ("torch_cuda", "needed", "installed", "right"),
    [
        ("13.0", {12}, "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"),  # the case
        ("12.8", {13}, "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine"),
        (None, {12}, "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"),
        ("13.0", set(), "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13"),
    ],
)
def test_a_libcudart_major_other_than_torchs_cuda_names_the_right_build(
    torch_cuda: str | None, needed: set[int], installed: str, right: str
) -> None:
    """Values: torch's CUDA builds cannot be installed here."""
    torch = TorchFacts(version="2.14.0", cuda=torch_cuda, device_count=1 if torch_cuda else 0)
    mismatch = wrong_build(frozenset(needed), torch, installed)
    assert mismatch is not None
    problem, fix = mismatch
    assert installed in problem
    assert fix.startswith(f"pip uninstall -y {installed} && pip install '{right}")


def test_a_mooncake_of_torchs_cuda_is_the_right_build() -> None:
    assert wrong_build(frozenset({13}), TorchFacts("2.14.0", "13.0", 8), "mooncake-transfer-engine-cuda13") is None
    assert wrong_build(frozenset(), TorchFacts("2.13.0+cpu", None, 0), "mooncake-transfer-engine-non-cuda") is None


def test_a_cuda_without_a_mooncake_build_says_so() -> None:
    mismatch = wrong_build(frozenset({12}), TorchFacts("2.5.0", "11.8", 1), "mooncake-transfer-engine")
    assert mismatch is not None and "no Mooncake build matches CUDA 11.8" in mismatch[1]
    assert set(MOONCAKE_BUILDS) == {None, 12, 13}


def test_missing_system_libraries_become_one_apt_get_line() -> None:
    missing = [
        SharedLibrary(name=name, needed_by=("store.so",), found=None, how=None, provided_by=None)
        for name in ("libnuma.so.1", "libmlx5.so.1", "libibverbs.so.1")
    ]
    assert missing_libraries_fix(missing) == "apt-get install -y ibverbs-providers libibverbs1 libnuma1"


def test_each_system_library_comes_from_the_debian_package_the_doctor_names() -> None:
    """dpkg's own answer on this Debian machine, for every library in the doctor's table."""
    if shutil.which("dpkg") is None:
        unavailable("dpkg is not here (not a Debian/Ubuntu machine)")
    for name, package in SYSTEM_LIBRARIES.items():
        owner = subprocess.run(["dpkg", "-S", f"*/{name}"], capture_output=True, text=True)
        assert owner.returncode == 0, f"{name} is not installed here: {owner.stderr}"
        assert {line.split(":")[0] for line in owner.stdout.splitlines()} == {package}, owner.stdout


# --- MOONCAKE_CONFIG_PATH ------------------------------------------------------------------------


def test_an_unset_mooncake_config_path_fails() -> None:
    result, master = check_mooncake_config({}, use_vllm=False)
    assert (result.status, master) == ("fail", None)
    assert "MOONCAKE_CONFIG_PATH is not set" in result.message and "export MOONCAKE_CONFIG_PATH" in (result.fix or "")


def test_a_config_path_that_does_not_exist_fails_located(tmp_path: Path) -> None:
    path = tmp_path / "missing.json"
    result, _ = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert result.status == "fail"
    assert result.message == f"{path}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: No such file or directory"


def test_a_config_path_naming_a_directory_fails_saying_so(tmp_path: Path) -> None:
    """A directory: unreadable as a file even for root (which chmod 000 would not stop)."""
    result, _ = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(tmp_path)}, use_vllm=False)
    assert result.status == "fail"
    assert result.message == f"{tmp_path}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: it is a directory, not a regular file"


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_as_the_config_fails_at_once_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "mooncake.json"
    os.mkfifo(fifo)
    with within(5):
        result, master = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(fifo)}, use_vllm=False)
    assert (result.status, master) == ("fail", None)
    assert result.message == f"{fifo}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: it is a FIFO, not a regular file"
    assert result.fix == "point MOONCAKE_CONFIG_PATH at a regular JSON file"


def test_a_character_device_as_the_config_is_refused_without_being_read() -> None:
    """``/dev/zero`` never ends: read whole, it would take all the memory there is."""
    with within(5):
        result, master = check_mooncake_config({"MOONCAKE_CONFIG_PATH": "/dev/zero"}, use_vllm=False)
    assert (result.status, master) == ("fail", None)
    assert result.message == "/dev/zero:1:1: error: cannot read MOONCAKE_CONFIG_PATH: it is a character device, not a regular file"


def test_a_config_larger_than_the_bound_is_refused_naming_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    config = json.dumps({"master_server_address": "127.0.0.1:50051", "protocol": "tcp"})
    path.write_text(config + " " * (MAX_MOONCAKE_CONFIG_BYTES + 1 - len(config)))  # valid JSON, one byte too many
    result, master = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert (result.status, master) == ("fail", None)
    assert result.message == (
        f"{path}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: it is larger than 1048576 bytes (1 MiB); "
        "a Mooncake config is a few hundred bytes"
    )


def test_a_config_of_exactly_the_bound_is_read(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    config = json.dumps({"master_server_address": "127.0.0.1:50051", "protocol": "tcp"})
    path.write_text(config + " " * (MAX_MOONCAKE_CONFIG_BYTES - len(config)))
    result, master = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert (result.status, master) == ("ok", MasterAddress("127.0.0.1", 50051))


def test_a_config_that_is_not_utf8_fails_saying_so(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_bytes(b'{"master_server_address": "\xff"}')
    result, _ = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert result.status == "fail"
    assert result.message.startswith(f"{path}:1:1: error: cannot read MOONCAKE_CONFIG_PATH: not UTF-8 text")


def test_a_config_nested_too_deeply_fails_as_invalid_json_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text("[" * 100_000)
    result, master = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert (result.status, master) == ("fail", None)
    assert result.message == f"{path}:1:1: error: invalid JSON: nested too deeply to read; a Mooncake config is one flat object"


def test_a_long_master_address_is_quoted_cut_to_one_short_line(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "x" * 500_000}))
    result, _ = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert result.status == "fail" and len(result.message) < 400
    assert result.message.endswith("... (499802 more characters)")


def test_a_bad_json_config_fails_at_its_line_and_column_and_doctor_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text('{\n  "master_server_address": "127.0.0.1:50051"\n  "protocol": "tcp"\n}\n')  # no comma
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    code, out, _ = run(capsys, "doctor")
    lines = out.strip().splitlines()
    config = next(line for line in lines if " mooncake-config: " in line)
    assert code == 1
    assert config.startswith(f"FAIL  mooncake-config: {path}:3:3: error: invalid JSON: Expecting ',' delimiter; fix: ")
    assert next(line for line in lines if " mooncake-master: " in line).startswith("skip  ")
    assert len(lines) == len(CHECKS) + 1  # one line per check, then the summary
    assert lines[-1].startswith("doctor: ") and "failed" in lines[-1]


def test_a_config_that_is_not_an_object_fails(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text('["127.0.0.1:50051"]')
    result, _ = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert result.status == "fail" and "expected a JSON object, found list" in result.message


def test_a_config_vllm_refuses_fails_with_vllms_reason(tmp_path: Path) -> None:
    require("vllm.distributed.mooncake_store")
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:50051", "mode": "sideways"}))
    result, _ = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=True)
    assert result.status == "fail"
    assert "vLLM refuses it: unknown Mooncake mode: 'sideways'" in result.message


@pytest.mark.parametrize("address", [None, "", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", 50051])
def test_a_config_without_a_host_port_master_fails(tmp_path: Path, address: object) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"protocol": "tcp"} | ({} if address is None else {"master_server_address": address})))
    result, master = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert (result.status, master) == ("fail", None)
    assert "master_server_address must be \"HOST:PORT\"" in result.message


def test_a_good_config_gives_its_master_address(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "[::1]:50051", "protocol": "tcp"}))
    result, master = check_mooncake_config({"MOONCAKE_CONFIG_PATH": str(path)}, use_vllm=False)
    assert (result.status, master) == ("ok", MasterAddress("::1", 50051))


# --- the master ----------------------------------------------------------------------------------


def test_a_real_master_answers(mooncake_master: object) -> None:
    result = check_master(MasterAddress("127.0.0.1", mooncake_master.rpc_port), 2.0)  # type: ignore[attr-defined]
    assert result.status == "ok", result
    assert result.message.startswith(f"a Mooncake master answered at 127.0.0.1:{mooncake_master.rpc_port} in ")  # type: ignore[attr-defined]


def test_a_closed_port_fails_at_once() -> None:
    from kvpolicy.mooncake.master import free_ports

    (port,) = free_ports(1)
    started = time.monotonic()
    result = check_master(MasterAddress("127.0.0.1", port), 2.0)
    assert time.monotonic() - started < 1.0
    assert result.status == "fail"
    assert result.message == f"no Mooncake master answers at 127.0.0.1:{port}: Connection refused"
    assert result.fix is not None and "start mooncake_master" in result.fix


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A loopback port whose listen queue is full: the kernel drops further SYNs, so a connect hangs
    as it does towards an unroutable address."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = [socket.create_connection(("127.0.0.1", port), timeout=1)]
    try:
        yield port
    finally:
        for connection in queued:
            connection.close()
        server.close()


def test_a_master_that_never_answers_fails_within_the_timeout(full_backlog: int) -> None:
    started = time.monotonic()
    result = check_master(MasterAddress("127.0.0.1", full_backlog), 0.5)
    elapsed = time.monotonic() - started
    assert 0.4 < elapsed < 5, "a connect without the timeout waits for the kernel's SYN retries (over a minute)"
    assert result.message == f"no Mooncake master answers at 127.0.0.1:{full_backlog}: no answer within 0.5 s"


def test_an_unroutable_address_returns_within_the_timeout() -> None:
    """10.255.255.1 drops SYNs on most networks (some sandboxes answer for it instead); either way the
    check returns within its bound and does not pass."""
    started = time.monotonic()
    result = check_master(MasterAddress("10.255.255.1", 50051), 0.5)
    assert time.monotonic() - started < 1.5
    assert result.status == "fail"


def test_a_service_that_is_not_a_mooncake_master_fails() -> None:
    """Something accepts TCP connections but never speaks Mooncake's RPC: connecting is not enough."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    try:
        answer = master_answers(MasterAddress("127.0.0.1", server.getsockname()[1]), 0.5)
    finally:
        server.close()
    assert not answer.answered
    assert answer.problem is not None and answer.problem.startswith("something accepted the TCP connection")


# --- the policy ----------------------------------------------------------------------------------


def test_a_valid_policy_gives_the_line_vllm_config_prints(capsys: pytest.CaptureFixture[str]) -> None:
    result = check_policy("default")
    code, out, _ = run(capsys, "vllm-config", "--policy", "default")
    assert code == 0 and result.status == "ok"
    assert result.paste == out.strip()
    assert result.message.endswith(f"--kv-transfer-config '{out.strip()}'")


def test_an_invalid_policy_fails_with_the_validators_diagnostics(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nkind: ReplicationPolicy\nname: bad\nrules:\n  - name: r\n    replicaton: sharded\n")
    result = check_policy(str(path))
    _, problems = check_file(path)
    assert result.status == "fail"
    assert result.details == tuple(str(problem) for problem in problems if problem.severity == "error")
    assert result.details and all(detail.startswith(f"{path}:") for detail in result.details)


def test_a_valid_policy_with_warnings_shows_them_instead_of_calling_it_simply_valid(tmp_path: Path) -> None:
    path = tmp_path / "plugin.yaml"
    path.write_text("version: 1\nkind: ReplicationPolicy\nname: plugin\nrules:\n  - name: r\n    reason: a plugin's state\n"
                    "    match: {spec: [ConvStateSpc]}\n    replication: sharded\n")
    result = check_policy(str(path))
    _, problems = check_file(path)
    warnings = tuple(str(problem) for problem in problems if problem.severity == "warning")
    assert result.status == "ok" and len(warnings) == 1
    assert "valid, with 1 warning (below)" in result.message
    assert result.details == warnings


@pytest.mark.parametrize("value", ["0", "-1", "nan", "61", "soon"])
def test_a_timeout_outside_what_the_doctor_waits_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["doctor", "--timeout", value])
    assert stopped.value.code == 2
    assert "--timeout" in capsys.readouterr().err
