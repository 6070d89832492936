"""References of elementwise ops: one output element from the input elements broadcasting sends to it.

Transcendentals run in mpmath at the working precision, with the IEEE results at poles and outside
the real domain (log(0) = -inf, sqrt(-1) = nan); the sign of a zero input comes from its float, which
mpf drops. ``gelu`` uses the erfc form, which keeps its negative tail where float64 kernels lose it.
"""

from __future__ import annotations

import fractions
import functools
import math
from typing import Callable

import mpmath
import torch

from ..opsets import SELECTION, Family
from ._table import INF, NAN, Call, register_reference
from .exact import Exact

aten = torch.ops.aten
mpf = mpmath.mpf


def _unary(fn: Callable[[mpmath.mpf, float | int], mpmath.mpf], call: Call, index: tuple[int, ...]) -> Exact:
    """An elementwise op of ``self``; ``fn`` gets the value as mpf and as the float it came from
    (for the sign of zero, which mpf drops)."""
    x = call.scalar("self", index)
    return Exact.plain(fn(mpf(x), x))


def _log_domain(fn: Callable, x: mpmath.mpf, xf: float, pole: float = 0.0) -> mpmath.mpf:
    if x == pole:
        return -INF
    return NAN if x < pole else fn(x)


def _recip(x: mpmath.mpf, xf: float) -> mpmath.mpf:
    return mpf(math.copysign(math.inf, xf)) if x == 0 else 1 / x


def _rsqrt(x: mpmath.mpf, xf: float) -> mpmath.mpf:
    if x == 0:
        return mpf(math.copysign(math.inf, xf))  # rsqrt(-0.0) = 1 / -0.0 = -inf
    return NAN if x < 0 else 1 / mpmath.sqrt(x)


def _sigmoid(x: mpmath.mpf) -> mpmath.mpf:
    return 1 / (1 + mpmath.exp(-x))


_UNARY: dict[tuple[torch._ops.OpOverloadPacket, ...], Callable[[mpmath.mpf, float], mpmath.mpf]] = {
    (aten.abs, aten.abs_): lambda x, xf: abs(x),
    (aten.neg, aten.neg_): lambda x, xf: -x,
    (aten.relu, aten.relu_): lambda x, xf: max(x, mpf(0)),
    (aten.reciprocal, aten.reciprocal_): _recip,
    (aten.sqrt, aten.sqrt_): lambda x, xf: NAN if x < 0 else mpmath.sqrt(x),
    (aten.rsqrt, aten.rsqrt_): _rsqrt,
    (aten.exp, aten.exp_): lambda x, xf: mpmath.exp(x),
    (aten.expm1, aten.expm1_): lambda x, xf: mpmath.expm1(x),
    (aten.log, aten.log_): functools.partial(_log_domain, mpmath.log),
    (aten.log2, aten.log2_): functools.partial(_log_domain, lambda x: mpmath.log(x, 2)),
    (aten.log1p, aten.log1p_): lambda x, xf: _log_domain(mpmath.log1p, x, xf, pole=-1.0),
    (aten.sin, aten.sin_): lambda x, xf: mpmath.sin(x),
    (aten.cos, aten.cos_): lambda x, xf: mpmath.cos(x),
    (aten.tanh, aten.tanh_): lambda x, xf: mpmath.tanh(x),
    (aten.sigmoid, aten.sigmoid_): lambda x, xf: _sigmoid(x),
    (aten.erf, aten.erf_): lambda x, xf: mpmath.erf(x),
    (aten.silu, aten.silu_): lambda x, xf: x * _sigmoid(x),
}
# float64 computes these exactly (abs, neg, relu) or with one IEEE 754 rounding (sqrt, 1 / x) per element
_ROUND_ONCE = {aten.abs, aten.neg, aten.relu, aten.sqrt, aten.reciprocal}
for _ops, _fn in _UNARY.items():
    register_reference(*_ops, family=Family.MOVEMENT if _ops[0].__name__ in SELECTION else Family.ELEMENTWISE,
                       rounds_once=_ops[0] in _ROUND_ONCE)(functools.partial(_unary, _fn))


