"""The one drift check: every vLLM internal kvpolicy relies on (:data:`kvpolicy.vllm.internals.SURFACE`)
and every upstream constructor it repeats (:data:`~kvpolicy.vllm.internals.REPEATED_INITS`), against
the installed vLLM 0.32 and against vLLM 0.33 in a child process. An upgrade that renames, removes or
re-signs one of them fails here, with one line per entry."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conftest import require, unavailable

require("vllm")
require("mooncake.store")

from kvpolicy.vllm.internals import (  # noqa: E402
    REPEATED_INITS,
    SURFACE,
    WORKER,
    Internal,
    RepeatedInit,
    assignments_and_calls,
    assignments_and_calls_in,
    drift,
    resolve,
)

REPO = Path(__file__).resolve().parents[2]
VLLM_033 = Path(os.environ.get("KVPOLICY_VLLM_033", Path(sys.prefix) / "vllm-0.33"))


def test_the_installed_vllm_has_kvpolicys_surface() -> None:
    assert drift() == []


def test_vllm_0_33_has_kvpolicys_surface() -> None:
    if not (VLLM_033 / "vllm" / "__init__.py").is_file():
        unavailable(f"vLLM 0.33 is not installed in {VLLM_033} (scripts/bootstrap.sh installs it)")
    code = "import json, vllm; from kvpolicy.vllm.internals import drift; print(json.dumps([vllm.__version__, drift()]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(VLLM_033), str(REPO)]), "VLLM_TARGET_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    version, problems = json.loads(result.stdout.strip().splitlines()[-1])
    assert (version.startswith("0.33"), problems) == (True, [])


def test_the_surface_names_each_entry_once() -> None:
    names = [(entry.module, entry.name) for entry in SURFACE]
    assert len(names) == len(set(names))


def test_a_changed_signature_is_one_line_naming_the_entry_and_both_signatures() -> None:
    entry = Internal(WORKER, "MooncakeStoreWorker._select_store_layout", "override", "(self, extra_config, extra)", "test")
    assert drift([entry], ()) == [
        f"{WORKER}.MooncakeStoreWorker._select_store_layout: parameters were (self, extra_config, extra), "
        "are now (self, extra_config) (test)"
    ]


def test_a_name_vllm_no_longer_has_is_reported() -> None:
    assert drift([Internal(WORKER, "MooncakeStoreWorker._gone", "call", "(self)", "test")], ()) == [
        f"{WORKER}.MooncakeStoreWorker._gone: is gone"
    ]


def test_an_attribute_upstream_no_longer_sets_is_reported() -> None:
    assert drift([Internal(WORKER, "MooncakeStoreWorker._never_set", "attribute", None, "test")], ()) == [
        f"{WORKER}.MooncakeStoreWorker._never_set: upstream no longer sets self._never_set"
    ]


def test_an_attribute_a_base_class_sets_counts() -> None:
    # KVCacheStoreSendingThread's store is set by its base class's __init__.
    assert drift([entry for entry in SURFACE if entry.name == "KVCacheStoreSendingThread.store"], ()) == []


def lacking(worker: object) -> None:
    worker.tp_rank = 0  # type: ignore[attr-defined]


def test_a_repeated_constructor_missing_an_upstream_line_is_reported() -> None:
    repeated = RepeatedInit(f"{WORKER}:MooncakeStoreWorker.__init__", f"{__name__}:lacking", "worker")
    problems = drift((), [repeated])
    assert f"{WORKER}.MooncakeStoreWorker.__init__: `self.tp_size =` is not repeated by {__name__}:lacking" in problems
    assert not any("`self.tp_rank =`" in problem for problem in problems)


def test_a_replaced_line_upstream_dropped_is_reported() -> None:
    standalone = REPEATED_INITS[0]
    stale = RepeatedInit(
        standalone.upstream, standalone.ours, standalone.receiver,
        replaced=(*standalone.replaced, ("self._dropped()", "test")),
    )
    assert drift((), [stale]) == [
        f"{WORKER}.MooncakeStoreWorker.__init__: no longer has `self._dropped()` that {standalone.ours} replaces"
    ]


@pytest.mark.parametrize("repeated", REPEATED_INITS, ids=lambda repeated: repeated.ours.rpartition(":")[2])
def test_every_repeated_constructor_sets_attributes_and_calls(repeated: RepeatedInit) -> None:
    # The check is not vacuous: both sides of each comparison hold statements.
    module, _, name = repeated.upstream.partition(":")
    ours_module, _, ours_name = repeated.ours.partition(":")
    assert len(assignments_and_calls(resolve(module, name), "self")) > 3
    assert len(assignments_and_calls(resolve(ours_module, ours_name), repeated.receiver)) > 3


def upstream_names() -> set[str]:
    """Every attribute vLLM's store worker, its threads and its connector have or set (minus Python's
    own ``threading.Thread``'s)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        KVCacheStoreRecvingThread,
        KVCacheStoreSendingThread,
        MooncakeStoreWorker,
    )

    names: set[str] = set()
    for cls in (MooncakeStoreWorker, KVCacheStoreSendingThread, KVCacheStoreRecvingThread, MooncakeStoreConnector):
        for klass in inspect.getmro(cls):
            if klass in (object, threading.Thread):
                continue
            names |= set(vars(klass))
            source = textwrap.dedent(inspect.getsource(klass))
            names |= {item.removeprefix("self.").rstrip(" =()") for item in assignments_and_calls_in(source, "self")}
    return names - set(dir(threading.Thread))


def test_every_private_name_of_vllms_that_kvpolicy_touches_is_declared() -> None:
    touched: dict[str, set[str]] = {}
    for path in sorted([*(REPO / "kvpolicy" / "vllm").glob("*.py"), *(REPO / "kvpolicy" / "sim").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                touched.setdefault(node.attr, set()).add(f"{path.relative_to(REPO)}:{node.lineno}")
    undeclared_names = upstream_names() - {entry.name.rpartition(".")[2] for entry in SURFACE}
    undeclared = {name: sorted(where) for name, where in touched.items() if name in undeclared_names}
    assert undeclared == {}
