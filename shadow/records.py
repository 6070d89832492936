"""What shadow records of one op call: small typed objects that keep numbers, never tensors.

>>> rec = Record(index=0, op="aten.mm.default", module="Net.fc", phase=Phase.FORWARD, kind=Kind.REPLAYED,
...              dtype="torch.float32", shape=(4, 8))
>>> rec.kind == "replayed", rec.over_budget
(True, False)
"""

from __future__ import annotations

import dataclasses
import enum
import math

from .metrics import ErrorStats
from .spot import SpotStats


def op_class(op: str) -> str:
    """The op without its overload: "aten.add.Tensor" -> "aten.add" (a class groups every overload)."""
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


class _Value(str, enum.Enum):
    """A str Enum that prints and formats as its value ("forward"), as saved reports and tables show it."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__  # hashes as its value, which it equals: a member and "forward" are one dict key


class Kind(_Value):
    """How an op call was handled; every call gets exactly one."""

    REPLAYED = "replayed"  # recomputed in float64 by the op's own CPU kernel
    DECOMPOSED = "decomposed"  # recomputed through its decomposition (no float64 CPU kernel)
    VIEW = "view"  # an alias or metadata change: no value to recompute
    META = "meta"  # computed on meta tensors (shapes only): no values exist
    RANDOM = "random"  # random values adopted from the device, never replayed
    ADOPTED = "adopted"  # uninitialized memory (empty*): the device's bytes adopted
    UNSUPPORTED = "unsupported"  # could not be replayed: device result adopted, reason recorded


class Phase(_Value):
    """Which part of a training step an op call belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"  # outside any module, not in backward, not in an optimizer step


@dataclasses.dataclass(slots=True)
class BudgetInfo:
    """The error budget a call's local error was held to (shadow.budgets): the rule family, how much of it
    the local error used (max abs / bound; > 1 is over budget), and whether no rule knew the op."""

    family: str
    used: float
    is_default: bool = False


@dataclasses.dataclass(slots=True)
class Record:
    """One op call. ``local``: the device output against the op replayed in float64 on the device's own
    inputs; ``drift``: against the shadow, computed from shadow inputs since the start."""

    index: int
    op: str
    module: str
    phase: Phase
    kind: Kind
    local: ErrorStats | None = None
    drift: ErrorStats | None = None
    flips: int = 0  # discrete outputs: elements where the device differs from the shadow
    local_flips: int = 0  # ... from the replay on the device's own inputs
    shape_mismatch: int = 0  # outputs whose shape differed from the shadow's (device adopted)
    item: tuple[float, float] | None = None  # .item(): (device value, shadow value)
    reason: str = ""  # why an op was not replayed
    spot: SpotStats | None = None  # mpmath spot check of the float64 reference (None: not sampled)
    budget: BudgetInfo | None = None  # the error budget of the local error (None: budgets off or no float result)
    cpu_fallback: bool = False  # the backend ran this op through its CPU fallback (DirectML): CPU arithmetic
    cpu: ErrorStats | None = None  # compare_cpu=True: the CPU kernel's own error, same dtype, same reference
    dtype: str = ""  # the device result's dtype ("torch.bfloat16"; the first tensor result's; "" if none)
    shape: tuple[int, ...] = ()  # ... and its shape
    inputs_nonfinite: bool = False  # some input held a NaN or an infinity: non-finite outputs flow from there
    skipped: int = 0  # output elements not compared because the op leaves them undefined (shadow.replay.defined)
    callsite: str = ""  # file:line of the user's code that ran it (a backward op: its forward op's); "" if off
    inputs_drift: float = 0.0  # the largest drift rel_norm among its floating inputs (of their storages)

    @property
    def cpu_ratio(self) -> float | None:
        """Device error / CPU error on the same inputs in the same dtype (max abs): ~1 means the device
        kernel is as accurate as PyTorch's CPU kernel; >> 1, less accurate than the dtype allows in practice."""
        if self.cpu is None or self.local is None:
            return None
        if self.cpu.max_abs == 0.0:
            return 1.0 if self.local.max_abs == 0.0 else math.inf
        return self.local.max_abs / self.cpu.max_abs

    @property
    def over_budget(self) -> bool:
        """The verdict: the op's own error is above what a correct kernel in the device dtype may make.
        Default budgets (a few ulps guessed for ops no rule knows) never make a call over budget: they are
        no evidence."""
        return self.budget is not None and not self.budget.is_default and self.budget.used > 1.0

    @property
    def introduced(self) -> float | None:
        """The error this call adds itself: its local error's rel_norm (None: no local figure)."""
        return self.local.rel_norm if self.local is not None else None

    @property
    def amplification(self) -> float | None:
        """How much this call magnifies the drift it receives: (output drift - its own error) / input drift, in
        rel_norm, a lower bound of the propagated part by the triangle inequality. ~1 or less: it passes drift
        on; >> 1: it magnifies it (a normalization dividing by a small variance, Adam dividing by the square
        root of a zero gradient's second moment). None: its inputs carried no drift, or no drift figure."""
        if self.drift is None or not 0.0 < self.inputs_drift < math.inf or not math.isfinite(self.drift.rel_norm):
            return None
        return max(self.drift.rel_norm - (self.introduced or 0.0), 0.0) / self.inputs_drift

    @property
    def zero_reference(self) -> int:
        """Elements whose float64 reference is exactly 0 where the device is not (the more of the local error's
        and the drift's): there any error is ~1e30 ulp and an infinite relative error. Such huge figures say the
        true value is exactly 0 (``x - x.mean()`` of a constant x; a gradient that cancels exactly), not that a
        kernel is inaccurate: read ``max_abs``."""
        return max(self.local.zero_reference if self.local is not None else 0,
                   self.drift.zero_reference if self.drift is not None else 0)

    @property
    def nonfinite(self) -> int:
        """Elements where device and shadow disagree on NaN/Inf (drift)."""
        return self.drift.nonfinite if self.drift is not None else 0

    @property
    def nonfinite_cause(self) -> str | None:
        """Why this call's device result holds NaN or Inf: "propagated" (an input held one), "math" (float64 is
        non-finite there too, on the same inputs and in the float64 program: log of a negative number, 0/0),
        "precision" (float64 is finite where the device is not: an overflow of the device dtype here, or, where
        the replay on the device's inputs agrees and the shadow does not, one upstream that made those inputs,
        such as Adam's eps rounded to 0); None when it holds none."""
        stats = self.local if self.local is not None else self.drift
        if stats is None or not stats.device_nonfinite:
            return None
        if self.inputs_nonfinite:
            return "propagated"
        shadow_finite = self.drift is not None and self.drift.nonfinite_device
        return "precision" if stats.nonfinite_device or shadow_finite else "math"

    def to_dict(self) -> dict:
        """The saved form (``shadow.reportformat.RECORD``)."""
        from .reportformat import RECORD

        return RECORD.write(self, "record")

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        """Inverse of ``to_dict``; reads version-3 records too (no dtype and shape, budget "kind"). A malformed one
        raises ``ReportFormatError`` naming the field."""
        from .reportformat import RECORD

        return RECORD.read(d, "record")


@dataclasses.dataclass(slots=True)
class Event:
    """Something that happened between ops (a write shadow did not see)."""

    index: int  # the op call at which it was detected
    op: str
    kind: str
    detail: str
