"""Linear algebra budgets: Higham's gamma_K(ua) * (|A| @ |B|) for matmuls (Thm 3.5, any order, FMA or not),
gamma_K(ua) * (|x| conv |w|) for convolutions and their backward, the outer products, cdist, cross, a
normwise bound for FFTs, and no a-priori bound (inf) for solves and factorizations, whose error a correct
implementation makes depends on the inputs' conditioning.

>>> from shadow.budgets import budget_for
>>> A = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]], dtype=torch.float64)
>>> b = budget_for(torch.ops.aten.mm.default, (A, A.T), {}, [A @ A.T], torch.float32)
>>> b.family, b.of_sum
('matmul', True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..metrics import fused_bounds
from ..opsets import CONVOLUTIONS, MATMULS, Family
from ..plan import OpPlan
from .core import (Budget, BudgetCall, add_into, aten, coefficient, is_float, overloads, reduced_dims, register_budget,
                   register_budget_predicate, sumsq)
from .elementwise import ULPS
from .units import EXP_ULPS, accumulation_sq, gamma


# --- matmul family: gamma_K(ua) * (|A| @ |B|) (Higham Thm 3.5, any order, FMA or not) ---
# |A| @ |B| costs another matmul, as much as the float64 replay. Above this many multiply-adds the bound
# uses Cauchy-Schwarz instead: (|A||B|)_ij <= ||a_i||_2 ||b_j||_2, O(MK + KN + MN) work, looser by ~pi/2 on
# random data (sum|a||b| ~ (2/pi) K vs ||a|| ||b|| ~ K for Gaussian entries), more when the mass of a_i
# and b_j sits on different k (sparse or one-hot rows).
EXACT_MAGNITUDE_MACS = 1 << 16
# gelu's largest slope, Phi(x) + x phi(x) at x = sqrt(2): 1.1289 (relu's is 1)
GELU_LIPSCHITZ = 1.13


def _sq_sum(c: BudgetCall, t: torch.Tensor, dim: int) -> torch.Tensor:
    """sum of |t|**2 along dim (keepdim), by the faster way for t's layout: vector_norm reduces a unit-stride
    dim several times faster than square + sum, and a strided one several times slower (weights seen
    transposed, W.T, are the rule in backward); the squares in one temporary (``c.empty``)."""
    if t.dim() and t.stride(dim) == 1 and not t.is_complex():
        return torch.linalg.vector_norm(t, dim=dim, keepdim=True).square_()
    squares = torch.abs(t, out=c.empty(t)).square_() if t.is_complex() else torch.square(t, out=c.empty(t))
    return squares.sum(dim, keepdim=True)


def _sq_sums(c: BudgetCall, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|t|**2 summed along t's rows and down its columns (dims -1 and -2, keepdim): the bound reads a matmul's
    operands one way and the scale the other, so both come from one read where the fused pass reads t
    (``shadow._fused_bounds.squares``: a 2-D float64 matrix, by rows or by columns), else from ``_sq_sum``."""
    both = None if fused_bounds is None else fused_bounds.squares(t)
    return both if both is not None else (_sq_sum(c, t, -1), _sq_sum(c, t, -2))


def _mm_magnitude(c: BudgetCall, A: torch.Tensor, B: torch.Tensor, sums: Callable, scale: float = 1.0,
                  base: Any = 0.0) -> torch.Tensor:
    """base + scale * (an upper bound of |A| @ |B|), batched on leading dims: exact when small,
    Cauchy-Schwarz else from the operands' sums of squares (``sums(0)``, ``sums(1)``: ``_sq_sums`` of A and
    B), in one fused pass over the M x N result, in reused memory where it has the result's shape."""
    if A.numel() and B.numel() and A.numel() * B.shape[-1] <= EXACT_MAGNITUDE_MACS:
        return torch.add(base, A.abs() @ B.abs(), alpha=scale)
    na = sums(0)[0].sqrt().mul_(scale)
    nb = sums(1)[1].sqrt()
    base = torch.as_tensor(base, dtype=torch.float64)
    r = c.out()
    if torch.broadcast_shapes(base.shape, na.shape, nb.shape) == r.shape:  # c.empty is real for a complex r
        return torch.addcmul(base, na, nb, out=c.empty(r))
    return torch.addcmul(base, na, nb)


