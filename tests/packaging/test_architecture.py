"""The package layout as the README draws it: a pure core, thin adapters, the simulation and the
application on top, no import circles, and no module reaching into another's private names."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = ("models", "loader", "yamlsource", "expressions", "matcher", "engine", "plan", "keys", "audit",
        "diagnostics", "schema", "report", "catalog", "traffic", "dumper", "store_layout", "contract", "diff",
        "settings", "routers", "discovery", "propose")
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


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def shown(path: Path) -> Path:
    """``path`` as a finding names it: relative to the checkout, or whole where it lies elsewhere (a probe)."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


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
                    yield f"{shown(path)}:{node.lineno}: from {node.module} import {alias.name}"
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
            yield f"{shown(path)}:{node.lineno}: {node.value.id}.{node.attr}"


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
    probe = tmp_path / "probe_private_import.py"
    probe.write_text("from kvpolicy.engine import _decide_group\nfrom kvpolicy import keys\nkeys._x\n", encoding="utf-8")
    assert [use.split(": ", 1)[1] for use in private_uses(probe)] == [
        "from kvpolicy.engine import _decide_group",
        "keys._x",
    ]


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


def import_graph(root: Path = REPO, package: str = "kvpolicy") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports: every import in it, at the top, inside a function
    (a lazy import that dodges a circle is still the circle) or under ``TYPE_CHECKING``. ``from p import
    name`` is an edge to the submodule ``p.name`` where there is one, else to ``p`` (its ``__init__``)."""
    modules = {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package this module is in, up level - 1
                    anchor = here
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                if target == package or target.startswith(f"{package}."):
                    found = known(target)
                    if found is not None and found != module:
                        graph[module].add(found)
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion):
    modules that import each other, directly or around a longer loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_no_kvpolicy_modules_import_each_other_in_a_circle() -> None:
    # Dependencies go one way: a piece two modules share lives in a third, below both.
    assert circles(import_graph()) == []


def test_the_circle_check_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from pkg.sub.c import g  # lazy\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n",
        "d.py": "import pkg.a\nimport os\n",  # imports into the circle, is not part of it
        "e.py": "from . import f\n",
        "f.py": "from .e import y\n",
    }
    for name, text in files.items():
        (package / name).write_text(text, encoding="utf-8")
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.e", "pkg.f"]]


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


INTERNALS = REPO / "kvpolicy" / "vllm" / "internals.py"
OVERRIDE_HOME = REPO / "kvpolicy" / "vllm" / "worker.py"
"""The one module besides :data:`INTERNALS` that may define vLLM's private methods: KVPolicyStoreWorker,
for the override points upstream's MooncakeStoreWorker calls in its ``__init__`` (declared in
``internals.SURFACE`` with kind ``override``). Moving them would need a second class between the worker
and upstream's, for four methods whose whole job is to answer upstream from the plan."""


def vllm_private_names() -> tuple[frozenset[str], frozenset[str]]:
    """(every private name of vLLM's declared in ``internals.SURFACE``, those declared as override points
    of ``MooncakeStoreWorker``): the last part of each entry's name, where it starts with one underscore."""
    from kvpolicy.vllm.internals import SURFACE

    def private(name: str) -> str | None:
        last = name.rpartition(".")[2]
        return last if last.startswith("_") and not last.startswith("__") else None

    names = frozenset(name for entry in SURFACE if (name := private(entry.name)))
    overrides = frozenset(
        name
        for entry in SURFACE
        if entry.kind == "override" and entry.name.startswith("MooncakeStoreWorker.") and (name := private(entry.name))
    )
    return names, overrides


