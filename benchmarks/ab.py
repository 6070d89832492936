"""Per-op overhead of two source trees of shadow, A/B: processes alternate between them, each running this tree's
``overhead.py --per-op`` against its tree's ``shadow`` package; the least figure of each side is kept.

    git archive main shadow | tar -x -C /tmp/a && git archive HEAD shadow | tar -x -C /tmp/b
    python benchmarks/ab.py /tmp/a /tmp/b --rounds 4 --clock thread
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

OVERHEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overhead.py")


def run(tree: str, clock: str, reps: int) -> dict:
    """One process of ``overhead.py --per-op`` importing ``shadow`` from ``tree``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    done = subprocess.run([sys.executable, OVERHEAD, "--per-op", "--clock", clock, "--reps", str(reps)],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="a directory holding a shadow/ package (the baseline)")
    ap.add_argument("b", help="another (the change)")
    ap.add_argument("--rounds", type=int, default=4, help="processes per side, alternating (a b, b a, ...)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="thread", help="overhead.py's --clock")
    ap.add_argument("--reps", type=int, default=7, help="overhead.py's --reps")
    args = ap.parse_args()
    figures: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            figures[side].append(run(getattr(args, side), args.clock, args.reps))
            print(f"round {r} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures[side][-1].items()), flush=True)
    print(f"{'figure':<26} {'a (least)':>10} {'b (least)':>10}")
    for k in figures["a"][0]:
        a, b = min(f[k] for f in figures["a"]), min(f[k] for f in figures["b"])
        print(f"{k:<26} {a:>10.2f} {b:>10.2f}")
    for side in ("a", "b"):
        ratios = [f["drift_overhead_us"] / f["bare_replay_overhead_us"] for f in figures[side]]
        print(f"{side}: drift / bare replay per process: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
