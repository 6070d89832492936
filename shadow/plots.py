"""Plots of a report: drift along the op sequence, budget use per op, the bits each op class reads, local error per
module and phase, the trajectory.

matplotlib is optional (the ``display`` extra), so it is imported inside the functions that draw; each returns a
``matplotlib.figure.Figure`` drawn on the Agg canvas, never through pyplot (no window, no process-wide figure
list to leak into). A report without records gets a figure that says so instead of an error.

>>> from shadow import plots
>>> plots.write_pngs(sm.report, "plots")        # doctest: +SKIP
['plots/drift.png', 'plots/budget.png', 'plots/bits.png', 'plots/modules.png', 'plots/trajectory.png']
"""

from __future__ import annotations

import io
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from .nonfinite import flow
from .records import Aggregate, Phase, Record, op_class
from .reportdata import ReportData
from .tables import number
from .verdict import FORMATS, STORED_BITS, arithmetic, op_classes, run_losses

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .band import Envelope

NEED_MATPLOTLIB = ("shadow's plots need matplotlib, which is not installed: pip install matplotlib "
                   "(or pip install 'shadow[display]')")
PHASES = tuple(p.value for p in Phase)
PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c"}
DRIFT_METRICS = ("rel_norm", "ulp")
HEATMAP_METRICS = ("budget", "ulp")
_OVER = "#c44e52"  # over budget, in every figure
_WITHIN = "#4c72b0"


def drift_figure(report: ReportData, *, metric: str = "rel_norm") -> Figure:
    """Drift of each kept call (its result against the shadow) along the op sequence, on a log axis: ``metric``
    "rel_norm" or "ulp" (max ulp). Bands mark the forward, backward, optimizer and other phases, the top axis
    names the modules of the longest runs of calls, and rings mark calls whose own error was over budget: where
    drift rises at a ring, a kernel added it; where it rises without one, earlier error was amplified.

    >>> fig = drift_figure(rep, metric="ulp")    # doctest: +SKIP
    """
    _check_choice("drift_figure", "metric", metric, DRIFT_METRICS)
    fig = _new_figure(11, 4.5)
    ax = fig.add_subplot()
    records = report.records
    if not records:
        return _say(fig, ax, "no records: nothing ran under ShadowMode, or the report keeps none (max_records=0)")
    labelled = set()  # one legend entry per phase, however many bands it has
    for first, last, phase in _runs(records, lambda r: r.phase.value):
        ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLORS[phase], alpha=0.15, lw=0, gid=f"band:{phase}",
                   label=None if phase in labelled else phase)
        labelled.add(phase)
    drawn = [r for r in records if 0 < _drift_value(r, metric) < math.inf]  # a log axis has no 0 (nor NaN, inf)
    if drawn:
        ax.plot([r.index for r in drawn], [_drift_value(r, metric) for r in drawn], ".", ms=3, color="black",
                label="drift")
        over = [r for r in drawn if r.over_budget]
        if over:
            ax.plot([r.index for r in over], [_drift_value(r, metric) for r in over], "o", mfc="none", mec=_OVER,
                    ms=7, label="call over its budget")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no drift: every compared result equals its shadow", transform=ax.transAxes,
                ha="center", va="center")
    born = flow(report)
    if born.origin is not None:  # NaN/Inf that reaches the loss, a gradient or a parameter: where it is born
        ax.axvline(born.origin.index, color=_OVER, ls="--", lw=1.2,
                   label=f"NaN/Inf born ({op_class(born.origin.op)})", gid="nonfinite:born")
    ax.set_xlim(records[0].index - 0.5, records[-1].index + 0.5)
    ax.set_xlabel("op call (record index)")
    ax.set_ylabel("drift, " + ("rel_norm ||y - shadow|| / ||shadow||" if metric == "rel_norm" else "max ulp"))
    ax.set_title("drift along the op sequence" + (f" (first {len(records)} calls kept of "
                                                   f"{len(records) + report.dropped_records})"
                                                   if report.dropped_records else ""))
    fig.legend(loc="outside lower center", fontsize=8, ncols=6)  # below the axes: points can be anywhere
    _module_labels(ax, records)
    return fig


