"""Pin the store keys of the shipped policies on the example layouts: ``tests/golden/keys-v<N>.json``.

Routers rebuild store keys, so a change of the key recipe (template rendering, fingerprint inputs)
must never land by accident. ``tests/core/test_golden_keys.py`` recomputes every case and compares;
after a deliberate change, bump ``KEY_VERSION`` in ``kvpolicy/language/keys.py`` (and say what changed in
its docstring), then run ``python scripts/golden_keys.py --write`` to record the new version's keys.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvpolicy.documents.loader import load_layout, load_policy, shipped_policy_names  # noqa: E402
from kvpolicy.language.keys import KEY_VERSION  # noqa: E402
from kvpolicy.language.models import Topology  # noqa: E402
from kvpolicy.planning.contract import key_contract  # noqa: E402
from kvpolicy.planning.engine import plan_deployment  # noqa: E402

LAYOUTS = ("deepseek-v3", "gpt-oss-120b", "kimi-linear-48b-a3b", "llama-3.1-70b", "nemotron-h-8b", "qwen3-next-80b-a3b")
EXTRA_CASES: tuple[dict[str, Any], ...] = (
    {"policy": "default", "layout": "deepseek-v3", "tp": 8, "dcp": 2},
    {"policy": "vllm-compat", "layout": "deepseek-v3", "tp": 8, "dcp": 2},
    {"policy": "default", "layout": "llama-3.1-70b", "tp": 4, "pp": 2},
    {"policy": "default", "layout": "llama-3.1-70b", "tp": 2, "store_tp": 8},
    {"policy": "vllm-compat", "layout": "llama-3.1-70b", "tp": 4, "store_tp": 8},
    {"policy": "default", "layout": "qwen3-next-80b-a3b", "tp": 4, "cache_prefix": "tenant-a"},
)
"""Cases beyond every shipped policy x example layout x tp 1/2/4/8: DCP, PP, a TP-sharded store, a cache prefix."""


def golden_path(version: int = KEY_VERSION) -> Path:
    return REPO / "tests" / "golden" / f"keys-v{version}.json"


def cases() -> list[dict[str, Any]]:
    grid = [
        {"policy": policy, "layout": layout, "tp": tp}
        for policy in shipped_policy_names()
        for layout in LAYOUTS
        for tp in (1, 2, 4, 8)
    ]
    return grid + list(EXTRA_CASES)


def keys_of(case: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint and every group's lookup prefixes of one case."""
    topology = Topology(tp_size=case["tp"], pp_size=case.get("pp", 1), dcp_size=case.get("dcp", 1))
    options = {"store_tp_size": case["store_tp"]} if "store_tp" in case else {}
    plan, layout, _ = plan_deployment(
        load_policy(case["policy"]), load_layout(case["layout"]), topology,
        extra_config={**options, "cache_prefix": case.get("cache_prefix", "")},
    )
    contract = key_contract(plan, layout)
    return {
        **case,
        "fingerprint": contract.fingerprint,
        "lookup_prefixes": [list(group.lookup_prefixes) for group in contract.groups],
    }


def compute() -> dict[str, Any]:
    return {"key_version": KEY_VERSION, "cases": [keys_of(case) for case in cases()]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {golden_path().relative_to(REPO)}")
    args = parser.parse_args()
    text = json.dumps(compute(), indent=1) + "\n"
    if args.write:
        golden_path().write_text(text, encoding="utf-8")
        print(f"wrote {golden_path().relative_to(REPO)}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
