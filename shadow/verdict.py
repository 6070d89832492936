"""What a report concludes, in lines a user can act on: the op classes whose own error is over budget (and what
arithmetic their error reads like), where NaN/Inf is born and whether float64 agrees, float64 references that
mpmath found wrong, what shadow could not check; or the all-clear.

A pure function of a Report (``conclude``); ``Report.summary``, ``shadow show`` and the pytest plugin render it.

>>> v = conclude(sm.report)                                   # doctest: +SKIP
>>> print(v.text)                                             # doctest: +SKIP
verdict: 1 op class over budget (its own error beyond what a correct float32 kernel makes):
  aten.mm 2.8e+03x budget in 3 of 3 calls (reads ~10 bits: TF32-like; worst: Net.fc2, backward, call #40)
>>> v.suspicious, [c.op for c in v.over_budget]               # doctest: +SKIP
(True, ['aten.mm'])
"""

from __future__ import annotations

import dataclasses
import math

from .records import Record
from .report import Aggregate, Report

# mantissa bits each dtype stores (what `effective_bits` reads in), and the narrower arithmetics an error may read
# like: the same 10 bits are TF32 in a matmul or convolution and float16 elsewhere
STORED_BITS = {"torch.float64": 52, "torch.float32": 23, "torch.float16": 10, "torch.bfloat16": 7}
_MATMUL_LIKE = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear",
                          "aten.mv", "aten.addmv", "aten.dot", "aten.vdot", "aten.convolution", "aten._convolution",
                          "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution_backward",
                          "aten.mkldnn_convolution", "aten._scaled_mm"})
_SHOWN = 3  # unsupported ops and untrusted op classes named in a line; the rest counted


def op_class(op: str) -> str:
    """The op without its overload: "aten.add.Tensor" -> "aten.add" (a class groups every overload)."""
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def times(x: float) -> str:
    """A budget use as a multiple: 0.31x, 40x, 2.8e+03x."""
    if not math.isfinite(x):
        return f"{x}x"
    return f"{x:.2g}x" if x < 10 or x >= 1e4 else f"{x:.0f}x"


@dataclasses.dataclass(frozen=True)
class OpClass:
    """The calls of one op class held to an error budget: how much of it the worst call used, and what it reads."""

    op: str  # "aten.mm": every overload
    budgeted_calls: int  # calls held to a rule's budget (not the default guess)
    over_calls: int  # ... over it (Record.over_budget)
    budget_used: float  # the worst call's local error / its budget
    effective_bits: float | None  # the fewest mantissa bits a call's error reads (None: exact or not known)
    dtypes: tuple[str, ...]  # the floating result dtypes ("torch.float32")
    worst: Record | None = dataclasses.field(repr=False)  # the worst kept call (None: not kept: max_records)

    @property
    def reads_like(self) -> str:
        """The arithmetic the error reads like ("TF32-like", "bfloat16-like"; "" when it is the dtype's own or
        no known format fits): the narrowest known format within 1.5 bits of ``effective_bits``, narrower
        than the dtype by more than 2 bits."""
        bits, stored = self.effective_bits, min((STORED_BITS.get(d, 52) for d in self.dtypes), default=52)
        if bits is None or not math.isfinite(bits) or bits > stored - 2:
            return ""
        ten = "TF32" if self.op in _MATMUL_LIKE else "float16"
        for name, p in (("bfloat16", 7), (ten, 10)):
            if abs(bits - p) <= 1.5:
                return f"{name}-like"
        return ""

    def __str__(self) -> str:
        detail = []
        if self.effective_bits is not None and math.isfinite(self.effective_bits):
            like = self.reads_like
            detail.append(f"reads ~{self.effective_bits:.0f} bits" + (f": {like}" if like else ""))
        if self.worst is not None:
            detail.append(f"worst: {self.worst.module or '(no module)'}, {self.worst.phase}, call #{self.worst.index}")
        calls = f" in {self.over_calls} of {self.budgeted_calls} calls" if self.over_calls else ""
        return f"{self.op} {times(self.budget_used)} budget{calls}" + (f" ({'; '.join(detail)})" if detail else "")


