"""The check of given elements: each recomputed at high precision, the float64 reference and the device
result judged against it (the rule is in ``shadow.spot``'s docstring)."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import mpmath
import torch
from mpmath.libmp import finf, fnan, fninf, from_float, mpf_abs, mpf_sub, round_nearest, to_float

from ..errors import NoReference
from ..metrics import precision_bits
from ..references import DEFAULT_BITS, Exact, reference_for, to_float64, working_precision
from ..references import READ_WHOLE
from ..savedform import COUNT, FIGURE, TEXT, Fields, Flag
from ..scratch import copy

aten = torch.ops.aten

RISK_FACTOR = 2.0**10  # roundings of float64 error (2**-53 * magnitude) that must fit in the trust tolerance
TRUST_RATIO = 0.01  # the reference may err by at most 1% of the device's error
_NONFINITE = (finf, fninf, fnan)  # mpf tuples
_mpmath_lock = threading.Lock()  # mpmath's precision is process-wide; backward may run on other threads


# --- records ---
@dataclasses.dataclass(slots=True)
class SpotStats:
    """The spot check of one op call (numbers only). ``samples == 0`` means nothing was checked and
    ``reason`` says why; the figures are then 0 and ``trusted`` True (no evidence against the
    reference), so read ``checked`` before ``trusted``.

    ``ref_err_ulp``: max |float64 reference - exact| in float64 ulps at the exact value;
    ``device_err_ulp`` / ``device_err_abs``: max |device - exact| in ulps of the device dtype / absolute
    (finite device results only); ``max_cancellation``: max ``Exact.cancellation`` (sum |terms| / |value|,
    inf where the value is 0); ``trusted``: the module docstring's rule held on every sample.

    >>> SpotStats(samples=0, reason="no mpmath reference for aten.index_add.default").checked
    False
    """

    samples: int = 0
    ref_err_ulp: float = 0.0
    device_err_ulp: float = 0.0
    device_err_abs: float = 0.0
    max_cancellation: float = 0.0
    trusted: bool = True
    reason: str = ""

    @property
    def checked(self) -> bool:
        return self.samples > 0

    def to_dict(self) -> dict:
        """The saved form (``SPOT``)."""
        return SPOT.write(self, "spot")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpotStats:
        """Inverse of ``to_dict``; also reads "inf"/"nan" strings (how saved reports write them). A malformed one
        raises ``ReportFormatError`` naming the field."""
        return SPOT.read(d, "spot")


SPOT = Fields("SpotStats", {  # the saved form (shadow.reportformat)
    "samples": COUNT, "ref_err_ulp": FIGURE, "device_err_ulp": FIGURE, "device_err_abs": FIGURE,
    "max_cancellation": FIGURE, "trusted": Flag(), "reason": TEXT}, SpotStats)


# not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__ (5x the cost)
@dataclasses.dataclass(slots=True)
class Sample:
    """One checked element: output ``output`` at ``index``, its exact value correctly rounded to
    float64 (``exact``), the float64 reference and the device value, and the errors and verdict."""

    output: int
    index: tuple[int, ...]
    exact: float
    reference: float
    device: float
    ref_err_ulp: float  # float64 ulps at the exact value
    device_err_ulp: float  # device-dtype ulps at the exact value (nan: non-finite, left out)
    device_err_abs: float
    cancellation: float
    trusted: bool
    risky: bool  # cancellation beyond float64's headroom over the device: escalate


# --- units ---
@functools.cache
def _emin(dtype: torch.dtype) -> int:
    return math.frexp(torch.finfo(dtype).tiny)[1] - 1  # smallest normal = 2**emin


def _spacing(e2: int | None, dtype: torch.dtype) -> float:
    """spacing_d at |x| = 2**(max(floor(log2|x|), emin) - p), as ``shadow.metrics.spacing``."""
    emin = _emin(dtype)
    return math.ldexp(1.0, max(emin if e2 is None else e2, emin) - precision_bits(dtype))


def _in_ulps(err: float, spacing: float) -> float:
    """err / spacing; a subnormal spacing reads 0 in a process that flushes subnormals (torch 2.4 after
    torch.compile): then any error is infinitely many ulps, none is 0."""
    return err / spacing if spacing > 0 else (math.inf if err else 0.0)


def _abs_diff(a: float, x: mpmath.mpf) -> float:
    """|a - x| rounded once to float64 (to the nearest: the difference itself is computed exactly)."""
    return to_float(mpf_abs(mpf_sub(from_float(a), x._mpf_, 53, round_nearest)))


def _same_special(a: float, x: float) -> bool:
    return (math.isnan(a) and math.isnan(x)) or a == x


def judge_sample(e: Exact, r: float, y: float, dtype: torch.dtype, output: int, index: tuple[int, ...]) -> Sample:
    """One element's errors and verdict (the rule of the module docstring)."""
    x = e.value
    xraw = x._mpf_
    _, man, exp, bc = xraw
    e2 = exp + bc - 1 if man else None  # floor(log2 |x|) of a finite x (mpf: man * 2**exp, man of bc bits)
    # a normal float64 itself (products and sums of narrow values, data movement): float64 subtraction rounds
    # its differences once, to the nearest, as _abs_diff does
    held = e2 is not None and bc <= 53 and -1022 <= e2 <= 1023
    # beyond float64's range the exact value rounds to an infinity: so must the reference
    xf = to_float(xraw) if held else to_float64(x)
    c = e.cancellation
    c = 0.0 if math.isnan(c) else c
    if not math.isfinite(xf) or not math.isfinite(r):  # IEEE specials: equal or wrong, nothing between
        ok = _same_special(r, xf)
        return Sample(output, index, xf, r, y, 0.0 if ok else math.inf, math.nan, math.nan, c, ok, not ok)
    ref_abs = abs(r - xf) if held else _abs_diff(r, x)
    ref_ulp = _in_ulps(ref_abs, _spacing(e2, torch.float64))
    if not math.isfinite(y):  # the device's error is infinite: any finite reference is within 1% of it
        return Sample(output, index, xf, r, y, ref_ulp, math.nan, math.nan, c, True, False)
    spacing = _spacing(e2, dtype)
    dev_abs = abs(y - xf) if held else _abs_diff(y, x)
    tol = TRUST_RATIO * max(dev_abs, spacing / 2)
    trusted = ref_abs <= tol
    # float64's typical error here is 2**-53 * magnitude; escalate while RISK_FACTOR of them would not fit
    # in the tolerance (a device dtype as precise as float64 has no headroom to escalate over)
    raw = e.magnitude._mpf_
    mag = to_float(mpf_abs(raw)) if raw not in _NONFINITE else abs(xf)
    risky = not trusted or (precision_bits(dtype) < 52 and RISK_FACTOR * math.ldexp(mag, -53) > tol)
    return Sample(output, index, xf, r, y, ref_ulp, _in_ulps(dev_abs, spacing), dev_abs, c, trusted, risky)


