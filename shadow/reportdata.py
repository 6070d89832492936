"""What a run recorded, as a report holds it: the kept per-call records (``shadow.records``), the aggregates of
every call by (op, module, call site, phase) cells and the views over them, coverage, events, the trajectory, and
the saved form (``shadow.reportformat``). ``shadow.report.Report`` adds the text renderings (``shadow.tables``);
the verdict (``shadow.verdict``) and every rendering read a ``ReportData``.

>>> data = ReportData(max_records=10)
>>> data.view("op"), data.coverage.calls
({}, 0)
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from . import reportformat
from .records import Aggregate, Coverage, Event, Kind, Phase, Record, StepDrift, untrack

VIEWS = ("op", "module", "callsite", "phase")  # the ways aggregates are grouped (ReportData.view)
_CELL = {"op": 0, "module": 1, "callsite": 2, "phase": 3}  # a view's position in a cell's key
_R = TypeVar("_R", bound="ReportData")


class ReportData:
    """The results of a ShadowMode run: per-call records, aggregates by cell and their views, coverage, the
    trajectory; saved and read back (``save``, ``from_dict``). A merged report (``shadow.merge_reports``) also keeps
    each rank's cells (``per_rank``)."""

    def __init__(self, *, max_records: int | None = None, meta: dict | None = None,
                 cells: dict[tuple[str, str, str, str], Aggregate] | None = None):
        self.max_records = max_records
        self.meta = dict(meta or {})
        self.records: list[Record] = []
        self.dropped_records = 0
        self.coverage = Coverage()
        self.events: list[Event] = []
        self.trajectory: list[StepDrift] = []  # per optimizer step: the loss's and the parameters' drift
        # every call lands in one cell, keyed (op, module, call site, phase); the views merge cells on demand
        self.cells: dict[tuple[str, str, str, str], Aggregate] = {} if cells is None else cells
        self._views: dict[tuple[str, str | None], dict[str, Aggregate]] = {}  # merged views, until the next add
        self._legacy: dict[str, dict[str, Aggregate]] | None = None  # by op and module of a report saved before 5
        # a merged report (shadow.merge_reports): each rank's cells, with only the figures its table compares
        self.per_rank: dict[Any, ReportData] = {}

    def add(self, rec: Record) -> None:
        self.coverage.calls += 1
        self.coverage.kinds[rec.kind] = self.coverage.kinds.get(rec.kind, 0) + 1
        if rec.kind is Kind.UNSUPPORTED:
            self.coverage.unsupported.setdefault(rec.op, rec.reason)
        key = (rec.op, rec.module, rec.callsite, rec.phase)
        agg = self.cells.get(key)
        if agg is None:
            agg = self.cells[key] = Aggregate()
        agg.add(rec)
        if self._views:
            self._views.clear()
        if self.max_records is None or len(self.records) < self.max_records:
            self.records.append(rec)
            untrack(rec)
        else:
            self.dropped_records += 1

    # --- coverage: every counter is written here ---
    def passed_through(self) -> None:
        """A call with no tensor in or out (profiler markers...), passed through untouched."""
        self.coverage.passthrough += 1

    def internal_error(self, where: str, reason: str) -> None:
        """A bug of shadow's, caught: counted, and its first reason kept under ``where`` (an op name)."""
        self.coverage.internal_errors += 1
        self.coverage.unsupported.setdefault(where, reason)

    def unobserved_write(self, event: Event) -> None:
        """A storage written behind shadow's back (resynced from the device)."""
        self.coverage.unobserved_writes += 1
        self.events.append(event)

    def out_of_scope(self) -> None:
        """A call outside ShadowMode(scope=...) ran unshadowed."""
        self.coverage.out_of_scope += 1

    def compiled_module(self, name: str, eagerly: bool) -> None:
        """A torch.compile'd module ran inside the mode, eagerly or as compiled code."""
        self.coverage.compiled[name] = self.coverage.compiled.get(name, 0) + 1
        self.coverage.compiled_eagerly = eagerly

    def mirror_counts(self, adopted: int, reinterpreted: int) -> None:
        """The mirror's own counts, at the end of a ``with`` block."""
        self.coverage.tensors_adopted, self.coverage.reinterpreted = adopted, reinterpreted

    # --- aggregates: every call, whether or not its record was kept ---
    @property
    def by_op(self) -> dict[str, Aggregate]:
        """Aggregates by op overload ("aten.mm.default")."""
        return self.view("op")

    @property
    def by_module(self) -> dict[str, Aggregate]:
        """Aggregates by the innermost module ("Net.fc1"; optimizer ops by parameter, "Net.fc1.weight")."""
        return self.view("module")

    @property
    def by_callsite(self) -> dict[str, Aggregate]:
        """Aggregates by call site ("model.py:42": the user's line; a backward op: its forward op's line)."""
        return self.view("callsite")

    @property
    def by_phase(self) -> dict[str, Aggregate]:
        """Aggregates by phase ("forward", "backward", "optimizer", "other")."""
        return self.view("phase")

    def view(self, by: str = "op", phase: str | None = None) -> dict[str, Aggregate]:
        """Aggregates grouped ``by`` "op", "module", "callsite" or "phase", over the calls of one ``phase`` (None:
        all). Computed from the per-(op, module, call site, phase) cells, kept until the next call is added.

        >>> rep.view("module", phase="backward")["Net.fc1"].max_budget_used   # doctest: +SKIP
        """
        if by not in VIEWS:
            raise ValueError(f"view(by={by!r}): expected one of {', '.join(map(repr, VIEWS))}")
        _check_phase("view", phase)
        found = self._views.get((by, phase))
        if found is not None:
            return found
        if self._legacy is not None:
            if by in self._legacy and phase is None:
                return self._legacy[by]
            raise ValueError(f"view(by={by!r}, phase={phase!r}): this report was saved by a shadow before call "
                             "sites and phases were aggregated (format version < 5): only by='op' and by='module' "
                             "over all phases; re-run the program with this shadow for the others")
        i = _CELL[by]
        found = {}
        for key, agg in self.cells.items():
            if phase is not None and key[3] != phase:
                continue
            a = found.get(key[i])
            if a is None:
                a = found[key[i]] = Aggregate()
            a.merge(agg)
        self._views[(by, phase)] = found
        return found

    def module_tree(self, phase: str | None = None) -> dict[str, Aggregate]:
        """Aggregates of every module path with its submodules' calls folded in ("Net.encoder" holds
        "Net.encoder.layer.0", ...; a parameter's optimizer ops count under its module), over one ``phase``
        (None: all). "" holds the calls outside any module."""
        tree: dict[str, Aggregate] = {}
        for name, agg in self.view("module", phase).items():
            parts = name.split(".") if name else [""]
            for depth in range(1, len(parts) + 1):
                key = ".".join(parts[:depth])
                a = tree.get(key)
                if a is None:
                    a = tree[key] = Aggregate()
                a.merge(agg)
        return tree

    # --- queries ---
    def first_nonfinite(self) -> Record | None:
        """The first kept call where device and shadow disagree on NaN/Inf."""
        return next((r for r in self.records if r.nonfinite or (r.local is not None and r.local.nonfinite)), None)

    def nonfinite_origin(self) -> Record | None:
        """Where NaN/Inf is born: the first kept call whose device result holds a NaN or an infinity while none
        of its inputs did. ``rec.nonfinite_cause`` tells a math problem ("math": float64 gives NaN there too)
        from a precision one ("precision": float64 is finite); later calls fed by it say "propagated". Whether it
        matters is ``shadow.nonfinite.flow``'s answer: an attention mask of -inf is born here too, and softmax
        absorbs it before the loss, the gradients and the parameters.

        >>> rec = rep.nonfinite_origin(); rec.op, rec.module, rec.nonfinite_cause   # doctest: +SKIP
        ('aten.log.default', 'Net.bad', 'math')
        """
        return next((r for r in self.records if r.nonfinite_cause in ("math", "precision")), None)

    def records_over_budget(self) -> list[Record]:
        """Kept calls whose local error exceeds the op's error budget, worst first: kernels less accurate
        than the dtype allows (reduced-precision accumulation, TF32, approximate functions, bugs)."""
        return sorted((r for r in self.records if r.over_budget), key=lambda r: -r.budget.used)

    def untrusted(self) -> list[Record]:
        """Kept calls whose float64 reference a spot check found untrustworthy (cancellation). Their error
        figures use the exact value at the sampled elements, which it also gives the shadow; the other
        elements' reference is suspect too. ``rec.spot`` has the reference's own error."""
        return [r for r in self.records if r.spot is not None and r.spot.checked and not r.spot.trusted]

    def find(self, op: str | None = None, module: str | None = None, phase: str | None = None) -> list[Record]:
        """Kept records matching every given field. ``op``: an overload ("aten.mm.default"), an op of every
        overload ("aten.mm") or its short name ("mm"); ``phase``: "forward", "backward", "optimizer", "other".

        >>> rep.find(op="mm", phase="backward")    # doctest: +SKIP
        """
        _check_phase("find", phase)
        return [r for r in self.records
                if (op is None or _names_op(op, r.op)) and (module is None or r.module == module)
                and (phase is None or r.phase == phase)]

    def grouped(self, by: str, phase: str | None, tree: bool) -> dict[str, Aggregate]:
        """The aggregates a table shows: ``view(by, phase)``, or ``module_tree(phase)``."""
        return self.module_tree(phase) if tree else self.view(by, phase)

    # --- persistence ---
    def to_dict(self) -> dict:
        """The saved form (``shadow.reportformat``), non-finite figures as floats. A report read from a version
        before 5 has aggregates by op and by module only, no cells: it is saved as version 4, which says so (saved
        as the current version its aggregates would be recomputed from no cells on load: lost)."""
        return reportformat.write(reportformat.Contents(
            version=reportformat.VERSION if self._legacy is None else 4, meta=self.meta, max_records=self.max_records,
            dropped_records=self.dropped_records, records=self.records, cells=self.cells,
            per_rank={rank: part.cells for rank, part in self.per_rank.items()}, by_op=self.by_op,
            by_module=self.by_module, coverage=self.coverage, events=self.events, trajectory=self.trajectory))

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as versioned JSON (non-finite figures as the strings "inf"/"nan"), whole or not at all:
        a temporary file beside ``path``, then renamed over it."""
        reportformat.save(self.to_dict(), path)

    @classmethod
    def from_dict(cls: type[_R], d: dict) -> _R:
        """A report from its saved form (``to_dict``); versions 1 to 7 load (later versions only added
        fields, and the two renamed in version 4 are read under their old names; before version 5, aggregates
        exist by op and by module only). Anything malformed raises
        ``ReportFormatError`` naming the field, its path and what was expected."""
        return cls.from_contents(reportformat.read(d))

    @classmethod
    def from_contents(cls: type[_R], c: reportformat.Contents) -> _R:
        """A report of the parts the format read (``shadow.reportformat.Contents``)."""
        rep = cls(max_records=c.max_records, meta=c.meta, cells=c.cells)
        rep.dropped_records = c.dropped_records
        rep.records = c.records
        if c.version < 5:
            rep._legacy = {"op": c.by_op, "module": c.by_module}
        rep.per_rank = {rank: cls(cells=cells) for rank, cells in c.per_rank.items()}
        rep.coverage = c.coverage
        rep.events = c.events
        rep.trajectory = c.trajectory
        return rep


def _check_phase(where: str, phase: str | None) -> None:
    if phase is not None and phase not in {p.value for p in Phase}:
        raise ValueError(f"{where}(phase={phase!r}): expected None (all) or one of "
                         f"{', '.join(repr(p.value) for p in Phase)}")


def _names_op(name: str, op: str) -> bool:
    """``name`` designates the overload ``op`` ("aten.mm.default"): as itself, its op ("aten.mm") or its short
    name ("mm")."""
    return op == name or op.startswith(name + ".") or ("." not in name and op.split(".")[1:2] == [name])
