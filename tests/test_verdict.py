"""The verdict (shadow.verdict) and Report.summary: what a report concludes, on runs whose findings are known."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from shadow import ShadowMode
from shadow.modes import TF32Mode
from shadow.metrics import ErrorStats
from shadow.records import BudgetInfo, Kind, Phase, Record
from shadow.records import StepDrift
from shadow.report import Report
from shadow.tables import LEGEND, MANY_ULPS, ORDER, cancels, number, ulp_cell
from shadow.verdict import OpClass, arithmetic, conclude, op_class, times


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def step(x):
    torch.manual_seed(0)
    net = Net()
    net(x).square().mean().backward()


@pytest.fixture(scope="module")
def clean():
    x = torch.randn(16, 32)
    with ShadowMode() as sm:
        step(x)
    return sm.report


@pytest.fixture(scope="module")
def tf32():
    x = torch.randn(16, 32)
    with TF32Mode(), ShadowMode() as sm:
        step(x)
    return sm.report


def test_all_clear(clean):
    v = conclude(clean)
    assert not v.suspicious and v.over_budget == () and v.nonfinite is None and v.guessed == ()
    derived = [r for r in clean.records if r.budget is not None and not r.budget.is_default]
    assert v.budgeted == len(derived) and 0 < v.budgeted <= clean.coverage.replayed
    assert v.lines == [f"verdict: all {len(derived)} calls held to derived budgets are within their float32 budgets: "
                       "nothing suspicious"]


def _judged(i, op, used, guess=False, module="Net.fc"):
    return Record(i, op, module, Phase.FORWARD, Kind.REPLAYED, budget=BudgetInfo("elementwise", used, guess),
                  dtype="torch.float32", local=ErrorStats(max_abs=1e-7, max_ulp=used * 4, rel_norm=1e-7, n=4))


def test_a_guessed_budget_is_never_counted_as_judged():
    """Calls of ops no rule knows, held only to the default guess, are neither within nor over: the all-clear
    counts the derived ones, and a line names the rest."""
    rep = Report()
    rep.add(_judged(0, "aten.exp.default", 0.5))
    for i in range(1, 7):
        rep.add(_judged(i, "aten._fused_adamw_.default", 3e3, guess=True))  # 1.2e4 ulps: over its guess, no finding
    rep.add(_judged(7, "aten.mkldnn_rnn_layer.default", 0.1, guess=True))
    v = conclude(rep)
    assert v.budgeted == 1 and v.guessed == (("aten._fused_adamw_", 6), ("aten.mkldnn_rnn_layer", 1))
    assert not v.suspicious and v.over_budget == ()
    assert v.lines == [
        "verdict: all 1 calls held to derived budgets are within their float32 budgets: nothing suspicious",
        "not judged: 7 calls of aten._fused_adamw_, aten.mkldnn_rnn_layer (no budget rule: the few ulps guessed for "
        "them are no evidence, so they are neither over nor within)"]
    assert rep.by_op["aten._fused_adamw_.default"].guessed_calls == 6
    assert rep.by_op["aten._fused_adamw_.default"].budgeted_calls == 0
    assert rep.by_module["Net.fc"].guessed_calls == 7 and rep.by_module["Net.fc"].budgeted_calls == 1

    only = Report()  # nothing derived: no all-clear
    for i in range(3):
        only.add(_judged(i, "aten._fused_adamw_.default", 0.1, guess=True))
    v = conclude(only)
    assert not v.suspicious and "nothing suspicious" not in v.text
    assert v.lines[0] == ("verdict: 3 replayed calls, none held to a derived error budget: their local errors are "
                          "not judged")
    assert v.lines[1].startswith("not judged: 3 calls of aten._fused_adamw_ (no budget rule")

    over = Report()  # a finding and a guess: both said, the guess apart
    over.add(_judged(0, "aten.mm.default", 40.0))
    over.add(_judged(1, "aten._fused_adamw_.default", 0.1, guess=True))
    v = conclude(over)
    assert v.suspicious and [c.op for c in v.over_budget] == ["aten.mm"] and v.guessed == (("aten._fused_adamw_", 1),)
    assert v.lines[-1].startswith("not judged: 1 call of aten._fused_adamw_")


# the schema given: torch 2.4 infers none from the string annotations of `from __future__ import annotations`
@torch.library.custom_op("shadowtest::shifted", mutates_args=(), schema="(Tensor x) -> Tensor")
def shifted(x: torch.Tensor) -> torch.Tensor:
    """An op no budget rule can know (registered here): shadow replays it on its float64 CPU kernel, and judges
    it by the default guess only."""
    return x * 1.5 + 0.25


def test_an_op_no_rule_knows_is_counted_apart_in_a_real_run():
    x = torch.randn(8, 16)
    with ShadowMode() as sm:
        torch.relu(shifted(x @ torch.randn(16, 16))).sum()
    guessed = [r for r in sm.report.records if r.budget is not None and r.budget.is_default]
    derived = [r for r in sm.report.records if r.budget is not None and not r.budget.is_default]
    assert [r.op for r in guessed] == ["shadowtest.shifted.default"] and derived
    v = conclude(sm.report)
    assert v.guessed == (("shadowtest.shifted", 1),) and v.budgeted == len(derived)
    assert v.lines[0] == (f"verdict: all {len(derived)} calls held to derived budgets are within their float32 "
                          "budgets: nothing suspicious")
    assert v.lines[1].startswith("not judged: 1 call of shadowtest.shifted (no budget rule")
    row = next(line for line in sm.report.table().splitlines() if line.startswith("shadowtest.shifted.default"))
    assert row.split()[3] == "?"  # op, calls, local ulp, budget: a guess, said as such


def test_tf32_matmuls_over_budget_read_ten_bits(tf32):
    v = conclude(tf32)
    assert v.suspicious and {c.op for c in v.over_budget} == {"aten.mm", "aten.addmm"}
    assert [c.budget_used for c in v.over_budget] == sorted((c.budget_used for c in v.over_budget), reverse=True)
    assert v.lines[0] == "verdict: 2 op classes over budget (their own error beyond what a correct float32 kernel " \
                         "makes):"
    for c, line in zip(v.over_budget, v.lines[1:]):
        assert c.budget_used > 1 and c.over_calls and 9 <= c.effective_bits <= 11 and c.reads_like == "TF32-like"
        assert c.worst is not None and c.worst.budget.used == c.budget_used and c.worst.module in ("Net.fc1", "Net.fc2")
        assert line == (f"  {c.op} {times(c.budget_used)} budget in {c.over_calls} of {c.budgeted_calls} calls "
                        f"(reads ~{c.effective_bits:.0f} bits: TF32-like; worst: {c.worst.module}, {c.worst.phase}, "
                        f"call #{c.worst.index})")


def test_reads_like():
    def cls(op, bits, dtype="torch.float32"):
        return OpClass(op, 1, 1, 5.0, bits, (dtype,), None)

    assert cls("aten.mm", 10.2).reads_like == "TF32-like"
    assert cls("aten.sum", 10.2).reads_like == "float16-like"  # the same 10 bits outside a matmul
    assert cls("aten.sum", 7.3).reads_like == "bfloat16-like"
    assert cls("aten.sum", 16).reads_like == ""  # no known format
    assert cls("aten.sum", 22).reads_like == ""  # the dtype's own bits: a correct kernel, only unlucky
    assert cls("aten.sum", 7.0, "torch.bfloat16").reads_like == ""
    assert cls("aten.sum", None).reads_like == "" and "reads" not in str(cls("aten.sum", None))


def test_one_cause_for_op_classes_reading_one_format():
    def cls(op, bits, used=5.0):
        return OpClass(op, 2, 2 if used > 1 else 0, used, bits, ("torch.float32",), None)

    bf16 = [cls("aten.add", 6.5, 3e5), cls("aten.mm", 7.1, 4e3), cls("aten.gelu", 7.0, 4e3), cls("aten.sum", 6.2)]
    odd, exact = cls("aten._foreach_add_", 18.3, 1.4e4), cls("aten.clone", None, 0.0)
    within = cls("aten.relu", 22.5, 0.3)
    cause = arithmetic(bf16 + [odd, within, exact])
    # 4 of the 6 classes that round read 7 bits: >= 2/3, "throughout"; clone is exact, relu within its budget
    assert (cause.bits, cause.like, cause.throughout, cause.within) == (7, "bfloat16-like", True, ("aten.relu",))
    assert cause.classes == tuple(bf16)
    assert cause.line("float32") == ("bfloat16-like arithmetic throughout: 4 op classes read ~7 bits, 5x to 3e+05x "
                                     "their float32 budgets (worst: aten.add)")
    assert arithmetic(bf16[:2] + [odd]) is None  # two classes: listed one by one
    tf32 = [cls("aten.mm", 10.1), cls("aten.addmm", 9.8), cls("aten.bmm", 10.0)]
    cause = arithmetic(tf32 + [cls(f"aten.op{i}", 22.0, 0.2) for i in range(4)])
    assert cause.like == "TF32-like" and not cause.throughout and cause.within == ()
    assert cause.line("float32") == ("TF32-like arithmetic in 3 op classes (read ~10 bits, 5x to 5x their float32 "
                                     "budgets): aten.mm, aten.addmm, aten.bmm")
    assert arithmetic(tf32 + [cls("aten.sum", 10.2)]).like == "float16-like"  # 10 bits outside matmuls too


def test_helpers():
    assert op_class("aten.add.Tensor") == "aten.add" and op_class("aten.mm") == "aten.mm"
    assert [times(x) for x in (0.31, 4.0, 40.2, 2749.2, 12345.0)] == ["0.31x", "4x", "40x", "2749x", "1.2e+04x"]


class Bad(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_nan_born_of_the_math():
    bad = Bad()
    with ShadowMode() as sm:
        (bad(torch.tensor([1.0, -1.0])) * 2).sum()
    v = conclude(sm.report)
    assert v.suspicious and v.nonfinite is not None and v.nonfinite.cause == "math"
    assert (v.nonfinite.op, v.nonfinite.module, v.nonfinite.phase) == ("aten.log.default", "Bad", "forward")
    assert v.lines[0] == (f"verdict: NaN/Inf born in aten.log at Bad (forward, call #{v.nonfinite.index}): a math "
                          "problem: float64 gives NaN/Inf there too (fix the math: the inputs reach a pole or leave "
                          "the domain)")


def test_inf_born_of_the_precision():
    with ShadowMode() as sm:
        torch.tensor([20.0, 1.0], dtype=torch.float16).exp()  # e**20 = 4.9e8: past float16's 65504
    v = conclude(sm.report)
    assert v.nonfinite is not None and v.nonfinite.cause == "precision" and v.nonfinite.module == ""
    assert v.lines[0].startswith("verdict: NaN/Inf born in aten.exp at (no module) (other, call #")
    assert "a precision problem: float64 is finite there" in v.lines[0]


def test_nan_from_outside_and_past_the_kept_records():
    x = torch.tensor([1.0, float("nan")])  # the user's data holds a NaN before shadow sees it
    with ShadowMode() as sm:
        (x * 2).sum()
    v = conclude(sm.report)
    assert v.nonfinite is not None and v.nonfinite.op == "" and v.absorbed == ()
    assert v.lines[0] == ("verdict: NaN/Inf reaches the result (aten.sum, call #1), and no kept call made it from "
                          "finite values: it came in with the inputs (the data, or a tensor made before shadow "
                          "started)")
    rep = Report()  # a step's loss NaN where only the trajectory looked (records capped)
    rep.trajectory.append(StepDrift(1, float("nan"), float("nan"), float("nan"), "fc.weight", float("nan")))
    v = conclude(rep)
    assert [r.what for r in v.nonfinite.reaches] == ["loss", "parameters"] and v.suspicious
    assert v.lines[0] == ("verdict: NaN/Inf reaches the loss (after optimizer step 1), born past the kept records "
                          "(raise --max-records / max_records to see where)")


def test_no_budgets(clean):
    x = torch.randn(4, 32)
    with ShadowMode(budgets=False) as sm:
        step(x)
    assert conclude(sm.report).lines[0].endswith("none held to an error budget (budgets off): their local errors "
                                                 "are not judged")
    assert conclude(Report()).lines == ["verdict: no op call was replayed: nothing to judge"]


def _record(i, op, kind=Kind.REPLAYED, used=None, reason=""):
    budget = BudgetInfo("elementwise", used) if used is not None else None
    return Record(i, op, "Net.fc", Phase.FORWARD, kind, budget=budget, reason=reason, dtype="torch.float32")


def test_coverage_notes():
    """Unsupported ops, capped records and internal errors are said, below the verdict on what was checked."""
    rep = Report(max_records=2)
    rep.add(_record(0, "aten.exp.default", used=0.5))
    for i in range(1, 5):
        rep.add(_record(i, "aten.weird.default", Kind.UNSUPPORTED, reason="no float64 kernel"))
    rep.internal_error("aten.other.default", "KeyError: 'x'")
    v = conclude(rep)
    assert v.unsupported == (("aten.weird.default", "no float64 kernel"),) and v.unsupported_calls == 4
    assert v.lines == [
        "verdict: all 1 calls held to derived budgets are within their float32 budgets: nothing suspicious",
        "not checked: 4 calls of 1 ops shadow cannot replay (device results adopted, drift restarts there): "
        "aten.weird.default (no float64 kernel)",
        "note: 1 internal errors of shadow (their ops adopted from the device, listed in the coverage): a bug in "
        "shadow, please report it",
        "note: per-call records capped at 2: the 3 later calls are in the tables, not in the records",
    ]


def test_summary_is_the_table_the_legend_and_the_verdict(tf32):
    text = tf32.summary(top=3)
    table = tf32.table(top=3)
    assert text.startswith(table + f"\n(3 of {len(tf32.by_op)} rows)\n\nrows: {ORDER}; columns:\n"
                           "  op         the aten op overload\n")
    for name in table.splitlines()[0].split("  "):
        if name.strip():
            assert f"\n  {name.strip():<9}  " in text  # every column of the table explained
    assert text.endswith(conclude(tf32).text)
    assert set(LEGEND) == {"calls", "dtype", "local ulp", "budget", "bits", "drift rel", "flips", "nonfin", "unsup",
                           "untrust"}
    tree = tf32.summary(by="module", tree=True)
    assert "rows: tree order, parents above their submodules; columns:" in tree
    assert "the innermost module (optimizer ops: the parameter updated) (with its submodules)" in tree


def test_table_rows_keep_their_format(tf32):
    """Columns widen to fit a wide cell (an over-budget "2.75e+03 !") instead of pushing the row out of line."""
    lines = tf32.table().splitlines()
    head = lines[0]
    assert head.split() == ["op", "calls", "local", "ulp", "budget", "bits", "drift", "rel", "flips", "nonfin",
                            "unsup", "untrust"]
    end = len(head)
    assert all(len(line) == end for line in lines[2:]) and len(lines[1]) == end
    row = next(line for line in lines if line.startswith("aten.mm.default"))
    assert row.split()[4] == "!" and row.index("!") == head.index("budget") + len("budget") - 1


def test_summary_drawn_by_rich(tf32):
    pytest.importorskip("rich")
    text = tf32.summary(top=4, rich=True, width=200)
    head = text.splitlines()[0]
    assert head.split() == ["op", "calls", "local", "ulp", "budget", "bits", "drift", "rel", "flips", "nonfin", "unsup",
                            "untrust"]
    assert "─" in text.splitlines()[1] and "\x1b[" not in text  # rich's rule, no colour unless asked
    assert "aten.mm.default" in text and "aten.addmm.default" in text
    assert "\x1b[" in tf32.summary(top=4, rich=True, color=True)
    narrow = tf32.summary(top=4, rich=True, width=60)
    assert "…" not in narrow  # a long op name folds onto another line, never cut


def test_many_ulps_a_derived_budget_allows_are_marked_c():
    """A product whose terms cancel (issue 53: the demo's aten.mm read 9e+05 ulps beside budget 0.22): its error, the
    correct kernel's, is many ulps of the tiny result; the cell says so (c), the legend explains it."""
    torch.manual_seed(0)
    n = 512
    a, b0 = torch.randn(4, n), torch.randn(n, 1)
    a64 = a.double()
    # a column nearly orthogonal to a's first row: the exact (0, 1) element is tiny against its terms
    b1 = (b0.double() - a64[0:1].T * (a64[0] @ b0.double()) / (a64[0] @ a64[0])).float()
    b = torch.cat([b0, b1], 1)
    device = a @ b  # outside ShadowMode: the same bits (shadow never changes what the device computes)
    exact = a64 @ b.double()
    err = (device.double() - exact).abs()
    spacing = torch.tensor([2.0 ** (math.frexp(v)[1] - 24) for v in exact.abs().flatten().tolist()]).view(exact.shape)
    direct_ulp = (err / spacing).max().item()  # float32 ulps at the exact value, computed without shadow
    ratio = ((a64.abs() @ b.double().abs()) / exact.abs()).max().item()
    assert ratio > 1e3 and direct_ulp > MANY_ULPS
    assert direct_ulp <= n * ratio  # the kernel errs by at most ~n u sum|terms|: n * ratio ulps of the result

    with ShadowMode() as sm:
        a @ b
    agg = sm.report.by_op["aten.mm.default"]
    (rec,) = sm.report.find(op="aten.mm.default")
    assert agg.max_local_ulp_nonzero == pytest.approx(direct_ulp, rel=1e-6)
    assert rec.budget.used <= 1 and not rec.budget.is_default and agg.zero_reference_calls == 0
    assert cancels(agg) and ulp_cell(agg) == f"{number(agg.max_local_ulp_nonzero)} c"
    assert "c: over 16 ulps yet within a derived budget" in LEGEND["local ulp"]
    # the mark needs a derived budget that allows it: not over it, nor a guess
    assert not cancels(dataclasses.replace(agg, over_budget_calls=1))
    assert not cancels(dataclasses.replace(agg, guessed_calls=1))
    assert not cancels(dataclasses.replace(agg, max_local_ulp_nonzero=MANY_ULPS))
