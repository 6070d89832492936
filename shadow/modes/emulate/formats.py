"""Number formats (TF32, bfloat16, float16) and rounding to them: pure functions of a tensor, the rounding
rule explicit.

The rounding runs where the tensor lives, exactly: one cast where torch has the format's dtype on that device, else
in float64 (``round_f64``), or, on a device without float64 (DirectML), on the float32 bit patterns with integer
arithmetic (``round_f32``)."""

from __future__ import annotations

import dataclasses
import enum

import torch

from ...devices import holds_dtype
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
    if rounding is Rounding.NEAREST_EVEN and fmt.dtype is not None and x.dtype in _TORCH_CASTS_EXACTLY \
            and holds_dtype(x.device, fmt.dtype):
        # one correctly rounded cast (float64 sources would go through float32 first: a double rounding)
        return x.to(fmt.dtype).to(x.dtype)
    if x.dtype is not torch.float64 and not holds_dtype(x.device, torch.float64):
        r = round_f32(x.float(), fmt, rounding).to(x.dtype)  # the halves widen to float32 exactly
    else:
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


def round_f32(x: torch.Tensor, fmt: Format, rounding: Rounding) -> torch.Tensor:
    """A float32 tensor rounded to ``fmt``, still float32, in integer arithmetic on its bit patterns (for devices
    without float64). ``fmt`` must be no wider than float32 (at most 24 significand bits, emin >= -126).

    The value is sig * 2**(e - 23), sig the 24-bit significand with its implicit bit (float32 subnormals: e = -126,
    no implicit bit); ``fmt``'s spacing there is 2**(max(e, emin) - precision + 1), so the low d bits of sig go,
    rounded as asked, and the kept part scales back exactly (a multiple of the spacing with at most 24 bits).

    >>> round_f32(torch.tensor([1 + 2**-11, 1 + 3 * 2**-12, 2.0**-25]), FP16, Rounding.NEAREST_EVEN).tolist()
    [1.0, 1.0009765625, 0.0]
    """
    if fmt.precision > 24 or fmt.emin < -126:
        raise ValueError(f"round_f32: {fmt.name} is wider than float32")
    mag = x.view(torch.int32) & 0x7FFFFFFF
    field = mag >> 23
    e = field.clamp(min=1) - 127  # the binade (float32 subnormals: that of the smallest normal)
    d = (e.clamp(min=fmt.emin) - e + (24 - fmt.precision)).clamp_(max=25)  # bits to drop: sig < 2**24 <= half
    sig = torch.where(field > 0, (mag & 0x7FFFFF) | 0x800000, mag)
    one = torch.ones_like(d) << d
    half, low = one >> 1, sig & (one - 1)
    if rounding is Rounding.NEAREST_EVEN:
        up = (low > half) | ((low == half) & ((sig & one) != 0))
    elif rounding is Rounding.NEAREST_AWAY:
        up = low >= half
    else:
        up = torch.zeros_like(low, dtype=torch.bool)
    kept = (sig - low + torch.where(up, one, 0)).float()  # exact: at most 24 significant bits (2**24 on a carry)
    s = e - 23  # the scale 2**s, built in two exact steps where 2**s is a float32 subnormal
    tiny = s < -100
    r = kept * _pow2(torch.where(tiny, s + 64, s)) * torch.where(tiny, 2.0**-64, 1.0)
    r = torch.copysign(r, x)  # a negative value that rounds to 0 is -0
    if rounding is Rounding.TOWARD_ZERO:
        return r.clamp(-fmt.max, fmt.max)
    return torch.where(r.abs() > fmt.max, torch.copysign(torch.full_like(r, float("inf")), r), r)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2.0**n as float32 for integer n in [-126, 127], from its exponent bits."""
    return ((n + 127) << 23).view(torch.float32)


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
