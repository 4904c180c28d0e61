"""The connector refuses, at import and in one line, a vLLM outside the releases it is checked against."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

from kvpolicy.vllm.version import UnsupportedVLLMError, check_vllm_version

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1.dev4+g1a2b3c", "0.33"])
def test_a_supported_release_passes(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.3.32", "0.320.0", "dev", ""])
def test_another_release_is_refused_in_one_line_naming_both(version: str) -> None:
    with pytest.raises(UnsupportedVLLMError) as refused:
        check_vllm_version(version)
    message = str(refused.value)
    assert "\n" not in message and f"vLLM {version!r} is installed" in message and "supports vLLM 0.32 and 0.33" in message


def test_the_installed_vllm_is_supported() -> None:
    vllm = require("vllm")
    check_vllm_version(vllm.__version__)


def test_the_vllm_under_test_is_the_one_asked_for() -> None:
    # tests/connector/test_vllm_033.py runs this module with vLLM 0.33 first on the path; a child that
    # silently imported the venv's 0.32 instead would prove nothing.
    # Without that request, the vLLM imported is the one installed in this environment.
    vllm = require("vllm")
    expected = os.environ.get("KVPOLICY_EXPECT_VLLM")
    if expected is None:
        assert Path(vllm.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), vllm.__file__
    else:
        assert vllm.__version__.startswith(f"{expected}."), (vllm.__version__, vllm.__file__)


def test_importing_the_connector_under_an_unsupported_vllm_stops_with_that_line() -> None:
    require("vllm")
    code = "import vllm; vllm.__version__ = '0.34.0'\nimport kvpolicy.vllm.connector"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""},
        timeout=300,
    )
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last.startswith("kvpolicy.vllm.version.UnsupportedVLLMError: kvpolicy supports vLLM")
