"""Replay rules for the fused scaled-dot-product-attention kernels that have no float64 CPU kernel.

The CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, what
``F.scaled_dot_product_attention`` runs on the CPU in every dtype, grouped-query attention included) has
float64 CPU kernels: the default rule replays it with them. The math path is composite (its matmuls and
softmax are replayed one by one). The device-only kernels are replayed here through the attention formula
in float64: ``softmax(q k^T * scale + bias) v``, with their backward written out by hand
(``dS = P * (dP - rowsum(dO * O))``):

- CUDA flash, memory-efficient, cuDNN, and the PrivateUse1 backends' overrideable kernel: output and
  logsumexp; auxiliary outputs that carry no value (RNG seeds and offsets, sequence offsets, debug masks,
  logsumexp padding) are the device's;
- MPS's math kernel: output and the attention weights.

Grouped-query attention (``enable_gqa``: key/value with fewer heads than the query) repeats each key/value
head over its group of query heads (:func:`expand_kv`); the gradients of a key/value head sum over its group.
With dropout > 0 the kernels draw random numbers inside: their outputs are adopted (Kind.RANDOM).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..opsets import Family
from ..records import Kind
from .table import Replay, register_rule

aten = torch.ops.aten


def _ops(*names: str) -> list:
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


def expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: t (keys, values, or per-head figures of them: heads at dim -3) with each head
    repeated over its group of query heads, so that it has q's head count (t itself when it has)."""
    if t.dim() >= 3 and t.size(-3) != q.size(-3):
        return t.repeat_interleave(q.size(-3) // t.size(-3), dim=-3)
    return t


def sum_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention, backward: t (per query head, heads at dim -3) summed over each group of query
    heads that shares a key/value head, down to ``heads`` heads (t itself when it has that many)."""
    if t.size(-3) != heads:
        return t.unflatten(-3, (heads, t.size(-3) // heads)).sum(-3)
    return t


def attention_scale(q: torch.Tensor, scale: float | None) -> float:
    """The logits' scale: ``scale`` if given, else 1 / sqrt(E)."""
    return 1.0 / math.sqrt(q.size(-1)) if scale is None else scale


@dataclasses.dataclass(slots=True)
class _Attention:
    """The float64 forward of one call: logits S, probabilities P = softmax(S), output O = P V, logsumexp."""

    scale: float
    p: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def _forward(r: Replay, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> _Attention:
    scale = attention_scale(q, r.arg("scale"))
    s = (q @ expand_kv(q, k).transpose(-2, -1)) * scale
    if r.arg("is_causal", False):  # top-left aligned, as F.scaled_dot_product_attention documents
        L, S = s.size(-2), s.size(-1)
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), -math.inf)
    if bias is not None:
        s = s.masked_fill(~bias, -math.inf) if bias.dtype == torch.bool else s + bias
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return _Attention(scale, p, p @ expand_kv(q, v), lse)


def _device_like(x: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor | None:
    """``value`` laid out as the device output x: logsumexp padding and extra dims are the device's."""
    if x is None:
        return None
    out = x.detach().to(device=value.device, dtype=torch.float64 if x.is_floating_point() else x.dtype, copy=True)
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


def _adopt(x: Any, like: torch.Tensor) -> Any:
    """A device output taken as it is, where the shadow ``like`` lives."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(like.device)
    return x


def _draws_random(r: Replay) -> bool:
    return r.arg("dropout_p", 0.0) not in (0, 0.0, None)


@register_rule(*_ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable"),
               family=Family.ATTENTION)
def sdpa_forward_rule(r: Replay) -> Any:
    """Output and logsumexp from the formula; every other output adopted from the device."""
    if _draws_random(r):
        return Kind.RANDOM, None
    a = _forward(r, r.arg("query"), r.arg("key"), r.arg("value"), r.arg("attn_bias"))
    dev = r.device_out
    return Kind.REPLAYED, (a.out, _device_like(dev[1], a.lse)) + tuple(_adopt(x, a.out) for x in dev[2:])


@register_rule(*_ops("_scaled_dot_product_attention_math_for_mps"), family=Family.ATTENTION)
def sdpa_math_rule(r: Replay) -> Any:
    """(output, attention weights P) from the formula."""
    if _draws_random(r):
        return Kind.RANDOM, None
    a = _forward(r, r.arg("query"), r.arg("key"), r.arg("value"), r.arg("attn_mask"))
    return Kind.REPLAYED, (a.out, a.p)


@register_rule(*_ops("_scaled_dot_product_flash_attention_backward",
                     "_scaled_dot_product_efficient_attention_backward",
                     "_scaled_dot_product_cudnn_attention_backward",
                     "_scaled_dot_product_fused_attention_overrideable_backward"), family=Family.ATTENTION)
def sdpa_backward_rule(r: Replay) -> Any:
    """Backward by hand: P = softmax(S), dV = P^T dO, dS = P * (dP - rowsum(dO * O)), dQ = dS K s, dK = dS^T Q s."""
    if _draws_random(r):
        return Kind.RANDOM, None
    grad_out, q, k, v = r.args[:4]  # grad_out is "grad_out_" in efficient attention's schema
    bias = r.arg("attn_bias")
    a = _forward(r, q, k, v, bias)
    dv = a.p.transpose(-2, -1) @ grad_out  # per query head (GQA: summed over each group below)
    dp = grad_out @ expand_kv(q, v).transpose(-2, -1)
    ds = a.p * (dp - (grad_out * a.out).sum(-1, keepdim=True))
    dq = (ds @ expand_kv(q, k)) * a.scale
    dk = (ds.transpose(-2, -1) @ q) * a.scale
    grads = [dq, sum_groups(dk, k.size(-3)), sum_groups(dv, v.size(-3))]
    dev = r.device_out
    if len(dev) > 3:  # efficient / overrideable: a bias gradient, reduced to the bias' broadcast shape
        db = None
        if dev[3] is not None and bias is not None and bias.dtype != torch.bool:
            db = _device_like(dev[3], ds.sum_to_size(bias.shape))
        grads.append(db if db is not None else _adopt(dev[3], dq))
    return Kind.REPLAYED, tuple(grads)
