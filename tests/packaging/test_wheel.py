"""A normal, non-editable install finds the shipped policies, schemas and example layouts by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, kvpolicy
from kvpolicy.documents.loader import load_policy, load_layout, policies_dir, layouts_dir, shipped_policy_names
from kvpolicy.documents.schema import stale_files
from kvpolicy.documents.loader import schemas_dir
print(json.dumps({
    "module": kvpolicy.__file__,
    "policies_dir": str(policies_dir()),
    "names": list(shipped_policy_names()),
    "default_rules": len(load_policy("default").rules),
    "layout_groups": len(load_layout("kimi-linear-48b-a3b").groups),
    "stale_schemas": [str(p) for p in stale_files(schemas_dir())],
}))
"""


@pytest.fixture(scope="module")
def installed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(work.glob("kvpolicy-*.whl"))
    site = work / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    return site


def _probe(site: Path, cwd: Path) -> dict[str, object]:
    # PYTHONPATH puts the installed copy ahead of the repository's editable install.
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_installed_wheel_finds_shipped_policies_by_name(installed_site: Path, tmp_path: Path) -> None:
    found = _probe(installed_site, tmp_path)
    assert str(found["module"]).startswith(str(installed_site))
    assert str(found["policies_dir"]).startswith(str(installed_site))
    assert found["names"] == sorted(path.stem for path in (REPO / "policies").glob("*.yaml"))
    assert found["default_rules"] > 0


def test_installed_wheel_carries_example_layouts_and_current_schemas(installed_site: Path, tmp_path: Path) -> None:
    found = _probe(installed_site, tmp_path)
    assert found["layout_groups"] > 0
    assert found["stale_schemas"] == []
