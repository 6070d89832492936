"""Histogram budgets (histc, histogram, histogramdd): counts are exact where a correct kernel and the float64 one
pick the same bin, so a bin's bound is the weight of the elements that may land in it but need not (an edge flip:
within the rounding of an edge or of the position the kernel computes), plus the rounding of weight sums in the
device dtype; density divides by the total and the bins' widths; the bin edges are linspace's.

>>> from shadow.budgets import budget_for
>>> x = torch.tensor([0.5, 1.5, 1.5, 2.5], dtype=torch.float64)
>>> budget_for(torch.ops.aten.histc.default, (x,), {"bins": 3, "min": 0, "max": 3},
...            [torch.histc(x, 3, 0, 3)], torch.float32).bound[0].tolist()  # no element near an edge
[0.0, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch

from ..opsets import Family
from .core import Budget, BudgetCall, overloads, register_budget
from .elementwise import linspace_budget
from .units import gamma


def _histogram_rows(c: BudgetCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call's elements as rows of coordinates (one column; histogramdd: the last dim's) and their weights,
    rows with a non-finite coordinate dropped: the kernels never count them."""
    x, w = c.a["self"], c.a.get("weight")
    x = x.reshape(-1, x.shape[-1]) if c.plan.base.startswith("_histogramdd") else x.reshape(-1, 1)
    keep = x.isfinite().all(1)
    return x[keep], None if w is None else w.reshape(-1)[keep]


def _bin_of(pos: torch.Tensor, bins: int) -> torch.Tensor:
    """The bin at a position measured in bins from the leftmost edge (the rightmost bin holds its right edge);
    -1 and ``bins``: outside."""
    return torch.where(pos == bins, bins - 1, pos.floor()).clamp(-1, bins).long()


