"""Trajectories (shadow.trajectory): the drift of the loss and of the parameters after every optimizer step of a
multi-step run, checked against the same training run separately in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shadow
from shadow import ShadowMode

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(model: nn.Module, steps: int, dtype: torch.dtype, mode=None) -> list[float]:
    torch.manual_seed(1)
    data = [(torch.randn(32, 8).to(dtype), torch.randn(32, 1).to(dtype)) for _ in range(steps)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_long_run_keeps_the_loss_drift_of_every_step():
    """200 Adam steps under one ShadowMode keeping no per-call record: each step's loss drift equals the one
    measured apart, between the float32 run and the same training in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model64 = copy.deepcopy(model).double()
    steps = 200
    with ShadowMode(max_records=0, spot_checks="off", budgets=False) as sm:
        losses = _train(model, steps, torch.float32)
    losses64 = _train(model64, steps, torch.float64)
    traj = sm.report.trajectory
    assert [t.step for t in traj] == list(range(1, steps + 1)) and not sm.report.records
    for t, dev, ref in zip(traj, losses, losses64):
        assert t.loss == dev
        assert t.loss_drift == pytest.approx(abs(dev - ref) / abs(ref), rel=1e-6, abs=1e-12)
    # the parameters' drift, against the float64 model's parameters
    pairs = [(p.detach().double(), q.detach()) for p, q in zip(model.parameters(), model64.parameters())]
    diff = math.sqrt(sum(float((p - q).norm()) ** 2 for p, q in pairs))
    size = math.sqrt(sum(float(q.norm()) ** 2 for _, q in pairs))
    assert traj[-1].params == pytest.approx(diff / size, rel=1e-6)
    assert traj[-1].worst.startswith("Sequential.") and traj[-1].worst_drift >= traj[-1].params
    assert traj[-1].params > traj[0].params > 0  # float32 drift grows over 200 steps of Adam here


def test_the_trajectory_is_saved_and_loaded(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
    with ShadowMode(spot_checks="off") as sm:
        _train(model, 3, torch.float32)
    path = tmp_path / "r.json"
    sm.report.save(path)
    back = shadow.load_report(path)
    assert back.trajectory == sm.report.trajectory and len(back.trajectory) == 3


def _direct(sm: ShadowMode, params) -> tuple[float, float]:
    """(||p - shadow||, ||shadow||) over ``params``, from copies of both (the definition)."""
    pairs = [(p.detach().double(), sm.shadow_of(p)) for p in params]
    return (math.sqrt(sum(float((p - s).norm()) ** 2 for p, s in pairs)),
            math.sqrt(sum(float(s.norm()) ** 2 for _, s in pairs)))


def test_the_parameters_drift_equals_its_definition():
    """Read in one comparison pass over each parameter and its shadow where they lie, the figure equals
    ||p - shadow|| / ||shadow|| over the parameters computed from copies, and so does the worst one's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    with ShadowMode(spot_checks="off", budgets=False) as sm:
        _train(model, 3, torch.float32)
        diff, size = _direct(sm, model.parameters())
        own = {n: _direct(sm, [p]) for n, p in model.named_parameters()}
    last = sm.report.trajectory[-1]
    assert last.params == pytest.approx(diff / size, rel=1e-12) and last.params > 0
    name, (d, s) = max(own.items(), key=lambda kv: kv[1][0] / kv[1][1])
    assert last.worst.endswith(name) and last.worst_drift == pytest.approx(d / s, rel=1e-12)


def test_a_parameter_holding_nan_makes_the_parameters_drift_nan():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ShadowMode(spot_checks="off") as sm:
        model(torch.randn(2, 4)).sum().backward()
        model.bias.grad.fill_(math.nan)
        opt.step()
    assert math.isnan(sm.report.trajectory[-1].params)
