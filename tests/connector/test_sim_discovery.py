"""Discovery on simulated ranks (``kvpolicy discover --archetype``): the connector's own worker observes
which ranks hold identical bytes, each rank holding the bytes the model holds (:mod:`kvpolicy.sim.content`).

For every archetype at TP 2, 4 and 8 the observed partition of every layer is the ground truth
(:meth:`~kvpolicy.sim.archetypes.Archetype.true_factors`); the policy proposed from TP 2 and 4 plans TP 8
as observed there; a spec class no rule names, registered as a plugin would, gets a rule that plans it
as observed; and observing changes nothing that is stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from kvpolicy.documents.loader import load_policy  # noqa: E402
from kvpolicy.documents.propose import LoadedReport, disagreements, load_reports, propose  # noqa: E402
from kvpolicy.evidence.discovery import DiscoveryReport, runs  # noqa: E402
from kvpolicy.planning.engine import make_plan  # noqa: E402
from kvpolicy.sim import ARCHETYPES, LAYER_HEADS_ARCHETYPES, Fleet  # noqa: E402
from kvpolicy.sim.archetypes import Archetype  # noqa: E402
from kvpolicy.sim.discover import run_discovery  # noqa: E402

EVERY_ARCHETYPE = sorted({*ARCHETYPES, *LAYER_HEADS_ARCHETYPES})
TP_SIZES = (2, 4, 8)


@pytest.fixture(scope="module")
def reports(mooncake_master: Any, clients: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    directory = tmp_path_factory.mktemp("discovery")
    found: dict[tuple[str, int], Path] = {}

    def observe(archetype: str | Archetype, tp_size: int) -> Path:
        name = archetype if isinstance(archetype, str) else archetype.name
        if (name, tp_size) not in found:
            path = directory / f"{name}-tp{tp_size}.yaml"
            run_discovery(archetype, tp_size, path, master=mooncake_master, clients=clients)
            found[name, tp_size] = path
        return found[name, tp_size]

    yield observe


def _loaded(*paths: Path) -> list[LoadedReport]:
    loaded, problems = load_reports([str(path) for path in paths])
    assert not problems, problems
    return loaded


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("archetype", EVERY_ARCHETYPE)
def test_every_layer_is_observed_with_its_true_partition(reports: Any, archetype: str, tp_size: int) -> None:
    (loaded,) = _loaded(reports(archetype, tp_size))
    report = loaded.report
    truth = (ARCHETYPES.get(archetype) or LAYER_HEADS_ARCHETYPES[archetype]).true_factors(tp_size)
    assert report.source == "simulation" and report.failed_steps == 0 and report.steps == 4
    for group in report.groups:
        for layer in group.layers:
            assert layer.evidence.blocks >= 4 and layer.evidence.zero_blocks == 0, layer
            assert layer.partition == runs(truth[layer.name], tp_size), f"{archetype} tp {tp_size} {layer.name}"


@pytest.mark.parametrize("archetype", EVERY_ARCHETYPE)
def test_the_proposal_from_tp_2_and_4_predicts_tp_8(reports: Any, archetype: str) -> None:
    proposal, refusals = propose(_loaded(reports(archetype, 2), reports(archetype, 4)))
    assert proposal is not None, refusals
    (at_8,) = _loaded(reports(archetype, 8))
    assert disagreements(proposal.policy, at_8.report) == []


def test_a_proposal_from_one_tp_size_states_nothing_about_another(reports: Any) -> None:
    """At one TP size only literal factors can be concluded: gqa-kv-lt-tp repeats its heads over 2
    ranks at every TP size, which TP 2 alone cannot tell from "every rank holds the same bytes"; the
    proposal states factor 2 at TP 2 only, and another TP size falls to ``unmatched: sharded``."""
    proposal, _ = propose(_loaded(reports("gqa-kv-lt-tp", 2)))
    assert proposal is not None
    assert proposal.policy.rules and all(rule.when is not None and rule.when.source == "tp_size == 2" for rule in proposal.policy.rules)
    (at_4,) = _loaded(reports("gqa-kv-lt-tp", 4))
    plan = make_plan(proposal.policy, at_4.report.layout, at_4.report.topology)
    assert all(group.factor == 1 for group in plan.groups)  # unmatched: sharded, never a guessed replication


GQA_MAMBA = ARCHETYPES["gqa-mamba"]
"""Its single-KV-head attention and Mamba2 state go beside the plugin's state."""


