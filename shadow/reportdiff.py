"""Two reports of the same program (``shadow compare A B``; DirectML against CPU, bfloat16 against float32, two library versions): which
ops and modules got worse in the second, and by how much.

The programs must agree: their per-call records are matched in order by (op, module, phase, shape) (``align``:
calls one run adds, such as autocast's casts, are skipped over rather than misalign the rest, and a step is never
matched with the next), and when too few calls match the reports are refused (``ReportDiffError``). The per-op and
per-module figures come from the aggregates, which cover every call even where records were capped; the matched
calls add the individual calls that got worse.

Own error is judged by budget use (the worst call's local error over its a-priori bound): it names the kernels that
changed. Ops without a derived budget (no rule knows them: a guess, or none) are compared by their local ulp, listed
after the judged ones and never named by the verdict: ulps alone are no evidence (at a result that cancels, a correct
kernel's error reads 1e+15 of them). Drift is reported apart: a kernel that got worse makes the drift of everything
downstream worse too.

>>> diff = diff_reports(shadow.load_report("fp32.json"), shadow.load_report("tf32.json"))  # doctest: +SKIP
>>> [c.key for c in diff.worse("op")]                                                  # doctest: +SKIP
['aten.mm.default', 'aten.addmm.default']
>>> print(diff.text)                                                                    # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
from collections import Counter

from .compiled.matching import GraphChange, match_calls
from .records import Aggregate
from .reportdata import ReportData
from .verdict import STORED_BITS, op_class, times

FACTOR = 2.0  # a figure that moved by this factor or more changed (error figures between correct kernels vary less)
FLOOR = 0.01  # ... unless it stays below this share of the budget on both sides: noise of correct kernels
MIN_MATCH = 0.5  # the share of calls that must match in order for two reports to be of the same program
_SHOWN = 10  # rows per list in the text


class ReportDiffError(ValueError):
    """The two reports cannot be compared (not of the same program); the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Figures:
    """One side's figures for an op or module (from its aggregate)."""

    calls: int
    budget_used: float | None  # the worst budget use (None: no call held to a rule's budget)
    local_ulp: float  # the worst local ulp (elements whose reference is not 0)
    effective_bits: float | None  # the fewest bits a call reads (None: exact or no budget)
    drift: float  # the worst drift rel_norm
    over_calls: int  # calls over budget
    nonfinite: int  # elements where device and shadow disagree on NaN/Inf
    stored_bits: float | None = None  # the mantissa bits the narrowest floating result dtype stores (None: none)

    @classmethod
    def of(cls, a: Aggregate) -> Figures:
        return cls(calls=a.calls, budget_used=a.max_budget_used if a.budgeted_calls else None,
                   local_ulp=a.max_local_ulp_nonzero,
                   effective_bits=a.min_effective_bits if math.isfinite(a.min_effective_bits) else None,
                   drift=a.max_drift_rel, over_calls=a.over_budget_calls, nonfinite=a.nonfinite,
                   stored_bits=min((STORED_BITS[d] for d in a.dtypes if d in STORED_BITS), default=None))

    @property
    def own(self) -> float:
        """The own-error figure compared: budget use where there is a budget, else local ulp."""
        return self.budget_used if self.budget_used is not None else self.local_ulp


