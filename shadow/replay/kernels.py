"""Replay rules for fused device kernels that have no float64 CPU kernel and no decomposition (the attention
kernels are a family of their own: ``attention``).

oneDNN LSTM layers (nn.LSTM on CPU float32/bfloat16) are replayed as the LSTM recurrence, with
backpropagation through time written out.
"""

from __future__ import annotations

from typing import Any

import torch

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

    @register_rule(aten.mkldnn_rnn_layer.default)
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

    @register_rule(aten.mkldnn_rnn_layer_backward.default)
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
