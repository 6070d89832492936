"""A report as text: its tables (``Report.table``: plain, or drawn by rich), the legend of their columns, a merged
report's columns per rank, and the summary ``shadow show`` prints with the verdict (``Report.summary``). The cells'
words (``number``, ``ulp_cell``, ``budget_cell``... ``LEGEND``) are the HTML page's and the plots' too.

>>> number(0.000123456), number(0.0), number(float("inf"))
('0.000123', '0', 'inf')
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import TYPE_CHECKING, Callable

from .records import Aggregate
from .reportdata import ReportData
from .verdict import conclude, run_losses

if TYPE_CHECKING:
    from .band import Envelope


def summary(report: ReportData, by: str = "op", top: int | None = None, *, phase: str | None = None,
            tree: bool = False, rich: bool = False, color: bool = False, width: int = 120,
            envelope: Envelope | None = None) -> str:
    """What ``shadow show`` prints (``Report.summary``): the table, how its rows are sorted and what each column
    means, and the verdict (with ``envelope``: whether the run's loss stays in its band, and the band's table)."""
    t = text_table(report, by, top, phase, tree)
    lines = [_rich_table(t.head, t.rows, width, color) if rich else _plain_table(t.head, t.rows)]
    if len(t.rows) < t.total:
        lines.append(f"({len(t.rows)} of {t.total} rows)")
    if t.ranks_line:
        lines.append(t.ranks_line)
    order = "tree order, parents above their submodules" if tree else ORDER
    lines += ["", f"rows: {order}; columns:"]
    keys = {**LEGEND, t.head[0]: _KEY_LEGEND[by] + (" (with its submodules)" if tree else "")}
    legend = [(name, keys[name]) for name in t.head if name in keys]
    legend += [(f"{name} rK", _RANK_LEGEND.format(name)) for name in t.rank_figures]
    name_w = max(len(name) for name, _ in legend)
    for name, text in legend:
        lines += textwrap.wrap(text, width=max(width, 60), initial_indent=f"  {name:<{name_w}}  ",
                               subsequent_indent=" " * (name_w + 4), break_on_hyphens=False)
    lines += ["", conclude(report, envelope).text]
    if envelope is not None:
        first, losses = run_losses(report, envelope.steps)
        lines += ["", envelope.table(losses, start=first)]
    return "\n".join(lines)


def table(report: ReportData, by: str = "op", top: int | None = None, *, phase: str | None = None,
          tree: bool = False) -> str:
    """``Report.table``: the aggregates as a plain text table, and a merged report's line on its ranks."""
    t = text_table(report, by, top, phase, tree)
    return "\n".join([_plain_table(t.head, t.rows)] + ([t.ranks_line] if t.ranks_line else []))


def text_table(report: ReportData, by: str, top: int | None, phase: str | None, tree: bool) -> Table:
    """The table of ``report`` as text, row by row (``Report.table``'s arguments)."""
    if tree and by != "module":
        raise ValueError(f"table(by={by!r}, tree=True): a tree is of modules: use by='module'")
    table = report.grouped(by, phase, tree)
    if tree:  # parents first, children below them
        keys = sorted(table, key=lambda k: k.split("."))
    else:
        keys = sorted(table, key=lambda k: row_order(k, table[k]))
    total = len(keys)
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"table(top={top!r}): expected None (every row) or an int >= 0")
        keys = keys[:top]
    mixed = len({d for a in table.values() for d in a.dtypes if floating(d)}) > 1
    columns = [name for name in _COLUMNS if name != "dtype" or mixed]
    ranks = list(report.per_rank) if len(report.per_rank) > 1 else []  # a merged report's
    per_rank, differ = _rank_rows(report, by, phase, tree, table) if ranks else ({}, {})
    shown = [name for name in columns if differ.get(name)]
    head = [by]
    for name in columns:
        head += [name] + ([f"{name} r{r}" for r in ranks] if name in shown else [])
    rows = []
    for key in keys:
        a = table[key]
        label = ("  " * key.count(".")) + key.rsplit(".", 1)[-1] if tree else key  # a tree's: indented by depth
        text = {"calls": str(a.calls), "dtype": "/".join(short_dtype(d) for d in a.dtypes if floating(d)) or "-",
                "local ulp": ulp_cell(a), "budget": budget_cell(a),
                "bits": "-" if math.isinf(a.min_effective_bits) else f"{a.min_effective_bits:.1f}",
                "drift rel": drift_cell(a), "flips": str(a.flips), "nonfin": str(a.nonfinite),
                "unsup": str(a.kinds.get("unsupported", 0)),
                "untrust": (str(a.spot_untrusted) + " !") if a.spot_untrusted else "0"}
        row = [label or "(none)"]
        for name in columns:
            row.append(text[name])
            if name in shown:
                row += [_rank_cell(_RANK_FIGURES[name], key in differ[name], r) for r in per_rank[key]]
        rows.append(row)
    return Table(head, rows, total, shown, _ranks_line(ranks, differ, len(table)) if ranks else None)


