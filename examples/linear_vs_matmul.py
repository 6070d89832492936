"""F.linear(x, W, B) and x @ W.T + B differ by up to 0.03 on CPU float32: is one of them wrong?

Both are run under ShadowMode, which replays every op in float64. For each path the script prints
each op's own (local) error against that float64 replay, the end-to-end error of the result, and the
same error in units of the float32 spacing at the magnitude of the dot product's terms
(sum_k |x_ik W_jk| + |B_j|): the scale a correct float32 summation of those terms is accurate to.

    python examples/linear_vs_matmul.py [--k 8192] [--scale 10] [--seed 0]

Typical output (CPU, torch 2.13): the two results differ by 0.03125 = 2 float32 ulps of ~2e5; each is
within ~5.5 ulps of the exact value, so the difference is two correct roundings taken in a different
order (addmm adds the bias inside the GEMM; mm rounds the product, then add rounds again), not a bug.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F

from shadow import ShadowMode
from shadow.metrics import compare  # the error units (abs, ulp, rel_norm), defined once


@dataclasses.dataclass
class PathResult:
    name: str
    y: torch.Tensor  # the device (float32) result
    ops: list[tuple[str, float, float]]  # (op, local max ulp, local max abs) for each op that computed
    err_abs: float  # max |y - exact| of the result
    err_ulp: float  # ... in float32 ulps of |exact| (shadow.metrics' ulp)
    err_ulp_terms: float  # ... in float32 ulps of sum |terms| (the dot product's own scale)
    budget_used: float  # the worst op's local error as a fraction of its float32 error budget (> 1: over)


def make_case(m: int, k: int, n: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-negative inputs of size ~scale (post-ReLU activations, say): no cancellation, large sums."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(m, k, generator=g) * scale
    w = torch.rand(n, k, generator=g) * scale
    b = torch.rand(n, generator=g) * scale
    return x, w, b


def ulp_at(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each float64 ``magnitude``: 2**(e-1) * eps for magnitude in
    [2**(e-1), 2**e), as shadow.metrics defines the ulp, but taken at a magnitude other than |exact|."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(magnitude.clamp_min(fi.tiny))
    return torch.ldexp(torch.full_like(magnitude, fi.eps / 2), e)


def run_path(name: str, fn, x, w, b, terms: torch.Tensor) -> PathResult:
    with ShadowMode() as sm:
        y = fn(x, w, b)
    exact = sm.shadow_of(y)  # float64 replay of the same ops from the same (exactly upcast) inputs
    ops = [(r.op, r.local.max_ulp, r.local.max_abs) for r in sm.report.records if r.local is not None]
    used = max(r.budget.used for r in sm.report.records if r.budget is not None)
    e2e = compare(y, exact, y.dtype)
    err = (y.double() - exact).abs()
    return PathResult(name, y, ops, e2e.max_abs, e2e.max_ulp, (err / ulp_at(terms, y.dtype)).max().item(), used)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=64, help="rows of x")
    ap.add_argument("--k", type=int, default=8192, help="reduction length (in features)")
    ap.add_argument("--n", type=int, default=256, help="out features")
    ap.add_argument("--scale", type=float, default=10.0, help="inputs are uniform in [0, scale)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    x, w, b = make_case(args.m, args.k, args.n, args.scale, args.seed)
    # sum_k |x_ik W_jk| + |B_j| in float64: every product of two float32 is exact in float64
    terms = x.double().abs() @ w.double().abs().T + b.double().abs()
    paths = [
        run_path("F.linear(x, W, B)", lambda x, w, b: F.linear(x, w, b), x, w, b, terms),
        run_path("x @ W.T + B", lambda x, w, b: x @ w.T + b, x, w, b, terms),
    ]

    print(f"x: {args.m}x{args.k}, W: {args.n}x{args.k}, B: {args.n}; float32 on cpu, values in [0, {args.scale:g})")
    print(f"largest |result| {terms.max().item():.6g}: float32 spacing there "
          f"{ulp_at(terms.max().reshape(1), torch.float32).item():.6g}")
    for p in paths:
        print(f"\n{p.name}")
        for op, ulp, ab in p.ops:
            print(f"  local  {op:<24} max {ulp:8.3f} ulp  {ab:.4g} abs")
        print(f"  result vs float64: max {p.err_abs:.4g} abs = {p.err_ulp:.3f} ulp of |exact| "
              f"= {p.err_ulp_terms:.3f} ulp of sum|terms|")

    a, c = paths[0].y, paths[1].y
    diff = (a.double() - c.double()).abs()
    diff_terms = (diff / ulp_at(terms, torch.float32)).max().item()
    print(f"\ndifference between the two device results: max {diff.max().item():.6g} abs "
          f"= {diff_terms:.3f} ulp of sum|terms|; {(diff > 0).double().mean().item():.1%} of elements differ")

    # Verdict. A correct float32 summation of k terms errs, typically, by about sqrt(k) units of
    # u * sum|terms| (Higham & Mary 2019, probabilistic rounding-error analysis); the deterministic
    # worst case is k units. Each check is one line; shadow's error budgets (gamma_k * |x||W|^T for the
    # matmul, ulps for the add) are the deterministic version of the same question, op by op.
    limit = math.sqrt(args.k)
    checks = [
        (f"{p.name}: every op within its float32 error budget (worst uses {p.budget_used:.3f} of it)",
         p.budget_used <= 1.0)
        for p in paths
    ] + [
        (f"{p.name}: {p.err_ulp_terms:.2f} ulp of sum|terms| <= sqrt(k) = {limit:.0f}", p.err_ulp_terms <= limit)
        for p in paths
    ]
    checks.append((f"the difference ({diff_terms:.2f} ulp) is explained by the two errors together ("
                   f"{paths[0].err_ulp_terms + paths[1].err_ulp_terms:.2f} ulp)",
                   diff_terms <= paths[0].err_ulp_terms + paths[1].err_ulp_terms + 1e-9))
    print("\nchecks:")
    for text, ok in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {text}")
    if all(ok for _, ok in checks):
        print(f"verdict: not suspicious. Both results are within {max(p.err_ulp_terms for p in paths):.2f} ulp "
              f"(of their terms' magnitude) of the exact value, as a correct float32 summation is; the "
              f"{diff.max().item():.3g} difference is two correct roundings taken in a different order.")
    else:
        print("verdict: suspicious: at least one result is less accurate than a correct float32 summation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
