"""Number formats (TF32, bfloat16, float16) and rounding to them: pure functions of a tensor, the rounding
rule explicit."""

from __future__ import annotations

import dataclasses
import enum

import torch

from ...errors import ShadowOptionError


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format: ``precision`` significand bits (the implicit one included),
    exponents of normal numbers in [emin, emax], gradual underflow below."""

    name: str
    precision: int
    emin: int
    emax: int
    dtype: torch.dtype | None = None  # the torch dtype holding exactly this format, if any
    largest: float | None = None  # the largest finite value where the format takes codes from it (E4M3's NaN)

    @property
    def max(self) -> float:
        if self.largest is not None:
            return self.largest
        return (2.0 - 2.0 ** (1 - self.precision)) * 2.0**self.emax

    @property
    def tiny(self) -> float:
        """The smallest normal value: below it values are subnormal (or flush to zero)."""
        return 2.0**self.emin


TF32 = Format("tf32", 11, -126, 127)
BF16 = Format("bfloat16", 8, -126, 127, torch.bfloat16)
FP16 = Format("float16", 11, -14, 15, torch.float16)
# OCP FP8 (Transformer Engine): E4M3 has no infinities and one NaN code per sign, so its largest value is 448
E4M3 = Format("float8_e4m3", 4, -6, 8, largest=448.0)
E5M2 = Format("float8_e5m2", 3, -14, 15)


class Rounding(str, enum.Enum):
    """How a value between two neighbours of the format is rounded."""

    NEAREST_EVEN = "rne"  # IEEE default: nearest, ties to the even significand
    NEAREST_AWAY = "rna"  # nearest, ties away from zero (PTX cvt.rna, CUTLASS round_half_ulp_truncate)
    TOWARD_ZERO = "rz"  # truncation: drop the extra bits

    @classmethod
    def parse(cls, value: str | Rounding) -> Rounding:
        try:
            return cls(value)
        except ValueError:
            raise ShadowOptionError(f"rounding={value!r}: expected one of {[r.value for r in cls]}") from None


_TORCH_CASTS_EXACTLY = frozenset({torch.float32, torch.float16, torch.bfloat16})


def round_to(x: torch.Tensor, fmt: Format, rounding: str | Rounding = "rne") -> torch.Tensor:
    """``x`` rounded to the values of ``fmt``, returned in ``x``'s dtype (a new tensor).

    Non-finite values are kept; finite values beyond the format's range become +-inf (to nearest) or
    +-max (toward zero); tiny ones round to the format's subnormals. Complex tensors round both parts.

    >>> round_to(torch.tensor([1 + 2**-11], dtype=torch.float32), TF32, "rne")   # a tie: to even
    tensor([1.])
    >>> round_to(torch.tensor([1 + 2**-11], dtype=torch.float32), TF32, "rna")   # a tie: away from 0
    tensor([1.0010])
    """
    rounding = Rounding.parse(rounding)
    if x.is_complex():
        return torch.complex(round_to(x.real, fmt, rounding), round_to(x.imag, fmt, rounding))
    if not x.is_floating_point():
        return x
    if rounding is Rounding.NEAREST_EVEN and fmt.dtype is not None and x.dtype in _TORCH_CASTS_EXACTLY:
        # one correctly rounded cast (float64 sources would go through float32 first: a double rounding)
        return x.to(fmt.dtype).to(x.dtype)
    r = round_f64(x.to(torch.float64, copy=True), fmt, rounding).to(x.dtype)
    return torch.where(x.abs() < float("inf"), r, x)  # NaN payloads kept bit for bit


_RNE_MAGIC = 1.5 * 2.0**52  # adding it leaves no fraction bits: the sum is rounded to an integer


def round_f64(s: torch.Tensor, fmt: Format, rounding: Rounding) -> torch.Tensor:
    """A float64 tensor rounded to ``fmt``, still float64 (every step below is exact in float64)."""
    # the spacing of fmt at s: 2**(e - precision + 1) for |s| in [2**e, 2**(e+1)), and the
    # subnormal spacing below 2**emin; built from exponent bits so that it is an exact power of two
    e = ((s.view(torch.int64) >> 52) & 0x7FF) - 1023
    e = e.clamp_(fmt.emin, 1023 + fmt.precision - 1) - (fmt.precision - 1)
    q = ((e + 1023) << 52).view(torch.float64)
    t = s / q  # an exact scaling: |t| < 2**precision
    if rounding is Rounding.NEAREST_EVEN:
        r = (t + _RNE_MAGIC) - _RNE_MAGIC  # half to even by float64's own rounding (|t| < 2**51); faster than round
        r = torch.copysign(r, t)  # a negative value that rounds to 0 gives +0 above: -0 is the rounded value
    elif rounding is Rounding.NEAREST_AWAY:
        r = torch.copysign(torch.floor(t.abs() + 0.5), t)  # exact: |t| + 0.5 stays below 2**53
    else:
        r = torch.trunc(t)
    r = r * q
    if rounding is Rounding.TOWARD_ZERO:
        r = r.clamp(-fmt.max, fmt.max)
    else:
        r = torch.where(r.abs() > fmt.max, torch.copysign(torch.full_like(r, float("inf")), r), r)
    return torch.where(s.abs() < float("inf"), r, s)  # inf and NaN kept (cheaper than isfinite)


def to_tf32(x: torch.Tensor, rounding: str | Rounding = "rne") -> torch.Tensor:
    """float32 ``x`` rounded to TF32 (10 stored mantissa bits), as tensor cores see it; a new tensor.

    >>> to_tf32(torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-12]))   # a tie, to even; above a tie
    tensor([1.0000, 1.0010])
    >>> to_tf32(torch.tensor([1.0 + 2**-11]), "rna")                # the tie away from zero
    tensor([1.0010])
    """
    return round_to(x, TF32, rounding)


def flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every subnormal (0 < |v| < smallest normal of its dtype) replaced by a zero of
    the same sign; a new tensor. Normal values, zeros, inf and NaN are kept bit for bit.

    >>> flush_subnormals(torch.tensor([1e-40, -1e-40, 1e-30]))
    tensor([0.0000e+00, -0.0000e+00, 1.0000e-30])
    """
    if x.is_complex():
        return torch.complex(flush_subnormals(x.real), flush_subnormals(x.imag))
    if not x.is_floating_point():
        return x
    return torch.where(x.abs() < torch.finfo(x.dtype).tiny, x * 0, x)  # x * 0: a zero with x's sign
