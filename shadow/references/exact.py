"""Exact arithmetic: exact sums and dot products of float tensors, error-free transformations, and the
mpmath precision that everything inexact runs at.

Sums and dot products come out as exact binary numbers (no rounding at all), from float64 passes
(error-free extraction, ``math.fsum``, Dekker's two-product) with mpmath's exact integers where those
could over- or underflow; ``Exact`` carries the value and the magnitude a float64 evaluation errs by.
The derivations are in docs/references.md ("Exact sums and dot products").

>>> e = exact_sum(torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64))
>>> float(e), e.cancellation         # float64's own sum gives 0.0
(1.0, 2e+16)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import mpmath
import numpy as np
import torch
from mpmath.libmp import from_float, mpf_abs, mpf_mul, mpf_pos, mpf_shift, mpf_sum, round_nearest, to_float, to_int

from ..metrics import host

mpf = mpmath.mpf

DEFAULT_BITS = 128  # the precision promised for a result: 75 bits more than float64
GUARD_BITS = 32  # extra working bits so that a few roundings inside a formula stay below DEFAULT_BITS
METHODS = ("auto", "fsum", "mpmath")  # the paths of exact_sum and exact_dot

__all__ = [
    "DEFAULT_BITS",
    "GUARD_BITS",
    "METHODS",
    "Exact",
    "Uncovered",
    "exact_add",
    "exact_dot",
    "exact_moments",
    "exact_mul",
    "exact_sum",
    "extract_parts",
    "float64_array",
    "fsum_parts",
    "to_float64",
    "working_precision",
]


# --- precision and results ---
class working_precision:  # a context manager named as a function: a class costs less per use than a generator
    """Run mpmath at ``bits + GUARD_BITS`` bits; the previous precision comes back even on error.

    mpmath's precision is process-wide: references are computed from one thread at a time.

    >>> with working_precision(128) as prec:
    ...     mpmath.mp.prec == prec == 160
    True
    """

    __slots__ = ("_bits", "_old")

    def __init__(self, bits: int = DEFAULT_BITS):
        if bits < 64:
            raise ValueError(f"working_precision needs at least 64 bits to beat float64, got {bits}")
        self._bits = bits

    def __enter__(self) -> int:
        self._old = old = mpmath.mp.prec
        prec = self._bits + GUARD_BITS
        if prec != old:  # nested at the same precision (a spot check's elements): setting it is not free
            mpmath.mp.prec = prec
        return prec

    def __exit__(self, *exc: object) -> None:
        if mpmath.mp.prec != self._old:
            mpmath.mp.prec = self._old


def to_float64(x: mpmath.mpf) -> float:
    """``x`` correctly rounded to float64 (nearest, ties to even), subnormals and overflow included.

    mpmath's own ``float()`` rounds twice below the normal range and truncates under its default
    rounding mode, hence this.

    >>> to_float64(mpmath.fadd(1, mpmath.ldexp(1, -53), exact=True))  # a tie: to even
    1.0
    """
    raw = x._mpf_
    sign, man, exp, bc = raw
    if not man:  # zero, inf, nan
        return to_float(raw)
    if exp + bc <= -1022:  # |x| < 2**-1022: round on the subnormal grid of 2**-1074
        return math.ldexp(to_int(mpf_shift(raw, 1074), round_nearest), -1074)
    try:
        return to_float(mpf_pos(raw, 53, round_nearest), strict=True)
    except OverflowError:
        return -math.inf if sign else math.inf


@dataclasses.dataclass(frozen=True, slots=True)
class Exact:
    """One output element at high precision.

    ``value`` is exact or accurate to the working precision; ``magnitude`` is the scale of the terms
    the op's formula forms it from (sum of |terms| for a sum or dot product, ``|x| + |mean|`` in a
    normalization, ``|value|`` where the formula cannot cancel). A float64 evaluation errs by about
    ``n * 2**-53 * magnitude``, so ``cancellation = magnitude / |value|`` far above 1 flags elements
    where float64 itself can be wrong.

    >>> Exact.plain(mpmath.mpf(-2)).cancellation
    1.0
    """

    value: mpmath.mpf
    magnitude: mpmath.mpf

    @classmethod
    def plain(cls, v: mpmath.mpf) -> Exact:
        """An element whose formula cannot cancel: its magnitude is itself."""
        return cls(v, abs(v))

    def __float__(self) -> float:
        return to_float64(self.value)

    @property
    def cancellation(self) -> float:
        raw = mpf_abs(self.value._mpf_)
        if raw[1] and raw == self.magnitude._mpf_:  # a finite nonzero value that is its own magnitude (plain)
            return 1.0
        v = abs(self.value)
        if v == 0:
            return math.inf if self.magnitude > 0 else 1.0
        return float(self.magnitude / v)


class Uncovered(ValueError):
    """Input values an exact path does not take: non-finite (an IEEE special result, compared apart
    by the metrics) or integers beyond 2**53."""


# --- exact sums and dot products ---
# Products of two values that fit float32 (24-bit significands, exponents in [-149, 127]) have at
# most 48 significant bits and exponents in [-298, 255]: exact, normal float64 numbers.
_NARROW_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_EXACT_INT_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32})
_SPLIT = 134217729.0  # 2**27 + 1: Veltkamp's splitter for 53-bit significands
# Dekker's two-product is exact when nothing over- or underflows: with every nonzero |x| in
# [2**-400, 2**400], partial products stay in [2**-906, 2**801], far from both ends of float64.
_DEKKER_LO, _DEKKER_HI = 2.0**-400, 2.0**400
_FLOAT32_MAX = torch.finfo(torch.float32).max
_MAX_PARTS = 64  # an exact float64 sum spans < 2200 bits: < 42 parts of 53 bits; more is a bug


def float64_array(t: torch.Tensor | Sequence[float]) -> tuple[np.ndarray, bool]:
    """Values as a flat float64 array (an exact conversion) and whether they all fit float32."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t, dtype=torch.float64)
    if t.is_complex():
        raise Uncovered(f"exact sums take real tensors, got {t.dtype}")
    if not (t.is_floating_point() or t.dtype in _EXACT_INT_DTYPES) and t.numel() and t.abs().max().item() > 2**53:
        raise Uncovered(f"{t.dtype} values above 2**53 are not exact in float64")
    t = (t.detach() if t.requires_grad else t).reshape(-1)
    # numpy converts float32 exactly and faster than a torch op, read through host(): Tensor.numpy() would
    # leave the caller's storage non-resizable. bfloat16, float16 and integers go through torch.
    a = host(t).astype(np.float64) if t.dtype in (torch.float32, torch.float64) else t.to("cpu", torch.float64).numpy()
    if not np.isfinite(a).all():
        raise Uncovered("non-finite input: IEEE special values are compared apart")
    if t.dtype in _NARROW_DTYPES or t.dtype in _EXACT_INT_DTYPES:
        return a, True
    if a.size and np.abs(a).max() > _FLOAT32_MAX:  # (checked first: the cast would overflow)
        return a, False
    return a, bool((a.astype(np.float32).astype(np.float64) == a).all())


