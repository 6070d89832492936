"""The report of a run: per-call records (``shadow.records``), per-op and per-module aggregates, coverage,
and the saved format."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import textwrap
from typing import Any, Callable, Iterable

from .metrics import ErrorStats
from .records import BudgetInfo, Event, Kind, Phase, Record
from . import reportformat
from .reportformat import FORMAT, READS, VERSION  # noqa: F401 (declared in the format's own module)
from .spot import SpotStats
from .trajectory import StepDrift

VIEWS = ("op", "module", "callsite", "phase")  # the ways aggregates are grouped (Report.view)
_CELL = {"op": 0, "module": 1, "callsite": 2, "phase": 3}  # a view's position in a cell's key


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
        for name in ("zero_reference_calls", "flips", "nonfinite", "budgeted_calls", "over_budget_calls",
                     "spot_checked", "spot_untrusted"):
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


class Report:
    """The results of a ShadowMode run: per-call records, per-op and per-module aggregates, coverage.

    >>> rep = sm.report
    >>> print(rep.table())            # doctest: +SKIP
    >>> rep.save("run.json"); shadow.load_report("run.json")  # doctest: +SKIP
    """

    def __init__(self, *, max_records: int | None = None, meta: dict | None = None):
        self.max_records = max_records
        self.meta = dict(meta or {})
        self.records: list[Record] = []
        self.dropped_records = 0
        self.coverage = Coverage()
        self.events: list[Event] = []
        self.trajectory: list[StepDrift] = []  # per optimizer step: the loss's and the parameters' drift
        # every call lands in one cell, keyed (op, module, call site, phase); the views merge cells on demand
        self._cells: dict[tuple[str, str, str, str], Aggregate] = {}
        self._views: dict[tuple[str, str | None], dict[str, Aggregate]] = {}  # merged views, until the next add
        self._legacy: dict[str, dict[str, Aggregate]] | None = None  # by op and module of a report saved before 5
        # a merged report (shadow.merge_reports): each rank's cells, with only the figures its table compares
        self.per_rank: dict[Any, Report] = {}

    def add(self, rec: Record) -> None:
        self.coverage.calls += 1
        self.coverage.kinds[rec.kind] = self.coverage.kinds.get(rec.kind, 0) + 1
        if rec.kind is Kind.UNSUPPORTED:
            self.coverage.unsupported.setdefault(rec.op, rec.reason)
        key = (rec.op, rec.module, rec.callsite, rec.phase)
        agg = self._cells.get(key)
        if agg is None:
            agg = self._cells[key] = Aggregate()
        agg.add(rec)
        if self._views:
            self._views.clear()
        if self.max_records is None or len(self.records) < self.max_records:
            self.records.append(rec)
            _untrack(rec)
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
        for key, agg in self._cells.items():
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

    def table(self, by: str = "op", top: int | None = None, *, phase: str | None = None, tree: bool = False) -> str:
        """A text table of the aggregates ``by`` "op", "module", "callsite" or "phase" (``Report.view``), over the
        calls of one ``phase`` (None: all), sorted by the worst budget used, then the worst local ulp, then the
        worst drift. ``tree=True`` (by="module"): every module path with its submodules folded in, in tree order,
        indented by depth. ``summary`` adds the legend and the verdict.

        columns (``LEGEND`` says the same in a user's words): calls, the result dtypes (only when the run mixes
        floating dtypes, as under autocast), max local ulp (over elements whose reference is not 0; ``z``: some
        reference is exactly 0 where the device is not, whose error is in abs and the budget), max budget used
        (``!``: some call over budget; ``-``: only default budgets), the fewest effective bits of a call (``-``:
        exact or no budget; a long TF32 matmul within its worst-case budget still reads ~10 here), max drift
        rel_norm, flips, non-finite, unsupported calls, calls whose float64 reference a spot check found
        untrustworthy (``!`` marks rows with any).

        A merged report (``shadow.merge_reports``) adds, after each figure the rows are ranked by (local ulp,
        budget, drift rel) on which its ranks differ in some row, one column per rank ("budget r0", "budget r1",
        ...; ``=`` on the rows where the ranks agree on it), and a line under the table saying where the ranks
        differ, or that they agree (``RANK_RTOL``; docs/reports.md, "Merged reports")."""
        t = self._table_cells(by, top, phase, tree)
        return "\n".join([_plain_table(t.head, t.rows)] + ([t.ranks_line] if t.ranks_line else []))

    def summary(self, by: str = "op", top: int | None = None, *, phase: str | None = None, tree: bool = False,
                rich: bool = False, color: bool = False, width: int = 120) -> str:
        """What ``shadow show`` prints: the table (``table``), how its rows are sorted and what each column means,
        and the verdict (``shadow.verdict.conclude``: what is over budget, where NaN/Inf is born, what was not
        checked, or the all-clear). ``rich=True`` draws the table with the ``rich`` package (``pip install rich``),
        at most ``width`` characters wide, with ANSI colours if ``color`` (for a terminal).

        >>> print(rep.summary(top=10))     # doctest: +SKIP
        """
        from .verdict import conclude

        t = self._table_cells(by, top, phase, tree)
        lines = [_rich_table(t.head, t.rows, width, color) if rich else _plain_table(t.head, t.rows)]
        if len(t.rows) < t.total:
            lines.append(f"({len(t.rows)} of {t.total} rows)")
        if t.ranks_line:
            lines.append(t.ranks_line)
        order = "tree order, parents above their submodules" if tree else \
            "worst budget use first, then worst local ulp, then worst drift"
        lines += ["", f"rows: {order}; columns:"]
        keys = {**LEGEND, t.head[0]: _KEY_LEGEND[by] + (" (with its submodules)" if tree else "")}
        legend = [(name, keys[name]) for name in t.head if name in keys]
        legend += [(f"{name} rK", _RANK_LEGEND.format(name)) for name in t.rank_figures]
        name_w = max(len(name) for name, _ in legend)
        for name, text in legend:
            lines += textwrap.wrap(text, width=max(width, 60), initial_indent=f"  {name:<{name_w}}  ",
                                   subsequent_indent=" " * (name_w + 4), break_on_hyphens=False)
        lines += ["", conclude(self).text]
        return "\n".join(lines)

    def _table_cells(self, by: str, top: int | None, phase: str | None, tree: bool) -> _Table:
        if tree and by != "module":
            raise ValueError(f"table(by={by!r}, tree=True): a tree is of modules: use by='module'")
        table = self._grouped(by, phase, tree)
        if tree:  # parents first, children below them
            keys = sorted(table, key=lambda k: k.split("."))
        else:
            keys = sorted(table, key=lambda k: (-table[k].max_budget_used, -table[k].max_local_ulp_nonzero,
                                                -table[k].max_drift_rel, k))
        total = len(keys)
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or top < 0:
                raise ValueError(f"table(top={top!r}): expected None (every row) or an int >= 0")
            keys = keys[:top]
        mixed = len({d for a in table.values() for d in a.dtypes if _floating(d)}) > 1
        columns = [name for name in _COLUMNS if name != "dtype" or mixed]
        ranks = list(self.per_rank) if len(self.per_rank) > 1 else []  # a merged report's
        per_rank, differ = self._rank_rows(by, phase, tree, table) if ranks else ({}, {})
        shown = [name for name in columns if differ.get(name)]
        head = [by]
        for name in columns:
            head += [name] + ([f"{name} r{r}" for r in ranks] if name in shown else [])
        rows = []
        for key in keys:
            a = table[key]
            label = ("  " * key.count(".")) + key.rsplit(".", 1)[-1] if tree else key  # a tree's: indented by depth
            cells = {"calls": str(a.calls), "dtype": "/".join(_short_dtype(d) for d in a.dtypes if _floating(d)) or "-",
                     "local ulp": _ulp_cell(a), "budget": _budget_cell(a),
                     "bits": "-" if math.isinf(a.min_effective_bits) else f"{a.min_effective_bits:.1f}",
                     "drift rel": _drift_cell(a), "flips": str(a.flips), "nonfin": str(a.nonfinite),
                     "unsup": str(a.kinds.get("unsupported", 0)),
                     "untrust": (str(a.spot_untrusted) + " !") if a.spot_untrusted else "0"}
            row = [label or "(none)"]
            for name in columns:
                row.append(cells[name])
                if name in shown:
                    row += [_rank_cell(_RANK_FIGURES[name], key in differ[name], r) for r in per_rank[key]]
            rows.append(row)
        return _Table(head, rows, total, shown, _ranks_line(ranks, differ, len(table)) if ranks else None)

    def _rank_rows(self, by: str, phase: str | None, tree: bool, table: dict[str, Aggregate]
                   ) -> tuple[dict[str, list[Aggregate | None]], dict[str, set[str]]]:
        """A merged report's ``table`` by rank: each row's aggregate of every rank (None: no call), and for each
        figure of ``_RANK_FIGURES`` the rows on which the ranks differ."""
        parts = [part._grouped(by, phase, tree) for part in self.per_rank.values()]
        per_rank = {key: [part.get(key) for part in parts] for key in table}
        return per_rank, {name: {key for key in table if not _ranks_agree(figure, per_rank[key])}
                          for name, figure in _RANK_FIGURES.items()}

    def _grouped(self, by: str, phase: str | None, tree: bool) -> dict[str, Aggregate]:
        """The aggregates a table shows: ``view(by, phase)``, or ``module_tree(phase)``."""
        return self.module_tree(phase) if tree else self.view(by, phase)

    # --- persistence ---
    def to_dict(self) -> dict:
        """The saved form (``shadow.reportformat``), non-finite figures as floats."""
        return reportformat.to_dict(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as versioned JSON (non-finite figures as the strings "inf"/"nan"), whole or not at all:
        a temporary file beside ``path``, then renamed over it."""
        reportformat.save(self, path)

    @classmethod
    def from_dict(cls, d: dict) -> Report:
        """A report from its saved form (``to_dict``); versions 1 to 7 load (later versions only added
        fields, and the two renamed in version 4 are read under their old names; before version 5, aggregates
        exist by op and by module only). Anything malformed raises
        ``ReportFormatError`` naming the field, its path and what was expected."""
        return reportformat.from_dict(d)


