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
import re
import sys
import tempfile
from pathlib import Path

from kvpolicy.app.archetypes import archetype_name, archetypes_help
from kvpolicy.app.topology_flags import add_topology_flag, several_help
from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.documents.propose import load_reports, propose
from kvpolicy.evidence.discovery import DiscoveryReport
from kvpolicy.language.diagnostics import DocumentError, printable_path
from kvpolicy.language.models import NAME_PATTERN

__all__ = ["add_discover_parser"]

DEFAULT_OUT = Path("discovery")
DEFAULT_STEPS = 4
MAX_SIMULATED_TP = 64
"""Largest TP size observed offline: every simulated rank opens a Mooncake client (1-2 s and a few
dozen descriptors each)."""


def _policy_name(text: str) -> str:
    if len(text) > 128 or not re.fullmatch(NAME_PATTERN, text):
        raise argparse.ArgumentTypeError(
            f"'{ascii(text[:40])[1:-1]}{'...' if len(text) > 40 else ''}' is not a policy name: kebab-case, as 'my-model', "
            "at most 128 characters"
        )
    return text


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
    target.add_argument("--archetype", type=archetype_name, help=archetypes_help("observe a simulated archetype"))
    target.add_argument("--layout", help="observe a layout (an example layout's name or a path) on simulated ranks")
    target.add_argument("--model", metavar="CONFIG_OR_DIR",
                        help="observe a tiny copy of a model on a real vLLM engine, from its config.json (a file, a "
                             "directory holding one, a transformers model type or a vLLM architecture)")
    target.add_argument("--propose", action="store_true", help="write the policy the REPORTs support (exit 1 if they cannot)")
    target.add_argument("--check", metavar="POLICY",
                        help="compare POLICY's plan with the REPORTs: exit 0 agrees, 1 harmless differences (or a "
                             "policy that cannot plan a report), 3 no evidence for some layer, 4 DANGEROUS (a replica "
                             "set holding different bytes: another rank's state would load)")
    add_topology_flag(discover, "tp_size", nargs="+", default=None, help=several_help("tp_size"))
    discover.add_argument("--steps", type=int, metavar="K", help=f"save steps observed per TP size (default {DEFAULT_STEPS})")
    discover.add_argument("--out", type=Path, help="directory the reports go to (default ./discovery)")
    discover.add_argument("--check-warm", action="store_true",
                          help="with --model: a second engine loads what the first stored and must produce the same tokens")
    discover.add_argument("reports", nargs="*", metavar="REPORT", help="discovery reports (--propose, --check)")
    discover.add_argument("--output", "-o", type=Path, help="file the proposed policy goes to (default: stdout)")
    discover.add_argument("--name", type=_policy_name, help="the proposed policy's name (default discovered)")
    discover.set_defaults(run=run_discover, parser=discover)


