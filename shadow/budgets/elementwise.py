"""Elementwise and movement budgets: a few ulps of the result, plus, for formulas PyTorch's kernels evaluate
with cancellation, a term relative to the operands (``OPERAND_TERMS``). Calibrated on OpInfo in float32,
bfloat16 and float16 (tests/test_budgets.py).

>>> from shadow.budgets import budget_for
>>> x = torch.tensor([1.0], dtype=torch.float64)
>>> b = budget_for(torch.ops.aten.exp.default, (x,), {}, [x.exp()], torch.float32)
>>> b.ulps, b.bound[0].item() == 2.0**-20   # exp(1) in [2, 4): float32 spacing 2**-22, 4 ulps
(4.0, True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any, Callable

import torch

from ..opsets import DATA_MOVEMENT, PARTIAL_WRITES, SELECTION, VIEW_COPIES, Family
from ..plan import OpPlan
from .core import (Budget, BudgetCall, InUlps, is_float, magnitude, overloads, register_budget,
                   register_budget_predicate)

# Data movement and selection: a correct kernel returns its inputs' values exactly; the one rounding it may
# do is of a Python scalar argument (fill value, clamp bound) or of a cast to the output dtype: 1 ulp. Ops
# that write only part of their destination may accumulate into it (index_put): their rules are the sums'.
MOVEMENT = frozenset(overloads(*((DATA_MOVEMENT | VIEW_COPIES | SELECTION) - PARTIAL_WRITES)))

# Ulps per class of elementwise op (calibrated: see tests/test_budgets.py).
ULPS = {"movement": 1.0, "arith": 2.0, "transcendental": 4.0, "special": 64.0, "pointwise": 4.0}
ARITH = ("mul", "true_divide", "reciprocal", "sqrt", "rsqrt", "square", "deg2rad", "rad2deg", "ldexp",
         "leaky_relu", "leaky_relu_backward", "relu6", "hardswish", "hardsigmoid", "hardswish_backward",
         "hardsigmoid_backward", "kron", "float_power", "softshrink", "round", "sgn", "rrelu_with_noise_backward",
         "nextafter")  # nextafter: the float64 replay steps by a float64 ulp, the device by its own
TRANSCENDENTAL = (
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin", "acos", "atan",
    "atan2", "arctan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "gelu",
    "silu", "mish", "softplus", "elu", "selu", "celu", "log_sigmoid_forward", "logaddexp", "logaddexp2",
    "xlogy", "special_xlog1py", "sinc", "pow", "hypot", "logit", "gelu_backward", "silu_backward",
    "sigmoid_backward", "tanh_backward", "elu_backward", "softplus_backward", "mish_backward",
    "log_sigmoid_backward", "logit_backward", "special_entr", "angle", "rrelu_with_noise", "prelu",
    "_prelu_kernel", "_prelu_kernel_backward", "glu", "polar",
)
SPECIAL = (
    "lgamma", "digamma", "polygamma", "mvlgamma", "erfinv", "igamma", "igammac", "special_zeta",
    "special_ndtri", "special_airy_ai", "special_bessel_j0", "special_bessel_j1", "special_bessel_y0",
    "special_bessel_y1", "special_modified_bessel_i0", "special_modified_bessel_i1", "special_modified_bessel_k0",
    "special_modified_bessel_k1", "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1",
    "special_spherical_bessel_j0", "special_i0e", "special_i1e", "i0", "special_i0", "special_i1", "special_ndtr",
    "special_log_ndtr", "special_erfcx",
)
POLYNOMIALS = (
    "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u",
    "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_w", "special_hermite_polynomial_h",
    "special_hermite_polynomial_he", "special_laguerre_polynomial_l", "special_legendre_polynomial_p",
    "special_shifted_chebyshev_polynomial_t", "special_shifted_chebyshev_polynomial_u",
    "special_shifted_chebyshev_polynomial_v", "special_shifted_chebyshev_polynomial_w",
)
REFLECTED = ("lgamma", "digamma", "polygamma")  # special functions with a reflection formula for x < 0


def register_ulps(ops: Iterable, family: Family, ulps: float) -> None:
    """Bound ``ops`` by ``ulps`` units in the last place of the result (``InUlps``: a rule that reads no
    argument): an elementwise kernel given exact inputs."""
    register_budget(*ops, reads_overwritten=False)(InUlps(family, ulps))


def with_operand_term(c: BudgetCall, ulps: float, term: Callable[[], Any], alpha: float = 1.0, op: str = "",
                      other: Any = None) -> Budget:
    """``ulps`` of the result plus a term relative to an operand: what a rounding *before* a cancelling
    add costs (a scaled operand, a Python scalar rounded to the compute type). Reduced-precision kernels
    may round that intermediate in the device dtype (bf16 add with alpha does), so the term is in u. The bound
    is ``alpha`` times the term (``term()``, or what ``op`` forms from it and ``other``: ``UlpsPlus``) added to
    the ulps (``BudgetCall.ulps_plus``): the comparison forms it where it reads the result, so the optimizer's
    add/addcmul/addcdiv/lerp (every parameter, every step) write neither a bound nor a term tensor."""
    return c.ulps_plus(ulps, term, alpha, op, other)


def _arg0(c: BudgetCall) -> Any:
    return c.a.get("self", c.a.get("input"))


# PyTorch's kernels for these evaluate a formula that cancels where the result is small, so their error
# is not a few ulps of the result there; the extra term (in u of the device dtype, which reduced-precision
# kernels may round intermediates to) says what it is relative to.
OPERAND_TERMS: dict[str, Callable[[BudgetCall], Any]] = {
    # x * (1 + erf(x / sqrt 2)) / 2 (or the tanh form): 1 + erf cancels for x << 0
    "gelu": lambda c: 4 * c.u * _arg0(c).abs(),
    "gelu_backward": lambda c: 4 * c.u * c.a["grad_output"].abs() * (1 + c.a["self"].abs()),
    "sinc": lambda c: 2 * c.u,  # sin(pi x) / (pi x): pi x is rounded, moving sin by u absolute
    "logit": lambda c: 4 * c.u,  # log(x / (1 - x)) near x = 1/2: the quotient's rounding, absolute
    "logit_backward": lambda c: 4 * c.u * c.out().abs(),
    "softplus": lambda c: 2 * c.u / abs(float(c.a.get("beta", 1) or 1)),  # log(1 + exp(b x)): 1 + tiny rounded
    "logaddexp": lambda c: 2 * c.u * (magnitude(c.a["self"]) + magnitude(c.a["other"])),  # x - y rounded
    "logaddexp2": lambda c: 2 * c.u * (magnitude(c.a["self"]) + magnitude(c.a["other"])),
    # g * (x / 3 + 1/2) on (-3, 3): cancels at x = -3/2
    "hardswish_backward": lambda c: 2 * c.u * c.a["grad_output"].abs() * (c.a["self"].abs() / 3 + 0.5),
    "softplus_backward": lambda c: 2 * c.u * c.a["grad_output"].abs(),
    # g s (1 + x (1 - s)), s = sigmoid(x): cancels near x = -1.28
    "silu_backward": lambda c: (4 * c.u * c.a["grad_output"].abs() * (1 + c.a["self"].abs())
                                * torch.sigmoid(c.a["self"])),
    "mish_backward": lambda c: 4 * c.u * c.a["grad_output"].abs() * (1 + c.a["self"].abs()),
}
_SPECIAL_ABS = 16.0  # special functions near their zeros: an absolute floor of this many u


def operand_term_rule(c: BudgetCall, *, ulps: float, term: Callable[[BudgetCall], Any]) -> Budget:
    return with_operand_term(c, ulps, lambda: term(c))


for _names, _class in ((ARITH, "arith"), (TRANSCENDENTAL, "transcendental")):
    for _name in _names:
        if _name in OPERAND_TERMS:
            register_budget(*overloads(_name), family=Family.ELEMENTWISE)(
                functools.partial(operand_term_rule, ulps=ULPS[_class], term=OPERAND_TERMS[_name]))
        else:
            register_ulps(overloads(_name), Family.ELEMENTWISE, ULPS[_class])
register_ulps(sorted(MOVEMENT, key=str), Family.MOVEMENT, ULPS["movement"])


def _reflection_term(c: BudgetCall) -> Any:
    """lgamma, digamma, polygamma for x < 0 use the reflection formula, whose sin(pi x) has pi x rounded:
    relative error ~ (n+1) pi u |x| / dist(x, poles) of the result (absolute for lgamma)."""
    x = c.a["self"]
    if not isinstance(x, torch.Tensor):
        return _SPECIAL_ABS * c.u
    name = c.plan.base
    n = c.a.get("n", 0) if name == "polygamma" else 0
    dist = (x - x.round()).abs().clamp_min(c.u)
    k = 4 * (n + 1) * c.u * x.abs() / dist * (x < 0)
    scale = 1.0 if name == "lgamma" else c.out().abs()
    return _SPECIAL_ABS * c.u + k * scale


register_budget(*overloads(*(n for n in SPECIAL if n not in REFLECTED)), family=Family.ELEMENTWISE)(
    functools.partial(operand_term_rule, ulps=ULPS["special"], term=lambda c: _SPECIAL_ABS * c.u))
register_budget(*overloads(*REFLECTED), family=Family.ELEMENTWISE)(
    functools.partial(operand_term_rule, ulps=ULPS["special"], term=_reflection_term))
# recurrences for degree-n polynomials lose ~n^2 u relative to max(1, |P_n|) near their roots
register_budget(*overloads(*POLYNOMIALS), family=Family.ELEMENTWISE)(functools.partial(
    operand_term_rule, ulps=ULPS["special"], term=lambda c: 4 * c.u * magnitude(c.a["n"]) ** 2 * (1 + c.out().abs())))


def _near_integer(q: torch.Tensor, u: float) -> torch.Tensor:
    """Where a quotient rounded at u may land on the other side of an integer (floor/trunc flips)."""
    return (q - q.round()).abs() <= 4 * u * q.abs() + 4 * u


@register_budget(*overloads("div", "floor_divide", "remainder", "fmod"), family=Family.ELEMENTWISE)
def quotient_budget(c: BudgetCall) -> Budget:
    """Plain division: ulps. floor/trunc division, remainder, fmod: PyTorch rounds a/b before flooring, so
    where a/b is within u of an integer the result may be off by one step (1 for the quotient, |b| for the
    remainder); a correct kernel given exact inputs would not, but the budget holds PyTorch's own kernels."""
    name = c.plan.base
    mode = c.a.get("rounding_mode")
    if name == "div" and mode is None:
        return c.ulps(ULPS["arith"])
    a, b = c.a["self"], c.a["other"]
    r = c.out()

    def make():
        q = torch.as_tensor(a, dtype=torch.float64) / torch.as_tensor(b, dtype=torch.float64)
        near = _near_integer(q, c.u).to(torch.float64)
        step = near if name in ("div", "floor_divide") else near * magnitude(torch.as_tensor(b, dtype=torch.float64))
        return [c.ulp_bound(r, ULPS["arith"]) + step]

    return c.budget(make)


