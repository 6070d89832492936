"""Budgets of sampling at computed points (grid_sample): the sample coordinates are computed from the grid in the
device dtype, so a correct kernel moves each sample point by its rounding, a few u times the coordinate in
pixels; the interpolation weights move with it. The bound is what that motion can change: weights (bilinear,
bicubic) or a nearest pick (at a half-pixel), times the largest value of the input plane.

>>> from shadow.budgets import budget_for
>>> x = torch.arange(4.0, dtype=torch.float64).reshape(1, 1, 2, 2)
>>> g = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
>>> budget_for(torch.ops.aten.grid_sampler_2d.default, (x, g, 0, 0, False), {}, [x[..., :1, :1]],
...            torch.float32).family
'elementwise'
"""

from __future__ import annotations

import torch

from ..opsets import Family
from .core import Budget, BudgetCall, gamma, overloads, register_budget

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
REFLECTION = 2
CUBIC_WEIGHTS = 1.375  # max over t of sum |w_i(t)| for the cubic convolution kernel, A = -0.75


def _pixel_coordinates(grid: torch.Tensor, sizes: list[int], align_corners: bool) -> torch.Tensor:
    """GridSampler.h's grid_sampler_unnormalize, in float64: [..., d] grid values in [-1, 1] to pixels."""
    size = torch.tensor(sizes, dtype=torch.float64)
    if align_corners:
        return (grid + 1) / 2 * (size - 1)
    return ((grid + 1) * size - 1) / 2


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
        ce = (8 if int(a["padding_mode"]) == REFLECTION else 4) * c.u * (ix.abs() + torch.tensor(sizes))
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
