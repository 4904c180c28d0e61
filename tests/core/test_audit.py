"""The pure half of the replication audit: digests and the verdict per replica set."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_support import HYBRID_AUDIT_LAYOUT as LAYOUT

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.evidence.audit import Digest, Verdict, audited_groups, describe, digest_blocks, judge
from kvpolicy.language.models import Topology
from kvpolicy.planning.engine import make_plan


@pytest.fixture
def hybrid_plan(tmp_path: Path):
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    return make_plan(load_policy("default"), load_layout(layout), Topology(tp_size=4))


def test_digest_of_zero_blocks_is_flagged_as_no_evidence() -> None:
    assert digest_blocks([bytes(64), bytes(64)]).all_zero
    assert not digest_blocks([bytes(64), b"\x00" * 63 + b"\x01"]).all_zero


def test_digest_depends_on_every_byte_and_on_block_order() -> None:
    a, b = b"a" * 32, b"b" * 32
    assert digest_blocks([a, b]) != digest_blocks([b, a])
    assert digest_blocks([a]) != digest_blocks([a[:-1] + b"c"])


def test_only_groups_with_factor_above_one_are_audited(hybrid_plan) -> None:
    assert hybrid_plan.factors == (4, 1)
    assert audited_groups(hybrid_plan) == (0,)


def test_audit_off_audits_nothing(tmp_path: Path) -> None:
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    compat = make_plan(load_policy("vllm-compat"), load_layout(layout), Topology(tp_size=4))
    assert compat.factors[0] == 4 and audited_groups(compat) == ()


def test_identical_digests_across_the_replica_set_agree(hybrid_plan) -> None:
    same = Digest("d1", all_zero=False)
    (audit,) = judge(hybrid_plan, [{0: same}] * 4, [0])
    assert audit.verdict is Verdict.AGREED


def test_one_rank_with_different_bytes_names_its_replica_set(hybrid_plan) -> None:
    digests = [{0: Digest("d1", False)}, {0: Digest("d1", False)}, {0: Digest("d2", False)}, {0: Digest("d1", False)}]
    (audit,) = judge(hybrid_plan, digests, [0])
    assert audit.verdict is Verdict.DISAGREED
    assert audit.disagreeing == ((0, 1, 2, 3),)


def test_all_zero_blocks_are_not_agreement(hybrid_plan) -> None:
    zero = digest_blocks([bytes(16)])
    (audit,) = judge(hybrid_plan, [{0: zero}] * 4, [0])
    assert audit.verdict is Verdict.NO_EVIDENCE


def test_zeros_on_one_rank_and_data_on_another_disagree(hybrid_plan) -> None:
    zero, data = digest_blocks([bytes(16)]), digest_blocks([b"x" * 16])
    (audit,) = judge(hybrid_plan, [{0: data}, {0: zero}, {0: data}, {0: data}], [0])
    assert audit.verdict is Verdict.DISAGREED


def test_the_error_names_group_rule_location_and_ranks(hybrid_plan) -> None:
    digests = [{0: Digest("d1", False)}, {0: Digest("d2", False)}] * 2
    (audit,) = judge(hybrid_plan, digests, [0])
    message = describe(hybrid_plan, audit)
    assert "group 0 (mla)" in message
    assert "'mla-latent'" in message and "default.yaml:" in message
    assert "ranks 0,1,2,3" in message


def test_demoting_a_group_gives_it_factor_one_and_a_new_fingerprint(tmp_path: Path, hybrid_plan) -> None:
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    demoted = make_plan(load_policy("default"), load_layout(layout), Topology(tp_size=4), demoted=[0])
    assert demoted.factors == (1, 1) and demoted.groups[0].demoted
    assert demoted.fingerprint != hybrid_plan.fingerprint
    assert audited_groups(demoted) == ()
    assert not set(demoted.groups[0].lookup_namespaces) & set(hybrid_plan.groups[0].lookup_namespaces)


def test_a_demoted_group_gets_its_own_namespace_even_without_a_fingerprint_in_the_template(tmp_path: Path) -> None:
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    trusted = make_plan(load_policy("vllm-compat"), load_layout(layout), Topology(tp_size=4))
    demoted = make_plan(load_policy("vllm-compat"), load_layout(layout), Topology(tp_size=4), demoted=[0])
    trusting_keys = {trusted.key_prefix(0, rank) for rank in range(4)}
    assert not {demoted.key_prefix(0, rank) for rank in range(4)} & trusting_keys
