"""Normalization budgets (layer, group, batch and RMS norm, forward and backward): composed first-order
bounds, written once over a "statistics view". The bounds are per statistics group (a row for layer norm,
a channel for batch norm) times |weight|, from a few read-only reductions (extremes and norms of x and of
the gradient), so their cost stays near the fused kernels' own; per element they are looser where |xhat|
is below its group's largest.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..opsets import Family
from .core import Budget, BudgetCall, add_into, is_float, numel_over, overloads, register_budget
from .units import gamma


@dataclasses.dataclass(slots=True)
class _NormView:
    """x as [..] with the statistics (mean, rstd) and the affine parameters broadcastable to it:
    layer norm [R, n] / [R, 1] / [1, n]; batch norm [N, C, L] / [1, C, 1] / [1, C, 1];
    group norm [N, G, C/G, L] / [N, G, 1, 1] / [1, G, C/G, 1]."""

    layout: str  # "ln", "bn", "gn"
    x: torch.Tensor
    stat_shape: tuple
    param_shape: tuple
    stat_dims: tuple  # reduced for the statistics (n elements)
    param_dims: tuple  # reduced for weight/bias gradients (R elements)
    k: int = 0  # layer norm: number of normalized dims

    @property
    def n(self) -> int:
        return numel_over(self.x, self.stat_dims)

    @property
    def R(self) -> int:
        return numel_over(self.x, self.param_dims)

    def stat(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.stat_shape)

    def param(self, t: Any) -> Any:
        return None if t is None else t.reshape(self.param_shape)

    def to_output(self, t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """A bound computed in this view, reshaped to broadcast against an output of ``shape``."""
        if t.numel() == math.prod(shape):
            return t.reshape(shape)
        if self.layout == "ln":
            return t.reshape(*shape[: len(shape) - self.k], *([1] * self.k))
        if self.layout == "bn":
            return t.reshape(1, shape[1], *([1] * (len(shape) - 2)))
        full = t.expand(self.x.shape[0], self.x.shape[1], self.x.shape[2], 1)  # gn: per (n, channel)
        return full.reshape(shape[0], shape[1], *([1] * (len(shape) - 2)))

    def xhat_max(self, mu: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
        """max |x - mean| * rstd per group, from the group's extremes (read-only passes)."""
        return _absmax(self.x, self.stat_dims, mu) * rstd


def _absmax(t: torch.Tensor, dims: Sequence[int], center: Any = 0.0) -> torch.Tensor:
    """max |t - center| over dims (keepdim), from two read-only reductions; 0 for empty groups."""
    if t.numel() == 0:
        return torch.zeros([1 if i in dims else s for i, s in enumerate(t.shape)], dtype=torch.float64,
                           device=t.device)
    return torch.maximum(t.amax(dims, keepdim=True) - center, center - t.amin(dims, keepdim=True))


def _ln_view(x: torch.Tensor, normalized_shape: Sequence[int]) -> _NormView:
    n = math.prod(normalized_shape)
    R = x.numel() // max(n, 1)
    return _NormView("ln", x.reshape(R, n), (R, 1), (1, n), (1,), (0,), len(normalized_shape))


def _bn_view(x: torch.Tensor) -> _NormView:
    N, C = x.shape[0], x.shape[1]
    return _NormView("bn", x.reshape(N, C, math.prod(x.shape[2:])), (1, C, 1), (1, C, 1), (0, 2), (0, 2))


