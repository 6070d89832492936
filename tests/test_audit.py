"""shadow.audit: which parts of a model can run in bf16, fp16, TF32 or FP8 (one-pass estimates against direct
runs, range risks), and the precision plan it builds, applied and checked."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shadow
from models import one_step
from test_answers_audit import spearman
from shadow import ShadowOptionError
from shadow.precision.lowering import Plan

pytestmark = pytest.mark.usefixtures("one_thread")


class Sensitive(nn.Module):
    """Logits centred through a large offset: y = x + 8 rounds each logit to the offset's spacing (bfloat16: 1/16,
    float16: 1/128), and y - mean(y) keeps that absolute error on logits of size ~0.3, an error some 20 times
    the format's own relative one. The cross-entropy does not care about the shift, only about the rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 8.0
        return y - y.mean(-1, keepdim=True)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = Sensitive()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.head(self.layer(self.inp(x)).mean(1)))


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = Model()
    x, y = torch.randn(8, 10, 16), torch.randint(0, 5, (8,))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    return model, opt, one_step(model, opt, x, y, F.cross_entropy)


@pytest.fixture(scope="module")
def audited():
    model, opt, step = _setup()
    rng = torch.get_rng_state()
    start = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    # every part verified; rows of each module's own calls (tests/test_answers_audit.py holds the module tree's)
    aud = shadow.audit(step, precisions=("bf16", "fp16", "tf32", "fp8"), verify=100, own=True)
    start += (rng, torch.get_rng_state())  # the generator before and after the audit (other tests draw from it)
    return model, opt, step, start, aud


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_sensitive_part_comes_first_and_estimates_match_direct_runs(audited, precision):
    aud = audited[-1]
    # the loss ("": outside any module, never moved) may come before it: the CPU's bfloat16 log_softmax rounds inside
    assert [k for k in aud.ranking(precision) if k][0] == "Model.norm"
    rows = [r for r in aud.rows if r.precision == precision and r.applies]
    top = sorted(rows, key=lambda r: -r.verified)[:5]
    for r in top:  # the one-pass estimate against the part run alone in that precision
        assert r.verified / 2 <= r.estimate <= 2 * r.verified, (r.key, r.estimate, r.verified)
    assert spearman([r.estimate for r in rows], [r.verified for r in rows]) >= 0.8
    assert aud.row("Model.norm", precision).verified > 10 * aud.row("Model.head", precision).verified


class Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - 8.0


class Repeat(nn.Module):
    """Three own calls (x + 8), each followed by a child's (- 8). In bf16 or fp16 the first add rounds x to the
    offset's spacing; the child's subtraction is then exact, and so are the two later adds: run alone in the
    format, the part makes one rounding's error (and so does the child run alone). Emulated on the float64 inputs instead, each later add would
    round x again, the same error three times over: an estimate three times the part's own change."""

    def __init__(self):
        super().__init__()
        self.back = Shift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.back(x + 8.0)
        return x


def test_a_parts_later_calls_are_estimated_on_the_inputs_of_its_own_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Repeat(), nn.Linear(32, 5))
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    start = copy.deepcopy(model.state_dict())
    step = one_step(model, opt, x, y, F.cross_entropy)
    aud = shadow.audit(step, precisions=("bf16", "fp16"), verify=100)
    for precision in ("bf16", "fp16"):
        for part in ("Sequential.1", "Sequential.1.back"):  # the subtraction alone rounds x + 8 likewise, once
            r = aud.row(part, precision)
            assert r.verified > 3e-5  # well above the float32 device's own level (~1e-7)
            assert abs(r.estimate - r.verified) <= 0.05 * r.verified, (precision, part, r.estimate, r.verified)
    model.load_state_dict(start)
    by_op = shadow.audit(step, precisions=("fp16",), by="op", verify=100)  # the same by op: three adds, one part
    r = by_op.row("aten.add.Tensor", "fp16")
    assert r.verified > 3e-5 and abs(r.estimate - r.verified) <= 0.05 * r.verified, (r.estimate, r.verified)


def test_worlds_beyond_the_memory_bound_end_and_are_named(monkeypatch):
    """Worlds may hold as many bytes as the shadows: with that bound alone (no 64 MiB floor), the test model's
    many worlds do not fit; those that end are named, and their parts are still estimated."""
    from shadow.precision import onepass

    monkeypatch.setattr(onepass, "MIN_BYTES", 0)
    model, opt, step = _setup()
    aud = shadow.audit(step, precisions=("bf16", "fp16"), verify=0)
    assert aud.dropped and all(p in ("bf16", "fp16") for p, _ in aud.dropped)
    assert all(math.isfinite(r.estimate) for r in aud.rows)
    # below the loss ("") and the whole model, which contains it
    assert [k for k in aud.ranking("bf16") if k not in ("", "Model")][0] == "Model.norm"
    assert "memory bound" in aud.table()


