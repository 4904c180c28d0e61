"""The ``vllm`` extra installs a Mooncake whose native modules NEED the CUDA runtime of the torch that
the chosen vLLM pins, as pip chooses them for a user on a Linux GPU host.

pip's own finder and metadata decide, one requirement at a time (``pip install --dry-run --report
--no-deps``): the vLLM the extra allows, the torch that vLLM pins, that torch's CUDA major (its
``cuda-toolkit`` / ``nvidia-*-cuNN`` requirements), the Mooncake build the extra names; then the
Mooncake wheel is downloaded and the ``libcudart.so.N`` its ``store.so`` and ``engine.so`` NEED is read
from their ELF dynamic sections. pip runs ``--isolated`` against ``https://pypi.org/simple`` only, so
this machine's pip configuration (local wheel directories, a torch constraint) cannot change the answer.

Reaches PyPI: without it the module skips, or fails under ``CI=true``. Downloads (the Mooncake wheels,
about 100 MB each) and pip's HTTP cache are kept in ``$KVPOLICY_PACKAGING_CACHE`` (default
``$TMPDIR/kvpolicy-gpu-extra``), so only the first run pays for them.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import unavailable
from packaging.requirements import Requirement
from packaging.version import Version

from kvpolicy.app.elf import cudart_majors, read_dynamic
from kvpolicy.vllm.version import SUPPORTED_SERIES

REPO = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple"
CACHE = Path(os.environ.get("KVPOLICY_PACKAGING_CACHE") or Path(tempfile.gettempdir()) / "kvpolicy-gpu-extra")
NATIVE_MODULES = ("mooncake/store.so", "mooncake/engine.so")
OLD_VLLM_EXTRA = ("vllm>=0.32,<0.34", "mooncake-transfer-engine>=0.3.13")
"""The ``vllm`` extra before issue 23: vLLM's CUDA 13 torch beside Mooncake's CUDA 12 build."""


def extra(name: str) -> tuple[str, ...]:
    """The requirements of one of kvpolicy's extras, as pyproject.toml lists them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return tuple(project["optional-dependencies"][name])


@dataclass(frozen=True)
class Chosen:
    """The distribution pip would install for one requirement, and its metadata."""

    name: str
    version: str
    requires_dist: tuple[str, ...]
    url: str

    def pins(self, name: str) -> list[Requirement]:
        """Its requirements on ``name`` that apply on this machine (Linux), outside any extra."""
        return [
            requirement
            for requirement in map(Requirement, self.requires_dist)
            if requirement.name == name and (requirement.marker is None or requirement.marker.evaluate({"extra": ""}))
        ]


@dataclass(frozen=True)
class Verdict:
    """What one list of requirements installs, as far as the CUDA runtime goes."""

    vllm: Chosen
    torch: Chosen
    torch_cuda_major: int
    """From the torch's requirements: ``cuda-toolkit==13.0.3`` or ``nvidia-*-cu13`` → 13."""
    mooncake: Chosen
    cudart: dict[str, frozenset[int]]
    """Per native module of the Mooncake wheel, the ``libcudart.so.N`` majors it NEEDS."""
    needed: dict[str, tuple[str, ...]]
    """Per native module, its whole NEEDED list."""

    @property
    def matches(self) -> bool:
        return all(majors == {self.torch_cuda_major} for majors in self.cudart.values())

    def __str__(self) -> str:
        runtimes = {module: ", ".join(f"libcudart.so.{major}" for major in sorted(majors))
                    for module, majors in self.cudart.items()}
        needs = ", ".join(
            f"{module.rsplit('/', 1)[1]} NEEDS {names or 'no libcudart'}" for module, names in runtimes.items()
        )
        return (f"vllm {self.vllm.version} pins torch {self.torch.version} (CUDA {self.torch_cuda_major}); "
                f"{self.mooncake.name} {self.mooncake.version}: {needs}")


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    return subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "--cache-dir",
         str(CACHE / "pip"), *args],
        capture_output=True, text=True, env=environment, timeout=300,
    )