def run_discover(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    observing = ("--steps", args.steps), ("--out", args.out), ("--check-warm", args.check_warm or None)
    proposing = ("--output", args.output), ("--name", args.name)
    if args.propose or args.check:
        if not args.reports:
            parser.error("--propose and --check need one or more REPORT files")
        if args.tp:
            parser.error("--tp observes; with --propose or --check the reports say their TP sizes")
        given = [flag for flag, value in observing if value is not None]
        if args.check:
            given += [flag for flag, value in proposing if value is not None]
        if given:
            parser.error(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not go with "
                         f"{'--check' if args.check else '--propose'}")
        return _propose(args) if args.propose else _check(args)
    if args.model is not None:
        from kvpolicy.app.discover_model import run_discover_model

        return run_discover_model(args)
    if args.check_warm:
        parser.error("--check-warm goes with --model")
    if args.archetype is None and args.layout is None:
        parser.error("give --archetype or --layout (to observe), --propose or --check (with REPORT files)")
    if args.reports:
        parser.error("REPORT files go with --propose or --check")
    if not args.tp:
        parser.error("give the TP sizes to observe at: --tp N (repeat for several)")
    given = [flag for flag, value in proposing if value is not None]
    if given:
        parser.error(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --propose")
    too_large = [size for size in args.tp if size > MAX_SIMULATED_TP]
    if too_large:
        parser.error(f"--tp {too_large[0]}: the simulation observes up to TP {MAX_SIMULATED_TP} (a Mooncake client per rank)")
    args.tp = list(dict.fromkeys(args.tp))
    args.steps = DEFAULT_STEPS if args.steps is None else args.steps
    args.out = DEFAULT_OUT if args.out is None else args.out
    if not 1 <= args.steps <= 64:
        parser.error(f"--steps must be between 1 and 64, got {args.steps}")
    return _observe(args)


def _observe(args: argparse.Namespace) -> int:
    from kvpolicy.app.quiet import libraries_logging_to

    # The summary is on stdout; what vLLM, torch and Mooncake log goes to a log file.
    with libraries_logging_to(Path(tempfile.gettempdir()) / f"kvpolicy-discover-{os.getpid()}.log"):
        return _run_observe(args)


def _run_observe(args: argparse.Namespace) -> int:
    """Observe offline, one report per TP size. Everything that can be judged without the simulation
    is judged first, before torch, vLLM and Mooncake are imported (seconds) and a master started: the
    layout file; every spec class the simulation holds bytes for (vLLM's own: a plugin's class is
    refused at its line, naming the engine route); the layout planned at each TP size, as ``kvpolicy
    plan`` plans it (an expression that fails there is located in the layout's file). Exit 3 when a
    group of some report has no evidence (no block compared), as ``discover --check`` does."""
    from kvpolicy.documents.loader import read_text, resolve_layout_path
    from kvpolicy.language.catalog import SPEC_CLASSES
    from kvpolicy.language.models import Topology
    from kvpolicy.language.yamlsource import parse
    from kvpolicy.planning.engine import make_plan

    layout = load_layout(args.layout) if args.layout is not None else None
    if layout is not None:
        unknown = [
            (index, position, member.spec.type)
            for index, group in enumerate(layout.groups)
            for position, member in enumerate(group.members)
            if member.spec.type not in SPEC_CLASSES
        ]
        if unknown:
            path = str(resolve_layout_path(args.layout))
            source = parse(read_text(path), path)[1]
            raise DocumentError([
                source.diagnostic(
                    ("groups", index, "spec", "type") if layout.groups[index].uniform is None
                    else ("groups", index, "uniform", position, "spec", "type"),
                    f"{spec_type} is not a spec class of vLLM 0.32 (vllm.v1.kv_cache_interface): the simulation holds "
                    "the bytes of vLLM's own classes only, and would have to guess what each rank holds of this one; "
                    "observe it on an engine instead: serve the model with the connector's kvpolicy_discover setting "
                    "(kv_connector_extra_config {\"kvpolicy_discover\": \"report.yaml\"}), then "
                    "kvpolicy discover --propose the reports",
                    code="KVP404",
                )
                for index, position, spec_type in unknown
            ])
        no_dedup = load_policy("no-dedup")  # what the simulated instances run
        for tp_size in args.tp:
            make_plan(no_dedup, layout, Topology(tp_size=tp_size))  # PlanError: located, as `kvpolicy plan` prints it
    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.mooncake.pool import ClientPool
    from kvpolicy.sim import archetype_from_layout, get_archetype
    from kvpolicy.sim.archetypes import BLOCK_SIZE
    from kvpolicy.sim.discover import run_discovery

    if layout is not None:
        stem = Path(args.layout).stem
        archetype = archetype_from_layout(layout, layers_per_group=2, name=stem, num_kv_heads=None)
    else:
        archetype = get_archetype(args.archetype)  # the name was checked when parsed
        stem = archetype.name
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"error: cannot create '{printable_path(str(args.out))}': {error.strerror or error}")
        return 1
    tokens = (2 * args.steps + 2) * BLOCK_SIZE
    unobserved = False
    with MooncakeMaster() as master, ClientPool(master) as clients:
        for tp_size in args.tp:
            path = args.out / f"{stem}-tp{tp_size}.yaml"
            report = run_discovery(archetype, tp_size, path, master=master, clients=clients, steps=args.steps,
                                   num_tokens=tokens)
            unobserved = not _summary(report, path) or unobserved
    return 3 if unobserved else 0


def _summary(report: DiscoveryReport, path: Path) -> bool:
    """Print each group's observation (:func:`kvpolicy.documents.propose.observation_summary`); whether every
    layer had evidence."""
    from kvpolicy.documents.propose import observation_summary

    lines, every = observation_summary(report, printable_path(str(path)))
    for line in lines:
        print(line)
    return every


def _propose(args: argparse.Namespace) -> int:
    loaded, problems = load_reports(args.reports)
    if problems:
        for problem in problems:
            print(problem)
        return 1
    proposal, refusals = propose(loaded, name=args.name or "discovered")
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
    """Compare the plan of POLICY with each REPORT's observation. The first line is the verdict; exit
    codes, the worst found:

    - 0: the policy plans every observed group and layer as observed;
    - 1: it departs only harmlessly (it keeps apart ranks that held the same bytes, and writes them
      more than once), or it cannot plan a report, or an input is invalid (errors located);
    - 3: NO EVIDENCE: some layer compared no (or too few) blocks, so it cannot be judged (nothing
      dangerous was found elsewhere); an observation that proves nothing is not a pass;
    - 4: DANGEROUS: it puts ranks observed holding different bytes in one replica set (it treats as
      replicated state that is sharded): a warm hit would load another rank's state.

    (2 stays argparse's: the command line is wrong.)"""
    from kvpolicy.documents.propose import check_policy

    loaded, problems = load_reports(args.reports)
    try:
        policy = load_policy(args.check)
    except DocumentError as error:
        problems = [*error.diagnostics, *problems]
        policy = None
    if problems or policy is None:
        for problem in problems:
            print(problem)
        return 1
    lines, code = check_policy(policy, loaded)
    for line in lines:
        print(line)
    return code
