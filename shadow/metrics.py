"""The error units of DESIGN.md, defined once: abs, ulp, rel_norm, non-finite counts, flips."""

from __future__ import annotations

import dataclasses
import math

import torch

_INF = float("inf")


@dataclasses.dataclass(slots=True)
class ErrorStats:
    """Error of a device result against a float64 reference (one op call; several outputs merge).

    ``max_ulp`` is in units of the device dtype's spacing at the reference value; ``rel_norm`` is
    ``||y - r||_2 / ||r||_2`` of the worst output. Non-finite elements are counted apart and left out
    of the other figures: ``nonfinite_device`` where the device is NaN/Inf and the reference finite,
    ``nonfinite_reference`` the reverse, ``nonfinite_mismatch`` where both are non-finite but differ.
    """

    max_abs: float = 0.0
    max_ulp: float = 0.0
    rel_norm: float = 0.0
    n: int = 0
    nonfinite_device: int = 0
    nonfinite_reference: int = 0
    nonfinite_mismatch: int = 0

    @property
    def nonfinite(self) -> int:
        return self.nonfinite_device + self.nonfinite_reference + self.nonfinite_mismatch

    @property
    def exact(self) -> bool:
        return self.max_abs == 0.0 and self.nonfinite == 0

    def merge(self, other: ErrorStats) -> None:
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_ulp = max(self.max_ulp, other.max_ulp)
        self.rel_norm = max(self.rel_norm, other.rel_norm)
        self.n += other.n
        self.nonfinite_device += other.nonfinite_device
        self.nonfinite_reference += other.nonfinite_reference
        self.nonfinite_mismatch += other.nonfinite_mismatch

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def precision_bits(dtype: torch.dtype) -> int:
    """Stored mantissa bits p of a floating dtype (23 for float32): spacing at 1.0 is 2**-p."""
    return -round(math.log2(torch.finfo(dtype).eps))


def spacing(r_abs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at each |r| (float64): 2**(e - 1 - p) for |r| in [2**(e-1), 2**e),
    the subnormal spacing below the smallest normal."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(r_abs.clamp_min(fi.tiny))
    return torch.pow(2.0, (e - (1 + precision_bits(dtype))).to(torch.float64))


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def compare(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> ErrorStats:
    """ErrorStats of a device result ``y`` (rounded to ``dtype``) against a float64 reference ``r``.

    >>> compare(torch.tensor([1.0 + 2**-23]), torch.tensor([1.0], dtype=torch.float64), torch.float32).max_ulp
    1.0
    """
    n = r.numel()
    if n == 0:
        return ErrorStats()
    y = y.to(device="cpu", dtype=r.dtype)
    d = y - r
    m = torch.linalg.vector_norm(d, _INF).item()
    if m == 0.0:
        return ErrorStats(n=n)
    stats = ErrorStats(n=n)
    if not math.isfinite(m):
        fy, fr = torch.isfinite(y), torch.isfinite(r)
        same = (y == r) | (torch.isnan(y) & torch.isnan(r))
        stats.nonfinite_device = int((~fy & fr).sum())
        stats.nonfinite_reference = int((fy & ~fr).sum())
        stats.nonfinite_mismatch = int((~fy & ~fr & ~same).sum())
        both = fy & fr
        d, r = d[both], r[both]
        if d.numel() == 0:
            return stats
        m = torch.linalg.vector_norm(d, _INF).item()
        if m == 0.0:
            return stats
    stats.max_abs = m
    ra = r.abs()
    stats.max_ulp = (d.abs() / spacing(ra, _real_dtype(dtype))).max().item()
    nd, nr = torch.linalg.vector_norm(d).item(), torch.linalg.vector_norm(r).item()
    stats.rel_norm = nd / nr if nr > 0 else _INF
    return stats


def count_flips(y: torch.Tensor, r: torch.Tensor) -> int:
    """Elements where a discrete (integer/bool) device result differs from the reference's."""
    if y.numel() == 0:
        return 0
    y = y.to("cpu")
    if y.shape != r.shape:
        return y.numel()
    return int((y != r).sum())