# --- the check of given elements ---
def _gather(t: torch.Tensor, flats: Sequence[int], coords: Sequence[tuple[int, ...]]) -> list[float]:
    """Elements of ``t`` at the flat indices ``flats`` (``coords``: the same as coordinates), as float64 numbers.
    On the CPU a small tensor is read whole (one ``tolist``), a larger one element by element (a few us each);
    elsewhere one gather and one transfer (one synchronization)."""
    if t.dim() == 0:
        return [float(t.item())] * len(coords)
    if t.device.type == "cpu":
        if t.numel() <= READ_WHOLE:
            values = t.reshape(-1).tolist()
            return [float(values[f]) for f in flats]
        return [float(t[c].item()) for c in coords]
    cols = tuple(torch.tensor(col, dtype=torch.int64, device=t.device) for col in zip(*coords))
    return copy(t[cols], torch.float64, "cpu").tolist()


def _coords(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        flat, i = divmod(flat, s)
        out.append(i)
    return tuple(reversed(out))


def spot_check(
    func: torch._ops.OpOverload,
    args: Sequence,
    kwargs: Mapping[str, Any] | None,
    device_outputs: Sequence[torch.Tensor | None],
    reference_outputs: Sequence[torch.Tensor | None],
    dtype: torch.dtype,
    elements: Sequence[tuple[int, int]],
    *,
    bits: int = DEFAULT_BITS,
) -> tuple[list[Sample], str]:
    """Check the given elements ``(output, flat index)`` of one call: the samples and, for elements
    that could not be checked, the last reason (``""`` if none). Raises ``NoReference`` if the op has
    no rule.

    >>> x = torch.tensor([1e-20], dtype=torch.float64)
    >>> (s,), why = spot_check(aten.log1p.default, (x,), {}, [torch.tensor([1e-20])],
    ...                        [torch.log(1 + x)], torch.float32, [(0, 0)])
    >>> s.exact, s.reference, s.trusted          # log(1 + x) rounds 1 + 1e-20 to 1
    (1e-20, 0.0, False)
    """
    ref = reference_for(func)
    if ref is None:
        raise NoReference(str(func), f"no mpmath reference for {func}")
    by_output: dict[int, list[int]] = {}
    for k, flat in elements:
        by_output.setdefault(k, []).append(flat)
    samples: list[Sample] = []
    why = ""
    with _mpmath_lock, working_precision(bits):  # the rule's own precision, set once for every element
        for k, flats in by_output.items():
            try:
                call = ref.call(args, kwargs, k)
            except NoReference as exc:
                why = exc.reason
                continue
            dev, r = device_outputs[k], reference_outputs[k]
            shape = tuple(r.shape)
            indices = [_coords(flat, shape) for flat in flats]
            for index, y, rv in zip(indices, _gather(dev, flats, indices), _gather(r, flats, indices)):
                try:
                    e = ref.element(call, index)
                except NoReference as exc:
                    why = exc.reason
                    continue
                except Exception as exc:  # noqa: BLE001 -- a rule's failure loses this element, never the op's record
                    why = f"reference rule failed at output {k} index {index}: {type(exc).__name__}: {exc}"
                    continue
                samples.append(judge_sample(e, rv, y, dtype, k, index))
    return samples, why


def summarize(samples: list[Sample], why: str) -> SpotStats:
    """The ``SpotStats`` of a call's checked samples (``why``: the reason when there are none)."""
    if not samples:
        return SpotStats(reason=why or "no element could be checked")
    first = samples[0]  # one loop of comparisons: max() of each figure, as it picks them
    stats = SpotStats(samples=len(samples), ref_err_ulp=first.ref_err_ulp, max_cancellation=first.cancellation)
    for s in samples:
        if s.ref_err_ulp > stats.ref_err_ulp:
            stats.ref_err_ulp = s.ref_err_ulp
        if s.cancellation > stats.max_cancellation:
            stats.max_cancellation = s.cancellation
        if not math.isnan(s.device_err_ulp):  # finite device values only (their errors are >= 0)
            if s.device_err_ulp > stats.device_err_ulp:
                stats.device_err_ulp = s.device_err_ulp
            if s.device_err_abs > stats.device_err_abs:
                stats.device_err_abs = s.device_err_abs
        stats.trusted = stats.trusted and s.trusted
    return stats
