"""Replay rules for the recurrent family's fused kernels, which have no float64 CPU kernel and no decomposition.

oneDNN LSTM layers (nn.LSTM on CPU float32/bfloat16) are replayed as the LSTM recurrence, with
backpropagation through time written out; the fused LSTM and GRU cells of GPUs and PrivateUse1 devices
(``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backward) as the cells' arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

from ..opsets import Family
from ..records import Kind
from .table import Replay, register_rule

aten = torch.ops.aten
F = torch.nn.functional


# --- oneDNN LSTM layers: nn.LSTM on CPU float32/bfloat16 runs mkldnn_rnn_layer(_backward), which has no float64
# kernel and no decomposition; replayed as the LSTM math of nn.LSTM's native path (what float64 runs) ---
_MKLDNN_LSTM_MODE = 2  # mkldnn_rnn_layer's `mode`: 0 RNN_RELU, 1 RNN_TANH, 2 LSTM, 3 GRU


def lstm_layer(x, w_ih, w_hh, b_ih, b_hh, h, c, reverse, linear=F.linear, keep=lambda v: v):
    """One LSTM layer over (T, B, I) input, as ``lstm_cell`` steps: (the outputs by step, h, c, per step what the
    backward reads). Written once on numbers: ``linear`` is F.linear's x @ w.T + b, ``keep`` the value the kernel
    keeps between steps (the budget's ``shadow.budgets.recurrent`` runs it on values carrying an error bound)."""
    xw = keep(linear(x, w_ih, b_ih))
    outs: list = [None] * x.shape[0]
    saved = []
    for t in (range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])):
        hy, cy, gates = lstm_cell(xw[t].chunk(4, 1), keep(linear(h, w_hh, b_hh)).chunk(4, 1), c, keep=keep)
        saved.append((t, gates, c, h, cy))
        h, c = keep(hy), keep(cy)
        outs[t] = h
    return outs, h, c, saved


def lstm_layer_backward(x, w_ih, w_hh, saved, grad_output, dh, dc, cat=torch.cat, stack=torch.stack,
                        keep=lambda v: v):
    """Backpropagation through time of ``lstm_layer`` (its ``saved``), from the gradients of its outputs and of
    its last h and c (``dh``, ``dc``): (dx, dw_ih, dw_hh, db, dh, dc); written once on numbers as ``lstm_layer``."""
    dgates: list = [None] * len(saved)
    h_prev: list = [None] * len(saved)
    for t, gates, c_prev, h, cy in reversed(saved):
        if grad_output is not None:
            dh = dh + grad_output[t]
        parts, dc = lstm_cell_backward(dh, dc, c_prev, cy, gates)
        dgates[t], h_prev[t] = keep(cat(list(parts), 1)), h  # the gates' gradients, as the weights' products read them
        dh, dc = keep(dgates[t] @ w_hh), keep(dc)
    g = stack(dgates)  # (T, B, 4H)
    rows = g.reshape(-1, g.shape[-1]).T
    return (g @ w_ih, rows @ x.reshape(-1, x.shape[-1]), rows @ stack(h_prev).reshape(-1, w_hh.shape[1]),
            rows.T.sum(0), dh, dc)


def mkldnn_lstm_inputs(args: Sequence, arg: Callable[[str], Any]) -> tuple | None:
    """(x, w_ih, w_hh, b_ih, b_hh, hx, cx) of an ``mkldnn_rnn_layer(_backward)`` call, from its arguments by position
    and by name (``arg``), h and c as (B, H); None for the modes and layouts not replayed here."""
    x, w_ih, w_hh, b_ih, b_hh, hx, cx = args[:7]
    if arg("mode") != _MKLDNN_LSTM_MODE or arg("batch_sizes") or x.dim() != 3:
        return None  # GRU/RNN modes and packed sequences: not replayed here
    if not arg("has_biases"):  # the kernel is passed the weights again in the bias slots
        b_ih = b_hh = None
    # the kernel reads (T, B, I) input whatever batch_first says (nn.LSTM transposes before calling it)
    return x, w_ih, w_hh, b_ih, b_hh, hx.reshape(x.shape[1], -1), cx.reshape(x.shape[1], -1)