def _factor(a: float, b: float) -> float:
    """b / a, with 0 -> x as infinitely worse and 0 -> 0 as unchanged."""
    if a == b:
        return 1.0
    return b / a if a > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class Change:
    """An op (or module) in both reports: its figures in A and in B, and the factors B / A."""

    key: str
    a: Figures
    b: Figures

    @property
    def budgeted(self) -> bool:
        """Both sides held to a budget: the own-error figure is budget use (else local ulp)."""
        return self.a.budget_used is not None and self.b.budget_used is not None

    @property
    def own_factor(self) -> float:
        return _factor(*self._own())

    @property
    def drift_factor(self) -> float:
        return _factor(self.a.drift, self.b.drift)

    def _own(self) -> tuple[float, float]:
        if self.budgeted:
            return self.a.budget_used, self.b.budget_used
        return self.a.local_ulp, self.b.local_ulp

    def own_worse(self, factor: float = FACTOR, floor: float = FLOOR) -> bool:
        """B's own error is ``factor`` times A's or more, above the floor (budget share; 1 ulp without a budget),
        and B reads fewer effective bits where both sides read them; or B has calls over budget, or NaN/Inf
        disagreements, where A had none. Effective bits are the rms error over the op's scale: a kernel reading
        its dtype's full precision on both sides, or on B's, has not changed, whatever its worst element did (a 1024-term
        mean moved 0.2 -> 1.0 ulp between fp32 and TF32 runs, its inputs rounded differently upstream)."""
        a, b = self._own()
        floor = floor if self.budgeted else 1.0
        bits_a, bits_b = self.a.effective_bits, self.b.effective_bits
        # B at its dtype's full precision has not got worse, even where A happened to be exact (bits None)
        same_bits = self.budgeted and bits_b is not None and (
            (bits_a is not None and bits_b >= bits_a)
            or (self.b.stored_bits is not None and bits_b >= self.b.stored_bits))
        newly_over = self.b.over_calls > 0 and self.a.over_calls == 0
        newly_nonfinite = self.b.nonfinite > 0 and self.a.nonfinite == 0
        return (_factor(a, b) >= factor and b >= floor and not same_bits) or newly_over or newly_nonfinite

    @property
    def judged(self) -> bool:
        """A change in its own error is evidence: both sides held to derived budgets, or B has calls over budget or
        NaN/Inf disagreements where A had none (without a derived budget, local ulps are compared, and listed apart)."""
        return self.budgeted or (self.b.over_calls > 0 and self.a.over_calls == 0) or \
            (self.b.nonfinite > 0 and self.a.nonfinite == 0)

    def own_better(self, factor: float = FACTOR, floor: float = FLOOR) -> bool:
        return Change(self.key, self.b, self.a).own_worse(factor, floor)

    def drift_worse(self, factor: float = FACTOR) -> bool:
        return self.drift_factor >= factor and self.b.drift > 0

    def __str__(self) -> str:
        a, b = self._own()
        what = "budget" if self.budgeted else "ulp (no derived budget)"
        text = f"{_num(a)} -> {_num(b)} {what} ({times(self.own_factor)})"
        bits = [f"{f.effective_bits:.1f}" if f.effective_bits is not None else "-" for f in (self.a, self.b)]
        if bits != ["-", "-"] and bits[0] != bits[1]:
            text += f"; bits {bits[0]} -> {bits[1]}"
        if self.b.over_calls != self.a.over_calls:
            text += f"; over budget {self.a.over_calls} -> {self.b.over_calls} calls"
        return text


@dataclasses.dataclass(frozen=True)
class CallChange:
    """A call matched in both runs whose own error got worse."""

    index_a: int
    index_b: int
    op: str
    module: str
    phase: str
    a: float  # own error figure in A (budget use; local ulp without a budget)
    b: float
    budgeted: bool

    def __str__(self) -> str:
        return (f"#{self.index_a}/#{self.index_b} {self.op} {self.module or '(no module)'} ({self.phase}): "
                f"{_num(self.a)} -> {_num(self.b)} {'budget' if self.budgeted else 'ulp'} "
                f"({times(_factor(self.a, self.b))})")


