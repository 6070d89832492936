"""The verdict's finding when no kernel is at fault (shadow.amplification): drift that correct rounding grew into,
held against the same programs run in float64 without shadow."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shadow import ShadowMode, load_report
from shadow.amplification import ULPS_PER_CALL, amplification, rate
from shadow.cli import main
from shadow.modes.faults import FaultMode
from shadow.verdict import conclude

U32 = 2.0 ** -24


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| of a float32 run's value against the float64 run's, made without shadow."""
    return ((a.double() - b).norm() / b.norm()).item()


# --- pytorch/examples `regression`: a polynomial fit by nn.Linear(4, 1) with plain `param.data.add_` steps ---
POLY = 4
SEED, STEPS = 2, 442  # seed 2 reaches loss < 1e-3 at step 442 in float32, where the example stops


def draws(steps: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The example's random numbers, drawn beforehand so that both runs read the same: the target polynomial and
    each batch's 32 points (the features and targets are the loop's own arithmetic, in its dtype)."""
    g = torch.Generator().manual_seed(seed)
    w_target, b_target = torch.randn(POLY, 1, generator=g) * 5, torch.randn(1, generator=g) * 5
    return w_target, b_target, [torch.randn(32, generator=g) for _ in range(steps)]


def regression(fc: nn.Linear, data, optimizer=None) -> list[float]:
    w_target, b_target, batches = data
    dtype, losses = fc.weight.dtype, []
    for r in batches:
        x = r.to(dtype).unsqueeze(1)
        x = torch.cat([x ** i for i in range(1, POLY + 1)], 1)
        y = x.mm(w_target.to(dtype)) + b_target.item()
        fc.zero_grad()
        loss = F.smooth_l1_loss(fc(x), y)
        losses.append(loss.item())
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        else:
            for p in fc.parameters():
                p.data.add_(-0.1 * p.grad)
    return losses


def regression_runs(steps: int, sgd: bool = False):
    """(report, float32 losses, float64 losses, float32 parameters, float64 parameters): the loop in float32 under
    ShadowMode, and in float64 without shadow from the same initial weights."""
    data = draws(steps)
    torch.manual_seed(SEED)
    fc = nn.Linear(POLY, 1)
    fc64 = copy.deepcopy(fc).double()
    with ShadowMode() as sm:
        l32 = regression(fc, data, torch.optim.SGD(fc.parameters(), lr=0.1) if sgd else None)
    l64 = regression(fc64, data, torch.optim.SGD(fc64.parameters(), lr=0.1) if sgd else None)
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    return sm.report, l32, l64, flat(fc), flat(fc64)


SHORT = 200  # past the loss's first burst of drift (0.1 to 0.16 near step 188), short of its end


@pytest.fixture(scope="module")
def regression_run():
    return regression_runs(SHORT)


def fitted_growth(series: list[float]) -> float:
    """The growth per point of a measured drift series: numpy's least-squares line through its logarithm, from its
    first point to its largest."""
    peak = int(np.argmax(series)) + 1
    return math.exp(np.polyfit(np.arange(peak), np.log(series[:peak]), 1)[0])


def check_regression(rep, l32, l64, steps):
    v = conclude(rep)
    a = v.amplification
    assert not v.over_budget and a is not None and not v.suspicious
    # no optimizer object: the steps are the backward passes, the loss of each the last result before it
    assert (a.steps, a.per, a.dtype) == (steps, "step", "torch.float32")
    # The shadow is the float64 program this loop is (its random numbers drawn outside the mode), run by the same
    # float64 kernels, so its loss is the float64 run's up to float64 rounding amplified as float32's is: a 1e-13
    # relative change of the initial weights moves the final float64 loss by 2e-10 (measured), so the two drifts
    # agree far closer than the 1e-3 asked here.
    measured = [abs(a32 - a64) / abs(a64) for a32, a64 in zip(l32, l64)]
    assert a.drifts == (("the loss", pytest.approx(measured[-1], rel=1e-3)),)
    assert (a.peak, a.peak_at) == (pytest.approx(max(measured), rel=1e-3), int(np.argmax(measured)) + 1)
    assert a.bound == pytest.approx(ULPS_PER_CALL * U32 * rep.coverage.replayed) and a.peak > 10 * a.bound
    assert v.lines[0] == (f"verdict: no call over its float32 budget, yet the program amplifies correct rounding: "
                          f"the loss drifts {measured[-1]:.2g} from float64 (relative) after {steps} steps, up to "
                          f"{max(measured):.2g} (step {a.peak_at}), where one rounding per call (32 u of float32 "
                          f"added up over {rep.coverage.replayed} calls) explains at most {a.bound:.2g}")
    # the loss's drift jumps by 10x and more between neighbouring steps (each draws another batch): its growth is
    # the slope of a line through its logarithm, which the float64 run's gives as well
    assert a.growth == pytest.approx(fitted_growth(measured), rel=1e-3) and a.growth > 1.02
    # it grows in the loss and its backward: the residual of a fit near convergence is the small difference of
    # large values, whose relative drift is its inputs' times their ratio to it
    assert {g.op for g in a.where[:2]} == {"aten.smooth_l1_loss", "aten.smooth_l1_loss_backward"}
    assert all(g.factor > 10 for g in a.where[:2])
    return measured


def test_the_regression_loop_amplifies_correct_rounding(regression_run):
    measured = check_regression(*regression_run[:3], SHORT)
    # the run is that sensitive: one correct rounding per call grown to a relative drift of 0.16 on one Xeon, 0.095
    # on another (which roundings the CPU's kernels make moves how far it grows, never whether)
    assert max(measured) > 0.03


@pytest.mark.slow
def test_the_whole_regression_loop_amplifies_correct_rounding():
    rep, l32, l64, _, _ = regression_runs(STEPS)
    measured = check_regression(rep, l32, l64, STEPS)
    assert measured[-1] > 0.1  # loss 8.7e-4 in float32, 1.27e-3 in float64 when the example stops


def test_the_finding_renders_in_the_summary(regression_run):
    rep = regression_run[0]
    lines = conclude(rep).lines
    assert lines[1].startswith(f"  the drift grows x{conclude(rep).amplification.growth:.3g} per step; most in ")
    assert lines[2].startswith("  a correct device diverges from the true result as much: a difference of this "
                               "size between two devices")
    assert rep.summary().endswith("\n".join(lines))


@pytest.mark.slow
def test_with_an_optimizer_the_steps_are_its_own_and_the_parameters_drift_too():
    rep, l32, l64, p32, p64 = regression_runs(STEPS, sgd=True)
    a = conclude(rep).amplification
    assert a is not None and (a.steps, a.per) == (STEPS, "optimizer step")
    # as above: the shadow is the float64 run's program (SGD's add_ with alpha -0.1, in both)
    assert a.drifts == (("the loss", pytest.approx(abs(l32[-1] - l64[-1]) / l64[-1], rel=1e-3)),
                        ("the parameters", pytest.approx(gap(p32, p64), rel=1e-3)))
    assert a.growth == pytest.approx(rate([s.params for s in rep.trajectory]))


# --- a chaotic recurrence: h = tanh(W h + U x), W of spectral radius 3 ---
T, N = 60, 64


class Recurrence(nn.Module):
    def __init__(self, w: torch.Tensor, u: torch.Tensor):
        super().__init__()
        self.w, self.u = w, u

    def forward(self, h: torch.Tensor, xs: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        hs, pre = [], []
        for x in xs:
            a = self.w @ h + self.u @ x
            h = torch.tanh(a)
            pre.append(a)
            hs.append(h)
        return hs, pre


def recurrence_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, N, generator=g, dtype=torch.float64)
    w *= 3.0 / torch.linalg.eigvals(w).abs().max()
    u = torch.randn(N, N, generator=g, dtype=torch.float64) * (0.3 / math.sqrt(N))
    return w.float(), u.float(), torch.randn(T, N, generator=g), torch.randn(N, generator=g)


@pytest.fixture(scope="module")
def chaotic():
    w, u, xs, h0 = recurrence_inputs()
    with ShadowMode() as sm:
        hs, pre = Recurrence(w, u)(h0, xs)
    hs64, pre64 = Recurrence(w.double(), u.double())(h0.double(), xs.double())
    return sm.report, [gap(a, b) for a, b in zip(hs, hs64)], [gap(a, b) for a, b in zip(pre, pre64)]


def test_a_chaotic_recurrence_amplifies_and_says_where(chaotic):
    rep, hgap, pregap = chaotic
    v = conclude(rep)
    a = v.amplification
    assert not v.over_budget and a is not None
    assert hgap[0] < 8 * U32 and hgap[-1] > 0.1  # the float32 state leaves float64's: one rounding grown to O(1)
    assert a.drifts == (("the result", pytest.approx(hgap[-1], rel=1e-6)),) and a.steps == 0
    # the drift along the tanh's calls is the state's, h_1 ... h_T (saturating near the end)
    assert (a.peak, a.peak_at) == (pytest.approx(max(hgap), rel=1e-6), int(np.argmax(hgap)) + 1)
    # the peak is named where the drift fell back from it (it saturates near 1: at the last call on some CPUs)
    peak = f", up to {max(hgap):.2g} (call {a.peak_at} of aten.tanh at Recurrence)" if max(hgap) > hgap[-1] else ""
    assert v.lines[0] == ("verdict: no call over its float32 budget, yet the program amplifies correct rounding: "
                          f"the result drifts {hgap[-1]:.2g} from float64 (relative){peak}, where one rounding per "
                          f"call (32 u of float32 added up over {rep.coverage.replayed} calls) explains at most "
                          f"{a.bound:.2g}")
    # no steps: the growth is per call of the op where it grows, the tanh of the recurrence, once per time step;
    # the gap grows e-fold about every 4 steps, and fluctuates by a factor ~2 around that trend (the error's
    # direction turns), which moves an estimate from the two ends by 2 ln(2) / (T - 1)
    assert a.per == "call of aten.tanh at Recurrence"
    assert v.lines[1].startswith(f"  the drift grows x{a.growth:.3g} per call of aten.tanh at Recurrence; most in "
                                 "aten.tanh at Recurrence (x")
    assert abs(math.log(a.growth) - math.log((hgap[-1] / hgap[0]) ** (1 / (T - 1)))) < 2 * math.log(2) / (T - 1)
    assert a.growth == pytest.approx(fitted_growth(hgap), rel=1e-3)
    # where: each tanh call multiplies the relative drift of its input (the pre-activation) by what the float64
    # run measures, over the steps whose input drifts beyond noise
    top = a.where[0]
    assert (top.op, top.module) == ("aten.tanh", "Recurrence")
    ratios = [math.log(h / p) for h, p in zip(hgap, pregap) if p >= 64 * U32]
    # (a record takes its call's own error, under 1 u, off its output's drift of 64 u or more: 1/64 at most)
    assert top.calls == len(ratios) and top.factor == pytest.approx(math.exp(sum(ratios) / len(ratios)), rel=1 / 64)


def test_a_saved_report_reloads_to_the_same_finding_and_shows_it(chaotic, tmp_path, capsys):
    rep = chaotic[0]
    v = conclude(rep)
    path = tmp_path / "recurrence.json"
    rep.save(path)
    again = conclude(load_report(path))
    assert again.amplification == v.amplification and again.lines == v.lines
    assert main(["show", str(path)]) == 0
    assert "\n".join(v.lines) in capsys.readouterr().out


def test_a_fault_over_budget_is_the_finding_not_amplification():
    w, u, xs, h0 = recurrence_inputs()
    with FaultMode(rel=1e-3, op="mv"), ShadowMode() as sm:  # `w @ h` on vectors is aten.mv
        Recurrence(w, u)(h0, xs)
    v = conclude(sm.report)
    assert [c.op for c in v.over_budget] == ["aten.mv"] and v.amplification is None
    assert amplification(sm.report) is None
    assert v.lines[0].startswith("verdict: 1 op class over budget") and not any("amplifies" in line for line in v.lines)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_well_conditioned_step_gets_no_amplification_line():
    torch.manual_seed(0)
    x, target = torch.randn(16, 32), torch.randn(16, 4)
    net = MLP()
    net64 = copy.deepcopy(net).double()
    losses = []
    with ShadowMode() as sm:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            loss = F.mse_loss(net(x), target)
            loss.backward()
            opt.step()
        losses.append(F.mse_loss(net(x), target).item())
    opt64 = torch.optim.SGD(net64.parameters(), lr=0.1)
    for _ in range(2):
        opt64.zero_grad()
        F.mse_loss(net64(x.double()), target.double()).backward()
        opt64.step()
    loss64 = F.mse_loss(net64(x.double()), target.double()).item()
    assert abs(losses[-1] - loss64) / loss64 < 8 * U32  # measured without shadow: a few u
    v = conclude(sm.report)
    assert v.amplification is None and amplification(sm.report) is None
    assert not v.guessed
    assert v.lines == [f"verdict: all {v.budgeted} calls held to derived budgets are within their float32 budgets: "
                       "nothing suspicious"]


def test_the_growth_rate_of_a_series_is_its_exponent_up_to_its_peak():
    # 1e-7 doubling 20 times, then saturated below its peak: the tail is left out, the fit is exactly 2
    assert rate([1e-7 * 2 ** k for k in range(21)] + [0.09, 0.1]) == pytest.approx(2.0)
    assert rate([0.0, 1e-7, 0.0]) is None  # one drifting point: no fit