class SharedConvSpec(MambaSpec):
    """A plugin's state type: Mamba-shaped, but every TP rank holds all of it (computed before the TP
    split). No shipped rule names it; ``default`` matches it as a MambaSpec and shards it."""


def _shared_conv(tp_size: int) -> SharedConvSpec:
    base = GQA_MAMBA.kinds["mamba"](tp_size)
    return SharedConvSpec(
        block_size=base.block_size, shapes=base.shapes, dtypes=base.dtypes, mamba_type=base.mamba_type,
        mamba_cache_mode=base.mamba_cache_mode,
    )


PLUGIN_ARCHETYPE = Archetype(
    "plugin-shared-conv",
    "1-KV-head attention beside a plugin's replicated conv state and Mamba2 state",
    1,
    (("model.layers.0.mixer", "shared"), ("model.layers.1.self_attn.attn", "attn"),
     ("model.layers.2.mixer", "mamba"), ("model.layers.3.self_attn.attn", "attn")),
    MappingProxyType({"attn": GQA_MAMBA.kinds["attn"], "shared": _shared_conv, "mamba": GQA_MAMBA.kinds["mamba"]}),
    kind_factors=MappingProxyType({"shared": lambda tp_size: tp_size}),
)


def test_a_plugin_spec_class_no_rule_names_gets_a_rule_that_plans_it_as_observed(reports: Any) -> None:
    loaded = _loaded(reports(PLUGIN_ARCHETYPE, 2), reports(PLUGIN_ARCHETYPE, 4))
    default = load_policy("default")
    assert not any("SharedConvSpec" in str(rule.match.spec) for rule in default.rules)
    assert disagreements(default, loaded[0].report)  # default shards the shared state: it writes it twice
    proposal, refusals = propose(loaded)
    assert proposal is not None, refusals
    names = [tuple(rule.match.spec or ()) for rule in proposal.policy.rules]
    assert names.index(("SharedConvSpec",)) < names.index(("MambaSpec",))  # the subclass's rule comes first
    (at_8,) = _loaded(reports(PLUGIN_ARCHETYPE, 8))
    plan = make_plan(proposal.policy, at_8.report.layout, at_8.report.topology)
    shared = next(group for group in plan.groups if "SharedConvSpec" in group.spec_types)
    assert shared.factor == 8
    assert disagreements(proposal.policy, at_8.report) == []


def test_observing_changes_nothing_that_is_stored(mooncake_master: Any, clients: Any, tmp_path: Path) -> None:
    stored = []
    for extra in ({}, {"kvpolicy_discover": str(tmp_path / "r.yaml"), "kvpolicy_discover_steps": 2}):
        with Fleet("gqa-gdn", master=mooncake_master, clients=clients, num_tokens=128) as fleet:
            instance = fleet.instance(load_policy("default"), 2, extra_config=extra)
            outcome = instance.save()
            stored.append(sorted((rank, key.replace(fleet.run_id, ""), code) for rank, key, code in outcome.puts))
    assert stored[0] == stored[1] and stored[0]
    assert isinstance(_loaded(tmp_path / "r.yaml")[0].report, DiscoveryReport)


def test_discover_observes_a_layout_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-Next: Gated DeltaNet state split over the ranks, attention of 2 KV heads repeated over pairs at TP 4."""
    from kvpolicy.app.cli import main

    assert main(["discover", "--layout", "qwen3-next-80b-a3b", "--tp", "4", "--out", str(tmp_path)]) == 0
    (loaded,) = _loaded(tmp_path / "qwen3-next-80b-a3b-tp4.yaml")
    assert [group.partition for group in loaded.report.groups] == [runs(1, 4)] * 3 + [runs(2, 4)]
    printed = capsys.readouterr().out
    assert "group 3 full-attention (FullAttentionSpec): equal bytes in [[0, 1], [2, 3]] (factor 2)" in printed