@functools.cache
def choose(requirement: str) -> Chosen:
    """What ``pip install requirement`` would install from PyPI, without its dependencies."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        result = pip("install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--index-url", INDEX,
                     "--report", str(report), requirement)
        assert result.returncode == 0, f"pip cannot resolve {requirement}: {result.stderr[-2000:]}"
        (install,) = json.loads(report.read_text())["install"]
    metadata = install["metadata"]
    return Chosen(metadata["name"], metadata["version"], tuple(metadata.get("requires_dist", ())),
                  install["download_info"]["url"])


def cuda_major(torch: Chosen) -> int:
    """The CUDA major a torch wheel is built for, from the CUDA packages it requires."""
    majors = {Version(str(spec.version)).major for r in torch.pins("cuda-toolkit") for spec in r.specifier}
    majors |= {
        int(requirement.name.rsplit("-cu", 1)[1])
        for requirement in map(Requirement, torch.requires_dist)
        if requirement.name.startswith("nvidia-") and requirement.name.rsplit("-cu", 1)[-1].isdigit()
        and (requirement.marker is None or requirement.marker.evaluate({"extra": ""}))
    }
    assert len(majors) == 1, f"torch {torch.version} requires CUDA packages of majors {majors}"
    return majors.pop()


def download(chosen: Chosen) -> Path:
    """The wheel pip chose, downloaded once into the cache."""
    wheels = CACHE / "wheels"
    wheel = wheels / chosen.url.rsplit("/", 1)[1]
    if not wheel.is_file():
        result = pip("download", "--no-deps", "--only-binary", ":all:", "--quiet", "--index-url", INDEX,
                      "--dest", str(wheels), f"{chosen.name}=={chosen.version}")
        assert result.returncode == 0, f"pip cannot download {chosen.name}: {result.stderr[-2000:]}"
    assert wheel.is_file(), f"pip downloaded something else than {wheel.name}: {sorted(wheels.iterdir())}"
    return wheel


def resolve_extra(requirements: tuple[str, ...]) -> Verdict:
    """The vLLM, torch and Mooncake a list of requirements (an extra) installs, and the CUDA runtimes
    of the torch and of Mooncake's native modules."""
    (vllm,) = [r for r in requirements if Requirement(r).name == "vllm"]
    (mooncake,) = [r for r in requirements if Requirement(r).name.startswith("mooncake-transfer-engine")]
    return resolve(vllm, mooncake)


@functools.cache
def resolve(vllm_requirement: str, mooncake_requirement: str) -> Verdict:
    vllm = choose(vllm_requirement)
    (torch_pin,) = vllm.pins("torch")
    torch = choose(str(torch_pin))
    mooncake = choose(mooncake_requirement)
    with zipfile.ZipFile(download(mooncake)) as wheel:
        sections = {
            module: read_dynamic(wheel.read(module)) for module in NATIVE_MODULES if module in wheel.namelist()
        }
    assert set(sections) == set(NATIVE_MODULES), f"{mooncake.name} {mooncake.version} lacks {NATIVE_MODULES}"
    return Verdict(
        vllm=vllm, torch=torch, torch_cuda_major=cuda_major(torch), mooncake=mooncake,
        cudart={module: cudart_majors(section.needed) for module, section in sections.items()},
        needed={module: section.needed for module, section in sections.items()},
    )


@pytest.fixture(scope="module", autouse=True)
def pypi_reachable() -> None:
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError as error:
        unavailable(f"PyPI is not reachable ({error}); the GPU extra's resolution needs it")


def test_the_vllm_extra_installs_a_mooncake_whose_libcudart_is_torchs_cuda() -> None:
    verdict = resolve_extra(extra("vllm"))
    assert verdict.cudart == {module: {verdict.torch_cuda_major} for module in NATIVE_MODULES}, str(verdict)
    assert verdict.matches


def test_the_check_reports_the_old_extra_as_a_cuda_mismatch() -> None:
    verdict = resolve_extra(OLD_VLLM_EXTRA)
    assert not verdict.matches
    assert verdict.mooncake.name == "mooncake-transfer-engine"
    assert set(verdict.cudart.values()) != {frozenset({verdict.torch_cuda_major})}, str(verdict)


@pytest.mark.parametrize("series", SUPPORTED_SERIES, ids=lambda series: f"vllm-{series[0]}.{series[1]}")
def test_every_supported_vllm_series_pins_a_torch_of_the_cuda_mooncake_needs(series: tuple[int, int]) -> None:
    mooncake = next(r for r in extra("vllm") if Requirement(r).name.startswith("mooncake-transfer-engine"))
    verdict = resolve(f"vllm=={series[0]}.{series[1]}.*", mooncake)
    assert Version(verdict.vllm.version).release[:2] == series
    assert verdict.matches, str(verdict)


def test_the_gpu_mooncake_is_the_release_the_cpu_tests_run() -> None:
    """Both builds come from one Mooncake release, so the CPU tests exercise the API the GPU build has."""
    gpu = resolve_extra(extra("vllm")).mooncake
    (cpu,) = [Requirement(r) for r in extra("cpu") if Requirement(r).name.startswith("mooncake-transfer-engine")]
    assert cpu.name != gpu.name
    assert cpu.specifier.contains(gpu.version), (gpu.version, str(cpu.specifier))
