"""Budgets of sampling at computed points (grid_sample): the sample coordinates are computed from the grid in the
device dtype, so a correct kernel moves each sample point by its rounding, a few u times the coordinate in
pixels; the interpolation weights move with it. The bound is what that motion can change: weights (bilinear,
bicubic) or a nearest pick (at a half-pixel), times the largest value of the input plane. The backward adds the
weights' slopes (grad_grid) and the scatter of the weighted gradient onto the pixels (grad_input).

>>> from shadow.budgets import budget_for
>>> x = torch.arange(4.0, dtype=torch.float64).reshape(1, 1, 2, 2)
>>> g = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
>>> budget_for(torch.ops.aten.grid_sampler_2d.default, (x, g, 0, 0, False), {}, [x[..., :1, :1]],
...            torch.float32).family
'elementwise'
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..opsets import Family
from .core import Budget, BudgetCall, add_into, is_float, overloads, register_budget
from .units import gamma

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, REFLECTION = 0, 2  # padding modes (1: border)
CUBIC_A = -0.75
CUBIC_WEIGHTS = 1.375  # max over t of sum |w_i(t)| for the cubic convolution kernel, A = -0.75
# Horner's bound (gamma_k(u) times the sum of |monomials| on the tap's range, plus its argument's rounding times
# the slope) of the CPU kernel's cubic coefficients, in u, for the taps at distance t+1, t, 1-t, 2-t: the outer
# cubic A(x^3 - 5x^2 + 8x - 4) on [1, 2] (6 roundings of 36 |A|), the inner (A+2)x^3 - (A+3)x^2 + 1 on [0, 1]
# (5 of 4.5); and of their derivatives (GridSampler.h, get_cubic_coefficients_grad: 4 of 30, 3 of 8.25, plus 4.5)
CUBIC_ROUNDING = torch.tensor([218.0, 24.0, 24.0, 218.0], dtype=torch.float64)
CUBIC_GRAD_ROUNDING = torch.tensor([130.0, 30.0, 30.0, 130.0], dtype=torch.float64)
CUBIC_CURVATURE = 4.5  # max |w_i''(t)| of one tap: a coordinate's motion e moves a slope by at most 4.5 e
CUBIC_ENTERING = 1.5  # near an integer the device may take the next tap, at a slope of at most 1.5 e


def _pixel_coordinates(grid: torch.Tensor, sizes: list[int], align_corners: bool) -> torch.Tensor:
    """GridSampler.h's grid_sampler_unnormalize, in float64: [..., d] grid values in [-1, 1] to pixels."""
    size = torch.tensor(sizes, dtype=torch.float64)
    if align_corners:
        return (grid + 1) / 2 * (size - 1)
    return ((grid + 1) * size - 1) / 2


def _coordinate_error(c: BudgetCall, ix: torch.Tensor, sizes: list[int], padding: int) -> torch.Tensor:
    """ce: how far the device's rounding moves each sample coordinate, in pixels."""
    return (8 if padding == REFLECTION else 4) * c.u * (ix.abs() + torch.tensor(sizes, dtype=torch.float64))


def _padded(ix: torch.Tensor, size: int, padding: int, align_corners: bool) -> torch.Tensor:
    """GridSampler.h's clip_coordinates / reflect_coordinates of one dim's pixel coordinates, in float64."""
    if padding == REFLECTION:
        low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        if high <= low:
            return torch.zeros_like(ix)
        span = high - low
        t = (ix - low).abs()
        extra = torch.fmod(t, span)
        ix = torch.where(torch.floor(t / span) % 2 == 0, extra + low, span - extra + low)
    return ix.clamp(0, size - 1) if padding != ZEROS else ix


