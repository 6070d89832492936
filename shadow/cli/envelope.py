"""``shadow envelope``: the envelope of correct implementations of an unmodified script's training (``shadow.envelope``
for a script): its loss per optimizer step, float64 and under ``--runs`` runs with random rounding, and the band."""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from ..attribution.envelope import RANDOM_DEVICES, Enough, program_envelope
from ..band import CONFIDENCE
from .common import positive_int, unwritable
from .registry import Failure, command
from .run import Stops, exec_script


def _confidence(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number between 0 and 1, e.g. 0.99")
    return value


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="the Python script to run, unchanged (shadow's options come before it)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments: its sys.argv[1:]")
    p.add_argument("--runs", type=positive_int, default=8, metavar="R",
                   help="runs with random rounding (default 8; at least 2); the script runs R + 1 times")
    p.add_argument("--steps", type=positive_int, default=10, metavar="N",
                   help="optimizer steps per run (default 10): each run of the script is stopped after them")
    p.add_argument("--device", choices=RANDOM_DEVICES, default=RANDOM_DEVICES[0],
                   help="the random-rounding device of the runs (default stochastic_budget; docs/envelope.md)")
    p.add_argument("--confidence", type=_confidence, default=CONFIDENCE, metavar="C",
                   help=f"of the band: a further correct run lies inside with this chance (default {CONFIDENCE})")
    p.add_argument("--seed", type=int, default=0, help="the first run's seed of its random roundings (default 0)")
    p.add_argument("-o", "--output", metavar="PATH", default="shadow-envelope.json",
                   help="where to write the envelope (default shadow-envelope.json; shadow.load_envelope reads it)")


@command("envelope", "the band of losses correct implementations of a script's training reach, step by step: the "
         "script run once in float64 and --runs times with random rounding", arguments)
def execute(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        raise Failure(f"{args.script}: no such file; give the path of a Python script: shadow envelope [OPTIONS] "
                      "SCRIPT [ARGS...]")
    if args.runs < 2:
        raise Failure(f"--runs {args.runs}: at least 2 runs are needed for a band (8 is a good start)")
    if problem := unwritable(args.output):
        raise Failure(f"-o {args.output}: {problem}; give a writable path")
    output = os.path.abspath(args.output)
    start = (torch.get_rng_state(), random.getstate(), _numpy_state())

    def restore() -> None:  # every run of the script starts from the generators the first found
        torch.set_rng_state(start[0])
        random.setstate(start[1])
        if start[2] is not None:
            import numpy as np

            np.random.set_state(start[2])

    with Stops() as stops:
        try:
            env = program_envelope(lambda: exec_script(args.script, args.args, stops, ends=(Enough,)), restore,
                                   args.runs, args.steps, device=args.device, confidence=args.confidence,
                                   seed=args.seed, meta={"argv": [args.script, *args.args]})
        except RuntimeError as exc:
            raise Failure(str(exc)) from None
        env.save(output)
    print(env.table())
    print(f"shadow: envelope written to {args.output}: {env.runs} {env.device} runs of {env.steps} steps; compare a "
          f"run's losses with shadow.load_envelope({args.output!r}).contains(losses)", file=sys.stderr)
    return 0


def _numpy_state() -> object | None:
    if "numpy" not in sys.modules:
        return None
    import numpy as np

    return np.random.get_state()
