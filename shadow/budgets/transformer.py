"""The budget of nn.TransformerEncoderLayer's fused kernel (``_transformer_encoder_layer_fwd``: its fast path in
eval, on a padded batch or on nested tensors), composed over the layer's decomposition to first order.

The layer (post-norm; ``norm_first`` moves each norm to the start of its block):

    a = MHA(x):  qkv = x Wqkv^T + bqkv;  per head P = softmax(s q k^T + mask), o = P v;  a = o Wo^T + bo
    h = LN1(x + a);  f = act(h W1^T + b1) W2^T + b2;  y = LN2(h + f)

Each stage's own error is its op's budget (``budget_for``: ``addmm``, ``_addmm_activation``, the CPU flash
attention kernel, ``native_layer_norm``; one rounding for a residual add) at the float64 values of its inputs. The
errors a stage's inputs carry reach its output through the absolute value of its Jacobian:

- linear: e |W|^T; activation: its Lipschitz constant (relu 1, gelu 1.13); residual add: the sum;
- attention: logits dS = s (e_q |k|^T + |q| e_k^T); |dP| <= P (dS + rowsum(P dS)); e_o = |dP| |v| + P e_v
  (sum_j dP_ij v_j = sum_j P_ij dS_ij (v_j - o_i), and |o_i| <= sum_j P_ij |v_j|);
- layer norm, y = w xhat + b with xhat = (x - mean) / sigma: |w| / sigma (e + mean(e) + |xhat| mean(|xhat| e)).

Products of two errors (O(u^2)) are dropped: the bound is first order, as a linearized error analysis is. A
nested input is bounded as its padded batch with the padding keys masked, and its output's values
(``shadow.nested.values``) as the rows of its components. The derivation: docs/budgets.md.
"""

from __future__ import annotations

import math

import torch

from ..opsets import Family
from .core import Budget, BudgetCall, budget_for, overloads, register_budget
from .linalg import GELU_LIPSCHITZ

aten = torch.ops.aten

_Stage = tuple[torch.Tensor, torch.Tensor | None]  # a stage's float64 value and the bound of its error (None: 0)


@register_budget(*overloads("_transformer_encoder_layer_fwd"), family=Family.COMPOSED)
def encoder_layer_budget(c: BudgetCall) -> Budget:
    """The layer's output, dense ([B, L, E]) or nested (its values), bounded stage by stage."""
    src = c.a["src"]

    def make():
        if src.is_nested:
            lengths = src._nested_tensor_size()[:, 0]
            x = src.to_padded_tensor(0.0)
            valid = torch.arange(x.shape[1]) < lengths.unsqueeze(1)  # [B, L]: the components' rows
            _, bound = _layer(c, x, ~valid[:, None, None, :])
            return [bound[valid].reshape(-1)]
        _, bound = _layer(c, src, _masked_keys(c, src))
        return [bound]

    return c.budget(make)


def _masked_keys(c: BudgetCall, x: torch.Tensor) -> torch.Tensor | None:
    """The attention mask as the CPU kernel reads it (``_masked_softmax``: any nonzero masks a key), broadcast to
    [B, H, L, L]: a key padding mask [B, L] (``mask_type`` 1), else a mask broadcastable to the scores."""
    mask = c.a.get("mask")
    if mask is None:
        return None
    masked = mask.to(device=x.device, dtype=torch.bool)
    B, L = x.shape[0], x.shape[1]
    if c.a.get("mask_type") == 1 and masked.shape == (B, L):
        masked = masked[:, None, None, :]
    return torch.broadcast_to(masked, (B, c.a["num_heads"], L, L))


def _layer(c: BudgetCall, x: torch.Tensor, masked: torch.Tensor | None) -> _Stage:
    """The layer on the padded batch x [B, L, E] (``masked``: keys each query ignores), with its error bound."""
    a = c.a
    if a["norm_first"]:
        r = _add(c, (x, None), _attention(c, _norm(c, (x, None), 1), masked))
        return _add(c, r, _feed_forward(c, _norm(c, r, 2)))
    h = _norm(c, _add(c, (x, None), _attention(c, (x, None), masked)), 1)
    return _norm(c, _add(c, h, _feed_forward(c, h)), 2)


