"""``kvpolicy demo``: everything end to end on one machine, with an embedded Mooncake master on loopback.

1. start a master on 127.0.0.1; 2. validate the shipped policies and example layouts; 3. print the
plan of a hybrid model (Kimi-Linear: MLA + KDA state); 4. run the multi-rank harness for a hybrid
instance under ``default``, ``no-dedup`` and the pre-fix rule, through real Mooncake; 5. where vLLM
runs, serve a tiny model cold then warm through ``KVPolicyConnector``. Stops everything it started.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvpolicy.engine import plan
from kvpolicy.loader import check_file, layouts_dir, load_layout, load_policy, policies_dir
from kvpolicy.models import Policy, Topology
from kvpolicy.mooncake import MooncakeMaster
from kvpolicy.report import format_plan_table

HYBRID_LAYOUT = "kimi-linear-48b-a3b"
HYBRID_ARCHETYPE = "kimi-linear"
PRE_FIX_POLICY = Path(__file__).resolve().parent.parent / "examples" / "policies" / "pre-fix-single-factor.yaml"


def _say(message: str = "") -> None:
    print(message, flush=True)


def _step(number: int, title: str) -> None:
    _say()
    _say(f"[{number}/5] {title}")


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 to ``path``: Mooncake's C++ logging writes there directly, per client."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _pre_fix_policy() -> Policy:
    packaged = Path(__file__).resolve().parent / "examples_policies" / "pre-fix-single-factor.yaml"
    return load_policy(packaged if packaged.is_file() else PRE_FIX_POLICY)


def run_demo(*, tp_size: int = 4, with_engine: bool = True) -> int:
    started = time.monotonic()
    from kvpolicy.vllm.harness import ClientPool, run_consistency

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
        hybrid = plan(load_policy("default"), load_layout(HYBRID_LAYOUT), Topology(tp_size=tp_size))
        _say("  " + format_plan_table(hybrid).replace("\n", "\n  "))

        _step(4, f"multi-rank harness: hybrid MLA + KDA instance, tp={tp_size}, through real Mooncake")
        rows = []
        native_log = Path(tempfile.gettempdir()) / f"kvpolicy-demo-{os.getpid()}.log"
        _say(f"  (Mooncake's and vLLM's own log lines go to {native_log})")
        with _stderr_to(native_log), ClientPool(master) as clients:  # closed before the master stops: a client outliving it blocks
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

        _step(5, "vLLM (CPU, TP=1): tiny model, cold engine then a fresh warm engine, through KVPolicyConnector")
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
    """One line on what the replication audit concluded for a harness group."""
    status = group.audit  # type: ignore[attr-defined]
    factor = group.declared_factor  # type: ignore[attr-defined]
    if status == "agreed":
        return f"agreed, replicated over {factor} ranks"
    if status == "demoted":
        return f"DEMOTED, factor {factor} -> 1: {group.audit_message}"  # type: ignore[attr-defined]
    if status == "off":
        return f"off, factor {factor} trusted unchecked"
    return status


def _engine_run(master: MooncakeMaster) -> bool:
    try:
        from kvpolicy.mooncake.testing import small_client_config
        from kvpolicy.vllm.e2e import SegmentHolder, engine_store_config, fixed_prompt, serve_once
        from kvpolicy.vllm.tinymodel import make_tiny_llama
    except ImportError as error:  # vLLM is optional for the demo; the harness above already ran
        _say(f"  skipped: vLLM is not importable here ({error})")
        return True
    prompt = fixed_prompt()
    config = {
        "kv_connector": "KVPolicyConnector",
        "kv_connector_module_path": "kvpolicy.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvpolicy": "default"},
    }
    with tempfile.TemporaryDirectory(prefix="kvpolicy-demo-") as workdir:
        with _stderr_to(Path(tempfile.gettempdir()) / f"kvpolicy-demo-{os.getpid()}.log"):  # progress bars
            model = make_tiny_llama(Path(workdir) / "tiny-llama", num_kv_heads=2)
        store_config = engine_store_config(small_client_config(master), Path(workdir) / "mooncake.json")
        # Engines mount no segment of their own (so the warm one can read what the cold one wrote after
        # it exited); this process holds the store's memory.
        with SegmentHolder(master.rpc_address):
            results = []
            for label in ("cold", "warm"):
                _say(f"  serving the {len(prompt)}-token prompt in a fresh {label} engine process ...")
                results.append(
                    serve_once(model, prompt, tp_size=1, kv_transfer_config=config, mooncake_config_path=store_config)
                )
    cold, warm = results
    identical = cold.tokens == warm.tokens
    _say(
        f"  cold: {cold.num_cached_tokens} tokens loaded; warm: {warm.num_cached_tokens} of {len(prompt)} prompt tokens "
        f"loaded from Mooncake; greedy tokens identical: {identical}; "
        f"max |logprob difference| {cold.max_logprob_diff(warm):.2g}"
    )
    return cold.num_cached_tokens == 0 and warm.num_cached_tokens > 0 and identical


if __name__ == "__main__":
    sys.exit(run_demo())
