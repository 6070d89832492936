"""References of reductions and scans (sum, mean, var/std, vector norms, cumsum) and of the softmax family.

Sums are exact; a variance's numerator ``N sum(x^2) - sum(x)^2`` is exact too, so the final division is
its only rounding. Softmax, log-softmax and logsumexp need ``exp`` per term: they run in mpmath (about
10 us per term), and are registered with that cost.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import mpmath
import torch

from ..opsets import Family
from ._table import INF, NAN, Call, finite, register_reference
from .exact import Exact, exact_dot, exact_moments, exact_sum

aten = torch.ops.aten
mpf = mpmath.mpf


# --- selecting the reduced elements ---
def _dims(call: Call, nd: int, dims: Any) -> set[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return set(range(nd))
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) for d in dims):
        raise call.fail(f"dims {dims!r}: only integer dims are supported")
    return {d % max(nd, 1) for d in dims} if nd else set()


def _reduced(call: Call, x: torch.Tensor, dims: Any, keepdim: bool, index: tuple[int, ...]) -> torch.Tensor:
    """The elements of ``x`` that a reduction over ``dims`` sends to output ``index`` (flat)."""
    nd = x.dim()
    red = _dims(call, nd, dims)
    expected = nd if keepdim else nd - len(red)
    if len(index) != expected:
        raise IndexError(f"output index {index} has {len(index)} dims, expected {expected}")
    it = iter(index)
    sel: list = []
    for d in range(nd):
        if d in red:
            if keepdim and next(it) != 0:
                raise IndexError(f"output index {index}: reduced dim {d} is kept with size 1")
            sel.append(slice(None))
        else:
            sel.append(next(it))
    return x[tuple(sel)].reshape(-1)


def _reduction_input(call: Call, index: tuple[int, ...]) -> torch.Tensor:
    return _reduced(call, call.tensor("self"), call.arg("dim"), bool(call.arg("keepdim", False)), index)


def _along(
    call: Call, x: torch.Tensor, dim: int, index: tuple[int, ...], stop: bool = False
) -> tuple[torch.Tensor, int]:
    """The line of ``x`` through ``index`` along ``dim`` (up to ``index[dim]`` when ``stop``), and the
    position on it."""
    if len(index) != x.dim():
        raise IndexError(f"output index {index} has {len(index)} dims, expected {x.dim()}")
    if x.dim() == 0:
        return x.reshape(1), 0
    if not isinstance(dim, int):
        raise call.fail(f"dim {dim!r}: only integer dims are supported")
    d = dim % x.dim()
    k = index[d]
    sel = list(index)
    sel[d] = slice(0, k + 1) if stop else slice(None)
    return x[tuple(sel)].reshape(-1), k


def _along_dim_terms(call: Call, out_numel: int) -> int:
    """A scan's or softmax's terms: the length of ``self`` along ``dim``."""
    x, d = call.arg("self"), call.arg("dim")
    return int(x.shape[d]) if isinstance(x, torch.Tensor) and x.dim() and isinstance(d, int) else 1


# --- sums, means, variances ---
@register_reference(aten.sum, family=Family.REDUCTION)
def sum_rule(call: Call, index: tuple[int, ...]) -> Exact:
    return exact_sum(_reduction_input(call, index))


@register_reference(aten.mean, family=Family.REDUCTION)
def mean_rule(call: Call, index: tuple[int, ...]) -> Exact:
    x = _reduction_input(call, index)
    if x.numel() == 0:
        return Exact.plain(NAN)
    s = exact_sum(x)
    return Exact(s.value / x.numel(), s.magnitude / x.numel())


def _correction(call: Call) -> mpmath.mpf:
    if call.has("correction"):
        c = call.arg("correction")
        return mpf(1 if c is None else c)
    return mpf(1 if call.arg("unbiased", True) else 0)


def _variance(x: torch.Tensor, correction: mpmath.mpf) -> tuple[Exact, Exact]:
    """(variance, mean) of the values of ``x``, with magnitude sum(x^2)/(N - c): the scale that the
    one-pass formula E[x^2] - E[x]^2 cancels from."""
    n = x.numel()
    if n == 0:
        return Exact.plain(NAN), Exact.plain(NAN)
    s, s2, num = exact_moments(x)
    dof = max(mpf(n) - correction, mpf(0))
    mean = Exact(s.value / n, s.magnitude / n)
    if dof == 0:  # IEEE: 0/0 and x/0
        return (Exact.plain(NAN) if num == 0 else Exact(INF, INF)), mean
    return Exact(num / (n * dof), s2.value / dof), mean


def _var_rule(root: bool, call: Call, index: tuple[int, ...]) -> Exact:
    var, mean = _variance(_reduction_input(call, index), _correction(call))
    if call.output == 1:
        return mean
    return Exact(mpmath.sqrt(var.value), mpmath.sqrt(var.magnitude)) if root else var


register_reference(aten.var, family=Family.REDUCTION)(functools.partial(_var_rule, False))
register_reference(aten.std, family=Family.REDUCTION)(functools.partial(_var_rule, True))
register_reference(aten.var_mean, family=Family.REDUCTION, outputs=2)(functools.partial(_var_rule, False))
register_reference(aten.std_mean, family=Family.REDUCTION, outputs=2)(functools.partial(_var_rule, True))


# --- vector norms ---
def _order(ord_name: str, call: Call) -> Any:
    """The norm's order as passed (2 when None)."""
    p = call.arg(ord_name)
    return 2 if p is None else p


