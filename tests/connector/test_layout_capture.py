"""Layout capture: the layout of a real vLLM ``KVCacheConfig``, written as YAML, is read back as the
same layout and planned the same; the store worker writes it for ``kvpolicy_layout_out``."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import NoPublishedDemotions, alone, engine_config, require

require("vllm")
require("mooncake.store")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvpolicy.app.cli import main as cli_main  # noqa: E402
from kvpolicy.documents.loader import check_file, load_policy, schemas_dir, shipped_policy_names  # noqa: E402
from kvpolicy.language.diagnostics import PlanError  # noqa: E402
from kvpolicy.language.dumper import dump_layout  # noqa: E402
from kvpolicy.language.keys import model_basename  # noqa: E402
from kvpolicy.language.models import Layout, Topology, thawed  # noqa: E402
from kvpolicy.planning.engine import make_plan  # noqa: E402
from kvpolicy.planning.plan import Plan  # noqa: E402
from kvpolicy.runtime.binding import RankPlace  # noqa: E402
from kvpolicy.vllm.layout import layout_from_kv_cache_config  # noqa: E402
from kvpolicy.vllm.worker import KVPolicyStoreWorker  # noqa: E402

BLOCK = 16
MODEL = "org/Tiny-Model"
POLICIES = {name: load_policy(name) for name in shipped_policy_names()}


def full(num_kv_heads: int = 2, **fields: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=num_kv_heads, head_size=64, dtype=torch.bfloat16, **fields)


def mla() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)


def mamba(**fields: Any) -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=((3, 256), (8, 64, 16)), dtypes=(torch.bfloat16, torch.float32), **fields)


@dataclass(frozen=True)
class BucketedStateSpec(MambaSpec):
    """Exists only in this test module: a plugin's spec class whose field holds mappings keyed by integers."""

    buckets: tuple[dict[int, str], ...] = field(default_factory=lambda: ({1: "short", 8: "long"},))


def bucketed_state() -> BucketedStateSpec:
    return BucketedStateSpec(block_size=BLOCK, shapes=((4, 32),), dtypes=(torch.float32,))


def layers(template: str, indices: range | list[int]) -> list[str]:
    return [template.format(index) for index in indices]


def kv_cache_config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))


def uniform_group() -> KVCacheGroupSpec:
    specs: dict[str, KVCacheSpec] = {
        name: (mla() if index % 2 else full()) for index, name in enumerate(layers("model.layers.{}.attn", range(8)))
    }
    return KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs))


LINEAR_LAYERS = [index for index in range(24) if index % 4 != 3]
"""Qwen3-Next-like: every 4th layer is full attention, the others are split into 3 Mamba groups."""

# Models as vLLM's KVCacheConfig describes them: (config, total_num_kv_heads).
MODELS: dict[str, tuple[KVCacheConfig, int]] = {
    "dense-gqa": (kv_cache_config(KVCacheGroupSpec(layers("model.layers.{}.self_attn.attn", range(28)), full(8))), 8),
    "mla": (kv_cache_config(KVCacheGroupSpec(layers("model.layers.{}.self_attn.attn", range(61)), mla())), 128),
    "mamba-hybrid": (
        kv_cache_config(
            *(
                KVCacheGroupSpec(layers("model.layers.{}.linear_attn", LINEAR_LAYERS[g::3]), mamba()) for g in range(3)
            ),
            KVCacheGroupSpec(layers("model.layers.{}.self_attn.attn", range(3, 24, 4)), full(2)),
        ),
        2,
    ),
    "mamba-hints": (
        kv_cache_config(
            KVCacheGroupSpec(["model.layers.0.mixer"], mamba(tp_replicated=True)),
            KVCacheGroupSpec(["model.layers.1.attn"], full(2, max_tp_shards=2)),
        ),
        2,
    ),
    "uniform": (kv_cache_config(uniform_group()), 2),
    "sliding-window": (
        kv_cache_config(
            KVCacheGroupSpec(
                layers("model.layers.{}.attn.attn", range(0, 12, 2)),
                SlidingWindowSpec(
                    block_size=BLOCK, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, sliding_window=128
                ),
            ),
            KVCacheGroupSpec(layers("model.layers.{}.attn.attn", range(1, 12, 2)), full(8)),
        ),
        8,
    ),
    "sliding-window-mla": (
        kv_cache_config(
            KVCacheGroupSpec(
                layers("model.layers.{}.self_attn.attn", range(4)),
                SlidingWindowMLASpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=64
                ),
            ),
        ),
        16,
    ),
    "plugin-spec": (
        kv_cache_config(
            KVCacheGroupSpec(["model.layers.0.conv"], bucketed_state()),
            KVCacheGroupSpec(["model.layers.1.attn"], mla()),
        ),
        4,
    ),
}