def load_report(path: str | os.PathLike) -> Report:
    """Read a report written by ``Report.save``; checks its format name, version and every field against the
    format's declaration (``shadow.reportformat``), and says what is wrong with anything else
    (``ReportFormatError``).

    >>> rep = shadow.load_report("run.json")  # doctest: +SKIP
    """
    return reportformat.load(path)


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
_GC_UNTRACK = _gc_untrack()


def _untrack(rec: Record) -> None:
    """Take a kept record and its figures out of the garbage collector's lists. Kept records pile up (one to five
    tracked objects a call), and as they do they set off the collector's full collections, each a walk over
    every object of the process: 7-13 us a call over a long run of small ops, and a third of a small GPT-2's
    shadowed step (benchmarks/records_gc.py). A record and its figures hold numbers, strings and each other, never
    a reference back, so no cycle the collector could free runs through them; reference counting frees them.
    Each is an instance of a collected type (``_gc_untrack`` checks), which untracking twice leaves untracked."""
    if _GC_UNTRACK is None:
        return
    for o in (rec, rec.local, rec.drift, rec.budget, rec.spot, rec.cpu):
        if o is not None:
            _GC_UNTRACK(o)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


def _drift_cell(a: Aggregate) -> str:
    return _fmt(a.max_drift_rel)


