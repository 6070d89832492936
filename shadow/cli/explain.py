"""``shadow explain OP``: what shadow knows about one op: every table's answer (``shadow.explain``)."""

from __future__ import annotations

import argparse

from ..errors import ShadowOptionError
from ..explanation import explain
from .registry import command, fail


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", help="an op: aten.mm (every overload), aten.mm.default, mm, aten::mm.out")


@command("explain", "every table's answer for one op: replay rule, budget family and formula, reference, defined "
         "region, op sets, and what each emulated device does to it", arguments)
def execute(args: argparse.Namespace) -> int:
    try:
        print(explain(args.op).render())
    except ShadowOptionError as exc:
        return fail(f"explain: {exc}")
    return 0
