"""``kvpolicy demo``: everything end to end on one machine, with an embedded Mooncake master on loopback.

1. start a master on 127.0.0.1; 2. validate the shipped policies and example layouts; 3. print the
plan of a hybrid model (Kimi-Linear: MLA + KDA state); 4. run the multi-rank simulation (the production worker) for a hybrid
instance under ``default``, ``no-dedup`` and the pre-fix rule, through real Mooncake; 5. where vLLM
runs, serve a tiny hybrid (Qwen3-Next: Gated DeltaNet state next to attention) at TP=2, cold then
warm, through ``KVPolicyConnector`` under ``default`` (warm equals cold) and the pre-fix rule (warm
loads another rank's state and differs). Stops everything it started.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from kvpolicy.documents.loader import check_file, layouts_dir, load_layout, load_policy, policies_dir
from kvpolicy.documents.report import format_plan_table
from kvpolicy.documents.settings import KVPolicySettings
from kvpolicy.language.models import Policy, Topology
from kvpolicy.mooncake import MooncakeMaster
from kvpolicy.mooncake.native_log import native_stderr_to
from kvpolicy.planning.engine import make_plan

HYBRID_LAYOUT = "kimi-linear-48b-a3b"
HYBRID_ARCHETYPE = "kimi-linear"
PRE_FIX_POLICY = Path(__file__).resolve().parents[2] / "examples" / "policies" / "pre-fix-single-factor.yaml"


def _say(message: str = "") -> None:
    print(message, flush=True)


def _step(number: int, title: str) -> None:
    _say()
    _say(f"[{number}/5] {title}")


def _pre_fix_path() -> Path:
    """The pre-fix example policy: packaged with a wheel install, else in the checkout."""
    packaged = Path(__file__).resolve().parents[1] / "examples_policies" / "pre-fix-single-factor.yaml"
    return packaged if packaged.is_file() else PRE_FIX_POLICY


def _pre_fix_policy() -> Policy:
    return load_policy(_pre_fix_path())


def run_demo(*, tp_size: int = 4, with_engine: bool = True) -> int:
    started = time.monotonic()
    from kvpolicy.mooncake.pool import ClientPool
    from kvpolicy.sim import run_consistency

    verdicts: list[bool] = []
    _step(1, "starting an embedded Mooncake master on 127.0.0.1")
    # A long object lease: on a busy 2-core machine a warm read can stall past Mooncake's default 10 s.
    with MooncakeMaster(object_lease_ms=120_000, client_ttl_s=120) as master:
        master_pid = master.pid
        _say(f"  master pid {master_pid}, rpc {master.rpc_address}, metrics {master.metrics_url}")

        _step(2, "validating the shipped policies and example layouts")
        files = sorted(policies_dir().glob("*.yaml")) + sorted(layouts_dir().glob("*.yaml"))
        invalid = 0
        for path in files:
            document, problems = check_file(path)
            for problem in problems:
                _say(f"  {problem}")
            invalid += document is None
            _say(f"  {'ok  ' if document is not None else 'FAIL'} {path.name}")
        verdicts.append(invalid == 0)

        _step(3, f"plan of {HYBRID_LAYOUT} at tp={tp_size} under 'default'")
        hybrid = make_plan(load_policy("default"), load_layout(HYBRID_LAYOUT), Topology(tp_size=tp_size))
        _say("  " + format_plan_table(hybrid).replace("\n", "\n  "))

        _step(4, f"multi-rank simulation on the production worker: hybrid MLA + KDA instance, tp={tp_size}, through real Mooncake")
        rows = []
        native_log = Path(tempfile.gettempdir()) / f"kvpolicy-demo-{os.getpid()}.log"
        _say(f"  (Mooncake's and vLLM's own log lines go to {native_log})")
        with native_stderr_to(native_log), ClientPool(master) as clients:  # closed before the master stops: a client outliving it blocks
            for label, policy, expect_consistent, audit in (
                ("default", load_policy("default"), True, None),
                ("no-dedup", load_policy("no-dedup"), True, None),
                ("pre-fix (one model-wide factor)", _pre_fix_policy(), False, None),
                # The pre-fix policy turns its audit off; audit=True runs it with audit: warn's fallback.
                ("pre-fix with audit: warn", _pre_fix_policy(), True, True),
            ):
                _say(f"  running {label} ...")
                report = run_consistency(policy, HYBRID_ARCHETYPE, tp_size, master=master, clients=clients, audit=audit)
                rows.append((label, report))
                verdicts.append(report.consistent == expect_consistent)
            _say("  closing the store clients ...")
        _say()
        _say(f"  {'policy':32} {'objects':>8} {'bytes written':>14} {'vs unique':>9}  warm hit  byte consistency per group")
        for label, report in rows:
            groups = ", ".join(
                f"{group.name}:{'PASS' if group.consistent else 'FAIL ranks ' + ','.join(map(str, group.mismatched_ranks))}"
                for group in report.groups
            )
            _say(
                f"  {label:32} {report.objects_written:>8} {report.bytes_written:>14,} "
                f"{report.write_amplification:>8.2f}x  {report.hit_tokens:>5} tok  {groups}"
            )
            for group in report.groups:
                if group.declared_factor > 1:
                    _say(f"      audit {group.name}: {_audit_line(group)}")
        _say("  (the pre-fix rule must FAIL: it 'deduplicates' the sharded KDA state and loads another rank's shard;")
        _say("   with audit: warn the ranks' digests disagree before the first save, the state group falls back to")
        _say("   factor 1 in its own namespace, and every rank loads its own bytes)")

        _step(5, "vLLM (CPU, TP=2): a tiny hybrid (Gated DeltaNet + attention), cold then warm engines, through KVPolicyConnector")
        if with_engine:
            verdicts.append(_engine_run(master))
        else:
            _say("  skipped (--no-engine)")

    elapsed = time.monotonic() - started
    passed = all(verdicts)
    _say()
    _say(f"demo {'PASSED' if passed else 'FAILED'} in {elapsed:.0f} s; the master (pid {master_pid}) is stopped")
    return 0 if passed else 1


def _audit_line(group: object) -> str:
    """One line on what the replication audit concluded for a simulated group."""
    status = group.audit  # type: ignore[attr-defined]
    factor = group.declared_factor  # type: ignore[attr-defined]
    if status == "agreed":
        return f"agreed, replicated over {factor} ranks"
    if status == "demoted":
        return f"DEMOTED, factor {factor} -> 1: {group.audit_message}"  # type: ignore[attr-defined]
    if status == "off":
        return f"off, factor {factor} trusted unchecked"
    return status


HYBRID_ARCHITECTURE = "qwen3-next"
"""The tiny hybrid the engine step serves: Gated DeltaNet state (sharded) next to attention with
one KV head (replicated at TP=2), so ``default`` dedups one group and must not touch the other."""


def _engine_policies() -> tuple[tuple[str, str, bool], ...]:
    """(label, policy, must the warm engine equal the cold one?)."""
    return (("default", "default", True), ("pre-fix", str(_pre_fix_path()), False))


def _engine_run(master: MooncakeMaster) -> bool:
    try:
        from kvpolicy.harness.e2e import EngineFailed, SegmentHolder, engine_store_config, fixed_prompt, serve_once
        from kvpolicy.harness.tinymodel import ARCHITECTURES, make_tiny_model
    except ImportError as error:  # vLLM is optional for the demo; the simulation above already ran
        _say(f"  skipped: vLLM is not importable here ({error})")
        return True
    log = Path(tempfile.gettempdir()) / f"kvpolicy-demo-{os.getpid()}.log"
    with tempfile.TemporaryDirectory(prefix="kvpolicy-demo-") as workdir:
        store_config = engine_store_config(master.client_config(), Path(workdir) / "mooncake.json")
        # Engines mount no segment of their own (so the warm one can read what the cold one wrote after
        # it exited); this process holds the store's memory.
        with SegmentHolder(master.rpc_address):
            entry = ARCHITECTURES[HYBRID_ARCHITECTURE]
            with native_stderr_to(log):  # progress bars
                model = make_tiny_model(HYBRID_ARCHITECTURE, Path(workdir) / f"tiny-{entry.name}", num_kv_heads=1)
            # Two full 96-token blocks (vLLM's hybrid block for this model) and one token to compute.
            prompt = fixed_prompt(193)
            try:
                return _cold_and_warm(
                    serve_once, model, prompt, store_config, master, tp_size=2, dtype=entry.dtype, hybrid=True
                )
            except EngineFailed as error:
                reason = next((line for line in reversed(error.stderr.splitlines()) if "Error" in line), "see the log")
                _say(f"  this machine cannot serve the hybrid at TP=2 ({reason.strip()[:200]}); serving the dense model")
            with native_stderr_to(log):
                dense = make_tiny_model("llama", Path(workdir) / "tiny-llama", num_kv_heads=2)
            return _cold_and_warm(
                serve_once, dense, fixed_prompt(), store_config, master, tp_size=1, dtype="float32", hybrid=False
            )


def _cold_and_warm(serve, model, prompt, store_config, master, *, tp_size, dtype, hybrid) -> bool:
    verdicts = []
    for label, policy, must_match in _engine_policies():
        config = KVPolicySettings(kvpolicy=policy).kv_transfer_config(upstream_extra={"cache_prefix": label})
        results = []
        for phase in ("cold", "warm"):
            _say(f"  {label}: serving the {len(prompt)}-token prompt in a fresh {phase} engine process (tp={tp_size}) ...")
            results.append(
                serve(
                    model,
                    prompt,
                    tp_size=tp_size,
                    kv_transfer_config=config,
                    mooncake_config_path=store_config,
                    logprobs=20,
                    dtype=dtype,
                    hybrid=hybrid,
                    master_metrics_url=master.metrics_url,
                )
            )
        cold, warm = results
        diff = cold.max_logprob_diff(warm)
        identical = cold.tokens == warm.tokens and diff == 0.0
        hit = cold.num_cached_tokens == 0 and warm.num_cached_tokens > 0
        expectation = "must equal cold" if must_match else "must differ: a rank loads another rank's state"
        _say(
            f"    warm loaded {warm.num_cached_tokens} of {len(prompt)} prompt tokens from Mooncake; cold wrote "
            f"{cold.traffic.objects_written if cold.traffic else '?'} objects; greedy tokens identical: "
            f"{cold.tokens == warm.tokens}; max |logprob difference| "
            f"{'(top-20 candidates disjoint)' if diff == float('inf') else f'{diff:.3g}'} ({expectation})"
        )
        verdicts.append(hit and (identical if must_match else diff > 0.05))
    return all(verdicts)


if __name__ == "__main__":
    sys.exit(run_demo())