def test_tf32_and_fp8_touch_only_the_matmuls(audited):
    aud = audited[-1]
    for precision in ("tf32", "fp8"):
        assert aud.row("Model.head", precision).applies and aud.row("Model.layer.linear1", precision).applies
        assert not aud.row("Model.norm", precision).applies and not aud.row("Model.layer.norm1", precision).applies
    # FP8's 3 mantissa bits against TF32's 10: a matmul's change is several times larger
    assert aud.row("Model.head", "fp8").verified > 4 * aud.row("Model.head", "tf32").verified
    text = aud.table()
    assert "Model.norm" in text and "fp8" in text and text.count("\n") >= len({r.key for r in aud.rows}) + 2


def test_the_audit_leaves_the_users_objects_as_found(audited):
    """Its runs each took an optimizer step: parameters, buffers, the optimizer's state and torch's generator are
    put back as before the audit, bit for bit (the audit takes no step)."""
    model, opt, _, start, aud = audited
    assert aud.runs > 1
    assert model.state_dict().keys() == start[0].keys()
    for k, v in model.state_dict().items():
        assert torch.equal(start[0][k], v), k
    assert opt.state_dict() == start[1]  # before its first step: no state
    assert torch.equal(start[3], start[2])
    assert aud.table().splitlines()[0] == "rows: a module's own calls, not its submodules'"  # own=True


def test_a_plan_keeps_the_measured_change_within_its_tolerance(audited, tmp_path):
    model, opt, step, _, aud = audited
    tolerance = 2e-3
    plan = aud.plan(tolerance=tolerance)
    assert plan.parts and "Model.norm" not in plan.parts and "" not in plan.parts
    assert all(p in ("bf16", "fp16", "tf32", "fp8") for p in plan.parts.values())
    assert plan.estimate <= tolerance / 2
    plan.apply(model)
    measured = plan.check(step)
    assert 0 < measured <= tolerance
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.parts == plan.parts and "Model.head" in str(again) or "Model.layer" in str(again)
    with pytest.raises(ShadowOptionError, match="apply the plan first"):
        again.check(step)
    with pytest.raises(ShadowOptionError, match="not modules of this Linear"):
        plan.apply(nn.Linear(2, 2))


class Overflowing(nn.Module):
    """big's activations reach ~1e5 (beyond float16's 65504); the model divides them back before small."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(8, 8)
        self.small = nn.Linear(8, 1)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(self.big(x) / 1e5)


def test_activations_beyond_fp16_range_are_flagged_for_that_module_only():
    torch.manual_seed(0)
    model, x = Overflowing(), torch.randn(16, 8)
    aud = shadow.audit(lambda: model(x).square().mean(), precisions=("bf16", "fp16"), verify=0, own=True)
    fp16 = {r.key: r for r in aud.rows if r.precision == "fp16"}
    assert fp16["Overflowing.big"].overflow and fp16["Overflowing.big"].sensitivity == float("inf")
    assert not any(r.overflow for k, r in fp16.items() if k != "Overflowing.big")
    assert not any(r.overflow for r in aud.rows if r.precision == "bf16")  # bf16 has float32's range
    assert "Overflowing.big" not in aud.plan(tolerance=1.0).parts or aud.plan(tolerance=1.0).parts["Overflowing.big"] != "fp16"
    tree = shadow.audit(lambda: model(x).square().mean(), precisions=("fp16",), verify=0)  # the model contains big
    assert {r.key for r in tree.rows if r.overflow} == {"Overflowing", "Overflowing.big"}
    assert all(tree.plan(tolerance=1.0).covers(k) != "fp16" for k in ("Overflowing", "Overflowing.big"))


def test_bad_arguments_say_what_is_expected():
    with pytest.raises(ShadowOptionError, match="expected a tuple of 'fp8', 'bf16', 'fp16', 'tf32'"):
        shadow.audit(lambda: torch.ones(1), precisions=("int4",))
    with pytest.raises(ShadowOptionError, match="by='layer'"):
        shadow.audit(lambda: torch.ones(1), by="layer")
    with pytest.raises(ShadowOptionError, match="verify=-1"):
        shadow.audit(lambda: torch.ones(1), verify=-1)
    net = nn.Linear(4, 3)
    with pytest.raises(ShadowOptionError, match="the target has 6 elements"):
        shadow.audit(lambda: net(torch.randn(2, 4)))


@pytest.mark.slow
def test_the_example_answers_which_layers_can_move_to_bf16():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "examples/which_layers_bf16.py"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "precision plan by module" in proc.stdout and "within the tolerance" in proc.stdout
