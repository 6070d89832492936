"""The error units of DESIGN.md, defined once: abs, ulp, rel_norm, non-finite counts, flips."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
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


def spacing(r_abs: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Spacing of ``dtype`` at each |r| (float64): 2**(e - 1 - p) for |r| in [2**(e-1), 2**e),
    the subnormal spacing below the smallest normal.

    >>> spacing(np.array([1.0, 3.0, 0.0]), torch.float32).tolist() == [2.0**-23, 2.0**-22, 2.0**-149]
    True
    """
    _, e = np.frexp(np.maximum(r_abs, torch.finfo(dtype).tiny))
    return np.ldexp(1.0, e - (1 + precision_bits(dtype)))


_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128})


def host(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU result, for reading only; a float64 copy for other devices and dtypes.

    Through DLPack, not ``Tensor.numpy()``: that marks the storage non-resizable, which would change
    what the user's program may do with its tensors (and break ``resize_`` replays on shadows)."""
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES:
        try:
            return np.from_dlpack(t.detach() if t.requires_grad else t)
        except (RuntimeError, BufferError, TypeError):  # conjugate/negative views cannot be exported
            pass
    return t.to(device="cpu", dtype=torch.complex128 if t.is_complex() else torch.float64, copy=True).numpy()


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def compare(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> ErrorStats:
    """ErrorStats of a device result ``y`` (rounded to ``dtype``) against a float64 reference ``r``.

    The arithmetic runs in numpy: per call it costs about a microsecond on small tensors, a third of a
    torch call, and this runs for every output of every op.

    >>> compare(torch.tensor([1.0 + 2**-23]), torch.tensor([1.0], dtype=torch.float64), torch.float32).max_ulp
    1.0
    """
    n = r.numel()
    if n == 0:
        return ErrorStats()
    yn, rn = host(y), host(r)
    d = np.subtract(yn, rn, dtype=rn.dtype)
    ad = np.abs(d)
    m = float(ad.max())
    stats = ErrorStats(n=n)
    if m == 0.0:
        return stats
    if not math.isfinite(m):
        fy, fr = np.isfinite(yn), np.isfinite(rn)
        same = (yn == rn) | (np.isnan(yn) & np.isnan(rn))
        stats.nonfinite_device = int(np.count_nonzero(~fy & fr))
        stats.nonfinite_reference = int(np.count_nonzero(fy & ~fr))
        stats.nonfinite_mismatch = int(np.count_nonzero(~fy & ~fr & ~same))
        both = fy & fr
        d, ad, rn = d[both], ad[both], rn[both]
        m = float(ad.max()) if ad.size else 0.0
        if m == 0.0:
            return stats
    stats.max_abs = m
    stats.max_ulp = float((ad / spacing(np.abs(rn), _real_dtype(dtype))).max())
    nd, nr = math.sqrt(float(np.vdot(d, d).real)), math.sqrt(float(np.vdot(rn, rn).real))
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
