"""Replay rules for fused device kernels that have no float64 CPU kernel and no decomposition.

oneDNN LSTM layers (nn.LSTM on CPU float32/bfloat16) are replayed as the LSTM recurrence, with
backpropagation through time written out.

The CUDA / cuDNN scaled-dot-product-attention kernels (flash, memory-efficient, cuDNN) are replayed
through the attention formula in float64: ``softmax(q k^T * scale + bias) v``, with their backward
written out by hand (``dS = P * (dP - rowsum(dO * O))``). Auxiliary outputs that carry no value
(RNG seeds and offsets, sequence offsets, debug masks, logsumexp padding) are the device's.
With dropout > 0 the kernels draw random numbers inside: their outputs are adopted (Kind.RANDOM).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..records import Kind
from .table import Replay, register_rule

aten = torch.ops.aten


def _ops(*names: str) -> list:
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: repeat k/v heads to q's head count."""
    if t.dim() >= 3 and t.size(-3) != q.size(-3):
        return t.repeat_interleave(q.size(-3) // t.size(-3), dim=-3)
    return t


def _scores(r: Replay, q, k, bias) -> torch.Tensor:
    scale = r.arg("scale")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q @ _expand_kv(q, k).transpose(-2, -1)) * scale
    if r.arg("is_causal", False):
        L, S = s.size(-2), s.size(-1)
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    if bias is not None:
        s = s.masked_fill(~bias, -math.inf) if bias.dtype == torch.bool else s + bias
    return s


def _forward(r: Replay, q, k, v, bias):
    s = _scores(r, q, k, bias)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return p @ _expand_kv(q, v), lse, p, s


def _device_like(x: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor | None:
    """``value`` laid out as the device output x: logsumexp padding and extra dims are the device's."""
    if x is None:
        return None
    out = x.detach().to(device="cpu", dtype=torch.float64 if x.is_floating_point() else x.dtype, copy=True)
    if not x.is_floating_point() or out.numel() == 0:
        return out
    if out.shape == value.shape:
        return value
    if out.dim() == value.dim() and all(a >= b for a, b in zip(out.shape, value.shape)):  # padded (efficient)
        out[tuple(slice(0, n) for n in value.shape)] = value
        return out
    if out.numel() == value.numel():
        return value.reshape(out.shape)
    return out


def _adopt(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu")
    return x


@register_rule(*_ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention"))
def sdpa_forward_rule(r: Replay):
    """Forward: output and logsumexp from the formula; every other output adopted from the device."""
    if r.arg("dropout_p", 0.0):
        return Kind.RANDOM, None
    q, k, v = r.args[0], r.args[1], r.args[2]
    bias = r.arg("attn_bias")
    out, lse, _, _ = _forward(r, q, k, v, bias)
    dev = r.device_out
    return Kind.REPLAYED, (out, _device_like(dev[1], lse)) + tuple(_adopt(x) for x in dev[2:])


@register_rule(*_ops("_scaled_dot_product_flash_attention_backward",
                     "_scaled_dot_product_efficient_attention_backward",
                     "_scaled_dot_product_cudnn_attention_backward"))
def sdpa_backward_rule(r: Replay):
    """Backward by hand: P = softmax(S), dV = P^T dO, dS = P * (dP - rowsum(dO * O)), dQ = dS K s, dK = dS^T Q s."""
    if r.arg("dropout_p", 0.0):
        return Kind.RANDOM, None
    grad_out, q, k, v = r.args[0], r.args[1], r.args[2], r.args[3]
    bias = r.arg("attn_bias")
    out, _, p, _ = _forward(r, q, k, v, bias)
    scale = r.arg("scale")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    ve = _expand_kv(q, v)
    dv = p.transpose(-2, -1) @ grad_out
    dp = grad_out @ ve.transpose(-2, -1)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    dq = (ds @ _expand_kv(q, k)) * scale
    dk = (ds.transpose(-2, -1) @ q) * scale
    if k.size(-3) != q.size(-3):  # GQA: sum the gradients of each group of query heads
        g = q.size(-3) // k.size(-3)
        dk = dk.unflatten(-3, (k.size(-3), g)).sum(-3)
        dv = dv.unflatten(-3, (v.size(-3), g)).sum(-3)
    grads = [dq, dk, dv]
    dev = r.device_out
    if len(dev) > 3:  # efficient / cuDNN: a bias gradient, reduced to the bias' broadcast shape
        db = None
        if dev[3] is not None and bias is not None and bias.dtype != torch.bool:
            db = ds.sum_to_size(bias.shape) if ds.shape != bias.shape else ds
            db = _device_like(dev[3], db)
        grads.append(db if db is not None else _adopt(dev[3]))
    return Kind.REPLAYED, tuple(grads)


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
        return Kind.DECOMPOSED, (out, h.reshape(hx.shape), c.reshape(hx.shape), r.device_out[3].to("cpu", copy=True))

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
        db = torch.zeros(w_hh.shape[0], dtype=x.dtype)
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
