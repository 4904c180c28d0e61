"""Declarative per-cache-group TP replication policies for vLLM's Mooncake store connector.

The ``kvpolicy`` command; ``kvpolicy --help`` lists its commands. Exit codes: 0 success; 1 the input is
invalid (every problem printed as ``PATH:LINE:COL: error: ...``) or a check failed; 2 the command line is
wrong; ``discover --check`` also 3 (no evidence) and 4 (a dangerous difference).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpolicy import __version__
from kvpolicy.app.archetypes import archetype_name, archetypes_help
from kvpolicy.app.args import CommandParser
from kvpolicy.app.diagnostic_formats import FORMATS, FileResult, Selection, parse_codes, render
from kvpolicy.app.discover import add_discover_parser
from kvpolicy.app.rule import run_rule
from kvpolicy.app.topology_flags import add_topology_flag, add_topology_flags, several_help, topology_from_args
from kvpolicy.app.vllm_config import kv_transfer_config, policy_warnings
from kvpolicy.documents import schema
from kvpolicy.documents.loader import (
    check_file,
    declared_spec_classes,
    load_layout,
    load_policy,
    schemas_dir,
    shipped_policy_names,
)
from kvpolicy.documents.report import (
    format_explanation,
    format_key_contract,
    format_plan_table,
    format_traffic,
    plan_to_json,
    traffic_to_json,
    versioned,
)
from kvpolicy.evidence.routers import (
    KEYED_KEYS_UNREADABLE,
    RouterExportError,
    check_dynamo_descriptor,
    dynamo_descriptor,
    dynamo_refusals,
    keyed_keys_fix,
)
from kvpolicy.language import catalog
from kvpolicy.language.diagnostics import DocumentError, PlanError, printable_path
from kvpolicy.language.models import KV_CACHE_LAYOUTS, Keyed, Layout, Policy
from kvpolicy.planning.contract import KeyContract, key_contract
from kvpolicy.planning.engine import make_plan, plan_deployment
from kvpolicy.planning.plan import Plan
from kvpolicy.planning.store_layout import StoreSelection
from kvpolicy.planning.traffic import prompt_traffic


def _validate(args: argparse.Namespace) -> int:
    try:
        selection = Selection(_codes(args.select), _codes(args.ignore), args.warnings_as_errors)
    except ValueError as error:
        print(f"kvpolicy validate: error: {error}", file=sys.stderr)
        return 2
    checked = [(path, *check_file(path)) for path in args.paths]
    # A spec class a layout of this command declares (a plugin's) is known to the policies beside it.
    declared = declared_spec_classes((path, document) for path, document, _ in checked if isinstance(document, Layout))
    if declared:
        checked = [
            (path, *check_file(path, declared_classes=declared)) if isinstance(document, Policy) else (path, document, problems)
            for path, document, problems in checked
        ]
    results = [
        FileResult(path, None if document is None else document.kind, selection.apply(problems))
        for path, document, problems in checked
    ]
    out, err = render(results, args.format)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return 0 if all(result.valid for result in results) else 1


def _codes(given: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """The codes of every ``--select``/``--ignore`` given (each a comma-separated list)."""
    return tuple(code for codes in given for code in codes)


def _schema(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else schemas_dir()
    if args.check:
        try:
            stale = schema.stale_files(directory)
        except (OSError, ValueError) as error:  # ValueError: a NUL in the path, a file that is not UTF-8
            print(f"{printable_path(str(directory))}:1:1: error: cannot read the schemas: {_reason(error, directory)}")
            return 1
        for path in stale:
            print(f"{printable_path(str(path))}:1:1: error: schema is stale; run 'kvpolicy schema --write'")
        return 1 if stale else 0
    if args.write:
        try:
            written = schema.write(directory)
        except (OSError, ValueError) as error:  # ValueError: a NUL in the path
            print(f"error: cannot write the schemas into '{printable_path(str(directory))}': {_reason(error, directory)}")
            return 1
        for path in written:
            print(f"wrote {printable_path(str(path))}", file=sys.stderr)
        return 0
    print(json.dumps({name: schema.json_schema(model) for name, model in schema.SCHEMA_FILES.items()}, indent=2))
    return 0


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= 1 << 40:
        raise argparse.ArgumentTypeError(f"expected a number of tokens between 0 and 2**40, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"expected a size between 1 and 4096, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 60, got {text}")
    return value


def _tp_sizes(text: str) -> tuple[int, ...]:
    return tuple(_positive(part.strip()) for part in text.split(","))


def _store_options(args: argparse.Namespace) -> dict[str, object]:
    """``kv_connector_extra_config`` as the store flags set it (argparse lets at most one through)."""
    if args.store_tp is not None:
        return {"store_tp_size": args.store_tp}
    if args.store_tp_lcm is not None:
        return {"enable_store_tp_lcm": True, "prefill_tp_sizes": list(args.store_tp_lcm)}
    return {}


def _planned(args: argparse.Namespace) -> list[tuple[Plan, Layout, StoreSelection]]:
    return _planned_with_policy(args)[1]


def _planned_with_policy(args: argparse.Namespace) -> tuple[Policy, list[tuple[Plan, Layout, StoreSelection]]]:
    """The plan the flags describe at each ``--tp`` size given (in the order given, each once), of the
    layout (with the flag's KV cache layout), and vLLM's store layout choice for it. The refusals at
    every size are one :class:`PlanError`, so all of them are printed at once."""
    options = {**_store_options(args), "cache_prefix": getattr(args, "cache_prefix", "")}
    policy, layout = _policy_and_layout(args.policy, args.layout)
    planned, problems = [], []
    for tp_size in dict.fromkeys(args.tp):
        try:
            planned.append(plan_deployment(
                policy, layout, topology_from_args(argparse.Namespace(**{**vars(args), "tp": tp_size})),
                extra_config=options, kv_cache_layout=args.kv_cache_layout,
            ))
        except PlanError as error:
            problems.extend(error.problems)
    if problems:
        raise PlanError(problems)
    return policy, planned


def idle_rules(policy: Policy, plan: Plan) -> tuple[str, ...]:
    """The rules of ``policy`` that decide no layer of ``plan``: each matches none of the layout's layers
    at that topology, or an earlier rule takes them. A general policy has some for every model; a
    misspelled class or field shows here."""
    deciding = {decision.rule for group in plan.groups for decision in group.decisions}
    return tuple(rule.name for rule in policy.rules if rule.name not in deciding)


def undeclared_classes(policy: Policy, layout: Layout) -> list[str]:
    """A warning for each spec class a rule of ``policy`` matches that neither vLLM 0.32 nor ``layout``
    declares, with the layout's nearest class: the rule can decide nothing for this model."""
    declared = {name for group in layout.groups for member in group.members for name in (member.spec.type, *member.spec.bases)}
    warnings = []
    for index, rule in enumerate(policy.rules):
        for name in rule.match.spec or ():
            if name in declared or name in catalog.SPEC_CLASSES:
                continue
            close = difflib.get_close_matches(name, sorted(declared), n=1)
            hint = f"; did you mean '{close[0]}' (the layout's)?" if close else ""
            warnings.append(f"warning: rule '{rule.name}' ({policy.rule_origin(index)}) matches spec class "
                            f"'{printable_path(name)}', which neither vLLM 0.32 nor layout {layout.model} declares{hint}")
    return warnings


def _policy_and_layout(policy: str, layout: str) -> tuple[Policy, Layout]:
    """Both documents, or one :class:`DocumentError` with the problems of both."""
    loaded: list[Any] = []
    problems = []
    for load, name in ((load_policy, policy), (load_layout, layout)):
        try:
            loaded.append(load(name))
        except DocumentError as error:
            problems.extend(error.diagnostics)
    if problems:
        raise DocumentError(problems)
    return loaded[0], loaded[1]


def _one_or_list(payloads: list[Any]) -> Any:
    """One ``--tp`` size: its JSON document, as always; several: the list of them, in order."""
    return payloads[0] if len(payloads) == 1 else payloads


def _keys(args: argparse.Namespace) -> int:
    policy, planned = _planned_with_policy(args)
    if args.keyed and policy.key.keyed is Keyed.OFF:
        print(f"error: --keyed: the policy's key.keyed is 'off' ({args.policy}): its deployments never key their keys")
        return 2
    keyed = args.keyed or policy.key.keyed is Keyed.REQUIRED
    if keyed and args.format == "dynamo":
        why = "--keyed" if args.keyed else f"{args.policy}: key.keyed is 'required'"
        fix = keyed_keys_fix(policy_requires=policy.key.keyed is Keyed.REQUIRED)
        print(f"error: no Dynamo descriptor ({why}): keyed namespaces: {KEYED_KEYS_UNREADABLE}; {fix}")
        return 1
    contracts = [(key_contract(result, layout, keyed=keyed), layout) for result, layout, _ in planned]
    if args.format == "dynamo":
        return _dynamo(contracts)
    if args.format == "json":
        print(json.dumps(_one_or_list([contract.model_dump(mode="json") for contract, _ in contracts]), indent=2))
    else:
        print("\n\n".join(format_key_contract(contract) for contract, _ in contracts))
    return 0


def _dynamo(contracts: list[tuple[KeyContract, Layout]]) -> int:
    """Dynamo's router descriptor of each plan on stdout; exit 1, with every reason, where its format
    cannot describe a plan. What today's Dynamo refuses besides the format goes to stderr."""
    descriptors, failed = [], False
    for contract, layout in contracts:
        try:
            descriptor = dynamo_descriptor(contract, layout)
        except RouterExportError as error:
            for problem in error.problems:
                print(f"error: no Dynamo descriptor: {_one_line(problem)}")
            failed = True
            continue
        problems = check_dynamo_descriptor(descriptor).problems
        for problem in problems:
            print(f"error: Dynamo's validator refuses the descriptor: {_one_line(problem)}")
        failed = failed or bool(problems)
        descriptors.append((contract, descriptor))
    if failed:
        return 1
    print(json.dumps(_one_or_list([descriptor.model_dump(mode="json") for _, descriptor in descriptors]), indent=2))
    for contract, descriptor in descriptors:
        for refusal in dynamo_refusals(contract, descriptor):
            print(f"note: Dynamo (PR #14965) refuses this today: {refusal}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    policy, planned = _planned_with_policy(args)
    for warning in undeclared_classes(policy, planned[0][1]):
        print(warning, file=sys.stderr)
    if args.format == "json":
        payloads = []
        for result, layout, _ in planned:
            payload = plan_to_json(result)
            if args.explain:
                payload["explanation"] = format_explanation(result).splitlines()
            if args.prompt_tokens is not None:
                payload["traffic"] = traffic_to_json(prompt_traffic(result, layout, args.prompt_tokens))
            payloads.append(payload)
        print(json.dumps(_one_or_list(payloads), indent=2))
        return 0
    for index, (result, layout, store) in enumerate(planned):
        if index:
            print()
        print(format_plan_table(result))
        idle = idle_rules(policy, result)
        if idle:
            print(f"rules deciding no layer: {', '.join(idle)}")
        if store.sharding is None and store.store_namespace:
            print(f"store layout: {store.reason}")
        if args.prompt_tokens is not None:
            print(format_traffic(prompt_traffic(result, layout, args.prompt_tokens)))
        if args.explain:
            print()
            print(format_explanation(result))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from kvpolicy.documents.loader import layouts_dir
    from kvpolicy.planning.diff import compare_plans

    old, new = load_policy(args.old), load_policy(args.new)
    names = args.layout or [path.stem for path in sorted(layouts_dir().glob("*.yaml"))]
    layouts = [(name, load_layout(name)) for name in names]
    topologies = [topology_from_args(argparse.Namespace(tp=tp, pp=args.pp)) for tp in args.tp]
    results = []
    for name, layout in layouts:
        for topology in topologies:
            plans = []
            for policy in (old, new):
                try:
                    plans.append(make_plan(policy, layout, topology))
                except PlanError as error:
                    plans.append(str(error))
            results.append(compare_plans(name, f"tp={topology.tp_size} pp={topology.pp_size}", *plans))
    changed = [result for result in results if result.changed]
    if args.format == "json":
        print(json.dumps(versioned("PolicyDiff", {"old": old.name, "new": new.name, "changed": bool(changed),
                                                  "plans": [_change_json(result) for result in results]}), indent=2))
    else:
        print(f"diff: policy {old.name} -> {new.name}, {len(layouts)} layouts x tp {', '.join(map(str, args.tp))}")
        for result in changed:
            print(_change_text(result))
        print(f"{len(results) - len(changed)} of {len(results)} plans unchanged")
    return 1 if changed else 0


def _change_text(result: Any) -> str:
    from kvpolicy.documents.report import format_bytes

    head = f"{result.layout} {result.topology}:"
    if isinstance(result.old, str) or isinstance(result.new, str):
        if isinstance(result.old, str) and isinstance(result.new, str):
            return f"{head} refused by both, now: {result.new}"
        which, reason = ("old", result.old) if isinstance(result.old, str) else ("new", result.new)
        return f"{head} refused by the {which} policy: {reason}"
    lines = [head]
    if result.fingerprint_changed:
        lines[0] += (
            f" fingerprint {result.old.fingerprint} -> {result.new.fingerprint}"
            " (instances of the new policy miss everything the old one stored)"
        )
    if result.template_changed:
        lines.append(f"  key template: {result.old.key_template} -> {result.new.key_template}")
    for group in result.groups:
        before, after = group.written_bytes_per_token
        lines.append(
            f"  group {group.index} {group.name}: {'; '.join(group.changes)}; "
            f"written/token {format_bytes(before)} -> {format_bytes(after)}"
        )
    return "\n".join(lines)


def _change_json(result: Any) -> dict[str, Any]:
    before, after = result.written_bytes_per_token
    return {
        "layout": result.layout,
        "topology": result.topology,
        "changed": result.changed,
        "fingerprint": {
            "old": None if isinstance(result.old, str) else result.old.fingerprint,
            "new": None if isinstance(result.new, str) else result.new.fingerprint,
        },
        "refused": {
            "old": result.old if isinstance(result.old, str) else None,
            "new": result.new if isinstance(result.new, str) else None,
        },
        "key_template_changed": result.template_changed,
        "written_bytes_per_token": {"old": before, "new": after},
        "groups": [
            {"index": group.index, "name": group.name, "changes": list(group.changes),
             "written_bytes_per_token": {"old": group.written_bytes_per_token[0], "new": group.written_bytes_per_token[1]}}
            for group in result.groups
        ],
    }


def _explain(args: argparse.Namespace) -> int:
    args.explain = True
    return _plan(args)


def _vllm_config(args: argparse.Namespace) -> int:
    config = kv_transfer_config(args.policy, role=args.role, strict=args.strict)
    warnings = policy_warnings(args.policy)
    print(json.dumps(config, separators=(",", ":")))
    for warning in warnings:
        print(warning, file=sys.stderr)
    said = f", with {len(warnings)} warning{'s' if len(warnings) != 1 else ''} (above)" if warnings else ""
    print(f"# policy '{load_policy(args.policy).name}' is valid{said}; pass the line above to --kv-transfer-config",
          file=sys.stderr)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from kvpolicy.app.doctor import format_json, format_text, run_doctor  # imports vLLM, torch, Mooncake lazily

    report = run_doctor(policy=args.policy, timeout_s=args.timeout)
    print(format_json(report) if args.format == "json" else format_text(report))
    return 0 if report.passed else 1


def _list(args: argparse.Namespace) -> int:
    for name in shipped_policy_names():
        print(f"{name:14} {load_policy(name).description.strip()}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvpolicy.app.demo import run_demo  # imports vLLM and Mooncake; keep them out of the other commands

    return run_demo(tp_size=args.tp, with_engine=not args.no_engine)


def _audit(args: argparse.Namespace) -> int:
    """The offline replication audit: the connector's audit on simulated ranks holding the bytes the
    model really holds, then a warm load to check the fallback's bytes. The report is on stdout, and
    it alone says what was demoted: what vLLM, torch and Mooncake log goes to a log file."""
    import tempfile

    from kvpolicy.app.quiet import libraries_logging_to

    # Every input is judged before torch, vLLM and Mooncake are imported (seconds): a wrong path or name
    # is refused at once.
    policy = load_policy(args.policy)
    layout = load_layout(args.layout) if args.layout is not None else None
    with libraries_logging_to(Path(tempfile.gettempdir()) / f"kvpolicy-audit-{os.getpid()}.log"):
        return _run_audit(args, policy, layout)


def _run_audit(args: argparse.Namespace, policy: Policy, layout: Layout | None) -> int:
    from kvpolicy.evidence.audit import ReplicationAuditError
    from kvpolicy.mooncake import MooncakeMaster
    from kvpolicy.mooncake.pool import ClientPool
    from kvpolicy.sim import archetype_from_layout, run_consistency

    if layout is not None:
        target = f"layout {Path(args.layout).stem}"
        archetype = archetype_from_layout(layout, layers_per_group=2, name=f"audit-{Path(args.layout).stem}")
    else:
        from kvpolicy.sim import get_archetype

        archetype = get_archetype(args.archetype)  # the name was checked when parsed
        target = f"archetype {args.archetype}"
    try:
        with MooncakeMaster() as master, ClientPool(master) as clients:
            report = run_consistency(
                policy, archetype, args.tp, master=master, clients=clients, num_tokens=args.tokens, audit=True
            )
    except ReplicationAuditError as error:
        if args.format == "json":
            payload = versioned("AuditReport", {"policy": policy.name, "target": target, "tp": args.tp,
                                                "enforced": str(error)})
            print(json.dumps(payload, indent=2))
        else:
            print(f"audit: policy {policy.name}, {target}, tp={args.tp}: stopped (audit: enforce)")
            print(error)
        return 1
    failed = any(group.audit == "demoted" or not group.consistent for group in report.groups)
    if args.format == "json":
        payload = versioned("AuditReport", {
            "policy": policy.name,
            "target": target,
            "tp": args.tp,
            "passed": not failed,
            "hit_tokens": report.hit_tokens,
            "groups": [
                {
                    "index": group.index,
                    "name": group.name,
                    "declared_factor": group.declared_factor,
                    "factor": group.factor,
                    "true_factor": group.true_factor,
                    "audit": group.audit,
                    "message": group.audit_message,
                    "consistent": group.consistent,
                    "mismatched_ranks": list(group.mismatched_ranks),
                }
                for group in report.groups
            ],
        })
        print(json.dumps(payload, indent=2))
        return 1 if failed else 0
    print(f"audit: policy {policy.name}, {target}, tp={args.tp}, {report.num_tokens}-token prompt")
    for group in report.groups:
        verdict = {
            "agreed": f"agreed: replicated over {group.factor} ranks, confirmed",
            "demoted": f"DEMOTED: factor {group.declared_factor} -> 1 (own namespace)",
            "-": "factor 1, nothing to audit",
            "pending": "no evidence (all-zero blocks), not confirmed",
            "unverified": "no evidence (all-zero blocks), not confirmed",
        }.get(group.audit, group.audit)
        loaded = "bytes loaded back correctly" if group.consistent else (
            "WRONG bytes loaded on ranks " + ",".join(map(str, group.mismatched_ranks))
        )
        print(f"  group {group.index} {group.name}: {verdict}; {loaded}")
        if group.audit_message:
            print(f"    {group.audit_message}")
    demoted = sum(group.audit == "demoted" for group in report.groups)
    if failed:
        print(f"FAILED: {demoted} group(s) demoted; fix the rule(s) named above before deploying this policy")
    else:
        print("passed: every replicated group is identical across its replica sets")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="kvpolicy", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvpolicy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = commands.add_parser(
        "validate", help="check policy and layout files; print every problem",
        description="Check policies, layouts and discovery reports without vLLM: every problem of every file at once, "
        "each on one line with its location, what is wrong, the fix where there is one and a stable code "
        "(kvpolicy rule CODE explains it). Exit 1 on an error, or on a warning with --warnings-as-errors.",
    )
    validate.add_argument("paths", nargs="+", metavar="PATH", help="policy, layout or discovery report files")
    validate.add_argument("--format", choices=FORMATS, default="text", help="text, json, github (Actions annotations) or sarif")
    validate.add_argument(
        "--select", type=parse_codes, action="append", default=(), metavar="CODES",
        help="report only these warnings: codes or prefixes, comma-separated (KVP201,KVP203) or the flag repeated",
    )
    validate.add_argument(
        "--ignore", type=parse_codes, action="append", default=(), metavar="CODES",
        help="do not report these warnings: comma-separated or the flag repeated",
    )
    validate.add_argument(
        "--warnings-as-errors", action="store_true", help="count the warnings reported as errors (exit 1)"
    )
    validate.set_defaults(run=_validate)

    rule = commands.add_parser(
        "rule", help="explain a diagnostic code, with an example that reports it",
        description="Print a diagnostic code's page: what it finds, why it matters, an example that reports it and "
        "the example fixed, each run for real, and the page's URL; --all lists every code.",
    )
    rule.add_argument("code", nargs="?", metavar="CODE", help="a code (KVP203) or a check's name (unreachable-rule)")
    rule.add_argument("--all", action="store_true", help="list every code instead")
    rule.set_defaults(run=lambda args: run_rule(args, main))

    schema_command = commands.add_parser(
        "schema", help="print the JSON Schemas, or check/write schemas/",
        description="Print the JSON Schemas of the policy, layout, discovery report and connector settings formats "
        "(for editors and other validators), or check or regenerate the schemas/ directory from the code.",
    )
    schema_command.add_argument("--check", action="store_true", help="exit 1 when schemas/ is stale")
    schema_command.add_argument("--write", action="store_true", help="regenerate schemas/")
    schema_command.add_argument("--dir", help="schema directory (default: the project's schemas/)")
    schema_command.set_defaults(run=_schema)

    for name, run, summary, description in (
        ("plan", _plan, "show the plan of a policy for a layout and topology",
         ("Plan a policy for a layout at a topology, as the connector would: per KV-cache group the rule that "
          "matched, the replication factor, who writes, and the bytes written per token with and without dedup; "
          "with --prompt-tokens, the store objects one prompt writes and reads.")),
        ("explain", _explain, "for each layer: which rule matched and why earlier ones did not",
         ("The plan, then for each group and layer the rule that matched and why each earlier rule did not: the "
          "command to run when a layer ends up in a group or factor you did not expect.")),
        ("keys", _keys, "print the key contract: every store key prefix a plan reads and writes",
         ("Print the key contract of a plan: the store key prefix every rank writes and every lookup reads, per "
          "group, as text, as JSON for routers, or as Dynamo's router descriptor.")),
    ):
        command = commands.add_parser(name, help=summary, description=description)
        if name == "keys":
            command.add_argument(
                "--cache-prefix", default="", metavar="PREFIX", help="kv_connector_extra_config cache_prefix"
            )
            command.add_argument(
                "--keyed", action="store_true",
                help="the deployment names kvpolicy_secret (keyed namespaces): chunk keys end in an HMAC only its "
                "secret computes, which routers cannot read (implied by a policy whose key.keyed is 'required')",
            )
        command.add_argument("--policy", required=True, help="a shipped policy's name or a path")
        command.add_argument("--layout", required=True, help="an example layout's name or a path")
        add_topology_flags(command, required=("tp_size",), several=("tp_size",))
        store_tp = command.add_mutually_exclusive_group()
        store_tp.add_argument(
            "--store-tp", type=_positive, metavar="N", help="kv_connector_extra_config store_tp_size: share store shards across TP sizes"
        )
        store_tp.add_argument(
            "--store-tp-lcm", type=_tp_sizes, metavar="TP,TP,...",
            help="enable_store_tp_lcm with these prefill_tp_sizes (the store TP size is their lcm)",
        )
        command.add_argument(
            "--kv-cache-layout", choices=KV_CACHE_LAYOUTS,
            help="the KV cache layout the attention backend resolves (vLLM's CPU backend: LBHNC); default: the "
            "layout's kv_cache_layout, else unknown (LBNHC, vLLM's preference, where --store-tp needs one)",
        )
        formats = ("text", "json", "dynamo") if name == "keys" else ("text", "json")
        command.add_argument(
            "--format", choices=formats, default="text",
            help="text, json (the key contract) or dynamo (Dynamo's router descriptor)" if name == "keys"
            else "text (a table) or json (the plan, every group and rank)",
        )
        command.set_defaults(run=run)
        if name == "keys":
            continue
        command.add_argument(
            "--prompt-tokens",
            type=_non_negative,
            metavar="N",
            help="also show the store objects one prompt of N tokens writes (cold) and reads (warm)",
        )
        command.add_argument("--explain", action="store_true", default=name == "explain", help=argparse.SUPPRESS)

    diff = commands.add_parser(
        "diff", help="what a policy edit changes, per layout and TP size; exit 1 on any change",
        description="Plan two policies on the same layouts and TP sizes and print what changes: factors, "
        "namespaces, bytes written per token, and whether instances of the new policy still read what the old one "
        "stored. Exit 1 on any change, so CI can gate a policy edit on review.",
    )
    diff.add_argument("old", metavar="OLD", help="the policy before the edit (a shipped name or a path)")
    diff.add_argument("new", metavar="NEW", help="the policy after the edit")
    diff.add_argument("--layout", nargs="+", help="layouts' names or paths (repeatable; default: every example)")
    add_topology_flag(diff, "tp_size", nargs="+", default=[1, 2, 4, 8], help=several_help("tp_size", [1, 2, 4, 8]))
    add_topology_flag(diff, "pp_size")
    diff.add_argument("--format", choices=("text", "json"), default="text", help="text or json (every change)")
    diff.set_defaults(run=_diff)

    vllm_config = commands.add_parser(
        "vllm-config", help="print the --kv-transfer-config JSON for a policy",
        description="Validate a policy and print the --kv-transfer-config value that runs it with vllm serve, "
        "on one line, with kvpolicy's connector and vLLM's recompute-on-load-failure.",
    )
    vllm_config.add_argument("--policy", required=True, help="a shipped policy's name or a path")
    vllm_config.add_argument(
        "--role", choices=("kv_both", "kv_producer", "kv_consumer"), default="kv_both",
        help="vLLM's kv_role: kv_both stores and loads; kv_producer only stores (a prefill instance), "
        "kv_consumer only loads (a decode instance)",
    )
    vllm_config.add_argument("--strict", action="store_true", help="make specs no rule matches an error")
    vllm_config.set_defaults(run=_vllm_config)

    doctor = commands.add_parser(
        "doctor",
        help="check vLLM, torch, Mooncake, MOONCAKE_CONFIG_PATH and a policy; one line each (exit 1 if wrong)",
        description="Check a serving host: the vLLM release, torch and its CUDA, the Mooncake build and the system "
        "libraries its native modules need, MOONCAKE_CONFIG_PATH and the master it names, and a policy; one line "
        "each, with the fix for what is wrong. Exit 1 if anything is.",
    )
    doctor.add_argument("--policy", help="also validate this policy and print its --kv-transfer-config")
    doctor.add_argument(
        "--timeout", type=_seconds, default=2.0, metavar="SECONDS",
        help="how long the master gets to answer (default 2)",
    )
    doctor.add_argument("--format", choices=("text", "json"), default="text", help="text or json (the whole report)")
    doctor.set_defaults(run=_doctor)

    list_command = commands.add_parser(
        "list", help="list the shipped policies",
        description="List the policies shipped with kvpolicy, each with its description; any command taking a "
        "policy takes one of these names or a path.",
    )
    list_command.set_defaults(run=_list)

    audit = commands.add_parser(
        "audit", help="check a policy's replicated groups on simulated ranks through real Mooncake (exit 1 if wrong)",
        description="Run the replication audit offline: simulated TP ranks holding the bytes the model holds save "
        "and load a prompt through an embedded Mooncake master under the policy; every group the policy replicates "
        "is compared across its replica sets and every rank's loaded bytes checked. Needs vLLM and Mooncake.",
    )
    audit.add_argument("--policy", required=True, help="a shipped policy's name or a path")
    target = audit.add_mutually_exclusive_group(required=True)
    target.add_argument("--archetype", type=archetype_name, help=archetypes_help("a simulated archetype"))
    target.add_argument("--layout", help="an example layout's name or a path")
    add_topology_flag(audit, "tp_size", required=True)
    audit.add_argument("--tokens", type=_positive, default=256, metavar="N", help="prompt length (default 256)")
    audit.add_argument("--format", choices=("text", "json"), default="text", help="text or json (per group)")
    audit.set_defaults(run=_audit)

    add_discover_parser(commands)

    demo = commands.add_parser(
        "demo", help="embedded Mooncake master, multi-rank simulation, vLLM cold/warm run",
        description="The main job: validate the shipped policies, plan a hybrid model, save and reload it through "
        "an embedded Mooncake master with simulated ranks under correct and wrong policies, then serve a tiny "
        "hybrid cold and warm on vLLM (about 2 minutes on 2 cores). Needs vLLM and Mooncake.",
    )
    add_topology_flag(demo, "tp_size", default=4, help="TP size of the simulated hybrid instance")
    demo.add_argument("--no-engine", action="store_true", help="skip the vLLM engine run")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # here, where a closed pipe is handled, not at interpreter exit
        return code
    except DocumentError as error:
        for diagnostic in error.diagnostics:
            print(diagnostic)
        return 1
    except PlanError as error:
        for problem in error.problems:
            where = f"{printable_path(problem.location)}: " if problem.location else ""
            print(f"{where}error: {_one_line(problem.message)} [KVP301]")
        return 1
    except ValueError as error:
        print(f"error: {_one_line(error)}")
        return 1
    except BrokenPipeError:
        # The reader went away (`kvpolicy plan ... | head`): nothing more to say, and no traceback
        # when Python flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    except ImportError as error:
        print(
            f"error: {args.command} needs {error.name or 'a module'} (in a kvpolicy checkout: pip install '.[vllm]' "
            f"on GPUs, '.[cpu]' on CPUs; see the README's Install): {_one_line(error)}"
        )
        return 1
    except Exception as error:
        if os.environ.get("KVPOLICY_TRACEBACK"):
            raise
        print(f"error: {type(error).__name__}: {_one_line(error)} (set KVPOLICY_TRACEBACK=1 for the traceback)")
        return 1


def _reason(error: BaseException, directory: Path) -> str:
    """Why a file-system call on ``directory`` failed, as words (not the exception's class), naming the
    path at fault where it is another."""
    if isinstance(error, FileExistsError):
        return "it is not a directory"
    if isinstance(error, OSError) and error.strerror:
        at = error.filename
        where = f" ('{printable_path(str(at))}')" if at is not None and str(at) != str(directory) else ""
        return f"{error.strerror[0].lower()}{error.strerror[1:]}{where}"
    if isinstance(error, ValueError) and "null" in str(error):
        return "the path contains a NUL character"
    return _one_line(error)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 500 else f"{text[:500]}..."


if __name__ == "__main__":
    sys.exit(main())
