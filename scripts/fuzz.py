#!/usr/bin/env python3
"""A long fuzzing run of the loader, ``kvpolicy validate``, the expression evaluator and key templates.

    .venv/bin/python scripts/fuzz.py [--examples N] [--seed S] [--only TARGET ...] [--memory-mib M]

The strategies and contracts are the ones ``tests/faults/test_fuzz_loader.py`` runs a few hundred
times (``tests/faults/fuzz_strategies.py``). ``N`` inputs in total (default 10,000) are split over
the targets by weight; each target prints the inputs it ran and its time. A failing target prints
Hypothesis's shrunk falsifying example and the error; the other targets still run, and the script
exits 1. Needs the test extra (``hypothesis``), not vLLM or Mooncake.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "faults")]

import fuzz_strategies as fs  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SCRATCH = Path(tempfile.gettempdir()) / "kvpolicy-fuzz.yaml"
"""Where ``validate-cli`` writes each input; :func:`main` points it into a temporary directory."""

# name → (weight, strategy, contract)
TARGETS: dict[str, tuple[float, st.SearchStrategy[Any], Callable[[Any], None]]] = {
    "mutated-documents": (3, fs.mutated_documents(), fs.check_contract),
    "mangled-yaml-text": (3, fs.mutated_texts(), fs.check_contract),
    "generated-documents": (2, fs.generated_documents(), fs.check_contract),
    "validate-cli": (
        1,
        st.tuples(fs.raw_files(), st.sampled_from(["text", "json", "github", "sarif"])),
        lambda case: fs.validate_contract(case[0], case[1], SCRATCH),  # SCRATCH as set by main()
    ),
    "special-files": (
        0.3,
        st.tuples(st.sampled_from(fs.SPECIAL_FILES), st.sampled_from(["text", "json", "github", "sarif"])),
        lambda case: fs.special_file_contract(case[0], case[1], SCRATCH.parent),
    ),
    "cli-flags": (0.5, fs.plan_argvs(), fs.cli_contract),
    "command-line-edges": (0.5, fs.command_line_edges(), fs.cli_contract),
    "several-sizes": (0.2, st.lists(st.integers(1, 16), min_size=1, max_size=4), fs.several_sizes_contract),
    "doctor-config-files": (0.2, st.sampled_from(fs.SPECIAL_FILES), lambda kind: fs.doctor_config_contract(kind, SCRATCH.parent)),
    "side-file-settings": (0.5, fs.side_file_settings(), fs.side_file_settings_contract),
    "discovery-reports": (0.5, fs.discovery_reports(), lambda text: fs.discovery_report_contract(text, SCRATCH)),
    "alias-amplified-documents": (0.5, fs.alias_amplified_documents(), fs.memory_contract),
    "tagged-documents": (1, fs.tagged_documents(), fs.check_contract),
    "odd-paths": (
        0.5,
        st.tuples(fs.odd_file_names(), fs.raw_files(), st.sampled_from(["text", "json", "github", "sarif"])),
        lambda case: fs.odd_path_contract(case[0], case[1], case[2], SCRATCH.parent),
    ),
    "plan-documents": (0.5, fs.plan_documents(), lambda case: fs.plan_document_contract(case, SCRATCH.parent)),
    "expressions": (2, fs.expressions(), fs.expression_contract),
    "pathological-expressions": (0.5, fs.pathological_expressions(), fs.expression_contract),
    "key-templates": (1, fs.key_templates(), fs.template_contract),
}


def run_target(name: str, examples: int, random_seed: int | None) -> tuple[int, float, str | None]:
    """Run one target for ``examples`` inputs; return (inputs run, seconds, failure or None)."""
    _, strategy, contract = TARGETS[name]
    calls = 0

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(strategy)
    def property_(case: Any) -> None:
        nonlocal calls
        calls += 1
        contract(case)

    if random_seed is not None:
        property_ = seed(random_seed)(property_)
    started = time.perf_counter()
    try:
        property_()
    except Exception as error:  # noqa: BLE001 - every failure is reported, then the next target runs
        traceback.print_exc()
        return calls, time.perf_counter() - started, f"{type(error).__name__}: {str(error)[:300]}"
    return calls, time.perf_counter() - started, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000, help="inputs in total over all targets")
    parser.add_argument("--seed", type=int, help="Hypothesis seed, for a reproducible run")
    parser.add_argument("--only", nargs="+", choices=sorted(TARGETS), help="run these targets only")
    parser.add_argument(
        "--memory-mib", type=int, default=4096,
        help="address space of this process (RLIMIT_AS): an input that needs more fails its target (default 4096)",
    )
    args = parser.parse_args(argv)
    # Bounded memory is part of the contract: past the limit an input fails with MemoryError.
    resource.setrlimit(resource.RLIMIT_AS, (args.memory_mib << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))

    global SCRATCH
    scratch = tempfile.TemporaryDirectory(prefix="kvpolicy-fuzz-")
    SCRATCH = Path(scratch.name) / "fuzzed.yaml"
    try:
        return _run(args)
    finally:
        scratch.cleanup()


def _run(args: argparse.Namespace) -> int:
    names = args.only or list(TARGETS)
    weight = sum(TARGETS[name][0] for name in names)
    started = time.perf_counter()
    failures: dict[str, str] = {}
    total = 0
    print(f"fuzzing {len(names)} targets with {args.examples} inputs in total", flush=True)
    for name in names:
        share = max(1, round(args.examples * TARGETS[name][0] / weight))
        calls, seconds, failure = run_target(name, share, args.seed)
        total += calls
        status = "ok" if failure is None else "FAILED"
        print(f"{name:26} {calls:7d} inputs {seconds:8.1f} s  {status}", flush=True)
        if failure is not None:
            failures[name] = failure
    elapsed = time.perf_counter() - started
    print(f"{'total':26} {total:7d} inputs {elapsed:8.1f} s  {len(failures)} failed target(s)")
    for name, failure in failures.items():
        print(f"FAILED {name}: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
