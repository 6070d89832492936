"""Where NaN and Inf come from and where they go: whether a NaN or an infinity some op made reaches the loss (the
result, in a run without backward), a gradient or a parameter, and if so which op made it and how it got there.

An attention mask of ``-inf`` (``masked_fill(mask, float('-inf'))``, ``log(tril(ones))``) is born in the forward
and absorbed by the softmax that reads it: float64 holds the same -inf, and nothing downstream is non-finite. That
is not a finding; the report keeps it as information. A NaN from ``log`` of a negative number, ``0/0`` in a
normalization or an overflow of the device's dtype reaches the loss, then the gradients and the parameters: that
is one, named with its op, its module and its way there (docs/reports.md: Where NaN/Inf goes).

The analysis reads the records only: each says whether its device result holds NaN/Inf
(``Record.nonfinite_cause``) and whether some input did (``Record.inputs_nonfinite``), not which input. So the
birth a reach traces to is inferred: births are taken in order, each call that reads NaN/Inf and returns none
absorbs the latest birth still live, and a reach is traced to a birth still live there: first one whose code (op
and call site) never had its NaN/Inf absorbed elsewhere in the run (the same mask in another layer or step is),
then one that computed it (log, div, exp) rather than placed a value it was given (masked_fill(-inf), full), then
the earliest. ``Flow.others`` counts the other live births, which may feed the reach too.

Gradients that a GradScaler's check reads (``CHECKS``) while nothing else holds NaN/Inf are caught: it skips those
steps, as it is meant to, and they are information too.

>>> f = flow(rep)                                             # doctest: +SKIP
>>> f.origin.op, [r.what for r in f.reaches]                  # doctest: +SKIP
('aten.log.default', ['loss', 'gradients', 'parameters'])
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .opsets import DATA_MOVEMENT
from .plan import base_name
from .records import Kind, Phase, Record, loss_candidate, op_class

if TYPE_CHECKING:
    from .reportdata import ReportData

# ops that check gradients for NaN/Inf so that the optimizer step is skipped (GradScaler's): gradients they read are
# caught there, by base name (shadow.opsets)
CHECKS = frozenset({"_amp_foreach_non_finite_check_and_unscale"})
BORN = ("math", "precision")  # Record.nonfinite_cause of a call that makes NaN/Inf from finite inputs
VALUES = frozenset({Kind.REPLAYED, Kind.DECOMPOSED})  # calls whose result was compared: whether it holds NaN/Inf is known


@dataclasses.dataclass(frozen=True)
class Reach:
    """The first place of one kind that holds NaN/Inf: ``what`` is "loss" (a step's loss: the last one-element
    floating result before its backward), "result" (a run without backward: its last floating result),
    "gradients" (a backward call's result), "parameters" (a parameter after an optimizer step, as the trajectory
    compares them) or "state" (an optimizer call's result while the parameters stay finite: Adam's moments).
    ``record``: the first such call (None where only the trajectory saw it, past the kept records); ``step``: the
    optimizer step after which the trajectory saw it."""

    what: str
    record: Record | None
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class Absorbed:
    """Births of NaN/Inf that reach nothing, by op class and cause: where, how many, and which ops absorbed them
    (read them and returned finite results: softmax reading a -inf mask)."""

    op: str  # op class ("aten.masked_fill")
    cause: str  # "math" (float64 makes it too) | "precision" (float64 is finite: the device's dtype overflowed)
    modules: tuple[str, ...]  # in the order first seen
    calls: int
    absorbers: tuple[str, ...]  # op classes, in the order first seen; () when no kept call read it
    caught: bool = False  # it is in the gradients, caught by a check (CHECKS: GradScaler skips those steps)


@dataclasses.dataclass(frozen=True)
class Flow:
    """What became of the NaN/Inf of a run (``flow(report)``)."""

    reaches: tuple[Reach, ...]  # the first of each kind that holds NaN/Inf, earliest first (by call index; those
    # only the trajectory saw last); () when none does
    origin: Record | None  # the birth the first reach traces to (None: nothing reaches, or no kept call made it)
    path: tuple[str, ...]  # modules of the calls holding NaN/Inf from the origin to the first reach, in order
    others: int  # other births live at the first reach, which may feed it too
    absorbed: tuple[Absorbed, ...]  # births that reach nothing (information, not a finding)
    trained: bool  # the run has a backward or an optimizer step: its targets are losses, gradients and parameters,
    # else its result


def holds(rec: Record) -> bool:
    """The call's device result holds a NaN or an infinity."""
    return rec.nonfinite_cause is not None


def absorbs(rec: Record) -> bool:
    """The call read NaN/Inf and returned none (softmax of a -inf mask; a comparison or a cast to integers)."""
    return rec.inputs_nonfinite and rec.kind in VALUES and rec.nonfinite_cause is None


def checks(rec: Record) -> bool:
    """The call checks gradients for NaN/Inf (``CHECKS``), so that the optimizer skips the step."""
    return _base(rec) in CHECKS


def written(rec: Record) -> bool:
    """The call only places values it was given (``shadow.opsets.DATA_MOVEMENT``: masked_fill, full, where...), so
    the NaN/Inf it made from finite inputs was an argument: ``masked_fill(mask, float('-inf'))`` on purpose."""
    return _base(rec) in DATA_MOVEMENT


