"""Replay rules for device-only fused kernels (CUDA/cuDNN SDPA), tested on the CPU by calling the rules
with float64 inputs and comparing with PyTorch's own CPU attention and autograd."""

import math

import pytest
import torch
import torch.nn.functional as F

from shadow.replay.kernels import sdpa_backward_rule, sdpa_forward_rule
from shadow.records import Kind
from shadow.replay import Replay
from shadow.plan import plan_of

aten = torch.ops.aten
f64 = torch.float64


def _replay(op, args, kwargs, device_out):
    return Replay(plan_of(op), list(args), dict(kwargs), device_out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_efficient_attention_forward_and_backward_match_torch(causal, gqa):
    torch.manual_seed(0)
    B, H, L, S, E = 2, 4, 5, 7, 8
    Hk = 2 if gqa else H
    q = torch.randn(B, H, L, E, dtype=f64, requires_grad=True)
    k = torch.randn(B, Hk, S, E, dtype=f64, requires_grad=True)
    v = torch.randn(B, Hk, S, E, dtype=f64, requires_grad=True)
    bias = torch.randn(B, H, L, S, dtype=f64, requires_grad=True)
    kk, vv = (k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1))
    ref = F.scaled_dot_product_attention(q, kk, vv, attn_mask=None if causal else bias, is_causal=causal, scale=0.3)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, (q, k, v) + (() if causal else (bias,)), g)
    # the device's logsumexp is padded to a multiple of 32 (efficient attention), its seeds are int64
    lse_dev = torch.full((B, H, 32), 7.0)
    seed, offset = torch.tensor(123), torch.tensor(4)
    args = (q.detach(), k.detach(), v.detach(), None if causal else bias.detach(), True)
    kind, out = sdpa_forward_rule(_replay(aten._scaled_dot_product_efficient_attention.default, args,
                                          {"dropout_p": 0.0, "is_causal": causal, "scale": 0.3},
                                          (ref.detach(), lse_dev, seed, offset)))
    assert kind is Kind.REPLAYED
    assert torch.allclose(out[0], ref, rtol=1e-12, atol=1e-13)
    s = (q @ kk.transpose(-2, -1)) * 0.3
    s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf) if causal else s + bias
    assert torch.allclose(out[1][..., :L], torch.logsumexp(s, -1), rtol=1e-13)
    assert (out[1][..., L:] == 7.0).all() and out[2] is not seed and out[2].item() == 123  # padding, seeds: device's
    bargs = (g, q.detach(), k.detach(), v.detach(), None if causal else bias.detach(), ref.detach(), out[1], seed,
             offset, 0.0, [True, True, True, not causal])
    dev_grads = (q, k, v, None if causal else bias)
    kind, got = sdpa_backward_rule(_replay(aten._scaled_dot_product_efficient_attention_backward.default, bargs,
                                           {"is_causal": causal, "scale": 0.3}, dev_grads))
    for a, b in zip(got, grads):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)


def test_flash_attention_with_dropout_is_adopted_not_replayed():
    q = torch.randn(1, 1, 4, 8, dtype=f64)
    r = _replay(aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.1), {}, None)
    assert sdpa_forward_rule(r) == (Kind.RANDOM, None)
