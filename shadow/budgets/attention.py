"""Attention budgets: the fused scaled-dot-product kernels (the CPU flash kernel and its backward; the math
path dispatches matmuls and softmax, bounded by their own rules). Norms and maxima of q, k, v only: no
L x S matrix is formed. Grouped-query attention (key/value with fewer heads than the query): each key/value
head's figures are repeated over its group of query heads, and the gradients of a key/value head, sums over
the group's queries, get the sum of the group's bounds.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..opsets import Family
from ..replay.attention import attention_scale, expand_kv, sum_groups
from .core import Budget, BudgetCall, is_float, overloads, register_budget
from .units import EXP_ULPS, gamma


@dataclasses.dataclass(slots=True)
class _Operands:
    """q, k, v by name, k and v repeated to q's heads; E the head dim, S the key count, qn_i = ||q_i||
    ([..., L]) and kmax = max_j ||k_j|| ([..., 1]) per query head."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    E: int
    S: int
    scale: float
    qn: torch.Tensor
    kmax: torch.Tensor


def _operands(c: BudgetCall) -> _Operands:
    q = c.a["query"]
    k, v = expand_kv(q, c.a["key"]), expand_kv(q, c.a["value"])
    return _Operands(q, k, v, q.shape[-1], k.shape[-2], attention_scale(q, c.a.get("scale")),
                     torch.linalg.vector_norm(q, dim=-1), torch.linalg.vector_norm(k, dim=-1).amax(-1, keepdim=True))


def _random(c: BudgetCall) -> bool:
    return c.a.get("dropout_p", 0.0) not in (0, 0.0, None)


@register_budget(*overloads("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"),
                 family=Family.ATTENTION)
def attention_budget(c: BudgetCall) -> Budget:
    """out_i = sum_j P_ij v_j, P = softmax(s q k^T + mask). Logit i,j is off by eps_i = gamma_{E+2}(ua) s
    ||q_i|| max_j ||k_j|| (Cauchy-Schwarz) + ua |m_i| (rounding at the row max m_i, |m_i| <= |lse_i| + log S);
    P_ij by P_ij (2 eps_i + ua (lse_i - x_ij) + c ua + gamma_S(ua)) (online-softmax rescalings included);
    with sum_j P_ij (lse_i - x_ij) <= log S (entropy) and sum_j P_ij |v_jd| <= max_j |v_jd|:
        |d out_id| <= max_j |v_jd| * (2 eps_i + 2 ua log S + c ua + 2 gamma_S(ua)) + rounding of out;
        |d lse_i|  <= eps_i + ua (log S + c) + gamma_S(ua) + ua |lse_i|.
    O(L E + S E) work: norms and maxima, no L x S matrix. Outside the gamma terms (accumulations, at ua)
    the roundings are at the device's u: the bf16 CPU kernel rounds the logits and P to bf16 for its GEMMs.
    The logsumexp output of memory-efficient attention is padded to a multiple of 32 queries: the padding
    (the device's, adopted by the replay) gets a bound of 0."""
    if _random(c):
        return NotImplemented  # random: not replayed, nothing to bound
    o = _operands(c)
    out = c.out(0)
    lse_out = c.outputs[1] if len(c.outputs) > 1 and is_float(c.outputs[1]) and c.outputs[1].numel() else None
    padded = lse_out is not None and lse_out.numel() != o.qn.numel()
    lse = lse_out[..., :o.qn.shape[-1]] if padded else lse_out

    def make():
        log_s = math.log(max(o.S, 1))
        eps = gamma(o.E + 2, c.ua) * o.scale * o.qn * o.kmax  # [..., L]
        if lse is not None:
            eps = eps + c.u * (lse.abs() + log_s).reshape(eps.shape)
        const = 2 * c.u * log_s + (2 * EXP_ULPS + 4) * c.u + 2 * gamma(o.S, c.ua)
        vmax = o.v.abs().amax(-2, keepdim=True)  # [..., 1, Ev]
        bounds = [vmax * (2 * eps + const).unsqueeze(-1) + c.u * out.abs() + c.final(out)]
        if lse is not None:
            b_lse = (eps + c.u * (log_s + 2 * EXP_ULPS) + gamma(o.S, c.ua)).reshape(lse.shape)
            b_lse = b_lse + 2 * c.u * lse.abs() + c.final(lse)
            if padded:
                full = torch.zeros_like(lse_out)
                full[..., :lse.shape[-1]] = b_lse
                b_lse = full
            bounds.append(b_lse)
        bounds.extend(None for _ in c.outputs[len(bounds):])
        return bounds

    return c.budget(make)


@register_budget(*overloads("_scaled_dot_product_flash_attention_for_cpu_backward"), family=Family.ATTENTION)
def attention_backward_budget(c: BudgetCall) -> Budget:
    """dV = P^T dO, dS = P o (dO V^T - D), D_i = dO_i . O_i, dQ = s dS K, dK = s dS^T Q, P recomputed from
    the given lse with relative error eta_ij <= eps_i + ua (lse_i - x_ij) + c ua. With R_i = ||dO_i|| max_j
    ||v_j|| + sum_d |dO_id O_id| (>= |dP_ij| + |D_i|), |dS_ij| <= P_ij R_i and
        |d dQ_id| <= s R_i max_j |k_jd| (eps_i + ua (log S + c) + 2 gamma_Ev(ua) + gamma_S(ua) + ua)
    (rows of P sum to 1, entropy bound as in the forward). dK and dV sum over queries, where P has no
    normalization: there P_ij <= 1 and P_ij (lse_i - x_ij) <= 1/e, so their bounds are looser by up to ~S.
    With grouped-query attention a key/value head sums over the G L queries of its group."""
    if _random(c):
        return NotImplemented
    o = _operands(c)
    dO, O, lse = c.a["grad_out"], c.a["out"], c.a["logsumexp"]
    L, Ev = o.q.shape[-2], o.v.shape[-1]
    kv_heads = c.a["key"].shape[-3]  # the CPU flash kernel takes (B, H, L, E) only
    group = o.q.shape[-3] // kv_heads

    def make():
        log_s = math.log(max(o.S, 1))
        eps = gamma(o.E + 2, c.ua) * o.scale * o.qn * o.kmax + 2 * c.u * (lse.abs().reshape(o.qn.shape) + log_s)
        R = torch.linalg.vector_norm(dO, dim=-1) * torch.linalg.vector_norm(o.v, dim=-1).amax(-1, keepdim=True) + \
            (dO * O).abs().sum(-1)  # [..., L]
        base = (2 * EXP_ULPS + 4) * c.u + 2 * gamma(Ev, c.ua) + c.u
        dq_rel = eps + c.u * log_s + base + gamma(o.S, c.ua)
        dq = o.scale * (R * dq_rel).unsqueeze(-1) * o.k.abs().amax(-2, keepdim=True)
        per_i = eps + base + gamma(group * L, c.ua) + c.u / math.e  # [..., L]
        dk = sum_groups(o.scale * ((per_i * R).unsqueeze(-1) * o.q.abs()).sum(-2, keepdim=True), kv_heads)
        dv = sum_groups((per_i.unsqueeze(-1) * dO.abs()).sum(-2, keepdim=True), kv_heads)  # [..., 1, Ev]
        outs = []
        for b, r in zip((dq, dk, dv), c.outputs):
            outs.append(None if not is_float(r) else (b + 2 * c.u * r.abs() + c.final(r)).expand(r.shape))
        return outs

    return c.budget(make)
