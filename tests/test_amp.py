"""GradScaler's steps (``torch.amp.GradScaler``) with fused and foreach optimizers, replayed (``shadow.replay.amp``):
the device bit-identical with and without shadow, every call replayed and judged by a derived budget, the shadows
equal to the same program run in float64 without shadow, and an overflowing step skipped by the shadows as by the
device."""

from __future__ import annotations

import copy

import pytest
import torch

from shadow import ShadowMode
from shadow.modes.faults import FaultMode

AMP_OPS = ("aten._amp_foreach_non_finite_check_and_unscale_.default", "aten._amp_update_scale_.default")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _train(model, fused, steps=3, loss_scale=1.0):
    """GradScaler's loop as its docs write it; returns the scales it used."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    g = torch.Generator().manual_seed(1)
    scales = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g).to(next(model.parameters()).dtype)
        loss = model(x).square().mean() * loss_scale
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_gradscaler_steps_replayed_and_judged(fused):
    plain, shadowed, wide = _model(), _model(), _model(torch.float64)
    scales = _train(plain, fused)
    with ShadowMode() as sm:
        assert _train(shadowed, fused) == scales
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), shadowed.parameters()))
    assert not sm.report.coverage.unsupported and sm.report.coverage.internal_errors == 0
    calls = [r for r in sm.report.records if r.op in AMP_OPS or "_fused_adamw_" in r.op]
    assert len(calls) == (9 if fused else 6)
    assert all(not r.budget.is_default and r.budget.used <= 1 for r in calls), [(r.op, r.budget) for r in calls]
    # the shadows are the program's values in float64: the same loop run in float64, without shadow
    assert _train(wide, fused) == scales
    for p, p64 in zip(shadowed.parameters(), wide.parameters()):
        assert float((sm.shadow_of(p) - p64).abs().max()) <= 1e-14 * float(p64.abs().max())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_an_overflowing_step_is_skipped_by_the_shadows_too(fused):
    model = _model()
    before = copy.deepcopy(model)
    with ShadowMode() as sm:
        scales = _train(model, fused, steps=1, loss_scale=1e36)  # the scaled loss overflows float32
    assert scales == [2.0 ** 15]  # the device found Inf: the step skipped, the scale backed off
    for p, p0 in zip(model.parameters(), before.parameters()):
        assert torch.equal(p, p0) and torch.equal(sm.shadow_of(p), p0.double())
    assert not sm.report.coverage.unsupported


def test_unscale_fault_over_budget():
    op = AMP_OPS[0]
    with FaultMode(rel=1e-4, op=op) as fault:
        with ShadowMode() as sm:
            # foreach AdamW: GradScaler unscales the gradients here (a fused optimizer takes the scale itself, and
            # this op, given inv_scale 1, only checks them: it writes nothing a fault could show in)
            _train(_model(), False, steps=1)
    assert fault.injected == {op: 1}
    (rec,) = [r for r in sm.report.records if r.op == op]
    assert not rec.budget.is_default and rec.budget.used > 1, rec.budget
