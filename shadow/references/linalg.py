"""References of dot products: the mm family, matmul, linear and convolution, each element an exact dot
product (``exact_dot``) plus an exactly added ``beta * bias``.

Operand names come from ``shadow.opsets.MATMULS`` and ``CONVOLUTIONS``; the cost of an element is its
inner dimension (a's last dim; for a convolution, a group's channels times the kernel taps).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Callable

import mpmath
import torch

from ..opsets import CONVOLUTIONS, MATMULS, Family, Matmul
from ._table import Call, bcast, register_reference
from .exact import Exact, exact_dot

aten = torch.ops.aten
mpf = mpmath.mpf


def _combine(call: Call, dot: Exact, index: tuple[int, ...], bias: str | None) -> Exact:
    """beta * bias + alpha * dot; the bias is not read when beta == 0 (NaN there is ignored too)."""
    alpha = mpf(call.scalar("alpha")) if call.has("alpha") else mpf(1)
    beta = mpf(call.scalar("beta")) if call.has("beta") else mpf(1)
    value, mag = alpha * dot.value, abs(alpha) * dot.magnitude
    if bias is not None and beta != 0 and call.arg(bias) is not None:
        c = beta * mpf(call.scalar(bias, index))
        value, mag = value + c, mag + abs(c)
    return Exact(value, mag)


def _mm_rule(m: Matmul, call: Call, index: tuple[int, ...]) -> Exact:
    """One element of a (batched) matrix product: ``a[..., i, :] . b[..., :, j]`` (+ beta * bias)."""
    a, b = call.tensor(m.a), call.tensor(m.b)
    expected = a.dim() - (b.dim() == 1)
    if len(index) != expected:
        raise IndexError(f"output index {index} has {len(index)} dims, expected {expected}")
    if b.dim() == 1:  # mv, addmv: out[..., i] = a[..., i, :] . b
        return _combine(call, exact_dot(a[index], b), index, m.bias)
    *batch, i, j = index
    return _combine(call, exact_dot(a[(*batch, i)], b[(*batch, slice(None), j)]), index, m.bias)


def dot_rule(m: Matmul, call: Call, index: tuple[int, ...]) -> Exact:
    if index:
        raise IndexError(f"dot has a 0-d output, got index {index}")
    return exact_dot(call.tensor(m.a), call.tensor(m.b))


def matmul_rule(m: Matmul, call: Call, index: tuple[int, ...]) -> Exact:
    """torch.matmul's cases: dot, matrix-vector, vector-matrix, broadcast batched matrix products."""
    a, b = call.tensor(m.a), call.tensor(m.b)
    if a.dim() == 0 or b.dim() == 0:
        raise call.fail("matmul needs tensors of at least one dimension")
    if a.dim() == 1 and b.dim() == 1:
        return exact_dot(a, b)
    if b.dim() == 1:
        return exact_dot(a[tuple(index)], b)
    if a.dim() == 1:
        *batch, j = index
        return exact_dot(a, b[(*batch, slice(None), j)])
    *batch, i, j = index
    return exact_dot(
        a[(*bcast(a[..., 0, 0], tuple(batch)), i)], b[(*bcast(b[..., 0, 0], tuple(batch)), slice(None), j)]
    )


def linear_rule(m: Matmul, call: Call, index: tuple[int, ...]) -> Exact:
    """input[..., :] . weight[j, :] + bias[j]."""
    x, w = call.tensor(m.a), call.tensor(m.b)
    if w.dim() != 2:
        raise call.fail(f"weight of shape {tuple(w.shape)}: only 2-d weights are covered")
    *lead, j = index
    return _combine(call, exact_dot(x[tuple(lead)], w[j]), (j,), m.bias)


def _inner_terms(name: str, call: Call, out_numel: int) -> int:
    """A dot product's length: the last dim of its first factor."""
    t = call.arg(name)
    return int(t.shape[-1]) if isinstance(t, torch.Tensor) and t.dim() else 1


def _register_matmul(name: str, rule: Callable[[Matmul, Call, tuple[int, ...]], Exact]) -> None:
    """``rule`` with the operand names of ``name``, for the op and its in-place twin (addmm_)."""
    m = MATMULS[name]
    ops = [getattr(aten, op) for op in (name, f"{name}_") if hasattr(aten, op)]
    register_reference(*ops, family=Family.MATMUL, terms=functools.partial(_inner_terms, m.a))(
        functools.partial(rule, m))