def _base(rec: Record) -> str:
    """The op's base name, as the op sets hold it: "aten.masked_fill_.Scalar" -> "masked_fill"."""
    parts = rec.op.split(".")
    return base_name(parts[1]) if len(parts) >= 2 else rec.op


def _site(rec: Record) -> tuple[str, str]:
    """The code that made a birth: its op and call site (its module where call sites are off)."""
    return rec.op, rec.callsite or rec.module


def targets(records: list[Record], stepped: bool) -> tuple[list[Record], bool]:
    """The calls whose results are the run's targets, and whether it trained (a backward, or an optimizer step:
    ``stepped``): each backward's loss; in a run without either, its last floating result compared."""
    losses, last, backward = [], None, False
    for rec in records:
        if rec.phase is Phase.BACKWARD:
            if not backward and last is not None:
                losses.append(last)
            backward, last = True, None
        else:
            backward = False
            if loss_candidate(rec.op, rec.phase, math.prod(rec.shape), "float" in rec.dtype):
                last = rec
    if stepped or any(r.phase is Phase.BACKWARD for r in records):
        return losses, True
    final = next((r for r in reversed(records) if r.kind in VALUES and "float" in r.dtype
                  and (r.local is not None or r.drift is not None)), None)
    return ([final] if final is not None else []), False


def _reaches(report: ReportData, targets: list[Record], trained: bool) -> tuple[Reach, ...]:
    found: dict[str, Reach] = {}
    target = next((r for r in targets if holds(r)), None)
    if target is not None:
        found["loss" if trained else "result"] = Reach("loss" if trained else "result", target)
    elif trained:  # a loss past the kept records, where only the trajectory looked
        step = next((s.step for s in report.trajectory if s.loss is not None and not math.isfinite(s.loss)), None)
        if step is not None:
            found["loss"] = Reach("loss", None, step)
    gradient = next((r for r in report.records if r.phase is Phase.BACKWARD and holds(r)), None)
    if gradient is not None:
        found["gradients"] = Reach("gradients", gradient)
    caught = gradient is not None and any(checks(r) for r in report.records if r.index > gradient.index)
    # an optimizer call's result is a parameter or the optimizer's state (Adam's moments): the trajectory, which
    # compares every parameter after each step, tells them apart where it ran
    optimizer = next((r for r in report.records if r.phase is Phase.OPTIMIZER and holds(r)), None)
    step = next((s.step for s in report.trajectory if not math.isfinite(s.params)), None)
    if step is not None or (optimizer is not None and not report.trajectory):
        found["parameters"] = Reach("parameters", optimizer, step)
    elif optimizer is not None:
        found["state"] = Reach("state", optimizer)
    if caught and found.keys() == {"gradients"}:  # GradScaler skipped the steps: nothing else holds it
        del found["gradients"]
    return tuple(sorted(found.values(), key=lambda r: (r.record is None, r.record.index if r.record else r.step)))


def flow(report: ReportData) -> Flow:
    """Where the NaN/Inf of ``report``'s kept calls is born, where it goes, and what absorbs it."""
    records = report.records
    losses, trained = targets(records, bool(report.trajectory))
    reaches = _reaches(report, losses, trained)
    end = reaches[0].record if reaches else None  # the call where NaN/Inf first reaches (None: none kept)
    live: list[int] = []  # positions of the births not absorbed yet, in order
    absorbed_by: dict[int, list[Record]] = {}  # a birth's position -> the calls that absorbed it
    absorbing_sites = set()  # the sites of the births some call absorbed
    at_end: list[int] = []
    stop = len(records)  # the position of the call where NaN/Inf first reaches (past the end: none kept)
    for i, rec in enumerate(records):
        if rec.nonfinite_cause in BORN:
            live.append(i)
        elif (absorbs(rec) or checks(rec)) and live:
            birth = live.pop()
            absorbed_by.setdefault(birth, []).append(rec)
            absorbing_sites.add(_site(records[birth]))
        if rec is end:
            at_end, stop = list(live), i
    start = None  # the origin's position
    if end is not None and end.nonfinite_cause in BORN:
        start = stop
    elif at_end:
        start = min(at_end, key=lambda b: (_site(records[b]) in absorbing_sites, written(records[b]), b))
    path: dict[str, None] = {}
    if start is not None:
        for rec in records[start:stop + 1]:
            if holds(rec):
                path.setdefault(rec.module or "(no module)")
    groups: dict[tuple[str, str], tuple[dict, list[int], dict]] = {}  # (op class, cause) -> modules, calls, absorbers
    reached = set(at_end)
    for i, rec in enumerate(records[:stop]):
        if rec.nonfinite_cause not in BORN or i in reached or (reaches and i not in absorbed_by):
            continue
        modules, calls, absorbers = groups.setdefault((op_class(rec.op), rec.nonfinite_cause), ({}, [], {}))
        modules.setdefault(rec.module or "(no module)")
        calls.append(i)
        for a in absorbed_by.get(i, ()):
            absorbers[op_class(a.op)] = absorbers.get(op_class(a.op), False) or checks(a)
    absorbed = tuple(Absorbed(op, cause, tuple(modules), len(calls), tuple(absorbers), any(absorbers.values()))
                     for (op, cause), (modules, calls, absorbers) in groups.items())
    origin = records[start] if start is not None else None
    others = len(at_end) - (start in reached) if origin is not None else 0
    return Flow(reaches, origin, tuple(path), others, absorbed, trained)