def _granularity(terms: np.ndarray) -> float:
    """The largest power of two g that divides every term (so the exact sum is a multiple of g)."""
    m, e = np.frexp(terms[terms != 0])  # term = m * 2**e, 0.5 <= |m| < 1: m * 2**53 is an integer
    if m.size == 0:
        return math.inf
    sig = np.abs(np.ldexp(m, 53)).astype(np.int64)
    return float(np.ldexp((sig & -sig).astype(np.float64), e - 53).min())


def fsum_parts(terms: np.ndarray) -> list[float]:
    """The exact sum of float64 ``terms`` as non-overlapping float64 parts, largest first, by repeated
    ``math.fsum`` (why it stops early: docs/references.md, "Repeated fsum")."""
    stop = 2.0**52 * _granularity(terms)
    work = terms.tolist()
    parts: list[float] = []
    s = math.fsum(work)
    while s != 0.0:
        parts.append(s)
        if abs(s) < stop:
            break
        if len(parts) == _MAX_PARTS:
            raise AssertionError("fsum expansion did not terminate")
        work.append(-s)
        s = math.fsum(work)
    return parts


def extract_parts(terms: np.ndarray) -> list[float]:
    """The exact sum of finite float64 ``terms`` as float64 parts, in a few vectorized passes (Rump,
    Ogita and Oishi's ExtractVector: docs/references.md, "Error-free extraction")."""
    p = terms
    M = max(1, math.ceil(math.log2(p.size + 2)))  # 2**M >= n + 2
    if M > 26:  # the partial sums of q stay below sigma only while n * eps < 2**(1 - M)
        return fsum_parts(p)
    parts: list[float] = []
    while True:
        mu = float(np.abs(p).max()) if p.size else 0.0
        if mu == 0.0:
            return parts
        sigma = math.ldexp(1.0, M + math.frexp(mu)[1])  # 2**M * 2**ceil(log2 mu) >= 2**M * mu
        if sigma > 2.0**1020:  # sigma + p could overflow
            raise OverflowError("terms too large for the extraction")
        if sigma < 2.0**-1000 or len(parts) == _MAX_PARTS:
            return parts + fsum_parts(p)
        q = (sigma + p) - sigma
        p = p - q
        tau = float(q.sum())
        if tau != 0.0:
            parts.append(tau)
        p = p[p != 0]


