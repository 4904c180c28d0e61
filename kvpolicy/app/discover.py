"""``kvpolicy discover``: observe which TP ranks hold identical bytes, and propose the rules.

Three forms::

    kvpolicy discover --archetype A | --layout L --tp N [--tp M ...] [--out DIR]   # observe, offline
    kvpolicy discover --propose REPORT [REPORT ...] [--output FILE] [--name NAME]  # reports -> policy
    kvpolicy discover --check POLICY REPORT [REPORT ...]                           # policy vs reports

On an engine the connector observes (``kvpolicy_discover``); offline the simulation does, on ranks
that run the connector's own worker and hold the bytes the model holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from kvpolicy.app.topology_flags import add_topology_flag
from kvpolicy.diagnostics import printable_path
from kvpolicy.discovery import DiscoveryReport
from kvpolicy.loader import load_layout, load_policy
from kvpolicy.propose import head_factor_of, load_reports, propose
from kvpolicy.propose import disagreements as policy_disagreements

__all__ = ["add_discover_parser"]

DEFAULT_OUT = Path("discovery")


def add_discover_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    discover = commands.add_parser(
        "discover",
        help="observe which TP ranks hold identical bytes (simulated), propose a policy from reports, or check one",
        description=(
            "Observe, on simulated ranks holding the bytes the model holds, which TP ranks hold byte-identical "
            "KV cache per group and layer (an engine does the same with the connector's kvpolicy_discover); turn "
            "discovery reports into a policy (--propose); or check a policy against them (--check)."
        ),
    )
    target = discover.add_mutually_exclusive_group()
    target.add_argument("--archetype", help="observe a simulated archetype (gqa-gdn, mla, kimi-linear, gemma4-like, ...)")
    target.add_argument("--layout", help="observe a layout (an example layout's name or a path) on simulated ranks")
    target.add_argument("--propose", action="store_true", help="write the policy the REPORTs support (exit 1 if they cannot)")
    target.add_argument("--check", metavar="POLICY", help="compare POLICY's plan with the REPORTs (exit 1 on any difference)")
    add_topology_flag(discover, "tp_size", action="append", default=None,
                      help="TP size to observe at (repeat for several: --tp 2 --tp 4)")
    discover.add_argument("--steps", type=int, default=4, help="save steps observed per TP size (default 4)")
    discover.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory the reports go to (default ./discovery)")
    discover.add_argument("reports", nargs="*", metavar="REPORT", help="discovery reports (--propose, --check)")
    discover.add_argument("--output", "-o", type=Path, help="file the proposed policy goes to (default: stdout)")
    discover.add_argument("--name", default="discovered", help="the proposed policy's name (default discovered)")
    discover.set_defaults(run=run_discover, parser=discover)


def run_discover(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.propose or args.check:
        if not args.reports:
            parser.error("--propose and --check need one or more REPORT files")
        if args.tp:
            parser.error("--tp observes; with --propose or --check the reports say their TP sizes")
        return _propose(args) if args.propose else _check(args)
    if args.archetype is None and args.layout is None:
        parser.error("give --archetype or --layout (to observe), --propose or --check (with REPORT files)")
    if args.reports:
        parser.error("REPORT files go with --propose or --check")
    if not args.tp:
        parser.error("give the TP sizes to observe at: --tp N (repeat for several)")
    if not 1 <= args.steps <= 64:
        parser.error(f"--steps must be between 1 and 64, got {args.steps}")
    return _observe(args)


def _observe(args: argparse.Namespace) -> int:
    from kvpolicy.app.environment import environment

    # vLLM logs to stdout; keep the summary readable, and leave the caller's environment as it was.
    with environment(VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")):
        return _run_observe(args)


def _run_observe(args: argparse.Namespace) -> int:
    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.mooncake.native_log import native_stderr_to
    from kvpolicy.mooncake.pool import ClientPool
    from kvpolicy.sim import archetype_from_layout, get_archetype
    from kvpolicy.sim.archetypes import BLOCK_SIZE
    from kvpolicy.sim.discover import run_discovery

    if args.layout is not None:
        layout = load_layout(args.layout)
        stem = Path(args.layout).stem
        archetype = archetype_from_layout(layout, layers_per_group=2, name=stem, num_kv_heads=None)
    else:
        try:
            archetype = get_archetype(args.archetype)
        except ValueError as error:
            print(f"kvpolicy discover: error: {error}", file=sys.stderr)
            return 2
        stem = archetype.name
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"error: cannot create '{printable_path(str(args.out))}': {error.strerror or error}")
        return 1
    native_log = Path(tempfile.gettempdir()) / f"kvpolicy-discover-{os.getpid()}.log"
    tokens = (2 * args.steps + 2) * BLOCK_SIZE
    with native_stderr_to(native_log), MooncakeMaster() as master, ClientPool(master) as clients:
        for tp_size in args.tp:
            path = args.out / f"{stem}-tp{tp_size}.yaml"
            report = run_discovery(archetype, tp_size, path, master=master, clients=clients, steps=args.steps,
                                   num_tokens=tokens)
            _summary(report, path)
    return 0


def _summary(report: DiscoveryReport, path: Path) -> None:
    topology = report.topology
    print(f"{printable_path(str(path))}: {report.model} at tp {topology.tp_size}, {report.steps} steps observed")
    for group, observed in zip(report.layout.groups, report.groups, strict=True):
        types = ", ".join(dict.fromkeys(member.spec.type for member in group.members))
        partition = [list(members) for members in observed.partition] or "nothing compared"
        factor = head_factor_of(observed.partition, topology) if observed.partition else None
        said = f"factor {factor}" if factor is not None else "no factor expresses it"
        print(f"  group {observed.index} {observed.name or '-'} ({types}): equal bytes in {partition} ({said}); "
              f"{observed.evidence.blocks} blocks compared, {observed.evidence.zero_blocks} all-zero")


def _propose(args: argparse.Namespace) -> int:
    loaded, problems = load_reports(args.reports)
    if problems:
        for problem in problems:
            print(problem)
        return 1
    proposal, refusals = propose(loaded, name=args.name)
    if proposal is None:
        for refusal in refusals:
            print(refusal)
        print(f"no policy proposed: {len(refusals)} observation{'s' if len(refusals) != 1 else ''} cannot be concluded "
              "from (see above)", file=sys.stderr)
        return 1
    if args.output is None:
        sys.stdout.write(proposal.text)
        return 0
    try:
        args.output.write_text(proposal.text, encoding="utf-8")
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        print(f"error: cannot write '{printable_path(str(args.output))}': {reason}")
        return 1
    print(f"wrote {printable_path(str(args.output))} ({len(proposal.policy.rules)} rules); compare it with the policy "
          f"you run: kvpolicy diff CURRENT {printable_path(str(args.output))} --layout LAYOUT --tp N", file=sys.stderr)
    return 0


def _check(args: argparse.Namespace) -> int:
    policy = load_policy(args.check)
    loaded, problems = load_reports(args.reports)
    if problems:
        for problem in problems:
            print(problem)
        return 1
    differ = False
    for item in loaded:
        found = policy_disagreements(policy, item.report)
        label = f"{printable_path(item.path)}: policy {policy.name} vs {item.report.model} at tp {item.report.topology.tp_size}"
        if found:
            differ = True
            print(f"{label}: {len(found)} difference{'s' if len(found) != 1 else ''}")
            for line in found:
                print(f"  {line}")
        else:
            print(f"{label}: agrees with every observed group and layer")
    return 1 if differ else 0