def captured(name: str) -> Layout:
    config, heads = MODELS[name]
    return layout_from_kv_cache_config(config, model=model_basename(MODEL), total_num_kv_heads=heads)


def write(layout: Layout, path: Path, **options: Any) -> Path:
    path.write_text(dump_layout(layout, **options), encoding="utf-8")
    return path


def reloaded(name: str, tmp_path: Path) -> tuple[Layout, Layout]:
    original = captured(name)
    document, problems = check_file(write(original, tmp_path / f"{name}.yaml", captured_at=Topology(tp_size=2)))
    assert problems == [] and isinstance(document, Layout)
    return original, document


def plan_outcome(policy: str, layout: Layout, tp: int) -> tuple[Any, ...]:
    try:
        result: Plan = make_plan(POLICIES[policy], layout, Topology(tp_size=tp))
    except PlanError as error:
        return ("PlanError", str(error))
    return result.fingerprint, result.factors, tuple(group.lookup_namespaces for group in result.groups)


# --- the round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_captured_layout_reads_back_without_diagnostics_and_equal(name: str, tmp_path: Path) -> None:
    original, document = reloaded(name, tmp_path)
    assert document == original


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", MODELS)
def test_captured_layout_plans_with_the_same_fingerprint_factors_and_namespaces(
    name: str, policy: str, tp: int, tmp_path: Path
) -> None:
    original, document = reloaded(name, tmp_path)
    assert plan_outcome(policy, document, tp) == plan_outcome(policy, original, tp)


def test_every_shipped_policy_plans_some_captured_layout_at_every_tp() -> None:
    # Guards the test above against comparing nothing but two identical PlanErrors.
    outcomes = [plan_outcome(policy, captured(name), tp) for name in MODELS for policy in POLICIES for tp in (1, 2, 4)]
    assert all(outcome[0] != "PlanError" for outcome in outcomes)


def test_consecutive_captured_layer_names_are_written_as_a_range(tmp_path: Path) -> None:
    text = write(captured("mla"), tmp_path / "mla.yaml").read_text(encoding="utf-8")
    assert "layers: ['model.layers.{0..60}.self_attn.attn']" in text


def test_mappings_in_a_plugin_field_read_back_with_string_keys(tmp_path: Path) -> None:
    original, document = reloaded("plugin-spec", tmp_path)
    buckets = [thawed(layout.groups[0].spec.fields["buckets"]) for layout in (document, original)]
    assert buckets[0] == buckets[1] == [
        {"1": "short", "8": "long"}
    ]


