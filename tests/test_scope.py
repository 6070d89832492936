"""ShadowMode(scope=[module, ...]) shadows part of a model; max_shadow_bytes caps the shadows' memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shadow import ShadowMode, ShadowOptionError
from shadow.errors import ShadowMemoryError

pytestmark = pytest.mark.usefixtures("one_thread")


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.block2 = nn.Sequential(nn.Linear(64, 64), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block2(self.block1(x))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def test_scope_shadows_only_the_chosen_block():
    torch.manual_seed(0)
    model, x = TwoBlocks(), torch.randn(16, 64)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.Adam(plain.parameters(), 1e-3)
    with ShadowMode(scope=[model.block2], spot_checks="off") as sm:
        loss = _step(model, opt, x)
    rep = sm.report
    assert {r.module.split(".")[1] for r in rep.records} == {"block2"}  # its calls and its parameters' updates
    assert {r.phase for r in rep.records} == {"forward", "backward", "optimizer"}
    assert rep.coverage.out_of_scope > 0 and rep.coverage.calls == len(rep.records)
    for r in rep.find(op="addmm"):  # block2's input comes from outside: adopted as it is, so no drift at first
        assert r.local is not None and r.local.rel_norm < 1e-6
    # the device computed as without shadow
    assert torch.equal(loss, _step(plain, plain_opt, x))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    with pytest.raises(KeyError, match="never seen"):
        sm.shadow_of(loss)  # computed outside the scope


def test_scope_must_name_modules():
    with pytest.raises(ShadowOptionError, match="list of the nn.Modules"):
        ShadowMode(scope=["block1"])


def test_max_shadow_bytes_fails_before_the_op_and_leaves_the_program_intact():
    torch.manual_seed(0)
    model, x = TwoBlocks(), torch.randn(16, 64)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ShadowMemoryError, match=r"over max_shadow_bytes=4096: raise max_shadow_bytes, or .*scope="):
        with ShadowMode(max_shadow_bytes=4096):
            _step(model, opt, x)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and model.block1[0].weight.grad is None
    _step(model, opt, x)  # the program goes on without shadow
    with ShadowMode(max_shadow_bytes=64 << 20) as sm:  # enough
        _step(model, opt, x)
    assert sm.report.coverage.calls > 0
    mirror = sm._engine.mirror  # the running count the cap is checked against is the sum over live shadows
    mirror.sweep()
    assert mirror.held == mirror.shadow_bytes() > 0
    with pytest.raises(ShadowOptionError, match="max_shadow_bytes=0"):
        ShadowMode(max_shadow_bytes=0)
