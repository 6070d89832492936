"""Replay rules for the recurrent family's fused kernels, which have no float64 CPU kernel and no decomposition.

oneDNN LSTM layers (nn.LSTM on CPU float32/bfloat16) are replayed as the LSTM recurrence, with
backpropagation through time written out; the fused LSTM and GRU cells of GPUs and PrivateUse1 devices
(``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backward) as the cells' arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch

from ..opsets import Family
from ..records import Kind
from .table import Replay, register_rule

aten = torch.ops.aten


# --- oneDNN LSTM layers: nn.LSTM on CPU float32/bfloat16 runs mkldnn_rnn_layer(_backward), which has no float64
# kernel and no decomposition; replayed as the LSTM math of nn.LSTM's native path (what float64 runs) ---
_MKLDNN_LSTM_MODE = 2  # mkldnn_rnn_layer's `mode`: 0 RNN_RELU, 1 RNN_TANH, 2 LSTM, 3 GRU


def _lstm_steps(x, w_ih, w_hh, b_ih, b_hh, h, c, reverse):
    """One LSTM layer over (T, B, I) input; returns (output, h, c, per-step saved values for the backward)."""
    xw = x @ w_ih.T if b_ih is None else torch.addmm(b_ih, x.reshape(-1, x.shape[-1]), w_ih.T).view(*x.shape[:2], -1)
    outs: list = [None] * x.shape[0]
    saved = []
    for t in (range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])):
        gates = (h @ w_hh.T if b_hh is None else torch.addmm(b_hh, h, w_hh.T)) + xw[t]
        i, f, g, o = gates.chunk(4, 1)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c_prev, h_prev = c, h
        c = f * c + i * g
        tc = c.tanh()
        h = o * tc
        outs[t] = h
        saved.append((t, i, f, g, o, c_prev, tc, h_prev))
    return torch.stack(outs), h, c, saved


def _mkldnn_lstm_args(r: Replay):
    x, w_ih, w_hh, b_ih, b_hh, hx, cx = r.args[:7]
    if r.arg("mode") != _MKLDNN_LSTM_MODE or r.arg("batch_sizes") or x.dim() != 3:
        return None  # GRU/RNN modes and packed sequences: not replayed here
    if not r.arg("has_biases"):  # the kernel is passed the weights again in the bias slots
        b_ih = b_hh = None
    # the kernel reads (T, B, I) input whatever batch_first says (nn.LSTM transposes before calling it)
    return x, w_ih, w_hh, b_ih, b_hh, hx.reshape(x.shape[1], -1), cx.reshape(x.shape[1], -1)


if hasattr(aten, "mkldnn_rnn_layer"):

    @register_rule(aten.mkldnn_rnn_layer.default, family=Family.RECURRENT)
    def mkldnn_lstm_layer_rule(r: Replay) -> Any:
        """(output, hy, cy, workspace): the LSTM recurrence; the workspace is oneDNN's opaque bytes, kept."""
        a = _mkldnn_lstm_args(r)
        if a is None:
            return NotImplemented
        hx = r.arg("hx_")
        out, h, c, _ = _lstm_steps(*a, r.arg("reverse"))
        workspace = r.device_out[3]  # None without autograd (eval, no_grad): oneDNN keeps no workspace then
        return Kind.DECOMPOSED, (out, h.reshape(hx.shape), c.reshape(hx.shape),
                                 None if workspace is None else workspace.to(out.device, copy=True))

    @register_rule(aten.mkldnn_rnn_layer_backward.default, family=Family.RECURRENT)
    def mkldnn_lstm_layer_backward_rule(r: Replay) -> Any:
        """(dx, dw_ih, dw_hh, db_ih, db_hh, dhx, dcx): backpropagation through time of the recomputed forward."""
        a = _mkldnn_lstm_args(r)
        if a is None:
            return NotImplemented
        x, w_ih, w_hh, _, _, hx, _ = a
        _, _, _, saved = _lstm_steps(*a, r.arg("reverse"))
        gout, ghy, gcy = r.arg("grad_output"), r.arg("grad_hy"), r.arg("grad_cy")
        dh = torch.zeros_like(hx) if ghy is None else ghy.reshape(hx.shape).clone()
        dc = torch.zeros_like(hx) if gcy is None else gcy.reshape(hx.shape).clone()
        dx = torch.zeros_like(x)
        dw_ih, dw_hh = torch.zeros_like(w_ih), torch.zeros_like(w_hh)
        db = torch.zeros(w_hh.shape[0], dtype=x.dtype, device=x.device)
        for t, i, f, g, o, c_prev, tc, h_prev in reversed(saved):
            if gout is not None:
                dh = dh + gout[t]
            dc = dc + dh * o * (1 - tc * tc)
            dgates = torch.cat([dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g),
                                dh * tc * o * (1 - o)], 1)
            dc = dc * f
            dx[t] = dgates @ w_ih
            dw_ih += dgates.T @ x[t]
            dw_hh += dgates.T @ h_prev
            db += dgates.sum(0)
            dh = dgates @ w_hh
        shape = r.arg("hx_").shape
        return Kind.DECOMPOSED, (dx, dw_ih, dw_hh, db, db.clone(), dh.reshape(shape), dc.reshape(shape))


# --- the fused RNN cells aten's LSTM and GRU call on CUDA, XPU and PrivateUse1 devices (DirectML): aten's CPU has no
# kernel for them and there is no decomposition. Their arithmetic, as CUDA's kernels order it
# (aten/src/ATen/native/cuda/RNN.cu), written once on numbers with +, -, * and .sigmoid()/.tanh(): the rules below
# run it on float64 shadows, the cells' budget (shadow.budgets.recurrent) on values carrying an error bound.
# Gates come chunked: LSTM (input, forget, cell, output), GRU (reset, update, new).
def lstm_cell(igates, hgates, cx, b_ih=None, b_hh=None):
    """(hy, cy, (i, f, g, o)) of one LSTM step from its gate pre-activations (biases not yet added)."""
    z = [a + b for a, b in zip(igates, hgates)]
    if b_ih is not None:
        z = [zk + bi + bh for zk, bi, bh in zip(z, b_ih, b_hh)]
    i, f, g, o = z[0].sigmoid(), z[1].sigmoid(), z[2].tanh(), z[3].sigmoid()
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