# --- the CLI on a captured file ------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli_main(list(argv))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", MODELS)
def test_kvpolicy_validate_accepts_a_captured_layout(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(captured(name), tmp_path / f"{name}.yaml", captured_at=Topology(tp_size=2))
    assert run(capsys, "validate", str(path)) == (0, "")


@pytest.mark.parametrize("name", MODELS)
def test_kvpolicy_plan_reads_a_captured_layout(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = captured(name)
    path = write(original, tmp_path / f"{name}.yaml", captured_at=Topology(tp_size=2))
    code, out = run(capsys, "plan", "--policy", "default", "--layout", str(path), "--tp", "2", "--format", "json")
    expected = make_plan(POLICIES["default"], original, Topology(tp_size=2))
    payload = json.loads(out)
    assert (code, payload["fingerprint"], [group["factor"] for group in payload["groups"]]) == (
        0,
        expected.fingerprint,
        list(expected.factors),
    )


# --- the worker writes it ------------------------------------------------------------------------


def planned_worker(name: str, *, tp_size: int = 2, layout_out: Path | None = None) -> KVPolicyStoreWorker:
    """Rank 0's KVPolicyStoreWorker through its standalone construction (upstream's ``__init__`` would
    mount a Mooncake segment). ``vllm-compat`` audits nothing, so planning reads no store."""
    config, heads = MODELS[name]
    extra = (("kvpolicy_layout_out", str(layout_out)),) if layout_out else ()
    return KVPolicyStoreWorker.standalone(
        engine_config(tp_size, extra_config=extra),
        config,
        policy=POLICIES["vllm-compat"],
        place=RankPlace(tp_rank=0, tp_size=tp_size),
        store=NoPublishedDemotions(),
        model=MODEL,
        total_num_kv_heads=heads,
        gather=alone,
    )


def test_worker_writes_the_layout_it_planned(tmp_path: Path) -> None:
    path = tmp_path / "captured.yaml"
    planned_worker("mamba-hybrid", layout_out=path)
    document, problems = check_file(path)
    # The engine config resolves LBHNC (vLLM's CPU attention backend), which the capture records.
    assert (document, problems) == (captured("mamba-hybrid").model_copy(update={"kv_cache_layout": "LBHNC"}), [])


def test_plan_of_a_worker_captured_layout_has_the_workers_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "captured.yaml"
    worker = planned_worker("dense-gqa", layout_out=path)
    assert worker.plan is not None
    code, out = run(capsys, "plan", "--policy", "vllm-compat", "--layout", str(path), "--tp", "2", "--format", "json")
    assert (code, json.loads(out)["fingerprint"]) == (0, worker.plan.fingerprint)


def test_worker_layout_file_names_its_topology_after_the_schema_line(tmp_path: Path) -> None:
    path = tmp_path / "captured.yaml"
    planned_worker("mla", tp_size=4, layout_out=path)
    first, second = path.read_text(encoding="utf-8").splitlines()[:2]
    schema = (schemas_dir() / "layout.schema.json").resolve()
    assert (first, "at tp_size 4, pp_size 1" in second) == (f"# yaml-language-server: $schema={schema}", True)


def test_worker_replaces_an_existing_layout_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "captured.yaml"
    path.write_text("stale\n", encoding="utf-8")
    planned_worker("dense-gqa", layout_out=path)
    assert ([entry.name for entry in tmp_path.iterdir()], check_file(path)) == (
        ["captured.yaml"],
        (captured("dense-gqa").model_copy(update={"kv_cache_layout": "LBHNC"}), []),
    )


def test_worker_without_the_key_writes_nothing(tmp_path: Path) -> None:
    planned_worker("dense-gqa")
    assert list(tmp_path.iterdir()) == []


def test_a_layout_path_that_cannot_be_written_is_one_line_naming_the_key_and_the_worker_plans_on(tmp_path: Path) -> None:
    path = tmp_path / "missing-directory" / "captured.yaml"
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.kvpolicy.runtime")  # under vLLM's logger, which does not propagate to pytest's
    logger.addHandler(handler)
    try:
        worker = planned_worker("dense-gqa", layout_out=path)
    finally:
        logger.removeHandler(handler)
    assert worker.plan is not None
    assert messages == [
        f"kvpolicy: cannot write the layout to {path} (kvpolicy_layout_out): No such file or directory; serving on without it"
    ]
