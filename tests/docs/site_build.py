"""The documentation site, built once per test session for every test that reads the built pages
(``from site_build import built_site``: a fixture, and the build it returns is cached)."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import unavailable

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BuiltSite:
    """``mkdocs build --strict`` of the checkout: where it wrote the site and what it said."""

    path: Path
    returncode: int
    stderr: str

    def page(self, relative: str) -> str:
        """The HTML of a page, by its path under the site (``reference/cli/index.html``)."""
        return (self.path / relative).read_text(encoding="utf-8")

    def pages(self) -> dict[str, str]:
        """Every page the build wrote (the theme's assets aside), by path."""
        return {
            str(path.relative_to(self.path)): path.read_text(encoding="utf-8")
            for path in sorted(self.path.rglob("index.html"))
            if "assets" not in path.relative_to(self.path).parts
        }


@functools.cache
def build_site() -> BuiltSite:
    """Build the site strictly, with its references and figures, into a temporary directory (about 2 s)."""
    root = Path(tempfile.mkdtemp(prefix="kvpolicy-docs-"))
    atexit.register(shutil.rmtree, root, True)  # removed when the test session's process exits
    site = root / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    return BuiltSite(site, built.returncode, built.stderr)


@pytest.fixture(scope="session")
def built_site() -> BuiltSite:
    missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
    if missing:
        unavailable(f"the documentation tools are not installed (pip install '.[docs]'): {', '.join(missing)}")
    return build_site()