def _cubic(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cubic convolution weights of the taps at distance t+1, t, 1-t, 2-t ([..., 4]) and their slopes in t."""
    x = torch.stack([t + 1, t, 1 - t, 2 - t], -1)
    A = CUBIC_A
    inner = ((A + 2) * x - (A + 3)) * x * x + 1
    outer = ((A * x - 5 * A) * x + 8 * A) * x - 4 * A
    slope = torch.where(x <= 1, (3 * (A + 2) * x - 2 * (A + 3)) * x, (3 * A * x - 10 * A) * x + 8 * A)
    return torch.where(x <= 1, inner, outer), slope * torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)


def _taps(c: BudgetCall, ix: torch.Tensor, ce: torch.Tensor, size: int, mode: int, padding: int,
          align_corners: bool) -> tuple:
    """One dim's taps ([..., A] each): pixel positions (-1: none), weights w, slopes dw in the coordinate, and
    bounds on the device's errors in both, ew and edw (its coordinate off by ce, its arithmetic rounded).
    Bilinear: w = 1 - f, f at floor(t) and floor(t) + 1, off by ce + u; within ce of an integer the device's point
    may lie in the next cell: the neighbour there takes a weight <= ce (counted on the tap beside it) and the slopes
    change by 4 in all. Nearest: the pick, which may move to the other pixel within ce of a half pixel. Bicubic
    (coordinates not padded, taps padded):
    the cubic's weights, off by ``CUBIC_ROUNDING`` u + ce |dw|, slopes by ``CUBIC_GRAD_ROUNDING`` u +
    ``CUBIC_CURVATURE`` ce, and within ce of an integer the entering tap's slope."""
    t = ix if mode == BICUBIC else _padded(ix, size, padding, align_corners)
    f = t.floor()
    fr = t - f
    lo, hi = (fr <= ce).double(), (1 - fr <= ce).double()
    if mode == BILINEAR:
        offsets = (0, 1)
        w = torch.stack([1 - fr, fr], -1)
        dw = torch.tensor([-1.0, 1.0], dtype=torch.float64).expand(w.shape)
        ew = torch.stack([ce * (1 + lo), ce * (1 + hi)], -1) + c.u
        edw = (2 * (lo + hi))[..., None].expand(w.shape)
    elif mode == NEAREST:
        offsets = (0, 1)
        pick = (torch.round(t) > f).double()
        w = torch.stack([1 - pick, pick], -1)
        dw = edw = torch.zeros_like(w)
        ew = ((fr - 0.5).abs() <= ce).double()[..., None].expand(w.shape)
    else:
        offsets = (-1, 0, 1, 2)
        w, dw = _cubic(fr)
        ew = CUBIC_ROUNDING * c.u + ce[..., None] * dw.abs()
        edw = (CUBIC_GRAD_ROUNDING * c.u + CUBIC_CURVATURE * ce[..., None]
               + CUBIC_ENTERING * (ce * torch.maximum(lo, hi))[..., None] * torch.tensor([1.0, 0.0, 0.0, 1.0]))
    pos = f[..., None] + torch.tensor(offsets, dtype=torch.float64)
    if mode == BICUBIC and padding != ZEROS:
        pos = _padded(pos, size, padding, align_corners)
    pos = torch.where((pos >= 0) & (pos <= size - 1), pos, -1.0).long()
    return pos, w, dw, ew, edw


@register_budget(*overloads("grid_sampler_2d", "grid_sampler_3d"), family=Family.ELEMENTWISE)
def grid_sampler_budget(c: BudgetCall) -> Budget:
    """Each coordinate is off by ce = 4 u (|ix| + size) pixels after unnormalizing (8 u with reflection's
    fmod). A weight is a product of one factor per dim; moving dim k's coordinate by ce changes the weights by at
    most (sum over that dim's taps of |dw/dt|) * ce times the other dims' sum of |w|: bilinear 2 * 1, bicubic
    (A = -0.75) 3 * 1.375**(d-1) (both maxima over t, measured on the cubic); plus 2 u per factor's rounding and
    the sum of the taps (gamma, times sum|w|); all on values <= max|x| of the plane. Nearest: exact but where a
    coordinate is within ce of a half pixel, where it may pick the neighbour (2 max|x|)."""
    a, r = c.a, c.out()
    x, grid = a["input"], a["grid"]
    d = grid.shape[-1]
    mode = int(a["interpolation_mode"])

    def make():
        sizes = [x.shape[-1 - k] for k in range(d)]  # grid (x, y, z) indexes (W, H, D)
        ix = _pixel_coordinates(grid, sizes, bool(a["align_corners"]))
        ce = _coordinate_error(c, ix, sizes, int(a["padding_mode"]))
        vmax = x.abs().amax(tuple(range(2, x.dim())), keepdim=True)  # [N, C, 1, ...]
        if mode == NEAREST:
            moved = ((ix - ix.floor() - 0.5).abs() <= ce).any(-1).to(x.dtype)
            return [(2 * moved).unsqueeze(1) * vmax + c.final(r)]
        worst = ce.amax(-1).unsqueeze(1) + 2 * c.u  # [N, 1, *out]
        cubic = mode == BICUBIC
        slope, weights = (3.0, CUBIC_WEIGHTS) if cubic else (2.0, 1.0)
        taps = 4 ** d if cubic else 2 ** d
        motion = d * slope * weights ** (d - 1) * worst
        return [(motion + gamma(taps + 2 * d + 2, c.u) * weights ** d) * vmax + c.final(r)]

    return c.budget(make)


def _box_sum(t: torch.Tensor, radius: int) -> torch.Tensor:
    """Each pixel's sum of t over the box of pixels within ``radius`` of it (per dim), on [N, C, *plane]."""
    for dim in range(2, t.dim()):
        n = t.shape[dim]
        padded = F.pad(t.movedim(dim, -1), (radius, radius)).movedim(-1, dim)
        t = sum(padded.narrow(dim, o, n) for o in range(2 * radius + 1))
    return t


def _grad_input_bound(c: BudgetCall, g: torch.Tensor, ix: torch.Tensor, ce: torch.Tensor, taps: list[tuple],
                      in_shape: torch.Size, padding: int, align_corners: bool) -> torch.Tensor:
    """Each tap's g W scattered onto its pixel. What the device's weights may add, |g| times sum_k max ew_k (all
    other |w| <= 1), lands on a pixel within ceil(max ce) + 2 of the sample's (padded) nearest pixel: the box sum
    of that mass around each pixel bounds it, and K (taps times the samples in that box) the contributions the sum
    in the device dtype rounds: gamma_K(u) (sum |g W| + that mass); (d + 1) u |g W| for the product's roundings."""
    N, C = g.shape[:2]
    d = len(taps)
    plane = math.prod(in_shape[2:])
    ga = g.abs().reshape(N, C, -1)

    def scatter(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # [N, P_out] -> [N, C, *plane]
        out = torch.zeros(N, values.shape[1], plane + 1, dtype=torch.float64)
        return out.scatter_add_(2, index[:, None].expand_as(values), values)[..., :plane].reshape(
            N, values.shape[1], *in_shape[2:])

    def flat(positions: list[torch.Tensor]) -> torch.Tensor:  # per dim [N, P_out] (-1: none) -> plane index
        index = torch.zeros_like(positions[0])
        for k in reversed(range(d)):  # z, y, x: the plane is laid out (D, H, W)
            index = index * in_shape[2 + d - 1 - k] + positions[k]
        return torch.where(torch.stack(positions).ge(0).all(0), index, plane)

    mags = 0.0
    for combo in itertools.product(*(range(t[0].shape[-1]) for t in taps)):
        index = flat([taps[k][0][..., combo[k]].reshape(N, -1) for k in range(d)])
        W = math.prod(taps[k][1][..., combo[k]].reshape(N, -1) for k in range(d)).abs()
        mags = mags + scatter(index, ga * W[:, None])
    sizes = list(in_shape[2:])[::-1]
    near = [_padded(ix[..., k], sizes[k], padding, align_corners).round().clamp(0, sizes[k] - 1).reshape(N, -1).long()
            for k in range(d)]
    index = flat(near)
    moved = sum(t[3].amax(-1) for t in taps).reshape(N, -1)
    radius = math.ceil(float(ce.amax())) + 2 if ce.numel() else 2
    count = _box_sum(scatter(index, torch.ones(N, 1, index.shape[-1], dtype=torch.float64)), radius)
    moved = _box_sum(scatter(index, ga * moved[:, None]), radius)
    ku = count * (math.prod(t[0].shape[-1] for t in taps) * c.u)
    g_k = torch.where(ku < 1, ku / (1 - ku), math.inf)
    return torch.where(mags + moved > 0, g_k * (mags + moved), 0.0) + moved + (d + 1) * c.u * mags


def _grad_grid_bound(c: BudgetCall, g: torch.Tensor, x: torch.Tensor, t: torch.Tensor, ce: torch.Tensor,
                     taps: list[tuple], sizes: list[int], padding: int, align_corners: bool,
                     bilinear: bool) -> torch.Tensor:
    """d grad / d coordinate k, times the unnormalizing factor ((size - 1) / 2 or size / 2), on values <= max|x| of
    each plane: G = sum_c |g_c| max|x_c|, the taps' slopes D_k = sum|dw_k| prod_{j != k} sum(|w_j| + ew_j);
    bound G (gamma_{taps C + 2d + 2}(u) D_k + E_k) with E_k the slopes' error to first order (sum edw_k times the
    others' weights, plus sum |dw_k| times the others' ew). Bilinear with border or reflection: within ce of an
    edge the factor itself may be 0 or flip its sign: 2 G (D_k + E_k) more."""
    d = len(taps)
    G = (g.abs() * x.abs().amax(tuple(range(2, x.dim())), keepdim=True)).sum(1)  # [N, *out]
    sw = [(tp[1].abs() + tp[3]).sum(-1) for tp in taps]
    sdw = [tp[2].abs().sum(-1) for tp in taps]
    sew = [tp[3].sum(-1) for tp in taps]
    sedw = [tp[4].sum(-1) for tp in taps]
    rounding = gamma(math.prod(tp[0].shape[-1] for tp in taps) * g.shape[1] + 2 * d + 2, c.u)
    bounds = []
    for k in range(d):
        rest = [j for j in range(d) if j != k]
        others = math.prod(sw[j] for j in rest)
        motion = sum(sew[j] * math.prod(sw[l] for l in rest if l != j) for j in rest)
        e = sedw[k] * others + (sdw[k] + sedw[k]) * motion
        slope = sdw[k] * others
        b = G * (rounding * slope + e)
        if bilinear and padding != ZEROS:
            tk = _padded(t[..., k], sizes[k], padding, align_corners)
            edge = (tk <= ce[..., k]) | (tk >= sizes[k] - 1 - ce[..., k])
            b = b + 2 * edge * G * (slope + e)
        bounds.append(b * ((sizes[k] - 1) / 2 if align_corners else sizes[k] / 2))
    return torch.stack(bounds, -1)


@register_budget(*overloads("grid_sampler_2d_backward", "grid_sampler_3d_backward"), family=Family.REDUCTION)
def grid_sampler_backward_budget(c: BudgetCall) -> Budget:
    """grad_input scatters g W over each sample's taps (``_grad_input_bound``); grad_grid sums, over channels and
    taps, values times the weights' slopes (``_grad_grid_bound``). Both from ``_taps``: weights and slopes at the
    float64 coordinates, and what the device's coordinates, off by ce pixels (as the forward's), and its rounding
    change in them, cell changes included."""
    a = c.a
    g, x, grid = a["grad_output"], a["input"], a["grid"]
    d = grid.shape[-1]
    mode, padding, align = int(a["interpolation_mode"]), int(a["padding_mode"]), bool(a["align_corners"])
    grad_input, grad_grid = c.out(0), c.out(1)

    def make():
        sizes = [x.shape[-1 - k] for k in range(d)]
        ix = _pixel_coordinates(grid, sizes, align)
        ce = _coordinate_error(c, ix, sizes, padding)
        taps = [_taps(c, ix[..., k], ce[..., k], sizes[k], mode, padding, align) for k in range(d)]
        gi = (add_into(c.final(grad_input), _grad_input_bound(c, g, ix, ce, taps, x.shape, padding, align))
              if is_float(grad_input) else None)
        gg = add_into(c.final(grad_grid), _grad_grid_bound(c, g, x, ix, ce, taps, sizes, padding, align,
                                                           mode == BILINEAR))
        return [gi, gg]

    return c.budget(make)


@register_budget(*overloads("affine_grid_generator"), family=Family.MATMUL)
def affine_grid_budget(c: BudgetCall) -> Budget:
    """AffineGridGenerator.cpp: the base grid (linspace over [-1, 1] per dim, in the device dtype: 2 ulps + 4 u of
    its largest value, |b| <= 1, and an exact 1) times theta^T, a sum of K = dims + 1 terms: each grid coordinate
    is off by (6 u + gamma_K(ua)) sum_k |theta_jk|, then its own rounding."""
    theta, r = c.a["theta"], c.out()
    k = theta.shape[-1]
    rel = 6 * c.u + gamma(k, c.ua)
    # theta (N, d, K): one bound per (sample, coordinate), broadcast over the grid's points
    scale = theta.abs().sum(-1).reshape(theta.shape[0], *([1] * (r.dim() - 2)), theta.shape[1])
    return c.budget(lambda: [add_into(c.final(r), scale.expand(r.shape), alpha=rel)])
