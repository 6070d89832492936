"""``Rounded``: a float64 value and a first-order bound on the error of computing it with each operation rounded once
(relative ``ua``), for budgets that carry an error bound through a kernel's own arithmetic: the same Python function
that computes a kernel's values on tensors runs on ``Rounded`` values (the fused RNN cells and oneDNN LSTM layers of
``budgets.recurrent``, the fused optimizers of ``budgets.optimizer``). docs/budgets.md: the fused RNN cells.

>>> a = Rounded(torch.tensor([3.0], dtype=torch.float64), 0.0, 2.0**-24)
>>> ((a + 1.0) * a).e.tolist() == [(4 * 2.0**-24) * 3 + 12 * 2.0**-24]   # |a| e(a + 1) + ua |(a + 1) a|
True
"""

from __future__ import annotations

from typing import Any

import torch

from .units import EXP_ULPS, gamma

F = torch.nn.functional


class Rounded:
    """A float64 value and a bound on the error of computing it with each operation rounded once (relative ``ua``);
    an operand that is not ``Rounded`` is exact."""

    __slots__ = ("v", "e", "ua")

    def __init__(self, v: torch.Tensor, e: Any, ua: float):
        self.v, self.e, self.ua = v, e, ua

    def _new(self, v: torch.Tensor, e: Any) -> Rounded:
        return Rounded(v, e + self.ua * v.abs(), self.ua)

    def __add__(self, other: Any) -> Rounded:
        return self._new(self.v + value(other), self.e + error(other))

    __radd__ = __add__

    def __sub__(self, other: Any) -> Rounded:
        return self._new(self.v - value(other), self.e + error(other))

    def __rsub__(self, other: Any) -> Rounded:
        return self._new(value(other) - self.v, self.e + error(other))

    def __neg__(self) -> Rounded:
        return Rounded(-self.v, self.e, self.ua)

    def __mul__(self, other: Any) -> Rounded:
        b = value(other)
        return self._new(self.v * b, self.e * magnitude(b) + self.v.abs() * error(other))

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Rounded:
        b = value(other)
        q = self.v / b
        return self._new(q, (self.e + q.abs() * error(other)) / magnitude(b))

    def __matmul__(self, other: Any) -> Rounded:
        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> Rounded:
        return matmul(other, self)

    def __getitem__(self, index: Any) -> Rounded:
        return Rounded(self.v[index], self.e[index] if _is_tensor(self.e) and self.e.dim() else self.e, self.ua)

    @property
    def shape(self) -> torch.Size:
        return self.v.shape

    @property
    def T(self) -> Rounded:  # noqa: N802 (torch's name)
        return Rounded(self.v.T, self.e.T if _is_tensor(self.e) and self.e.dim() else self.e, self.ua)

    def reshape(self, *shape: Any) -> Rounded:
        return Rounded(self.v.reshape(*shape), self.full().reshape(*shape), self.ua)

    def sum(self, dim: int) -> Rounded:
        """Summed over ``dim``, in any order: gamma_n(ua) times the sum of magnitudes more."""
        n = self.v.shape[dim]
        return Rounded(self.v.sum(dim), self.full().sum(dim) + gamma(n, self.ua) * self.v.abs().sum(dim), self.ua)

    def sqrt(self) -> Rounded:
        """sqrt(a): e_a / (2 sqrt a) to first order, never more than sqrt(e_a) (which holds at a = 0 too)."""
        r = self.v.sqrt()
        e = torch.as_tensor(self.e, dtype=torch.float64)
        return Rounded(r, torch.fmin(e / (2 * r), e.sqrt()) + self.ua * r, self.ua)

    def maximum(self, other: Any) -> Rounded:
        """The larger value, exactly: it errs by no more than the larger of the two errors."""
        e = torch.maximum(self.full(), other.full()) if isinstance(other, Rounded) else self.full()
        return Rounded(torch.maximum(self.v, value(other)), e, self.ua)

    def sigmoid(self) -> Rounded:
        s = self.v.sigmoid()
        return Rounded(s, s * (1 - s) * self.e + EXP_ULPS * self.ua * s, self.ua)

    def tanh(self) -> Rounded:
        t = self.v.tanh()
        return Rounded(t, (1 - t * t) * self.e + EXP_ULPS * self.ua * t.abs(), self.ua)

    def chunk(self, parts: int, dim: int) -> list[Rounded]:
        es = self.e.chunk(parts, dim) if _is_tensor(self.e) and self.e.dim() else [self.e] * parts
        return [Rounded(v, e, self.ua) for v, e in zip(self.v.chunk(parts, dim), es)]

    def full(self) -> torch.Tensor:
        """The error bound as a tensor of the value's shape."""
        return torch.as_tensor(self.e, dtype=torch.float64).expand_as(self.v)

    def stored(self, u: float) -> Rounded:
        """The value as the kernel stores it in a dtype of unit roundoff ``u``: one more rounding where that is
        narrower than ``ua``."""
        return Rounded(self.v, self.e + u * self.v.abs(), self.ua) if u > self.ua else self

    def bound(self, u: float, ua: float) -> torch.Tensor:
        """The bound of the stored result: the chain's, then a rounding to the device dtype where it is narrower."""
        return torch.as_tensor(self.e, dtype=torch.float64) + (u if u > ua else 0.0) * self.v.abs()