def _mm_scale_sq(sums: Callable) -> float:
    """Two roundings (one per operand) of every product a_ik b_kj: 2 sum_k (sum_i a_ik^2)(sum_j b_kj^2)."""
    ca = sums(0)[1].squeeze(-2)  # [..., K]
    rb = sums(1)[0].squeeze(-1)  # [..., K]
    return 2.0 * float(torch.linalg.vecdot(ca, rb).sum())


def _addmm_like(c: BudgetCall, A: torch.Tensor, B: torch.Tensor, K: int, bias: Any, beta: Any, alpha: Any) -> Budget:
    r = c.out()
    beta, alpha = coefficient(beta), coefficient(alpha)
    use_bias = isinstance(bias, torch.Tensor) and beta != 0

    @functools.cache
    def sums(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # operand i's, computed once for the bound and the scale
        return _sq_sums(c, (A, B)[i])

    def make():
        g = gamma(K + (2 if use_bias or alpha != 1 else 0), c.ua)
        base = torch.full((), c.floor(), dtype=torch.float64)
        # beta and alpha may be rounded to the device dtype (bf16 addmm does): one u each where they scale
        if use_bias:
            base = base + ((g + (2 * c.u if beta != 1 else 0)) * abs(beta)) * bias.abs()
        out = _mm_magnitude(c, A, B, sums, (g + (2 * c.u if alpha != 1 else 0)) * abs(alpha), base)
        out = out.reshape(r.shape) if out.numel() == r.numel() else out.expand(r.shape)
        return [c.out_rounding(r, out)]

    def scale_sq():
        s, r_sq = _mm_scale_sq(sums) * abs(alpha) ** 2, sumsq(r)
        acc = accumulation_sq(K, s / 2, r_sq)
        if use_bias:
            # a broadcast repeats every element of bias equally often
            s += sumsq(bias) * (r.numel() / max(bias.numel(), 1)) * abs(beta) ** 2
        return s + c.out_rounding_sq(r_sq), acc

    return c.budget(make, scale_sq)


def _factors(c: BudgetCall) -> tuple[Any, Any, Any]:
    """(a, b, bias) of a matmul-like call (bias None where the op has none)."""
    m = MATMULS[c.plan.base]
    return c.a[m.a], c.a[m.b], c.a[m.bias] if m.bias is not None else None


@register_budget(*overloads("mm", "bmm", "matmul", "addmm", "baddbmm"), family=Family.MATMUL)
def mm_budget(c: BudgetCall) -> Budget:
    """beta * bias + alpha * (A @ B), batched on leading dims."""
    A, B, bias = _factors(c)
    if A.dim() < 2 or B.dim() < 2:
        return NotImplemented
    return _addmm_like(c, A, B, A.shape[-1], bias, c.a.get("beta"), c.a.get("alpha"))


@register_budget(*overloads("_addmm_activation"), family=Family.MATMUL)
def addmm_activation_budget(c: BudgetCall) -> Budget:
    """relu (1-Lipschitz) or gelu (Lipschitz ``GELU_LIPSCHITZ``) after addmm, plus the activation's own ulps."""
    A, B, bias = _factors(c)
    b = _addmm_like(c, A, B, A.shape[-1], bias, c.a.get("beta"), c.a.get("alpha"))
    r = c.out()
    return c.budget(lambda: [GELU_LIPSCHITZ * b.bound[0] + c.ulp_bound(r, ULPS["transcendental"])],
                    b.scales)


@register_budget(*overloads("addbmm"), family=Family.MATMUL)
def addbmm_budget(c: BudgetCall) -> Budget:
    """beta*C + alpha*sum_b A_b @ B_b: one inner product of length batch*K."""
    A, B, bias = _factors(c)
    Af = A.permute(1, 0, 2).reshape(A.shape[1], -1)  # [M, batch*K]
    Bf = B.reshape(-1, B.shape[-1])  # [batch*K, N]
    return _addmm_like(c, Af, Bf, Af.shape[-1], bias, c.a.get("beta"), c.a.get("alpha"))


@register_budget(*overloads("mv", "addmv"), family=Family.MATMUL)
def mv_budget(c: BudgetCall) -> Budget:
    A, v, bias = _factors(c)
    return _addmm_like(c, A, v.unsqueeze(-1), A.shape[-1], None if bias is None else bias.reshape(-1, 1),
                       c.a.get("beta"), c.a.get("alpha"))


@register_budget(*overloads("dot", "vdot", "inner"), family=Family.MATMUL)
def dot_budget(c: BudgetCall) -> Budget:
    a, b, _ = _factors(c)
    if a.dim() != 1:
        return NotImplemented
    r = c.out()
    n = a.shape[0]

    def scale_sq():
        terms, r_sq = float((a.abs() * b.abs()).square().sum()), sumsq(r)
        return 2.0 * terms + c.out_rounding_sq(r_sq), accumulation_sq(n, terms, r_sq)

    return c.budget(lambda: [add_into(c.final(r), (a.abs() * b.abs()).sum(), alpha=gamma(n, c.ua))],
                    scale_sq)


@register_budget(*overloads("addr", "outer", "ger"), family=Family.MATMUL)
def addr_budget(c: BudgetCall) -> Budget:
    """beta*C + alpha*v1 v2^T: products and one add per element, intermediates possibly in the device dtype."""
    v1, v2 = c.a.get("vec1", c.a.get("self")), c.a.get("vec2")
    r = c.out()
    bias = c.a["self"] if "vec1" in c.a else None
    beta, alpha = coefficient(c.a.get("beta")), coefficient(c.a.get("alpha"))

    def make():
        t = abs(alpha) * torch.outer(v1.abs(), v2.abs())
        if bias is not None and beta != 0:
            t = t + abs(beta) * bias.abs()
        return [c.final(r, 2.0) + 3 * c.u * t]

    return c.budget(make)


# --- convolution: gamma_K(ua) * (|x| conv |w|), K = C_in/groups * prod(kernel) ---
def _conv_args(a: dict) -> tuple:
    return a["stride"], a["padding"], a["dilation"], a["transposed"], a["output_padding"], a["groups"]


def _conv_K(w: torch.Tensor, transposed: bool, groups: int) -> int:
    k = math.prod(w.shape[2:])
    return (w.shape[0] // groups if transposed else w.shape[1]) * k


def _conv_magnitude(x: torch.Tensor, w: torch.Tensor, a: dict, scale: float = 1.0) -> torch.Tensor:
    """scale * an upper bound of |x| conv |w|: exact when small; else Cauchy-Schwarz per output: the norm
    of the input window times the norm of the output channel's filter. Window norms: x**2 summed over each
    group's channels, then a ones kernel (one channel in, one out, per group): ~1/(C_in C_out) of the op's
    work; the result is one fused pass over the output."""
    stride, padding, dilation, transposed, output_padding, groups = _conv_args(a)
    macs = x.shape[0] * _conv_K(w, transposed, groups) * (w.shape[1] * groups if transposed else w.shape[0])
    conv = functools.partial(aten.convolution.default, stride=stride, padding=padding, dilation=dilation,
                             transposed=transposed, output_padding=output_padding, groups=groups)
    if macs * 64 <= EXACT_MAGNITUDE_MACS:  # tiny: the exact magnitude costs less than the bookkeeping
        return conv(x.abs(), w.abs(), None) * scale
    ks = w.shape[2:]
    if transposed:
        c_out = w.shape[1] * groups
        wn = w.abs().square().reshape(groups, w.shape[0] // groups, w.shape[1], -1).sum((1, 3))  # [g, C_out/g]
    else:
        c_out = w.shape[0]
        wn = w.abs().square().reshape(groups, c_out // groups, -1).sum(-1)  # [g, C_out/g]
    N, c_in = x.shape[0], x.shape[1]
    xs = x.abs().square().reshape(N, groups, c_in // groups, *x.shape[2:]).sum(2)  # [N, g, *in]
    xn = conv(xs, torch.ones((groups, 1, *ks), dtype=torch.float64, device=xs.device), None).sqrt_()  # [N, g, *out]
    spatial = xn.shape[2:]
    xn = xn.reshape(N, groups, 1, *spatial)
    wn = (wn.sqrt() * scale).reshape(1, groups, c_out // groups, *([1] * len(spatial)))
    return (xn * wn).reshape(N, c_out, *spatial)


@register_budget(*overloads(*CONVOLUTIONS), family=Family.CONV)
def conv_budget(c: BudgetCall) -> Budget:
    m = CONVOLUTIONS[c.plan.base]
    x, w, bias = c.a[m.a], c.a[m.b], c.a[m.bias]
    if not isinstance(w, torch.Tensor) or w.dim() < 3:
        return NotImplemented
    transposed, groups = c.a["transposed"], c.a["groups"]
    K = _conv_K(w, transposed, groups)
    r = c.out()

    def make():
        g = gamma(K + (1 if bias is not None else 0), c.ua)
        b = _conv_magnitude(x, w, c.a, g)
        extra = c.floor() + (g * bias.abs().reshape(1, -1, *([1] * (b.dim() - 2))) if bias is not None else 0.0)
        return [c.out_rounding(r, b.add_(extra))]

    def scale_sq():
        # sum over outputs of sum over terms of x^2 w^2, by linearity: conv(sum_n x^2, sum_co w^2)
        a = c.a
        x2 = x.abs().square().sum(0, keepdim=True)
        if transposed:
            w2 = w.abs().square().sum(1, keepdim=True)  # [C_in, 1, *k]
        else:
            w2 = w.abs().square().reshape(groups, w.shape[0] // groups, *w.shape[1:]).sum(1)  # [g, C_in/g, *k]
        s = aten.convolution.default(x2, w2, None, a["stride"], a["padding"], a["dilation"], transposed,
                                     a["output_padding"], groups)
        terms, r_sq = float(s.sum()), sumsq(r)
        return 2.0 * terms + c.out_rounding_sq(r_sq) + (
            sumsq(torch.broadcast_to(bias.reshape(1, -1, *([1] * (r.dim() - 2))), r.shape)) if bias is not None
            else 0.0), accumulation_sq(K, terms, r_sq)

    return c.budget(make, scale_sq)


@register_budget(*overloads("convolution_backward"), family=Family.CONV)
def conv_backward_budget(c: BudgetCall) -> Budget:
    """(grad_input, grad_weight, grad_bias), each an inner product bounded as the forward:
    grad_input: K = C_out/groups * prod(kernel) terms, magnitude <= ||grad_output window|| * ||w[:, ci]||
    (window norms by the op itself on grad_output**2 with a ones kernel, one channel per group);
    grad_weight: N * (spatial size) terms, magnitude <= ||grad_output[:, co]|| * ||input[:, ci]|| (whole
    channels: looser than the windows, O(N C HW) work); grad_bias: a sum, gamma_n * sum|grad_output|.
    Exact magnitudes (the op on |arguments|, as much work as the replay) when tiny."""
    a = c.a
    gy, x, w = a["grad_output"], a["input"], a["weight"]
    if w.dim() < 3:
        return NotImplemented
    transposed, groups = a["transposed"], a["groups"]
    ks = w.shape[2:]
    c_out = w.shape[1] * groups if transposed else w.shape[0]
    c_in = x.shape[1]
    K_in = (c_out // groups) * math.prod(ks)
    N = x.shape[0]
    K_w = N * max(math.prod(x.shape[2:]), math.prod(gy.shape[2:]))
    K_b = N * math.prod(gy.shape[2:])
    outs = c.outputs
    args = (a["bias_sizes"], a["stride"], a["padding"], a["dilation"], transposed, a["output_padding"], groups)

    def make():
        small = N * c_out * math.prod(gy.shape[2:]) * K_in * 64 <= EXACT_MAGNITUDE_MACS
        if small:
            mi, mw, mb = aten.convolution_backward.default(gy.abs(), x.abs(), w.abs(), *args, [True, True, True])
        else:
            mi = mw = mb = None
            if is_float(outs[0]):
                ones = torch.ones((groups, c_out // groups, *ks) if transposed else (c_out, 1, *ks),
                                  dtype=torch.float64, device=gy.device)
                dummy = torch.zeros((N, groups, *x.shape[2:]), dtype=torch.float64, device=gy.device)
                win = aten.convolution_backward.default(gy.abs().square(), dummy, ones, None, *args[1:],
                                                        [True, False, False])[0].sqrt()  # [N, g, *in]
                if transposed:
                    wn = w.abs().square().sum(tuple(range(1, w.dim())))  # [C_in]
                else:
                    wn = w.abs().square().reshape(groups, c_out // groups, c_in // groups, -1).sum((1, 3)).reshape(-1)
                sp = x.shape[2:]
                mi = (win.reshape(N, groups, 1, *sp) *
                      wn.sqrt().reshape(1, groups, c_in // groups, *([1] * len(sp)))).reshape(x.shape)
            if is_float(outs[1]):
                gn = torch.linalg.vector_norm(gy.transpose(0, 1).reshape(c_out, -1), dim=1)  # [C_out]
                xn = torch.linalg.vector_norm(x.transpose(0, 1).reshape(c_in, -1), dim=1)  # [C_in]
                if transposed:  # w [C_in, C_out/g, *k]
                    mw = xn.reshape(groups, c_in // groups, 1) * gn.reshape(groups, 1, c_out // groups)
                    mw = mw.reshape(c_in, c_out // groups)
                else:  # w [C_out, C_in/g, *k]
                    mw = gn.reshape(groups, c_out // groups, 1) * xn.reshape(groups, 1, c_in // groups)
                    mw = mw.reshape(c_out, c_in // groups)
                mw = mw.reshape(*mw.shape, *([1] * len(ks))).expand(w.shape)
            if is_float(outs[2]):
                mb = gy.abs().sum([d for d in range(gy.dim()) if d != 1])
        bounds = []
        for m, K, r in ((mi, K_in, outs[0]), (mw, K_w, outs[1]), (mb, K_b, outs[2])):
            if not is_float(r) or m is None:
                bounds.append(None)
                continue
            g = gamma(K, c.ua)
            bounds.append(c.out_rounding(r, torch.add(torch.full((), c.floor(), dtype=torch.float64),
                                                         m.reshape(r.shape), alpha=g)))
        return bounds

    return c.budget(make, lambda: _results_accumulated(c, (K_in, K_w, K_b)))


def _results_accumulated(c: BudgetCall, Ks: Sequence[int]) -> tuple[float, float]:
    """(scale, accumulation) for outputs that are each a K-term sum, without the terms at hand: the results'
    own rounding, and accumulation_sq's drift part K/3 r**2 (its random-walk part needs the terms: left
    out, so the estimate is low and the bits read conservatively)."""
    scale = acc = 0.0
    for r, K in zip(c.outputs, Ks):
        if is_float(r):
            r_sq = sumsq(r)
            scale += r_sq
            acc += accumulation_sq(K, 0.0, r_sq)
    return scale, acc


# --- FFT: normwise bound (Higham, Thm 24.2): ||dy||_2 <= c log2(n) ua ||y||_2, and each |dy_k| <= ||dy||_2 ---
_FFT_C = 8.0


@register_budget(*overloads("_fft_r2c", "_fft_c2r", "_fft_c2c"), family=Family.FFT)
def fft_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    dims = reduced_dims(x, c.a["dim"])
    if c.plan.base == "_fft_c2r":
        n = math.prod(x.shape[d] for d in dims[:-1]) * c.a["last_dim_size"]
        herm = math.sqrt(2.0)  # the half spectrum stands for the full one: ||X_full|| <= sqrt(2) ||X_half||
    else:
        n = math.prod(x.shape[d] for d in dims)
        herm = 1.0
    norm = {0: 1.0, 1: 1.0 / math.sqrt(max(n, 1)), 2: 1.0 / max(n, 1)}[c.a["normalization"]]
    rel = _FFT_C * (math.log2(max(n, 2)) + 1) * c.ua

    def make():
        xn = torch.linalg.vector_norm(x, dim=dims, keepdim=True)
        return [add_into(c.final(r, 2.0), xn, alpha=rel * math.sqrt(n) * herm * norm).expand(r.shape)]

    return c.budget(make)


# --- pairwise distances: p = 2 goes through a matmul (|x|^2 + |y|^2 - 2 x.y) and cancels ---
@register_budget(*overloads("_cdist_forward"), family=Family.REDUCTION)
def cdist_budget(c: BudgetCall) -> Budget:
    x1, x2, r = c.a["x1"], c.a["x2"], c.out()
    p = float(c.a["p"])
    K = x1.shape[-1]
    if p == 2.0:
        def make():
            n1 = x1.abs().square().sum(-1, keepdim=True)
            n2 = x2.abs().square().sum(-1).unsqueeze(-2)
            dd = 2 * gamma(K + 3, c.ua) * (n1 + n2)  # error of the squared distance
            return [torch.minimum(dd.sqrt(), dd / (2 * r.abs())) + c.final(r, 4.0)]

        return c.budget(make)
    return _norm_of_differences(c, K, p)


def _norm_of_differences(c: BudgetCall, K: int, p: float) -> Budget:
    """(sum_k |x_k - y_k|**p)**(1/p) summed directly: each difference rounded (relative), its power, the sum of
    positive terms (gamma_K(ua)), the root: relative to the result; p = inf selects a difference, p = 0 counts."""
    r = c.out()
    if math.isinf(p) or p == 0:
        return c.budget(lambda: [c.final(r, 2.0) + c.ua * r.abs()])
    rel = (gamma(K, c.ua) + (EXP_ULPS + 1) * c.ua) / abs(p) + EXP_ULPS * c.ua
    return c.budget(lambda: [add_into(c.final(r), r.abs(), alpha=rel)])


@register_budget(*overloads("_pdist_forward"), family=Family.REDUCTION)
def pdist_budget(c: BudgetCall) -> Budget:
    """DistanceOpsKernel.cpp: every pair's p-norm of differences summed over the features in the device dtype
    (p = 2 too: no matmul form, no cancellation)."""
    x = c.a["self"]
    return _norm_of_differences(c, x.shape[-1] if x.dim() else 1, float(c.a.get("p", 2.0)))


# rows of x1 per chunk of the pairwise backward's [B, rows, r2, m] differences: memory, not work, is capped
PAIRWISE_CHUNK = 1 << 22


def _pairwise_backward(c: BudgetCall, x1: torch.Tensor, x2: torch.Tensor, grad: torch.Tensor, dist: torch.Tensor,
                       p: float) -> torch.Tensor:
    """[B, r1, m] bound of DistanceOpsKernel.cpp's backward, sum_j t(x1_i - x2_j) over the r2 rows of x2 in the
    device dtype (gamma_r2(u)), each term rounded: t = g sign(diff) exact (p = 1); g diff / d, 3 u (p = 2);
    sign(diff) |diff|**(p-1) g / d**(p-1), (|p - 1| + 2 EXP_ULPS + 4) u (diff's rounding through the power, two
    pows, two products, the quotient); d is the device's distance, an input. p = inf: g sign(diff) where |diff|
    == d, exact, but the device tests its rounded diff: |g| where |diff| != d is within 2 u d of it (an exact
    difference is the device's too)."""
    g = gamma(x2.shape[-2], c.u)
    rel = 0.0 if p == 1 or math.isinf(p) else 3 * c.u if p == 2 else (abs(p - 1) + 2 * EXP_ULPS + 4) * c.u
    rows = max(1, PAIRWISE_CHUNK // max(1, x1.shape[0] * x2.shape[-2] * x1.shape[-1]))
    parts = []
    for i in range(0, x1.shape[-2], rows):
        diff = (x1[:, i:i + rows, None, :] - x2[:, None, :, :]).abs_()  # [B, rows, r2, m]
        ga, d = grad[:, i:i + rows, :, None].abs(), dist[:, i:i + rows, :, None]
        flip = 0.0
        if math.isinf(p):  # a term the device may select or not counts whole, and in the sum
            off = (diff - d).abs_()
            may = ga * ((off > 0) & (off <= 2 * c.u * d))
            term, flip = may + ga * (off == 0), may.sum(-2)
        else:  # the kernel's zeros: d = 0, and diff = 0 where sign or the power vanish (p < 1: set so)
            live = (d > 0) & (diff > 0) if p <= 1 else d > 0
            term = torch.where(live, ga * (diff / d).pow(p - 1), 0.0)
        parts.append(term.sum(-2).mul_(g + rel * (1 + g)).add_(flip))
    return torch.cat(parts, -2)


@register_budget(*overloads("_pdist_backward"), family=Family.REDUCTION)
def pdist_backward_budget(c: BudgetCall) -> Budget:
    """Every point's gradient sums the terms of its n - 1 pairs (``_pairwise_backward``, the pairs' condensed
    grad and distances laid out as a symmetric matrix); p = 0: zeros."""
    x, r, p = c.a["self"], c.out(), float(c.a["p"])
    if p == 0 or x.shape[0] < 2:
        return c.budget(lambda: [c.final(r)])

    def make():
        n = x.shape[0]
        i, j = torch.triu_indices(n, n, 1)
        square = []
        for t in (c.a["grad"], c.a["pdist"]):
            m = torch.zeros(n, n, dtype=torch.float64)
            m[i, j] = m[j, i] = t.reshape(-1)
            square.append(m[None])
        return [add_into(c.final(r), _pairwise_backward(c, x[None], x[None], *square, p)[0])]

    return c.budget(make)


@register_budget(*overloads("_cdist_backward"), family=Family.REDUCTION)
def cdist_backward_budget(c: BudgetCall) -> Budget:
    """grad_x1 of ``_cdist_forward``'s direct path: ``_pairwise_backward`` per batch (x2's gradient is this op with
    x1 and x2 swapped)."""
    a, r, p = c.a, c.out(), float(c.a["p"])
    if p == 0 or a["grad"].numel() == 0:  # zeros
        return c.budget(lambda: [c.final(r)])

    def make():
        grad, dist = a["grad"], a["cdist"]
        batch = grad.shape[:-2]
        B = math.prod(batch)
        x1, x2 = (t.expand(*batch, *t.shape[-2:]).reshape(B, *t.shape[-2:]) for t in (a["x1"], a["x2"]))
        flat = (t.reshape(B, *t.shape[-2:]) for t in (grad, dist))
        return [add_into(c.final(r), _pairwise_backward(c, x1, x2, *flat, p).reshape(r.shape))]

    return c.budget(make)


@register_budget(*overloads("linalg_cross", "cross"), family=Family.ELEMENTWISE)
def cross_budget(c: BudgetCall) -> Budget:
    """a_i b_j - a_j b_i: two products, one cancelling difference: 3 u (|a_i b_j| + |a_j b_i|)."""
    a_, b_, r = c.a["self"], c.a["other"], c.out()
    dim = c.a.get("dim")
    dim = -1 if dim is None else dim

    def make():
        aa, bb = torch.broadcast_tensors(a_.abs(), b_.abs())
        return [c.final(r) + 3 * c.u * (aa.roll(1, dim) * bb.roll(-1, dim) + aa.roll(-1, dim) * bb.roll(1, dim))]

    return c.budget(make)


# --- no a-priori bound: errors set by the inputs' conditioning, not by shapes ---
UNBOUNDED_NAMES = frozenset((
    "cholesky", "cholesky_solve", "_cholesky_solve_helper", "cholesky_inverse", "lu_solve", "lu_unpack",
    "triangular_solve", "_lu_with_info", "geqrf", "orgqr", "ormqr", "inverse", "det", "logdet", "slogdet",
    "svd", "_svd_helper", "pinverse", "matrix_exp", "matrix_power", "qr", "symeig", "eig", "lstsq",
    "linalg_householder_product", "_linalg_check_errors",
))


def solves_and_factorizations(plan: OpPlan) -> bool:
    return plan.base.startswith(("linalg_", "_linalg_")) or plan.base in UNBOUNDED_NAMES


@register_budget_predicate(solves_and_factorizations, family=Family.UNBOUNDED)
def unbounded_budget(c: BudgetCall) -> Budget:
    """Linear algebra (solves, factorizations, eigen/singular values, inverses): the error of a correct
    implementation scales with the condition number, which the shapes do not give: bound = inf."""
    return c.budget(lambda: [torch.full_like(r, math.inf, dtype=torch.float64) if is_float(r) and not
                                          r.is_complex() else (torch.full(r.shape, math.inf, dtype=torch.float64, device=r.device)
                                                               if is_float(r) else None) for r in c.outputs])


@register_budget(*overloads("_trilinear"), family=Family.MATMUL)
def trilinear_budget(c: BudgetCall) -> Budget:
    """sum over sumdim of i1 * i2 * i3 (nn.Bilinear): the op on magnitudes; intermediates (the kernel forms
    i1 x i2 first) may be rounded to the device dtype."""
    a, r = c.a, c.out()
    n = max(a["i1"].numel(), a["i2"].numel(), a["i3"].numel())

    def make():
        mag = c.call_with(i1=a["i1"].abs(), i2=a["i2"].abs(), i3=a["i3"].abs())
        return [add_into(c.final(r), mag, alpha=gamma(n + 2, c.ua) + 4 * c.u)]

    return c.budget(make)