def _ulp_cell(a: Aggregate) -> str:
    """max local ulp over elements whose reference is not 0; ``z`` marks rows where some reference is exactly 0
    and the device is not (the ulp at 0 is subnormal: 1e30+ for any error; read abs and the budget there)."""
    return _fmt(a.max_local_ulp_nonzero) + (" z" if a.zero_reference_calls else "")


def _budget_cell(a: Aggregate) -> str:
    """max budget used, ``!`` when a call was over it; ``-`` when no call had a rule's budget (a 0 would read
    as perfect)."""
    if not a.budgeted_calls:
        return "-"
    return _fmt(a.max_budget_used) + (" !" if a.over_budget_calls else "")


# the table's columns after the key: the narrowest width each takes (it widens to fit its cells), and its alignment
_COLUMNS = {"calls": (6, ">"), "dtype": (5, "<"), "local ulp": (10, ">"), "budget": (8, ">"), "bits": (5, ">"),
            "drift rel": (10, ">"), "flips": (6, ">"), "nonfin": (6, ">"), "unsup": (5, ">"), "untrust": (7, ">")}
LEGEND = {  # what each column of Report.table means, in a user's words (Report.summary prints it)
    "calls": "op calls in the row (every call: the tables are never capped)",
    "dtype": "the calls' floating result dtypes (shown when the run mixes them)",
    "local ulp": "worst local error: the op's own error against float64 on its own inputs, in ulps of the result "
                 "dtype (z: some exact result is 0, where any error reads 1e30+ ulp: judge it by the budget)",
    "budget": "worst local error / the error a correct kernel in that dtype may make; above 1 (!) the kernel is "
              "less accurate than its dtype allows; -: no budget rule for the op",
    "bits": "the fewest mantissa bits a call's error reads like (~23: correct float32, ~10: TF32 or float16, "
            "~7: bfloat16; -: exact or no budget)",
    "drift rel": "worst drift, ||device - shadow|| / ||shadow||: all the error accumulated since shadowing began",
    "flips": "integer/bool output elements that differ from the shadow's (argmax, masks, comparisons)",
    "nonfin": "elements where device and shadow disagree on NaN/Inf",
    "unsup": "calls shadow cannot replay (device result adopted)",
    "untrust": "calls whose float64 reference mpmath found inaccurate (!: heavy cancellation)",
}
_RANK_LEGEND = ("rank K's {0}, where the ranks differ on it in some row (=: they agree on this row; no call: rank K "
                "has no call in it)")