@dataclasses.dataclass(frozen=True)
class NonfiniteOrigin:
    """Where NaN/Inf is born (``Report.nonfinite_origin``): the first call whose device result holds one while its
    inputs held none, and whether float64 gives one there too ("math") or not ("precision")."""

    op: str
    module: str
    phase: str
    index: int
    cause: str  # "math" | "precision"

    def __str__(self) -> str:
        module = self.module or "(no module)"
        where = f"NaN/Inf born in {op_class(self.op)} at {module} ({self.phase}, call #{self.index})"
        if self.cause == "math":
            return f"{where}: a math problem: float64 gives NaN/Inf there too (fix the math: the inputs reach " \
                   "a pole or leave the domain)"
        return f"{where}: a precision problem: float64 is finite there (the dtype overflowed or lost the " \
               "difference: compute it in a wider dtype or rescale)"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a report concludes. ``lines`` (``text``) render it; the fields hold the same findings as data."""

    calls: int  # aten calls seen
    replayed: int  # ... replayed in float64 (own kernel or decomposition)
    budgeted: int  # ... held to a rule's error budget
    dtypes: tuple[str, ...]  # floating result dtypes of the budgeted calls
    over_budget: tuple[OpClass, ...]  # op classes with calls over budget, worst first
    nonfinite: NonfiniteOrigin | None  # where NaN/Inf is born (None: nowhere in the kept records)
    nonfinite_elements: int  # elements where device and shadow disagree on NaN/Inf (every call)
    first_nonfinite_op: str  # ... the op of the first of them ("" if none)
    untrusted: tuple[tuple[str, int], ...]  # (op class, calls) whose float64 reference mpmath found wrong
    unsupported: tuple[tuple[str, str], ...]  # (op, first reason) of the ops shadow could not replay
    unsupported_calls: int
    notes: tuple[str, ...]  # what else limits the report: internal errors, unseen writes, capped records...

    @property
    def suspicious(self) -> bool:
        """Something a user should look at: an op over budget, NaN/Inf born or disagreed on, a wrong reference."""
        return bool(self.over_budget or self.nonfinite or self.nonfinite_elements or self.untrusted)

    @property
    def lines(self) -> list[str]:
        dtypes = "/".join(d.replace("torch.", "") for d in self.dtypes) or "float"
        out = []
        if self.over_budget:
            n = len(self.over_budget)
            out.append(f"verdict: {n} op class{'es' if n > 1 else ''} over budget ({'their' if n > 1 else 'its'} own "
                       f"error beyond what a correct {dtypes} kernel makes):")
            out += [f"  {c}" for c in self.over_budget]
        if self.nonfinite is not None:
            out.append(("verdict: " if not out else "") + str(self.nonfinite))
        elif self.nonfinite_elements:
            out.append(("verdict: " if not out else "") + f"device and shadow disagree on NaN/Inf in "
                       f"{self.nonfinite_elements} elements, first in {op_class(self.first_nonfinite_op)}; where it "
                       "was born is past the kept records (raise --max-records / max_records)")
        if self.untrusted:
            shown = ", ".join(f"{op} ({n} call{'s' if n > 1 else ''})" for op, n in self.untrusted[:_SHOWN])
            more = f" and {len(self.untrusted) - _SHOWN} more" if len(self.untrusted) > _SHOWN else ""
            out.append(("verdict: " if not out else "") + f"float64 itself is inaccurate (cancellation) in {shown}"
                       f"{more}: their figures use mpmath's exact value where sampled")
        if not out:
            if not self.replayed:
                out.append("verdict: no op call was replayed: nothing to judge")
            elif not self.budgeted:
                out.append(f"verdict: {self.replayed} replayed calls, none held to an error budget (budgets off): "
                           "their local errors are not judged")
            else:
                out.append(f"verdict: all {self.replayed} replayed calls within their {dtypes} budgets: "
                           "nothing suspicious")
        if self.unsupported:
            shown = "; ".join(f"{op} ({why})" for op, why in self.unsupported[:_SHOWN])
            more = f"; and {len(self.unsupported) - _SHOWN} more ops" if len(self.unsupported) > _SHOWN else ""
            out.append(f"not checked: {self.unsupported_calls} calls of {len(self.unsupported)} ops shadow cannot "
                       f"replay (device results adopted, drift restarts there): {shown}{more}")
        out += [f"note: {n}" for n in self.notes]
        return out

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def op_classes(report: Report) -> list[OpClass]:
    """Every op class with calls held to a rule's budget, the worst budget use first."""
    merged: dict[str, Aggregate] = {}
    for op, agg in report.by_op.items():
        if agg.budgeted_calls:
            key = op_class(op)
            if key not in merged:
                merged[key] = Aggregate()
            merged[key].merge(agg)
    worst: dict[str, Record] = {}
    for r in report.records:
        if r.budget is not None and not r.budget.is_default:
            key = op_class(r.op)
            w = worst.get(key)
            if w is None or r.budget.used > w.budget.used:
                worst[key] = r
    found = [OpClass(op=key, budgeted_calls=a.budgeted_calls, over_calls=a.over_budget_calls,
                     budget_used=a.max_budget_used,
                     effective_bits=a.min_effective_bits if math.isfinite(a.min_effective_bits) else None,
                     dtypes=tuple(sorted(d for d in a.dtypes if "float" in d)), worst=worst.get(key))
             for key, a in merged.items()]
    return sorted(found, key=lambda c: (-c.budget_used, c.op))


