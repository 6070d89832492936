"""What shadow records: small typed objects that keep numbers, never tensors. Per op call a ``Record``, per
optimizer step a ``StepDrift``, per group of calls (an op, a module, a cell) an ``Aggregate``, per run its
``Coverage`` and ``Event``s; each with its saved form beside it (``RECORD``... ``shadow.reportformat`` assembles the
report from them).

>>> rec = Record(index=0, op="aten.mm.default", module="Net.fc", phase=Phase.FORWARD, kind=Kind.REPLAYED,
...              dtype="torch.float32", shape=(4, 8))
>>> rec.kind == "replayed", rec.over_budget
(True, False)
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import math
from typing import Any, Callable

from .metrics import ERROR_STATS, ErrorStats
from .savedform import COUNT, COUNTS, FIGURE, TEXT, Choice, Field, Fields, Flag, ListOf, MapOf, Maybe, Spec
from .spot import SpotStats
from .spot.verdict import SPOT


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


# report.meta[KERNELS_KEY]: the record (Record.to_dict) of each call of a compiled graph's fused kernel judged alone
# (shadow.compiled.kernels): kept apart from the records, since the graph's own record already holds its error
KERNELS_KEY = "compiled_kernels"


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
        """The saved form (``RECORD``)."""
        return RECORD.write(self, "record")

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        """Inverse of ``to_dict``; reads version-3 records too (no dtype and shape, budget "kind"). A malformed one
        raises ``ReportFormatError`` naming the field."""
        return RECORD.read(d, "record")


@dataclasses.dataclass(slots=True)
class Event:
    """Something that happened between ops (a write shadow did not see)."""

    index: int  # the op call at which it was detected
    op: str
    kind: str
    detail: str


# results that are constants, not computed values: backward's seed (ones_like of the loss) is one
_CONSTANTS = frozenset({"ones_like", "zeros_like", "full_like", "empty_like", "ones", "zeros", "full", "fill",
                        "fill_", "scalar_tensor", "lift_fresh", "lift_fresh_copy"})


def loss_candidate(op: str, phase: Phase, numel: int, floating: bool) -> bool:
    """A result that can be a step's loss: one floating element computed in the forward or outside any module,
    not a constant (backward's seed is ones_like of the loss). A step's loss is the last one before its backward."""
    return phase in (Phase.FORWARD, Phase.OTHER) and numel == 1 and floating and op.split(".")[1] not in _CONSTANTS


@dataclasses.dataclass(slots=True)
class StepDrift:
    """One optimizer step of a run."""

    step: int  # optimizer steps this ShadowMode saw, from 1
    loss: float | None  # the device's loss (None: no one-element result before the backward)
    loss_drift: float | None  # |loss - its float64 shadow| / |shadow|
    params: float  # ||parameters - their shadows|| / ||shadows||, over every parameter the optimizer stepped
    worst: str  # the parameter whose own relative drift is the largest
    worst_drift: float


@dataclasses.dataclass(slots=True)
class Aggregate:
    """Every call of one op (or module), whether or not its per-call record was kept."""

    calls: int = 0
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    max_local_ulp: float = 0.0
    max_local_ulp_nonzero: float = 0.0  # ... over elements whose reference is not exactly 0
    zero_reference_calls: int = 0  # calls with references exactly 0 where the device is not (local)
    max_local_abs: float = 0.0
    max_drift_rel: float = 0.0
    max_drift_ulp: float = 0.0
    flips: int = 0
    nonfinite: int = 0
    first_nonfinite: int | None = None  # index of the first call with a non-finite mismatch
    budgeted_calls: int = 0  # calls held to a rule's budget (not the default guess for ops no rule knows)
    guessed_calls: int = 0  # calls judged only by that guess (BudgetInfo.is_default): not judged, counted apart
    max_budget_used: float = 0.0  # the worst local error as a fraction of its budget (> 1: over)
    over_budget_calls: int = 0  # calls over budget (Record.over_budget)
    min_effective_bits: float = math.inf  # the fewest mantissa bits a call's local error reads (inf: all exact)
    spot_checked: int = 0  # calls whose float64 reference was spot-checked with mpmath
    spot_untrusted: int = 0  # ... and found less accurate than the device error needs
    dtypes: dict[str, int] = dataclasses.field(default_factory=dict)  # calls by result dtype ("torch.bfloat16")

    def add(self, rec: Record) -> None:
        # comparisons where max() would be called (once per op call): the same result, NaNs included
        self.calls += 1
        if rec.dtype:
            self.dtypes[rec.dtype] = self.dtypes.get(rec.dtype, 0) + 1
        self.kinds[rec.kind] = self.kinds.get(rec.kind, 0) + 1
        local, drift, budget = rec.local, rec.drift, rec.budget
        if local is not None:
            if local.max_ulp > self.max_local_ulp:
                self.max_local_ulp = local.max_ulp
            v = local.ulp_nonzero
            if v > self.max_local_ulp_nonzero:
                self.max_local_ulp_nonzero = v
            self.zero_reference_calls += local.zero_reference > 0
            if local.max_abs > self.max_local_abs:
                self.max_local_abs = local.max_abs
        if drift is not None:
            if drift.rel_norm > self.max_drift_rel:
                self.max_drift_rel = drift.rel_norm
            if drift.max_ulp > self.max_drift_ulp:
                self.max_drift_ulp = drift.max_ulp
        self.flips += rec.flips
        if budget is not None and not budget.is_default:
            self.budgeted_calls += 1
            if budget.used > self.max_budget_used:
                self.max_budget_used = budget.used
            self.over_budget_calls += rec.over_budget
            bits = local.effective_bits if local is not None else None
            if bits is not None and bits < self.min_effective_bits:  # a NaN compares false: skipped
                self.min_effective_bits = bits
        elif budget is not None:
            self.guessed_calls += 1
        if rec.spot is not None and rec.spot.checked:
            self.spot_checked += 1
            self.spot_untrusted += not rec.spot.trusted
        nf = (drift.nonfinite if drift is not None else 0) + (local.nonfinite if local is not None else 0)
        if nf:
            self.nonfinite += nf
            if self.first_nonfinite is None:
                self.first_nonfinite = rec.index

    def merge(self, other: Aggregate) -> None:
        """Fold in another aggregate (of other calls): counts add, worst figures combine."""
        self.calls += other.calls
        for mine, theirs in ((self.kinds, other.kinds), (self.dtypes, other.dtypes)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        for name in ("max_local_ulp", "max_local_ulp_nonzero", "max_local_abs", "max_drift_rel", "max_drift_ulp",
                     "max_budget_used"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        for name in ("zero_reference_calls", "flips", "nonfinite", "budgeted_calls", "guessed_calls",
                     "over_budget_calls", "spot_checked", "spot_untrusted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.min_effective_bits = min(self.min_effective_bits, other.min_effective_bits)
        if other.first_nonfinite is not None and (self.first_nonfinite is None
                                                  or other.first_nonfinite < self.first_nonfinite):
            self.first_nonfinite = other.first_nonfinite


@dataclasses.dataclass(slots=True)
class Coverage:
    """What shadow saw and what it could replay."""

    calls: int = 0  # aten op calls seen
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    unsupported: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> first reason
    internal_errors: int = 0
    passthrough: int = 0  # non-aten ops (profiler markers...), passed through untouched
    tensors_adopted: int = 0  # storages first seen mid-run, adopted by exact upcast
    unobserved_writes: int = 0  # storages written behind shadow's back, resynced from the device
    reinterpreted: int = 0  # reads through a view of another element size, served from the device
    compiled: dict[str, int] = dataclasses.field(default_factory=dict)  # compiled modules that ran: calls
    compiled_eagerly: bool = True  # they ran eagerly (recent torch); False: as compiled code, outputs adopted
    out_of_scope: int = 0  # calls outside ShadowMode(scope=...): run, not shadowed, not recorded

    @property
    def replayed(self) -> int:
        return self.kinds.get("replayed", 0) + self.kinds.get("decomposed", 0)

    @property
    def unsupported_calls(self) -> int:
        return self.kinds.get(Kind.UNSUPPORTED.value, 0)

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))
        lines = [f"{self.calls} aten calls ({kinds}); {self.passthrough} non-aten passed through"
                 + (f"; {self.out_of_scope} outside the scope, not shadowed" if self.out_of_scope else "")]
        lines.append(
            f"{self.tensors_adopted} storages adopted on first sight, {self.unobserved_writes} unobserved writes, "
            f"{self.internal_errors} internal errors"
        )
        lines += [f"  unsupported {op}: {why}" for op, why in sorted(self.unsupported.items())]
        how = ("ran eagerly ({} calls): its figures are the eager kernels'" if self.compiled_eagerly else
               "ran as compiled code ({} calls): its fused kernels unseen, its outputs adopted from the device")
        lines += [f"  compiled module {name} {how.format(n)}" for name, n in sorted(self.compiled.items())]
        return "\n".join(lines)


# what a merged report keeps of each rank's cells (Report.per_rank; shadow.distributed.merge_reports)
RANK_FIELDS = ("calls", "max_local_ulp_nonzero", "zero_reference_calls", "budgeted_calls", "guessed_calls",
               "max_budget_used", "over_budget_calls", "max_drift_rel")


def _gc_untrack() -> Callable[[Any], None] | None:
    """CPython's ``PyObject_GC_UnTrack`` (None on another Python, where records stay tracked, or where a record's
    type is not one the collector tracks, whose objects have no tracking header to clear)."""
    if not all(t.__flags__ & _HAVE_GC for t in (Record, ErrorStats, BudgetInfo, SpotStats)):
        return None
    try:
        fn = ctypes.pythonapi.PyObject_GC_UnTrack
    except AttributeError:
        return None
    fn.argtypes, fn.restype = [ctypes.py_object], None
    return fn


_HAVE_GC = 1 << 14  # Py_TPFLAGS_HAVE_GC: the type's objects carry the collector's header
GC_UNTRACK = _gc_untrack()  # CPython's PyObject_GC_UnTrack, or None


def untrack(rec: Record) -> None:
    """Take a kept record and its figures out of the garbage collector's lists. Kept records pile up (one to five
    tracked objects a call), and as they do they set off the collector's full collections, each a walk over
    every object of the process (benchmarks/RESULTS.md: "Kept records in the garbage collector"). A record and its figures hold numbers, strings and each other, never
    a reference back, so no cycle the collector could free runs through them; reference counting frees them.
    Each is an instance of a collected type (``_gc_untrack`` checks), which untracking twice leaves untracked."""
    if GC_UNTRACK is None:
        return
    for o in (rec, rec.local, rec.drift, rec.budget, rec.spot, rec.cpu):
        if o is not None:
            GC_UNTRACK(o)


# --- the saved forms (shadow.savedform specs; shadow.reportformat assembles the report from them) ---
BUDGET = Fields("BudgetInfo", {"family": Field(TEXT, True, old="kind"), "used": Field(FIGURE, True),
                               "is_default": Flag()}, BudgetInfo)


class _Scalar(Spec):
    """.item()'s device and shadow values: a float, an int or a bool."""

    expected = "a number or true/false"

    def load(self, value: Any) -> Any:
        return value if type(value) is bool else FIGURE.load(value)