@register_reference(aten.gelu, aten.gelu_, family=Family.ELEMENTWISE)
def gelu_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """x/2 (1 + erf(x/sqrt 2)), or with approximate='tanh' x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = mpf(call.scalar("self", index))
    approximate = call.arg("approximate", "none")
    if approximate == "none":
        # erfc form: 1 + erf(z) cancels for z << 0, where float64 kernels lose every digit
        value = x / 2 * mpmath.erfc(-x / mpmath.sqrt(2))
        return Exact(value, abs(x) / 2 * (1 + abs(mpmath.erf(x / mpmath.sqrt(2)))))
    if approximate == "tanh":
        # the op's definition uses the decimal constant 0.044715; 1 + tanh(y) = 2 / (1 + exp(-2y))
        y = mpmath.sqrt(2 / mpmath.pi) * (x + mpf("0.044715") * x**3)
        return Exact(x / (1 + mpmath.exp(-2 * y)), abs(x) / 2 * (1 + abs(mpmath.tanh(y))))
    raise call.fail(f"approximate={approximate!r}: expected 'none' or 'tanh'")


@register_reference(aten.softplus, family=Family.ELEMENTWISE)
def softplus_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (part of the op's definition)."""
    xf = call.scalar("self", index)
    beta, threshold = mpf(call.scalar("beta")), mpf(call.scalar("threshold"))
    if beta == 0:
        raise call.fail("beta == 0")
    x = mpf(xf)
    # the branch is taken on the exact product: a float kernel rounding beta*x across the threshold
    # differs by about log1p(exp(-threshold)), a documented property of the op, not an error here
    if x * beta > threshold:
        return Exact.plain(x)
    return Exact.plain(mpmath.log1p(mpmath.exp(beta * x)) / beta)


def _add_rule(sign: int, reverse: bool, call: Call, index: tuple[int, ...]) -> Exact:
    """self + sign * alpha * other (reverse: other - alpha * self, as aten.rsub)."""
    a, b = mpf(call.scalar("self", index)), mpf(call.scalar("other", index))
    alpha = mpf(call.scalar("alpha")) if call.has("alpha") else mpf(1)
    if reverse:
        a, b = b, a
    t = sign * alpha * b
    return Exact(a + t, abs(a) + abs(t))


register_reference(aten.add, aten.add_, family=Family.ELEMENTWISE)(functools.partial(_add_rule, 1, False))
register_reference(aten.sub, aten.sub_, family=Family.ELEMENTWISE)(functools.partial(_add_rule, -1, False))
register_reference(aten.rsub, family=Family.ELEMENTWISE)(functools.partial(_add_rule, -1, True))


@register_reference(aten.mul, aten.mul_, family=Family.ELEMENTWISE, rounds_once=True)
def mul_rule(call: Call, index: tuple[int, ...]) -> Exact:
    return Exact.plain(mpf(call.scalar("self", index)) * mpf(call.scalar("other", index)))


@register_reference(aten.div, aten.div_, family=Family.ELEMENTWISE)
def div_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """self / other, rounded toward zero or down with rounding_mode='trunc' / 'floor' (exactly)."""
    af, bf = call.scalar("self", index), call.scalar("other", index)
    mode = call.arg("rounding_mode")
    if mode not in (None, "trunc", "floor"):
        raise call.fail(f"rounding_mode={mode!r}: expected None, 'trunc' or 'floor'")
    if bf == 0:
        if af == 0:
            return Exact.plain(NAN)
        return Exact.plain(mpf(math.copysign(math.inf, af) * math.copysign(1.0, bf)))
    if mode is None:
        return Exact.plain(mpf(af) / mpf(bf))
    q = fractions.Fraction(af) / fractions.Fraction(bf)  # exact: a floor must not see a rounded quotient
    return Exact.plain(mpf(math.trunc(q) if mode == "trunc" else math.floor(q)))


@register_reference(aten.pow, aten.pow_, family=Family.ELEMENTWISE)
def pow_rule(call: Call, index: tuple[int, ...]) -> Exact:
    """self ** exponent with IEEE pow's real-valued special cases (0 ** -y = inf, (-x) ** 0.5 = nan)."""
    xf, yf = call.scalar("self", index), call.scalar("exponent", index)
    x, y = mpf(xf), mpf(yf)
    if y == 0:
        return Exact.plain(mpf(1))
    if x == 0:
        if y > 0:
            return Exact.plain(mpf(0))
        odd = float(yf).is_integer() and int(yf) % 2 == 1
        return Exact.plain(mpf(math.copysign(math.inf, xf) if odd else math.inf))
    if x < 0 and not float(yf).is_integer():
        return Exact.plain(NAN)
    return Exact.plain(mpmath.power(x, int(yf) if float(yf).is_integer() else y))