@register_budget(*overloads("linspace", "arange", "_histogramdd_bin_edges", "range"), family=Family.ELEMENTWISE)
def linspace_budget(c: BudgetCall) -> Budget:
    """start + i * step: the roundings are relative to the largest value, not to each (a value near 0 in
    the middle of the range keeps an error of ~u * max|r|)."""
    outs = c.outputs
    return c.budget(lambda: [
        None if not is_float(r) else c.ulp_bound(r, 2.0) + 4 * c.u * (r.abs().max() if r.numel() else 0.0)
        for r in outs])


@register_budget(*overloads("logspace"), family=Family.ELEMENTWISE)
def logspace_budget(c: BudgetCall) -> Budget:
    """RangeFactories.cpp: base ** (start + i * step) by a double pow, with start and end first rounded to the
    device dtype (and step formed from the rounded ends): the exponent is off by u * max(|start|, |end|), which
    pow turns into |ln base| times that, relative; then the result's own rounding."""
    a, r = c.a, c.out()
    ends = max(float(magnitude(torch.as_tensor(a[k], dtype=torch.float64)).max()) for k in ("start", "end"))
    rel = abs(math.log(float(a.get("base", 10.0)))) * (c.u * ends + 8 * 2.0**-53 * (ends + 1))
    return with_operand_term(c, 2.0, lambda: r.abs(), rel)


@register_budget(*overloads("glu_backward"), family=Family.ELEMENTWISE)
def glu_backward_budget(c: BudgetCall) -> Budget:
    """glu(x) = a * s, s = sigmoid(b); Activation.cpp writes s to the first half in the device dtype, then the
    second half is (1 - s) s a g: for b >> 0, 1 - s cancels, so s's error ((EXP_ULPS + 1) u s) reaches it
    absolute, not relative to 1 - s; every other rounding is relative (10 ulps of the result)."""
    a = c.a

    def term():
        x, dim = a["self"], a["dim"]
        first, second = x.chunk(2, dim)
        s = torch.sigmoid(second)
        return torch.cat([torch.zeros_like(first), (first * a["grad_output"]).abs() * s], dim)

    return with_operand_term(c, 10.0, term, (ULPS["transcendental"] + 1) * c.u)


def pointwise(plan: OpPlan) -> bool:
    """Tagged ``torch.Tag.pointwise``: the ops no rule above names."""
    return torch.Tag.pointwise in plan.tags


register_budget_predicate(pointwise, reads_overwritten=False)(InUlps(Family.ELEMENTWISE, ULPS["pointwise"]))