RECORD = Fields("Record", {
    "index": Field(COUNT, True), "op": Field(TEXT, True), "module": Field(TEXT, True),
    "phase": Field(Choice(Phase), True), "kind": Field(Choice(Kind), True),
    "local": Maybe(ERROR_STATS), "drift": Maybe(ERROR_STATS), "flips": COUNT, "local_flips": COUNT,
    "shape_mismatch": COUNT, "item": Maybe(ListOf(_Scalar(), length=2, into=tuple)), "reason": TEXT,
    "spot": Maybe(SPOT), "budget": Maybe(BUDGET), "cpu_fallback": Flag(), "cpu": Maybe(ERROR_STATS),
    "dtype": TEXT, "shape": ListOf(COUNT, into=tuple), "inputs_nonfinite": Flag(), "skipped": COUNT,
    "callsite": TEXT, "inputs_drift": FIGURE}, Record)


def _aggregate_legacy(values: dict) -> None:
    values.setdefault("max_local_ulp_nonzero", values.get("max_local_ulp", 0.0))  # before version 4
    if "budgeted_calls" not in values and "max_budget_used" in values:  # version 3 did not count them
        values["budgeted_calls"] = values.get("calls", 0)


AGGREGATE = Fields("Aggregate", {
    "calls": COUNT, "kinds": COUNTS, "max_local_ulp": FIGURE, "max_local_ulp_nonzero": FIGURE,
    "zero_reference_calls": COUNT, "max_local_abs": FIGURE, "max_drift_rel": FIGURE, "max_drift_ulp": FIGURE,
    "flips": COUNT, "nonfinite": COUNT, "first_nonfinite": Maybe(COUNT), "budgeted_calls": COUNT,
    "guessed_calls": COUNT, "max_budget_used": FIGURE, "over_budget_calls": Field(COUNT, old="over_budget"), "min_effective_bits": FIGURE,
    "spot_checked": COUNT, "spot_untrusted": COUNT, "dtypes": COUNTS}, Aggregate, legacy=_aggregate_legacy)
COVERAGE = Fields("Coverage", {
    "calls": COUNT, "kinds": COUNTS, "unsupported": MapOf(TEXT), "internal_errors": COUNT, "passthrough": COUNT,
    "tensors_adopted": COUNT, "unobserved_writes": COUNT, "reinterpreted": COUNT, "compiled": COUNTS,
    "compiled_eagerly": Flag(), "out_of_scope": COUNT}, Coverage)
EVENT = Fields("Event", {"index": Field(COUNT, True), "op": Field(TEXT, True), "kind": Field(TEXT, True),
                         "detail": Field(TEXT, True)}, Event)
STEP = Fields("StepDrift", {"step": Field(COUNT, True), "loss": Field(Maybe(FIGURE), True),
                            "loss_drift": Field(Maybe(FIGURE), True), "params": Field(FIGURE, True),
                            "worst": Field(TEXT, True), "worst_drift": Field(FIGURE, True)}, StepDrift)
