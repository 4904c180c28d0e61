"""Every test file's tier: what its tests need to run, assigned here and nowhere else.

Tiers, cheapest first (a test's tier is the first one whose needs cover it):

- ``pure``: kvpolicy's own code only (pydantic, PyYAML, jsonschema, hypothesis): no vLLM, torch or
  Mooncake. Runs on a machine with only the core installed.
- ``contract``: vLLM's classes, torch, the installed Mooncake package, a kvpolicy subprocess; no
  Mooncake master.
- ``sim``: a real Mooncake master on 127.0.0.1 (the ``mooncake_master`` / ``clients`` fixtures):
  simulated instances running the production worker.
- ``engine``: real vLLM engines and OpenAI servers, network-namespace hosts, child test runs (vLLM
  0.33), wheel builds and the package index.
- ``exhaustive``: full cross-products. Where a file's parametrized tests re-check one assertion over
  a product of parameters (:data:`COVERED`), the fast tiers run a covering subset and the rest of the
  product is ``exhaustive``. Hypothesis budgets are not a tier: they come from the ``dev`` / ``ci``
  profiles (``tests/conftest.py``).

``pytest`` with no ``--tier`` runs every tier (CI: ``.ci/run``). ``pytest --tier pure,contract`` (the
README's dev loop) does not even import the modules of the other tiers.

A test file missing from :data:`TIERS` fails collection: a new file gets a tier here. A test that
uses a fixture of a costlier tier (:data:`FIXTURE_TIERS`) is raised to that tier, and the file must
list that tier too, so the table stays what runs.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TIER_NAMES = ("pure", "contract", "sim", "engine", "exhaustive")
"""Tiers, cheapest first; each is a pytest marker (``-m sim``) and a ``--tier`` value."""

CONNECTOR = "connector"
"""The folder of the connector's tests: not ``vllm``, which would shadow the ``vllm`` package wherever
vLLM is not installed (pytest puts ``tests/`` on ``sys.path``)."""

C = CONNECTOR

TIERS: dict[str, str | tuple[str, ...]] = {
    # --- the core -------------------------------------------------------------------------------
    "core/test_attention_free.py": "pure",
    "core/test_audit.py": "pure",
    "core/test_audit_state.py": "pure",
    "core/test_discovery.py": "pure",
    "core/test_engine_properties.py": "pure",
    "core/test_engine_reference.py": "pure",
    "core/test_expressions.py": "pure",
    "core/test_fingerprint_coverage.py": "pure",
    "core/test_frozen_documents.py": "pure",
    "core/test_golden_keys.py": "pure",
    "core/test_hostile_inputs.py": ("pure", "contract"),
    "core/test_hostile_inputs.py::test_audit_without_vllm_is_one_line_naming_what_to_install": "contract",
    "core/test_hostile_inputs.py::test_the_connector_refuses_a_policy_path_holding_a_nul_with_its_configuration_error": "contract",
    "core/test_key_contract.py": "pure",
    "core/test_key_grammar.py": "pure",
    "core/test_layout_dump.py": "pure",
    "core/test_layouts_and_policies.py": "pure",
    "core/test_layer_kv_heads.py": "pure",
    "core/test_layer_kv_heads_dump.py": "pure",
    "core/test_loader_errors.py": "pure",
    "core/test_one_source_of_validity.py": "pure",
    "core/test_plain_reader.py": "pure",
    "core/test_plan_cache.py": "pure",
    "core/test_plan_error_locations.py": "pure",
    "core/test_plan_sharing.py": "pure",
    "core/test_router_descriptor.py": "pure",
    "core/test_router_grammar.py": "pure",
    "core/test_store_layout.py": "pure",
    "core/test_striping_schedule.py": "pure",
    "core/test_topology_dependent_layouts.py": "pure",
    "core/test_traffic.py": "pure",
    "core/test_validation_fast_paths.py": "pure",
    "core/test_settings.py": "pure",
    "core/test_trust_settings.py": "pure",
    "faults/test_fuzz_loader.py": "pure",
    # --- the run-time policy without vLLM (in-memory store, list collective, hand clock) --------------
    "runtime/test_rank_discovery.py": "pure",
    "runtime/test_read_failures.py": "pure",
    "runtime/test_markers.py": "pure",
    "runtime/test_policy.py": "pure",
    "runtime/test_binding.py": "pure",
    "runtime/test_dynamo_descriptor_file.py": "pure",
    "runtime/test_trust.py": "pure",
    # --- the command line -----------------------------------------------------------------------
    "cli/test_cli.py": "pure",
    "cli/test_command_line.py": ("pure", "contract"),
    "cli/test_command_line.py::test_the_archetype_names_are_the_simulations": "contract",
    "cli/test_command_line.py::test_wrong_names_paths_and_values_are_refused_before_torch_or_vllm_is_imported": "contract",
    "cli/test_diagnostic_formats.py": "pure",
    "cli/test_quiet_commands.py": "sim",
    "cli/test_discover.py": ("pure", "contract"),
    "cli/test_discover.py::test_layout_refusals_come_before_torch_vllm_or_mooncake_is_imported": "contract",
    "cli/test_diff.py": "pure",
    "cli/test_topology_flags.py": "pure",
    "cli/test_elf.py": "contract",
    "cli/test_document_kinds.py": ("contract", "sim"),
    # kvpolicy audit on an archetype starts its own Mooncake master.
    "cli/test_document_kinds.py::test_the_audit_report_carries_its_kind_and_version": "sim",
    "cli/test_document_kinds.py::test_an_enforced_audits_stop_is_an_audit_report_too": "sim",
    "cli/test_doctor.py": ("contract", "sim"),
    "cli/test_demo.py": "engine",
    "cli/test_rule.py": "pure",
    # --- the documentation site -----------------------------------------------------------------
    "docs/test_docs_site.py": ("pure", "contract", "engine"),
    "docs/test_docs_site.py::test_the_metrics_reference_names_every_series_and_operation_*": "contract",
    "docs/test_docs_site.py::test_the_site_builds_strictly_with_its_references": "engine",
    "docs/test_rendering.py": ("pure", "engine"),
    "docs/test_figures.py": "pure",
    "docs/test_quickstart.py": ("pure", "engine"),
    "docs/test_quickstart.py::test_the_quickstart_runs_*": "engine",
    # --- packaging ------------------------------------------------------------------------------
    "packaging/test_architecture.py": "pure",
    "packaging/test_lint.py": "pure",
    "packaging/test_tiers.py": "pure",
    "packaging/test_pre_commit.py": "contract",
    "packaging/test_wheel.py": "engine",
    "packaging/test_gpu_extra.py": "engine",
    # --- the device paths without vLLM (scripts/gpu_check.py on CPU tensors) ------------------------
    "device/test_gpu_check.py": ("contract", "sim"),
    "device/test_gpu_check.py::test_every_check_passes_on_cpu_tensors_with_nothing_skipped": "sim",
    "device/test_gpu_check.py::test_a_wrong_byte_read_back_fails_the_mooncake_check": "sim",
    "device/test_device_paths.py": "contract",
    # --- the connector against vLLM's classes -----------------------------------------------------
    f"{C}/test_metric_value.py": "pure",
    f"{C}/test_audit_cache_dtypes.py": "contract",
    f"{C}/test_compat_equivalence.py": "contract",
    f"{C}/test_connector_config.py": "contract",
    f"{C}/test_hybrid_block_sizes.py": "contract",
    f"{C}/test_layout_adapter.py": "contract",
    f"{C}/test_layout_capture.py": "contract",
    f"{C}/test_gemma4_example_layout.py": "contract",
    f"{C}/test_layer_kv_heads_adapter.py": "contract",
    f"{C}/test_standalone_worker.py": "contract",
    f"{C}/test_sim_layer_heads_truth.py": "contract",
    f"{C}/test_store_tp_layouts.py": "contract",
    f"{C}/test_tinymodel.py": "contract",
    f"{C}/test_vllm_version.py": "contract",
    f"{C}/test_vllm_internals.py": ("contract", "engine"),
    f"{C}/test_vllm_internals.py::test_vllm_0_33_has_kvpolicys_surface": "engine",
    "zoo/test_coverage.py": "contract",
    "zoo/test_error_line.py": "contract",
    "zoo/test_families.py": "contract",
    "zoo/test_shrink.py": "contract",
    "faults/test_policy_read_once.py": "contract",
    # --- simulated instances on a real master -----------------------------------------------------
    f"{C}/test_audit_harness.py": "sim",
    f"{C}/test_connector_metrics.py": "sim",
    f"{C}/test_harness_consistency.py": "sim",
    f"{C}/test_merged_saves.py": "sim",
    f"{C}/test_minimal_lookup.py": "sim",
    f"{C}/test_mixed_device_caches.py": "sim",
    f"{C}/test_sim_dcp.py": "sim",
    f"{C}/test_sim_discovery.py": "sim",
    f"{C}/test_sim_layer_kv_heads.py": "sim",
    f"{C}/test_sim_production_worker.py": "sim",
    f"{C}/test_striped_loads.py": "sim",
    "faults/test_cross_tp_store.py": "sim",
    "faults/test_mixed_fleets.py": "sim",
    "faults/test_mooncake_faults.py": "sim",
    "integration/test_mooncake_master.py": "sim",
    "integration/test_protected_store.py": "sim",
    # --- real engines, servers, hosts -------------------------------------------------------------
    f"{C}/test_vllm_033.py": "engine",
    "e2e/test_audit_engine.py": "engine",
    "e2e/test_discovery_engine.py": "engine",
    "e2e/test_hybrid_engine.py": "engine",
    "e2e/test_layer_kv_heads_engine.py": "engine",
    "e2e/test_load_failure_engine.py": "engine",
    "e2e/test_poisoned_store_engine.py": "engine",
    "e2e/test_shared_memory_reclaim.py": "contract",
    "e2e/test_openai_server.py": "engine",
    "e2e/test_vllm_engine.py": "engine",
    "e2e/test_zoo_engine.py": "engine",
    "fleet/test_hosts.py": "engine",
    "fleet/test_netns.py": "engine",
}
"""Test file (relative to ``tests/``) → its tier, or its tiers with the default first. A key may also
be ``file::test_name`` (an ``fnmatch`` pattern on the test function's name) to give one test of a
file another tier."""

NEEDS: dict[str, tuple[str, ...]] = {
    "pure": (),
    "contract": ("vllm", "torch"),
    "sim": ("vllm", "torch", "mooncake"),
    "engine": ("vllm", "torch", "mooncake"),
    "exhaustive": ("vllm", "torch"),
}
"""Packages a tier's modules need installed: a module whose file's tier needs a missing one is not
imported and skips (fails under ``CI=true``), so a machine with only the core collects cleanly."""

FIXTURE_TIERS = {
    "mooncake_master": "sim",
    "clients": "sim",
    "e2e_master": "engine",
    "e2e_store_config": "engine",
    "built_site": "engine",
}
"""Fixtures that need a costlier tier than their file's default: a test using one is in that tier."""

COVERED: dict[str, str] = {
    f"{C}/test_compat_equivalence.py": "each-value",
}
"""Files whose parametrized tests run a covering subset in their tier and the full product in
``exhaustive``, and how the subset is chosen, per test function, in collection order:

- ``each-value``: a cell is kept when it brings a parameter value no kept cell had, so every value
  of every parameter is run at least once. A parameter whose value is a dataclass (a ``Case``) counts
  each of its fields as a parameter: every model, every TP size, every head count, every DCP/PCP/PP
  size appears; values are told apart by ``repr``.
- ``pairwise``: a cell is kept when it brings a pair of parameter values no kept cell had.

The choice depends only on the parameter lists, so the same cells are chosen on every run."""


def declared(file: str) -> tuple[str, ...] | None:
    """The tiers ``file``'s tests may be in (its default first), or None when it has no tier."""
    if file not in TIERS:
        return None
    own = TIERS[file]
    tiers = (own,) if isinstance(own, str) else own
    tiers += tuple(tier for key, tier in TIERS.items() if key.startswith(f"{file}::") for tier in _as_tuple(tier))
    if file in COVERED:
        tiers += ("exhaustive",)
    return tuple(dict.fromkeys(tiers))


def _as_tuple(tier: str | tuple[str, ...]) -> tuple[str, ...]:
    return (tier,) if isinstance(tier, str) else tier


def tier_of(file: str, function: str, fixtures: Iterable[str]) -> str:
    """The tier of test ``function`` of ``file`` (in the table) that uses ``fixtures``."""
    tier = _as_tuple(TIERS[file])[0]
    for key, own in TIERS.items():
        if key.startswith(f"{file}::") and fnmatch.fnmatchcase(function, key.split("::", 1)[1]):
            tier = _as_tuple(own)[0]
    needs = [FIXTURE_TIERS[name] for name in fixtures if name in FIXTURE_TIERS]
    return max([tier, *needs], key=TIER_NAMES.index)


Facets = frozenset[tuple[str, str]]


def facets(params: Mapping[str, Any], indices: Mapping[str, int]) -> Facets:
    """(parameter, value) pairs of one cell; a dataclass value contributes one pair per field."""
    found: set[tuple[str, str]] = set()
    for name, value in params.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.update((f"{name}.{field.name}", repr(getattr(value, field.name))) for field in dataclasses.fields(value))
        else:
            found.add((name, str(indices.get(name, repr(value)))))
    return frozenset(found)


def covering(cells: Sequence[Facets], how: str) -> list[int]:
    """Indices of the cells kept in the fast tier, chosen in order (see :data:`COVERED`)."""
    if how not in ("each-value", "pairwise"):
        raise ValueError(f"unknown covering {how!r}: each-value or pairwise")
    seen: set[Any] = set()
    kept = []
    for index, cell in enumerate(cells):
        units = set(cell) if how == "each-value" else set(itertools.combinations(sorted(cell), 2)) or set(cell)
        if not units <= seen:
            seen |= units
            kept.append(index)
    return kept


def default_tier(file: str) -> str:
    """The tier of ``file``'s tests unless a fixture or a per-test entry says otherwise."""
    return _as_tuple(TIERS[file])[0]


def installed(package: str) -> bool:
    """``package`` is importable as a real package: a test folder of the same name (a namespace
    package without ``__init__.py`` on ``sys.path``) does not count."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


def missing(tier: str) -> tuple[str, ...]:
    """The packages ``tier`` needs that are not installed."""
    return tuple(package for package in NEEDS[tier] if not installed(package))
