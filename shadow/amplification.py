"""When no kernel is at fault: every call within its budget, and yet the run's loss, parameters or result drift from
float64 far beyond what one rounding per call explains. Then the program amplifies correct rounding (a chaotic
recurrence, a training loop at the edge of stability, a loss that is the small difference of large values), and a
correct device, any correct device, diverges from the true result as much: two devices that differ by that much are
both right (docs/reports.md: When the program amplifies rounding).

A pure function of a report (``amplification``), which ``shadow.verdict.conclude`` says when nothing is over budget.

>>> a = amplification(sm.report)                              # doctest: +SKIP
>>> a.drift, a.growth, a.per, a.where[0].op                   # doctest: +SKIP
(0.18, 1.27, 'call of aten.tanh at Recurrence', 'aten.tanh')
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .nonfinite import targets
from .records import Record, op_class
from .reportdata import ReportData

# What one call's correct rounding may add to the relative drift of what it computes, in units of the roundoff u of
# the device dtype: a few dozen (a reduction's bound grows with its length, an elementwise op's is a few u). Added
# up over every call as if each sat on the way to the loss and none shrank what it received, this bounds the drift
# of a program that only accumulates rounding; a drift beyond it has been multiplied on the way.
ULPS_PER_CALL = 32
# A call whose inputs drift by less than this many u receives drift of the size of its own rounding: the ratio of
# its output's drift to its inputs' is then noise, not a property of the op (Record.amplification).
NOISE_ULPS = 64
MIN_SERIES = 3  # drifting points needed to fit a growth rate
SHOWN = 3  # op classes named where the drift grows


def roundoff(dtype: str) -> float | None:
    """The unit roundoff u of a floating dtype named as records name it ("torch.float32": 2**-24); None otherwise."""
    t = getattr(torch, dtype.removeprefix("torch."), None)
    return torch.finfo(t).eps / 2 if isinstance(t, torch.dtype) and t.is_floating_point else None


def rate(series: list[float]) -> float | None:
    """The growth per point of a drift series: exp of the least-squares slope of its logarithm over its points that
    drift, from the first to the peak (past it the drift saturates at O(1)); None with fewer than MIN_SERIES."""
    points = [(i, math.log(d)) for i, d in enumerate(series) if 0.0 < d < math.inf]
    if not points:
        return None
    peak = max(range(len(points)), key=lambda k: points[k][1])  # the first of the largest
    points = points[:peak + 1]
    if len(points) < MIN_SERIES:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return math.exp(slope)


@dataclasses.dataclass(frozen=True)
class Growth:
    """The calls of one op class in one module that multiply the drift they receive (``Record.amplification``)."""

    op: str  # op class ("aten.tanh")
    module: str  # "" outside any module
    factor: float  # the geometric mean of their amplification, per call
    calls: int  # calls whose inputs drifted beyond NOISE_ULPS

    @property
    def gain(self) -> float:
        """The e-folds their calls multiply the drift by, together."""
        return self.calls * math.log(self.factor)

    def __str__(self) -> str:
        return f"{self.op} at {self.module or '(no module)'} (x{self.factor:.3g} per call, {self.calls} calls)"


def growths(records: list[Record], u: float) -> tuple[Growth, ...]:
    """Op classes by module whose calls multiply drift, the most e-folds first; calls whose inputs drift less than
    NOISE_ULPS u, or whose output drifts not at all (a constant), left out."""
    logs: dict[tuple[str, str], list[float]] = {}
    for r in records:
        a = r.amplification
        if a is not None and a > 0.0 and r.inputs_drift >= NOISE_ULPS * u:
            logs.setdefault((op_class(r.op), r.module), []).append(math.log(a))
    found = [Growth(op, module, math.exp(sum(v) / len(v)), len(v)) for (op, module), v in logs.items() if sum(v) > 0]
    return tuple(sorted(found, key=lambda g: (-g.gain, g.op, g.module)))


@dataclasses.dataclass(frozen=True)
class Amplification:
    """Drift that correct rounding grew into: what drifts and by how much at the end, the most one rounding per call
    explains, how fast it grew, and where."""

    drifts: tuple[tuple[str, float], ...]  # ("the loss", 0.34), ("the parameters", 0.024): relative, at the end
    peak: float  # the largest drift along the way (the loss's of one step may dwarf the last one's)
    peak_at: int  # ... at this step (from 1; a call of where[0] when steps == 0)
    bound: float  # ULPS_PER_CALL u over every replayed call: the most accumulation alone explains
    calls: int  # replayed calls
    dtype: str  # the least precise floating dtype of the run's results, whose u the bound uses
    steps: int  # optimizer steps, or backward passes without an optimizer (0: neither; the growth is per call)
    growth: float | None  # the drift's growth per step (per call of ``where[0]`` when steps == 0); None: no fit
    per: str  # "optimizer step", "step" (a backward pass), "call of aten.tanh at Recurrence"
    where: tuple[Growth, ...]  # the op classes whose calls multiply the drift, the most first

    def lines(self, dtypes: str) -> list[str]:
        (first, d), *rest = self.drifts
        what = f"{first} drifts {d:.2g}" + "".join(f" and {name} {d:.2g}" for name, d in rest)
        after = f" after {self.steps} {'optimizer steps' if self.per == 'optimizer step' else 'steps'}" \
            if self.steps else ""
        if self.peak > max(d for _, d in self.drifts):
            at = f"step {self.peak_at}" if self.steps else f"call {self.peak_at} of {self.per.removeprefix('call of ')}"
            after += f", up to {self.peak:.2g} ({at})"
        out = [f"no call over its {dtypes} budget, yet the program amplifies correct rounding: {what} from float64 "
               f"(relative){after}, where one rounding per call ({ULPS_PER_CALL} u of "
               f"{self.dtype.replace('torch.', '')} added up over {self.calls} calls) explains at most "
               f"{self.bound:.2g}"]
        grows = f"the drift grows x{self.growth:.3g} per {self.per}" if self.growth is not None else ""
        if self.where:
            most = "most in " + ", ".join(str(g) for g in self.where[:SHOWN])
            grows = f"{grows}; {most}" if grows else f"the drift grows {most}"
        if grows:
            out.append(f"  {grows}")
        out.append("  a correct device diverges from the true result as much: a difference of this size between two "
                   "devices (or a device and the CPU) is expected, not a kernel's fault; less of it takes a wider "
                   "dtype where it grows, or a less sensitive program")
        return out


def amplification(report: ReportData) -> Amplification | None:
    """Drift beyond what one rounding per call explains, with no call over its budget (a guessed budget is no
    finding); None otherwise, or where the drift is not finite (NaN/Inf is a finding of its own)."""
    if any(a.over_budget_calls for a in report.by_op.values()):
        return None
    us = [(u, d) for a in report.by_op.values() for d in a.dtypes if (u := roundoff(d)) is not None]
    if not us or not report.coverage.replayed:
        return None
    u, dtype = max(us)
    calls = report.coverage.replayed
    bound = ULPS_PER_CALL * u * calls
    losses, trained = targets(report.records, bool(report.trajectory))
    where = growths(report.records, u)
    drifting = [r for r in losses if r.drift is not None]
    if report.trajectory:
        last = report.trajectory[-1]
        drifts = ((("the loss", last.loss_drift),) if last.loss_drift is not None else ()) + \
            (("the parameters", last.params),)
        series, steps, per = [s.params for s in report.trajectory], len(report.trajectory), "optimizer step"
        along = [max(s.params, s.loss_drift or 0.0) for s in report.trajectory]
    elif drifting:
        drifts = (("the loss" if trained else "the result", drifting[-1].drift.rel_norm),)
        series, steps, per = [r.drift.rel_norm for r in drifting], len(drifting) if trained else 0, "step"
        along = series
    else:
        return None
    if not all(math.isfinite(d) for _, d in drifts):
        return None
    if not steps:  # no steps: the drift along the calls where it grows most, each a turn of the loop they sit in
        top = where[0] if where else None
        series = along = [] if top is None else [r.drift.rel_norm for r in report.records if r.drift is not None
                                                 and op_class(r.op) == top.op and r.module == top.module]
        per = "call" if top is None else f"call of {top.op} at {top.module or '(no module)'}"
    finite = [(d, -i) for i, d in enumerate(along) if math.isfinite(d)]
    peak, at = max(finite) if finite else (0.0, 0)
    final = max(d for _, d in drifts)
    if final >= peak:
        peak, at = final, -(len(along) - 1)
    if peak <= bound:
        return None
    return Amplification(drifts, peak, 1 - at, bound, calls, dtype, steps, rate(series), per, where)
