"""The pre-commit hook: its manifest is what pre-commit itself accepts, and pre-commit runs it on the
files it names, failing a commit on an invalid policy.

pre-commit installs a ``language: python`` hook by cloning this repository and pip-installing it,
which needs the package index; so the run here uses the manifest's own entry, file patterns and
types as a ``repo: local`` hook with ``language: system`` on this environment's ``kvpolicy``.
Everything else is the real pre-commit (``pre-commit run`` in a real git repository).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import require

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / ".pre-commit-hooks.yaml"
VALID = (REPO / "policies" / "default.yaml").read_text(encoding="utf-8")
INVALID = "version: 1\nkind: ReplicationPolicy\nname: x\nrules:\n  - name: r\n    replicaton: sharded\n"


def test_the_manifest_is_what_pre_commit_accepts() -> None:
    clientlib = require("pre_commit.clientlib")
    (hook,) = clientlib.load_manifest(str(MANIFEST))
    assert (hook["id"], hook["entry"], hook["language"]) == ("kvpolicy-validate", "kvpolicy validate", "python")


@pytest.fixture()
def repository(tmp_path: Path) -> Path:
    require("pre_commit")
    if shutil.which("git") is None:
        pytest.fail("git is needed to run pre-commit")
    (hook,) = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    kvpolicy = Path(sys.executable).with_name("kvpolicy")
    local = {**hook, "language": "system", "entry": f"{kvpolicy} validate"}
    local.pop("description", None)
    config = {"repos": [{"repo": "local", "hooks": [local]}]}
    (tmp_path / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


def pre_commit(repository: Path) -> subprocess.CompletedProcess[str]:
    subprocess.run(["git", "add", "-A"], cwd=repository, check=True)
    env = dict(os.environ, PRE_COMMIT_HOME=str(repository / ".cache"), SKIP="")
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", "--all-files", "--color", "never"],
        cwd=repository, capture_output=True, text=True, timeout=300, env=env, check=False,
    )


def test_pre_commit_passes_valid_policies_and_ignores_other_yaml(repository: Path) -> None:
    (repository / "policies").mkdir()
    (repository / "policies" / "site.yaml").write_text(VALID, encoding="utf-8")
    (repository / "deploy.yaml").write_text("apiVersion: v1\nkind: Pod\n", encoding="utf-8")  # not a policy
    result = pre_commit(repository)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvpolicy validate" in result.stdout and "Passed" in result.stdout


def test_pre_commit_fails_an_invalid_policy_with_its_located_errors(repository: Path) -> None:
    (repository / "team.kvpolicy.yaml").write_text(INVALID, encoding="utf-8")
    result = pre_commit(repository)
    assert result.returncode == 1
    assert "team.kvpolicy.yaml:6:5: error: unknown field 'replicaton'; did you mean 'replication'? [KVP102]" in result.stdout
