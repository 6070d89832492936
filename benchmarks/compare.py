"""Time per call of shadow.metrics.compare: the fused numba pass against the paths it replaced (never a
timed test).

    python benchmarks/compare.py            # 4, 1k, 1M, 16M elements; float32 and bfloat16
    python benchmarks/compare.py --sizes 1000000 --repeat 3

    python benchmarks/compare.py --sizes 1000 1048576 --no-first-call   # a quick look

"before" is compare with the fused pass switched off (``metrics.fused = None``, as without numba): the Python
loop up to 64 elements, numpy up to 16k, then the torch passes. "fused" is compare as shipped. Each figure is
the best of ``--repeat`` rounds of about 20 ms (the mean of the calls in the round), the four ways of one row
taking turns round by round. The first call's cost
(compiling, or loading numba's on-disk cache) is measured apart, in fresh processes with an empty and then a
filled cache directory. A second table times a result's drift and local figures (the second reference with
a bound): two compare calls against compare_pair, which reads the result once for both (``shadow._fused.pair``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from shadow import metrics

SIZES = (4, 1000, 1 << 20, 1 << 24)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _inputs(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A result with about 1 ulp of error against its reference, and a per-element bound."""
    g = torch.Generator().manual_seed(n)
    r = torch.randn(n, dtype=torch.float64, generator=g)
    y = (r * (1 + torch.finfo(dtype).eps * torch.randn(n, dtype=torch.float64, generator=g))).to(dtype)
    return y, r, r.abs() * torch.finfo(dtype).eps + 1e-30


def _best(fns, repeat: int) -> list[float]:
    """Best time per call of each function over ``repeat`` rounds of about 20 ms each, the functions taking
    turns round by round, so that a machine busy with other work slows both alike."""
    calls = []
    for fn in fns:
        fn()
        start = time.perf_counter()
        fn()
        calls.append(max(1, int(0.02 / max(time.perf_counter() - start, 1e-9))))
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for j, (fn, k) in enumerate(zip(fns, calls)):
            start = time.perf_counter()
            for _ in range(k):
                fn()
            best[j] = min(best[j], (time.perf_counter() - start) / k)
    return best


def _before(*args):
    fused, metrics.fused = metrics.fused, None
    try:
        return metrics.compare(*args)
    finally:
        metrics.fused = fused


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def first_calls() -> list[tuple[str, float, float]]:
    """(case, seconds with an empty cache, seconds with the cache the first process filled)."""
    code = ("import sys, time, torch; from shadow.metrics import compare, compare_pair; n = int(sys.argv[1]); "
            "y = torch.randn(n); r = y.double(); t = time.perf_counter(); "
            "compare_pair(y, r, r, torch.float32) if sys.argv[2] == 'pair' else compare(y, r, torch.float32); "
            "print(time.perf_counter() - t)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for case, n, how in (("float32, 1k elements (serial pass)", 1000, "one"),
                         ("float32, 1M elements (parallel pass)", 1 << 20, "one"),
                         ("float32, 1k elements (paired pass)", 1000, "pair")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=root)
            runs = [float(subprocess.run([sys.executable, "-c", code, str(n), how], env=env, check=True,
                                         capture_output=True, text=True).stdout) for _ in range(2)]
        rows.append((case, runs[0], runs[1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    ap.add_argument("--repeat", type=int, default=20, help="timed rounds (best kept)")
    ap.add_argument("--no-first-call", action="store_true", help="skip the compile-time measurement")
    a = ap.parse_args()
    if metrics.FUSED_UNAVAILABLE is not None:
        sys.exit(f"the fused pass is off here: {metrics.FUSED_UNAVAILABLE}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | elements | before | fused | speedup | before, bound | fused, bound | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for name, dtype in DTYPES.items():
        for n in a.sizes:
            y, r, b = _inputs(n, dtype)
            times = _best([lambda fn=fn, bound=bound: fn(y, r, dtype, *bound)
                           for bound in ((), (b,)) for fn in (_before, metrics.compare)], a.repeat)
            print(f"| {name} | {n} | {_fmt(times[0])} | {_fmt(times[1])} | {times[0] / times[1]:.1f}x "
                  f"| {_fmt(times[2])} | {_fmt(times[3])} | {times[2] / times[3]:.1f}x |")
    print("\n| dtype | elements | two compare calls | compare_pair | speedup |\n|---|---|---|---|---|")
    for name, dtype in DTYPES.items():
        for n in a.sizes:
            y, r, b = _inputs(n, dtype)
            lo = r * (1 + 2**-40)
            two, pair = _best([lambda: (metrics.compare(y, r, dtype), metrics.compare(y, lo, dtype, b)),
                               lambda: metrics.compare_pair(y, r, lo, dtype, b)], a.repeat)
            print(f"| {name} | {n} | {_fmt(two)} | {_fmt(pair)} | {two / pair:.1f}x |")
    if not a.no_first_call:
        print("\n| first call | empty cache (compiles) | filled cache (loads) |\n|---|---|---|")
        for case, cold, warm in first_calls():
            print(f"| {case} | {cold:.2f} s | {warm:.3f} s |")


if __name__ == "__main__":
    main()
