"""Loss budgets: per-element terms (relative ``rel * u``, plus an absolute term where the formula cancels),
then the reduction at ``ua``; the losses' backward ops are elementwise given their inputs (a few ulps).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from ..opsets import Family
from .core import Budget, BudgetCall, overloads, register_budget
from .elementwise import register_ulps
from .units import EXP_ULPS, gamma

_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def _loss(c: BudgetCall, rel: float, absolute: Callable[[], Any] | None = None, divisor: Any = None) -> Budget:
    """l = reduce(l_i): |d l_i| <= rel * u * |l_i| + abs_i (the elementwise terms may be rounded to the device
    dtype before the reduction: reduced-precision kernels do); the sum adds gamma_n(ua) sum|l_i|; the mean
    divides by n (or by ``divisor()`` = (|W|, k): nll's total weight W, a sum whose error is gamma_n(ua) k |W|,
    k = sum|w_i| / |W|, 1 for weights of one sign)."""
    red = _REDUCTION.get(c.a.get("reduction", 1), "mean")
    r = c.out()

    def make():
        li = c.call_with(reduction=0)
        li = li[0] if isinstance(li, tuple) else li
        la = li.abs()
        e = rel * c.u * la
        if absolute is not None:
            e = e + absolute()
        if red == "none":
            return [e + c.final(r)]
        n = max(li.numel(), 1)
        s = e.sum() + gamma(n, c.ua) * la.sum()
        if red == "mean":
            d, k = (float(n), 1.0) if divisor is None else divisor()
            s = s / d + (gamma(n, c.ua) * k if divisor is not None else c.ua) * la.sum() / d
        return [c.final(r, 2.0) + s + c.ua * r.abs()]

    return c.budget(make)


register_budget(*overloads("mse_loss"), family=Family.LOSS)(functools.partial(_loss, rel=4.0))
register_budget(*overloads("l1_loss"), family=Family.LOSS)(functools.partial(_loss, rel=2.0))
register_budget(*overloads("smooth_l1_loss", "huber_loss"), family=Family.LOSS)(functools.partial(_loss, rel=6.0))


@register_budget(*overloads("soft_margin_loss"), family=Family.LOSS)
def soft_margin_budget(c: BudgetCall) -> Budget:
    """log(1 + exp(-y x)): 1 + exp(-y x) is rounded (log then moves by u absolute), -y x too (relative)."""
    x, y = c.a["self"], c.a["target"]
    return _loss(c, 2 * EXP_ULPS + 4, lambda: 2 * c.u * (1 + (x * y).abs()))


@register_budget(*overloads("binary_cross_entropy"), family=Family.LOSS)
def bce_budget(c: BudgetCall) -> Budget:
    """-w (t log x + (1-t) log(1-x)): both terms have one sign (no cancellation); 1 - x is rounded (ua,
    relative), which moves log(1-x) by ua absolute."""
    a = c.a
    w = a.get("weight")

    def absolute():
        t = (2 * c.u) * (a["target"].abs() + (1 - a["target"]).abs())
        return t * w.abs() if w is not None else t

    return _loss(c, EXP_ULPS + 4, absolute)


@register_budget(*overloads("binary_cross_entropy_with_logits"), family=Family.LOSS)
def bce_logits_budget(c: BudgetCall) -> Budget:
    """(1-t) x + lw (log1p(exp(-|x|)) + max(-x, 0)), lw = 1 + (pw - 1) t: the terms cancel (to |t x| for
    x < 0), so the roundings are relative to |x| (|1 - t| + |lw|) + |lw|."""
    a = c.a
    x, t, w, pw = a["self"], a["target"], a.get("weight"), a.get("pos_weight")

    def absolute():
        lw = 1 + (pw - 1) * t if pw is not None else torch.ones_like(t)
        e = (2 * EXP_ULPS * c.u) * (x.abs() * ((1 - t).abs() + lw.abs()) + lw.abs())
        return e * w.abs() if w is not None else e

    return _loss(c, EXP_ULPS + 4, absolute)


@register_budget(*overloads("nll_loss_forward", "nll_loss2d_forward"), family=Family.LOSS)
def nll_budget(c: BudgetCall) -> Budget:
    """-w_t x[i, t_i] summed, divided by the total weight (mean). total_weight: gamma_n(ua) * itself."""
    tw = c.out(1)
    n = max(c.a["target"].numel(), 1)  # the terms the sums run over (nll_loss2d: N*H*W)

    def divisor() -> tuple[float, float]:
        w = abs(float(tw))
        return w, (_weights_abs_sum(c) / w if w > 0 else 1.0)

    main = _loss(c, 2.0, divisor=divisor)
    return c.budget(lambda: [main.bound[0], c.final(tw) + gamma(n, c.ua) * _weights_abs_sum(c)])


def _weights_abs_sum(c: BudgetCall) -> float:
    """sum |w_t| over the targets that count (not ignore_index): |total weight| unless weights change sign."""
    target, weight = c.a["target"], c.a.get("weight")
    counted = target != c.a.get("ignore_index", -100)
    if weight is None:
        return float(counted.sum())
    return float(weight.abs()[target.clamp_min(0).clamp_max(weight.numel() - 1)][counted].sum())



# Loss and activation backward ops are elementwise given their inputs: a handful of roundings of the result.
LOSS_BACKWARD = ("mse_loss_backward", "nll_loss_backward", "nll_loss2d_backward", "binary_cross_entropy_backward",
                 "smooth_l1_loss_backward", "huber_loss_backward", "l1_loss_backward")
register_ulps(overloads(*LOSS_BACKWARD), Family.LOSS, 8.0)
# -y g sigmoid(-y x) / n through exp(-y x) / (1 + exp(-y x)): more roundings (observed up to 24 ulps)
register_ulps(overloads("soft_margin_loss_backward"), Family.LOSS, 32.0)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(-1) if x.dim() else x.abs()


@register_budget(*overloads("multi_margin_loss"), family=Family.LOSS)
def multi_margin_budget(c: BudgetCall) -> Budget:
    """sum_j max(0, margin - x_y + x_j)^p w_y / C: each term off by (2p + 2) u relative to
    (|margin| + 2 max|x|)^p, the sum by gamma_C(ua)."""
    a = c.a
    x, p, w = a["self"], float(a.get("p", 1)), a.get("weight")
    C = x.shape[-1] if x.dim() else 1
    wmax = float(w.abs().max()) if isinstance(w, torch.Tensor) and w.numel() else 1.0
    return _loss(c, 0.0, lambda: (gamma(C + 2, c.ua) + (2 * p + 2) * c.u) * wmax *
                 (abs(float(a.get("margin", 1))) + 2 * _row_max(x)) ** p)


@register_budget(*overloads("multilabel_margin_loss_forward"), family=Family.LOSS)
def multilabel_margin_budget(c: BudgetCall) -> Budget:
    """sum over target/non-target pairs of max(0, 1 - (x_j - x_k)) / C: at most C^2 terms of size
    <= 1 + 2 max|x|, each off by 2 u. Output 1 (is_target) is a 0/1 mask."""
    x = c.a["self"]
    C = x.shape[-1] if x.dim() else 1
    main = _loss(c, 0.0, lambda: (gamma(C * C + 2, c.ua) + 4 * c.u) * C * (1 + 2 * _row_max(x)))
    return c.budget(lambda: [main.bound[0], c.ulp_bound(c.out(1), 1.0)])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the margin kernels read it: [nframe, dim] (a vector is one frame, a scalar one frame of one class)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)


def _frame_scale(c: BudgetCall, n: int, dim: int) -> float:
    """g = 1 / (nframe * dim) for the mean, 1 / dim otherwise: the per-pair gradient the margin kernels add."""
    return 1.0 / (n * dim) if c.a.get("reduction", 1) == 1 else 1.0 / dim


def _grad_output_rows(c: BudgetCall, n: int) -> torch.Tensor:
    """|grad_output| per frame (a [n, 1] column, or a scalar for the reduced losses)."""
    g = c.a["grad_output"].abs()
    return g.reshape(n, 1) if g.dim() and g.numel() == n and c.a.get("reduction", 1) == 0 else g.reshape(())


@register_budget(*overloads("multi_margin_loss_backward"), family=Family.LOSS)
def multi_margin_backward_budget(c: BudgetCall) -> Budget:
    """LossMultiMargin.cpp: for d != y, z = margin - x_y + x_d (two roundings: 2 u (|margin| + |x_y| + |x_d|)
    absolute), h = g w_y (p = 1) or 2 g w_y z (p = 2) where z > 0, and the target's entry -sum_d h in the device
    dtype (gamma_C(u) sum|h|); then times grad_output. For p = 1 the step at z = 0 is a flip: where |z| is within
    its rounding of 0, h may be g w_y or 0 (a correct kernel decides on its rounded z)."""
    a, r = c.a, c.out()
    p, margin, w = int(a["p"]), float(a["margin"]), a.get("weight")

    def make():
        x = _rows(a["self"])
        n, dim = x.shape
        tgt = a["target"].reshape(n, 1).long()
        xt = x.gather(1, tgt)
        z = margin - xt + x
        near = 2 * c.u * (abs(margin) + xt.abs() + x.abs())
        gw = _frame_scale(c, n, dim) * (w.abs()[tgt] if isinstance(w, torch.Tensor) else torch.ones_like(xt))
        live = (z > -near).to(z.dtype).scatter(1, tgt, 0.0)  # the terms a correct kernel may count
        if p == 1:
            h = gw * live
            e = 4 * c.u * h + gw * (z.abs() <= near).to(z.dtype).scatter(1, tgt, 0.0)
        else:
            h = 2 * gw * z.abs() * live
            e = 2 * gw * (4 * c.u * z.abs() + near) * live
        e = e.scatter(1, tgt, e.sum(1, keepdim=True) + gamma(dim, c.u) * h.sum(1, keepdim=True))
        return [(e * _grad_output_rows(c, n)).reshape(r.shape) + c.final(r, 2.0)]

    return c.budget(make)


# Above this many (frame, target, class) triples the multilabel margin bound lets every pair flip (no
# pairwise temporary): as loose as the gradient itself, but still finite.
PAIRWISE_LIMIT = 1 << 22


@register_budget(*overloads("multilabel_margin_loss_backward"), family=Family.LOSS)
def multilabel_margin_backward_budget(c: BudgetCall) -> Budget:
    """LossMultiLabelMargin.cpp: for every target i and non-target d with z = 1 - x_i + x_d > 0 the kernel adds
    g to grad[d] and -g to grad[i], in the device dtype: an element that k pairs reach is off by gamma_k(u) k g,
    plus g per pair whose z is within its rounding (2 u (1 + |x_i| + |x_d|)) of 0 (counted or not); then times
    grad_output."""
    a, r = c.a, c.out()

    def make():
        x = _rows(a["self"])
        n, dim = x.shape
        tgt = a["target"].reshape(n, dim).long()
        listed = (tgt >= 0).long().cumprod(1).bool()  # the target list ends at the first -1
        count = torch.zeros_like(x).scatter_add_(1, tgt.clamp_min(0), listed.to(x.dtype))
        other = (a["is_target"].reshape(n, dim) == 0).to(x.dtype)
        if n * dim * dim <= PAIRWISE_LIMIT:
            z = 1 - x[:, :, None] + x[:, None, :]  # [frame, target i, class d]
            near = 2 * c.u * (1 + x.abs()[:, :, None] + x.abs()[:, None, :])
            pairs = count[:, :, None] * other[:, None, :]
            live, flips = pairs * (z > -near), pairs * (z.abs() <= near)
            k = live.sum(2) + live.sum(1)  # pairs reaching each element, as target and as non-target
            f = flips.sum(2) + flips.sum(1)
        else:
            k = count * other.sum(1, keepdim=True) + other * count.sum(1, keepdim=True)
            f = k
        g = _frame_scale(c, n, dim)
        e = g * (k * (k + 2) * c.u / (1 - (k + 2) * c.u).clamp_min(1e-300) + f)
        return [(e * _grad_output_rows(c, n)).reshape(r.shape) + c.final(r, 2.0)]

    return c.budget(make)


# --- CTC (LossCTC.cpp): log_alpha[t, s] = logsumexp(la[t-1, s], la[t-1, s-1], la[t-1, s-2]) + lp[t, l'(s)],
# in the device dtype, one time step after another ---
LOG3 = math.log(3.0)
# one step's own roundings, in u: the differences la - max (u/e after exp), three exps and two adds, the log
# of a sum in [1, 3]
CTC_STEP = 2 * EXP_ULPS + 4


def _lengths(v: Any) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.int64).reshape(-1)


def _ctc_alpha_magnitude(lp: torch.Tensor) -> torch.Tensor:
    """[T, N]: |log_alpha[t]| <= sum_{t' <= t} max_c |lp[t', c]| + t log 3 (at most 3**t paths, each a sum of
    log-probabilities), over the finite log-probabilities."""
    m = torch.where(lp.isfinite(), lp.abs(), 0.0).amax(-1)
    t = torch.arange(lp.shape[0], dtype=torch.float64)[:, None]
    return m.cumsum(0) + t * LOG3


def _ctc_alpha_error(ma: torch.Tensor, u: float) -> torch.Tensor:
    """[T, N]: the error of log_alpha[t]. logsumexp is 1-Lipschitz, so the errors of t - 1 carry over and each
    step adds its own: CTC_STEP u, u (|max| + log 3) for adding the max back, u |la[t]| for adding lp."""
    steps = CTC_STEP + ma[:-1] + ma[1:] + LOG3
    return u * torch.cat([torch.zeros_like(ma[:1]), steps.cumsum(0)])


@register_budget(*overloads("_ctc_loss"), family=Family.LOSS)
def ctc_budget(c: BudgetCall) -> Budget:
    """The forward recursion's error grows with t as its terms do (:func:`_ctc_alpha_error`); the loss adds one
    more logaddexp of the last two log_alpha. Output 1 (log_alpha) is bounded where it is defined."""
    lp = c.a["log_probs"]
    nll, alpha = c.out(0), c.out(1)

    def make():
        ma = _ctc_alpha_magnitude(lp)
        err = _ctc_alpha_error(ma, c.u)
        last = (_lengths(c.a["input_lengths"]).clamp(1, lp.shape[0]) - 1)[None, :]
        end = err.gather(0, last)[0] + c.u * (CTC_STEP + 2 * ma.gather(0, last)[0] + LOG3)
        return [end.reshape(nll.shape) + c.final(nll), err.T.unsqueeze(-1) + c.final(alpha)]

    return c.budget(make)


@register_budget(*overloads("_ctc_loss_backward"), family=Family.LOSS)
def ctc_backward_budget(c: BudgetCall) -> Budget:
    """grad = (exp(lp) - exp(lcab + nll - lp)) * gr, lcab the log-sum over the states of each label of
    log_alpha + log_beta. log_alpha and nll are inputs (exact as given); log_beta runs the forward recursion
    backward in time (its error grows with T - t as log_alpha's with t), lcab chains up to L + 1 logaddexps,
    the exponent is rounded twice, and exp turns its absolute error into a relative one of X = exp(...), whose
    size |X gr| = |exp(lp) gr - grad| the reference gives."""
    a, r = c.a, c.out()
    lp, gr, nll = a["log_probs"], a["grad"], a["neg_log_likelihood"]

    def make():
        T = lp.shape[0]
        tb = _lengths(a["input_lengths"])[None, :]
        L = _lengths(a["target_lengths"]).to(torch.float64)[None, :]
        t = torch.arange(T)[:, None]
        m = torch.where(lp.isfinite(), lp.abs(), 0.0).amax(-1) * (t < tb)
        mb = m.flip(0).cumsum(0).flip(0) + (tb - 1 - t).clamp_min(0) * LOG3  # bounds |log_beta[t]|
        steps = (CTC_STEP + mb[:-1] + mb[1:] + LOG3) * (t[:-1] < tb - 1)
        beta_err = c.u * torch.cat([steps.flip(0).cumsum(0).flip(0), torch.zeros_like(mb[:1])])
        ab = _ctc_alpha_magnitude(lp) + mb + torch.log(2 * L + 1)  # bounds |lcab|
        e = (beta_err + c.u * (L + 2) * (CTC_STEP + ab))[..., None]
        e = e + 2 * c.u * (ab[..., None] + nll.abs().reshape(1, -1, 1) + torch.where(lp.isfinite(), lp.abs(), 0.0))
        g = gr.abs().reshape(1, -1, 1)
        elp = lp.exp()
        x_gr = (elp * gr.reshape(1, -1, 1) - r).abs()
        return [g * elp * ((EXP_ULPS + 1) * c.u) + x_gr * (e + (EXP_ULPS + 1) * c.u) + c.final(r, 2.0)]

    return c.budget(make)


# --- torch 2.13's chunked linear + cross entropy (F.linear_cross_entropy with options): a Python custom op that
# returns the loss and, for mean/sum, its gradients at once, for an upstream gradient of 1 ---
def _chunked_ops() -> list:
    try:
        import torch.nn.modules.linear_cross_entropy  # noqa: F401 (registers the torch_nn ops; torch >= 2.13)
    except ImportError:
        return []
    ns = torch.ops.torch_nn
    return [ns._linear_cross_entropy_batch_chunked.default, ns._linear_cross_entropy_batch_chunked_no_reduction.default]


@register_budget(*_chunked_ops(), family=Family.LOSS)
def linear_cross_entropy_budget(c: BudgetCall) -> Budget:
    """z = x W^T + b (N, V), l_i = w_t (lse_i - z_{i,t}), reduced; the gradients from G = s w_t (softmax(z) - onehot_t)
    (s = 1 / total weight for the mean): G W, G^T x, sum_i G. First order, values stored at u, sums at ua:
    e_z = gamma_{K+1}(ua) (|x| |W|^T + |b|) + u |z|; lse off by p . e_z + ua (p . |z - m| + |lse|) + u |lse| +
    (EXP_ULPS + 2) ua + gamma_V(ua); p_ij by p_ij (e_z + e_lse + (EXP_ULPS + 1) ua); each product and sum then
    adds its own gamma over the terms it runs over (V for G W, N for G^T x and the reductions); the loss and the
    weight and bias gradients, summed chunk by chunk (``batch_chunk_size`` rows) into a total kept in the device
    dtype, gamma_C(u) more for C chunks."""
    a = c.a
    if a.get("label_smoothing", 0.0):
        return NotImplemented  # the chunked path runs without smoothing only
    x, w_lin, b_lin, target = a["input"], a["linear_weight"], a["linear_bias"], a["target"]
    red = a.get("reduction", "none")
    n, k = x.shape
    v = w_lin.shape[0]
    u, ua = c.u, c.ua
    chunks = gamma(-(-n // max(int(a["batch_chunk_size"]), 1)), u)  # the totals' roundings, one per chunk

    def make():
        z = torch.nn.functional.linear(x, w_lin, b_lin)
        e_z = gamma(k + 1, ua) * torch.nn.functional.linear(x.abs(), w_lin.abs(), None if b_lin is None else
                                                            b_lin.abs()) + u * z.abs()
        lse = z.logsumexp(1, keepdim=True)
        p = (z - lse).exp()
        m = z.amax(1, keepdim=True)
        e_lse = ((p * e_z).sum(1, keepdim=True) + ua * ((p * (z - m).abs()).sum(1, keepdim=True) + lse.abs())
                 + u * lse.abs() + (EXP_ULPS + 2) * ua + gamma(v, ua))
        counted = target != a["ignore_index"]
        t = target.clamp(0, v - 1)
        wt = (torch.ones(n, dtype=torch.float64) if a["weight"] is None else a["weight"][t]) * counted
        rows = torch.arange(n)
        li = wt * (lse[:, 0] - z[rows, t])
        e_li = wt.abs() * (e_lse[:, 0] + e_z[rows, t] + ua * (lse[:, 0] - z[rows, t]).abs()) + ua * li.abs()
        out = [c.out(i) for i in range(len(c.outputs))]
        if red == "none":
            return [e_li + c.final(out[0])]
        total = wt.sum()
        if red == "mean" and float(total) == 0:  # every row ignored: the loss and gradients are 0/0, NaN both ways
            return [c.final(r) if r.numel() else None for r in out]
        wabs = float(wt.abs().sum())
        # the mean's divisor: the total weight, a sum of N terms (its relative error gamma_N(ua) sum|w| / |W|)
        s, s_rel = (1.0, 0.0) if red == "sum" else (1.0 / float(total), gamma(n, ua) * wabs / abs(float(total)) + ua)
        loss = (e_li.sum() + (gamma(n, ua) + chunks) * li.abs().sum()) * abs(s) + s_rel * abs(float(li.sum() * s))
        bounds: list = [loss + c.final(out[0], 2.0)]
        onehot = torch.zeros_like(p)
        onehot[rows, t] = 1.0
        g = s * wt[:, None] * (p - onehot)
        e_g = (abs(s) * wt.abs()[:, None] * (p * (e_z + e_lse + (EXP_ULPS + 1) * ua) + ua * (p - onehot).abs())
               + (s_rel + u) * g.abs())
        grads = [lambda: e_g @ w_lin.abs() + gamma(v, ua) * (g.abs() @ w_lin.abs()),
                 lambda: e_g.T @ x.abs() + (gamma(n, ua) + chunks) * (g.abs().T @ x.abs()),
                 lambda: e_g.sum(0) + (gamma(n, ua) + chunks) * g.abs().sum(0)]
        for r, grad in zip(out[1:4], grads):  # an output not asked for is empty
            bounds.append(None if r.numel() == 0 else grad().reshape(r.shape) + c.final(r))
        return bounds

    return c.budget(make)