if hasattr(aten, "mkldnn_rnn_layer"):

    @register_rule(aten.mkldnn_rnn_layer.default, family=Family.RECURRENT)
    def mkldnn_lstm_layer_rule(r: Replay) -> Any:
        """(output, hy, cy, workspace): the LSTM recurrence; the workspace is oneDNN's opaque bytes, kept."""
        a = mkldnn_lstm_inputs(r.args, r.arg)
        if a is None:
            return NotImplemented
        hx = r.arg("hx_")
        outs, h, c, _ = lstm_layer(*a, r.arg("reverse"))
        workspace = r.device_out[3]  # None without autograd (eval, no_grad): oneDNN keeps no workspace then
        return Kind.DECOMPOSED, (torch.stack(outs), h.reshape(hx.shape), c.reshape(hx.shape),
                                 None if workspace is None else workspace.to(h.device, copy=True))

    @register_rule(aten.mkldnn_rnn_layer_backward.default, family=Family.RECURRENT)
    def mkldnn_lstm_layer_backward_rule(r: Replay) -> Any:
        """(dx, dw_ih, dw_hh, db_ih, db_hh, dhx, dcx): backpropagation through time of the recomputed forward."""
        a = mkldnn_lstm_inputs(r.args, r.arg)
        if a is None:
            return NotImplemented
        x, w_ih, w_hh, _, _, hx, _ = a
        _, _, _, saved = lstm_layer(*a, r.arg("reverse"))
        ghy, gcy = r.arg("grad_hy"), r.arg("grad_cy")
        dh = torch.zeros_like(hx) if ghy is None else ghy.reshape(hx.shape)
        dc = torch.zeros_like(hx) if gcy is None else gcy.reshape(hx.shape)
        dx, dw_ih, dw_hh, db, dh, dc = lstm_layer_backward(x, w_ih, w_hh, saved, r.arg("grad_output"), dh, dc)
        shape = r.arg("hx_").shape
        return Kind.DECOMPOSED, (dx, dw_ih, dw_hh, db, db.clone(), dh.reshape(shape), dc.reshape(shape))


# --- the fused RNN cells aten's LSTM and GRU call on CUDA, XPU and PrivateUse1 devices (DirectML): aten's CPU has no
# kernel for them and there is no decomposition. Their arithmetic, as CUDA's kernels order it
# (aten/src/ATen/native/cuda/RNN.cu), written once on numbers with +, -, * and .sigmoid()/.tanh(): the rules below
# run it on float64 shadows, the cells' budget (shadow.budgets.recurrent) on values carrying an error bound.
# Gates come chunked: LSTM (input, forget, cell, output), GRU (reset, update, new).
def lstm_cell(igates, hgates, cx, b_ih=None, b_hh=None, keep=lambda v: v):
    """(hy, cy, (i, f, g, o)) of one LSTM step from its gate pre-activations (biases not yet added); ``keep``: the
    gates as a kernel keeps them (oneDNN's workspace holds them in the device dtype)."""
    z = [a + b for a, b in zip(igates, hgates)]
    if b_ih is not None:
        z = [zk + bi + bh for zk, bi, bh in zip(z, b_ih, b_hh)]
    i, f, g, o = keep(z[0].sigmoid()), keep(z[1].sigmoid()), keep(z[2].tanh()), keep(z[3].sigmoid())
    cy = f * cx + i * g
    return o * cy.tanh(), cy, (i, f, g, o)


def lstm_cell_backward(grad_hy, grad_cy, cx, cy, gates):
    """((grad of each gate's pre-activation), grad_cx) of ``lstm_cell``; ``gates``: its (i, f, g, o); a missing
    gradient (None) counts as zero."""
    i, f, g, o = gates
    t = cy.tanh()
    gcx = grad_hy * o * (1 - t * t)
    if grad_cy is not None:
        gcx = gcx + grad_cy
    return (gcx * g * (1 - i) * i, gcx * cx * (1 - f) * f, gcx * i * (1 - g * g), grad_hy * t * (1 - o) * o), gcx * f


