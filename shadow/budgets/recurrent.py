"""The fused LSTM and GRU cells of GPUs and PrivateUse1 devices (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``
and their backward): a first-order bound carried through the cells' own arithmetic.

The cells are short chains of elementwise operations, but their sums cancel (gate pre-activations, 1 - t*t,
hx - n), so a few ulps of the result would not hold. Each output's bound is what the chain allows when every
operation rounds once at ``ua`` (the accumulation type's unit roundoff, float32 for the halves, as CUDA computes the
cells) and the sigmoid and tanh kernels err by ``EXP_ULPS`` units: the same Python function that the replay runs on
float64 shadows (``shadow.replay.recurrent``) runs here on ``Rounded`` values, which carry a value and its error
bound; then one rounding to the device dtype. docs/budgets.md: the fused RNN cells.
"""

from __future__ import annotations

from typing import Any

import torch

from ..opsets import Family
from ..replay.recurrent import gru_cell, gru_cell_backward, lstm_cell, lstm_cell_backward
from .core import EXP_ULPS, Budget, BudgetCall, gamma, register_budget

aten = torch.ops.aten


class Rounded:
    """A float64 value and a bound on the error of computing it with each operation rounded once (relative ``ua``);
    an operand that is not ``Rounded`` is exact."""

    __slots__ = ("v", "e", "ua")

    def __init__(self, v: torch.Tensor, e: Any, ua: float):
        self.v, self.e, self.ua = v, e, ua

    def _new(self, v: torch.Tensor, e: Any) -> Rounded:
        return Rounded(v, e + self.ua * v.abs(), self.ua)

    def __add__(self, other: Any) -> Rounded:
        return self._new(self.v + _value(other), self.e + _error(other))

    __radd__ = __add__

    def __sub__(self, other: Any) -> Rounded:
        return self._new(self.v - _value(other), self.e + _error(other))

    def __rsub__(self, other: Any) -> Rounded:
        return self._new(_value(other) - self.v, self.e + _error(other))

    def __mul__(self, other: Any) -> Rounded:
        b = _value(other)
        return self._new(self.v * b, self.e * _magnitude(b) + self.v.abs() * _error(other))

    __rmul__ = __mul__

    def sigmoid(self) -> Rounded:
        s = self.v.sigmoid()
        return Rounded(s, s * (1 - s) * self.e + EXP_ULPS * self.ua * s, self.ua)

    def tanh(self) -> Rounded:
        t = self.v.tanh()
        return Rounded(t, (1 - t * t) * self.e + EXP_ULPS * self.ua * t.abs(), self.ua)

    def chunk(self, parts: int, dim: int) -> list[Rounded]:
        es = self.e.chunk(parts, dim) if isinstance(self.e, torch.Tensor) and self.e.dim() else [self.e] * parts
        return [Rounded(v, e, self.ua) for v, e in zip(self.v.chunk(parts, dim), es)]

    def bound(self, u: float, ua: float) -> torch.Tensor:
        """The bound of the stored result: the chain's, then a rounding to the device dtype where it is narrower."""
        return torch.as_tensor(self.e, dtype=torch.float64) + (u if u > ua else 0.0) * self.v.abs()


def _value(x: Any) -> Any:
    return x.v if isinstance(x, Rounded) else x


def _error(x: Any) -> Any:
    return x.e if isinstance(x, Rounded) else 0.0


def _magnitude(x: Any) -> Any:
    return x.abs() if isinstance(x, torch.Tensor) else abs(x)


def _sum_rows(g: Rounded) -> Rounded:
    """g summed over its rows (a bias gradient), in any order."""
    v = g.v.sum(0)
    return Rounded(v, g.e.sum(0) + gamma(g.v.shape[0], g.ua) * g.v.abs().sum(0), g.ua)


def _cat(parts: list[Rounded]) -> Rounded:
    return Rounded(torch.cat([p.v for p in parts], 1),
                   torch.cat([torch.as_tensor(p.e, dtype=torch.float64).expand_as(p.v) for p in parts], 1),
                   parts[0].ua)


def _exact(c: BudgetCall, name: str, parts: int = 1, dim: int = 1) -> Any:
    t = c.a[name]
    if t is None:
        return None
    x = Rounded(t, 0.0, c.ua)
    return x if parts == 1 else x.chunk(parts, dim)


def _lstm(c: BudgetCall) -> list:
    hy, cy, gates = lstm_cell(_exact(c, "input_gates", 4), _exact(c, "hidden_gates", 4), _exact(c, "cx"),
                              _exact(c, "input_bias", 4, 0), _exact(c, "hidden_bias", 4, 0))
    return [hy, cy, _cat(list(gates))]


def _lstm_backward(c: BudgetCall) -> list:
    grad_hy, grad_cy, cy = _exact(c, "grad_hy"), _exact(c, "grad_cy"), _exact(c, "cy")
    if grad_hy is None and grad_cy is None:
        return [None, None, None]
    if grad_hy is None:
        grad_hy = Rounded(torch.zeros_like(cy.v), 0.0, c.ua)
    grads, grad_cx = lstm_cell_backward(grad_hy, grad_cy, _exact(c, "cx"), cy, _exact(c, "workspace", 4))
    grad_gates = _cat(list(grads))
    return [grad_gates, grad_cx, _sum_rows(grad_gates) if c.a["has_bias"] else None]


def _gru(c: BudgetCall) -> list:
    hy, saved = gru_cell(_exact(c, "input_gates", 3), _exact(c, "hidden_gates", 3), _exact(c, "hx"),
                         _exact(c, "input_bias", 3, 0), _exact(c, "hidden_bias", 3, 0))
    return [hy, _cat(list(saved))]


def _gru_backward(c: BudgetCall) -> list:
    grad_input, grad_hidden, grad_hx = gru_cell_backward(_exact(c, "grad_hy"), _exact(c, "workspace", 5))
    grad_input, grad_hidden = _cat(list(grad_input)), _cat(list(grad_hidden))
    bias = c.a["has_bias"]
    return [grad_input, grad_hidden, grad_hx, _sum_rows(grad_input) if bias else None,
            _sum_rows(grad_hidden) if bias else None]


_CELLS = {aten._thnn_fused_lstm_cell.default: _lstm, aten._thnn_fused_lstm_cell_backward_impl.default: _lstm_backward,
          aten._thnn_fused_gru_cell.default: _gru, aten._thnn_fused_gru_cell_backward.default: _gru_backward}


@register_budget(*_CELLS, family=Family.ELEMENTWISE)
def fused_rnn_cell_budget(c: BudgetCall) -> Budget:
    """Each output's error bound carried through the cell's arithmetic (module docstring)."""
    def bounds() -> list:
        return [None if b is None else b.bound(c.u, c.ua) for b in _CELLS[c.func](c)]
    return c.budget(bounds)
