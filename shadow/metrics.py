"""The error units, defined once (docs/error-units.md): abs, ulp, rel_norm, non-finite counts, flips."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, Iterable

import numpy as np
import torch

from .savedform import COUNT, FIGURE, Fields, Maybe
from .scratch import copy

# The fused comparison pass and the budgets' one-pass kernels need numba; without it (no wheel for the platform, a
# broken install) compare and the budgets take the numpy and torch paths: slower, the same figures.
# FUSED_UNAVAILABLE says why.
try:
    from . import _fused as fused, _fused_bounds as fused_bounds
except Exception as exc:  # numba raises ImportError; a broken llvmlite, others
    fused = fused_bounds = None
    FUSED_UNAVAILABLE: str | None = f"{type(exc).__name__}: {exc}"
else:
    FUSED_UNAVAILABLE = None

_INF = float("inf")
_ulp = math.ulp  # a global, not an attribute lookup: the tiny outputs' loop calls it per element


@dataclasses.dataclass(slots=True)
class ErrorStats:
    """Error of a device result against a float64 reference (one op call; several outputs merge).

    ``max_ulp`` is in units of the device dtype's spacing at the reference value; ``rel_norm`` is
    ``||y - r||_2 / ||r||_2`` of the worst output. Non-finite elements are counted apart and left out
    of the other figures: ``nonfinite_device`` where the device is NaN/Inf and the reference finite,
    ``nonfinite_reference`` the reverse, ``nonfinite_mismatch`` where both are non-finite but differ,
    ``nonfinite_agreed`` where both are the same NaN or infinity (no error: the math itself is non-finite).

    A reference that is exactly 0 where the device is not (the gradient of ``sum(BatchNorm(x))``) has the
    subnormal spacing as its ulp, so any error there reads 1e30+ ulp: honest, but no measure of accuracy.
    Such elements are counted in ``zero_reference``, and ``max_ulp_nonzero`` is the max ulp over the
    others; judge the zero ones by ``max_abs`` and the budget.
    """

    max_abs: float = 0.0
    max_ulp: float = 0.0
    rel_norm: float = 0.0
    n: int = 0
    nonfinite_device: int = 0
    nonfinite_reference: int = 0
    nonfinite_mismatch: int = 0
    nonfinite_agreed: int = 0  # non-finite in both, alike: not an error, but where NaN/Inf is born or flows
    norm: float = 0.0  # ||y - r||_2 over the finite elements (all outputs)
    budget_used: float | None = None  # max(abs / bound) under the op's budget (shadow.budgets); > 1: over
    effective_bits: float | None = None  # mantissa bits that explain the error under the budget's scale
    zero_reference: int = 0  # elements whose reference is exactly 0 where the device is not
    max_ulp_nonzero: float | None = None  # max ulp over the other elements (None: no zero reference, = max_ulp)

    @property
    def nonfinite(self) -> int:
        return self.nonfinite_device + self.nonfinite_reference + self.nonfinite_mismatch

    @property
    def device_nonfinite(self) -> int:
        """Elements where the device result is NaN or infinite (whatever the reference is)."""
        return self.nonfinite_device + self.nonfinite_mismatch + self.nonfinite_agreed

    @property
    def reference_nonfinite(self) -> int:
        """Elements where the float64 reference is NaN or infinite."""
        return self.nonfinite_reference + self.nonfinite_mismatch + self.nonfinite_agreed

    @property
    def ulp_nonzero(self) -> float:
        """max ulp over the elements whose reference is not 0 (``max_ulp`` when there are none such)."""
        return self.max_ulp if self.max_ulp_nonzero is None else self.max_ulp_nonzero

    @property
    def exact(self) -> bool:
        return self.max_abs == 0.0 and self.nonfinite == 0

    def merge(self, other: ErrorStats) -> None:
        if self.zero_reference or other.zero_reference:
            self.max_ulp_nonzero = max(self.ulp_nonzero, other.ulp_nonzero)
            self.zero_reference += other.zero_reference
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_ulp = max(self.max_ulp, other.max_ulp)
        self.rel_norm = max(self.rel_norm, other.rel_norm)
        self.norm = math.hypot(self.norm, other.norm)
        if other.budget_used is not None:
            self.budget_used = max(self.budget_used or 0.0, other.budget_used)
        self.n += other.n
        self.nonfinite_device += other.nonfinite_device
        self.nonfinite_reference += other.nonfinite_reference
        self.nonfinite_mismatch += other.nonfinite_mismatch
        self.nonfinite_agreed += other.nonfinite_agreed

    def to_dict(self) -> dict:
        """The saved form (``ERROR_STATS``)."""
        return ERROR_STATS.write(self, "stats")


def merged(stats: Iterable[ErrorStats | None]) -> ErrorStats | None:
    """Merge the stats of several outputs into one (None if there are none). The stats of a call with one
    output are returned as they are, not copied."""
    present = [s for s in stats if s is not None]
    if len(present) <= 1:
        return present[0] if present else None
    out = ErrorStats()
    for s in present:
        out.merge(s)
    return out


ERROR_STATS = Fields("ErrorStats", {  # the saved form (shadow.reportformat)
    "max_abs": FIGURE, "max_ulp": FIGURE, "rel_norm": FIGURE, "n": COUNT, "nonfinite_device": COUNT,
    "nonfinite_reference": COUNT, "nonfinite_mismatch": COUNT, "nonfinite_agreed": COUNT, "norm": FIGURE,
    "budget_used": Maybe(FIGURE), "effective_bits": Maybe(FIGURE), "zero_reference": COUNT,
    "max_ulp_nonzero": Maybe(FIGURE)}, ErrorStats)


@functools.cache  # finfo and log2 cost more than the figures a tiny comparison computes from it
def precision_bits(dtype: torch.dtype) -> int:
    """Stored mantissa bits p of a floating dtype (23 for float32): spacing at 1.0 is 2**-p."""
    return -round(math.log2(torch.finfo(dtype).eps))


_EXP_BITS = 0x7FF0000000000000  # the exponent field of a float64


def spacing(r: torch.Tensor, dtype: torch.dtype, times: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """``times`` spacings of ``dtype`` at each |r| (r a float64 tensor, or complex128: its modulus; the sign
    of a real r is never read):
    2**(e - p) for |r| in [2**e, 2**(e+1)), the subnormal spacing below the smallest normal. One new
    tensor, written in place (a fresh large tensor costs more in page faults than the arithmetic), or
    ``out`` (float64, r's shape and layout).

    >>> s = spacing(torch.tensor([1.0, -3.0, 0.0], dtype=torch.float64), torch.float32)
    >>> s.tolist() == [2.0**-23, 2.0**-22, 2.0**-149]
    True
    """
    if r.is_complex():
        r = r.abs()
    tiny, scale = torch.finfo(dtype).tiny, times * 2.0 ** -precision_bits(dtype)
    spaced = None if fused is None else fused.spacing(r, out, tiny, scale)  # one pass, the same figures
    if spaced is not None:
        return spaced
    floor = _pow2_floor(r, torch) if out is None else \
        torch.bitwise_and(r.view(torch.int64), _EXP_BITS, out=out.view(torch.int64)).view(torch.float64)
    return floor.clamp_min_(tiny).mul_(scale)


def _pow2_floor(r: Any, xp: Any) -> Any:
    """2**floor(log2|r|) for finite float64 r (0 below the normal range), exactly: the exponent bits of r
    kept, the sign and mantissa cleared. One pass, where frexp + ldexp take four."""
    return (r.view(xp.int64) & _EXP_BITS).view(xp.float64)


_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128})


def host(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU result, for reading only; a float64 copy for other devices and dtypes.

    Through DLPack, not ``Tensor.numpy()``: that marks the storage non-resizable, which would change
    what the user's program may do with its tensors (and break ``resize_`` replays on shadows)."""
    if t.is_cpu and t.dtype in _NUMPY_DTYPES:
        try:
            return np.from_dlpack(t.detach() if t.requires_grad else t)
        except (RuntimeError, BufferError, TypeError):  # conjugate/negative views cannot be exported
            pass
    return copy(t, torch.complex128 if t.is_complex() else torch.float64, "cpu").numpy()


_TINY = 64  # elements: below this a Python loop beats numpy's and torch's calls (scalars, biases, optimizer steps)
_LOOP_FUSED = 16  # ... and with numba, up to this only: its pass has a fixed cost the loop passes here
_SMALL = 1 << 14  # without numba: below this per-call overhead dominates (numpy); above, memory traffic (torch)


class _Scratch(threading.local):
    """Reused float64/int64 buffers for large comparisons on the CPU: a fresh 8 MB tensor costs ~10x its copy
    in page faults. Thread-local, since backward can run on autograd's device threads. Other devices get fresh
    buffers from their caching allocators."""

    def __init__(self) -> None:
        self.f = torch.empty(0, dtype=torch.float64)
        self.i = torch.empty(0, dtype=torch.int64)

    def get(self, shape: torch.Size, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device.type != "cpu":
            return (torch.empty(shape, dtype=torch.float64, device=device),
                    torch.empty(shape, dtype=torch.int64, device=device))
        if self.f.numel() < n:
            self.f = torch.empty(n, dtype=torch.float64)
            self.i = torch.empty(n, dtype=torch.int64)
        return self.f[:n].view(shape), self.i[:n].view(shape)


_scratch = _Scratch()


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def compare(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, bound: Any = None) -> ErrorStats:
    """ErrorStats of a device result ``y`` (rounded to ``dtype``) against a float64 reference ``r``;
    with an error ``bound`` (float64, broadcastable to r), also ``budget_used`` = max(abs / bound). The bound
    may be a formula instead (``shadow.budgets.core.UlpsPlus``: ulps of the dtype at r plus an operand term),
    which the fused pass forms where it reads r and the other paths compute as a tensor (the same bits).

    >>> compare(torch.tensor([1.0 + 2**-23]), torch.tensor([1.0], dtype=torch.float64), torch.float32).max_ulp
    1.0
    """
    n = r.numel()
    if n == 0:
        return ErrorStats() if bound is None else ErrorStats(budget_used=0.0)
    complex_ = y.is_complex() or r.is_complex()
    on_device = _off_cpu(r)  # a reference where the shadows live off the CPU (shadow_device=)
    # complex results: numpy (the modulus is a pass of its own; rare)
    # a formula is formed where the fused pass reads r: the loop would need its tensor first, three passes of torch
    if (n > _LOOP_FUSED or not (bound is None or isinstance(bound, torch.Tensor))) and fused is not None \
            and not complex_ and not on_device:
        return _compare_fused(y, r, dtype, n, bound)
    if bound is not None and not isinstance(bound, torch.Tensor):  # a formula: its tensor
        bound = bound.tensor(r)
    if bound is not None and on_device and bound.device != r.device and bound.dim():
        bound = bound.to(r.device)  # a budget rule's CPU tensor (0-d ones mix with any device as they are)
    if n <= _TINY and not on_device:
        return _compare_loop(y, _flat_list(y), r, dtype, n, bound)
    if bound is not None and bound.shape != r.shape:
        bound = bound.expand(r.shape)
    if n <= _TINY:
        stats = _compare_python(*_flat_lists(y, r, bound), dtype=dtype, n=n)
    elif on_device and not complex_:  # the torch passes where the reference lives, its figures read back once
        stats = _compare_torch(y.detach(), r, dtype, n, bound)
    elif complex_ or n <= _SMALL:  # flat: 0-d arithmetic would give numpy scalars
        stats = _compare_numpy(host(y).reshape(-1), host(r).reshape(-1), dtype, n,
                               None if bound is None else host(bound).reshape(-1))
    else:
        stats = _compare_torch(y.detach(), r, dtype, n, bound)
    return _zeros_checked(stats, y, r, dtype)


def compare_pair(y: torch.Tensor, r: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype, bound: Any = None
                 ) -> tuple[ErrorStats, ErrorStats]:
    """``(compare(y, r, dtype), compare(y, lo, dtype, bound))``: one result's drift and local figures, y's values
    read once where both take the Python loop (a few elements on the CPU, a bound that is a tensor if any) or
    both the fused pass (real results on the CPU above the loop's size, ``shadow._fused.pair``)."""
    n = r.numel()
    if 0 < n <= _LOOP_FUSED and lo.shape == r.shape and (bound is None or isinstance(bound, torch.Tensor)) \
            and not _off_cpu(r) and not _off_cpu(lo) and (bound is None or not _off_cpu(bound)):
        yl = _flat_list(y)
        return _compare_loop(y, yl, r, dtype, n, None), _compare_loop(y, yl, lo, dtype, n, bound)
    # the fused pass's condition in compare (real results on the CPU, above the loop's size or with a formula)
    if fused is None or n == 0 or lo.shape != r.shape or (n <= _LOOP_FUSED and isinstance(bound, torch.Tensor)) \
            or _off_cpu(r) or _off_cpu(lo) or y.is_complex() or r.is_complex() or lo.is_complex():
        return compare(y, r, dtype), compare(y, lo, dtype, bound)
    drift, local = part_figures(y, r, lo, dtype, bound)
    return _fused_stats(drift, n, False, dtype), _fused_stats(local, n, bound is not None, dtype)


def part_figures(y: torch.Tensor, r: torch.Tensor | None, lo: torch.Tensor, dtype: torch.dtype, bound: Any = None
                 ) -> tuple[list | None, list]:
    """The fused pass's raw figures (``shadow._fused.FIGURES``) of a result, or one part of it: against its shadow
    ``r`` (None: no drift figures) and, with the bound, against its local reference ``lo``; ``joined_stats`` turns
    the parts of one result into its ``compare``. For real CPU results when numba is there (``can_join``)."""
    b, scale, alpha, op, other = _pass_bound(bound, lo, dtype)
    tiny = _consts(dtype)[0]
    if r is None:
        return None, fused.figures(y, lo, b, tiny, scale, alpha, op, other)
    return fused.pair(y, r, lo, b, tiny, scale, alpha, op, other)


def can_join(t: torch.Tensor) -> bool:
    """Whether ``part_figures`` reads tensors like ``t``: real, on the CPU, numba there."""
    return fused is not None and not t.is_complex() and not _off_cpu(t)


def joined_stats(parts: list[list], n: int, bounded: bool, dtype: torch.dtype) -> ErrorStats:
    """The ErrorStats of a result of ``n`` elements from its parts' figures (``part_figures``), in their order:
    sums added, maxima taken, as the fused pass joins its own chunks."""
    return _fused_stats(fused.joined(parts), n, bounded, dtype)


def _compare_loop(y: torch.Tensor, yl: list, r: torch.Tensor, dtype: torch.dtype, n: int,
                  bound: torch.Tensor | None) -> ErrorStats:
    """compare's Python loop over a CPU reference of n <= _TINY elements, y's values read already (``yl``)."""
    if bound is not None and bound.shape != r.shape:
        bound = bound.expand(r.shape)
    stats = _compare_python(yl, _flat_list(r), None if bound is None else _flat_list(bound), dtype, n)
    return _zeros_checked(stats, y, r, dtype)


def _zeros_checked(stats: ErrorStats, y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> ErrorStats:
    """``stats``, where an error of at least the value's own magnitude somewhere (rare) asks whether some
    references are exactly 0."""
    if stats.max_ulp >= _consts(dtype)[1]:
        _zero_references(stats, y, r, dtype)
    return stats


def _off_cpu(r: torch.Tensor) -> bool:
    """Whether a reference lives off the CPU, where numba cannot read it (a function: tests take the device path
    on the CPU by replacing it)."""
    return not r.is_cpu


def _zero_references(stats: ErrorStats, y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> None:
    """Count the elements whose reference is exactly 0 where the device is not, and the max ulp of the rest."""
    yc = copy(y, r.dtype, r.device).reshape(-1)
    rc = r.reshape(-1)
    d = (yc - rc).abs()
    finite = torch.isfinite(d)
    zero = (rc == 0) & (d != 0) & finite
    count = int(zero.sum())
    if not count:
        return
    rest = ~zero & finite
    unit = _pow2_floor(rc.abs()[rest], torch).clamp_min_(torch.finfo(_real_dtype(dtype)).tiny)
    stats.zero_reference = count
    stats.max_ulp_nonzero = float((d[rest] / unit).max()) * _consts(dtype)[1] if bool(rest.any()) else 0.0


def _flat_list(t: torch.Tensor) -> list:
    if t.dim() == 1:
        return t.tolist()
    return [t.item()] if t.dim() == 0 else t.reshape(-1).tolist()


def _flat_lists(y: torch.Tensor, r: torch.Tensor, bound: torch.Tensor | None) -> tuple[list, list, list | None]:
    """``_flat_list`` of y, r (and the bound) of a reference off the CPU, read back in one transfer: y upcast
    exactly to r's dtype beside r, where r lives."""
    n = r.numel()
    parts = [copy(y, r.dtype, r.device).reshape(-1), r.reshape(-1)]
    if bound is not None:
        parts.append(bound.to(device=r.device, dtype=r.dtype).reshape(-1))
    values = torch.cat(parts).tolist()
    return values[:n], values[n:2 * n], values[2 * n:] if bound is not None else None


def _finish(stats: ErrorStats, m: float, nd: float, nr: float, ulp_unit_max: float, dtype: torch.dtype) -> ErrorStats:
    stats.max_abs = m
    stats.norm = nd
    stats.rel_norm = nd / nr if nr > 0 else _INF
    stats.max_ulp = ulp_unit_max * _consts(dtype)[1]
    return stats


def _compare_fused(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, n: int, bound: Any) -> ErrorStats:
    """Real results above the tiny size: every figure from one read of y and r (shadow._fused), where the
    paths below read them nine times."""
    return _fused_stats(part_figures(y, None, r, dtype, bound)[1], n, bound is not None, dtype)


def _pass_bound(bound: Any, r: torch.Tensor, dtype: torch.dtype) -> tuple:
    """A bound as the fused pass takes it: (tensor or None, scale, alpha, op, other operand). A formula in the
    pass's units is formed there from its operand term; any other is made a tensor first."""
    if bound is None or isinstance(bound, torch.Tensor):
        return bound, 0.0, 1.0, "", None
    if bound.dtype == _real_dtype(dtype) and not bound.term.is_complex() and \
            (bound.other is None or not bound.other.is_complex()):
        return bound.term, bound.scale, bound.alpha, bound.op, bound.other
    return bound.tensor(r), 0.0, 1.0, "", None


def _fused_stats(f: list[float], n: int, bounded: bool, dtype: torch.dtype) -> ErrorStats:
    """The ErrorStats of the fused pass's figures ``f`` (``bounded``: with a budget's bound)."""
    scale = _consts(dtype)[1]
    stats = ErrorStats(n=n, budget_used=0.0 if bounded else None,
                       nonfinite_device=int(f[fused.DEVICE]), nonfinite_reference=int(f[fused.REFERENCE]),
                       nonfinite_mismatch=int(f[fused.MISMATCH]), nonfinite_agreed=int(f[fused.AGREED]))
    m = f[fused.MAX_ABS]
    if m == 0.0:
        return stats
    if bounded:
        stats.budget_used = f[fused.BUDGET]
    _finish(stats, m, math.sqrt(f[fused.SUM_D2]), math.sqrt(f[fused.SUM_R2]), f[fused.MAX_ULP], dtype)
    # zero references reported under the same condition as compare's other paths check for them
    if stats.max_ulp >= scale and f[fused.ZERO]:
        stats.zero_reference = int(f[fused.ZERO])
        stats.max_ulp_nonzero = f[fused.MAX_ULP_NONZERO] * scale
    return stats


def _compare_python(yl: list, rl: list, bl: list | None, dtype: torch.dtype, n: int) -> ErrorStats:
    # comparisons rather than max() calls: this loop serves most small outputs (complex ones: abs is the modulus)
    stats = ErrorStats(n=n, budget_used=None if bl is None else 0.0)
    tiny, _ = _consts(dtype)
    m = nd2 = nr2 = unit_max = used = 0.0
    i = -1
    for a, b in zip(yl, rl):
        i += 1
        d = abs(a - b)
        ab = abs(b)
        if d == 0.0:
            nr2 += ab * ab
            continue
        if not d < _INF:  # NaN or Inf: count it apart (a finite difference that overflows is an error)
            fa, fb = math.isfinite(abs(a)), ab < _INF
            if fa and fb:
                pass
            elif not fa and fb:
                stats.nonfinite_device += 1
                continue
            elif fa:
                stats.nonfinite_reference += 1
                continue
            else:
                same = a == b or (a != a and b != b)
                stats.nonfinite_mismatch += not same
                stats.nonfinite_agreed += same
                continue
        if d > m:
            m = d
        nd2 += d * d
        nr2 += ab * ab
        # math.ulp(x) * 2**52 is 2**floor(log2 x) for normal float64 x: the spacing unit of _pow2_floor
        unit = _ulp(ab) * 4503599627370496.0
        q = d / (unit if unit > tiny else tiny)
        if q > unit_max:
            unit_max = q
        if bl is not None:
            c = bl[i]
            q = d / c if c > 0 else _INF
            if q > used:
                used = q
    if m == 0.0:
        return stats
    if bl is not None:
        stats.budget_used = used
    return _finish(stats, m, math.sqrt(nd2), math.sqrt(nr2), unit_max, dtype)


@functools.cache  # finfo costs more than a comparison
def _consts(dtype: torch.dtype) -> tuple[float, float]:
    """(smallest normal, 2**p) of a dtype's real part."""
    real = _real_dtype(dtype)
    return torch.finfo(real).tiny, 2.0 ** precision_bits(real)


@np.errstate(all="ignore")  # inf - inf and 0/0 are counted below, never printed into the user's stderr
def _compare_numpy(yn: np.ndarray, rn: np.ndarray, dtype: torch.dtype, n: int, bn: np.ndarray | None = None) -> ErrorStats:
    ad = np.abs(yn - rn)  # float64 (the modulus for complex results)
    m = float(ad.max())
    stats = ErrorStats(n=n, budget_used=None if bn is None else 0.0)
    if m == 0.0:
        return stats
    if not math.isfinite(m):
        both = _count_nonfinite(stats, yn, rn, np.isfinite, np.isnan, lambda b: int(np.count_nonzero(b)))
        ad, rn = ad[both], rn[both]
        bn = bn[both] if bn is not None else None
        m = float(ad.max()) if ad.size else 0.0
        if m == 0.0:
            return stats
    ra = np.abs(rn)
    if bn is not None:  # 0/0 (exact where the bound is 0) reads 0, x/0 inf
        stats.budget_used = float(np.nan_to_num(ad / bn, nan=0.0, posinf=_INF).max())
    unit = np.maximum(_pow2_floor(rn if rn.dtype == np.float64 else ra, np), torch.finfo(_real_dtype(dtype)).tiny)
    return _finish(stats, m, _norm(ad), _norm(ra), float((ad / unit).max()), dtype)


def _norm(a: np.ndarray) -> float:
    """||a||_2 of a small real array by a plain reduction: never BLAS (np.vdot, np.dot), whose thread pool
    takes every core and on a loaded machine made a 64k-element dot cost ms instead of us."""
    return math.sqrt(float(np.add.reduce(a * a)))


def _compare_torch(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, n: int,
                   bound: torch.Tensor | None = None) -> ErrorStats:
    """Large real results, and every real result whose reference is off the CPU: nine passes (two more with a
    bound) on r's device, on every core. The figures are computed whatever they show and read back together,
    one host sync (the rare non-finite and 0/0 cases read more)."""
    d, e = _scratch.get(r.shape, n, r.device)
    d.copy_(y)  # exact upcast, then the difference in place (a mixed-dtype sub is 3x slower)
    d.sub_(r)
    figures = list(torch.aminmax(d))
    if bound is not None:
        q = torch.div(d, bound, out=e.view(torch.float64))
        figures += torch.aminmax(q)
    figures += [torch.linalg.vector_norm(d), torch.linalg.vector_norm(r)]
    unit = torch.bitwise_and(r.view(torch.int64), _EXP_BITS, out=e).view(torch.float64)  # after q's pass
    unit.clamp_min_(torch.finfo(dtype).tiny)  # spacing / 2**-p: a power of two, so the division is exact
    figures += torch.aminmax(d.div_(unit))
    values = torch.stack(figures).tolist()
    lo, hi = values[0], values[1]
    m = max(-lo, hi)
    stats = ErrorStats(n=n, budget_used=None if bound is None else 0.0)
    if m == 0.0:
        return stats
    if not math.isfinite(m):  # rare: redo it on the elements where both are finite
        yc = copy(y, torch.float64, r.device)
        both = _count_nonfinite(stats, yc, r, torch.isfinite, torch.isnan, lambda b: int(b.sum()))
        if not bool(both.any()):
            return stats
        return _compare_torch_finite(stats, yc[both], r[both], dtype, None if bound is None else bound[both])
    if bound is not None:
        used = max(-values[2], values[3])
        if math.isnan(used):  # 0/0: exact where the bound is 0 (rare: a second pass only then)
            q = torch.div(copy(y, torch.float64, r.device) - r, bound)
            lo, hi = torch.aminmax(q.nan_to_num_(nan=0.0, posinf=_INF, neginf=-_INF))
            used = max(-lo.item(), hi.item())
        stats.budget_used = used
    nd, nr, ulo, uhi = values[-4:]
    return _finish(stats, m, nd, nr, max(-ulo, uhi), dtype)


def _compare_torch_finite(stats: ErrorStats, y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype,
                          bound: torch.Tensor | None) -> ErrorStats:
    d = (y - r).abs_()
    m = d.max().item()
    if m == 0.0:
        return stats
    if bound is not None:
        stats.budget_used = (d / bound).nan_to_num_(nan=0.0, posinf=_INF).max().item()
    unit = _pow2_floor(r, torch).clamp_min_(torch.finfo(dtype).tiny)
    return _finish(stats, m, torch.linalg.vector_norm(d).item(), torch.linalg.vector_norm(r).item(),
                   (d / unit).max().item(), dtype)


def _count_nonfinite(stats: ErrorStats, y: Any, r: Any, isfinite, isnan, count) -> Any:
    """Count the non-finite disagreements into ``stats``; return the mask of elements finite in both."""
    fy, fr = isfinite(y), isfinite(r)
    same = (y == r) | (isnan(y) & isnan(r))
    stats.nonfinite_device = count(~fy & fr)
    stats.nonfinite_reference = count(fy & ~fr)
    stats.nonfinite_mismatch = count(~fy & ~fr & ~same)
    stats.nonfinite_agreed = count(~fy & ~fr & same)
    return fy & fr


def count_flips(y: torch.Tensor, r: torch.Tensor) -> int:
    """Elements where a discrete (integer/bool) device result differs from the reference's."""
    if y.numel() == 0:
        return 0
    y = y.to(r.device)
    if y.shape != r.shape:
        return y.numel()
    return int((y != r).sum())