def gru_cell(igates, hgates, hx, b_ih=None, b_hh=None):
    """(hy, (r, z, n, hx, hn)) of one GRU step; hn is the hidden side of the new gate, its bias added."""
    if b_ih is None:
        r, z = (igates[0] + hgates[0]).sigmoid(), (igates[1] + hgates[1]).sigmoid()
        hn, xn = hgates[2], igates[2]
    else:
        r = (igates[0] + hgates[0] + b_ih[0] + b_hh[0]).sigmoid()
        z = (igates[1] + hgates[1] + b_ih[1] + b_hh[1]).sigmoid()
        hn, xn = hgates[2] + b_hh[2], igates[2] + b_ih[2]
    n = (xn + r * hn).tanh()
    return n + z * (hx - n), (r, z, n, hx, hn)


def gru_cell_backward(grad_hy, saved):
    """(grads of the input gates, grads of the hidden gates, grad_hx) of ``gru_cell``; ``saved``: its workspace."""
    r, z, n, hx, hn = saved
    gz = grad_hy * (hx - n) * (1 - z) * z
    gn = grad_hy * (1 - z) * (1 - n * n)
    gr = gn * hn * (1 - r) * r
    return (gr, gz, gn), (gr, gz, gn * r), grad_hy * z


def cell_inputs(r: Replay, parts: int) -> tuple:
    """A fused cell's (input gates, hidden gates, state, input bias, hidden bias), gates and biases chunked."""
    ig, hg, state = r.args[:3]
    b_ih, b_hh = r.arg("input_bias"), r.arg("hidden_bias")
    biases = (None, None) if b_ih is None else (b_ih.chunk(parts, 0), b_hh.chunk(parts, 0))
    return (ig.chunk(parts, 1), hg.chunk(parts, 1), state, *biases)


@register_rule(aten._thnn_fused_lstm_cell.default, family=Family.RECURRENT)
def fused_lstm_cell_rule(r: Replay) -> Any:
    """(hy, cy, workspace): the workspace holds the activated gates."""
    hy, cy, gates = lstm_cell(*cell_inputs(r, 4))
    return Kind.DECOMPOSED, (hy, cy, torch.cat(gates, 1))


@register_rule(aten._thnn_fused_lstm_cell_backward_impl.default, family=Family.RECURRENT)
def fused_lstm_cell_backward_rule(r: Replay) -> Any:
    """(grad_gates, grad_cx, grad_bias); nothing when neither gradient is given."""
    grad_hy, grad_cy = r.arg("grad_hy"), r.arg("grad_cy")
    if grad_hy is None and grad_cy is None:
        return Kind.DECOMPOSED, (None, None, None)
    cx, cy = r.arg("cx"), r.arg("cy")
    grad_gates, grad_cx = lstm_cell_backward(torch.zeros_like(cy) if grad_hy is None else grad_hy, grad_cy, cx, cy,
                                             r.arg("workspace").chunk(4, 1))
    grad_gates = torch.cat(grad_gates, 1)
    return Kind.DECOMPOSED, (grad_gates, grad_cx, grad_gates.sum(0) if r.arg("has_bias") else None)


@register_rule(aten._thnn_fused_gru_cell.default, family=Family.RECURRENT)
def fused_gru_cell_rule(r: Replay) -> Any:
    """(hy, workspace): the workspace holds r, z, n, hx and the new gate's hidden side."""
    hy, saved = gru_cell(*cell_inputs(r, 3))
    return Kind.DECOMPOSED, (hy, torch.cat(saved, 1))


@register_rule(aten._thnn_fused_gru_cell_backward.default, family=Family.RECURRENT)
def fused_gru_cell_backward_rule(r: Replay) -> Any:
    """(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)."""
    grad_input, grad_hidden, grad_hx = gru_cell_backward(r.arg("grad_hy"), r.arg("workspace").chunk(5, 1))
    grad_input, grad_hidden = torch.cat(grad_input, 1), torch.cat(grad_hidden, 1)
    bias = r.arg("has_bias")
    return Kind.DECOMPOSED, (grad_input, grad_hidden, grad_hx, grad_input.sum(0) if bias else None,
                             grad_hidden.sum(0) if bias else None)
