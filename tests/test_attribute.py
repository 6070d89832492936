"""shadow.attribute: the share of a target's drift each op class, module or call site causes, by the linear
(adjoint-weighted) method and by ablation; and the step state it restores between runs."""

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
from shadow import ShadowOptionError
from shadow.modes import FaultMode

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """A transformer encoder layer (attention, layer norms, feed-forward) and a classifier head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


def _mlp_setup(seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    net = Net().to(dtype)
    x, y = torch.randn(128, 16, dtype=dtype), torch.randn(128, 1, dtype=dtype)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    return net, opt, one_step(net, opt, x, y, F.mse_loss)


def _both(net: nn.Module, opt: torch.optim.Optimizer, step, wrap=None, **kwargs):
    """Both methods from the same start (the model and optimizer put back in between)."""
    start = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    out = []
    for method in ("linear", "ablation"):
        net.load_state_dict(start[0])
        opt.load_state_dict(copy.deepcopy(start[1]))
        if wrap is None:
            out.append(shadow.attribute(step, method=method, **kwargs))
        else:
            with wrap():
                out.append(shadow.attribute(step, method=method, **kwargs))
    return out


def _share(res, key: str) -> float:
    return next(r.share for r in res.rows if r.key == key)


# --- a known fault is found where it was put ---
def test_a_fault_in_gelu_is_ranked_first_by_both_methods():
    net, opt, step = _mlp_setup()
    linear, ablation = _both(net, opt, step, wrap=lambda: FaultMode(rel=1e-3, op="gelu"))
    for res in (linear, ablation):
        assert res.rows[0].key == "aten.gelu.default"
        assert 0.9 < res.rows[0].share < 1.1  # a 1e-3 error dwarfs float32 rounding: nearly all of the drift
        assert res.rows[0].introduced == pytest.approx(1e-3, rel=1e-3)
    assert 0.5 < _share(linear, "aten.gelu.default") / _share(ablation, "aten.gelu.default") < 2.0
    assert linear.phases == ("forward", "other") and "optimizer" in ablation.phases
    assert linear.runs == 1 and ablation.runs >= 3  # first run, one per key with an error beyond rounding, all-exact


def test_a_fault_in_one_modules_op_is_charged_to_that_module():
    net, opt, step = _mlp_setup(1)
    linear, ablation = _both(net, opt, step, wrap=lambda: FaultMode(rel=1e-3, op="addmm", module="Net.fc2"),
                             by="module")
    for res in (linear, ablation):
        assert res.rows[0].key == "Net.fc2" and res.rows[0].share > 0.9
        assert all(abs(r.share) < 0.05 for r in res.rows[1:])


def test_call_sites_name_the_faulty_line():
    net, opt, step = _mlp_setup(2)
    with FaultMode(rel=1e-3, op="tanh"):
        res = shadow.attribute(step, by="callsite")
    top = res.rows[0]
    assert top.share > 0.9 and top.key.endswith(f"test_attribute.py:{_line_of('torch.tanh(self.fc2')}")


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


# --- unperturbed steps: the two methods agree ---
@pytest.mark.parametrize("seed", [0, 3])
def test_unperturbed_fp32_step_both_methods_agree_on_the_top_three(seed):
    net, opt, step = _mlp_setup(seed)
    linear, ablation = _both(net, opt, step)
    top = [{r.key for r in res.rows[:3]} for res in (linear, ablation)]
    assert top[0] == top[1]
    for r in linear.rows[:3]:
        assert _share(ablation, r.key) == pytest.approx(r.share, abs=0.02 + 0.1 * abs(r.share))
    for res in (linear, ablation):  # every figure reported, and they add up
        assert math.isfinite(res.residual) and abs(res.residual) < 0.1
        assert sum(r.share for r in res.rows) + res.rounding + res.residual == pytest.approx(1.0)
        assert 0 < res.drift < 1e-5
    assert "residual" in linear.table() and "rounding" in ablation.table()


def test_unperturbed_bf16_step_both_methods_agree_on_the_top_three():
    """bfloat16 throughout: most CPU kernels compute in float32 and round once (no error beyond rounding), the
    attention kernel does not; rounding is most of the drift."""
    torch.manual_seed(0)
    net = Block().to(torch.bfloat16)
    x, y = torch.randn(8, 12, 32, dtype=torch.bfloat16), torch.randint(0, 5, (8,))
    opt = torch.optim.AdamW(net.parameters(), 1e-3)

    step = one_step(net, opt, x, y, lambda out, target: F.cross_entropy(out.float(), target))

    linear, ablation = _both(net, opt, step)
    assert [r.key for r in linear.rows[:3]] == [r.key for r in ablation.rows[:3]]
    top = max(linear.rows, key=lambda r: abs(r.share))  # the largest error beyond a correct rounding
    assert top.key == "aten._scaled_dot_product_flash_attention_for_cpu.default" and abs(top.share) > 0.01
    assert _share(ablation, top.key) == pytest.approx(top.share, rel=0.2)
    for res in (linear, ablation):
        assert res.rounding > 0.5 and abs(res.residual) < 0.05


# --- what the methods cover, and the step's state ---
def _snapshot(net: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    return copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state()


def _assert_same_state(net: nn.Module, opt: torch.optim.Optimizer, expected: tuple) -> None:
    """Parameters, buffers, optimizer state and torch's generator bit for bit as ``expected`` (``_snapshot``)."""
    got = _snapshot(net, opt)
    assert got[0].keys() == expected[0].keys()
    for k, v in expected[0].items():  # parameters and buffers (running stats, batches tracked)
        assert torch.equal(got[0][k], v), k
    assert got[1]["param_groups"] == expected[1]["param_groups"]
    assert got[1]["state"].keys() == expected[1]["state"].keys()
    for i, state in expected[1]["state"].items():
        assert state.keys() == got[1]["state"][i].keys()
        for name, v in state.items():
            assert torch.equal(got[1]["state"][i][name], v), (i, name)
    assert torch.equal(got[2], expected[2])


