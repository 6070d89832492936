"""The budgets' units: unit roundoffs and accumulation dtypes, the gamma_n factor of n roundings, and
:func:`effective_bits`, the error model that turns a call's local error into bits (docs/budgets.md).
"""

from __future__ import annotations

import functools
import math

import torch

from ..metrics import precision_bits
from ..opsets import Family


@functools.cache
def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2**-(p+1) for a dtype with p stored mantissa bits (the real part's, for complex dtypes).

    >>> unit_roundoff(torch.float32) == 2.0**-24, unit_roundoff(torch.bfloat16) == 2.0**-8
    (True, True)
    """
    if dtype.is_complex:
        dtype = dtype.to_real()
    return 2.0 ** -(precision_bits(dtype) + 1)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision PyTorch kernels accumulate in for ``dtype`` (at::opmath_type): float32 for the halves."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def gamma(n: float, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the worst-case relative error of n chained roundings
    (any summation order; inf once n u >= 1, where the worst case says nothing).

    >>> gamma(3, 2.0**-24) == 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    True
    """
    nu = n * u
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


def subnormal_min(dtype: torch.dtype) -> float:
    fi = torch.finfo(dtype.to_real() if dtype.is_complex else dtype)
    return fi.tiny * fi.eps


# mean of delta**2 / u**2 for a round-to-nearest relative error delta when mantissas are log-uniformly
# distributed (Benford): the absolute error is uniform in +-ulp/2, so E[delta**2] = u**2/3 * E[1/m**2] with
# m in [1, 2) of density 1/(m ln 2), E[1/m**2] = 3/(8 ln 2).
KAPPA = 1.0 / (8.0 * math.log(2.0))

# exp and log kernels: a few ulps of the compute type each (vectorized SLEEF u10 and glibc are <= 1-2 ulps)
EXP_ULPS = 4.0

# families whose bound is gamma_n times a sum of magnitudes (the rest round once per element)
SUM_FAMILIES = frozenset({Family.REDUCTION, Family.MATMUL, Family.CONV, Family.NORM, Family.LOSS, Family.ATTENTION,
                          Family.FFT})


def accumulation_sq(K: int, terms_sq: float, result_sq: float) -> float:
    """Estimated sum of the squared partial sums s_1..s_K of K-term inner products accumulated in
    sequence (BLAS and oneDNN kernels run K in order per output, one rounding per step with FMA), over
    all outputs, given sum t**2 over every term t and sum c**2 over every result c. With the terms in
    random order the partial sums form a Brownian bridge from 0 to c: E[s_j**2] = (j/K)**2 c**2 +
    (j/K)(1 - j/K) V, V = sum t**2 - c**2 / K; summed over j: K/3 c**2 + K/6 V."""
    if K <= 0:  # empty inner products: no accumulation
        return 0.0
    return K / 3.0 * result_sq + K / 6.0 * max(terms_sq - result_sq / K, 0.0)


def effective_bits(err_sq_sum: float, scale_sq_sum: float, acc_sq_sum: float = 0.0,
                   dtype: torch.dtype | None = None, n_out: int = 1) -> float:
    """The stored mantissa bits p that explain an observed error, under the model "every quantity the op
    is sensitive to is rounded once to p bits, independently, and the op's long sums accumulate as a
    correct kernel in ``dtype`` would": p = -log2(u_eff) - 1 with

        u_eff**2 = ( sum(err**2) / KAPPA  -  ua**2 * ACC ) / sum(T**2)

    T runs over those quantities (the rule's scale), ACC (``acc_sq_sum``) is the sum of the squared partial
    sums a sequential accumulation rounds (:func:`accumulation_sq`), ua the unit roundoff of ``dtype``'s
    accumulation type; what is subtracted is ACC's expectation plus three deviations of its scatter over
    ``n_out`` outputs. A correctly rounded float32 op reads ~23, a matmul on TF32-rounded inputs ~10; with
    a ``dtype`` the figure never exceeds its stored bits. The model and why it is not the worst case solved
    for u: docs/budgets.md.

    Returns inf for an exact result, -inf for an error where the scale is 0, nan where the scale is not
    finite (non-finite inputs).

    >>> round(effective_bits(KAPPA * 2.0**-22, 1.0), 6)   # errors of u = 2**-11 in rms: 10 bits
    10.0
    """
    if not math.isfinite(scale_sq_sum) or not math.isfinite(acc_sq_sum) or math.isnan(err_sq_sum):
        return math.nan
    if err_sq_sum <= 0.0:
        return math.inf
    excess = err_sq_sum / KAPPA
    p_max = math.inf if dtype is None else _stored_bits(dtype)
    if acc_sq_sum > 0.0 and dtype is not None:
        excess -= unit_roundoff(accumulation_dtype(dtype)) ** 2 * acc_sq_sum * (1 + 3 * math.sqrt(2 / max(n_out, 1)))
        if excess <= 0.0:
            return p_max
    if scale_sq_sum <= 0.0 or math.isinf(err_sq_sum):
        return -math.inf
    return min(-0.5 * math.log2(excess / scale_sq_sum) - 1.0, p_max)


_HALF_LOG2_KAPPA = 0.5 * math.log2(KAPPA)


def effective_bits_rel(rel: float, dtype: torch.dtype) -> float:
    """:func:`effective_bits` where the scale is the result itself and nothing accumulates, from the error's
    ``rel`` = sqrt(err_sq_sum / scale_sq_sum) (finite and > 0, as ``ErrorStats.rel_norm``): the same model,
    -0.5 log2(rel**2 / KAPPA) - 1, without forming the sums (most calls, once each).

    >>> effective_bits_rel(2.0**-11 * math.sqrt(KAPPA), torch.float32) == 10.0
    True
    """
    return min(-math.log2(rel) + _HALF_LOG2_KAPPA - 1.0, _stored_bits(dtype))


@functools.cache
def _stored_bits(dtype: torch.dtype) -> float:
    """The stored mantissa bits of ``dtype``'s real part: the most bits an error can read."""
    return float(precision_bits(dtype.to_real() if dtype.is_complex else dtype))
