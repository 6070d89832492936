"""shadow.reportdiff: two reports of the same program, the second judged against the first."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from shadow import Kind, Phase, Record, Report, ShadowMode
from shadow.metrics import ErrorStats
from shadow.records import BudgetInfo
from shadow.reportdiff import Change, Figures, ReportDiffError, align, diff_reports
from shadow.modes import TF32Mode


class Net(nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        self.extra = extra
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.extra:  # one op more mid-forward (and its backward), as autocast adds casts
            h = h * 1.0
        return self.fc2(h)


def step(extra: bool = False, steps: int = 1):
    """A two-layer model's training steps, on fixed data."""
    torch.manual_seed(0)
    net = Net(extra)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    for _ in range(steps):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


def shadowed(device=None, extra: bool = False, steps: int = 1, **options):
    """The report of ``step`` under ShadowMode(**options), on an emulated ``device`` (entered outside it) if given."""
    sm = ShadowMode(**options)
    with device or contextlib.nullcontext(), sm:
        step(extra, steps)
    return sm.report


@pytest.fixture(scope="module")
def fp32():
    return shadowed()


@pytest.fixture(scope="module")
def tf32():
    return shadowed(TF32Mode())


def test_tf32_matmuls_got_worse(fp32, tf32):
    cmp = diff_reports(fp32, tf32)
    assert cmp.match == 1.0 and cmp.matched == len(fp32.records) == len(tf32.records)
    worse = cmp.worse("op")
    assert {c.key for c in worse} == {"aten.mm.default", "aten.addmm.default"}
    for c in worse:
        assert c.budgeted and c.own_factor > 10 and c.b.over_calls and not c.a.over_calls
        assert c.a.effective_bits > 20 and c.b.effective_bits < 12
    assert {c.key for c in cmp.worse("module")} == {"Net.fc1", "Net.fc2"}
    assert cmp.better("op") == [] and cmp.drift_worse("op")  # downstream of the matmuls
    assert cmp.calls and {c.op for c in cmp.calls} <= {"aten.mm.default", "aten.addmm.default"}
    assert cmp.calls[0].b / cmp.calls[0].a >= cmp.calls[-1].b / cmp.calls[-1].a  # the worst call first
    assert cmp.lines[-1].startswith("verdict: B is worse: the own error of 2 op classes grew 2x or more: ")
    back = diff_reports(tf32, fp32)  # the other way round: better, not worse
    assert back.worse("op") == [] and {c.key for c in back.better("op")} == {"aten.mm.default", "aten.addmm.default"}
    assert back.verdict == "verdict: B is better: no op's own error got worse, some got better"


def test_a_kernel_at_full_precision_on_both_sides_did_not_change():
    """The worst element of a correct kernel moves with its inputs: a 5x larger budget share at the same effective
    bits (the dtype's 23, on both sides) is no change; fewer bits with it, or a call over budget, is."""
    def fig(used, bits, over=0):
        return Figures(calls=1, budget_used=used, local_ulp=1.0, effective_bits=bits, drift=0.0, over_calls=over,
                       nonfinite=0)

    assert not Change("mean", fig(0.004, 23.0), fig(0.02, 23.0)).own_worse()
    assert not Change("mean", fig(0.02, 23.0), fig(0.004, 23.0)).own_better()
    assert Change("mean", fig(0.004, 23.0), fig(0.02, 21.5)).own_worse()  # 1.5 bits fewer
    assert Change("mean", fig(0.004, 23.0), fig(1.5, 23.0, over=1)).own_worse()  # over budget, whatever the bits
    assert Change("mean", fig(0.004, None), fig(0.02, None)).own_worse()  # no bits read: the budget share decides
    assert not Change("mean", fig(0.001, 20.0), fig(0.004, 18.0)).own_worse()  # below the floor on both sides


def test_identical_runs_nothing_changed(fp32):
    again = shadowed()
    cmp = diff_reports(fp32, again)
    assert cmp.identical and not cmp.changed and cmp.worse("op") == [] and cmp.calls == ()
    assert cmp.text.endswith("verdict: nothing changed: the same calls with the same figures")


def test_calls_one_run_adds_are_skipped_over(fp32):
    """B runs one op more mid-forward (and in backward): the rest still match, in order, and the extra calls are
    named."""
    b = shadowed(extra=True)
    cmp = diff_reports(fp32, b)
    assert cmp.matched == len(fp32.records) and cmp.only_b == (("aten.mul.Tensor", 2),) and cmp.only_a == ()
    assert "calls only in B: aten.mul.Tensor x2" in cmp.lines and not cmp.worse("op")


