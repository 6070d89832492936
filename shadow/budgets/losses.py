"""Loss budgets: per-element terms (relative ``rel * u``, plus an absolute term where the formula cancels),
then the reduction at ``ua``; the losses' backward ops are elementwise given their inputs (a few ulps).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..opsets import Family
from .core import EXP_ULPS, Budget, BudgetCall, gamma, overloads, register_budget
from .elementwise import register_ulps

_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def _loss(c: BudgetCall, rel: float, absolute: Callable[[], Any] | None = None, divisor: Any = None) -> Budget:
    """l = reduce(l_i): |d l_i| <= rel * u * |l_i| + abs_i (the elementwise terms may be rounded to the device
    dtype before the reduction: reduced-precision kernels do); the sum adds gamma_n(ua) sum|l_i|; the mean
    divides by n (or by ``divisor()`` = (|W|, k): nll's total weight W, a sum whose error is gamma_n(ua) k |W|,
    k = sum|w_i| / |W|, 1 for weights of one sign)."""
    red = _REDUCTION.get(c.a.get("reduction", 1), "mean")
    r = c.out()

    def make():
        li = c.call_with(reduction=0)
        li = li[0] if isinstance(li, tuple) else li
        la = li.abs()
        e = rel * c.u * la
        if absolute is not None:
            e = e + absolute()
        if red == "none":
            return [e + c.final(r)]
        n = max(li.numel(), 1)
        s = e.sum() + gamma(n, c.ua) * la.sum()
        if red == "mean":
            d, k = (float(n), 1.0) if divisor is None else divisor()
            s = s / d + (gamma(n, c.ua) * k if divisor is not None else c.ua) * la.sum() / d
        return [c.final(r, 2.0) + s + c.ua * r.abs()]

    return c.budget(make)


register_budget(*overloads("mse_loss"), family=Family.LOSS)(functools.partial(_loss, rel=4.0))
register_budget(*overloads("l1_loss"), family=Family.LOSS)(functools.partial(_loss, rel=2.0))
register_budget(*overloads("smooth_l1_loss", "huber_loss"), family=Family.LOSS)(functools.partial(_loss, rel=6.0))


@register_budget(*overloads("soft_margin_loss"), family=Family.LOSS)
def soft_margin_budget(c: BudgetCall) -> Budget:
    """log(1 + exp(-y x)): 1 + exp(-y x) is rounded (log then moves by u absolute), -y x too (relative)."""
    x, y = c.a["self"], c.a["target"]
    return _loss(c, 2 * EXP_ULPS + 4, lambda: 2 * c.u * (1 + (x * y).abs()))


@register_budget(*overloads("binary_cross_entropy"), family=Family.LOSS)
def bce_budget(c: BudgetCall) -> Budget:
    """-w (t log x + (1-t) log(1-x)): both terms have one sign (no cancellation); 1 - x is rounded (ua,
    relative), which moves log(1-x) by ua absolute."""
    a = c.a
    w = a.get("weight")

    def absolute():
        t = (2 * c.u) * (a["target"].abs() + (1 - a["target"]).abs())
        return t * w.abs() if w is not None else t

    return _loss(c, EXP_ULPS + 4, absolute)


@register_budget(*overloads("binary_cross_entropy_with_logits"), family=Family.LOSS)
def bce_logits_budget(c: BudgetCall) -> Budget:
    """(1-t) x + lw (log1p(exp(-|x|)) + max(-x, 0)), lw = 1 + (pw - 1) t: the terms cancel (to |t x| for
    x < 0), so the roundings are relative to |x| (|1 - t| + |lw|) + |lw|."""
    a = c.a
    x, t, w, pw = a["self"], a["target"], a.get("weight"), a.get("pos_weight")

    def absolute():
        lw = 1 + (pw - 1) * t if pw is not None else torch.ones_like(t)
        e = (2 * EXP_ULPS * c.u) * (x.abs() * ((1 - t).abs() + lw.abs()) + lw.abs())
        return e * w.abs() if w is not None else e

    return _loss(c, EXP_ULPS + 4, absolute)


@register_budget(*overloads("nll_loss_forward", "nll_loss2d_forward"), family=Family.LOSS)
def nll_budget(c: BudgetCall) -> Budget:
    """-w_t x[i, t_i] summed, divided by the total weight (mean). total_weight: gamma_n(ua) * itself."""
    tw = c.out(1)
    n = max(c.a["target"].numel(), 1)  # the terms the sums run over (nll_loss2d: N*H*W)

    def divisor() -> tuple[float, float]:
        w = abs(float(tw))
        return w, (_weights_abs_sum(c) / w if w > 0 else 1.0)

    main = _loss(c, 2.0, divisor=divisor)
    return c.budget(lambda: [main.bound[0], c.final(tw) + gamma(n, c.ua) * _weights_abs_sum(c)])


def _weights_abs_sum(c: BudgetCall) -> float:
    """sum |w_t| over the targets that count (not ignore_index): |total weight| unless weights change sign."""
    target, weight = c.a["target"], c.a.get("weight")
    counted = target != c.a.get("ignore_index", -100)
    if weight is None:
        return float(counted.sum())
    return float(weight.abs()[target.clamp_min(0).clamp_max(weight.numel() - 1)][counted].sum())



# Loss and activation backward ops are elementwise given their inputs: a handful of roundings of the result.
LOSS_BACKWARD = ("mse_loss_backward", "nll_loss_backward", "nll_loss2d_backward", "binary_cross_entropy_backward",
                 "smooth_l1_loss_backward", "huber_loss_backward", "l1_loss_backward")
register_ulps(overloads(*LOSS_BACKWARD), Family.LOSS, 8.0)
# -y g sigmoid(-y x) / n through exp(-y x) / (1 + exp(-y x)): more roundings (observed up to 24 ulps)
register_ulps(overloads("soft_margin_loss_backward"), Family.LOSS, 32.0)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(-1) if x.dim() else x.abs()


@register_budget(*overloads("multi_margin_loss"), family=Family.LOSS)
def multi_margin_budget(c: BudgetCall) -> Budget:
    """sum_j max(0, margin - x_y + x_j)^p w_y / C: each term off by (2p + 2) u relative to
    (|margin| + 2 max|x|)^p, the sum by gamma_C(ua)."""
    a = c.a
    x, p, w = a["self"], float(a.get("p", 1)), a.get("weight")
    C = x.shape[-1] if x.dim() else 1
    wmax = float(w.abs().max()) if isinstance(w, torch.Tensor) and w.numel() else 1.0
    return _loss(c, 0.0, lambda: (gamma(C + 2, c.ua) + (2 * p + 2) * c.u) * wmax *
                 (abs(float(a.get("margin", 1))) + 2 * _row_max(x)) ** p)


@register_budget(*overloads("multilabel_margin_loss_forward"), family=Family.LOSS)
def multilabel_margin_budget(c: BudgetCall) -> Budget:
    """sum over target/non-target pairs of max(0, 1 - (x_j - x_k)) / C: at most C^2 terms of size
    <= 1 + 2 max|x|, each off by 2 u. Output 1 (is_target) is a 0/1 mask."""
    x = c.a["self"]
    C = x.shape[-1] if x.dim() else 1
    main = _loss(c, 0.0, lambda: (gamma(C * C + 2, c.ua) + 4 * c.u) * C * (1 + 2 * _row_max(x)))
    return c.budget(lambda: [main.bound[0], c.ulp_bound(c.out(1), 1.0)])