def _rank_rows(report: ReportData, by: str, phase: str | None, tree: bool, table: dict[str, Aggregate]
               ) -> tuple[dict[str, list[Aggregate | None]], dict[str, set[str]]]:
    """A merged report's ``table`` by rank: each row's aggregate of every rank (None: no call), and for each
    figure of ``_RANK_FIGURES`` the rows on which the ranks differ."""
    parts = [part.grouped(by, phase, tree) for part in report.per_rank.values()]
    per_rank = {key: [part.get(key) for part in parts] for key in table}
    return per_rank, {name: {key for key in table if not _ranks_agree(figure, per_rank[key])}
                      for name, figure in _RANK_FIGURES.items()}


def row_order(key: str, a: Aggregate) -> tuple:
    """The tables' order: rows with calls held to a derived budget first (a guessed budget is no evidence), by
    worst budget use, then worst local ulp, then worst drift."""
    return not a.budgeted_calls, -a.max_budget_used, -a.max_local_ulp_nonzero, -a.max_drift_rel, key


def number(x: float) -> str:
    """A figure in a cell: three significant digits, 0 and non-finite values as themselves."""
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


def drift_cell(a: Aggregate) -> str:
    return number(a.max_drift_rel)


# a local ulp above this, in a row whose every budgeted call is within its derived budget, is marked c (cancels)
MANY_ULPS = 16.0


def cancels(a: Aggregate) -> bool:
    """The row's worst local ulp is large (over ``MANY_ULPS``) and a derived budget allows it: no call over its
    budget, none held only to a guess. A budget bounds the error at the scale of what the op computes from (|A|@|B|,
    sum |x|, an elementwise op's inputs), so where the exact result is much smaller than that (cancellation), a
    correct kernel's error is many ulps of the result."""
    return bool(a.budgeted_calls and not a.over_budget_calls and not a.guessed_calls
                and a.max_local_ulp_nonzero > MANY_ULPS)


def ulp_cell(a: Aggregate) -> str:
    """max local ulp over elements whose reference is not 0; ``z`` marks rows where some reference is exactly 0
    and the device is not (the ulp at 0 is subnormal: 1e30+ for any error; read abs and the budget there), ``c``
    rows whose many ulps their derived budgets allow (``cancels``)."""
    return number(a.max_local_ulp_nonzero) + (" z" if a.zero_reference_calls else "") + (" c" if cancels(a) else "")


def budget_cell(a: Aggregate) -> str:
    """max budget used over the calls held to a derived budget, ``!`` when a call was over it, else ``?`` when some
    calls had only the guess for ops no rule knows; ``?`` alone when every call had only that guess, ``-`` when no
    call had a budget (a 0 would read as perfect)."""
    if not a.budgeted_calls:
        return "?" if a.guessed_calls else "-"
    return number(a.max_budget_used) + (" !" if a.over_budget_calls else " ?" if a.guessed_calls else "")


ORDER = "those with derived budgets first; worst budget use first, then worst local ulp, then worst drift"
# the table's columns after the key: the narrowest width each takes (it widens to fit its cells), and its alignment
_COLUMNS = {"calls": (6, ">"), "dtype": (5, "<"), "local ulp": (10, ">"), "budget": (8, ">"), "bits": (5, ">"),
            "drift rel": (10, ">"), "flips": (6, ">"), "nonfin": (6, ">"), "unsup": (5, ">"), "untrust": (7, ">")}
LEGEND = {  # what each column of Report.table means, in a user's words (Report.summary prints it)
    "calls": "op calls in the row (every call: the tables are never capped)",
    "dtype": "the calls' floating result dtypes (shown when the run mixes them)",
    "local ulp": "worst local error: the op's own error against float64 on its own inputs, in ulps of the result "
                 "dtype (z: some exact result is 0, where any error reads 1e30+ ulp: judge it by the budget; c: "
                 f"over {MANY_ULPS:g} ulps yet within a derived budget, which bounds the error at the scale of what "
                 "the op computes from (|A|@|B| for a matmul, sum |x| for a sum, an elementwise op's inputs): the "
                 "exact result is much smaller than that (cancellation), so a correct kernel's error is many ulps "
                 "of it)",
    "budget": "worst local error / the error a correct kernel in that dtype may make, derived from the op and its "
              "arguments; above 1 (!) the kernel is less accurate than its dtype allows; ?: calls of an op no "
              "budget rule knows, held only to a guess of a few ulps, which is no evidence: not judged (alone: "
              "every call); -: no budget (no floating result, or budgets off)",
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
    "local ulp": _RankFigure(ulp_cell, lambda a: a.max_local_ulp_nonzero,
                             lambda a: (a.zero_reference_calls > 0, cancels(a))),
    "budget": _RankFigure(budget_cell, lambda a: a.max_budget_used,
                          lambda a: (a.budgeted_calls > 0, a.over_budget_calls, a.guessed_calls > 0)),
    "drift rel": _RankFigure(drift_cell, lambda a: a.max_drift_rel, lambda a: ()),
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
class Table:
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


def floating(dtype: str) -> bool:
    return "float" in dtype or "complex" in dtype


def short_dtype(dtype: str) -> str:
    return dtype.replace("torch.", "")