def test_different_programs_are_refused(fp32):
    with ShadowMode() as sm:
        torch.randn(8).exp().sum()
    with pytest.raises(ReportDiffError, match=r"^the reports are not of the same program: only \d+% of their op calls "
                                           r"match in order \(\d+ calls against \d+\); compare two runs of the same "
                                           r"script with the same steps$"):
        diff_reports(fp32, sm.report)
    more = shadowed(steps=4)  # the same program, 4 steps against 1: 2 of 5 calls match
    with pytest.raises(ReportDiffError, match=r"only 4\d% of their op calls match"):
        diff_reports(fp32, more)
    assert diff_reports(fp32, more, min_match=0.3).matched == len(fp32.records)


def test_without_records_the_op_counts_are_compared(fp32, tf32):
    a, b = shadowed(max_records=0), shadowed(TF32Mode(), max_records=0)
    cmp = diff_reports(a, b)
    assert cmp.records_a == cmp.records_b == 0 and cmp.match == 1.0 and cmp.calls == ()
    assert {c.key for c in cmp.worse("op")} == {"aten.mm.default", "aten.addmm.default"}
    assert cmp.lines[0] == "no per-call records to match: compared by op counts (100% alike)"


def test_factor_must_exceed_one(fp32):
    with pytest.raises(ValueError, match="factor=1: expected a number > 1"):
        diff_reports(fp32, fp32, factor=1)


def test_align_periodic_calls_step_by_step():
    """A training run repeats its calls every step: a call missing mid-run and one added near the start must not
    shift the alignment by a step (difflib alone matched about half of such a sequence)."""
    steps = [f"op{k}" for k in range(8)] * 500
    other = steps[:2000] + steps[2003:]
    other.insert(20, "op3")
    pairs = align(steps, other)
    assert len(pairs) == len(steps) - 3
    assert all(steps[i] == other[j] for i, j in pairs)
    assert all(i1 < i2 and j1 < j2 for (i1, j1), (i2, j2) in zip(pairs, pairs[1:]))
    assert align(list("abcab"), list("zabcb")) == [(0, 1), (1, 2), (2, 3), (4, 4)]


def _run(mm_used: float, adamw_ulp: float) -> Report:
    """A forward matmul held to its derived budget and a fused AdamW call with only the guess (no rule knew it)."""
    rep = Report()
    for i, (op, used, ulp, guess) in enumerate([("aten.mm.default", mm_used, mm_used * 50, False),
                                                ("aten._fused_adamw_.default", adamw_ulp / 4, adamw_ulp, True)]):
        rep.add(Record(i, op, "Net.fc", Phase.FORWARD if i == 0 else Phase.OPTIMIZER, Kind.REPLAYED,
                       local=ErrorStats(max_abs=1e-6, max_ulp=ulp, rel_norm=1e-7, n=8),
                       budget=BudgetInfo("matmul" if i == 0 else "default", used, guess), dtype="torch.float32",
                       shape=(2, 4)))
    return rep


def test_ops_without_a_derived_budget_come_after_and_never_make_the_verdict():
    """shadow compare (issue 53): a guessed op's ulps that grew 4.7e+10x (a result that cancels, a correct kernel)
    are listed after the ops held to derived budgets, apart, and the verdict is about the judged ones."""
    cmp = diff_reports(_run(0.1, 2.25e4), _run(0.5, 1.06e15))
    worse = cmp.worse("op")
    assert [c.key for c in worse] == ["aten.mm.default", "aten._fused_adamw_.default"]
    assert [c.judged for c in worse] == [True, False] and worse[1].own_factor > worse[0].own_factor
    text = cmp.lines
    judged = text.index("own error worse in B, by op (A -> B):")
    apart = text.index("not judged (no derived budget), local ulp worse in B, by op (A -> B):")
    assert judged < apart and text[judged + 1].lstrip().startswith("aten.mm.default")
    assert "ulp (no derived budget)" in text[apart + 1] and "aten._fused_adamw_" in text[apart + 1]
    assert cmp.verdict == "verdict: B is worse: the own error of 1 op class grew 2x or more: aten.mm 5x"
    assert [c.op for c in cmp.calls] == ["aten.mm.default", "aten._fused_adamw_.default"]  # judged calls first

    only = diff_reports(_run(0.1, 2.25e4), _run(0.1, 1.06e15))  # only the guessed op moved
    assert only.verdict == ("verdict: no op held to a derived budget got worse; 1 op class without one read more "
                            "ulps in B, which is no evidence (not judged): aten._fused_adamw_")
