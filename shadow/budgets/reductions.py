"""Reduction budgets: Higham's worst case for any summation order (recursive, pairwise, blocked, with or
without FMA), |fl(sum x) - sum x| <= gamma_n(ua) * sum|x|, then one rounding of the result at u. Long sums
(sum, mean, var/std, norms, softmax, logsumexp) accumulate at ``ua``, torch's opmath precision, so a kernel
that accumulates them in float16 is over the float16 budget; short sums (pooling, scatter, embedding bags,
interpolation) are bounded at ``u``: CPU kernels round them in the device dtype.

>>> from shadow.budgets import budget_for
>>> x = torch.tensor([1.0, -2.0, 3.0, 4.0], dtype=torch.float64)
>>> budget_for(torch.ops.aten.sum.default, (x,), {}, [x.sum()], torch.bfloat16).family
'reduction'
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Callable

import torch

from ..opsets import Family
from .core import (Budget, BudgetCall, add_into, coefficient, magnitude, numel_over, overloads, reduced_dims,
                   register_budget, sumsq)
from .elementwise import ULPS
from .units import EXP_ULPS, accumulation_sq, gamma


# --- long sums ---
def _at_least_1d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1) if x.dim() == 0 else x


def _reduced_numel(c: BudgetCall, x: torch.Tensor) -> int:
    """How many elements of x each output of the call sums (its ``dim`` argument)."""
    return numel_over(x, reduced_dims(x, c.a.get("dim")))


def _reduced(x: torch.Tensor, dim: Any, keepdim: bool, fn: Callable) -> tuple[torch.Tensor, int]:
    dims = reduced_dims(x, dim)
    n = numel_over(x, dims)
    if x.dim() == 0:
        return fn(x), 1
    return fn(x, dims, keepdim), n


def _sum_abs(x, dims=None, keepdim=False):
    # one pass, no |x| temporary: as cheap as the replayed sum itself
    return x.abs() if dims is None else torch.linalg.vector_norm(x, 1, dims, keepdim=keepdim)


def _nansum_abs(x, dims=None, keepdim=False):
    a = x.abs()
    return a if dims is None else a.nansum(dims, keepdim=keepdim)


def sum_budget(c: BudgetCall, *, mean: bool = False, nan: bool = False) -> Budget:
    """sum/mean/nansum: gamma_n(ua) * sum|x| (/n for the mean) + one rounding of the result."""
    x = c.a["self"]
    r = c.out()

    def make():
        s, n = _reduced(x, c.a.get("dim"), bool(c.a.get("keepdim")), _nansum_abs if nan else _sum_abs)
        g = gamma(n + (1 if mean else 0), c.ua)
        return [add_into(c.final(r), s, alpha=g / n if mean else g)]

    def scale_sq():
        n = _reduced_numel(c, x)
        s, r_sq = sumsq(x) / (n * n if mean else 1), sumsq(r)  # the terms t = x (x / n for the mean)
        return s + c.out_rounding_sq(r_sq), accumulation_sq(n, s, r_sq)

    return c.budget(make, scale_sq)


register_budget(*overloads("sum"), family=Family.REDUCTION)(sum_budget)
register_budget(*overloads("mean"), family=Family.REDUCTION)(functools.partial(sum_budget, mean=True))
register_budget(*overloads("nansum"), family=Family.REDUCTION)(functools.partial(sum_budget, nan=True))
register_budget(*overloads("nanmean"), family=Family.REDUCTION)(functools.partial(sum_budget, mean=True, nan=True))


@register_budget(*overloads("prod"), family=Family.REDUCTION)
def prod_budget(c: BudgetCall) -> Budget:
    """n - 1 products, each relative: gamma_n * |r| + one rounding. Reduced-precision CPU kernels multiply in
    the device dtype, so gamma_n(u): a product has no cancellation for a wider accumulator to save."""
    x, r = c.a["self"], c.out()
    n = _reduced_numel(c, x)
    return c.budget(lambda: [add_into(c.final(r), r.abs(), alpha=gamma(n, c.u))])


@register_budget(*overloads("cumsum"), family=Family.REDUCTION)
def cumsum_budget(c: BudgetCall) -> Budget:
    """prefix k: gamma_k(ua) * sum_{j<=k} |x_j| <= gamma_n(ua) * cumsum(|x|)."""
    x, r = c.a["self"], c.out()
    dim = c.a["dim"]
    n = x.shape[dim] if x.dim() else 1
    def scale_sq():
        # output k of a row carries the roundings of the partial sums r_1..r_k (sequential by definition):
        # summed over outputs, sum_j (n - j + 1) r_j**2
        rr = _at_least_1d(r)
        d = dim % rr.dim()
        w = torch.arange(n, 0, -1, dtype=torch.float64, device=rr.device).reshape([n if i == d else 1 for i in range(rr.dim())])
        return sumsq(x) + c.out_rounding_sq(sumsq(r)), float(torch.nansum(rr.square() * w))

    return c.budget(lambda: [add_into(c.final(r), _at_least_1d(x).abs().cumsum(dim).reshape(x.shape),
                                                    alpha=gamma(n, c.ua))], scale_sq)


@register_budget(*overloads("cumprod"), family=Family.REDUCTION)
def cumprod_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    n = x.shape[c.a["dim"]] if x.dim() else 1
    return c.budget(lambda: [add_into(c.final(r), r.abs(), alpha=gamma(n, c.ua))])


def _lse_abs_bound(c: BudgetCall, n: int, r: torch.Tensor) -> torch.Tensor:
    """Absolute error of m + log(sum exp(x - m)): each x_j - m is rounded (relative ua), so exp(x_j - m) is
    off by ua*|x_j - m| relative; weighted by p_j = exp(x_j - lse) that is ua * sum p_j (m - x_j) <= ua * H(p)
    <= ua * log(n) (H the entropy); the sum adds gamma_n(ua), exp/log EXP_ULPS*ua each, the final add ua*|r|."""
    const = c.ua * (math.log(max(n, 1)) + 2 * EXP_ULPS) + gamma(n, c.ua)
    return add_into(c.final(r, 2.0) + const, r.abs(), alpha=c.ua)


@register_budget(*overloads("logsumexp"), family=Family.REDUCTION)
def logsumexp_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    n = _reduced_numel(c, x)
    return c.budget(lambda: [_lse_abs_bound(c, n, r)])


@register_budget(*overloads("logcumsumexp"), family=Family.REDUCTION)
def logcumsumexp_budget(c: BudgetCall) -> Budget:
    x, r = c.a["self"], c.out()
    n = x.shape[c.a["dim"]] if x.dim() else 1
    # each step is a logaddexp: the worst case grows with the prefix like a sum
    return c.budget(lambda: [_lse_abs_bound(c, n, r) + gamma(n, c.ua) * r.abs()])


def _var_parts(c: BudgetCall, x: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """sum(x**2) over the reduced dims (keepdim as the op), n and the divisor n - correction."""
    dims = reduced_dims(x, c.a.get("dim"))
    n = numel_over(x, dims)
    corr = c.a.get("correction")
    if corr is None:
        corr = 1 if c.a.get("unbiased", True) is not False else 0
    s2 = x.abs().square().sum(dims, keepdim=bool(c.a.get("keepdim"))) if x.dim() else x.abs().square()
    return s2, n, max(n - float(corr), 0.0)


def var_budget(c: BudgetCall, *, std: bool, with_mean: bool) -> Budget:
    """var = sum (x - mean)**2 / (n - correction). Bounded by gamma_{2n+4}(ua) * sum x**2 / (n - c): that
    covers two-pass, Welford and the one-pass sum(x**2) - n*mean**2 form (whose error is relative to
    sum x**2, not to the centered sum). std = sqrt(var): |d sqrt| <= min(sqrt(dv), dv / (2 sqrt v))."""
    x = c.a["self"]

    def make():
        s2, n, d = _var_parts(c, x)
        dv = gamma(2 * n + 4, c.ua) * s2 / d if d > 0 else torch.full_like(s2, math.inf)
        r = c.out(0)
        if std:
            main = torch.minimum(dv.sqrt(), dv / (2 * r.abs())) + 2 * c.ua * r.abs()
        else:
            main = dv + c.ua * r.abs()
        bounds = [main + c.final(r)]
        if with_mean:
            m = c.out(1)
            bounds.append(add_into(c.final(m), s2.sqrt(), alpha=gamma(n + 1, c.ua) / math.sqrt(max(n, 1))))
        return bounds

    return c.budget(make)


register_budget(*overloads("var"), family=Family.REDUCTION)(functools.partial(var_budget, std=False, with_mean=False))
register_budget(*overloads("std"), family=Family.REDUCTION)(functools.partial(var_budget, std=True, with_mean=False))
register_budget(*overloads("var_mean"), family=Family.REDUCTION)(
    functools.partial(var_budget, std=False, with_mean=True))
register_budget(*overloads("std_mean"), family=Family.REDUCTION)(
    functools.partial(var_budget, std=True, with_mean=True))


def norm_budget(c: BudgetCall) -> Budget:
    """(sum |x|**p)**(1/p): each |x|**p is relative (a pow kernel), the sum of positive terms gamma_n(ua),
    the root divides the relative error by |p| and adds its own: relative to the result throughout.
    p = +-inf and 0 are exact selections / counts."""
    x, r = c.a["self"], c.out()
    p = c.a.get("ord", c.a.get("p"))
    p = 2.0 if p is None else float(p)
    if math.isinf(p) or p == 0:
        return c.ulps(ULPS["movement"], family=Family.MOVEMENT)
    n = _reduced_numel(c, x)
    rel = (gamma(n, c.ua) + EXP_ULPS * c.ua) / abs(p) + EXP_ULPS * c.ua
    # the sum S of positive terms |x|**p accumulates as accumulation_sq (its term K/3 S**2 dominates), and
    # r = S**(1/p) carries 1/p of S's relative error: sum over outputs of K/3 (r/p)**2
    return c.budget(lambda: [add_into(c.final(r), r.abs(), alpha=rel)],
                    lambda: (sumsq(r), n / (3.0 * p * p) * sumsq(r)))


register_budget(*overloads("linalg_vector_norm", "norm"), family=Family.REDUCTION)(norm_budget)


@register_budget(*overloads("dist"), family=Family.REDUCTION)
def dist_budget(c: BudgetCall) -> Budget:
    """norm(x - y, p): the difference is relative to each term, so the norm bound holds with one more ua."""
    x = c.a["self"]
    y = c.a["other"]
    b = norm_budget(dataclasses.replace(c, named={"self": torch.broadcast_tensors(x, y)[0], "p": c.a.get("p")}))
    r = c.out()
    return c.budget(lambda: [b.bound[0] + c.ua * r.abs()] if b.bound[0] is not None else [None])


# --- softmax family: bounds from the reference output alone (cheap) ---
def _softmax_n(c: BudgetCall) -> int:
    x = c.a.get("self", c.a.get("grad_output"))
    return x.shape[c.a["dim"]] if x.dim() else 1


@register_budget(*overloads("_softmax", "softmax", "special_softmax", "_safe_softmax"), family=Family.REDUCTION)
def softmax_budget(c: BudgetCall) -> Budget:
    """y_i = exp(x_i - m) / S. Relative error of y_i: ua*(m - x_i) (rounding of x_i - m, then exp) + the
    same averaged by y over the row (<= ua log n, the entropy bound) + gamma_n(ua) (the sum) + exp and
    division roundings. m - x_i <= -log y_i, so the first term is ua * y_i * (-log y_i): no pass over x."""
    y = c.out()
    n = _softmax_n(c)
    rel = c.ua * (math.log(max(n, 1)) + EXP_ULPS + 2) + gamma(n, c.ua)
    # final(y, 2): the CPU kernels store exp(x - m) in the output dtype, then divide in place: two roundings
    def make():  # y >= 0: three passes over y, into reused memory where large
        b = torch.add(torch.full((), 2 * c.floor(), dtype=torch.float64), y, alpha=rel + 2 * c.u, out=c.empty(y))
        return [b.add_(torch.special.entr(y, out=c.empty(y)), alpha=c.ua)]

    # the row sum S of positive terms accumulates as accumulation_sq (K/3 S**2), and every y_i carries
    # S's relative error: sum over outputs of n/3 y**2
    return c.budget(make, lambda: (sumsq(y), n / 3.0 * sumsq(y)))


@register_budget(*overloads("_log_softmax", "log_softmax", "special_log_softmax"), family=Family.REDUCTION)
def log_softmax_budget(c: BudgetCall) -> Budget:
    """z_i = (x_i - m) - log S: ua*|x_i - m| <= ua*|z_i|, log S off by ua*(log n + c) + gamma_n(ua).
    Reduced-precision kernels round m + log S to the device dtype before subtracting it: u * |x_i - z_i|."""
    # fp16 log_softmax: observed error ~u absolute where |z| << 1 (S rounded to fp16 before the log)
    z, x = c.out(), c.a["self"]
    n = _softmax_n(c)
    const = c.ua * (math.log(max(n, 1)) + 2 * EXP_ULPS) + gamma(n, c.ua)
    # ... and may round S itself (>= 1, so log S moves by u): u * (|x_i - z_i| + 2)

    def make():  # into reused memory where large: a fresh tensor the logits' size costs more in page faults
        b = torch.abs(z, out=c.empty(z))
        torch.add(torch.full((), 2 * c.floor() + const, dtype=torch.float64), b, alpha=2 * c.u + 2 * c.ua, out=b)
        return [b.add_(c.u * ((x - z).abs() + 2)) if c.u != c.ua else b]

    return c.budget(make)


@register_budget(*overloads("_softmax_backward_data"), family=Family.REDUCTION)
def softmax_backward_budget(c: BudgetCall) -> Budget:
    """gx = y * (g - sum_j g_j y_j): the dot is off by gamma_n(ua) sum|g y|, the difference and the product
    by ua each."""
    g, y, gx = c.a["grad_output"], c.a["output"], c.out()
    n = _softmax_n(c)
    return c.budget(lambda: [
        c.final(gx) + 2 * c.ua * gx.abs() + gamma(n, c.ua) * y.abs() * (g * y).abs().sum(c.a["dim"], keepdim=True)])


@register_budget(*overloads("_log_softmax_backward_data"), family=Family.REDUCTION)
def log_softmax_backward_budget(c: BudgetCall) -> Budget:
    """gx = g - exp(z) * sum g: the sum is off by gamma_n(ua) sum|g|, exp by a few ulps, then two roundings."""
    g, z, gx = c.a["grad_output"], c.a["output"], c.out()
    n = _softmax_n(c)

    def make():  # in reused memory where large, as the same operations
        s = g.sum(c.a["dim"], keepdim=True)
        sa = torch.abs(g, out=c.empty(g)).sum(c.a["dim"], keepdim=True)
        b = c.final(gx).add_(torch.abs(gx, out=c.empty(gx)).mul_(c.ua))
        return [b.add_(torch.exp(z, out=c.empty(z)).mul_(gamma(n, c.ua) * sa + (EXP_ULPS + 2) * c.ua * s.abs()))]

    return c.budget(make)


# --- sums of inputs with nonnegative weights (pooling, scatter-add, embedding backward): the op itself
# applied to |inputs| is the exact magnitude: gamma_n * op(|x|), n the most terms one output gets. These
# short sums are bounded at the device's u: CPU kernels for them accumulate in the device dtype (bf16
# adaptive_avg_pool3d, index_reduce, upsampling do), unlike the long sums of the families above ---
def _linear_sum(c: BudgetCall, names: Sequence[str], n: int) -> Budget:
    """gamma_{n+1}(u) * the op on the magnitudes of the arguments ``names`` (tensors, and scalar weights such
    as a negative divisor_override or alpha) + one rounding of the result."""
    r = c.out()

    def make():
        mag = c.call_with(**{k: magnitude(c.a[k]) for k in names if isinstance(c.a.get(k), (torch.Tensor, int, float))})
        return [add_into(c.final(r), mag, alpha=gamma(n + 1, c.u))]

    return c.budget(make)


@register_budget(*overloads("avg_pool1d", "avg_pool2d", "avg_pool3d"), family=Family.REDUCTION)
def avg_pool_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["self", "divisor_override"], math.prod(c.a["kernel_size"]) + 1)


@register_budget(*overloads("avg_pool2d_backward", "avg_pool3d_backward"), family=Family.REDUCTION)
def avg_pool_backward_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["grad_output", "divisor_override"], math.prod(c.a["kernel_size"]) + 1)


@register_budget(*overloads("max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward"),
                 family=Family.REDUCTION)
def max_pool_backward_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["grad_output"], math.prod(c.a["kernel_size"]))


@register_budget(*overloads("_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool1d",
                            "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward"), family=Family.REDUCTION)
def adaptive_avg_pool_budget(c: BudgetCall) -> Budget:
    x = c.a.get("self")
    g = c.a.get("grad_output")
    # a window holds at most ceil(in/out) + 1 elements per dim; the backward sums at most as many windows
    src, dst = (x, c.out()) if g is None else (x, g)
    d = max(src.dim() - 2, 1)
    n = math.prod(-(-i // max(o, 1)) + 1 for i, o in zip(src.shape[-d:], dst.shape[-d:]))
    return _linear_sum(c, ["self", "grad_output"] if g is None else ["grad_output"], n + 1)


@register_budget(*overloads("embedding_dense_backward"), family=Family.REDUCTION)
def embedding_backward_budget(c: BudgetCall) -> Budget:
    idx = c.a["indices"]
    n = idx.numel()
    if c.a.get("scale_grad_by_freq"):
        n += 2  # the 1/count scaling
    return _linear_sum(c, ["grad_output"], n)


@register_budget(*overloads("index_add", "scatter_add", "index_put", "_index_put_impl", "put", "col2im",
                            "unfold_backward", "trace", "_unsafe_masked_index_put_accumulate",
                            "_unsafe_index_put"), family=Family.REDUCTION)
def scatter_add_budget(c: BudgetCall) -> Budget:
    """Sums into places: the op on magnitudes. index_put/put without accumulate are copies."""
    if c.a.get("accumulate") is False:
        return c.ulps(ULPS["movement"], family=Family.MOVEMENT)
    src = next((c.a[k] for k in ("source", "src", "values", "self") if isinstance(c.a.get(k), torch.Tensor)), None)
    n = src.numel() if src is not None else 1
    alpha = coefficient(c.a.get("alpha"))
    b = _linear_sum(c, ["self", "source", "src", "values", "grad_in", "grad", "alpha"], n + 2)
    return b if alpha == 1 else c.budget(
        lambda: [b.bound[0] * max(1.0, abs(alpha)) + 2 * c.ua * abs(alpha) * c.out().abs()])


@register_budget(*overloads("scatter_reduce", "index_reduce"), family=Family.REDUCTION)
def scatter_reduce_budget(c: BudgetCall) -> Budget:
    red = c.a["reduce"]
    if red in ("amax", "amin"):
        return c.ulps(ULPS["movement"], family=Family.MOVEMENT)
    src = c.a.get("src", c.a.get("source"))
    n = src.numel() + 1
    if red in ("sum", "mean"):
        return _linear_sum(c, ["self", "src", "source"], n + 1)
    r = c.out()  # prod: relative, multiplied in the device dtype
    return c.budget(lambda: [add_into(c.final(r), r.abs(), alpha=gamma(n, c.u))])


@register_budget(*overloads("_embedding_bag", "_embedding_bag_forward_only"), family=Family.REDUCTION)
def embedding_bag_budget(c: BudgetCall) -> Budget:
    """mode sum/mean: a sum per bag, bounded on magnitudes; mode max: a selection. Other outputs are indices."""
    a, r = c.a, c.out()
    if a.get("mode", 0) == 2:
        return c.budget(lambda: [c.ulp_bound(r, 1.0)] + [None] * (len(c.outputs) - 1), family=Family.MOVEMENT)
    n = a["indices"].numel() + 2

    def make():
        psw = a.get("per_sample_weights")
        mag = c.call_with(weight=a["weight"].abs(), per_sample_weights=None if psw is None else psw.abs())[0]
        return [add_into(c.final(r), mag, alpha=gamma(n, c.u))] + [None] * (len(c.outputs) - 1)

    return c.budget(make)


@register_budget(*overloads("_embedding_bag_per_sample_weights_backward"), family=Family.REDUCTION)
def embedding_bag_psw_backward_budget(c: BudgetCall) -> Budget:
    """One dot product of length D per index: gamma_D(ua) * (the op on magnitudes)."""
    a, r = c.a, c.out()
    D = a["weight"].shape[-1]
    return c.budget(lambda: [add_into(c.final(r), c.call_with(grad=a["grad"].abs(),
                                                                            weight=a["weight"].abs()),
                                                    alpha=gamma(D + 2, c.ua) + 2 * c.u)])


@register_budget(*overloads("_embedding_bag_backward", "_embedding_bag_dense_backward"), family=Family.REDUCTION)
def embedding_bag_backward_budget(c: BudgetCall) -> Budget:
    return _linear_sum(c, ["grad", "per_sample_weights"], c.a["indices"].numel() + 2)


# --- interpolation: short weighted sums whose weights come from rounded source coordinates ---
@register_budget(*overloads("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
                            "_upsample_bilinear2d_aa"), family=Family.ELEMENTWISE)
def upsample_linear_budget(c: BudgetCall) -> Budget:
    """Interpolation weights are >= 0 and sum to 1, but each is computed from a source coordinate rounded
    relative to its size (u * in_size absolute): gamma(2^d + 2) * op(|x|) + 4 u * sum(in sizes) * max|x|."""
    x, r = c.a["input"] if "input" in c.a else c.a["self"], c.out()
    d = x.dim() - 2
    key = "input" if "input" in c.a else "self"

    def make():
        mag = c.call_with(**{key: x.abs()})
        coord = 4 * c.u * sum(x.shape[2:]) * x.abs().amax(tuple(range(2, x.dim())), keepdim=True)
        return [add_into(c.final(r) + coord, mag, alpha=gamma(2 ** d + 2, c.u))]

    return c.budget(make)


@register_budget(*overloads("upsample_bicubic2d", "_upsample_bicubic2d_aa"), family=Family.ELEMENTWISE)
def upsample_bicubic_budget(c: BudgetCall) -> Budget:
    """16 taps whose cubic weights (some negative, sum of |w| <= 1.5 per dim) come from source coordinates
    rounded relative to the input size: (gamma_20(u) * 2.25 + 16 u * sum(in sizes)) * max|x| per plane."""
    x = c.a.get("self", c.a.get("input"))
    r = c.out()

    def make():
        amax = x.abs().amax((-2, -1), keepdim=True) if x.dim() >= 2 else x.abs()
        return [c.ulp_bound(r, 2.0) + (2.25 * gamma(20, c.u) + 16 * c.u * sum(x.shape[-2:])) * amax]

    return c.budget(make)


@register_budget(*overloads("upsample_linear1d_backward", "upsample_bilinear2d_backward",
                            "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward",
                            "upsample_bicubic2d_backward", "_upsample_bicubic2d_aa_backward"),
                 family=Family.ELEMENTWISE)
def upsample_backward_budget(c: BudgetCall) -> Budget:
    """Each input gathers at most ``count`` weighted output gradients (count per dim: outputs per input,
    times taps for the antialiased filters); weights <= 1 (cubic: |w| sums to <= 1.5 per dim), each off by
    8 u * in_size from its rounded coordinate: (gamma(u) * cw + 8 u cw sum(in sizes)) * count * max|g|."""
    g, r = c.a["grad_output"], c.out()
    name = c.plan.base
    d = g.dim() - 2
    ins, outs_ = list(c.a["input_size"])[2:], list(g.shape[2:])
    aa = "_aa" in name
    count = math.prod((-(-o // max(i, 1)) + 2) * ((2 * -(-i // max(o, 1)) + 2) if aa else 1)
                      for i, o in zip(ins, outs_))
    cw = 1.5 ** d if "bicubic" in name else 1.0

    def make():
        gmax = g.abs().amax(tuple(range(2, g.dim())), keepdim=True) if g.dim() > 2 else g.abs()
        k = (gamma(count * 2 ** d + 2, c.u) + 8 * c.u * sum(ins)) * cw * count
        return [add_into(c.final(r), gmax.expand(r.shape[:2] + (1,) * d), alpha=k).expand(r.shape)]

    return c.budget(make)


@register_budget(*overloads("scatter"), family=Family.REDUCTION)
def scatter_budget(c: BudgetCall) -> Budget:
    """scatter without reduce only places values (src's, or a scalar rounded once); reduce="add" sums into
    self, "multiply" multiplies into it (in the device dtype), as scatter_reduce does."""
    red = c.a.get("reduce")
    if red is None:
        return c.ulps(ULPS["movement"], family=Family.MOVEMENT)
    src = c.a.get("src")
    n = (src.numel() if isinstance(src, torch.Tensor) else c.a["index"].numel()) + 2
    if red == "add":
        return _linear_sum(c, ["self", "src", "value"], n)
    r = c.out()
    return c.budget(lambda: [add_into(c.final(r), r.abs(), alpha=gamma(n, c.u))])


# Gradients of ops that read an input element several times (padding, nearest upsampling, max pooling): each
# input's gradient is a sum of the output gradients that came from it, added in the device dtype: gamma over the
# most that reach one input, times the op on |grad_output|.
PAD_BACKWARD = ("reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
                "replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward")
NEAREST_BACKWARD = ("upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
                    "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
                    "_upsample_nearest_exact3d_backward")
MAX_POOL_BACKWARD = ("adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward", "fractional_max_pool2d_backward",
                     "fractional_max_pool3d_backward")


@register_budget(*overloads(*PAD_BACKWARD), family=Family.REDUCTION)
def pad_backward_budget(c: BudgetCall) -> Budget:
    """An element receives itself and its reflections or replications: at most left + right + 1 per dim."""
    pad = list(c.a["padding"])
    return _linear_sum(c, ["grad_output"], math.prod(pad[i] + pad[i + 1] + 1 for i in range(0, len(pad), 2)))


@register_budget(*overloads(*NEAREST_BACKWARD), family=Family.REDUCTION)
def nearest_backward_budget(c: BudgetCall) -> Budget:
    """An input element was picked by at most ceil(out / in) + 1 outputs per dim."""
    ins, outs = list(c.a["input_size"])[2:], list(c.a["output_size"])
    return _linear_sum(c, ["grad_output"], math.prod(-(-o // max(i, 1)) + 1 for i, o in zip(ins, outs)))


@register_budget(*overloads(*MAX_POOL_BACKWARD), family=Family.REDUCTION)
def max_pool_gather_budget(c: BudgetCall) -> Budget:
    """Overlapping windows may all pick one element: at most every output of its plane."""
    g = c.a["grad_output"]
    d = next(int(k[0]) for k in ("2d", "3d") if k in c.plan.base)
    return _linear_sum(c, ["grad_output"], math.prod(g.shape[-d:]) if g.dim() >= d else max(g.numel(), 1))


@register_budget(*overloads("renorm"), family=Family.REDUCTION)
def renorm_budget(c: BudgetCall) -> Budget:
    """ReduceOps.cpp: norm = ||x_k||_p per slice (opmath), factor = maxnorm / (norm + 1e-7) where norm > maxnorm
    (rounded to the device dtype), x * factor: the norm's relative error (``norm_budget``'s), the quotient's and
    the product's. Where the norm is within its error of maxnorm a correct kernel may scale or not: the factor
    there is within 1e-7 / maxnorm (plus the norm's error) of 1."""
    x, r = c.a["self"], c.out()
    p, dim, maxnorm = float(c.a["p"]), c.a["dim"] % max(x.dim(), 1), float(c.a["maxnorm"])
    dims = [d for d in range(x.dim()) if d != dim]
    n = numel_over(x, dims)
    rel = (gamma(n, c.ua) + EXP_ULPS * c.ua) / abs(p) + EXP_ULPS * c.ua if p not in (0.0, math.inf) else c.ua
    rel += 3 * c.ua + c.u

    def make():
        norm = torch.linalg.vector_norm(x, p, dims, keepdim=True) if dims else x.abs()
        near = ((norm - maxnorm).abs() <= 2 * rel * norm).to(x.dtype)
        return [add_into(c.final(r), r.abs(), alpha=rel) + near * (1e-7 / max(maxnorm, 1e-300) + 2 * rel) * x.abs()]

    return c.budget(make)


def _segment_length(c: BudgetCall) -> int:
    """The most elements one segment reduces (lengths, or the steps of offsets)."""
    lengths, offsets = c.a.get("lengths"), c.a.get("offsets")
    if isinstance(lengths, torch.Tensor) and lengths.numel():
        return int(lengths.max())
    if isinstance(offsets, torch.Tensor) and offsets.shape[-1] > 1:
        return int(offsets.diff(dim=-1).max())
    return 1


@register_budget(*overloads("segment_reduce"), family=Family.REDUCTION)
def segment_reduce_budget(c: BudgetCall) -> Budget:
    """SegmentReduce.cpp: each segment reduced in sequence in the device dtype from ``initial``: sum and mean
    as short sums (gamma_n(u) on the op applied to |data| and |initial|), prod relative, max and min select."""
    red = c.a["reduce"]
    if red in ("max", "min"):
        return c.ulps(ULPS["movement"], family=Family.MOVEMENT)
    n = _segment_length(c) + 2
    if red in ("sum", "mean"):
        return _linear_sum(c, ["data", "initial"], n)
    r = c.out()
    return c.budget(lambda: [add_into(c.final(r), r.abs(), alpha=gamma(n, c.u))])


@register_budget(*overloads("_segment_reduce_backward"), family=Family.REDUCTION)
def segment_reduce_backward_budget(c: BudgetCall) -> Budget:
    """sum: the gradient copied; mean: divided by the length; max/min: divided among the ties; prod: grad times
    the product of the other elements (output / data, or the product without the zeros): gamma_n(u) relative."""
    r = c.out()
    n = _segment_length(c) + 3 if c.a["reduce"] == "prod" else 0
    return c.budget(lambda: [add_into(c.ulp_bound(r, ULPS["arith"]), r.abs(), alpha=gamma(n, c.u))])
