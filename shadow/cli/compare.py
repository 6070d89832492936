"""``shadow compare A B``: which ops and modules got worse in B than in A (``shadow.reportdiff``)."""

from __future__ import annotations

import argparse

from ..reportdiff import FACTOR, ReportDiffError, diff_reports
from ..verdict import check_band
from .common import describe, envelope, envelope_argument, factor, load
from .registry import Failure, command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="the baseline report (e.g. the float32 or CPU run)")
    p.add_argument("b", metavar="B", help="the report judged against it (e.g. the bfloat16 or device run)")
    p.add_argument("--factor", type=factor, default=FACTOR,
                   help=f"how much a figure must move to count as changed (default {FACTOR:g})")
    envelope_argument(p)


@command("compare", "compare two reports of the same program: which ops and modules got worse in B, and by how "
         "much (exit status 1 if any; with --envelope, also where B's loss leaves the band)", arguments)
def execute(args: argparse.Namespace) -> int:
    a, b = load(args.a), load(args.b)
    env = envelope(args.envelope)
    try:
        diff = diff_reports(a, b, factor=args.factor)
    except ReportDiffError as exc:
        raise Failure(f"{args.a} and {args.b}: {exc}") from None
    print(f"A = {describe(args.a, a)}")
    print(f"B = {describe(args.b, b)}")
    print(diff.text)
    left = False
    if env is not None:  # the two devices' runs, each against the band of correct implementations
        bands = {"A": check_band(a, env), "B": check_band(b, env)}
        for name, band in bands.items():
            print(f"{name}: {'no loss per optimizer step to hold to the envelope' if band is None else band}")
        left = bands["B"] is not None and bands["B"].left is not None
    return 1 if diff.worse("op") or diff.worse("module") or left else 0
