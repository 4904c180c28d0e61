"""The package layout as the README draws it: a pure core, thin adapters, the simulation and the
application on top, no import circles, and no module reaching into another's private names."""

from __future__ import annotations

import ast
import itertools
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "kvpolicy"
CORE = ("kvpolicy.language", "kvpolicy.planning", "kvpolicy.evidence", "kvpolicy.documents")
"""The core's layer packages, lowest first: the policy language (what a policy, a layout and a topology
say, and how they are spelled: models, expressions, matching, keys, diagnostics, YAML in and out);
planning (what a policy means for one layout and topology: the engine, plans, store layouts, the key
contract, traffic, diffs); evidence (a plan checked against what is observed: the audit, discovery, the
routers that read the keys); the documents as files (the loader, the connector's settings, schemas,
reports, proposals). Which module is in which layer is where its file lies."""
STACK = (*CORE, PACKAGE, "kvpolicy.runtime", "kvpolicy.device", "kvpolicy.mooncake", "kvpolicy.vllm",
         "kvpolicy.sim", "kvpolicy.harness", "kvpolicy.app")
"""Every layer of kvpolicy, lowest first; a module imports nothing of a layer after its own (data flows one
way: core → runtime → adapters → sim → app). A module is in the layer of the longest package holding it,
so ``kvpolicy`` itself is ``kvpolicy/__init__.py`` alone: the front door, re-exporting the core's public
names, above the core and below everything that may use it. The run-time policy is written against
declared ports; the harness (engine and server runners, tiny models, the fleet of test hosts) is tooling
beside the simulation, and nothing in the product imports it."""
BARRED = {
    **{package: {"vllm", "torch", "mooncake"} for package in CORE},
    "kvpolicy.runtime": {"vllm", "torch", "mooncake"},
    "kvpolicy.device": {"vllm", "mooncake"},
    "kvpolicy.mooncake": {"vllm"},
    "kvpolicy.harness.fleet": {"vllm", "mooncake", "torch", "kvpolicy.sim"},
}
"""Package → what else it must not import, beside the layers above it: the core and the run-time policy
import neither vLLM, torch nor Mooncake; what runs on KV-cache tensors imports torch but neither vLLM nor
Mooncake, so it runs on a GPU host without them (scripts/gpu_check.py); the Mooncake adapter never imports
vLLM; the fleet of test hosts starts processes of the adapters and imports neither vLLM, Mooncake, torch
nor the simulation itself."""


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
    probe.write_text("from kvpolicy.planning.engine import _decide_group\nfrom kvpolicy.language import keys\nkeys._x\n", encoding="utf-8")
    assert [use.split(": ", 1)[1] for use in private_uses(probe)] == [
        "from kvpolicy.planning.engine import _decide_group",
        "keys._x",
    ]


def import_graph(root: Path = REPO, package: str = PACKAGE) -> dict[str, set[str]]:
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


def layer_of(module: str, stack: Sequence[str]) -> int | None:
    """The position in ``stack`` of the longest package holding ``module`` (None: in none)."""
    holding = [package for package in stack if module == package or module.startswith(f"{package}.")]
    return stack.index(max(holding, key=len)) if holding else None


def upward_imports(graph: Mapping[str, set[str]], stack: Sequence[str], package: str) -> list[str]:
    """``module -> imported`` for each module of layer ``package`` importing a module of a later layer."""
    here = stack.index(package)
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if layer_of(module, stack) == here
        for target in sorted(targets)
        if (there := layer_of(target, stack)) is not None and there > here
    ]


def barred_imports(root: Path, package: str, barred: set[str]) -> list[str]:
    """Every import, lazy or under ``TYPE_CHECKING`` too, in the files of ``package`` of a name in ``barred``
    (a library, by its top-level name, or a package of kvpolicy, with what it holds)."""
    return [
        f"{shown(path)}:{line}: {name}"
        for path in sorted((root / Path(*package.split("."))).rglob("*.py"))
        for line, name, _ in imports(path)
        if any(name == bar or name.startswith(f"{bar}.") for bar in barred)
    ]


def test_every_module_of_kvpolicy_lies_in_a_layer_package() -> None:
    # The folders show the layers: no flat module beside the front door, no package the stack does not name.
    root = REPO / PACKAGE
    assert sorted(path.name for path in root.glob("*.py")) == ["__init__.py"]
    assert {f"{PACKAGE}.{path.parent.name}" for path in root.glob("*/__init__.py")} == set(STACK) - {PACKAGE}
    assert all(layer_of(module, STACK) is not None for module in import_graph())


@pytest.mark.parametrize("package", STACK)
def test_a_layer_imports_nothing_above_it(package: str) -> None:
    assert upward_imports(import_graph(), STACK, package) == []


@pytest.mark.parametrize("package", BARRED)
def test_the_core_and_the_lower_layers_import_no_barred_library(package: str) -> None:
    assert barred_imports(REPO, package, BARRED[package]) == []


def test_the_type_checker_covers_every_core_package() -> None:
    files = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]["files"]
    assert set(files) >= {"kvpolicy/__init__.py", *(package.replace(".", "/") for package in CORE), "kvpolicy/runtime"}


