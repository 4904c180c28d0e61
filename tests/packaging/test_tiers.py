"""The tier table (tests/tiers.py): every test file has a tier, the fast tiers import nothing of the
others, covering subsets cover, and hypothesis budgets come from the dev / ci profiles."""

from __future__ import annotations

import ast
import importlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
import tiers
from hypothesis import given
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def suite_files() -> list[str]:
    return sorted(path.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py"))


def test_every_test_file_has_a_tier() -> None:
    assert [file for file in suite_files() if tiers.declared(file) is None] == []


def test_every_file_in_the_table_exists() -> None:
    files = {key.split("::", 1)[0] for key in tiers.TIERS}
    assert sorted(files - set(suite_files())) == []


def test_every_per_test_entry_names_a_test_of_its_file() -> None:
    unmatched = []
    for key in tiers.TIERS:
        if "::" not in key:
            continue
        file, pattern = key.split("::", 1)
        tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
        names = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
        if not any(tiers.fnmatch.fnmatchcase(name, pattern) for name in names):
            unmatched.append(key)
    assert unmatched == []


def test_every_tier_in_the_table_is_a_registered_marker(pytestconfig: pytest.Config) -> None:
    markers = {line.split(":", 1)[0] for line in pytestconfig.getini("markers")}
    used = {tier for value in tiers.TIERS.values() for tier in ((value,) if isinstance(value, str) else value)}
    assert used <= set(tiers.TIER_NAMES) <= markers


def test_the_connector_folder_is_named_in_one_place() -> None:
    text = (TESTS / "tiers.py").read_text(encoding="utf-8")
    assert text.count(f'"{tiers.CONNECTOR}/') == 0
    assert any(key.startswith(f"{tiers.CONNECTOR}/") for key in tiers.TIERS)


def test_a_fixture_of_a_costlier_tier_raises_the_test_to_it() -> None:
    assert tiers.tier_of("cli/test_doctor.py", "test_a_closed_port_fails_at_once", ["tmp_path"]) == "contract"
    assert tiers.tier_of("cli/test_doctor.py", "test_a_real_master_answers", ["mooncake_master"]) == "sim"


def test_a_per_test_entry_overrides_its_files_tier() -> None:
    name = "test_every_check_passes_on_cpu_tensors_with_nothing_skipped"
    assert tiers.tier_of("device/test_gpu_check.py", name, []) == "sim"
    assert tiers.tier_of("device/test_gpu_check.py", "test_a_failed_check_makes_the_exit_status_one", []) == "contract"


def selecting(tier: str) -> SimpleNamespace:
    return SimpleNamespace(getoption=lambda name: tier if name == "--tier" else None)


@pytest.mark.parametrize("tier", tiers.TIER_NAMES)
def test_a_tier_run_imports_exactly_the_modules_that_hold_that_tier(tier: str) -> None:
    ignored = {file for file in suite_files() if conftest.pytest_ignore_collect(TESTS / file, selecting(tier))}
    holding = {file for file in suite_files() if tier in (tiers.declared(file) or ())}
    assert ignored == set(suite_files()) - holding


def test_no_tier_selected_ignores_nothing() -> None:
    assert not any(conftest.pytest_ignore_collect(TESTS / file, selecting(None)) for file in suite_files())


def test_an_unknown_tier_is_a_usage_error_naming_the_tiers() -> None:
    with pytest.raises(pytest.UsageError, match="unknown tier fast; tiers are pure, contract, sim, engine, exhaustive"):
        conftest.selected_tiers(selecting("pure,fast"))


def test_a_test_file_without_a_tier_fails_collection() -> None:
    probe = TESTS / "packaging" / "test_probe_without_a_tier.py"
    probe.write_text("def test_nothing():\n    pass\n", encoding="utf-8")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", str(probe), "--collect-only", "-q", "-p", "no:cacheprovider"],
            capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
        )
    finally:
        probe.unlink()
    assert run.returncode != 0
    assert "tests/packaging/test_probe_without_a_tier.py has no tier: add it to TIERS in tests/tiers.py" in run.stdout


PARAMETERS = st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4)


def product(sizes: list[int]) -> list[tiers.Facets]:
    return [
        tiers.facets({f"p{i}": value for i, value in enumerate(cell)}, {f"p{i}": value for i, value in enumerate(cell)})
        for cell in itertools.product(*(range(size) for size in sizes))
    ]


