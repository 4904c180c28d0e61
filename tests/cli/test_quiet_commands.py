"""``kvpolicy audit`` and ``kvpolicy discover`` run vLLM, torch and Mooncake in-process: what those log
stays out of the command's results, which say each finding once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOG_NOTE = re.compile(r"^\(the log lines of vLLM, torch and Mooncake: (.+\.log)\)$")


def kvpolicy(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpolicy.app.cli", *argv], check=False, capture_output=True, text=True,
                          timeout=600, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def only_the_log_note(stderr: str) -> Path:
    """The one line on stderr is where the libraries' lines went; they are there, not on the terminal."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    found = LOG_NOTE.match(lines[0])
    assert found, stderr
    return Path(found.group(1))


def test_audit_says_a_demotion_once_and_keeps_library_lines_in_its_log(tmp_path: Path) -> None:
    policy = REPO / "examples" / "policies" / "pre-fix-single-factor.yaml"
    done = kvpolicy("audit", "--policy", str(policy), "--archetype", "kimi-linear", "--tp", "2", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("is declared replicated over 2 ranks") == 1, done.stdout
    assert done.stdout.splitlines()[-1].startswith("FAILED: 1 group(s) demoted")
    log = only_the_log_note(done.stderr)
    assert "Triton" in log.read_text() or "vllm" in log.read_text().lower()


def test_discover_prints_only_its_summary_and_keeps_library_lines_in_its_log(tmp_path: Path) -> None:
    done = kvpolicy("discover", "--archetype", "gqa-gdn", "--tp", "2", "--steps", "2", "--out", "d", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("d/gqa-gdn-tp2.yaml: gqa-gdn at tp 2")
    assert all(line.startswith("  group ") for line in lines[1:]), done.stdout
    only_the_log_note(done.stderr)
