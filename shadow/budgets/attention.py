"""Attention budgets: the fused scaled-dot-product kernels (the CPU flash kernel and its backward; the math
path dispatches matmuls and softmax, bounded by their own rules). Norms and maxima of q, k, v only: no
L x S matrix is formed.
"""

from __future__ import annotations

import math

import torch

from .core import EXP_ULPS, Budget, BudgetCall, gamma, is_float, overloads, register_budget


def _attention_parts(c: BudgetCall) -> tuple:
    q, k, v = c.a["query"], c.a["key"], c.a["value"]
    E, S = q.shape[-1], k.shape[-2]
    s = c.a.get("scale")
    s = 1.0 / math.sqrt(E) if s is None else float(s)
    qn = torch.linalg.vector_norm(q, dim=-1)  # [..., L]
    kmax = torch.linalg.vector_norm(k, dim=-1).amax(-1, keepdim=True)  # [..., 1]
    return q, k, v, E, S, s, qn, kmax


@register_budget(*overloads("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"))
def attention_budget(c: BudgetCall) -> Budget:
    """out_i = sum_j P_ij v_j, P = softmax(s q k^T + mask). Logit i,j is off by eps_i = gamma_{E+2}(ua) s
    ||q_i|| max_j ||k_j|| (Cauchy-Schwarz) + ua |m_i| (rounding at the row max m_i, |m_i| <= |lse_i| + log S);
    P_ij by P_ij (2 eps_i + ua (lse_i - x_ij) + c ua + gamma_S(ua)) (online-softmax rescalings included);
    with sum_j P_ij (lse_i - x_ij) <= log S (entropy) and sum_j P_ij |v_jd| <= max_j |v_jd|:
        |d out_id| <= max_j |v_jd| * (2 eps_i + 2 ua log S + c ua + 2 gamma_S(ua)) + rounding of out;
        |d lse_i|  <= eps_i + ua (log S + c) + gamma_S(ua) + ua |lse_i|.
    O(L E + S E) work: norms and maxima, no L x S matrix. Outside the gamma terms (accumulations, at ua)
    the roundings are at the device's u: the bf16 CPU kernel rounds the logits and P to bf16 for its GEMMs."""
    if c.a.get("dropout_p", 0.0) not in (0, 0.0, None):
        return NotImplemented  # random: not replayed, nothing to bound
    _, _, v, E, S, s, qn, kmax = _attention_parts(c)
    out = c.out(0)
    lse = c.outputs[1] if len(c.outputs) > 1 and is_float(c.outputs[1]) and c.outputs[1].numel() else None

    def make():
        m_abs = (lse.abs() + math.log(max(S, 1))) if lse is not None else None
        eps = gamma(E + 2, c.ua) * s * qn * kmax  # [..., L]
        if m_abs is not None:
            eps = eps + c.u * m_abs.reshape(eps.shape)
        const = 2 * c.u * math.log(max(S, 1)) + (2 * EXP_ULPS + 4) * c.u + 2 * gamma(S, c.ua)
        vmax = v.abs().amax(-2, keepdim=True)  # [..., 1, Ev]
        b_out = vmax * (2 * eps + const).unsqueeze(-1) + c.u * out.abs() + c.final(out)
        bounds = [b_out]
        if lse is not None:
            b_lse = (eps + c.u * (math.log(max(S, 1)) + 2 * EXP_ULPS) + gamma(S, c.ua)).reshape(lse.shape)
            bounds.append(b_lse + 2 * c.u * lse.abs() + c.final(lse))
        bounds.extend(None for _ in c.outputs[len(bounds):])
        return bounds

    return c.budget("attention", make)


@register_budget(*overloads("_scaled_dot_product_flash_attention_for_cpu_backward"))
def attention_backward_budget(c: BudgetCall) -> Budget:
    """dV = P^T dO, dS = P o (dO V^T - D), D_i = dO_i . O_i, dQ = s dS K, dK = s dS^T Q, P recomputed from
    the given lse with relative error eta_ij <= eps_i + ua (lse_i - x_ij) + c ua. With R_i = ||dO_i|| max_j
    ||v_j|| + sum_d |dO_id O_id| (>= |dP_ij| + |D_i|), |dS_ij| <= P_ij R_i and
        |d dQ_id| <= s R_i max_j |k_jd| (eps_i + ua (log S + c) + 2 gamma_Ev(ua) + gamma_S(ua) + ua)
    (rows of P sum to 1, entropy bound as in the forward). dK and dV sum over queries, where P has no
    normalization: there P_ij <= 1 and P_ij (lse_i - x_ij) <= 1/e, so their bounds are looser by up to ~S."""
    a = c.a
    if a.get("dropout_p", 0.0) not in (0, 0.0, None):
        return NotImplemented
    q, k, v, E, S, s, qn, kmax = _attention_parts(c)
    dO, O, lse = a["grad_out"], a["out"], a["logsumexp"]
    L, Ev = q.shape[-2], v.shape[-1]

    def make():
        eps = gamma(E + 2, c.ua) * s * qn * kmax + 2 * c.u * (lse.abs().reshape(qn.shape) + math.log(max(S, 1)))
        R = torch.linalg.vector_norm(dO, dim=-1) * torch.linalg.vector_norm(v, dim=-1).amax(-1, keepdim=True) + \
            (dO * O).abs().sum(-1)  # [..., L]
        base = (2 * EXP_ULPS + 4) * c.u + 2 * gamma(Ev, c.ua) + c.u
        dq_rel = eps + c.u * math.log(max(S, 1)) + base + gamma(S, c.ua)
        dq = s * (R * dq_rel).unsqueeze(-1) * k.abs().amax(-2, keepdim=True)
        per_i = (eps + base + gamma(L, c.ua) + c.u / math.e)  # [..., L]
        dk = s * ((per_i * R).unsqueeze(-1) * q.abs()).sum(-2, keepdim=True)  # [..., 1, E]
        dv = ((per_i.unsqueeze(-1)) * dO.abs()).sum(-2, keepdim=True)  # [..., 1, Ev]
        outs = []
        for b, r in zip((dq, dk, dv), c.outputs):
            outs.append(None if not is_float(r) else (b + 2 * c.u * r.abs() + c.final(r)).expand(r.shape))
        return outs

    return c.budget("attention", make)
