"""``shadow repro REPORT [--call N] [-o DIR]``: a minimal reproduction of a call over budget, from the inputs the
run kept (``Report.repro``, docs/repro.md): DIR/repro.py (torch alone) and DIR/inputs.pt."""

from __future__ import annotations

import argparse

from ..errors import ReproError
from .common import count, load
from .registry import Failure, command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("report", help="a report whose run kept inputs (its REPORT.inputs.pt beside it)")
    p.add_argument("--call", type=count, default=None, metavar="N",
                   help="the call to reproduce, by its record index (default: the worst call kept)")
    p.add_argument("-o", "--output", metavar="DIR", default=None,
                   help="the folder to write repro.py and inputs.pt into (default: ./repro-OP-CALL)")


@command("repro", "write a minimal reproduction of a call over budget: DIR/repro.py (needs torch alone; exits 1 "
         "over budget) and DIR/inputs.pt", arguments)
def execute(args: argparse.Namespace) -> int:
    rep = load(args.report)
    try:
        files = rep.repro(args.call, args.output)
    except ReproError as exc:
        raise Failure(str(exc)) from None
    print(f"wrote {files.script} and {files.inputs}: call {files.call}, {files.op}, {files.budget_used:.3g}x its "
          f"budget; run it with: python {files.script} (--device cpu to compare, --setup MODULE to import a "
          "backend first)")
    return 0