def _gn_view(x: torch.Tensor, N: int, C: int, G: int) -> _NormView:
    L = x.numel() // max(N * C, 1)
    return _NormView("gn", x.reshape(N, G, C // G, L), (N, G, 1, 1), (1, G, C // G, 1), (2, 3), (0, 3))


def _norm_forward(c: BudgetCall, v: _NormView, y: torch.Tensor, mu: torch.Tensor, rstd: torch.Tensor,
                  w: Any, b: Any, eps: float, stats_computed: bool) -> tuple[torch.Tensor, Any, Any]:
    """y = (x - mean) * rstd * w + b, bounds for (y, mean, rstd) with the exact statistics known.

    mean: gamma_n(ua) * mean|x| <= gamma_n(ua) * sqrt(mean^2 + var). rstd: relative 0.5 * the variance's,
    which is gamma_{2n+4}(ua) * (mean^2 + var) / (var + eps) (as for ``var``: covers one-pass forms), plus
    the rsqrt. y: the kernels compute x * (rstd w) + (b - mean rstd w), so the roundings are relative to
    |x| rstd |w| <= (|xhat| + 2|mean| rstd) |w|, and reduced-precision kernels normalize with the mean and
    rstd they return, rounded to the device dtype (bf16 batch norm does): one more u on each. With X the
    group's largest |xhat| (|y - b| <= X |w|):
        |dy| <= |w| (dmu rstd + (3 ua + u) |mean| rstd + (rho + 2 u + 6 ua) X) + (4 ua + u) |b|."""
    mu, rstd = v.stat(mu), v.stat(rstd)
    X = v.xhat_max(mu, rstd)
    if stats_computed:
        n = v.n
        var = (rstd.pow(-2) - eps).clamp_min(0.0)
        ms = mu.square() + var
        dmu = gamma(n, c.ua) * ms.sqrt()
        rho = 0.5 * gamma(2 * n + 4, c.ua) * ms / (var + eps) + 3 * c.ua
    else:  # statistics given (eval batch norm): only the rsqrt of var + eps
        dmu = torch.zeros_like(mu)
        rho = torch.full_like(rstd, 3 * c.ua)
    group = (dmu + (3 * c.ua + c.u) * mu.abs()) * rstd + (rho + 2 * c.u + 6 * c.ua) * X
    base = torch.full((), c.floor(), dtype=torch.float64)
    if b is not None:
        base = base + (4 * c.ua + c.u) * v.param(b).abs()
    by = torch.addcmul(base, v.param(w).abs(), group) if w is not None else group + base
    return v.to_output(by, y.shape), dmu, rho * rstd


def _stat_bounds(c: BudgetCall, v: _NormView, mu: torch.Tensor, rstd: torch.Tensor, dmu: Any, drstd: Any) -> list:
    return [(dmu + c.final(v.stat(mu))).reshape(mu.shape), (drstd + c.final(v.stat(rstd))).reshape(rstd.shape)]


@register_budget(*overloads("native_layer_norm"), family=Family.NORM)
def layer_norm_budget(c: BudgetCall) -> Budget:
    x, y, mu, rstd = c.a["input"], c.out(0), c.out(1), c.out(2)
    v = _ln_view(x, c.a["normalized_shape"])

    def make():
        by, dmu, drstd = _norm_forward(c, v, y, mu, rstd, c.a.get("weight"), c.a.get("bias"), c.a["eps"], True)
        return [by, *_stat_bounds(c, v, mu, rstd, dmu, drstd)]

    return c.budget(make)


@register_budget(*overloads("native_group_norm"), family=Family.NORM)
def group_norm_budget(c: BudgetCall) -> Budget:
    x, y, mu, rstd = c.a["input"], c.out(0), c.out(1), c.out(2)
    v = _gn_view(x, c.a["N"], c.a["C"], c.a["group"])

    def make():
        by, dmu, drstd = _norm_forward(c, v, y, mu, rstd, c.a.get("weight"), c.a.get("bias"), c.a["eps"], True)
        return [by, *_stat_bounds(c, v, mu, rstd, dmu, drstd)]

    return c.budget(make)


def batch_norm_budget(c: BudgetCall, *, training: bool | None = None) -> Budget:
    """native_batch_norm and the _native_batch_norm_legit / _batch_norm_with_update family. The running
    statistics it updates in place are not outputs: no bound for them here."""
    a = c.a
    x, y = a["input"], c.out(0)
    train = a.get("training", training) if training is None else training
    v = _bn_view(x)
    eps = a["eps"]

    def make():
        if train:
            mu, rstd = c.out(1), c.out(2)
        else:
            mu, rstd = a["running_mean"], (a["running_var"] + eps).rsqrt()
        by, dmu, drstd = _norm_forward(c, v, y, mu, rstd, a.get("weight"), a.get("bias"), eps, bool(train))
        out = [by]
        for t, d in ((c.out(1), dmu), (c.out(2), drstd)):
            out.append((d + c.final(v.stat(t))).reshape(t.shape) if train and t.numel() == mu.numel() else
                       (torch.zeros_like(t) if isinstance(t, torch.Tensor) else None))
        out.extend(torch.zeros_like(t) if isinstance(t, torch.Tensor) else None for t in c.outputs[3:])
        return out

    return c.budget(make)


register_budget(*overloads("native_batch_norm", "_native_batch_norm_legit"), family=Family.NORM)(batch_norm_budget)
register_budget(*overloads("_native_batch_norm_legit_no_training", "_batch_norm_no_update"), family=Family.NORM)(
    functools.partial(batch_norm_budget, training=False))
register_budget(*overloads("_batch_norm_with_update"), family=Family.NORM)(
    functools.partial(batch_norm_budget, training=True))


@register_budget(*overloads("_fused_rms_norm"), family=Family.NORM)
def rms_norm_budget(c: BudgetCall) -> Budget:
    """y = x * rstd * w, rstd = (mean(x^2) + eps)^-1/2: relative 0.5 gamma_{n+1}(ua) + rsqrt, then 2 products."""
    v = _ln_view(c.a["input"], c.a["normalized_shape"])
    rel = 0.5 * gamma(v.n + 1, c.ua) + 3 * c.ua
    y, rstd = c.out(0), c.out(1)
    return c.budget(lambda: [add_into(c.final(y), y.abs(), alpha=rel + 3 * c.ua),
                                     add_into(c.final(rstd), rstd.abs(), alpha=rel)])


def _bcast_sum(t: torch.Tensor, shape: Sequence[int], dims: Sequence[int]) -> torch.Tensor:
    """sum over ``dims`` of t broadcast to ``shape``, without materializing the broadcast."""
    own = [d for d in dims if t.shape[d] != 1]
    mult = math.prod(shape[d] for d in dims if t.shape[d] == 1)
    return (t.sum(own, keepdim=True) if own else t) * mult


def _norm_backward(c: BudgetCall, v: _NormView, dy: torch.Tensor, mu: torch.Tensor, rstd: torch.Tensor, w: Any,
                   outs: Sequence[Any], train: bool = True) -> list:
    """Bounds for (dx, dw, db) of y = xhat * w + b, xhat = (x - mean) * rstd, statistics given.

    dx = rstd * (g - mean(g) - xhat * mean(g xhat)), g = dy * w. Kernels compute it in the uncentered form
    rstd*g + c2*x + c3 (c2 from sum(g x) - mean * sum(g)), whose roundings are relative to |x| and |mean|.
    With K = rstd * rms(x) = sqrt(mean(xhat^2) + (mean rstd)^2) (about 1 for centered data, more with an
    offset mean or a negative eps), mean|g| <= rms(g) and mean|g x| <= rms(g) rms(x) (Cauchy-Schwarz), X and
    G the group's largest |xhat| and |g| (so |dx| <= rstd (G + rms(g) (1 + X K))):
        |d dx| <= rstd * [4 (gamma_{n+3}(ua) + 4 ua) rms(g) (1 + K (X + K)) + 3 u G + 3 u (G + rms(g) (1 + X K))].
    dw = sum dy * xhat, xhat computed as x rstd - mean rstd: (gamma_R(ua) + 2 ua) * sum |dy| (X + 2 |mean| rstd),
    by Cauchy-Schwarz over the summed dims; db = sum dy: gamma_R(ua) * sum|dy|. Read-only reductions only."""
    dyv = dy.reshape(v.x.shape)
    mu, rstd = v.stat(mu), v.stat(rstd)
    d = v.stat_dims
    n = max(v.n, 1)
    mr = (mu * rstd).abs()
    X = v.xhat_max(mu, rstd)
    K = (torch.linalg.vector_norm(v.x, 2, d, keepdim=True) / math.sqrt(n)) * rstd
    wm = _absmax(v.param(w), d) if w is not None else 1.0  # the largest |w| a group meets
    bounds = []
    dx, dw, db = (list(outs) + [None, None, None])[:3]
    if is_float(dx):
        G = _absmax(dyv, d) * wm
        if train:
            rms_g = torch.linalg.vector_norm(dyv, 2, d, keepdim=True) / math.sqrt(n) * wm
            t = 4 * (gamma(v.n + 3, c.ua) + 4 * c.ua) * rms_g * (1 + K * (X + K)) + 3 * c.u * G
            bdx = rstd * (t + 3 * c.u * (G + rms_g * (1 + X * K)))
        else:  # eval: dx = dy * w * rstd, elementwise
            bdx = 6 * c.u * rstd * G
        bounds.append(v.to_output(bdx + c.floor(), dx.shape))
    else:
        bounds.append(None)
    R = v.R
    if is_float(dw):
        cw = (X + 2 * mr).square()
        # (squares summed: torch's norm kernels are slow over leading dims)
        s = dyv.square().sum(v.param_dims).sqrt() * _bcast_sum(cw, v.x.shape, v.param_dims).reshape(
            [s for i, s in enumerate(cw.shape) if i not in v.param_dims] or [1]).sqrt()
        bounds.append(add_into(c.final(dw), s.reshape(dw.shape), alpha=gamma(R, c.ua) + 2 * c.ua))
    else:
        bounds.append(None)
    if is_float(db):
        s1 = dyv.abs().sum(v.param_dims)
        bounds.append(add_into(c.final(db), s1.reshape(db.shape), alpha=gamma(R, c.ua)))
    else:
        bounds.append(None)
    return bounds


@register_budget(*overloads("native_layer_norm_backward"), family=Family.NORM)
def layer_norm_backward_budget(c: BudgetCall) -> Budget:
    a = c.a
    v = _ln_view(a["input"], a["normalized_shape"])
    w = a.get("weight")
    return c.budget(lambda: _norm_backward(
        c, v, a["grad_out"], a["mean"], a["rstd"], None if w is None else w.reshape(-1), c.outputs))


@register_budget(*overloads("native_group_norm_backward"), family=Family.NORM)
def group_norm_backward_budget(c: BudgetCall) -> Budget:
    a = c.a
    v = _gn_view(a["input"], a["N"], a["C"], a["group"])
    return c.budget(lambda: _norm_backward(c, v, a["grad_out"], a["mean"], a["rstd"], a.get("weight"),
                                                   c.outputs))


def _bn_backward(c: BudgetCall, train: bool, saved_rstd: str) -> Budget:
    """Batch norm's backward from the saved statistics (training) or the running ones (inference)."""
    a = c.a
    v = _bn_view(a["input"])

    def make():
        if train:
            mu, rstd = a["save_mean"], a[saved_rstd]
        else:
            mu, rstd = a["running_mean"], (a["running_var"] + a["eps"]).rsqrt()
        return _norm_backward(c, v, a["grad_out"], mu, rstd, a.get("weight"), c.outputs, train)

    return c.budget(make)


@register_budget(*overloads("native_batch_norm_backward"), family=Family.NORM)
def batch_norm_backward_budget(c: BudgetCall) -> Budget:
    return _bn_backward(c, bool(c.a["train"]), "save_invstd")


@register_budget(*overloads("batch_norm_backward"), family=Family.NORM)
def batch_norm_backward2_budget(c: BudgetCall) -> Budget:
    """The backward of _batch_norm_with_update / _batch_norm_no_update: ``save_var`` holds the saved
    inverse standard deviation (what the forward returned), empty when the running statistics were used."""
    a = c.a
    return _bn_backward(c, bool(a["update"]) and a["save_mean"] is not None and a["save_mean"].numel() > 0,
                        "save_var")


@register_budget(*overloads("_fused_rms_norm_backward"), family=Family.NORM)
def rms_norm_backward_budget(c: BudgetCall) -> Budget:
    """As layer norm's backward with mean 0."""
    a = c.a
    v = _ln_view(a["input"], a["normalized_shape"])
    rstd = a["rstd"]
    w = a.get("weight")
    outs = [c.outputs[0], c.outputs[1] if len(c.outputs) > 1 else None, None]
    return c.budget(lambda: _norm_backward(c, v, a["grad_out"], torch.zeros_like(rstd), rstd,
                                                   None if w is None else w.reshape(-1), outs)[:len(c.outputs)])
