"""End to end: the replication audit in real vLLM engines (CPU, TP=2) through real Mooncake.

A 2-KV-head tiny Llama at TP=2 holds a distinct head on each rank. The deliberately wrong policy
declares attention replicated, so the two ranks share one namespace and take turns writing chunks.
Three engines, each a fresh process (:func:`kvpolicy.harness.e2e.serve_once`), one store:

* **A** (cold), the wrong policy with ``audit: off``: computes the prompt and writes it, striped,
  under the wrong plan's shared namespace (fingerprint F);
* **B** (warm), the same rule with ``audit: warn`` — the same plan, so the same F: its lookup gate
  refuses F (no audit has vouched for it), it computes the prompt, the audit finds the ranks'
  digests different before the first save, and the group falls back to factor 1 under a new
  fingerprint. B's logprobs equal A's;
* **B'** (warm), the wrong policy with ``audit: off`` again: it trusts F, loads the other rank's
  head for half of the chunks, and its logprobs differ from A's.

B and B' can share A's store: B never writes F (its audit runs before its first save and demotes
the group, so it writes only under its new fingerprint), and B' never reads B's namespace. So B's
result does not depend on B', nor B''s on B. 3 engines, about 40 s to 90 s each on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")

from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.harness.e2e import (  # noqa: E402
    DEFAULT_BLOCK_SIZE,
    EngineResult,
    fixed_prompt,
    serve_once,
)
from kvpolicy.harness.tinymodel import make_tiny_llama  # noqa: E402
from kvpolicy.mooncake import MasterCounters, delta  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WRONG = REPO / "examples" / "policies" / "wrong-attention-replicated.yaml"
WRONG_AUDITED = REPO / "examples" / "policies" / "wrong-attention-replicated-audited.yaml"

TP_SIZE = 2
PROMPT = fixed_prompt(109)
FULL_CHUNKS = len(PROMPT) // DEFAULT_BLOCK_SIZE
CACHED_TOKENS = FULL_CHUNKS * DEFAULT_BLOCK_SIZE
MAX_TOKENS = 8
LOGPROBS = 20
SAME_TOLERANCE = 1e-4
"""Two engines computing the same prompt at the same TP. Observed: exactly 0.0."""
WRONG_MIN_DIFF = 0.05
"""Loading the other rank's head moves some logprob by at least this (observed 0.3 to 1.6)."""
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The directory's name is part of every key: no other test module's objects can match.
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-tp2-kv2-audit", num_kv_heads=2)


@dataclass(frozen=True)
class Served:
    result: EngineResult
    traffic: MasterCounters
    plan: dict
    """The plan JSON rank 0 wrote (``kvpolicy_plan_json``), as it stood when the engine exited."""

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr


class Engines:
    """Serves :data:`PROMPT` once per policy in a fresh TP=2 engine, against one store."""

    def __init__(self, master: MooncakeMaster, config: Path, model: Path, scratch: Path) -> None:
        self.master, self.config, self.model, self.scratch = master, config, model, scratch

    def serve(self, name: str, policy: Path) -> Served:
        plan_path = self.scratch / f"{name}-plan.json"
        before = MasterCounters.read(self.master.metrics_url)
        result = serve_once(
            self.model,
            PROMPT,
            tp_size=TP_SIZE,
            kv_transfer_config=KVPolicySettings(kvpolicy=os.fspath(policy), kvpolicy_plan_json=plan_path).kv_transfer_config(),
            mooncake_config_path=self.config,
            max_tokens=MAX_TOKENS,
            logprobs=LOGPROBS,
        )
        traffic = delta(before, MasterCounters.read(self.master.metrics_url))
        print(
            f"{name} ({policy.stem}): wall {result.wall_s:.1f} s, cached {result.num_cached_tokens}/"
            f"{result.prompt_len}, written {traffic.objects_written}, read {traffic.objects_read}, "
            f"tokens {list(result.tokens)}"
        )
        assert len(result.tokens) == MAX_TOKENS, f"engine {name} failed its request:\n{result.stdout[-4000:]}"
        assert result.saves_drained, f"engine {name} exited before its puts finished"
        return Served(result, traffic, json.loads(plan_path.read_text()))


@pytest.fixture(scope="module")
def engines(e2e_master: MooncakeMaster, e2e_store_config: Path, model: Path, tmp_path_factory) -> Engines:
    return Engines(e2e_master, e2e_store_config, model, tmp_path_factory.mktemp("plans"))


@pytest.fixture(scope="module")
def cold(engines: Engines) -> Served:
    served = engines.serve("A", WRONG)
    assert served.result.num_cached_tokens == 0, "the cold engine hit: foreign objects share its keys"
    assert served.traffic.objects_written == FULL_CHUNKS, "the wrong (shared, striped) plan was not in effect"
    return served


@pytest.fixture(scope="module")
def audited(engines: Engines, cold: Served) -> Served:
    return engines.serve("B", WRONG_AUDITED)


@pytest.fixture(scope="module")
def trusting(engines: Engines, cold: Served) -> Served:
    return engines.serve("B'", WRONG)


def test_with_the_audit_on_the_warm_engine_matches_the_cold_one(cold: Served, audited: Served) -> None:
    assert audited.result.tokens == cold.result.tokens
    diff = cold.result.max_logprob_diff(audited.result)
    print(f"audit on: max |logprob(B) - logprob(A)| = {diff:.3g}")
    assert diff <= SAME_TOLERANCE


def test_with_the_audit_off_the_warm_engine_loads_the_other_ranks_heads(cold: Served, trusting: Served) -> None:
    assert trusting.result.num_cached_tokens == CACHED_TOKENS, "B' did not hit on A's objects"
    diff = cold.result.max_logprob_diff(trusting.result)
    print(f"audit off: max |logprob(B') - logprob(A)| = {diff:.3g}")
    assert diff >= WRONG_MIN_DIFF


def test_the_audited_engine_does_not_load_a_namespace_no_audit_vouched_for(audited: Served) -> None:
    # A (audit off) wrote the shared namespace of this very plan; B must not trust it unverified.
    assert audited.result.num_cached_tokens == 0
    assert audited.traffic.objects_read == 0


def test_rank_0_logs_one_error_naming_the_group_the_rule_and_the_ranks(audited: Served) -> None:
    errors = [line for line in audited.output.splitlines() if "replication audit: group" in line and "ERROR" in line]
    assert len(errors) == 1, audited.output[-4000:]
    (error,) = errors
    assert "group 0 (full-attention)" in error
    assert f"'attention-replicated' ({WRONG_AUDITED}:" in error
    assert "ranks 0,1" in error
    assert "Worker_TP0" in error


def test_the_demoted_group_gets_factor_one_under_a_new_fingerprint(cold: Served, audited: Served) -> None:
    (group,) = audited.plan["groups"]
    assert (group["audit"], group["factor"], group["demoted"]) == ("demoted", 1, True)
    assert audited.plan["fingerprint"] != cold.plan["fingerprint"]
    # Each rank wrote its own head for every chunk, in namespaces A's objects do not use.
    assert audited.traffic.objects_written == FULL_CHUNKS * TP_SIZE
    assert {f"@plan:{audited.plan['fingerprint']}@tp_rank:{shard}" for shard in range(TP_SIZE)} == {
        namespace[namespace.index("@plan:") : namespace.index("@pcp")] for namespace in group["lookup_namespaces"]
    }