def _linear(c: BudgetCall, stage: _Stage, w: torch.Tensor, b: torch.Tensor, act: str = "") -> _Stage:
    """x W^T + b, then ``act`` ("relu", "gelu"), on the last dim of x: addmm's or _addmm_activation's budget, and
    the incoming error through |W|^T (and the activation's Lipschitz constant)."""
    x, e = stage
    x2 = x.reshape(-1, x.shape[-1])
    if act:
        gelu = act == "gelu"
        y = torch._addmm_activation(b, x2, w.t(), use_gelu=gelu)
        own = budget_for(aten._addmm_activation.default, (b, x2, w.t()), {"use_gelu": gelu}, [y], c.dtype,
                         scratch=c.scratch)
    else:
        y = torch.addmm(b, x2, w.t())
        own = budget_for(aten.addmm.default, (b, x2, w.t()), {}, [y], c.dtype, scratch=c.scratch)
    bound = torch.broadcast_to(own.bound[0], y.shape)
    if e is not None:
        lipschitz = GELU_LIPSCHITZ if act == "gelu" else 1.0
        bound = bound + lipschitz * (e.reshape(-1, e.shape[-1]) @ w.abs().t())
    return y.view(*x.shape[:-1], -1), bound.view(*x.shape[:-1], -1)


def _attention(c: BudgetCall, stage: _Stage, masked: torch.Tensor | None) -> _Stage:
    """Multi-head self-attention of the layer (in-projection, softmax(s q k^T) v per head, out-projection)."""
    a = c.a
    x = stage[0]
    B, L, E = x.shape
    H = a["num_heads"]
    dh = E // H
    qkv, e_qkv = _linear(c, stage, a["qkv_weight"], a["qkv_bias"])

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, L, 3E] -> q, k, v as [B, H, L, dh]
        return t.view(B, L, 3, H, dh).permute(2, 0, 3, 1, 4)

    q, k, v = heads(qkv)
    s = 1.0 / math.sqrt(dh)
    logits = (q @ k.transpose(-1, -2)) * s
    if masked is not None:
        logits = logits.masked_fill(masked, -math.inf)
    lse = torch.logsumexp(logits, -1)
    seen = torch.isfinite(lse)  # rows with a key left: a row with none is 0 in the kernel and in the replay
    p = torch.where(seen.unsqueeze(-1), torch.exp(logits - lse.unsqueeze(-1)), 0.0)
    o = p @ v
    own = budget_for(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v), {"scale": s}, [o, lse],
                     c.dtype, scratch=c.scratch).bound[0]
    bound = torch.where(seen.unsqueeze(-1), own, 0.0)
    eq, ek, ev = heads(e_qkv)
    ds = (eq @ k.abs().transpose(-1, -2) + q.abs() @ ek.transpose(-1, -2)) * s
    p_ds = p * ds
    dp = p_ds + p * p_ds.sum(-1, keepdim=True)
    bound = bound + dp @ v.abs() + p @ ev

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, H, L, dh] -> [B, L, E]
        return t.permute(0, 2, 1, 3).reshape(B, L, E)

    return _linear(c, (tokens(o), tokens(bound)), a["proj_weight"], a["proj_bias"])


def _add(c: BudgetCall, first: _Stage, second: _Stage) -> _Stage:
    """A residual add: the errors add, and one rounding of the sum."""
    r = first[0] + second[0]
    bound = c.final(r)
    for _, e in (first, second):
        if e is not None:
            bound = bound + e
    return r, bound


def _norm(c: BudgetCall, stage: _Stage, which: int) -> _Stage:
    """Layer norm ``which`` (1 or 2) over the last dim: native_layer_norm's budget, and the incoming error through
    the normalization's Jacobian."""
    x, e = stage
    w, b = c.a[f"norm_weight_{which}"], c.a[f"norm_bias_{which}"]
    shape, eps = [x.shape[-1]], c.a["eps"]
    y, mean, rstd = torch.native_layer_norm(x, shape, w, b, eps)
    own = budget_for(aten.native_layer_norm.default, (x, shape, w, b, eps), {}, [y, mean, rstd], c.dtype,
                     scratch=c.scratch)
    bound = torch.broadcast_to(own.bound[0], y.shape)
    if e is not None:
        xhat = ((x - mean) * rstd).abs()
        spread = e + e.mean(-1, keepdim=True) + xhat * (xhat * e).mean(-1, keepdim=True)
        bound = bound + w.abs() * rstd * spread
    return y, bound


def _feed_forward(c: BudgetCall, stage: _Stage) -> _Stage:
    """act(x W1^T + b1) W2^T + b2."""
    a = c.a
    act = "gelu" if a["use_gelu"] else "relu"
    return _linear(c, _linear(c, stage, a["ffn_weight_1"], a["ffn_bias_1"], act), a["ffn_weight_2"], a["ffn_bias_2"])
