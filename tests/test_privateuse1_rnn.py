"""The fused LSTM and GRU cells (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backward), which
aten's LSTM and GRU call on a PrivateUse1 device: their float64 replay (shadow.replay.recurrent) and their budget
(shadow.budgets.recurrent), on the stand-in's float32 cells.

The replay is checked against float64 runs made without shadow (nn.LSTM/nn.GRU in float64 on the CPU, an unfused
path), the budget against the stand-in's own error and against a fault of known size.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shadow import ShadowMode
from shadow.budgets import budget_for
from shadow.plan import plan_of
from shadow.replay import Replay
from shadow.replay import recurrent

from privateuse1 import device

pytestmark = [pytest.mark.privateuse1, pytest.mark.usefixtures("one_thread")]
aten = torch.ops.aten
CELLS = {"lstm": (aten._thnn_fused_lstm_cell.default, aten._thnn_fused_lstm_cell_backward_impl.default, 4),
         "gru": (aten._thnn_fused_gru_cell.default, aten._thnn_fused_gru_cell_backward.default, 3)}
RULES = {aten._thnn_fused_lstm_cell.default: recurrent.fused_lstm_cell_rule,
         aten._thnn_fused_lstm_cell_backward_impl.default: recurrent.fused_lstm_cell_backward_rule,
         aten._thnn_fused_gru_cell.default: recurrent.fused_gru_cell_rule,
         aten._thnn_fused_gru_cell_backward.default: recurrent.fused_gru_cell_backward_rule}


@pytest.fixture(scope="module")
def dml():
    return device()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def upcast(args: list) -> list:
    return [a.to("cpu").double() if isinstance(a, torch.Tensor) else a for a in args]


def replayed(op, args: list, out) -> tuple:
    """The rule's float64 outputs on the device's own inputs (upcast exactly), as the engine's local replay."""
    return RULES[op](Replay(plan_of(op), upcast(args), {}, out))[1]


def budget_used(op, args: list, out, refs) -> float:
    outs = [t for t in out if isinstance(t, torch.Tensor)]
    rs = [r for r in refs if r is not None]
    b = budget_for(op, upcast(args), {}, rs, torch.float32)
    assert b.family == "elementwise" and not b.is_default
    used = 0.0
    for o, r, bound in zip(outs, rs, b.bound):
        err = (o.cpu().double() - r).abs()
        used = max(used, float(torch.where(err > 0, err / bound, 0.0).max()))  # exact copies: 0 of a 0 bound
    return used


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_cells_replay_and_budget_on_the_devices_own_inputs(dml, cell):
    """The stand-in's float32 cells against their float64 replay: errors of float32 rounding (rel ~1e-7), each within
    its budget; the same outputs scaled by 1 + 1e-4 (a fault) are far over it."""
    forward, backward, parts = CELLS[cell]
    torch.manual_seed(0)
    B, H = 6, 5
    ig, hg = torch.randn(B, parts * H) * 3, torch.randn(B, parts * H) * 3  # gate sums that cancel
    state, b1, b2 = torch.randn(B, H), torch.randn(parts * H), torch.randn(parts * H)
    args = [t.to(dml) for t in (ig, hg, state, b1, b2)]
    out = forward(*args)
    refs = replayed(forward, args, out)
    for o, r in zip(out, refs):
        assert 0 < rel(o.cpu(), r) < 1e-6
    assert budget_used(forward, args, out, refs) <= 1.0
    faulty = [o * (1 + 1e-4) for o in out]
    assert budget_used(forward, args, faulty, refs) > 10

    grad = torch.randn(B, H).to(dml)
    bargs = [grad, grad * 0.5, args[2], out[1], out[2], True] if cell == "lstm" else [grad, out[1], True]
    bout = backward(*bargs)
    brefs = replayed(backward, bargs, bout)
    for o, r in zip(bout, brefs):
        assert rel(o.cpu(), r) < 1e-5
    assert budget_used(backward, bargs, bout, brefs) <= 1.0


def test_the_lstm_backward_without_gradients(dml):
    """Neither grad_hy nor grad_cy: no outputs (the CUDA kernel's answer), replayed as such."""
    op = aten._thnn_fused_lstm_cell_backward_impl.default
    cx = torch.randn(2, 3).to(dml)
    args = [None, None, cx, cx, torch.randn(2, 12).to(dml), True]
    assert RULES[op](Replay(plan_of(op), upcast(args), {}, None))[1] == (None, None, None)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lstm_and_gru_on_the_device_are_exact_against_float64(dml, cell):
    """Two layers, forward and backward under ShadowMode on the device: every fused cell replayed (none unsupported),
    the shadow output and every shadow gradient equal to nn.LSTM/nn.GRU run in float64 on the CPU to 1e-12."""
    torch.manual_seed(1)
    net = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(4, 6, num_layers=2)
    x = torch.randn(5, 3, 4)
    ref = copy.deepcopy(net).double()
    out64, _ = ref(x.double())
    out64.pow(2).sum().backward()
    m = net.to(dml)
    with ShadowMode() as sm:
        out, _ = m(x.to(dml))
        out.pow(2).sum().backward()
        grads = [sm.shadow_of(p.grad) for p in m.parameters()]
        shadow_out = sm.shadow_of(out)
    rep = sm.report
    assert rep.coverage.internal_errors == 0 and not rep.coverage.unsupported, rep.coverage
    forward, backward, _ = CELLS[cell]
    cells = [r for r in rep.records if r.op in (str(forward), str(backward))]
    assert {r.op for r in cells} == {str(forward), str(backward)} and len(cells) == 2 * 2 * 5
    assert all(r.budget is not None and r.budget.used <= 1.0 and not r.budget.is_default for r in cells)
    assert rel(shadow_out, out64) < 1e-12
    for g, p in zip(grads, ref.parameters()):
        assert rel(g, p.grad) < 1e-12
