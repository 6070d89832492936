"""The ``shadow`` command line (also ``python -m shadow``):

    shadow run [OPTIONS] SCRIPT [ARGS...]   run a script unchanged under ShadowMode, write shadow-report.json
    shadow show REPORT                      the tables, their legend and the verdict
    shadow html REPORT -o FILE              the report as one self-contained HTML page
    shadow compare A B                      which ops and modules got worse in B than in A
    shadow explain OP                       what shadow knows about an op: every table's answer
    shadow repro REPORT [--call N] [-o DIR] a call over budget as DIR/repro.py (torch alone) + DIR/inputs.pt
    shadow demo | doctor                    a small model's step; the device backends
    shadow --version

Exit status:
    0    success; ``compare``: nothing got worse in B
    1    ``run``: the script raised (its traceback shown, the partial report written); ``compare``: B is worse
    2    a usage error or unusable input, with a one-line message naming the problem and the fix: a bad option, a
         missing script or report, an unwritable ``-o``, a report that cannot be read, two reports not of the same
         program, optimizer steps asked for that the script never made
    N    ``run``: the script's own ``sys.exit(N)``; 128 + the signal's number when a signal stopped it: 130 on
         Ctrl-C (SIGINT), 143 on SIGTERM (a timeout, a job scheduler, CI), 129 on SIGHUP; the partial report written

The CLI is the one place that prints; library code returns objects and leaves rendering to its caller.
Each command is a module of this package (``run``, ``show``, ``html``, ``compare``, ``explain``, ``repro``,
``demo``, ``doctor``) whose ``execute`` registers itself with ``@command`` (``shadow.cli.registry``); ``main`` imports every
module of the package and builds the parser from what registered: adding a command is adding a module.

>>> main(["run", "examples/train.py", "--steps", "1"])   # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import platform
import sys
from typing import Sequence

import torch

from .. import __version__
from .registry import COMMANDS, Command, Failure, fail

# --help lists these first, in this order (try it, run a script, read, compare, check the setup, publish, look an op
# up), then any
# other command by name
LISTED_FIRST = ("demo", "run", "show", "compare", "doctor", "html", "explain")


def _commands() -> list[Command]:
    """Every command: each module of this package imported (a command module registers its command)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    order = {name: i for i, name in enumerate(LISTED_FIRST)}
    return sorted(COMMANDS.values(), key=lambda c: (order.get(c.name, len(order)), c.name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shadow",
        description="Replay a PyTorch program op by op in float64 and report each op's error.",
        epilog="run 'shadow COMMAND --help' for a command's options; exit status: 0 success, 1 the script raised "
               "(run) or B is worse (compare), 2 a usage error or unusable input, N the script's own sys.exit(N)",
    )
    parser.add_argument("--version", action="version",
                        version=f"shadow {__version__} (torch {torch.__version__}, Python {platform.python_version()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in _commands():
        cmd.arguments(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a usage error, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a message on bad arguments
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return COMMANDS[args.command].execute(args)
    except Failure as exc:
        return fail(f"{args.command}: {exc}")
    except BrokenPipeError:  # output piped into `head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail
        return 1
