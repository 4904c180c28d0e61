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
    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.vllm.harness import ClientPool, run_consistency

    verdicts: list[bool] = []
    _step(1, "starting an embedded Mooncake master on 127.0.0.1")
    with MooncakeMaster() as master:
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
            for label, policy, expect_consistent in (
                ("default", load_policy("default"), True),
                ("no-dedup", load_policy("no-dedup"), True),
                ("pre-fix (one model-wide factor)", _pre_fix_policy(), False),
            ):
                _say(f"  running {label} ...")
                report = run_consistency(policy, HYBRID_ARCHETYPE, tp_size, master=master, clients=clients)
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
        _say("  (the pre-fix rule must FAIL: it 'deduplicates' the sharded KDA state and loads another rank's shard)")

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


def _engine_run(master: object) -> bool:
    try:
        from kvpolicy.vllm.e2e import demo_cold_warm
    except ImportError as error:  # vLLM is optional for the demo; the harness above already ran
        _say(f"  skipped: vLLM is not importable here ({error})")
        return True
    with tempfile.TemporaryDirectory(prefix="kvpolicy-demo-") as workdir:
        result = demo_cold_warm(master, Path(workdir), policy="default")
    _say(
        f"  cold: {result.cold.num_cached_tokens} cached tokens; warm (new process): "
        f"{result.warm.num_cached_tokens} of {result.prompt_tokens} prompt tokens loaded from Mooncake; "
        f"greedy tokens identical: {result.tokens_identical}"
    )
    return result.warm.num_cached_tokens > 0 and result.tokens_identical


if __name__ == "__main__":
    sys.exit(run_demo())