def _position_slack(u: float, pos: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """The error, in bins, of pos = (x - lo) * bins / (hi - lo) computed in the device dtype with lo and hi
    rounded to it."""
    return 4 * u * (pos.abs() + 1) + 2 * u * bins * (abs(lo) + abs(hi)) / (hi - lo)


def _box_sums(first: torch.Tensor, last: torch.Tensor, sizes: Sequence[int], weight: torch.Tensor) -> torch.Tensor:
    """Per bin of a histogram of ``sizes``, the sum of ``weight`` over the elements that may land in it: those whose
    bins run, in each dim d, from first[:, d] to last[:, d] (-1 and sizes[d] are outside)."""
    lo, hi = first.clamp(min=0), last.minimum(torch.tensor(sizes) - 1)
    keep = (lo <= hi).all(1)
    lo, hi, weight = lo[keep], hi[keep] + 1, weight[keep]
    padded = [s + 1 for s in sizes]
    strides = [math.prod(padded[d + 1:]) for d in range(len(sizes))]
    acc = torch.zeros(math.prod(padded), dtype=torch.float64)
    # a difference array: each box adds +-weight at its 2**D corners; prefix sums along every dim fill it in
    for corner in itertools.product((False, True), repeat=len(sizes)):
        at = sum((hi if up else lo)[:, d] * strides[d] for d, up in enumerate(corner))
        acc.index_add_(0, at, -weight if sum(corner) % 2 else weight)
    acc = acc.reshape(padded)
    for d in range(len(sizes)):
        acc = acc.cumsum(d)
    return acc[tuple(slice(s) for s in sizes)]


def _count_bound(c: BudgetCall, first: torch.Tensor, last: torch.Tensor, sizes: Sequence[int],
                 weight: torch.Tensor | None) -> torch.Tensor:
    """A bin's count (or weight sum): |w| of every element that may land in it but need not (an edge flip), plus
    the sum's rounding in the device dtype, gamma_n(u) sum|w| over the elements that may land in it, n the most
    that may land in one bin (none for counts up to 1/u: sums of ones are exact)."""
    w = torch.ones(len(first), dtype=torch.float64) if weight is None else weight.abs()
    moves = (first != last).any(1)
    bound = _box_sums(first[moves], last[moves], sizes, w[moves])
    n = float(_box_sums(first, last, sizes, torch.ones_like(w)).max())
    if weight is not None or n > 1 / c.u:
        bound += gamma(n, c.u) * _box_sums(first, last, sizes, w)
    return bound.clamp(min=0)  # the prefix sums' last-bit residue where no element may land


@register_budget(*overloads("histc"), family=Family.REDUCTION)
def histc_budget(c: BudgetCall) -> Budget:
    """Counts (HistogramKernel.cpp, LINEAR_INTERPOLATION: pos = (x - lo) * bins / (hi - lo) in the device dtype, lo
    and hi the edges rounded to it): exact where a correct kernel and the float64 one pick the same bin. An element
    may land in any bin within pos's rounding of its pos (or out, at lo and hi), so bin k's bound counts the
    elements that may land in it but need not (``_count_bound``): 0 where none may (any error is over budget)."""
    bins = int(c.a.get("bins", 100))

    def make():
        v, _ = _histogram_rows(c)
        lo, hi = float(c.a.get("min", 0)), float(c.a.get("max", 0))
        if lo == hi and v.numel():
            lo, hi = float(v.min()), float(v.max())
        if lo == hi:
            lo, hi = lo - 1, hi + 1
        pos = (v - lo) * (bins / (hi - lo))
        slack = _position_slack(c.u, pos, bins, lo, hi)
        return [_count_bound(c, _bin_of(pos - slack, bins), _bin_of(pos + slack, bins), [bins], None)]

    return c.budget(make)


@dataclasses.dataclass(frozen=True)
class _Binning:
    """Where a histogram's elements land, per element and dim: the bin the float64 kernel picks (``exact``), the
    lowest and highest a correct device kernel may pick (``first``, ``last``); per dim: the bins' widths, the device
    widths' error and the bound of the device's edges (the op's ``bin_edges``)."""

    exact: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    sizes: list[int]
    widths: list[torch.Tensor]
    width_err: list[torch.Tensor]
    edges: list[torch.Tensor]


def _linear_bins(c: BudgetCall, x: torch.Tensor, counts: Sequence[int], span: Sequence[float] | None) -> _Binning:
    """Equal bins from lo to hi (``range``, or x's extremes; widened by 1/2 where equal). The device computes the
    edges by linspace in its dtype (off by ``linspace_budget``'s bound; the ends by lo's and hi's rounding to the
    dtype) and finds an element's bin by pos, then a local search among its edges, which corrects pos's errors
    below one bin: an element within its edge's error (in bins) of an edge, plus pos's error where that reaches
    a bin, may land on either side."""
    ends = []
    for d in range(len(counts)):
        lo, hi = (float(span[2 * d]), float(span[2 * d + 1])) if span is not None else \
            (float(x[:, d].min()), float(x[:, d].max())) if len(x) else (0.0, 1.0)
        ends.append((lo - 0.5, hi + 0.5) if lo == hi else (lo, hi))
    edges = [torch.linspace(lo, hi, n + 1, dtype=torch.float64) for (lo, hi), n in zip(ends, counts)]
    bound = linspace_budget(dataclasses.replace(c, outputs=edges)).bound
    err, pos, slack = [], [], []
    for d, ((lo, hi), n) in enumerate(zip(ends, counts)):
        e = bound[d].clone()
        e[[0, -1]] = (edges[d][[0, -1]] - edges[d][[0, -1]].to(c.dtype)).abs()  # linspace returns its ends
        p = (x[:, d] - lo) * (n / (hi - lo))
        s = _position_slack(c.u, p, n, lo, hi)
        err.append(e)
        pos.append(p)
        slack.append(e[p.round().clamp(0, n).long()] * (n / (hi - lo)) + torch.where(s < 1, 0.0, s))

    def bins(shift: int) -> torch.Tensor:
        return torch.stack([_bin_of(p + shift * s, n) for p, s, n in zip(pos, slack, counts)], 1)

    widths = [e.diff() for e in edges]
    return _Binning(bins(0), bins(-1), bins(1), list(counts), widths,
                    [e[:-1] + e[1:] + c.u * w for e, w in zip(err, widths)], list(bound))


def _given_bins(c: BudgetCall, x: torch.Tensor, edges: Sequence[torch.Tensor]) -> _Binning:
    """Bins between given edges, found by binary search: the device compares its values with the same edges as
    the float64 kernel, so both pick the same bin; bin_edges is a copy (exact), each width rounded once."""
    exact = torch.stack([torch.where(x[:, d] == e[-1], len(e) - 2,
                                     torch.searchsorted(e, x[:, d].contiguous(), right=True) - 1)
                         for d, e in enumerate(edges)], 1)
    widths = [e.diff() for e in edges]
    return _Binning(exact, exact, exact, [len(e) - 1 for e in edges], widths, [c.u * w.abs() for w in widths],
                    [torch.zeros_like(e) for e in edges])


def _density_bound(c: BudgetCall, density: torch.Tensor, b: _Binning, weight: torch.Tensor | None,
                   counts: torch.Tensor) -> torch.Tensor:
    """density = h / S / prod of widths, S = sum h (a sum at ua, rounded to u), each width off by its error, each
    division rounded: the counts' bound through it, and the rest relative."""
    w = torch.ones(len(b.exact), dtype=torch.float64) if weight is None else weight
    h = _box_sums(b.exact, b.exact, b.sizes, w)
    total = float(h.sum())
    if total == 0:  # a density of 0/0: nothing to bound
        return torch.full_like(density, math.inf)
    d_total = float(counts.sum()) + gamma(h.numel(), c.ua) * float(h.abs().sum()) + c.u * abs(total)
    rel, volume = d_total / abs(total) + (1 + len(b.sizes)) * c.u, 1.0
    for d, (width, err) in enumerate(zip(b.widths, b.width_err)):
        shape = [1] * len(b.sizes)
        shape[d] = -1
        volume = volume * width.abs().reshape(shape)
        rel = rel + (err / width.abs()).reshape(shape)
    return counts / (abs(total) * volume) + density.abs() * rel


@register_budget(*overloads("histogram", "_histogramdd_from_bin_cts", "_histogramdd_from_bin_tensors"),
                 family=Family.REDUCTION)
def histogram_budget(c: BudgetCall) -> Budget:
    """Histogram.cpp, HistogramKernel.cpp: counts (or weight sums) as histc's, between edges the device computes
    (a bin count: ``_linear_bins``) or is given (``_given_bins``: exact); weights summed per bin in the device
    dtype; density divides by the total and the bins' widths. bin_edges as linspace's, or a copy."""
    def make():
        x, weight = _histogram_rows(c)
        bins = c.a["bins"]
        bins = [bins] if isinstance(bins, (int, torch.Tensor)) else list(bins)
        b = _given_bins(c, x, bins) if isinstance(bins[0], torch.Tensor) else \
            _linear_bins(c, x, [int(n) for n in bins], c.a.get("range"))
        counts = _count_bound(c, b.first, b.last, b.sizes, weight)
        if c.a.get("density"):
            counts = _density_bound(c, c.out(), b, weight, counts)
        return [counts, *b.edges][:len(c.outputs)]

    return c.budget(make)


@register_budget(*overloads("bincount"), family=Family.REDUCTION)
def bincount_budget(c: BudgetCall) -> Budget:
    """With weights: each bin the sum of its elements' weights, accumulated in the result's dtype (an exact index,
    no edge to flip): gamma_n(u) times the sum of their magnitudes, n the most elements of one bin."""
    x, w, r = c.a["self"], c.a.get("weights"), c.out()
    if w is None or not r.is_floating_point():
        return c.ulps(0.0)  # counts: exact

    def make():
        index = x.long().reshape(-1)
        n = int(torch.bincount(index).max()) if index.numel() else 0
        mag = torch.zeros_like(r).index_add_(0, index, w.abs().reshape(-1).to(r.dtype))
        return [c.final(r) + gamma(n, c.u) * mag]

    return c.budget(make)
