"""The envelope of correct implementations: per training step, the loss of a float64 run, the losses of several runs
of a correct implementation with random rounding (``shadow.modes.emulate.stochastic``), and the band a further
correct run lies in, with a stated confidence. ``shadow.envelope`` builds one; a run whose loss leaves the band is
further from the true result than correct rounding takes it (docs/envelope.md).

The band is a prediction interval, not the runs' minimum and maximum: at each step the runs' mean plus or minus
t(confidence, runs - 1) * sd * sqrt(1 + 1/runs) (a further draw from the runs' normal distribution lies inside with
probability ``confidence``), and never narrower than one unit in the last place of the loss's dtype (the loss is
rounded to it, so runs that agree to the last bit still leave that much room).

>>> env = Envelope(float64=(1.0, 0.5), values=((1.0, 0.5), (1.0 + 2e-7, 0.5 - 1e-7), (1.0 - 1e-7, 0.5)),
...                device="stochastic_budget")
>>> env.contains([1.0, 0.5]), env.leaves([1.0, 0.6])
([True, True], 2)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import TYPE_CHECKING, Any, Sequence

from .errors import ReportFormatError, ShadowOptionError
from .tables import number

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FORMAT, VERSION = "shadow-envelope", 1
CONFIDENCE = 0.99  # of the band: the chance that a further correct run lies inside at a step
_MANTISSA = {"torch.float64": 52, "torch.float32": 23, "torch.float16": 10, "torch.bfloat16": 7}


def t_quantile(confidence: float, df: int) -> float:
    """The t such that a Student t variable of ``df`` degrees of freedom lies in [-t, t] with probability
    ``confidence`` (closed form of the distribution for integer ``df``, Abramowitz and Stegun 26.7.3-4, inverted by
    bisection).

    >>> round(t_quantile(0.99, 7), 3), round(t_quantile(0.95, 2), 3)     # the tables' 3.499 and 4.303
    (3.499, 4.303)
    """
    if not 0.0 < confidence < 1.0 or df < 1:
        raise ValueError(f"t_quantile({confidence}, {df}): expected 0 < confidence < 1 and df >= 1")

    def within(t: float) -> float:  # P(|T| < t)
        theta = math.atan(t / math.sqrt(df))
        c2, s = math.cos(theta) ** 2, math.sin(theta)
        term = total = 1.0
        if df % 2 == 0:
            for k in range(1, df // 2):
                term *= c2 * (2 * k - 1) / (2 * k)
                total += term
            return s * total
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))

    low, high = 0.0, 1e12
    for _ in range(200):
        mid = (low + high) / 2
        if within(mid) < confidence:
            low = mid
        else:
            high = mid
    return high


def ulp(x: float, dtype: str) -> float:
    """The spacing of ``dtype`` ("torch.float32") at ``x``."""
    bits = _MANTISSA.get(dtype, 52)
    return 2.0 ** (math.frexp(abs(x))[1] - 1 - bits) if x and math.isfinite(x) else 0.0


@dataclasses.dataclass(frozen=True)
class Envelope:
    """The band correct implementations span, step by step (from step 1 of the runs).

    >>> env = shadow.envelope(step, runs=8, steps=20)            # doctest: +SKIP
    >>> env.contains(my_losses), env.leaves(my_losses)           # doctest: +SKIP
    ([True, True, ..., False], 17)
    """

    float64: tuple[float, ...]  # per step: the float64 run's loss
    values: tuple[tuple[float, ...], ...]  # per run, per step: the loss of a run with random rounding
    device: str  # the emulated device of those runs ("stochastic_budget")
    dtype: str = "torch.float32"  # the loss's dtype
    confidence: float = CONFIDENCE
    meta: dict = dataclasses.field(default_factory=dict, compare=False)  # how it was made (script, options)

    def __post_init__(self):
        if len(self.values) < 2:
            raise ShadowOptionError(f"an envelope needs at least 2 runs, got {len(self.values)}")
        if any(len(v) != len(self.float64) for v in self.values):
            raise ValueError(f"every run needs one loss per step ({len(self.float64)}), got "
                             f"{sorted({len(v) for v in self.values})}")
        if not 0.0 < self.confidence < 1.0:
            raise ShadowOptionError(f"confidence={self.confidence!r}: expected a number in (0, 1), e.g. 0.99")

    @property
    def steps(self) -> int:
        return len(self.float64)

    @property
    def runs(self) -> int:
        return len(self.values)

    @functools.cached_property
    def _band(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        n = self.runs
        t = t_quantile(self.confidence, n - 1) * math.sqrt(1.0 + 1.0 / n)
        low, high = [], []
        for at in zip(*self.values):
            mean = math.fsum(at) / n
            sd = math.sqrt(math.fsum((v - mean) ** 2 for v in at) / (n - 1))
            half = max(t * sd, ulp(mean, self.dtype))
            low.append(mean - half)
            high.append(mean + half)
        return tuple(low), tuple(high)

    @property
    def low(self) -> tuple[float, ...]:
        """Per step, the band's lower edge."""
        return self._band[0]

    @property
    def high(self) -> tuple[float, ...]:
        """Per step, the band's upper edge."""
        return self._band[1]

    def contains(self, losses: Sequence[Any], *, start: int = 1) -> list[bool]:
        """Per step, whether ``losses`` (floats or one-element tensors, the first at step ``start``) lie inside the
        band; NaN and infinities never do."""
        values = [float(v) for v in losses]
        if start < 1 or start - 1 + len(values) > self.steps:
            raise ValueError(f"losses of steps {start} to {start - 1 + len(values)}: the envelope covers steps 1 to "
                             f"{self.steps}; build it with more steps or compare fewer")
        return [lo <= v <= hi for v, lo, hi in zip(values, self.low[start - 1:], self.high[start - 1:])]

    def leaves(self, losses: Sequence[Any], *, start: int = 1) -> int | None:
        """The first step at which ``losses`` lie outside the band (None: inside at every step)."""
        return next((start + i for i, inside in enumerate(self.contains(losses, start=start)) if not inside), None)

    def table(self, losses: Sequence[Any] | None = None, *, start: int = 1) -> str:
        """Step, float64 loss, the band's edges and width (and ``losses``, the first at step ``start``, with whether
        each lies inside)."""
        head = f"{'step':>5}  {'float64':>14}  {'low - float64':>14}  {'high - float64':>14}  {'width':>9}"
        shown = None if losses is None else {start - 1 + i: float(v) for i, v in enumerate(losses)}
        if shown is not None:
            head += f"  {'loss - float64':>14}  inside"
        lines = [f"envelope of {self.runs} {self.device} runs, {self.confidence:.0%} band", head]
        for i in range(self.steps):
            ref, lo, hi = self.float64[i], self.low[i], self.high[i]
            line = f"{i + 1:>5}  {ref:>14.8g}  {lo - ref:>+14.3e}  {hi - ref:>+14.3e}  {number(hi - lo):>9}"
            if shown is not None and i in shown:
                line += f"  {shown[i] - ref:>+14.3e}  {'yes' if lo <= shown[i] <= hi else 'NO'}"
            lines.append(line)
        return "\n".join(lines)

    def plot(self, losses: dict[str, Sequence[Any]] | Sequence[Any] | None = None, *, start: int = 1) -> Figure:
        """The band and each run's loss against the float64 loss, step by step (``losses``: other runs to draw, by
        name, the first at step ``start``); a ``matplotlib.figure.Figure`` (matplotlib imported here: optional)."""
        from .plots import envelope_figure

        return envelope_figure(self, losses, start=start)

    # --- saved form ---
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "float64": list(self.float64),
                "values": [list(v) for v in self.values], "device": self.device, "dtype": self.dtype,
                "confidence": self.confidence, "meta": self.meta}

    def save(self, path: str | os.PathLike) -> None:
        """Write the envelope as JSON (``load`` reads it back), so that a test or CI need not run it again."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: Any) -> Envelope:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ReportFormatError(f"not a saved envelope (format {FORMAT!r} expected): make one with shadow "
                                    "envelope SCRIPT or shadow.envelope(...).save(path)")
        if d.get("version") != VERSION:
            raise ReportFormatError(f"envelope format version {d.get('version')!r}: this shadow reads version "
                                    f"{VERSION}; make the envelope again with this version")
        try:
            return cls(float64=tuple(map(float, d["float64"])), values=tuple(tuple(map(float, v)) for v in d["values"]),
                       device=str(d["device"]), dtype=str(d["dtype"]), confidence=float(d["confidence"]),
                       meta=dict(d.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportFormatError(f"a saved envelope with a missing or malformed field: {exc}") from None


def load_envelope(path: str | os.PathLike) -> Envelope:
    """An envelope written by ``Envelope.save`` (``shadow envelope -o``)."""
    with open(path, encoding="utf-8") as f:
        try:
            return Envelope.from_dict(json.load(f))
        except json.JSONDecodeError as exc:
            raise ReportFormatError(f"{path}: not JSON ({exc}): not a saved envelope") from None
