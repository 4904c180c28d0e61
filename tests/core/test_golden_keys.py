"""The key recipe is pinned: the shipped policies' keys on the example layouts are those recorded for
the current ``KEY_VERSION`` (``tests/golden/``, written by ``scripts/golden_keys.py``), so a change
that would make every instance miss what older ones stored cannot land without bumping the version."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import golden_keys

from kvpolicy.language.keys import KEY_VERSION

RECORDED = json.loads(golden_keys.golden_path().read_text(encoding="utf-8")) if golden_keys.golden_path().is_file() else None
BUMP = (
    "the store keys changed: instances of this version would miss every object stored by the last one; if that is "
    "deliberate, bump KEY_VERSION in kvpolicy/language/keys.py, say what changed, and run scripts/golden_keys.py --write"
)


def test_the_current_key_version_has_recorded_keys() -> None:
    assert RECORDED is not None, f"no {golden_keys.golden_path().name}: run scripts/golden_keys.py --write"
    assert RECORDED["key_version"] == KEY_VERSION


def test_every_case_is_recorded() -> None:
    assert RECORDED is not None
    recorded = [{key: case[key] for key in case if key not in ("fingerprint", "lookup_prefixes")} for case in RECORDED["cases"]]
    assert recorded == golden_keys.cases()


@pytest.mark.parametrize("index", range(len(golden_keys.cases())))
def test_keys_are_the_recorded_ones(index: int) -> None:
    assert RECORDED is not None
    recorded = RECORDED["cases"][index]
    assert golden_keys.keys_of(golden_keys.cases()[index]) == recorded, BUMP


def test_upstream_compatible_keys_are_vllms_own_spelling() -> None:
    # vLLM 0.32/0.33's MooncakeStoreWorker key prefix for DeepSeek-V3 at tp 1, written out by hand from its
    # KeyMetadata: model @tp_rank:T @pcp P @dcp D @pp_rank:R @group:G.
    assert RECORDED is not None
    (case,) = [c for c in RECORDED["cases"] if (c["policy"], c["layout"], c["tp"]) == ("vllm-compat", "deepseek-v3", 1)]
    assert case["lookup_prefixes"] == [["DeepSeek-V3@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"]]
