"""Two instances on one Mooncake store with different plans never load each other's objects wrongly.

Each run saves a 256-token prompt from one instance (policy, TP size) and looks it up and loads it
in another (:func:`kvpolicy.sim.run_mixed`): real vLLM store workers and threads, a real
master. A load may miss, or hit with the right bytes; it must never hand a rank bytes that are not
its own. "Right" across TP sizes (see :mod:`kvpolicy.sim.content`): a layer split into ``N``
distinct shards holds the same bytes in shard ``s`` at any TP size with the same ``N`` — an MLA
latent (``N = 1``) and a 2-KV-head attention layer (``N = 2``) are the same at TP 2 and TP 4;
Mamba / linear-attention state (``N = tp``) is not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import require

require("vllm")
require("mooncake.store")

from kvpolicy.documents.loader import load_policy, policies_dir  # noqa: E402
from kvpolicy.language.models import Policy  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402
from kvpolicy.mooncake.pool import ClientPool  # noqa: E402
from kvpolicy.sim import BLOCK_SIZE, MixedReport, run_mixed  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NUM_TOKENS = 256
FULL_HIT = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE

Side = tuple[str, int]  # (policy, tp_size)
Run = Callable[[Side, Side, str], MixedReport]

# saver, loader, archetype — pairs whose plans differ. Kimi-Linear has both kinds of group: an MLA
# latent (replicated) and KDA state (sharded per rank).
DIFFERENT_PLANS: dict[str, tuple[Side, Side, str]] = {
    "default-then-no-dedup": (("default", 2), ("no-dedup", 2), "kimi-linear"),
    "no-dedup-then-default": (("no-dedup", 2), ("default", 2), "kimi-linear"),
    "default-tp2-then-tp4": (("default", 2), ("default", 4), "kimi-linear"),
    "default-tp4-then-tp2": (("default", 4), ("default", 2), "kimi-linear"),
    "default-then-vllm-compat": (("default", 2), ("vllm-compat", 2), "kimi-linear"),
    "vllm-compat-then-default": (("vllm-compat", 2), ("default", 2), "kimi-linear"),
}


def renamed_default(directory: Path) -> Path:
    """``default`` with another policy name, other rule names, reasons and description: the same
    rules, so the same plan."""
    text = (policies_dir() / "default.yaml").read_text(encoding="utf-8")
    text = text.replace("name: default", "name: site-replication")
    rules = (
        "mamba-declared-replicated", "mamba-state", "mla-latent", "declared-max-shards", "kv-heads"
    )
    for number, rule in enumerate(rules, start=1):
        assert f"- name: {rule}\n" in text, rule
        text = text.replace(f"- name: {rule}\n", f"- name: site-rule-{number}\n")
    text = text.replace("reason: ", "reason: (site copy) ").replace("description: >-", "description: >-\n  Site copy.")
    path = directory / "site-replication.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Policy]:
    found = {name: load_policy(name) for name in ("default", "no-dedup", "vllm-compat")}
    found["pre-fix"] = load_policy(REPO / "examples" / "policies" / "pre-fix-single-factor.yaml")
    found["site-copy"] = load_policy(renamed_default(tmp_path_factory.mktemp("policies")))
    return found


@pytest.fixture(scope="module")
def run(mooncake_master: MooncakeMaster, clients: ClientPool, policies: dict[str, Policy]) -> Run:
    reports: dict[tuple[Side, Side, str], MixedReport] = {}

    def run(saver: Side, loader: Side, archetype: str) -> MixedReport:
        key = (saver, loader, archetype)
        if key not in reports:
            reports[key] = run_mixed(
                policies[saver[0]], saver[1], policies[loader[0]], loader[1], archetype,
                master=mooncake_master, clients=clients, num_tokens=NUM_TOKENS,
            )
        return reports[key]

    return run


def describe(report: MixedReport) -> str:
    verdict = report.verdict
    return (
        f"{report.saver_policy}@tp{report.saver_tp} -> {report.loader_policy}@tp{report.loader_tp} "
        f"({report.archetype}): hit {verdict.hit_tokens}, used {verdict.used_tokens}, "
        f"wrong {[(b.tp_rank, b.group, b.chunk) for b in verdict.wrong][:6]}, stray {verdict.stray[:6]}, "
        f"problems {verdict.problems}"
    )


# --- different plans -----------------------------------------------------------------------------


@pytest.mark.parametrize("pair", DIFFERENT_PLANS)
def test_instances_with_different_plans_never_load_wrong_bytes(run: Run, pair: str) -> None:
    report = run(*DIFFERENT_PLANS[pair])
    assert report.save.put_failures == 0 and report.save.keys_written
    assert report.verdict.correct and not report.verdict.crashed, describe(report)


@pytest.mark.parametrize("pair", DIFFERENT_PLANS)
def test_instances_with_different_plans_miss_each_others_objects(run: Run, pair: str) -> None:
    # default and no-dedup key every object with the plan's fingerprint; vllm-compat has none.
    assert run(*DIFFERENT_PLANS[pair]).hit_tokens == 0


@pytest.mark.parametrize("pair", [pair for pair in DIFFERENT_PLANS if "vllm-compat" not in pair])
def test_different_plans_have_different_fingerprints(run: Run, pair: str) -> None:
    report = run(*DIFFERENT_PLANS[pair])
    assert report.saver_fingerprint != report.loader_fingerprint


# --- identical plans -----------------------------------------------------------------------------

IDENTICAL = (("site-copy", 2), ("default", 2), "kimi-linear")


def test_a_renamed_copy_of_a_policy_has_the_same_fingerprint(run: Run) -> None:
    report = run(*IDENTICAL)
    assert report.saver_policy == "site-replication" and report.loader_policy == "default"
    assert report.saver_fingerprint == report.loader_fingerprint


def test_instances_with_identical_plans_share_hits(run: Run) -> None:
    verdict = run(*IDENTICAL).verdict
    assert (verdict.hit_tokens, verdict.used_tokens) == (FULL_HIT, FULL_HIT)


def test_instances_with_identical_plans_load_the_right_bytes(run: Run) -> None:
    report = run(*IDENTICAL)
    assert report.verdict.blocks_checked > 0 and report.verdict.correct, describe(report)


# --- identical bytes at different TP sizes -------------------------------------------------------

# Every group holds the same bytes per shard at both sizes: the MLA latent is one shard at any TP, and
# the 2-KV-head layers are 2 shards (one head each) at TP 2 and at TP 4 (each head on two ranks).
SAME_BYTES_ACROSS_TP: dict[str, tuple[Side, Side, str]] = {
    "mla-tp4-then-tp2": (("default", 4), ("default", 2), "mla"),
    "uniform-tp4-then-tp2": (("default", 4), ("default", 2), "uniform-mla-full"),
}


@pytest.mark.parametrize("pair", SAME_BYTES_ACROSS_TP)
def test_instances_at_different_tp_sizes_holding_the_same_bytes_share_a_fingerprint(run: Run, pair: str) -> None:
    report = run(*SAME_BYTES_ACROSS_TP[pair])
    assert report.saver_tp != report.loader_tp and report.saver_fingerprint == report.loader_fingerprint


@pytest.mark.parametrize("pair", SAME_BYTES_ACROSS_TP)
def test_instances_at_different_tp_sizes_holding_the_same_bytes_share_hits_with_the_right_bytes(
    run: Run, pair: str
) -> None:
    report = run(*SAME_BYTES_ACROSS_TP[pair])
    assert report.hit_tokens == FULL_HIT
    assert report.verdict.blocks_checked > 0 and report.verdict.correct, describe(report)


# The loader repeats a shard over more ranks than any saver's audit checked: the TP 2 uniform saver
# holds every head once (it audited nothing), the TP 2 MLA saver verified pairs of ranks, not fours.
UNVERIFIED_AT_THE_LOADERS_SIZE: dict[str, tuple[Side, Side, str]] = {
    "mla-tp2-then-tp4": (("default", 2), ("default", 4), "mla"),
    "uniform-tp2-then-tp4": (("default", 2), ("default", 4), "uniform-mla-full"),
}


@pytest.mark.parametrize("pair", UNVERIFIED_AT_THE_LOADERS_SIZE)
def test_an_agreement_over_smaller_replica_sets_does_not_vouch_for_larger_ones(run: Run, pair: str) -> None:
    # Same bytes and fingerprint, but the lookup gate keeps the loader from the shared namespace until
    # an audit of its own replica-set size (or a multiple) agrees.
    report = run(*UNVERIFIED_AT_THE_LOADERS_SIZE[pair])
    assert report.saver_fingerprint == report.loader_fingerprint
    assert report.hit_tokens == 0 and report.verdict.correct, describe(report)


# --- vLLM's own key format across TP sizes -------------------------------------------------------


@pytest.mark.parametrize("archetype", ["mla", "uniform-mla-full"])
def test_stock_keys_share_tp_independent_groups_across_tp_sizes_with_the_right_bytes(
    run: Run, archetype: str
) -> None:
    # No fingerprint: a TP 4 instance reads what a TP 2 instance wrote. The MLA latent and the
    # 2-KV-head layers hold the same bytes per shard at both sizes, so the hit is right.
    report = run(("vllm-compat", 2), ("vllm-compat", 4), archetype)
    assert report.hit_tokens == FULL_HIT
    assert report.verdict.blocks_checked > 0 and report.verdict.correct, describe(report)


def test_stock_keys_let_a_tp2_instance_load_a_tp4_instances_linear_attention_state(run: Run) -> None:
    # A vLLM bug that vllm-compat reproduces by design: the key has no TP size, the KDA page is
    # padded to the MLA page at both sizes so the object sizes agree, and TP 2's ranks 0 and 1
    # load TP 4's shards 0 and 1 (half their heads) with no error. default's fingerprint turns
    # this into a miss (test_instances_with_different_plans_miss_each_others_objects).
    report = run(("vllm-compat", 4), ("vllm-compat", 2), "kimi-linear")
    verdict = report.verdict
    assert verdict.hit_tokens == FULL_HIT and not verdict.reported_errors
    # Group 0 is the KDA state; the MLA latent (group 1) is right.
    assert {(block.group, block.tp_rank) for block in verdict.wrong} == {(0, 0), (0, 1)}, describe(report)


def test_the_check_catches_a_loader_that_reads_another_ranks_state(run: Run) -> None:
    # The pre-fix rule deduplicates the KDA state too: reading a vllm-compat store, every rank
    # loads shard 0's state; rank 1's is wrong. (Same key template, same factor for the MLA group.)
    report = run(("vllm-compat", 2), ("pre-fix", 2), "kimi-linear")
    assert report.hit_tokens == FULL_HIT
    assert {(block.group, block.tp_rank) for block in report.verdict.wrong} == {(0, 1)}, describe(report)
