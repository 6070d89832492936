"""Replay rules for fused device kernels that have no float64 CPU kernel and no decomposition.

The CUDA / cuDNN scaled-dot-product-attention kernels (flash, memory-efficient, cuDNN) are replayed
through the attention formula in float64: ``softmax(q k^T * scale + bias) v``, with their backward
written out by hand (``dS = P * (dP - rowsum(dO * O))``). Auxiliary outputs that carry no value
(RNG seeds and offsets, sequence offsets, debug masks, logsumexp padding) are the device's.
With dropout > 0 the kernels draw random numbers inside: their outputs are adopted (Kind.RANDOM).
"""

from __future__ import annotations

import math

import torch

from .replay import Kind, Replay, register_rule

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