def _norm_rule(ord_name: str, call: Call, index: tuple[int, ...]) -> Exact:
    """The vector norm (sum |x|^p)^(1/p), with p = 2, 1, inf, -inf, 0 (count) or any other real."""
    x = _reduction_input(call, index)
    p = _order(ord_name, call)
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        raise call.fail(f"{ord_name}={p!r}: only real orders are covered")
    if p == 2:
        return Exact.plain(mpmath.sqrt(exact_dot(x, x).value))
    if p == 1:
        return Exact.plain(exact_sum(x.abs()).value)
    vals = [abs(mpf(v)) for v in _values(x)]
    if p in (math.inf, -math.inf):
        if not vals:
            raise call.fail("the inf-norm of an empty tensor is an error in torch")
        return Exact.plain(max(vals) if p > 0 else min(vals))
    if p == 0:
        return Exact.plain(mpf(sum(1 for v in vals if v != 0)))
    if p < 0 and any(v == 0 for v in vals):
        return Exact.plain(mpf(0))  # a zero term makes sum |x|^p infinite, its (1/p)-th power zero
    return Exact.plain(mpmath.fsum(v**p for v in vals) ** (1 / mpf(p)))


def _values(x: torch.Tensor) -> list[float]:
    vals = x.detach().to("cpu", torch.float64).reshape(-1).tolist()
    for v in vals:
        finite(v)
    return vals


def _norm_per_term(ord_name: str, call: Call) -> str:
    """Orders 1 and 2 sum exactly; the others take each term to a power in mpmath."""
    return "exact" if _order(ord_name, call) in (1, 2) else "mpmath"


for _packet, _ord in ((aten.linalg_vector_norm, "ord"), (aten.norm, "p")):
    register_reference(_packet, family=Family.REDUCTION, per_term=functools.partial(_norm_per_term, _ord))(
        functools.partial(_norm_rule, _ord))


@register_reference(aten.cumsum, aten.cumsum_, family=Family.REDUCTION, terms=_along_dim_terms)
def cumsum_rule(call: Call, index: tuple[int, ...]) -> Exact:
    line, _ = _along(call, call.tensor("self"), call.arg("dim"), index, stop=True)
    return exact_sum(line)


# --- softmax family: exp is inexact, so these run in mpmath ---
def _lse_parts(line: torch.Tensor) -> tuple[mpmath.mpf, mpmath.mpf] | None:
    """(m, log sum exp(x - m)) with m the largest value; -inf terms contribute exp(-inf) = 0.
    None when every term is -inf."""
    vals = line.detach().to(torch.float64).tolist()
    finite_vals = [v for v in vals if v != -math.inf]
    for v in finite_vals:
        finite(v)
    if not finite_vals:
        return None
    m = mpf(max(finite_vals))
    return m, mpmath.log(mpmath.fsum(mpmath.exp(mpf(v) - m) for v in finite_vals))


def _softmax_rule(log: bool, call: Call, index: tuple[int, ...]) -> Exact:
    line, k = _along(call, call.tensor("self"), call.arg("dim"), index)
    parts = _lse_parts(line)
    if parts is None:  # every logit -inf: 0/0
        return Exact.plain(NAN)
    xk = line[k].item()
    if xk == -math.inf:
        return Exact.plain(-INF if log else mpf(0))
    m, lse = parts
    d = mpf(xk) - m
    if log:  # the kernel's x - m - lse cancels when x_k dominates: magnitude |x - m| + |lse|
        return Exact(d - lse, abs(d) + abs(lse))
    return Exact.plain(mpmath.exp(d - lse))


_softmax = functools.partial(register_reference, family=Family.REDUCTION, terms=_along_dim_terms, per_term="mpmath")
_softmax(aten._softmax, aten.softmax)(functools.partial(_softmax_rule, False))
_softmax(aten._log_softmax, aten.log_softmax)(functools.partial(_softmax_rule, True))


@register_reference(aten.logsumexp, family=Family.REDUCTION, per_term="mpmath")
def logsumexp_rule(call: Call, index: tuple[int, ...]) -> Exact:
    parts = _lse_parts(_reduction_input(call, index))
    if parts is None:
        return Exact.plain(-INF)
    m, lse = parts
    return Exact(m + lse, abs(m) + abs(lse))
