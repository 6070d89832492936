"""References of layer and batch normalization: the normalized element and the saved statistics.

Statistics come from exact sums (``exact_moments``), and ``x - mean`` is formed exactly in its numerator
``N x - sum(x)``, so a large mean does not cancel digits away; the cost of an element is the sum and the
sum of squares it reduces.
"""

from __future__ import annotations

import math

import mpmath
import torch

from ..opsets import Family
from ._table import Call, finite, register_reference
from .exact import Exact, exact_add, exact_moments, exact_mul

aten = torch.ops.aten
mpf = mpmath.mpf


def _normalized(
    x: mpmath.mpf, s: Exact, n: int, var: mpmath.mpf, eps: mpmath.mpf
) -> tuple[mpmath.mpf, mpmath.mpf, mpmath.mpf]:
    """((x - mean) * rstd, rstd, magnitude of the former) with mean = s / n, x - mean exact in its numerator."""
    rstd = 1 / mpmath.sqrt(var + eps)
    centered = exact_add(exact_mul(x, mpf(n)), -s.value) / n
    return centered * rstd, rstd, (abs(x) + abs(s.value) / n) * rstd


def _affine(call: Call, y: mpmath.mpf, mag: mpmath.mpf, at: tuple[int, ...]) -> Exact:
    """y * weight + bias at ``at`` (either may be None)."""
    w, b = call.arg("weight"), call.arg("bias")
    if w is not None:
        wv = mpf(call.scalar("weight", at))
        y, mag = y * wv, mag * abs(wv)
    if b is not None:
        bv = mpf(call.scalar("bias", at))
        y, mag = y + bv, mag + abs(bv)
    return Exact(y, mag)


def _stats_exact(x: torch.Tensor) -> tuple[int, Exact, mpmath.mpf, mpmath.mpf]:
    """(n, sum, biased variance, its magnitude sum(x^2)/n) with an exact numerator."""
    n = x.numel()
    s, s2, num = exact_moments(x)
    return n, s, num / (mpf(n) * n), s2.value / n


def _layer_norm_terms(call: Call, out_numel: int) -> int:
    return 2 * math.prod(call.arg("normalized_shape") or [1])  # a sum and a sum of squares per row


@register_reference(aten.native_layer_norm, family=Family.NORM, outputs=3, terms=_layer_norm_terms)
def layer_norm_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """Outputs: (x - mean) * rstd * weight + bias, mean, rstd = 1/sqrt(var + eps) over the normalized dims."""
    x = call.tensor("input")
    k = len(call.arg("normalized_shape"))
    axis = x.dim() - k
    if len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    lead, inner = index[:axis], index[axis:]
    n, s, var, var_mag = _stats_exact(x[lead].reshape(-1))
    if n == 0:
        raise call.fail("empty normalized shape")
    eps = mpf(call.scalar("eps"))
    if call.output == 1:
        _check_ones(inner)
        return Exact(s.value / n, s.magnitude / n)
    rstd = 1 / mpmath.sqrt(var + eps)
    if call.output == 2:
        _check_ones(inner)
        return Exact(rstd, rstd * (var_mag + eps) / (var + eps))
    y, _, mag = _normalized(mpf(finite(x[index].item())), s, n, var, eps)
    return _affine(call, y, mag, inner)


def _check_ones(inner: tuple[int, ...]) -> None:
    if any(inner):
        raise IndexError(f"mean/rstd have size 1 along the normalized dims, got index {inner}")


def _batch_norm_terms(call: Call, out_numel: int) -> int:
    """Training: a sum and a sum of squares over a channel; inference reads the running statistics."""
    x = call.arg("input")
    if not call.arg("training", False) or not isinstance(x, torch.Tensor) or x.dim() < 2:
        return 1
    return 2 * x.numel() // max(1, int(x.shape[1]))


@register_reference(
    aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
    family=Family.NORM, outputs=3, terms=_batch_norm_terms,
)
def batch_norm_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """Outputs: (x - mean[c]) * invstd[c] * weight[c] + bias[c], save_mean[c], save_invstd[c].

    Training: biased statistics of channel c (dim 1) over every other dim; inference: the running
    statistics. (The running-stat updates are writes to inputs, not outputs: not covered here.)
    """
    x = call.tensor("input")
    eps = mpf(call.scalar("eps"))
    training = bool(call.arg("training", False))
    c = index[1] if call.output == 0 else index[0]
    if call.output == 0 and len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    if call.output != 0 and len(index) != 1:
        raise IndexError(f"save_mean/save_invstd are 1-d (channels), got index {index}")
    if training:
        n, s, var, var_mag = _stats_exact(x.transpose(0, 1)[c].reshape(-1))
        mean, invstd = s.value / n, 1 / mpmath.sqrt(var + eps)
        if call.output == 1:
            return Exact(mean, s.magnitude / n)
        if call.output == 2:
            return Exact(invstd, invstd * (var_mag + eps) / (var + eps))
        y, _, mag = _normalized(mpf(finite(x[index].item())), s, n, var, eps)
        return _affine(call, y, mag, (c,))
    if call.output != 0:
        raise call.fail("inference batch norm returns empty save_mean/save_invstd")
    if call.arg("running_mean") is None or call.arg("running_var") is None:
        raise call.fail("inference without running statistics")
    rm, rv = mpf(call.scalar("running_mean", (c,))), mpf(call.scalar("running_var", (c,)))
    xv = mpf(finite(x[index].item()))
    invstd = 1 / mpmath.sqrt(rv + eps)
    return _affine(call, (xv - rm) * invstd, (abs(xv) + abs(rm)) * invstd, (c,))