def budget_figure(report: ReportData, *, top: int = 30) -> Figure:
    """Budget use per op (``Report.by_op``: the worst call's local error over its a-priori bound), one horizontal
    bar per op held to a rule's budget, worst first, ``top`` at most, on a log axis with the 1.0 line: bars past it
    (red) are kernels less accurate than their dtype allows. Ops with only default budgets are left out: a
    guessed budget is no evidence.

    >>> budget_figure(rep).axes[0].patches      # doctest: +SKIP
    """
    rows = sorted(((op, a) for op, a in report.by_op.items() if a.budgeted_calls),
                  key=lambda kv: (-kv[1].max_budget_used, kv[0]))
    shown = rows[:top]
    fig = _new_figure(9, 1.4 + 0.3 * max(len(shown), 3))
    ax = fig.add_subplot()
    if not report.by_op:
        return _say(fig, ax, "no records: nothing ran under ShadowMode")
    if not shown:
        return _say(fig, ax, "no op was held to a rule's budget (budgets off, or only ops no rule knows)")
    used = [a.max_budget_used for _, a in shown]
    finite = [u for u in used if 0 < u < math.inf] + [1.0]
    floor = 10.0 ** (math.floor(math.log10(min(finite))) - 1)
    ceiling = 10.0 ** (math.ceil(math.log10(max(finite))) + 1)
    ends = [min(max(u, floor), ceiling) for u in used]  # 0 sits at the floor, inf at the ceiling: labels say which
    bars = ax.barh(range(len(shown)), [e - floor for e in ends], left=floor,
                   color=[_OVER if a.over_budget_calls else _WITHIN for _, a in shown])
    ax.bar_label(bars, labels=[number(u) + (" !" if a.over_budget_calls else "") for u, (_, a) in zip(used, shown)],
                 padding=3, fontsize=8)
    ax.set_yticks(range(len(shown)), labels=[op for op, _ in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(floor, ceiling)
    ax.axvline(1.0, color=_OVER, ls="--", lw=1, label="budget (1.0)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("max budget used (local error / a-priori bound; ! some call over budget)")
    more = f"; {len(rows) - len(shown)} ops using less not shown" if len(rows) > len(shown) else ""
    ax.set_title(f"budget use per op{more}")
    return fig


def bits_figure(report: ReportData) -> Figure:
    """The bits each op class's error reads (``OpClass.effective_bits``, x) against its budget use (y, log), one
    point per op class held to a rule's budget whose results round: red over budget, blue within. Vertical lines
    mark the formats an error may read like (bfloat16 7 bits, float16 and TF32 10, the dtype's own), the
    horizontal one the budget (1.0). A cluster on one format line above 1.0 is one cause, as the verdict says
    ("bfloat16-like arithmetic throughout"); points away from it are its exceptions, and are named.

    >>> bits_figure(rep).axes[0].collections     # doctest: +SKIP
    """
    classes = [c for c in op_classes(report) if c.effective_bits is not None and math.isfinite(c.effective_bits)]
    fig = _new_figure(9, 4)
    ax = fig.add_subplot()
    if not report.by_op:
        return _say(fig, ax, "no records: nothing ran under ShadowMode")
    if not classes:
        return _say(fig, ax, "no op class held to a rule's budget rounds: nothing to place (budgets off, or every "
                             "result exact)")
    cause = arithmetic(classes)
    used = [min(max(c.budget_used, 1e-3), 1e8) for c in classes]  # 0 and inf at the axis' ends
    over = [c.over_calls > 0 for c in classes]
    for flag, color, label in ((True, _OVER, "op class over budget"), (False, _WITHIN, "op class within budget")):
        points = [(c.effective_bits, u) for c, u, o in zip(classes, used, over) if o == flag]
        if points:
            ax.scatter([b for b, _ in points], [u for _, u in points], s=22, color=color, alpha=0.8, label=label,
                       gid=f"bits:{'over' if flag else 'within'}")
    stored = {d.replace("torch.", ""): STORED_BITS[d] for c in classes for d in c.dtypes if d in STORED_BITS}
    # the formats an error may read like, and the dtypes' own bits
    lines = {**{"float16 / TF32" if name == "float16" else name: bits for name, bits in FORMATS}, **stored}
    named: dict[int, str] = {}  # one name a line: float16's own 10 bits are the format's line
    for name, bits in lines.items():
        named.setdefault(bits, name)
        ax.axvline(bits, color="#8c8c8c", ls=":", lw=1)
    # named on a top axis, above the points (a cluster at a format's line would hide a label inside the axes)
    ax.secondary_xaxis("top").set_xticks(list(named), labels=list(named.values()), fontsize=7, color="#555555")
    ax.axhline(1.0, color=_OVER, ls="--", lw=1, label="budget (1.0)")
    # the exceptions to the one cause (every class over budget where there is none), and its classes unless they
    # are most of them
    named = [c for c in classes if c.over_calls and (cause is None or not cause.throughout or c not in cause.classes)]
    for c in named[:8]:
        ax.annotate(c.op.removeprefix("aten."), (c.effective_bits, min(max(c.budget_used, 1e-3), 1e8)),
                    xytext=(4, 3), textcoords="offset points", fontsize=7)
    ax.set_yscale("log")
    ax.set_xlim(0, max(*lines.values(), *(c.effective_bits for c in classes)) + 2)
    ax.set_xlabel("effective bits: the mantissa bits the op class's worst error reads")
    ax.set_ylabel("max budget used")
    title = "bits each op class reads"
    if cause is not None:
        title += f": {cause.like} arithmetic in {len(cause.classes)} of {len(classes)} op classes"
    ax.set_title(title)
    fig.legend(loc="outside lower center", fontsize=8, ncols=3)  # below the axes: points can be anywhere
    return fig


def module_heatmap(report: ReportData, *, metric: str = "budget", top: int = 40) -> Figure:
    """Local error per module (rows, in tree order) and phase (forward, backward, optimizer, other), from
    ``Report.view("module", phase=...)``: ``metric`` "budget" (max budget used, the figure comparable across
    ops) or "ulp" (max local ulp over nonzero references). A parameter's optimizer calls count in its module's
    row. Empty cells: no call there (or, for "budget", no call held to a rule's budget: ``-``). With more than
    ``top`` modules, the worst ``top`` are shown.

    >>> module_heatmap(rep, metric="ulp")        # doctest: +SKIP
    """
    _check_choice("module_heatmap", "metric", metric, HEATMAP_METRICS)
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    columns = _module_cells(report)
    modules = sorted({m for cells in columns.values() for m in cells}, key=lambda m: m.split("."))
    worst = {m: max((_nan_low(_cell_value(c[m], metric)) for c in columns.values() if m in c), default=-math.inf)
             for m in modules}
    if len(modules) > top:
        keep = set(sorted(modules, key=lambda m: -worst[m])[:top])
        modules = [m for m in modules if m in keep]
    fig = _new_figure(8, 1.6 + 0.32 * max(len(modules), 3))
    ax = fig.add_subplot()
    if not modules:
        return _say(fig, ax, "no records: nothing ran under ShadowMode")
    phases = list(columns)
    grid = np.array([[_cell_value(columns[p][m], metric) if m in columns[p] else math.nan for p in phases]
                     for m in modules], dtype=float)
    positive = grid[np.isfinite(grid) & (grid > 0)]
    vmin = positive.min() if positive.size else 1e-3
    vmax = max(positive.max() if positive.size else 1.0, vmin * 10)
    cmap = colormaps["viridis"].with_extremes(bad="#eeeeee", over=_OVER)  # bad: no call, 0 or no budget
    image = ax.imshow(np.where(np.isinf(grid), vmax * 10, grid), cmap=cmap, norm=LogNorm(vmin, vmax),
                      aspect="auto", interpolation="nearest")
    bar = fig.colorbar(image, ax=ax)
    name = "max budget used" if metric == "budget" else "max local ulp"
    bar.set_label(name)
    if metric == "budget" and vmin <= 1.0 <= vmax:
        bar.ax.axhline(1.0, color=_OVER, lw=2)
    for i, m in enumerate(modules):
        for j, p in enumerate(phases):
            if m in columns[p]:
                text = _heat_text(columns[p][m], grid[i, j], metric)
                light = math.isfinite(grid[i, j]) and grid[i, j] > 0 and image.norm(grid[i, j]) < 0.6
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if light else "black")
    ax.set_xticks(range(len(phases)), labels=phases)
    ax.set_yticks(range(len(modules)), labels=[m or "(none)" for m in modules], fontsize=8)
    shown = f" (worst {top} of {len(worst)} modules)" if len(worst) > len(modules) else ""
    ax.set_title(f"local error per module and phase: {name}{shown}")
    return fig


def trajectory_figure(report: ReportData) -> Figure:
    """The drift of the loss and of the parameters after each optimizer step (``report.trajectory``), on a log
    axis: whether drift grows, saturates or is washed out by training.

    >>> fig = trajectory_figure(rep)             # doctest: +SKIP
    """
    fig = _new_figure(9, 4)
    from matplotlib.ticker import MaxNLocator

    ax = fig.add_subplot()
    steps = report.trajectory
    if not steps:
        return _say(fig, ax, "no records of steps: no optimizer step ran under ShadowMode")
    x = [t.step for t in steps]
    for values, label in (([t.loss_drift for t in steps], "loss"), ([t.params for t in steps], "parameters")):
        shown = [(s, v) for s, v in zip(x, values) if v is not None and v > 0 and math.isfinite(v)]
        if shown:
            ax.plot([s for s, _ in shown], [v for _, v in shown], marker="." if len(shown) < 50 else None,
                    label=label)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers: no tick at 1.25
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("drift (relative, against float64)")
    ax.set_title("drift of the loss and of the parameters over the run")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return fig


def envelope_figure(env: Envelope, losses: dict[str, Sequence[Any]] | Sequence[Any] | None = None, *,
                    start: int = 1) -> Figure:
    """The envelope of correct implementations (``shadow.envelope``): each step's band and each random-rounding run,
    as the loss minus the float64 loss, and ``losses`` (one run, or runs by name, the first at step ``start``) drawn
    on it, a ring where one leaves the band.

    >>> fig = envelope_figure(env, {"cuda": cuda_losses})     # doctest: +SKIP
    """
    fig = _new_figure(9, 4.5)
    from matplotlib.ticker import MaxNLocator

    ax = fig.add_subplot()
    x = list(range(1, env.steps + 1))
    ref = env.float64
    ax.fill_between(x, [lo - r for lo, r in zip(env.low, ref)], [hi - r for hi, r in zip(env.high, ref)],
                    color=_WITHIN, alpha=0.2, lw=0, label=f"{env.confidence:.0%} band of correct implementations")
    for i, run in enumerate(env.values):
        ax.plot(x, [v - r for v, r in zip(run, ref)], color=_WITHIN, lw=0.6, alpha=0.6,
                label=f"{env.runs} {env.device} runs" if i == 0 else None)
    ax.axhline(0.0, color="black", lw=0.8, label="float64")
    named = losses if isinstance(losses, dict) else {} if losses is None else {"run": losses}
    for name, values in named.items():
        shown = [float(v) for v in values][:max(0, env.steps - start + 1)]
        at = x[start - 1:start - 1 + len(shown)]
        ax.plot(at, [v - ref[s - 1] for v, s in zip(shown, at)], marker=".", label=name)
        out = [i for i, inside in enumerate(env.contains(shown, start=start)) if not inside]
        ax.scatter([at[i] for i in out], [shown[i] - ref[at[i] - 1] for i in out], s=80, facecolors="none",
                   edgecolors=_OVER, zorder=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss - float64 loss")
    ax.set_title("the envelope of correct implementations")
    ax.legend(fontsize="small")
    return fig


def run_envelope_figure(report: ReportData, env: Envelope) -> Figure:
    """``envelope_figure`` with the report's own loss per optimizer step (``run_losses``) drawn on the band."""
    first, losses = run_losses(report, env.steps)
    return envelope_figure(env, {"this run": losses}, start=first)


FIGURES: dict[str, Callable[[ReportData], Figure]] = {"drift": drift_figure, "budget": budget_figure, "bits": bits_figure,
                                                   "modules": module_heatmap,
                                                   "trajectory": trajectory_figure}  # name -> figure, as written


def png(fig: Figure, *, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (for pages that inline it)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def write_pngs(report: ReportData, directory: str | os.PathLike, *, dpi: int = 100,
               envelope: Envelope | None = None) -> list[str]:
    """Write every figure of ``FIGURES`` as ``DIRECTORY/NAME.png`` (the directory is created if missing), and
    ``envelope.png`` with ``envelope`` (``run_envelope_figure``); returns the paths written.

    >>> write_pngs(rep, "plots")                 # doctest: +SKIP
    ['plots/drift.png', 'plots/budget.png', 'plots/bits.png', 'plots/modules.png', 'plots/trajectory.png']
    """
    os.makedirs(directory, exist_ok=True)
    paths = []
    figures = {name: lambda make=make: make(report) for name, make in FIGURES.items()}
    if envelope is not None:
        figures["envelope"] = lambda: run_envelope_figure(report, envelope)
    for name, make in figures.items():
        path = os.path.join(directory, f"{name}.png")
        with open(path, "wb") as f:
            f.write(png(make(), dpi=dpi))
        paths.append(path)
    return paths


def has_matplotlib() -> bool:
    """matplotlib can be imported (the figures can be drawn)."""
    try:
        require_matplotlib()
    except ImportError:
        return False
    return True


def require_matplotlib() -> None:
    """Raise ImportError with the install command when matplotlib is missing (before any work is done)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(NEED_MATPLOTLIB) from exc


def _new_figure(width: float, height: float) -> Figure:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _say(fig: Figure, ax: Axes, message: str) -> Figure:
    ax.set_axis_off()
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", wrap=True)
    return fig


def _check_choice(where: str, name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{where}({name}={value!r}): expected one of {', '.join(map(repr, valid))}")


def _runs(records: list[Record], key: Callable[[Record], str]) -> Iterator[tuple[int, int, str]]:
    """(first index, last index, key) of each run of consecutive records with the same key."""
    first = records[0]
    prev = first
    for rec in records[1:]:
        if key(rec) != key(first):
            yield first.index, prev.index, key(first)
            first = rec
        prev = rec
    yield first.index, prev.index, key(first)


def _drift_value(rec: Record, metric: str) -> float:
    if rec.drift is None:
        return 0.0
    return rec.drift.rel_norm if metric == "rel_norm" else rec.drift.max_ulp


def _module_labels(ax: Axes, records: list[Record], most: int = 24) -> None:
    """Name the longest runs of calls on a top axis (every run would be unreadable on a long run) by their module;
    where no long run is in a named module (a model of plain functions and tensors: makemore's), by the line of the
    user's code that made them; with neither, the axis is left out."""
    span = records[-1].index - records[0].index + 1
    for what, name in (("module", lambda r: r.module), ("call site", lambda r: os.path.basename(r.callsite))):
        runs = [r for r in _runs(records, name) if r[2] and r[1] - r[0] + 1 >= span / 80]
        if runs:
            break
    else:
        return
    runs = sorted(sorted(runs, key=lambda r: r[0] - r[1])[:most])
    top = ax.secondary_xaxis("top")
    top.set_xticks([(first + last) / 2 for first, last, _ in runs], labels=[label for _, _, label in runs],
                   rotation=45, ha="left", fontsize=7)
    top.set_xlabel(what, fontsize=7, loc="left")


def _module_cells(report: ReportData) -> dict[str, dict[str, Aggregate]]:
    """phase -> module -> aggregate; optimizer calls, named by parameter ("Net.fc.weight"), under the module."""
    try:
        views = {p: report.view("module", phase=p) for p in PHASES}
    except ValueError:  # saved before phases were aggregated (format < 5): one column over all phases
        return {"all phases": dict(report.by_module)}
    columns: dict[str, dict[str, Aggregate]] = {}
    for phase, view in views.items():
        cells = columns[phase] = {}
        for key, agg in view.items():
            module = key.rpartition(".")[0] if phase == Phase.OPTIMIZER.value else key
            cell = cells.get(module)
            if cell is None:
                cell = cells[module] = Aggregate()
            cell.merge(agg)
    return columns


def _cell_value(agg: Aggregate, metric: str) -> float:
    if metric == "ulp":
        return agg.max_local_ulp_nonzero
    return agg.max_budget_used if agg.budgeted_calls else math.nan


def _heat_text(agg: Aggregate, value: float, metric: str) -> str:
    if metric == "budget" and not agg.budgeted_calls:
        return "-"
    return number(value) + (" !" if metric == "budget" and agg.over_budget_calls else "")


def _nan_low(x: float) -> float:
    """NaN (no budget) ranks below every figure: max() and sorting would otherwise depend on the order."""
    return -math.inf if math.isnan(x) else x
