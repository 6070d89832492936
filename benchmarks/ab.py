"""Overhead of two source trees of shadow, A/B: processes alternate between them, each running this tree's
``overhead.py --per-op`` (or ``--models-only``, with ``--models``) against its tree's ``shadow`` package; the
least figure of each side is kept.

    git archive main shadow | tar -x -C /tmp/a && git archive HEAD shadow | tar -x -C /tmp/b
    python benchmarks/ab.py /tmp/a /tmp/b --rounds 4 --clock thread
    python benchmarks/ab.py /tmp/a /tmp/b --rounds 2 --reps 3 --models "mlp 4x1024 b256"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

OVERHEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overhead.py")


# a model's figures A/B compares: its step times (ms) and their ratios to what the step must at least do
MODEL_FIGURES = ("native_ms", "f64_ms", "drift_ms", "both_ms", "full_ms", "steady_full_ms", "drift_ratio",
                 "both_ratio", "full_ratio", "steady_full_ratio")


def run(tree: str, clock: str, reps: int, models: list[str] | None) -> dict:
    """One process of ``overhead.py --per-op`` (or ``--models-only`` for ``models``) importing ``shadow`` from
    ``tree``: its figures by name (a model's as "model: figure")."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    what = ["--models-only", "--models", *models] if models else ["--per-op", "--clock", clock]
    done = subprocess.run([sys.executable, OVERHEAD, *what, "--reps", str(reps)],
                          env=env, capture_output=True, text=True, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if not models:
        return figures
    return {f"{m}: {k}": row[k] for m, row in figures.items() for k in MODEL_FIGURES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="a directory holding a shadow/ package (the baseline)")
    ap.add_argument("b", help="another (the change)")
    ap.add_argument("--rounds", type=int, default=4, help="processes per side, alternating (a b, b a, ...)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="thread", help="overhead.py's --clock")
    ap.add_argument("--reps", type=int, default=7, help="overhead.py's --reps")
    ap.add_argument("--models", nargs="+", metavar="MODEL",
                    help="A/B these models' training steps (overhead.py's --models) instead of the per-op chain")
    args = ap.parse_args()
    figures: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            figures[side].append(run(getattr(args, side), args.clock, args.reps, args.models))
            print(f"round {r} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures[side][-1].items()), flush=True)
    width = max(len(k) for k in figures["a"][0])
    print(f"{'figure':<{width}} {'a (least)':>10} {'b (least)':>10}")
    for k in figures["a"][0]:
        a, b = min(f[k] for f in figures["a"]), min(f[k] for f in figures["b"])
        print(f"{k:<{width}} {a:>10.2f} {b:>10.2f}")
    if args.models:
        return
    for side in ("a", "b"):
        ratios = [f["drift_overhead_us"] / f["bare_replay_overhead_us"] for f in figures[side]]
        print(f"{side}: drift / bare replay per process: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