@given(PARAMETERS)
def test_each_value_keeps_every_value_of_every_parameter(sizes: list[int]) -> None:
    cells = product(sizes)
    kept = tiers.covering(cells, "each-value")
    assert set().union(*(cells[i] for i in kept)) == set().union(*cells)
    assert len(kept) <= sum(sizes)


@given(PARAMETERS)
def test_pairwise_keeps_every_pair_of_values(sizes: list[int]) -> None:
    cells = product(sizes)
    kept = tiers.covering(cells, "pairwise")
    pairs = {pair for i in kept for pair in itertools.combinations(sorted(cells[i]), 2)}
    assert pairs == {pair for cell in cells for pair in itertools.combinations(sorted(cell), 2)}


def test_each_value_keeps_one_cell_per_new_value_of_a_product() -> None:
    assert len(tiers.covering(product([9, 4, 4, 2]), "each-value")) == 1 + 8 + 3 + 3 + 1


def test_a_dataclass_parameter_counts_each_field() -> None:
    @tiers.dataclasses.dataclass(frozen=True)
    class Case:
        model: str
        tp: int

    assert tiers.facets({"case": Case("mla", 2)}, {"case": 0}) == {("case.model", "'mla'"), ("case.tp", "2")}


def test_the_first_cell_bringing_a_new_value_is_kept() -> None:
    # cell index = 8 a + 2 b + c over a in 0..2, b in 0..3, c in 0..1
    assert tiers.covering(product([3, 4, 2]), "each-value") == [0, 1, 2, 4, 6, 8, 16]


@pytest.mark.parametrize(("ci", "profile"), [("true", "ci"), ("", "dev")])
def test_hypothesis_budgets_come_from_the_profile_ci_selects(ci: str, profile: str) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("CI", "HYPOTHESIS_PROFILE")}
    probe = "import conftest; from hypothesis import settings; print(settings.default.max_examples)"
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False,
        env={**env, "CI": ci, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])},
    )
    assert run.returncode == 0, run.stderr
    expected = {"ci": conftest.CI_EXAMPLES, "dev": conftest.DEV_EXAMPLES}[profile]
    assert int(run.stdout) == expected


def test_no_test_sets_its_own_hypothesis_budget() -> None:
    sites = [
        f"{path.relative_to(TESTS)}:{node.lineno}"
        for path in TESTS.rglob("*.py")
        if path.name != "conftest.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.keyword) and node.arg == "max_examples"
    ]
    assert sites == []


def test_a_test_folder_named_like_a_package_is_not_that_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvpolicy_probe_pkg").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not tiers.installed("kvpolicy_probe_pkg")
    (tmp_path / "kvpolicy_probe_pkg" / "__init__.py").write_text("", encoding="utf-8")
    importlib.invalidate_caches()
    assert tiers.installed("kvpolicy_probe_pkg")


def test_the_tiers_beyond_pure_need_vllm_and_torch_and_pure_needs_nothing() -> None:
    assert tiers.NEEDS["pure"] == ()
    assert all({"vllm", "torch"} <= set(tiers.NEEDS[tier]) for tier in tiers.TIER_NAMES if tier != "pure")


BLOCKED_IMPORTS = """
import importlib.util, sys
for name in ("vllm", "torch", "mooncake"):
    sys.modules[name] = None  # importing it now raises ImportError, as on a machine without it
sys.path[:0] = [sys.argv[1]]
failed = []
for file in sys.argv[2:]:
    sys.path.insert(0, f"{sys.argv[1]}/{file.rsplit('/', 1)[0]}")  # as pytest puts a module's folder first
    spec = importlib.util.spec_from_file_location(file.replace("/", ".")[:-3], f"{sys.argv[1]}/{file}")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # a module-level skip (pytest's Skipped) counts too
        failed.append(f"{file}: {type(error).__name__}: {error}")
print("\\n".join(failed))
"""


def test_the_pure_tiers_modules_import_without_vllm_torch_or_mooncake() -> None:
    pure = [file for file in suite_files() if tiers.default_tier(file) == "pure"]
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORTS, str(TESTS), *pure],
        capture_output=True, text=True, cwd=REPO, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == ""
