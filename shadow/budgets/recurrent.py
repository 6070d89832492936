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
from ..replay.recurrent import (gru_cell, gru_cell_backward, lstm_cell, lstm_cell_backward, lstm_layer,
                               lstm_layer_backward, mkldnn_lstm_inputs)
from .core import Budget, BudgetCall, register_budget
from .rounded import Rounded, cat, exact, linear, stack

aten = torch.ops.aten


def _exact(c: BudgetCall, name: str, parts: int = 1, dim: int = 1) -> Any:
    t = c.a[name]
    if t is None:
        return None
    x = exact(t, c.ua)
    return x if parts == 1 else x.chunk(parts, dim)


def _lstm(c: BudgetCall) -> list:
    hy, cy, gates = lstm_cell(_exact(c, "input_gates", 4), _exact(c, "hidden_gates", 4), _exact(c, "cx"),
                              _exact(c, "input_bias", 4, 0), _exact(c, "hidden_bias", 4, 0))
    return [hy, cy, cat(list(gates), 1)]


def _lstm_backward(c: BudgetCall) -> list:
    grad_hy, grad_cy, cy = _exact(c, "grad_hy"), _exact(c, "grad_cy"), _exact(c, "cy")
    if grad_hy is None and grad_cy is None:
        return [None, None, None]
    if grad_hy is None:
        grad_hy = Rounded(torch.zeros_like(cy.v), 0.0, c.ua)
    grads, grad_cx = lstm_cell_backward(grad_hy, grad_cy, _exact(c, "cx"), cy, _exact(c, "workspace", 4))
    grad_gates = cat(list(grads), 1)
    return [grad_gates, grad_cx, grad_gates.sum(0) if c.a["has_bias"] else None]


def _gru(c: BudgetCall) -> list:
    hy, saved = gru_cell(_exact(c, "input_gates", 3), _exact(c, "hidden_gates", 3), _exact(c, "hx"),
                         _exact(c, "input_bias", 3, 0), _exact(c, "hidden_bias", 3, 0))
    return [hy, cat(list(saved), 1)]


def _gru_backward(c: BudgetCall) -> list:
    grad_input, grad_hidden, grad_hx = gru_cell_backward(_exact(c, "grad_hy"), _exact(c, "workspace", 5))
    grad_input, grad_hidden = cat(list(grad_input), 1), cat(list(grad_hidden), 1)
    bias = c.a["has_bias"]
    return [grad_input, grad_hidden, grad_hx, grad_input.sum(0) if bias else None,
            grad_hidden.sum(0) if bias else None]


_CELLS = {aten._thnn_fused_lstm_cell.default: _lstm, aten._thnn_fused_lstm_cell_backward_impl.default: _lstm_backward,
          aten._thnn_fused_gru_cell.default: _gru, aten._thnn_fused_gru_cell_backward.default: _gru_backward}


# --- oneDNN LSTM layers (nn.LSTM on the CPU): the cell's bound composed over the time steps ---
def _layer(c: BudgetCall) -> tuple | None:
    """The layer's forward on ``Rounded`` values from the call's inputs: (outputs by step, h, c, saved), or None
    for the modes the replay does not know (their budget stays the default)."""
    schema = c.func._schema.arguments
    inputs = mkldnn_lstm_inputs([c.a[arg.name] for arg in schema[:7]], c.a.get)
    if inputs is None:
        return None
    x, w_ih, w_hh, b_ih, b_hh, hx, cx = inputs
    # oneDNN takes one bias per gate: PyTorch adds b_ih + b_hh in the inputs' dtype first (one rounding, which
    # reads as a large relative error where a gate's pre-activation cancels to near zero: measured on torch 2.4.1's
    # bfloat16 layer, whose output there matched the float64 layer with only that sum rounded)
    bias = None if b_ih is None else (exact(b_ih, c.ua) + b_hh).stored(_kept(c))
    return lstm_layer(exact(x, c.ua), w_ih, w_hh, bias, None, exact(hx, c.ua), exact(cx, c.ua), c.a["reverse"],
                      linear=linear, keep=lambda v: v.stored(_kept(c)))


def _kept(c: BudgetCall) -> float:
    """The unit roundoff of what the layer keeps between steps (h, c, the gates and their gradients): the inputs'
    dtype's (oneDNN's bfloat16 backward keeps them in bfloat16 and returns float32 gradients)."""
    return c.u if c.u_inputs is None else max(c.u, c.u_inputs)


def _mkldnn_lstm(c: BudgetCall) -> list | None:
    layer = _layer(c)
    if layer is None:
        return None
    outs, h, cy, _ = layer
    shape = c.a["hx_"].shape
    return [stack(outs), h.reshape(shape), cy.reshape(shape), None]  # the workspace: oneDNN's bytes, kept


def _mkldnn_lstm_backward(c: BudgetCall) -> list | None:
    layer = _layer(c)
    if layer is None:
        return None
    x, w_ih, w_hh = c.a["input"], c.a["weight1"], c.a["weight2"]
    shape = c.a["hx_"].shape
    ghy, gcy = c.a["grad_hy"], c.a["grad_cy"]
    zero = torch.zeros(x.shape[1], w_hh.shape[1], dtype=torch.float64)
    dh = exact(zero if ghy is None else ghy.reshape(zero.shape), c.ua)
    dc = exact(zero if gcy is None else gcy.reshape(zero.shape), c.ua)
    dx, dw_ih, dw_hh, db, dh, dc = lstm_layer_backward(
        exact(x, c.ua), w_ih, w_hh, layer[3], exact(c.a["grad_output"], c.ua), dh, dc, cat=cat, stack=stack,
        keep=lambda v: v.stored(_kept(c)))
    return [dx, dw_ih, dw_hh, db, db, dh.reshape(shape), dc.reshape(shape)]


if hasattr(aten, "mkldnn_rnn_layer"):
    _CELLS |= {aten.mkldnn_rnn_layer.default: _mkldnn_lstm,
               aten.mkldnn_rnn_layer_backward.default: _mkldnn_lstm_backward}


@register_budget(*_CELLS, family=Family.ELEMENTWISE)
def fused_rnn_cell_budget(c: BudgetCall) -> Budget:
    """Each output's error bound carried through the cell's or the layer's arithmetic (module docstring)."""
    chains = _CELLS[c.func](c)
    if chains is None:
        return NotImplemented
    return c.budget(lambda: [None if b is None else b.bound(c.u, c.ua) for b in chains])
