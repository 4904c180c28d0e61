"""The package layout as the README draws it: a pure core, thin adapters, the simulation and the
application on top, and no module reaching into another's private names."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = ("models", "loader", "yamlsource", "expressions", "matcher", "engine", "plan", "keys", "audit",
        "diagnostics", "schema", "report", "catalog", "traffic", "dumper", "store_layout", "contract", "diff",
        "settings")
LAYERS = {
    "kvpolicy.runtime": {
        "kvpolicy.vllm", "kvpolicy.mooncake", "kvpolicy.sim", "kvpolicy.app", "kvpolicy.harness",
        "vllm", "torch", "mooncake",
    },
    "kvpolicy.device": {
        "kvpolicy.vllm", "kvpolicy.mooncake", "kvpolicy.sim", "kvpolicy.app", "kvpolicy.harness", "vllm", "mooncake",
    },
    "kvpolicy.mooncake": {"kvpolicy.vllm", "kvpolicy.sim", "kvpolicy.app", "kvpolicy.harness", "vllm"},
    "kvpolicy.vllm": {"kvpolicy.sim", "kvpolicy.app", "kvpolicy.harness"},
    "kvpolicy.sim": {"kvpolicy.app", "kvpolicy.harness"},
    "kvpolicy.harness": {"kvpolicy.app"},
    "kvpolicy.harness.fleet": {"kvpolicy.app", "kvpolicy.sim", "vllm", "mooncake", "torch"},
}
"""Package → the packages it must not import (data flows one way: core → runtime → adapters → sim → app;
the run-time policy is written against declared ports, so it imports neither vLLM, torch, Mooncake
nor any adapter; what runs on KV-cache tensors imports torch but neither vLLM nor Mooncake, so it runs
on a GPU host without them (scripts/gpu_check.py). The harness (engine and server runners, tiny models,
the fleet of test hosts) is tooling beside the simulation: it may use the adapters and the simulation,
and nothing in the product imports it; its fleet starts processes of the adapters and imports neither
vLLM nor Mooncake itself)."""


def python_files(*roots: str) -> Iterator[Path]:
    for root in roots:
        yield from sorted((REPO / root).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, imported name or None) of every import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None


def private_uses(path: Path) -> Iterator[str]:
    """``from kvpolicy.x import _name`` and ``x._name`` where ``x`` is an imported kvpolicy module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvpolicy"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {alias.name}"
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvpolicy"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            yield f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}"


SUBJECTS: dict[str, set[str]] = {}
"""Private names a test may reach because they are its subject (none today: vLLM's drift check
lives in kvpolicy.vllm.internals)."""


def test_no_module_imports_another_modules_private_names() -> None:
    found = [
        use
        for path in python_files("kvpolicy", "benchmarks", "tests", "scripts")
        for use in private_uses(path)
        if use.rsplit(": ", 1)[1] not in SUBJECTS.get(str(path.relative_to(REPO)), set())
    ]
    assert found == []


def test_the_private_name_check_sees_a_private_import(tmp_path: Path) -> None:
    probe = REPO / "tests" / "packaging" / "_probe_private_import.py"
    probe.write_text("from kvpolicy.engine import _decide_group\nfrom kvpolicy import keys\nkeys._x\n", encoding="utf-8")
    try:
        assert len(list(private_uses(probe))) == 2
    finally:
        probe.unlink()


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_neither_vllm_mooncake_torch_nor_the_adapters(module: str) -> None:
    path = REPO / "kvpolicy" / f"{module}.py"
    forbidden = (
        "vllm", "mooncake", "torch", "kvpolicy.vllm", "kvpolicy.mooncake", "kvpolicy.sim", "kvpolicy.app", "kvpolicy.harness",
    )
    bad = [f"{line}: {name}" for line, name, _ in imports(path) if name.split(".")[0] in forbidden[:3] or name.startswith(forbidden[3:])]
    assert bad == []


@pytest.mark.parametrize("package", LAYERS)
def test_a_layer_imports_nothing_above_it(package: str) -> None:
    root = REPO / Path(*package.split("."))
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in sorted(root.rglob("*.py"))
        for line, name, _ in imports(path)
        if any(name == above or name.startswith(f"{above}.") for above in LAYERS[package])
    ]
    assert bad == []


def test_simulated_instances_stores_and_ranks_live_in_the_simulation_only() -> None:
    names = {"Instance", "Fleet", "Rank", "RecordingStore", "CapturingStore", "ClientPool"}
    homes = {
        f"{module_name(path)}.{node.name}"
        for path in python_files("kvpolicy", "benchmarks", "tests")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.name in names
    }
    assert homes == {
        "kvpolicy.sim.instance.Instance",
        "kvpolicy.sim.fleet.Fleet",
        "kvpolicy.sim.rank.Rank",
        "kvpolicy.sim.store.RecordingStore",
        "kvpolicy.mooncake.pool.ClientPool",
    }


def test_only_the_internals_module_imports_vllms_private_names() -> None:
    # kvpolicy.vllm.internals declares vLLM's private surface and is checked against each release.
    found = [
        f"{path.relative_to(REPO)}:{line}: from {module} import {name}"
        for path in python_files("kvpolicy")
        if path != REPO / "kvpolicy" / "vllm" / "internals.py"
        for line, module, name in imports(path)
        if module.split(".")[0] == "vllm" and name is not None and name.startswith("_")
    ]
    assert found == []