def value(x: Any) -> Any:
    return x.v if isinstance(x, Rounded) else x


def error(x: Any) -> Any:
    return x.e if isinstance(x, Rounded) else 0.0


def magnitude(x: Any) -> Any:
    return x.abs() if isinstance(x, torch.Tensor) else abs(x)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def exact(x: Any, ua: float) -> Any:
    """An input read exactly (a device tensor upcast to float64) as a ``Rounded`` of no error; None stays None."""
    return None if x is None else Rounded(x, 0.0, ua)


def constant(x: float, u: float, ua: float) -> Rounded:
    """A Python number as a kernel holds it, rounded to a dtype of unit roundoff ``u`` (``scalar_t(beta2)``)."""
    t = torch.tensor(float(x), dtype=torch.float64)
    return Rounded(t, u * t.abs(), ua)


def matmul(a: Any, b: Any) -> Rounded:
    """a @ b (either may be exact): the operands' errors carried through, plus gamma_K(ua) |a| @ |b| for the
    accumulation over the K inner terms in any order."""
    r = a if isinstance(a, Rounded) else b
    av, bv = value(a), value(b)
    e = gamma(av.shape[-1], r.ua) * (av.abs() @ bv.abs())
    if isinstance(a, Rounded):
        e = e + a.full() @ bv.abs()
    if isinstance(b, Rounded):
        e = e + av.abs() @ b.full()
    return Rounded(av @ bv, e, r.ua)


def linear(x: Any, w: torch.Tensor, b: Any) -> Rounded:
    """x @ w.T + b (``F.linear``) with an exact weight and a bias exact or ``Rounded``: the K products and the bias
    accumulate in any order, gamma_{K+1}(ua) times the sum of their magnitudes, plus the bias's own error."""
    ua = x.ua
    bv = value(b)
    k = w.shape[-1] + (b is not None)
    e = F.linear(x.full(), w.abs()) + gamma(k, ua) * F.linear(x.v.abs(), w.abs(), None if b is None else bv.abs())
    return Rounded(F.linear(x.v, w, bv), e + error(b), ua)


def cat(parts: list[Any], dim: int) -> Rounded:
    """torch.cat of ``Rounded`` values (an exact part has no error)."""
    r = next(p for p in parts if isinstance(p, Rounded))
    return Rounded(torch.cat([value(p) for p in parts], dim),
                   torch.cat([p.full() if isinstance(p, Rounded) else torch.zeros_like(p) for p in parts], dim), r.ua)


def stack(parts: list[Any]) -> Rounded:
    """torch.stack of ``Rounded`` values (an exact part has no error)."""
    return cat([p.unsqueeze(0) if isinstance(p, torch.Tensor) else Rounded(p.v.unsqueeze(0), p.full().unsqueeze(0),
                                                                         p.ua) for p in parts], 0)
