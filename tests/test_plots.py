"""shadow.plots: each figure's axes and artists on a real TF32-emulated training step and on hand-made reports
(empty, unbudgeted, infinite budget use, saved before phases were aggregated), and the PNGs written."""

from __future__ import annotations

import math
import sys

import pytest
import torch

pytest.importorskip("matplotlib")

from models import build, make_batches  # noqa: E402
from shadow import Kind, Phase, Record, Report, ShadowMode  # noqa: E402
from shadow import plots  # noqa: E402
from shadow.metrics import ErrorStats  # noqa: E402
from shadow.modes import TF32Mode  # noqa: E402
from shadow.records import BudgetInfo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def tf32_step() -> Report:
    """One SGD step of the test MLP under emulated TF32: every matmul (K = 12 or 32) goes far over its float32
    budget (TF32 keeps 10 mantissa bits), the rest stays within."""
    model = build("mlp")
    (x, y), = make_batches("mlp", 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with TF32Mode(), ShadowMode() as sm:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return sm.report


@pytest.fixture(scope="module")
def report() -> Report:
    return tf32_step()


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


def _record(index: int, op: str, used: float | None, *, module: str = "Net.fc", drift: float = 1e-6) -> Record:
    budget = None if used is None else BudgetInfo("matmul", used)
    return Record(index, op, module, Phase.FORWARD, Kind.REPLAYED, local=ErrorStats(max_abs=1e-7, n=4),
                  drift=ErrorStats(rel_norm=drift, max_ulp=drift * 1e7, n=4), budget=budget, dtype="torch.float32",
                  shape=(2, 2))


def test_drift_figure_bands_points_and_module_labels(report):
    fig = plots.drift_figure(report)
    ax = fig.axes[0]
    runs = [p.value for i, p in enumerate(r.phase for r in report.records)
            if i == 0 or report.records[i - 1].phase != p]
    bands = [p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith("band:")]
    assert bands == [f"band:{p}" for p in runs]
    assert set(runs) == {"forward", "backward", "optimizer", "other"}  # the step has every phase
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"forward", "backward", "optimizer", "other", "drift", "call over its budget"} <= legend
    assert ax.get_yscale() == "log"
    drift, over = ax.lines[0], ax.lines[1]
    assert len(over.get_xdata()) == len([r for r in report.records_over_budget() if r.drift.rel_norm > 0])
    assert len(drift.get_xdata()) == len([r for r in report.records if r.drift is not None and r.drift.rel_norm > 0])
    top = next(a for a in fig.axes[0].child_axes)  # the secondary axis naming modules
    labels = [t.get_text() for t in top.get_xticklabels()]
    assert {"MLP.fc1", "MLP.fc2", "MLP.fc3"} <= set(labels)


def test_drift_figure_ulp_and_bad_metric(report):
    ax = plots.drift_figure(report, metric="ulp").axes[0]
    assert ax.get_ylabel() == "drift, max ulp"
    with pytest.raises(ValueError, match="expected one of 'rel_norm', 'ulp'"):
        plots.drift_figure(report, metric="abs")


def test_budget_figure_one_bar_per_budgeted_op(report):
    fig = plots.budget_figure(report)
    ax = fig.axes[0]
    budgeted = {op: a for op, a in report.by_op.items() if a.budgeted_calls}
    bars = ax.containers[0]
    assert len(bars) == len(budgeted)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "aten.mm.default"  # worst first, at the top
    assert set(labels) == set(budgeted)
    red = [b for b in bars if b.get_facecolor()[0] > 0.7]
    assert len(red) == sum(1 for a in budgeted.values() if a.over_budget_calls) == 2  # mm and addmm
    assert ax.get_xscale() == "log"
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.lines)  # the budget line


def test_budget_figure_top_counts_the_rest(report):
    ax = plots.budget_figure(report, top=2).axes[0]
    assert len(ax.containers[0]) == 2
    budgeted = sum(1 for a in report.by_op.values() if a.budgeted_calls)
    assert ax.get_title() == f"budget use per op; {budgeted - 2} ops using less not shown"


def test_budget_figure_zero_and_infinite_use():
    # a bound of 0 with a nonzero error reads inf; an exact result reads 0: neither fits a log axis
    rep = Report()
    for i, (op, used) in enumerate([("aten.mm.default", math.inf), ("aten.exp.default", 0.0),
                                    ("aten.add.Tensor", 0.5), ("aten.foo.default", None)]):
        rep.add(_record(i, op, used))
    ax = plots.budget_figure(rep).axes[0]
    assert len(ax.containers[0]) == 3  # aten.foo has no budget
    assert [t.get_text() for t in ax.texts] == ["inf !", "0.5", "0"]


def test_bits_figure_places_each_rounding_op_class(report):
    """TF32's matmuls sit on the 10-bit line far above the budget, every other op class at float32's bits below."""
    from shadow.verdict import op_classes

    ax = plots.bits_figure(report).axes[0]
    rounding = [c for c in op_classes(report) if c.effective_bits is not None]
    over = next(c for c in ax.collections if c.get_gid() == "bits:over").get_offsets()
    within = next(c for c in ax.collections if c.get_gid() == "bits:within").get_offsets()
    assert len(over) == 2 and len(over) + len(within) == len(rounding)
    assert all(9 <= b <= 11 and u > 1 for b, u in over) and all(b > 18 and u <= 1 for b, u in within)
    assert {t.get_text() for t in ax.texts} == {"mm", "addmm"}  # the classes over budget, named
    # the formats' lines are named on a top axis, above the points, where no cluster can hide a name
    (top,) = ax.child_axes
    assert [t.get_text() for t in top.get_xticklabels()] == ["bfloat16", "float16 / TF32", "float32"]
    assert list(top.get_xticks()) == [7, 10, 23]
    assert ax.get_yscale() == "log"