@dataclasses.dataclass(frozen=True)
class ReportDiff:
    """The comparison of report B against report A. ``worse``/``better`` pick the changes; ``lines``/``text``
    render them."""

    calls_a: int  # aten calls of each run (all calls)
    calls_b: int
    records_a: int  # per-call records compared (kept records)
    records_b: int
    matched: int  # records matched by op sequence
    match: float  # the share of calls that match in order: 2 * matched / (records_a + records_b), or by counts
    only_a: tuple[tuple[str, int], ...]  # (op, calls) in A's records that B's lack, most first
    only_b: tuple[tuple[str, int], ...]
    by_op: tuple[Change, ...]  # every op in both (aggregates)
    by_module: tuple[Change, ...]
    ops_only_a: tuple[str, ...]  # ops one report has and the other not at all
    ops_only_b: tuple[str, ...]
    calls: tuple[CallChange, ...]  # matched calls whose own error got worse, worst first
    graphs: tuple[GraphChange, ...] = ()  # compiled graphs' calls matched with the calls they stand for
    factor: float = FACTOR
    floor: float = FLOOR

    def _changes(self, by: str) -> tuple[Change, ...]:
        if by not in ("op", "module"):
            raise ValueError(f"by={by!r}: expected 'op' or 'module'")
        return self.by_op if by == "op" else self.by_module

    def worse(self, by: str = "op") -> list[Change]:
        """Ops (modules) whose own error got worse in B: the judged ones (``Change.judged``) first, each part the
        largest factor first."""
        found = [c for c in self._changes(by) if c.own_worse(self.factor, self.floor)]
        return sorted(found, key=lambda c: (not c.judged, -c.own_factor, -c.b.own, c.key))

    def better(self, by: str = "op") -> list[Change]:
        found = [c for c in self._changes(by) if c.own_better(self.factor, self.floor)]
        return sorted(found, key=lambda c: (not c.judged, c.own_factor, c.key))

    def drift_worse(self, by: str = "op") -> list[Change]:
        """Ops (modules) whose drift got worse in B: downstream of a worse kernel, or amplifying more."""
        found = [c for c in self._changes(by) if c.drift_worse(self.factor)]
        return sorted(found, key=lambda c: (-c.drift_factor, c.key))

    @property
    def identical(self) -> bool:
        """Every figure of every op and module the same, and the same calls."""
        return (not self.ops_only_a and not self.ops_only_b and not self.only_a and not self.only_b
                and all(c.a == c.b for c in self.by_op + self.by_module))

    @property
    def changed(self) -> bool:
        """Something got worse or better beyond ``factor`` (drift included)."""
        return bool(self.worse("op") or self.worse("module") or self.better("op") or self.better("module")
                    or self.drift_worse("op"))

    @property
    def lines(self) -> list[str]:
        out = [f"matched {self.matched} calls in order, of A's {self.records_a} and B's {self.records_b} "
               f"({self.match:.0%})" if self.records_a and self.records_b else
               f"no per-call records to match: compared by op counts ({self.match:.0%} alike)"]
        for side, extra in (("A", self.only_a), ("B", self.only_b)):
            if extra:
                shown = ", ".join(f"{op} x{n}" for op, n in extra[:_SHOWN])
                out.append(f"calls only in {side}: {shown}" + (" ..." if len(extra) > _SHOWN else ""))
        for side, ops in (("A", self.ops_only_a), ("B", self.ops_only_b)):
            if ops:
                out.append(f"ops only in {side}: {', '.join(ops[:_SHOWN])}" + (" ..." if len(ops) > _SHOWN else ""))
        for by in ("op", "module"):
            worse, better = self.worse(by), self.better(by)
            for title, rows in ((f"own error worse in B, by {by} (A -> B):", [c for c in worse if c.judged]),
                                (f"own error better in B, by {by} (A -> B):", [c for c in better if c.judged]),
                                (f"not judged (no derived budget), local ulp worse in B, by {by} (A -> B):",
                                 [c for c in worse if not c.judged]),
                                (f"not judged (no derived budget), local ulp better in B, by {by} (A -> B):",
                                 [c for c in better if not c.judged])):
                if rows:
                    width = max(len(c.key or "(none)") for c in rows[:_SHOWN])
                    out.append(title)
                    out += [f"  {c.key or '(none)':<{width}}  {c}" for c in rows[:_SHOWN]]
                    if len(rows) > _SHOWN:
                        out.append(f"  ... and {len(rows) - _SHOWN} more")
        drift = self.drift_worse("op")
        if drift:
            worst = drift[0]
            out.append(f"drift worse in B in {len(drift)} ops (downstream of the above, or amplified); the most: "
                       f"{worst.key} {_num(worst.a.drift)} -> {_num(worst.b.drift)} rel_norm "
                       f"({times(worst.drift_factor)})")
        if self.calls:
            out.append("calls worse in B (matched calls, A's index / B's):")
            out += [f"  {c}" for c in self.calls[:_SHOWN]]
        if self.graphs:
            out.append("compiled graphs, against the calls they stand for (A -> B):")
            out += [f"  {g}" for g in self.graphs[:_SHOWN]] + (["  ..."] if len(self.graphs) > _SHOWN else [])
        out.append(self.verdict)
        return out

    @property
    def verdict(self) -> str:
        worse = [c for c in self.worse("op") if c.judged]
        graphs = [g for g in self.graphs if g.worse(self.factor)]
        if graphs:
            return (f"verdict: B is worse: {len(graphs)} compiled graph call{'s' if len(graphs) > 1 else ''} over "
                    f"budget, the most: {max(graphs, key=lambda g: g.own_b)}")
        if worse:
            classes: dict[str, Change] = {}
            for c in worse:
                classes.setdefault(op_class(c.key), c)
            shown = ", ".join(f"{k} {times(c.own_factor)}" for k, c in list(classes.items())[:5])
            return (f"verdict: B is worse: the own error of {len(classes)} op class{'es' if len(classes) > 1 else ''} "
                    f"grew {self.factor:g}x or more: {shown}")
        unjudged = sorted({op_class(c.key) for c in self.worse("op")})
        if unjudged:
            return (f"verdict: no op held to a derived budget got worse; {len(unjudged)} op "
                    f"class{'es' if len(unjudged) > 1 else ''} without one read more ulps in B, which is no "
                    f"evidence (not judged): {', '.join(unjudged[:5])}" + (" ..." if len(unjudged) > 5 else ""))
        if self.identical:
            return "verdict: nothing changed: the same calls with the same figures"
        if not self.changed:
            return (f"verdict: nothing changed: no op's or module's own error or drift moved by {self.factor:g}x "
                    "or more")
        if self.better("op"):
            return "verdict: B is better: no op's own error got worse, some got better"
        return "verdict: no op's own error got worse; drift moved (see above)"

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def diff_reports(a: ReportData, b: ReportData, *, factor: float = FACTOR, floor: float = FLOOR,
                 min_match: float = MIN_MATCH) -> ReportDiff:
    """Compare report ``b`` against ``a`` (see the module docstring). ``factor``: how much a figure must move to
    count; ``floor``: budget shares below which both sides are noise; ``min_match``: the share of calls that must
    match in order, else ``ReportDiffError``."""
    if not factor > 1:
        raise ValueError(f"factor={factor!r}: expected a number > 1")
    # a compiled graph's call and the calls of the other run it stands for are matched as one (shadow.compiled.matching)
    matched = match_calls(a.records, b.records, _token, align)
    graphs: tuple[GraphChange, ...] = ()
    covered: frozenset[str] = frozenset()  # ops whose every call a matched graph's call is or stands for
    if matched is not None:
        pairs, match, only_a, only_b, graphs, covered = matched
    else:  # records off (max_records=0): how alike the op counts are
        ca, cb = Counter({k: v.calls for k, v in a.by_op.items()}), Counter({k: v.calls for k, v in b.by_op.items()})
        total = sum(ca.values()) + sum(cb.values())
        match = 2 * sum((ca & cb).values()) / total if total else 1.0
        pairs, only_a, only_b = [], Counter(), Counter()
    if match < min_match:
        raise ReportDiffError(f"the reports are not of the same program: only {match:.0%} of their op calls match "
                              f"in order ({len(a.records) or a.coverage.calls} calls against "
                              f"{len(b.records) or b.coverage.calls}); "
                              "compare two runs of the same script with the same steps")

    calls = []
    for i, j in pairs:
        ra, rb = a.records[i], b.records[j]
        if ra.local is None or rb.local is None:
            continue
        budgeted = all(r.budget is not None and not r.budget.is_default for r in (ra, rb))
        va, vb = (ra.budget.used, rb.budget.used) if budgeted else (ra.local.ulp_nonzero, rb.local.ulp_nonzero)
        if _factor(va, vb) >= factor and vb >= (floor if budgeted else 1.0):
            calls.append(CallChange(ra.index, rb.index, ra.op, ra.module, str(ra.phase), va, vb, budgeted))
    calls.sort(key=lambda c: (not c.budgeted, -_factor(c.a, c.b), -c.b, c.index_a))

    def changes(view_a: dict[str, Aggregate], view_b: dict[str, Aggregate]) -> tuple[Change, ...]:
        return tuple(Change(k, Figures.of(view_a[k]), Figures.of(view_b[k])) for k in sorted(view_a.keys() & view_b))

    return ReportDiff(
        calls_a=a.coverage.calls, calls_b=b.coverage.calls, records_a=len(a.records), records_b=len(b.records),
        matched=len(pairs), match=match, only_a=tuple(only_a.most_common()), only_b=tuple(only_b.most_common()),
        by_op=changes(a.by_op, b.by_op), by_module=changes(a.by_module, b.by_module),
        ops_only_a=tuple(sorted(a.by_op.keys() - b.by_op.keys() - covered)),
        ops_only_b=tuple(sorted(b.by_op.keys() - a.by_op.keys() - covered)),
        calls=tuple(calls), graphs=graphs, factor=factor, floor=floor)