def conclude(report: Report) -> Verdict:
    """The verdict on ``report``: findings as data, and their lines."""
    by_op = report.by_op
    classes = op_classes(report)
    origin = report.nonfinite_origin()
    first = min(((a.first_nonfinite, op) for op, a in by_op.items() if a.first_nonfinite is not None), default=None)
    untrusted: dict[str, int] = {}
    for op, a in by_op.items():
        if a.spot_untrusted:
            untrusted[op_class(op)] = untrusted.get(op_class(op), 0) + a.spot_untrusted
    cov = report.coverage
    notes = []
    if cov.internal_errors:
        notes.append(f"{cov.internal_errors} internal errors of shadow (their ops adopted from the device, listed in "
                     "the coverage): a bug in shadow, please report it")
    if cov.unobserved_writes:
        notes.append(f"{cov.unobserved_writes} writes shadow did not see (through numpy or DLPack): resynced from "
                     "the device, so drift restarts there")
    if report.dropped_records:
        notes.append(f"per-call records capped at {report.max_records}: the {report.dropped_records} later calls are "
                     "in the tables, not in the records")
    for name, n in sorted(cov.compiled.items()):
        how = "ran eagerly: its figures are the eager kernels'" if cov.compiled_eagerly else \
            "ran as compiled code: its fused kernels unseen, its outputs adopted"
        notes.append(f"compiled module {name} ({n} calls) {how}")
    unsupported = tuple(sorted((op, why) for op, why in cov.unsupported.items() if by_op.get(op) is not None
                               and by_op[op].kinds.get("unsupported")))
    return Verdict(
        calls=cov.calls, replayed=cov.replayed, budgeted=sum(c.budgeted_calls for c in classes),
        dtypes=tuple(sorted({d for c in classes for d in c.dtypes})),
        over_budget=tuple(c for c in classes if c.over_calls),
        nonfinite=None if origin is None else NonfiniteOrigin(origin.op, origin.module, str(origin.phase),
                                                              origin.index, origin.nonfinite_cause),
        nonfinite_elements=sum(a.nonfinite for a in by_op.values()), first_nonfinite_op=first[1] if first else "",
        untrusted=tuple(sorted(untrusted.items(), key=lambda kv: (-kv[1], kv[0]))),
        unsupported=unsupported, unsupported_calls=cov.unsupported_calls, notes=tuple(notes))
