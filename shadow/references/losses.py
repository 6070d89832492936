"""References of losses: ``mse_loss`` and ``nll_loss`` per element or reduced (``at::Reduction``).

A reduced loss is one exact dot product or sum over every sample, so its cost is the ratio rule's
(the largest input over a 0-d output).
"""

from __future__ import annotations

import math

import mpmath
import torch

from ..opsets import Family
from ._table import NAN, Call, finite, register_reference
from .exact import Exact, exact_add, exact_dot, exact_mul, exact_sum

aten = torch.ops.aten
mpf = mpmath.mpf

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # at::Reduction


def _reduction(call: Call) -> str:
    r = call.arg("reduction")
    if r not in _REDUCTIONS:
        raise call.fail(f"reduction={r!r}: expected 0 (none), 1 (mean) or 2 (sum)")
    return _REDUCTIONS[r]


@register_reference(aten.mse_loss, family=Family.LOSS)
def mse_loss_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """(x - y)^2 per element, or its sum / mean: sum x^2 - 2 sum xy + sum y^2, each exact."""
    x, y = call.tensor("self"), call.tensor("target")
    mode = _reduction(call)
    if mode == "none":
        a, b = mpf(call.scalar("self", index)), mpf(call.scalar("target", index))
        d = a - b
        return Exact(d * d, abs(d) * (abs(a) + abs(b)))  # x - y cancels when x ~ y
    if index:
        raise IndexError(f"a reduced loss is 0-d, got index {index}")
    x, y = torch.broadcast_tensors(x, y)
    total = exact_add(exact_dot(x, x).value, exact_mul(mpf(-2), exact_dot(x, y).value), exact_dot(y, y).value)
    xd, yd = x.detach().double(), y.detach().double()
    mag = mpf(math.fsum(((xd - yd).abs() * (xd.abs() + yd.abs())).reshape(-1).tolist()))
    n = x.numel()
    if mode == "sum":
        return Exact(total, mag)
    return Exact(total / n, mag / n) if n else Exact.plain(NAN)


@register_reference(aten.nll_loss_forward, aten.nll_loss2d_forward, family=Family.LOSS, outputs=2)
def nll_loss_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """Outputs: -weight[t] * x[.., t, ..] per sample (or their sum, or their weighted mean), total_weight.

    The class dim is 1 (0 for a 1-d input); samples whose target is ignore_index weigh 0.
    """
    x, target = call.tensor("self"), call.arg("target")
    weight, ignore = call.arg("weight"), int(call.arg("ignore_index"))
    mode = _reduction(call)
    cdim = 1 if x.dim() >= 2 else 0
    n_classes = x.shape[cdim]
    if mode == "none":
        if call.output == 1:
            raise call.fail("reduction='none' leaves total_weight unspecified")
        t = int(target[index].item())
        if t == ignore:
            return Exact.plain(mpf(0))
        if not 0 <= t < n_classes:
            raise call.fail(f"target {t} outside [0, {n_classes})")
        picked = mpf(finite(x[(*index[:cdim], t, *index[cdim:])].item()))
        w = mpf(call.scalar("weight", (t,))) if weight is not None else mpf(1)
        return Exact.plain(-w * picked)
    if index:
        raise IndexError(f"a reduced loss is 0-d, got index {index}")
    rows = x.movedim(cdim, -1).reshape(-1, n_classes)
    t = target.reshape(-1)
    keep = t != ignore
    t, rows = t[keep], rows[keep]
    if t.numel() and not (0 <= int(t.min()) and int(t.max()) < n_classes):
        raise call.fail(f"targets outside [0, {n_classes})")
    picked = rows[torch.arange(t.numel()), t]
    w = weight.detach()[t] if weight is not None else torch.ones(t.numel(), dtype=torch.float64)
    total_weight = exact_sum(w)
    if call.output == 1:
        return total_weight
    num = exact_dot(w, picked)
    if mode == "sum":
        return Exact(-num.value, num.magnitude)
    if total_weight.value == 0:
        return Exact.plain(NAN)  # 0/0, as torch
    return Exact(-num.value / total_weight.value, num.magnitude / abs(total_weight.value))
