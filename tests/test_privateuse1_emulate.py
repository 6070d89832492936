"""Emulated devices and FaultMode on a device without float64 or bfloat16 (the stand-in): rounding to a format in
float32 integer arithmetic where float64 is missing (``round_f32``), each mode's results equal to the same mode's on
the CPU, and the audit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shadow
from shadow import ShadowMode
from shadow.modes import FaultMode
from shadow.modes.emulate import EMULATIONS, emulate
from shadow.modes.emulate.formats import BF16, E4M3, E5M2, FP16, TF32, Rounding, round_f32, round_f64, round_to

from privateuse1 import device

FORMATS = [TF32, BF16, FP16, E4M3, E5M2]
SPECIAL = [0.0, -0.0, 65504.0, 65520.0, 65519.99, 448.0, 464.0, 480.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-149,
           -(2.0**-149), 3.4e38, 2.0**-126, 2.0**-133, 2.0**-134, 3 * 2.0**-135, 1 + 2.0**-11, -(1 + 2.0**-8)]


@pytest.fixture(scope="module")
def dml():
    return device()


def bit_patterns(n: int) -> torch.Tensor:
    """n float32 values from uniformly random bit patterns (every binade, subnormals, NaNs), and the edge cases."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    return torch.cat([bits.view(torch.float32), torch.tensor(SPECIAL + [float("inf"), -float("inf"), float("nan")])])


@pytest.mark.parametrize("rounding", list(Rounding))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_integer_rounding_is_the_float64_rounding_bit_for_bit(fmt, rounding):
    """round_f32 (integer arithmetic on float32 bits) against round_f64 (float64), on 50,000 random patterns (2M
    agreed too, once: 1.8 s a format and rounding)."""
    x = bit_patterns(50_000)
    a = round_f32(x, fmt, rounding)
    b = round_f64(x.double(), fmt, rounding).float()
    finite = torch.isfinite(x)
    assert torch.equal(a[finite].view(torch.int32), b[finite].view(torch.int32))


@pytest.mark.privateuse1
@pytest.mark.parametrize("rounding", list(Rounding))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_to_on_the_device_is_the_cpus(dml, fmt, rounding):
    """Bit for bit, NaN payloads aside (the CPU's bfloat16 cast makes its own)."""
    x = bit_patterns(20_000)
    for dtype, bits in ((torch.float32, torch.int32), (torch.float16, torch.int16)):
        v = x.to(dtype)
        a, b = round_to(v.to(dml), fmt, rounding).cpu(), round_to(v, fmt, rounding)
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()].view(bits), b[~b.isnan()].view(bits))


def _program(d: torch.device | str) -> list[torch.Tensor]:
    """Elementwise and normalization ops (the stand-in's are the CPU's kernels), a K = 12 matmul (one block: the CPU's
    order), a float16 sum and subnormals: what each emulation claims. (A float16 matmul is the stand-in's own
    arithmetic, not the CPU's: left out.)"""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 12, generator=g), torch.randn(12, 5, generator=g)
    x, w = x.to(d), w.to(d)
    y = F.gelu(x * 1.7 + 0.3)
    z = F.layer_norm(y, (12,)).softmax(-1)
    m = z @ w
    h = x.half()
    return [y, z, m, (h * 1.1).sum(0), torch.tanh(x) * 1e-39]


@pytest.mark.privateuse1
@pytest.mark.parametrize("name", sorted(EMULATIONS))
def test_each_emulated_device_runs_on_the_device_as_on_the_cpu(dml, name):
    with emulate(name):
        cpu = _program("cpu")
    with emulate(name):
        dev = _program(dml)
    for a, b in zip(cpu, dev):
        assert torch.equal(a, b.cpu()), name
    plain = _program("cpu")
    assert any(not torch.equal(a, b) for a, b in zip(plain, cpu)), f"{name} changed nothing"


@pytest.mark.privateuse1
@pytest.mark.parametrize("random_sign", [False, True])
def test_fault_mode_on_the_device(dml, random_sign):
    """FaultMode rounds x * (1 + rel) once from float64: on the device, where float64 is missing, on the CPU."""
    x = torch.randn(50)
    outs = []
    for d in ("cpu", dml):
        with FaultMode(rel=1e-3, op="gelu", random_sign=random_sign, seed=3) as fault:
            outs.append(F.gelu(x.to(d)).cpu())
        assert fault.injected == {"aten.gelu.default": 1}
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], (F.gelu(x).double() * (1 + 1e-3)).float()) or random_sign


@pytest.mark.privateuse1
def test_a_fault_injected_on_the_device_is_found_where_it_was_put(dml):
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dml)
    x = torch.randn(5, 8).to(dml)
    with FaultMode(rel=1e-3, op="gelu"), ShadowMode() as sm:
        net(x).sum().backward()
    rep = sm.report
    assert rep.coverage.internal_errors == 0, rep.coverage
    gelu = rep.find(op="gelu")
    assert len(gelu) == 1 and gelu[0].local.rel_norm == pytest.approx(1e-3, rel=1e-3) and gelu[0].over_budget
    assert not any(r.over_budget for r in rep.records if r.op != "aten.gelu.default" and r.op.startswith("aten.gelu"))


@pytest.mark.privateuse1
def test_tf32_emulated_on_the_device_is_over_budget_under_shadow(dml):
    torch.manual_seed(6)
    a, b = torch.randn(16, 64).to(dml), torch.randn(64, 8).to(dml)
    with emulate("tf32"), ShadowMode() as sm:
        a @ b
    (mm,) = sm.report.find(op="mm")
    assert sm.report.coverage.internal_errors == 0 and mm.over_budget and 8 < mm.budget.used


@pytest.mark.privateuse1
def test_the_audit_on_the_device_ranks_as_on_the_cpu(dml):
    """shadow.audit of a small MLP's loss on the device and on the CPU: the same parts, the same ranking by
    estimate in bf16, each estimate within a factor 2 of the CPU's (the device sums its matmuls in another order)."""
    audits = {}
    for d in ("cpu", dml):
        torch.manual_seed(7)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(d)
        x, y = torch.randn(8, 16).to(d), torch.randint(0, 4, (8,)).to(d)
        audits[str(d)] = shadow.audit(lambda: F.cross_entropy(net(x), y), precisions=("bf16", "fp16", "tf32"),
                                      verify=1)
    cpu, dev = audits["cpu"], audits[str(dml)]
    assert cpu.ranking("bf16") == dev.ranking("bf16")
    pairs = {(r.key, r.precision): r.estimate for r in cpu.rows}
    for r in dev.rows:
        ref = pairs[r.key, r.precision]
        assert ref == 0 and r.estimate == 0 or 0.5 < r.estimate / ref < 2, (r, ref)