def _sum_terms(terms: np.ndarray, method: str) -> Exact | None:
    """Exact sum of finite float64 terms by the float paths, or None where only mpmath can do it."""
    a = np.abs(terms)
    top = float(a.max()) if a.size else 0.0
    mag = top * float((a / top).sum()) if top else 0.0  # scaled: no overflow warning from numpy
    try:
        parts = extract_parts(terms) if method == "auto" else fsum_parts(terms)
    except OverflowError:  # sigma or a partial sum beyond float64's range
        if method == "fsum":
            raise
        return None
    return Exact(mpmath.mp.make_mpf(mpf_sum([from_float(p) for p in parts])), mpf(mag))


def _mp_sum(raw: list) -> Exact:
    """Exact sum of raw mpf terms (``mpf_sum`` with precision 0 drops and rounds nothing)."""
    value = mpf_sum(raw)
    mag = mpf_sum(raw, 64, round_nearest, absolute=True)
    return Exact(mpmath.mp.make_mpf(value), mpmath.mp.make_mpf(mag))


def exact_sum(x: torch.Tensor | Sequence[float], *, method: str = "auto") -> Exact:
    """The exact sum of ``x`` (any real dtype, any shape); ``magnitude`` is sum |x| (in float64).

    ``method``: "auto" (vectorized error-free extraction, ``extract_parts``; mpmath where partial
    sums leave float64's range), "fsum" (repeated ``math.fsum``) or "mpmath" to force one path.
    Non-finite values (and integers beyond 2**53) raise ``Uncovered``.

    >>> float(exact_sum(torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64)))
    1.0
    """
    _check_method(method)
    a, _ = float64_array(x)
    if method != "mpmath":
        r = _sum_terms(a, method)
        if r is not None:
            return r
    return _mp_sum([from_float(v) for v in a.tolist()])


def exact_dot(a: torch.Tensor | Sequence[float], b: torch.Tensor | Sequence[float], *, method: str = "auto") -> Exact:
    """The exact dot product of two vectors (flattened); ``magnitude`` is sum |a_i b_i| (in float64).

    The products become float64 terms whose exact sum is the dot product (values that fit float32:
    the products themselves; otherwise Dekker's two-product inside a safe exponent range), then are
    summed as in ``exact_sum``; mpmath's exact integer arithmetic takes the remaining cases.
    ``method`` as in ``exact_sum``; a forced float path raises ``ValueError`` where it cannot vouch.

    >>> float(exact_dot([1e6, 1e-6, -1e6], [1.0, 1.0, 1.0])) == 1e-6   # float64: 1.00000761449337e-06
    True
    """
    _check_method(method)
    x, x_narrow = float64_array(a)
    y, y_narrow = float64_array(b)
    if x.shape != y.shape:
        raise ValueError(f"exact_dot needs vectors of one length, got {x.size} and {y.size}")
    if method != "mpmath":
        terms = _exact_products(x, y, x_narrow and y_narrow)
        r = None if terms is None else _sum_terms(terms, method)
        if r is not None:
            return r
        if method != "auto":
            raise ValueError("the float paths are not provably exact for these values (exponent range)")
    return _mp_sum([mpf_mul(from_float(p), from_float(q)) for p, q in zip(x.tolist(), y.tolist())])


def _exact_products(x: np.ndarray, y: np.ndarray, narrow: bool) -> np.ndarray | None:
    """Float64 terms whose exact sum is sum(x * y), or None where that cannot be guaranteed."""
    if narrow:
        return x * y
    for v in (x, y):
        m = np.abs(v)
        nz = m[m != 0]
        if nz.size and (nz.max() >= _DEKKER_HI or nz.min() <= _DEKKER_LO):
            return None
    # Veltkamp split and Dekker's two-product, each numpy op rounding once (no FMA contraction)
    p = x * y
    t = _SPLIT * x
    xh = t - (t - x)
    xl = x - xh
    t = _SPLIT * y
    yh = t - (t - y)
    yl = y - yh
    e = ((xh * yh - p) + xh * yl + xl * yh) + xl * yl
    return np.concatenate([p, e])


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")


def exact_add(*terms: mpmath.mpf) -> mpmath.mpf:
    """The exact sum of mpf numbers (no rounding, whatever mpmath's precision)."""
    return mpmath.mp.make_mpf(mpf_sum([t._mpf_ for t in terms]))


def exact_mul(a: mpmath.mpf, b: mpmath.mpf) -> mpmath.mpf:
    """The exact product of two mpf numbers (no rounding, whatever mpmath's precision)."""
    return mpmath.mp.make_mpf(mpf_mul(a._mpf_, b._mpf_))


def exact_moments(x: torch.Tensor) -> tuple[Exact, Exact, mpmath.mpf]:
    """(sum, sum of squares, N sum(x^2) - sum(x)^2) of the values of ``x``, all exact: the numerator of
    N^2 times the biased variance, free of the cancellation of E[x^2] - E[x]^2."""
    s, s2 = exact_sum(x), exact_dot(x, x)
    return s, s2, exact_add(exact_mul(mpf(x.numel()), s2.value), -exact_mul(s.value, s.value))
