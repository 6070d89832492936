"""A report as one self-contained HTML page (``shadow html REPORT -o FILE``: ``shadow.cli.html``): the verdict and
the plot that shows it (its first screen), the run's meta, coverage, where NaN/Inf is born and where it goes, the
calls over budget, the per-op and per-module tables, and the other plots (``shadow.plots``).

Everything is inline (styles, a small table-sorting script, plots as base64 PNG) and the page's Content Security
Policy forbids loading anything else, so it opens offline and can be mailed or attached to a bug report as one
file. Every string from the report is escaped.

>>> from shadow import html
>>> open("report.html", "w").write(html.render(sm.report))   # doctest: +SKIP
"""

from __future__ import annotations

import base64
import dataclasses
import math
from html import escape
from typing import TYPE_CHECKING, Callable, Sequence

from . import plots
from .records import Aggregate
from .reportdata import ReportData
from .tables import LEGEND, ORDER, budget_cell, drift_cell, floating, number, row_order, short_dtype, ulp_cell
from .verdict import Verdict, conclude, run_losses

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .band import Envelope

MAX_ROWS = 500  # rows of the over-budget table; the rest are counted (a long run can have thousands)

_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: .8em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; margin: .3em 0; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; font-size: 13px; }
th, td { padding: .2em .6em; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
th { background: #f4f4f4; position: sticky; top: 0; }
table.sortable th { cursor: pointer; } th[aria-sort=descending]::after { content: " \\25BE"; }
th[aria-sort=ascending]::after { content: " \\25B4"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.over td { background: #fbe9e9; }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; }
pre.verdict { white-space: pre-wrap; border-left: 4px solid #55a868; font-size: 14px; margin: .3em 0;
              max-height: 30vh; overflow-y: auto; }
figure.verdict { margin: .3em 0; } figure.verdict img { max-height: 55vh; max-width: 100%; width: auto; }
pre.verdict.suspicious { border-left-color: #c44e52; }
dl.legend { display: grid; grid-template-columns: max-content auto; gap: .1em 1em; font-size: 13px; color: #555; }
dl.legend dt { font-weight: 600; } dl.legend dd { margin: 0; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption, .note { color: #555; font-size: 13px; }
"""
# Click a header to sort by it; numeric cells sort by data-v, the figure before formatting ("784 !" reads 784).
_SCRIPT = """
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), col = th.cellIndex, down = th.getAttribute("aria-sort") !== "descending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", down ? "descending" : "ascending");
    function key(row) {
      var cell = row.cells[col];
      return cell.dataset.v === undefined ? cell.textContent : parseFloat(cell.dataset.v);
    }
    var rows = Array.prototype.slice.call(table.tBodies[0].rows);
    rows.sort(function (a, b) {
      var x = key(a), y = key(b), d = typeof x === "number" ? x - y : String(x).localeCompare(String(y));
      return down ? -d : d;
    });
    rows.forEach(function (row) { table.tBodies[0].appendChild(row); });
  });
});
"""

_CAPTIONS = {
    "drift": "Drift of each kept call against its shadow, along the op sequence; bands: phases; rings: calls whose "
             "own (local) error was over budget. Drift that rises at a ring was added by that kernel; drift that "
             "rises without one was amplified from earlier error.",
    "budget": "Budget use per op: the worst call's local error over the a-priori bound a correct kernel in its "
              "dtype may reach. Past the 1.0 line (red): less accurate than the dtype allows.",
    "bits": "The bits each op class's error reads against its budget use: a cluster on one format's line above 1.0 "
            "is one cause (bfloat16 or TF32 arithmetic); points away from it are the exceptions, named.",
    "modules": "Local error per module and phase (max budget used; - no call held to a rule's budget). A "
               "parameter's optimizer calls count in its module's row.",
    "trajectory": "Drift of the loss and of the parameters after each optimizer step, against float64: growing, "
                  "saturating or washed out by training.",
    "envelope": "The run's loss minus the float64 loss, step by step, on the band that correct implementations with "
                "random rounding span (shadow envelope): a ring where the run leaves it, further from the true "
                "result than correct rounding takes a run.",
}
_ORDER = f"Rows: {ORDER} (as Report.table); click a header to sort by it. Shaded rows had a call over budget. Columns:"


@dataclasses.dataclass(frozen=True)
class _Cell:
    text: str
    sort: float | None = None  # numeric sort key (data-v); None: sort by the text

    def render(self) -> str:
        if self.sort is None:
            return f"<td>{escape(self.text)}</td>"
        return f'<td class="num" data-v="{_sort_key(self.sort)}">{escape(self.text)}</td>'


def render(report: ReportData, *, title: str = "shadow report", envelope: Envelope | None = None) -> str:
    """The report as one HTML page (a str; write it with ``encoding="utf-8"``). Plots need matplotlib; without it
    the page says how to install it and shows everything else. With ``envelope`` (``shadow.envelope``), the verdict
    says whether the run's loss stays in its band, drawn with the run's loss under the verdict.

    >>> page = render(shadow.load_report("run.json"))   # doctest: +SKIP
    """
    verdict = conclude(report, envelope)
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<pre class="verdict{" suspicious" if verdict.suspicious else ""}">{escape(verdict.text)}</pre>',
        _figure(report, verdict.plot, "verdict") if plots.has_matplotlib() else "",
        "" if envelope is None else _envelope(report, envelope),
        _meta(report),
        "<h2>Coverage</h2>",
        f"<pre>{escape(str(report.coverage))}</pre>",
        _nonfinite(verdict),
        _over_budget(report),
        "<h2>Per op</h2>",
        _aggregates(report.by_op, "op"),
        "<h2>Per module</h2>",
        _aggregates(report.by_module, "module"),
        _legend(),
        "<h2>Plots</h2>",
        _plots(report, verdict.plot),
    ]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{escape(title)}</title>\n<style>{_STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>{_SCRIPT}</script>\n</body></html>\n")


def _meta(report: ReportData) -> str:
    """The run's meta: versions and other scalars in a table, each mapping (options, numerics) in its own block."""
    scalars = {k: v for k, v in report.meta.items() if not isinstance(v, dict)}
    parts = [_key_values(scalars)] if scalars else []
    for key, value in report.meta.items():
        if isinstance(value, dict):
            opened = " open" if key == "options" else ""
            parts.append(f"<details{opened}><summary>{escape(str(key))}</summary>{_key_values(value)}</details>")
    if report.dropped_records:
        parts.append(f'<p class="note">Per-call records capped at {escape(str(report.max_records))}: '
                     f"{report.dropped_records} later calls not kept. The per-op and per-module tables count "
                     "them; the over-budget table, the origin of NaN/Inf and the drift plot do not.</p>")
    return "<h2>Run</h2>\n" + ("\n".join(parts) if parts else '<p class="note">no meta recorded</p>')


def _key_values(d: dict) -> str:
    rows = "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(_value(v))}</td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def _value(v: object) -> str:
    """A meta value in words: a mapping as "key: value, ...", a list as its items (a command line), None "none"."""
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) or "none"
    if isinstance(v, (list, tuple)):
        return " ".join(_value(x) for x in v)
    return "none" if v is None else str(v)


_CAUSES = {"math": "float64 makes it too", "precision": "the device's rounding: float64 is finite there"}


def _nonfinite(verdict: Verdict) -> str:
    """The NaN/Inf finding (the call that made it, and how it got to the loss, the gradients or the parameters),
    then the births absorbed on the way: information."""
    head = "<h2>Where NaN/Inf is born</h2>\n"
    found = verdict.nonfinite
    parts = []
    if found is not None:
        parts.append(f"<p>{escape(found.headline)}</p>" + (f"<p>{escape(found.route)}.</p>" if found.op else ""))
    if verdict.absorbed:
        targets = "the loss, the gradients or the parameters" if verdict.trained else "the result"
        parts.append(f"<p>Made and absorbed before it reached {targets}: not a finding (an attention mask of -inf "
                     "that softmax absorbs is one).</p>")
        rows = [[_Cell(a.op), _Cell(", ".join(a.modules)), _Cell(str(a.calls), a.calls), _Cell(_CAUSES[a.cause]),
                 _Cell(", ".join(a.absorbers) or "no call shadow compared read it")] for a in verdict.absorbed]
        parts.append(_table(("op", "modules", "calls", "float64", "absorbed by"), rows))
    if not parts:
        parts.append("<p>No kept call produced NaN or Inf from finite inputs, and none reached the loss, the "
                     "gradients or the parameters.</p>")
    return head + "\n".join(parts)


_OVER_COLUMNS = ("#", "op", "module", "phase", "call site", "dtype", "shape", "budget used", "effective bits")


def _over_budget(report: ReportData) -> str:
    records = report.records_over_budget()
    head = "<h2>Calls over budget</h2>\n"
    if not records:
        return head + "<p>No kept call's local error exceeded its op's budget.</p>"
    rows = []
    for rec in records[:MAX_ROWS]:
        bits = rec.local.effective_bits if rec.local is not None else None
        cells = [_Cell(str(rec.index), rec.index), _Cell(rec.op), _Cell(rec.module or "(none)"), _Cell(str(rec.phase)),
                 _Cell(rec.callsite or "-"), _Cell(short_dtype(rec.dtype) or "-"),
                 _Cell("x".join(map(str, rec.shape)) or "scalar"), _Cell(number(rec.budget.used), rec.budget.used),
                 _Cell("-", -1.0) if bits is None or math.isnan(bits) else _Cell(f"{bits:.1f}", bits)]
        rows.append(cells)
    more = (f'<p class="note">{len(records) - MAX_ROWS} more calls over budget not listed.</p>'
            if len(records) > MAX_ROWS else "")
    intro = (f"<p>{len(records)} kept call(s) whose own error exceeds what a correct kernel in the device dtype may "
             "make (reduced-precision accumulation, TF32, approximate functions, bugs), worst first.</p>")
    return head + intro + _table(_OVER_COLUMNS, rows) + more


def _aggregates(table: dict[str, Aggregate], by: str) -> str:
    """The columns of ``Report.table``, in its order (``tables.row_order``)."""
    if not table:
        return "<p>No calls.</p>"
    rows = sorted(table.items(), key=lambda kv: row_order(*kv))
    mixed = len({d for a in table.values() for d in a.dtypes if floating(d)}) > 1
    columns = _AGGREGATE_COLUMNS if mixed else [c for c in _AGGREGATE_COLUMNS if c[0] != "dtype"]
    body = [[_Cell(key or "(none)")] + [cell(a) for _, cell in columns] for key, a in rows]
    return _table([by] + [name for name, _ in columns], body, [a.over_budget_calls > 0 for _, a in rows])


def _legend() -> str:
    """What each column means: ``report.LEGEND``, the words ``Report.summary`` prints, in the tables' order."""
    entries = "".join(f"<dt>{escape(name)}</dt><dd>{escape(LEGEND[name])}</dd>" for name, _ in _AGGREGATE_COLUMNS)
    return f'<p class="note">{escape(_ORDER)}</p>\n<dl class="legend">{entries}</dl>'


_AGGREGATE_COLUMNS: list[tuple[str, Callable[[Aggregate], _Cell]]] = [
    ("calls", lambda a: _Cell(str(a.calls), a.calls)),
    ("dtype", lambda a: _Cell("/".join(short_dtype(d) for d in a.dtypes if floating(d)) or "-")),
    ("local ulp", lambda a: _Cell(ulp_cell(a), a.max_local_ulp_nonzero)),
    ("budget", lambda a: _Cell(budget_cell(a), a.max_budget_used if a.budgeted_calls else -1.0)),
    ("bits", lambda a: _Cell("-", -1.0) if math.isinf(a.min_effective_bits)
     else _Cell(f"{a.min_effective_bits:.1f}", a.min_effective_bits)),
    ("drift rel", lambda a: _Cell(drift_cell(a), a.max_drift_rel)),
    ("flips", lambda a: _Cell(str(a.flips), a.flips)),
    ("nonfin", lambda a: _Cell(str(a.nonfinite), a.nonfinite)),
    ("unsup", lambda a: _Cell(str(a.kinds.get("unsupported", 0)), a.kinds.get("unsupported", 0))),
    ("untrust", lambda a: _Cell(f"{a.spot_untrusted} !" if a.spot_untrusted else "0", a.spot_untrusted)),
]


def _table(headers: Sequence[str], rows: list[list[_Cell]], over: list[bool] | None = None) -> str:
    """A sortable table; rows flagged in ``over`` are shaded (calls over budget)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    flags = over or [False] * len(rows)
    body = "\n".join(('<tr class="over">' if o else "<tr>") + "".join(c.render() for c in row) + "</tr>"
                     for row, o in zip(rows, flags))
    return f'<table class="sortable"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody></table>'



def _plots(report: ReportData, shown: str) -> str:
    """Every figure but ``shown``, which the verdict's figure on the first screen is."""
    if not plots.has_matplotlib():
        return f'<p class="note">{escape(plots.NEED_MATPLOTLIB)}</p>'
    return "\n".join(_figure(report, name) for name in plots.FIGURES if name != shown) + \
        f'\n<p class="note">The {escape(shown)} plot is at the top, under the verdict.</p>'


def _figure(report: ReportData, name: str, css: str = "", fig: Figure | None = None) -> str:
    data = base64.b64encode(plots.png(plots.FIGURES[name](report) if fig is None else fig)).decode("ascii")
    css = f' class="{css}"' if css else ""
    return (f'<figure id="plot-{name}"{css}><img alt="{escape(name)} plot" '
            f'src="data:image/png;base64,{data}"><figcaption>{escape(_CAPTIONS[name])}</figcaption></figure>')


def _envelope(report: ReportData, envelope: Envelope) -> str:
    """The band of correct implementations with the run's loss: the figure (with matplotlib) and the table."""
    first, losses = run_losses(report, envelope.steps)
    figure = _figure(report, "envelope", fig=plots.run_envelope_figure(report, envelope)) \
        if plots.has_matplotlib() else ""
    return "<h2>Envelope</h2>\n" + figure + f"\n<pre>{escape(envelope.table(losses, start=first))}</pre>"


def _sort_key(x: float) -> str:
    """A figure as data-v: JavaScript's parseFloat reads it, and inf/nan sort at the ends rather than break it."""
    if math.isnan(x):
        return "-1e308"
    return repr(max(min(float(x), 1e308), -1e308))
