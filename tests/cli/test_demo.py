"""The README's main job, ``kvpolicy demo``, without its engine step (the e2e tests serve engines):
every step up to and including the simulation runs and reports success."""

from __future__ import annotations

import pytest
from conftest import require

require("vllm")
require("mooncake.store")


def test_the_demo_without_the_engine_runs_every_step_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpolicy.app.demo import run_demo

    code = run_demo(tp_size=2, with_engine=False)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "multi-rank simulation on the production worker" in out
    # The pre-fix rule's row must show the wrong state group caught, the others pass.
    assert "mamba:FAIL ranks 1" in out and "demo PASSED" in out