def vllm_private_touches(path: Path, names: frozenset[str], overrides: frozenset[str]) -> Iterator[str]:
    """Every read, write or call of a declared vLLM private name in ``path`` (``x._name`` whatever ``x``),
    every method defining one, and every ``from vllm... import _name``; a declared override point of the
    store worker may be defined in :data:`OVERRIDE_HOME`, and may call upstream's through ``super()``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = shown(path)
    allowed_overrides = overrides if path == OVERRIDE_HOME else frozenset()
    inside_override: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name in names:
                    if item.name in allowed_overrides:
                        for inner in ast.walk(item):
                            inside_override[id(inner)] = item.name
                    else:
                        yield f"{where}:{item.lineno}: defines {node.name}.{item.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            calls_super = (
                isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "super"
            )
            if calls_super and inside_override.get(id(node)) == node.attr:
                continue
            yield f"{where}:{node.lineno}: {ast.unparse(node)}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{where}:{node.lineno}: from {node.module} import {alias.name}"


def test_only_the_internals_module_touches_vllms_private_names() -> None:
    names, overrides = vllm_private_names()
    found = [
        touch
        for path in python_files("kvpolicy")
        if path != INTERNALS
        for touch in vllm_private_touches(path, names, overrides)
    ]
    assert found == []


def names_kvpolicy_defines() -> frozenset[str]:
    """Every name kvpolicy's own code binds (functions, classes, arguments, imports, variables, attributes
    it assigns), outside :data:`INTERNALS` (whose assignments are writes to vLLM's objects)."""
    found: set[str] = set()
    for path in python_files("kvpolicy"):
        if path == INTERNALS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
            elif isinstance(node, ast.alias):
                found.add(node.asname or node.name.split(".")[0])
    return frozenset(found)


def imports_vllm(path: Path) -> bool:
    return any(module.split(".")[0] == "vllm" for _, module, _ in imports(path))


def foreign_private_reads(path: Path, own: frozenset[str]) -> Iterator[str]:
    """``x._name`` in ``path`` where kvpolicy binds no ``_name`` anywhere (outside :data:`INTERNALS`):
    someone else's private name, declared in ``internals.SURFACE`` or not."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in own
        ):
            yield f"{shown(path)}:{node.lineno}: {ast.unparse(node)}"


NOT_VLLMS = {
    "_exit": "os._exit (the standard library: a child process ends without running the parent's handlers)",
    "_handle": "ctypes.CDLL._handle (the standard library: the dlopen handle doctor asks the loader about)",
}
"""Private names of other libraries that modules importing vLLM use, each with whose it is."""


def test_modules_using_vllm_read_no_private_name_but_their_own() -> None:
    # What the scan above cannot see: a private name of vLLM's that SURFACE does not declare yet.
    own = names_kvpolicy_defines() | NOT_VLLMS.keys()
    found = [
        read
        for path in python_files("kvpolicy")
        if path != INTERNALS and imports_vllm(path)
        for read in foreign_private_reads(path, own)
    ]
    assert found == []


def test_the_vllm_private_scan_sees_reads_writes_calls_overrides_and_undeclared_names(tmp_path: Path) -> None:
    probe = tmp_path / "probe_vllm_private.py"
    probe.write_text(
        "import vllm\n"
        "from vllm.x import _helper\n"
        "class Thread(Upstream):\n"
        "    def _record_operation(self): ...\n"
        "    def _compute_group_tp_replication_factors(self): ...\n"
        "def f(worker, pool):\n"
        "    worker._capacity_only\n"
        "    worker._lookup_key_prefixes = ()\n"
        "    worker._tail_key_boundaries()\n"
        "    pool._not_declared_anywhere\n",
        encoding="utf-8",
    )
    names, overrides = vllm_private_names()
    touches = [touch.split(": ", 1)[1] for touch in vllm_private_touches(probe, names, overrides)]
    foreign = [read.split(": ", 1)[1] for read in foreign_private_reads(probe, names_kvpolicy_defines())]
    assert sorted(touches) == sorted([
        "from vllm.x import _helper",
        "defines Thread._record_operation",
        # A declared override point of the store worker, outside worker.py.
        "defines Thread._compute_group_tp_replication_factors",
        "worker._capacity_only",
        "worker._lookup_key_prefixes",
        "worker._tail_key_boundaries",
    ])
    # Declared or not, a private name kvpolicy does not bind is someone else's.
    assert sorted(foreign) == [
        "pool._not_declared_anywhere",
        "worker._capacity_only",
        "worker._lookup_key_prefixes",
        "worker._tail_key_boundaries",
    ]