_KEY_LEGEND = {"op": "the aten op overload", "module": "the innermost module (optimizer ops: the parameter updated)",
               "callsite": "file:line in your code (a backward op: its forward op's line)",
               "phase": "forward, backward, optimizer, or other (outside modules and steps)"}


# --- merged reports: each rank's figures beside the merged ones ---
RANK_FIELDS = ("calls", "max_local_ulp_nonzero", "zero_reference_calls", "budgeted_calls", "max_budget_used",
               "over_budget_calls", "max_drift_rel")  # what a merged report keeps of each rank's cells (per_rank)
# Ranks agree on a figure when their values are within this relative tolerance. Replicated work (DDP's optimizer
# step) gives equal figures; where float64 references are summed in another order (other thread counts) they move
# by ~1e-16 relative, which against a float32-sized error (~1e-7 relative) moves the figure by ~1e-9 of itself.
RANK_RTOL = 1e-9


@dataclasses.dataclass(frozen=True, slots=True)
class _RankFigure:
    """A figure the table ranks rows by, compared across the ranks of a merged report."""

    cell: Callable[[Aggregate], str]  # its text, as in its column
    value: Callable[[Aggregate], float]  # ranks agree when these are within a relative RANK_RTOL ...
    marks: Callable[[Aggregate], tuple]  # ... and these are equal


_RANK_FIGURES = {  # in the order of their columns
    "local ulp": _RankFigure(_ulp_cell, lambda a: a.max_local_ulp_nonzero, lambda a: (a.zero_reference_calls > 0,)),
    "budget": _RankFigure(_budget_cell, lambda a: a.max_budget_used,
                          lambda a: (a.budgeted_calls > 0, a.over_budget_calls)),
    "drift rel": _RankFigure(_drift_cell, lambda a: a.max_drift_rel, lambda a: ()),
}


def _ranks_agree(figure: _RankFigure, aggs: list[Aggregate | None]) -> bool:
    """Every rank has calls in the row, with equal marks and values within a relative ``RANK_RTOL``."""
    if any(a is None for a in aggs):
        return False
    values = [figure.value(a) for a in aggs]
    return len({figure.marks(a) for a in aggs}) == 1 and math.isclose(min(values), max(values), rel_tol=RANK_RTOL)


