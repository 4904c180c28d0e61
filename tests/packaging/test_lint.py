"""The code stays clean: ruff (the rules in pyproject.toml's ``[tool.ruff.lint]``) finds nothing in the
repository, and mypy (``[tool.mypy]``: strict, over the core and the run-time policy) passes.

Both come with the ``test`` extra; without them these tests skip locally and fail under ``CI=true``.
Neither writes into the checkout: ruff runs without its cache, mypy with its cache in a temporary folder.
``.pre-commit-config.yaml`` runs the same two for developers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import require

REPO = Path(__file__).resolve().parents[2]


def run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    require(tool)
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )


def test_ruff_finds_nothing() -> None:
    result = run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_type_checker_passes_over_the_core_and_runtime(tmp_path: Path) -> None:
    # No paths given: the ones [tool.mypy] names (the core's front door and layer packages, kvpolicy/runtime).
    result = run("mypy", "--cache-dir", str(tmp_path / "mypy"), "--no-error-summary")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_developers_pre_commit_hooks_run_the_same_two() -> None:
    clientlib = require("pre_commit.clientlib")
    config = clientlib.load_config(str(REPO / ".pre-commit-config.yaml"))
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    assert hooks["ruff"]["entry"].split()[:2] == [".venv/bin/ruff", "check"]
    assert hooks["mypy"]["entry"] == ".venv/bin/mypy" and hooks["mypy"]["pass_filenames"] is False