def test_the_layer_checks_see_an_upward_import_and_a_barred_library(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    files = {
        "__init__.py": "from pkg.low.a import x\n",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.high import b  # lazy: still upward\n",
        "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch.nn\nfrom pkg import x\n",
        "high/__init__.py": "",
        "high/b.py": "import pkg.low.a\nimport torch\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text, encoding="utf-8")
    stack = ("pkg.low", "pkg", "pkg.high")
    graph = import_graph(tmp_path, "pkg")
    assert upward_imports(graph, stack, "pkg.low") == ["pkg.low.a -> pkg.high.b", "pkg.low.c -> pkg"]
    assert upward_imports(graph, stack, "pkg") == []
    assert upward_imports(graph, stack, "pkg.high") == []
    assert [found.split(": ", 1)[1] for found in barred_imports(tmp_path, "pkg.low", {"torch", "pkg.high"})] == [
        "pkg.high", "torch.nn",
    ]


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


ARCHITECTURE = REPO / "docs" / "contributing" / "architecture.md"
FEATURES_HEADING = "## Features by layer"
FEATURES = {"audit", "discovery", "proposal", "routers", "striping", "keys", "settings"}
"""The features the architecture page's table must have a row for, at least."""
COLUMNS = ("core", *(package.rpartition(".")[2] for package in STACK[len(CORE) + 1:]))
"""The table's layer columns, in :data:`STACK`'s order: the core's (cells relative to ``kvpolicy/``), then one per
package (cells relative to its folder)."""


def feature_rows(markdown: str) -> tuple[list[str], dict[str, list[list[str]]]]:
    """(the header's layer columns, feature -> the modules named in each column) of the first table under
    :data:`FEATURES_HEADING`; a module is a cell's ``code`` spans, a dash or nothing is none."""
    after = markdown.split(FEATURES_HEADING, 1)[1].splitlines()
    first = next(index for index, line in enumerate(after) if line.startswith("|"))
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), after[first:]))

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip().strip("|").split("|")]

    header, rows = cells(lines[0]), [cells(line) for line in lines[2:]]
    return header[1:], {row[0]: [re.findall(r"`([^`]+)`", cell) for cell in row[1:]] for row in rows}


def feature_table_problems(markdown: str, package: Path) -> list[str]:
    """What the table under :data:`FEATURES_HEADING` gets wrong about the modules under ``package``: a column
    other than :data:`COLUMNS`, a module named that is not there (or, in the core's column, lies outside the
    core's packages), a module of ``package`` in no row, a feature of :data:`FEATURES` with none."""
    columns, rows = feature_rows(markdown)
    if columns != list(COLUMNS):
        return [f"columns {columns}, not {list(COLUMNS)}"]
    core = {name.rpartition(".")[2] for name in CORE}
    problems, named = [], set()
    for feature, modules in rows.items():
        for column, names in zip(COLUMNS, modules, strict=True):
            for name in names:
                path = package / name if column == "core" else package / column / name
                if not path.is_file() or path.suffix != ".py":
                    problems.append(f"{feature}, {column}: no module {name}")
                elif column == "core" and Path(name).parts[0] not in core:
                    problems.append(f"{feature}, core: {name} lies outside the core's packages")
                named.add(path)
    unnamed = sorted(
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if path.name != "__init__.py" and path not in named and path.parent != package
    )
    problems += [f"in no row: {name}" for name in unnamed]
    problems += [f"no row for the feature {feature}" for feature in sorted(FEATURES - rows.keys())]
    return problems


def test_the_architecture_pages_feature_table_names_every_module_where_it_lies() -> None:
    assert feature_table_problems(ARCHITECTURE.read_text(encoding="utf-8"), REPO / PACKAGE) == []


def test_the_feature_table_check_sees_a_missing_a_misplaced_and_an_unnamed_module(tmp_path: Path) -> None:
    package = tmp_path / "kvpolicy"
    for name in ("language/keys.py", "runtime/binding.py", "runtime/striping.py", "app/cli.py"):
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("", encoding="utf-8")
    empty = " — |" * (len(COLUMNS) - 2)
    markdown = "\n".join([
        "# Architecture", "", FEATURES_HEADING, "",
        f"| feature | {' | '.join(COLUMNS)} |", "|---" * (len(COLUMNS) + 1) + "|",
        f"| keys | `language/keys.py`, `runtime/binding.py` | `binding.py`, `gone.py` |{empty}",
        f"| audit | — | — |{empty}",
        "", "| not | this | table |",
    ])
    assert feature_table_problems(markdown, package) == [
        "keys, core: runtime/binding.py lies outside the core's packages",
        "keys, runtime: no module gone.py",
        "in no row: app/cli.py",
        "in no row: runtime/striping.py",
        *(f"no row for the feature {feature}" for feature in sorted(FEATURES - {"keys", "audit"})),
    ]
    assert feature_table_problems(markdown.replace("| runtime |", "| run time |", 1), package) == [
        f"columns {['core', 'run time', *COLUMNS[2:]]}, not {list(COLUMNS)}",
    ]