def _rank_cell(figure: _RankFigure, differ: bool, a: Aggregate | None) -> str:
    if not differ:
        return "="
    return "no call" if a is None else figure.cell(a)


def _ranks_line(ranks: list, differ: dict[str, set[str]], total: int) -> str:
    """Under a merged report's table: where its ranks differ, or that they agree."""
    names = ", ".join(map(str, ranks))
    rows = set().union(*differ.values())
    if not rows:
        return (f"ranks {names} agree on every row: local ulp, budget use and drift within a relative "
                f"{RANK_RTOL:g}, the same calls over budget")
    agree = [name for name in _RANK_FIGURES if not differ[name]]
    return (f"ranks {names} differ on {len(rows)} of {total} rows in "
            f"{', '.join(name for name in _RANK_FIGURES if differ[name])} (beyond a relative {RANK_RTOL:g}, other "
            f"calls over budget, or no call): a column per rank, = where they agree"
            + (f"; they agree on {', '.join(agree)} in every row" if agree else ""))


@dataclasses.dataclass(slots=True)
class _Table:
    """A table as text cells, and in a merged report what its ranks' columns show."""

    head: list[str]
    rows: list[list[str]]  # the key first
    total: int  # rows before ``top``
    rank_figures: list[str]  # the figures with a column per rank
    ranks_line: str | None  # a merged report's: where its ranks differ, or that they agree


def _column(name: str) -> tuple[int, str]:
    """A column's narrowest width and alignment (a rank's column, "budget r1": its figure's)."""
    return _COLUMNS.get(name) or _COLUMNS[name.rsplit(" ", 1)[0]]


def _plain_table(head: list[str], rows: list[list[str]]) -> str:
    """The table as aligned text: the key column left, each other column as ``_COLUMNS`` says."""
    widths = [max([len(head[0])] + [len(r[0]) for r in rows])]
    widths += [max([_column(name)[0]] + [len(r[i]) for r in rows]) for i, name in enumerate(head) if i]
    aligns = ["<"] + [_column(name)[1] for name in head[1:]]

    def line(cells: list[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, aligns, widths)).rstrip()

    return "\n".join([line(head), "-" * len(line(head))] + [line(r) for r in rows])


def _rich_table(head: list[str], rows: list[list[str]], width: int, color: bool) -> str:
    """The table drawn by ``rich``, rows with a call over budget in red (with ``color``)."""
    import io

    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError as exc:
        raise ImportError("Report.summary(rich=True) needs the rich package: pip install rich (or "
                          "pip install 'shadow[display]'), or pass rich=False for plain text") from exc
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in head:
        table.add_column(name, justify="right" if name != head[0] and _column(name)[1] == ">" else "left",
                         no_wrap=name != head[0], overflow="fold")  # a long key folds onto more lines, never cut
    for r in rows:
        table.add_row(*r, style="red" if r[head.index("budget")].endswith("!") else None)
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=color, no_color=not color, highlight=False).print(table)
    return out.getvalue().rstrip("\n")


def _check_phase(where: str, phase: str | None) -> None:
    if phase is not None and phase not in {p.value for p in Phase}:
        raise ValueError(f"{where}(phase={phase!r}): expected None (all) or one of "
                         f"{', '.join(repr(p.value) for p in Phase)}")


def _names_op(name: str, op: str) -> bool:
    """``name`` designates the overload ``op`` ("aten.mm.default"): as itself, its op ("aten.mm") or its short
    name ("mm")."""
    return op == name or op.startswith(name + ".") or ("." not in name and op.split(".")[1:2] == [name])


def _floating(dtype: str) -> bool:
    return "float" in dtype or "complex" in dtype


def _short_dtype(dtype: str) -> str:
    return dtype.replace("torch.", "")


def merged(stats: Iterable[ErrorStats | None]) -> ErrorStats | None:
    """Merge the stats of several outputs into one (None if there are none). The stats of a call with one
    output are returned as they are, not copied."""
    present = [s for s in stats if s is not None]
    if len(present) <= 1:
        return present[0] if present else None
    out = ErrorStats()
    for s in present:
        out.merge(s)
    return out
