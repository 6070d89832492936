"""What kept per-call records cost in Python's garbage collector: a long chain of tiny ops, per call.

    python benchmarks/records_gc.py                      # 6 rounds of 10,000 calls per configuration
    python benchmarks/records_gc.py --rounds 3 --calls 20000

Each configuration (drift only; the default ShadowMode()) runs twice in one process: keeping every record
(``max_records=None``, the default) and keeping none (``max_records=0``: the aggregates only). A kept record is
two to four objects (the Record, its ErrorStats, its BudgetInfo). Tracked by the garbage collector, as they pile
up they set off full collections, each a walk over every object in the process, torch's included; the report
takes them out of the collector's lists (``shadow.records.untrack``), and this measures what keeping them still
costs. Printed: each round's time per call in us, their mean, and the mean's excess over ``max_records=0``.
"""

from __future__ import annotations

import argparse
import time

import torch

from overhead import DRIFT
from shadow import ShadowMode


def per_call(options: dict, rounds: int, calls: int) -> list[float]:
    """us per call of ``y = y * 1.0001`` on 4 elements, per round of ``calls``, in one ShadowMode."""
    x = torch.randn(4)

    def chain(n: int) -> None:
        y = x
        for _ in range(n):
            y = y * 1.0001

    out = []
    with ShadowMode(**options):
        chain(200)  # first calls: plans, rules, the default spot checks' first 16
        for _ in range(rounds):
            t = time.perf_counter()
            chain(calls)
            out.append((time.perf_counter() - t) / calls * 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=10_000)
    args = p.parse_args()
    torch.manual_seed(0)
    for name, options in (("drift only", DRIFT), ("default", {})):
        means = {}
        for kept in (None, 0):
            rounds = per_call({**options, "max_records": kept}, args.rounds, args.calls)
            means[kept] = sum(rounds) / len(rounds)
            print(f"{name:10s} max_records={kept!s:4s} us/call per round: "
                  f"{' '.join(f'{r:.1f}' for r in rounds)}; mean {means[kept]:.1f}")
        print(f"{name:10s} kept records cost {means[None] - means[0]:+.1f} us a call")


if __name__ == "__main__":
    main()