def align(seq_a: list, seq_b: list) -> list[tuple[int, int]]:
    """Index pairs (i, j), increasing in both, of the elements of ``seq_a`` and ``seq_b`` matched in order: the
    more of two matchings.

    A training run repeats the same calls every step, and on such a periodic sequence difflib's longest-block-first
    matching can align step k of one run with step k + 1 of the other (one call missing mid-run made it match half
    of 10000 calls). So anchors come first, as in patience diff: the n-th occurrence of a call in A with the n-th
    occurrence of the same call in B, the longest run of those that is increasing in both; only the gaps between
    anchors are matched by difflib. Where calls repeat without a period (short random sequences) anchors can be
    misled and difflib alone matches more (measured: at worst half, against 93 % of the longest common
    subsequence): the larger matching is kept."""
    def numbered(seq: list) -> list[tuple]:
        seen: Counter = Counter()
        out = []
        for t in seq:
            out.append((t, seen[t]))
            seen[t] += 1
        return out

    in_b = {key: j for j, key in enumerate(numbered(seq_b))}
    anchors = _increasing([(i, in_b[key]) for i, key in enumerate(numbered(seq_a)) if key in in_b])
    pairs: list[tuple[int, int]] = []
    start_a = start_b = 0
    for i, j in anchors + [(len(seq_a), len(seq_b))]:
        if i > start_a and j > start_b:
            gap = difflib.SequenceMatcher(None, seq_a[start_a:i], seq_b[start_b:j], autojunk=False)
            pairs += [(start_a + blk.a + k, start_b + blk.b + k) for blk in gap.get_matching_blocks()
                      for k in range(blk.size)]
        if i < len(seq_a):
            pairs.append((i, j))
        start_a, start_b = i + 1, j + 1
    whole = difflib.SequenceMatcher(None, seq_a, seq_b, autojunk=False)
    plain = [(blk.a + k, blk.b + k) for blk in whole.get_matching_blocks() for k in range(blk.size)]
    return max(pairs, plain, key=len)


def _increasing(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest subsequence of ``pairs`` (increasing in i) whose j increase too: patience sorting, O(n log n)."""
    tail_j: list[int] = []  # tail_j[k]: the smallest j that ends an increasing run of length k + 1 so far
    tail: list[int] = []  # ... and the index in pairs of the pair with it
    before = [-1] * len(pairs)  # the previous pair of the run each pair ends
    for n, (_, j) in enumerate(pairs):
        k = bisect.bisect_left(tail_j, j)
        if k:
            before[n] = tail[k - 1]
        if k == len(tail_j):
            tail_j.append(j)
            tail.append(n)
        else:
            tail_j[k], tail[k] = j, n
    run, n = [], tail[-1] if tail else -1
    while n >= 0:
        run.append(pairs[n])
        n = before[n]
    return run[::-1]


def _token(rec) -> tuple:
    """What must agree for two calls to be the same call of the same program (the dtype may differ: bf16 vs fp32)."""
    return rec.op, rec.module, str(rec.phase), rec.shape


def _num(x: float) -> str:
    return f"{x:.3g}"
