"""``shadow show``: a report's table, the legend of its columns and the verdict; several reports (the ranks of a
distributed run) merged into one."""

from __future__ import annotations

import argparse

from ..distributed import merge_reports
from ..records import Phase
from ..reportdata import VIEWS
from .common import count_or_all, describe, envelope, envelope_argument, load, summary
from .registry import Failure, command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", nargs="+", help="a report file (shadow run's shadow-report.json, or Report.save's); "
                   "several (the ranks of a distributed run) are merged into one (shadow.merge_reports)")
    p.add_argument("--by", choices=VIEWS, default="op", help="group the table by op (default), module, call site "
                   "or phase")
    p.add_argument("--top", type=count_or_all, default=30, metavar="N|all", help="rows shown (default 30)")
    p.add_argument("--phase", choices=[ph.value for ph in Phase], default=None,
                   help="only the calls of one phase (default: all)")
    p.add_argument("--tree", action="store_true", help="with --by module: every module, its submodules folded in")
    p.add_argument("--plain", action="store_true",
                   help="plain text even on a terminal with rich installed (rich draws the table otherwise)")
    envelope_argument(p)


@command("show", "print a report's table, the legend of its columns and the verdict", arguments)
def execute(args: argparse.Namespace) -> int:
    if args.tree and args.by != "module":
        raise Failure("--tree folds modules into their parents: use it with --by module")
    env = envelope(args.envelope)
    if len(args.report) == 1:
        rep = load(args.report[0])
        print(describe(args.report[0], rep))
    else:
        rep = merge_reports([load(path) for path in args.report])
        print(f"{len(args.report)} reports merged (ranks {', '.join(map(str, rep.meta['ranks']))}): "
              f"{', '.join(args.report)}")
    print()
    try:
        print(summary(rep, by=args.by, top=args.top, phase=args.phase, tree=args.tree, plain=args.plain,
                      envelope=env))
    except ValueError as exc:  # a report saved before call sites and phases were aggregated
        raise Failure(str(exc)) from None
    print()
    print("coverage:", rep.coverage)
    return 0