def _unnamed(index: int, callsite: str) -> Record:
    return Record(index, "aten.mul.Tensor", "", Phase.OTHER, Kind.REPLAYED, drift=ErrorStats(rel_norm=1e-7, n=4),
                  dtype="torch.float32", shape=(2,), callsite=callsite)


def test_drift_figure_names_runs_without_modules_by_their_call_site():
    """A model of plain tensors (makemore's) runs no call in a named module: the top axis names its longest runs
    by the user's line that made them, never "(none)"; with neither modules nor call sites it is left out."""
    rep = Report()
    for i in range(30):
        rep.add(_unnamed(i, "/home/u/makemore.py:12" if i < 20 else "/home/u/makemore.py:40"))
    fig = plots.drift_figure(rep)
    (top,) = fig.axes[0].child_axes
    assert [t.get_text() for t in top.get_xticklabels()] == ["makemore.py:12", "makemore.py:40"]
    assert list(top.get_xticks()) == [9.5, 24.5] and top.get_xlabel() == "call site"
    rep = Report()
    for i in range(5):
        rep.add(_unnamed(i, ""))
    assert plots.drift_figure(rep).axes[0].child_axes == []


def test_drift_figure_marks_where_a_nan_finding_is_born():
    net = torch.nn.Linear(4, 4)
    with ShadowMode() as sm:
        torch.log(net(torch.randn(3, 4))).sum().backward()  # some outputs negative: NaN in the loss
    born = sm.report.nonfinite_origin()
    ax = plots.drift_figure(sm.report).axes[0]
    (line,) = [line for line in ax.lines if line.get_gid() == "nonfinite:born"]
    assert list(line.get_xdata()) == [born.index, born.index] and line.get_label() == "NaN/Inf born (aten.log)"


def test_module_heatmap_modules_by_phase(report):
    fig = plots.module_heatmap(report)
    ax = fig.axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["(none)", "MLP", "MLP.act", "MLP.fc1", "MLP.fc2", "MLP.fc3"]  # tree order
    assert [t.get_text() for t in ax.get_xticklabels()] == ["forward", "backward", "optimizer", "other"]
    grid = ax.images[0].get_array()
    assert grid.shape == (6, 4)
    fc1_forward = report.view("module", phase="forward")["MLP.fc1"].max_budget_used
    assert grid[3, 0] == pytest.approx(fc1_forward) and fc1_forward > 1
    # the optimizer's calls, named by parameter (MLP.fc1.weight, MLP.fc1.bias), fold into their module's row
    optimizer = report.view("module", phase="optimizer")
    assert grid[3, 2] == max(optimizer["MLP.fc1.weight"].max_budget_used, optimizer["MLP.fc1.bias"].max_budget_used)
    assert grid.mask[2, 2]  # MLP.act has no parameter: no optimizer call
    texts = {t.get_text() for t in ax.texts}
    assert any(t.endswith(" !") for t in texts)


def test_module_heatmap_top_keeps_the_worst(report):
    ax = plots.module_heatmap(report, top=2).axes[0]
    worst = {m: a.max_budget_used for m, a in report.by_module.items() if "." not in m.removeprefix("MLP.")}
    expected = sorted(sorted(worst, key=lambda m: -worst[m])[:2])  # fc1..fc3 hold the matmuls; no parameter row
    assert [t.get_text() for t in ax.get_yticklabels()] == expected
    assert ax.get_title().endswith("(worst 2 of 6 modules)")


def test_module_heatmap_ulp_metric(report):
    ax = plots.module_heatmap(report, metric="ulp").axes[0]
    forward = report.view("module", phase="forward")
    assert ax.images[0].get_array()[3, 0] == forward["MLP.fc1"].max_local_ulp_nonzero
    with pytest.raises(ValueError, match="expected one of 'budget', 'ulp'"):
        plots.module_heatmap(report, metric="bits")


def test_module_heatmap_of_a_report_saved_before_phases(report):
    d = report.to_dict()
    d["version"] = 4
    del d["cells"]
    ax = plots.module_heatmap(Report.from_dict(d)).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["all phases"]


@pytest.mark.parametrize("make", list(plots.FIGURES.values()), ids=list(plots.FIGURES))
def test_empty_report_says_no_records(make):
    assert any(t.startswith("no records") for t in _texts(make(Report())))


def test_write_pngs(report, tmp_path):
    paths = plots.write_pngs(report, tmp_path / "new" / "dir")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["drift.png", "budget.png", "bits.png", "modules.png",
                                                     "trajectory.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert plots.write_pngs(Report(), tmp_path / "empty")  # an empty report still writes its figures


def test_missing_matplotlib_names_the_install(monkeypatch, report):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a failed import leaves: ImportError on import
    with pytest.raises(ImportError, match=r"pip install matplotlib \(or pip install 'shadow\[display\]'\)"):
        plots.drift_figure(report)


def test_trajectory_figure_plots_the_loss_and_the_parameters_per_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ShadowMode(spot_checks="off") as sm:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
    ax = plots.trajectory_figure(sm.report).axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert "parameters" in labels and ax.get_yscale() == "log"
    params = next(line for line in ax.get_lines() if line.get_label() == "parameters")
    assert list(params.get_xdata()) == [t.step for t in sm.report.trajectory if t.params > 0]
    ax.figure.canvas.draw()  # the ticks as drawn: steps are whole numbers, so is every tick
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)