for _name in ("mm", "bmm", "addmm", "baddbmm", "mv", "addmv"):
    _register_matmul(_name, _mm_rule)
_register_matmul("dot", dot_rule)
_register_matmul("matmul", matmul_rule)
_register_matmul("linear", linear_rule)


# --- convolution ---
def _conv_window(
    call: Call, x: torch.Tensor, w: torch.Tensor, out_pos: Sequence[int], transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and weight values (flat, paired) that meet at output position ``out_pos``.

    ``x``: one sample's input channels of the group, ``(Cg, *L)``; ``w``: the matching weights,
    ``(Cg, *K)``. Out-of-range positions are zero padding: their terms are left out.
    """
    nsp = x.dim() - 1
    stride, padding, dilation = (_per_dim(call, n, nsp) for n in ("stride", "padding", "dilation"))
    out_pad = _per_dim(call, "output_padding", nsp) if transposed else [0] * nsp
    idx, valid = [], []
    for o, s, p, d, op, L, K in zip(out_pos, stride, padding, dilation, out_pad, x.shape[1:], w.shape[1:]):
        size = (L - 1) * s - 2 * p + d * (K - 1) + op + 1 if transposed else (L + 2 * p - d * (K - 1) - 1) // s + 1
        if not 0 <= o < size:
            raise IndexError(f"output position {tuple(out_pos)} is outside the output ({size} along a spatial dim)")
        k = torch.arange(K)
        if transposed:  # o = i * s - p + k * d: the inputs i that land on o
            num = o + p - k * d
            ok = (num >= 0) & (num % s == 0) & (num // s < L)
            pos = num // s
        else:
            pos = o * s - p + k * d
            ok = (pos >= 0) & (pos < L)
        idx.append(pos.clamp(0, L - 1))
        valid.append(ok)
    grids = torch.meshgrid(*idx, indexing="ij")
    mask = functools.reduce(torch.logical_and, torch.meshgrid(*valid, indexing="ij"))
    window = x[(slice(None), *grids)]
    return window[:, mask].reshape(-1), w[:, mask].reshape(-1)


def _per_dim(call: Call, name: str, n: int) -> list[int]:
    v = list(call.arg(name))
    if len(v) == 1:
        v = v * n
    if len(v) != n:
        raise call.fail(f"{name}={v}: expected {n} values")
    return v


def convolution_rule(m: Matmul, call: Call, index: tuple[int, ...]) -> Exact:
    """out[n, co, *o] = bias[co] + sum over the group's input channels and kernel taps of x * w."""
    x, w = call.tensor(m.a), call.tensor(m.b)
    transposed, groups = bool(call.arg("transposed")), int(call.arg("groups"))
    if x.dim() != w.dim() or x.dim() < 3:
        raise call.fail(f"input {tuple(x.shape)} and weight {tuple(w.shape)}: expected batched N-d convolution")
    if len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    n, co, *o = index
    if transposed:  # weight (C_in, C_out / groups, *K)
        cin_g, cout_g = x.shape[1] // groups, w.shape[1]
        g = co // cout_g
        xs, ws = x[n, g * cin_g : (g + 1) * cin_g], w[g * cin_g : (g + 1) * cin_g, co % cout_g]
    else:  # weight (C_out, C_in / groups, *K)
        cin_g, cout_g = w.shape[1], w.shape[0] // groups
        g = co // cout_g
        xs, ws = x[n, g * cin_g : (g + 1) * cin_g], w[co]
    if not 0 <= co < cout_g * groups:
        raise IndexError(f"output channel {co} out of range")
    a, b = _conv_window(call, xs, ws, o, transposed)
    return _combine(call, exact_dot(a, b), (co,), m.bias)


def _conv_terms(m: Matmul, call: Call, out_numel: int) -> int:
    """A group's input channels times the kernel taps: the weight over its output-channel dim."""
    w = call.arg(m.b)
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        return 1
    return w.numel() // max(1, int(w.shape[1 if call.arg("transposed") else 0]))


for _name in ("convolution", "_convolution"):
    _m = CONVOLUTIONS[_name]
    register_reference(getattr(aten, _name), family=Family.CONV, terms=functools.partial(_conv_terms, _m))(
        functools.partial(convolution_rule, _m)
    )
