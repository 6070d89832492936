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


def _pixel_coordinates(grid: torch.Tensor, sizes: list[int], align_corners: bool) -> torch.Tensor:
    """GridSampler.h's grid_sampler_unnormalize, in float64: [..., d] grid values in [-1, 1] to pixels."""
    size = torch.tensor(sizes, dtype=torch.float64)
    if align_corners:
        return (grid + 1) / 2 * (size - 1)
    return ((grid + 1) * size - 1) / 2


@register_budget(*overloads("grid_sampler_2d", "grid_sampler_3d"), family=Family.ELEMENTWISE)
def grid_sampler_budget(c: BudgetCall) -> Budget:
    """Each coordinate is off by ce = 4 u (|ix| + size) pixels after unnormalizing (8 u with reflection's
    fmod); bilinear: 2**d weights, each a product of d factors off by ce + 2 u, on values <= max|x| of the
    plane, plus their sum (gamma); bicubic: 4**d taps whose cubic weights move by <= 2 ce per dim (|w| sums to
    <= 1.5 per dim); nearest: exact but where a coordinate is within ce of a half pixel, where it may pick the
    neighbour (2 max|x|)."""
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
        worst = ce.amax(-1).unsqueeze(1)  # [N, 1, *out]
        taps = 4 ** d if mode == BICUBIC else 2 ** d
        weights = 1.5 ** d if mode == BICUBIC else 1.0
        motion = taps * d * 2 * (worst + 2 * c.u) if mode == BICUBIC else taps * d * (worst + 2 * c.u)
        return [(motion + gamma(taps + 2 * d + 2, c.u) * weights) * vmax + c.final(r)]

    return c.budget(make)
