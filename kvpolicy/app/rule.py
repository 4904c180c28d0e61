"""``kvpolicy rule CODE``: what a diagnostic code means, how to fix it, and an example that reports
it, run for real (as ``ruff rule`` does); ``kvpolicy rule --all`` lists every code. The text is the
documentation's diagnostics reference (:mod:`kvpolicy.app.reference`), from one source."""

from __future__ import annotations

import argparse
import sys

from kvpolicy.app.reference import find_check, rule_list, rule_text
from kvpolicy.diagnostics import CHECKS_BY_CODE


def run_rule(args: argparse.Namespace) -> int:
    if args.all == (args.code is not None):
        print("kvpolicy rule: error: give one CODE (e.g. KVP203) or --all", file=sys.stderr)
        return 2
    if args.all:
        sys.stdout.write(rule_list())
        return 0
    check = find_check(args.code)
    if check is None:
        shown = ascii(args.code[:40])[1:-1] + ("..." if len(args.code) > 40 else "")
        print(f"kvpolicy rule: error: unknown code '{shown}'; codes: {', '.join(CHECKS_BY_CODE)}", file=sys.stderr)
        return 2
    sys.stdout.write(rule_text(check))
    return 0