@pytest.mark.parametrize("started", [False, True], ids=["first step", "after a step"])
def test_attribute_and_audit_leave_the_users_objects_as_found_and_the_device_untouched(started):
    """Each runs the step (ablation and the audit several times), each run taking a real optimizer step: after
    them the model, the optimizer and torch's generator are as before (no step taken), and the step then made
    by hand is the ordinary step's, bit for bit: the device computed as usual in every run."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 1))
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    opt = torch.optim.AdamW(net.parameters(), 1e-2)
    step = one_step(net, opt, x, y, F.mse_loss)
    if started:  # the optimizer holds state already
        step()
    start = _snapshot(net, opt)
    with FaultMode(rel=1e-3, op="gelu"):  # the "device": one ordinary step, without shadow
        step()
    expected = _snapshot(net, opt)
    net.load_state_dict(start[0])
    opt.load_state_dict(copy.deepcopy(start[1]))
    torch.set_rng_state(start[2])
    with FaultMode(rel=1e-3, op="gelu"):
        linear = shadow.attribute(step, method="linear", by="module")
        _assert_same_state(net, opt, start)
        ablation = shadow.attribute(step, method="ablation", by="module")
        _assert_same_state(net, opt, start)
        aud = shadow.audit(step, precisions=("bf16",), verify=2)
        _assert_same_state(net, opt, start)
        step()
    assert linear.rows[0].key == "Sequential.3" and ablation.runs >= 3 and ablation.rows[0].key == "Sequential.3"
    assert aud.runs == 3
    _assert_same_state(net, opt, expected)
    # by module, attribute's rows are disjoint (a module's own calls), the audit's a module's subtree: said first
    assert linear.table().splitlines()[0].startswith("rows: a module's own calls, not its submodules'")
    assert aud.table().splitlines()[0] == "rows: a module with its submodules (a parent includes its children)"
    own = {k: a.calls for k, a in linear.report.by_module.items()}  # the report's by_module: each module's own calls
    assert all(own[r.key] == r.calls for r in linear.rows)


def test_parameters_after_the_optimizer_step_need_ablation():
    """A fault in Adam's update (addcdiv_) moves the parameters, not the loss: ablation, which covers the
    optimizer, finds it; the linear method says it cannot (the parameters are not computed by autograd)."""
    net, opt, step = _mlp_setup(4)
    start = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    with FaultMode(rel=1e-3, op="addcdiv_"):
        res = shadow.attribute(step, method="ablation", target=net)
    assert res.rows[0].key.startswith("aten.addcdiv") and res.rows[0].share > 0.9
    net.load_state_dict(start[0])
    opt.load_state_dict(start[1])
    with pytest.raises(ShadowOptionError, match="method='ablation'"):
        shadow.attribute(step, method="linear", target=lambda: list(net.parameters()))


def test_linear_runs_the_backward_itself_and_reads_through_a_loss_scale():
    """The same forward, three ways: the step calls loss.backward(), the step returns the loss and shadow runs
    the backward (into no .grad), the step scales the loss before backward (as a GradScaler does)."""
    torch.manual_seed(5)
    net, x, y = Net(), torch.randn(64, 16), torch.randn(64, 1)

    def forward():
        return F.mse_loss(net(x), y)

    def with_backward(scale: float):
        def step():
            net.zero_grad()
            loss = forward()
            (loss * scale).backward()
            return loss
        return step

    with FaultMode(rel=1e-4, op="tanh"):
        runs = [shadow.attribute(s) for s in (with_backward(1.0), forward, with_backward(1024.0))]
    shares = [{r.key: r.share for r in res.rows} for res in runs]
    for key, value in shares[1].items():  # the forward's op classes (the others have no share of the loss)
        assert shares[0][key] == pytest.approx(value, abs=1e-9) and shares[2][key] == pytest.approx(value, abs=1e-9)
    assert all(shares[0].get(k, 0.0) == 0.0 for k in set(shares[0]) - set(shares[1]))
    assert runs[0].rows[0].key == "aten.tanh.default"
    assert net.fc1.weight.grad is None  # as found: the steps' backward ran, their gradients were put back to none


def test_a_vector_target_is_projected_on_its_drift():
    torch.manual_seed(6)
    net, x = Net(), torch.randn(64, 16)
    with FaultMode(rel=1e-3, op="gelu"):
        res = shadow.attribute(lambda: net(x))
    assert res.rows[0].key == "aten.gelu.default" and 0.9 < res.rows[0].share < 1.1


@pytest.mark.parametrize("kwargs, message", [
    (dict(by="layer"), "by='layer'.*expected one of 'op', 'module', 'callsite'"),
    (dict(method="exact"), "method='exact'.*expected one of 'linear', 'ablation'"),
    (dict(callsites=False), "leave callsites on"),
    (dict(local=False), "leave local on"),
])
def test_bad_arguments_say_what_is_expected(kwargs, message):
    with pytest.raises(ShadowOptionError, match=message):
        shadow.attribute(lambda: torch.ones(1), **kwargs)


def test_bad_steps_say_what_is_expected():
    with pytest.raises(ShadowOptionError, match="zero-argument callable"):
        shadow.attribute(torch.ones(1))
    with pytest.raises(ShadowOptionError, match="the step's return gave int: expected a floating tensor"):
        shadow.attribute(lambda: 3)


def test_the_example_answers_which_op_is_to_blame():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "examples/which_op_drifts.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "to blame: aten.gelu" in out and "Block.ff.act" in out


def test_an_overflow_is_left_out_of_linear_and_ablated_as_rounding():
    """exp(12) overflows float16 where float64 holds 162755, and 12 / exp(12) reads 0 for 7.4e-5: nearly all of the
    sum's drift (the other term's rounding is 4e-6). Linear cannot weight an infinite error: the call is left out
    of its rows, named below the table and counted in the coverage, its part in the residual. Ablation can: inf is
    the correct rounding of 162755 in float16, so exp's share is 0 and its rounding share is that part."""
    x = torch.tensor([12.0, 0.01], dtype=torch.float16, requires_grad=True)

    def step():
        return (x / torch.exp(x)).sum()

    linear, ablation = (shadow.attribute(step, method=method) for method in ("linear", "ablation"))
    for res in (linear, ablation):
        figures = [v for r in res.rows for v in (r.share, r.rounding_share)] + [res.rounding, res.residual]
        assert all(math.isfinite(v) for v in figures) and res.drift > 0
    assert linear.left_out == {"aten.exp.default": 1} and linear.report.coverage.internal_errors == 1
    assert "aten.exp.default" not in [r.key for r in linear.rows] and "left out" in linear.table()
    assert linear.residual > 0.9
    assert ablation.left_out == {} and ablation.rows[0].key == "aten.exp.default"
    assert ablation.rows[0].share == 0.0 and ablation.rows[0].rounding_share > 0.9 and abs(ablation.residual) < 0.01
