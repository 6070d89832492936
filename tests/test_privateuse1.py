"""The DirectML-like backend itself (tests/privateuse1): what it claims to model of torch-directml, checked without
shadow, each against the CPU's own result or against the dispatcher's registrations.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import privateuse1
from privateuse1 import counters, device, device_kernels, reset_counters

pytestmark = [pytest.mark.privateuse1, pytest.mark.usefixtures("one_thread")]
aten = torch.ops.aten
NO_DOUBLE = r"The GPU device does not support Double \(Float64\) operations!"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dml():
    return device()


def test_the_device_is_privateuseone(dml):
    x = torch.ones(3, device=dml)
    assert dml == torch.device("privateuseone", 0) and x.device == dml and x.device.type == "privateuseone"
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"
    assert torch.privateuseone.is_available() and torch.privateuseone.device_count() == 1
    if hasattr(torch, "accelerator"):  # torch >= 2.6: the autograd engine asks for it
        assert torch.accelerator.current_accelerator().type in ("privateuseone", "cuda")


def test_memory_of_its_own(dml):
    before = counters()["allocated_bytes"]
    x = torch.arange(1000, dtype=torch.float32)
    xd = x.to(dml)
    assert counters()["allocated_bytes"] == before + 4000
    x.add_(1)  # the device holds a copy: no CPU tensor shares its memory
    assert torch.equal(xd.cpu(), torch.arange(1000, dtype=torch.float32))
    assert xd.untyped_storage().device == dml and xd.data_ptr() != x.data_ptr()
    del xd
    assert counters()["allocated_bytes"] == before


@pytest.mark.parametrize("make", [
    lambda d: torch.zeros(2, dtype=torch.float64, device=d),
    lambda d: torch.ones(2, device=d).double(),
    lambda d: torch.ones(2, device=d).to("cpu", torch.float64),  # DirectML converts on the device
    lambda d: torch.ones(2, dtype=torch.float64).to(d, torch.float32),
    lambda d: torch.ones(2, device=d).sum(dtype=torch.float64),  # the CPU fallback's float64 result comes back
], ids=["allocate", "cast", "to-cpu-float64", "from-cpu-float64", "fallback-result"])
def test_float64_is_refused_with_directmls_message(dml, make):
    with pytest.raises(RuntimeError, match=NO_DOUBLE):
        make(dml)


def test_no_bfloat16(dml):
    with pytest.raises(RuntimeError, match="BFloat16"):
        torch.ones(2, device=dml, dtype=torch.bfloat16)


def test_directmls_registrations_are_device_kernels_and_the_rest_falls_back(dml):
    """The kernels registered for PrivateUse1 are exactly DirectML's list (as this torch names its ops) and the
    fused RNN cells; every other op runs through the CPU fallback, with DirectML's warning."""
    registered = {n.removeprefix("aten::") for n in
                  torch._C._dispatch_get_registrations_for_dispatch_key("PrivateUse1") if n.startswith("aten::")}
    assert registered == set(device_kernels())
    assert len(privateuse1.DIRECTML_OPS) == 296 and len(device_kernels()) == 296 + 4  # and the fused RNN cells
    assert torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.PrivateUse1)
    x = torch.rand(5, device=dml) - 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.erfinv(x)  # erfinv.out is not DirectML's
    assert torch.equal(y.cpu(), torch.erfinv(x.cpu()))
    assert any("'aten::erfinv.out' is not currently supported on the DML backend and will fall back to run on the CPU"
               in str(w.message) for w in caught)


@pytest.mark.parametrize("name", ["gelu", "softmax", "layer_norm", "sigmoid", "cumsum", "embedding", "erfinv"])
def test_cpu_kernels_compute_the_cpus_bits(dml, name):
    """DirectML's device kernels of the stand-in (and its fallback) run the CPU's float32 kernels: the same bits."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 9), torch.randn(9)
    fn = {"gelu": F.gelu, "softmax": lambda t: t.softmax(-1), "layer_norm": lambda t: F.layer_norm(t, (9,), w),
          "sigmoid": torch.sigmoid, "cumsum": lambda t: t.cumsum(1), "erfinv": lambda t: torch.erfinv(t / 10),
          "embedding": lambda t: F.embedding(torch.tensor([[0, 3], [2, 2]], device=t.device), t)}[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(fn(x.to(dml)).cpu(), fn(x))


def test_views_share_storage(dml):
    x = torch.arange(12.0).to(dml)
    m = x.view(3, 4)
    col = m[:, 1]
    col.mul_(10)  # written through a strided view
    t = m.t()
    parts = torch.split(m, 2, dim=1)
    r = m.reshape(12)  # contiguous: a view
    u = x.unfold(0, 4, 4)
    for v in (m, col, t, *parts, r, u):
        assert v.data_ptr() >= x.data_ptr() and v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    expected = torch.arange(12.0).view(3, 4)
    expected[:, 1] *= 10
    assert torch.equal(x.cpu(), expected.reshape(12))
    assert torch.equal(t.cpu(), expected.t()) and torch.equal(parts[1].cpu(), expected[:, 2:])
    assert torch.equal(u.cpu(), expected.reshape(12).unfold(0, 4, 4))
    a = torch.ones(3, 4, device=dml).as_strided((2, 2), (4, 1), 1)
    assert a.storage_offset() == 1 and a.stride() == (4, 1)


def test_in_place_and_out_with_a_resize(dml):
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    ad, bd = a.to(dml), b.to(dml)
    out = torch.empty(0, device=dml)
    torch.add(ad, bd, alpha=2, out=out)  # out grows from 0 elements: its storage moves to new device memory
    assert out.shape == (3, 4) and torch.equal(out.cpu(), torch.add(a, b, alpha=2))
    ad.addcmul_(bd, bd, value=0.5)
    assert torch.equal(ad.cpu(), a.addcmul(b, b, value=0.5))
    m = torch.empty(0, device=dml)
    torch.mm(ad, bd.t(), out=m)  # a GPU-arithmetic kernel writing a resized out=
    assert m.shape == (3, 3)
    big = torch.zeros(2, device=dml)
    big.resize_(50)
    assert big.shape == (50,) and torch.equal(big[:2].cpu(), torch.zeros(2))


def test_random_ops_draw_from_the_devices_generator(dml):
    cpu_state = torch.get_rng_state()
    torch.privateuseone.manual_seed(7)
    a = torch.rand(5, device=dml).cpu()
    drop = F.dropout(torch.ones(100, device=dml), 0.5).cpu()
    torch.privateuseone.manual_seed(7)
    assert torch.equal(torch.rand(5, device=dml).cpu(), a)
    assert torch.equal(F.dropout(torch.ones(100, device=dml), 0.5).cpu(), drop)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU's generator untouched
    g = torch.Generator(device=dml)
    g.manual_seed(3)
    b = torch.randn(4, device=dml, generator=g).cpu()
    g.manual_seed(3)
    assert torch.equal(torch.randn(4, device=dml, generator=g).cpu(), b)
    assert set(drop.unique().tolist()) == {0.0, 2.0}


def test_item_and_the_counters(dml):
    """Copies and .item() reads asked for from outside the backend are counted; those its own kernels make (the CPU
    fallback's round trips) are not."""
    x = torch.randn(8).to(dml)
    reset_counters()
    assert x.sum().item() == pytest.approx(float(x.cpu().sum()), rel=1e-6)
    assert counters()["item"] == 1 and counters()["device_to_host"] == 1 and counters()["host_to_device"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.erfinv(x / 10)  # through the fallback: two copies inside the backend
    torch.ones(3).to(dml)
    assert counters()["device_to_host"] == 1 and counters()["host_to_device"] == 1


def test_matmul_sums_in_blocks_within_the_float32_bound(dml):
    """K = 256: blocks of 16 added pairwise, not the CPU's order: other bits, within gamma_K * |A||B|."""
    torch.manual_seed(1)
    a, b = torch.randn(8, 256), torch.randn(256, 6)
    y = (a.to(dml) @ b.to(dml)).cpu()
    exact = a.double() @ b.double()
    assert not torch.equal(y, a @ b)
    bound = 256 * 2.0**-24 / (1 - 256 * 2.0**-24) * (a.double().abs() @ b.double().abs())
    assert ((y.double() - exact).abs() <= bound).all()
    blocks = sum(a[:, k:k + 16] @ b[k:k + 16] for k in range(0, 256, 16))  # the same blocks, summed in sequence
    assert (blocks - y).abs().max() < 1e-4


def test_float16_matmul_accumulates_in_float16(dml):
    """Each of the K terms added to a float16 accumulator: the result is that recurrence, computed here apart."""
    torch.manual_seed(2)
    a, b = torch.randn(4, 64).half(), torch.randn(64, 5).half()
    y = (a.to(dml) @ b.to(dml)).cpu()
    acc = torch.zeros(4, 5, dtype=torch.float16)
    for k in range(64):
        acc = (acc.float() + a[:, k:k + 1].float() * b[k:k + 1].float()).half()
    assert torch.equal(y, acc)
    exact = a.double() @ b.double()  # further from it than the CPU's kernel, which accumulates in float32
    assert (y.double() - exact).abs().max() > ((a @ b).double() - exact).abs().max()


def test_exp_is_exp2_of_a_rounded_product(dml):
    x = torch.linspace(-80, 80, 1001)
    y = torch.exp(x.to(dml)).cpu()
    assert torch.equal(y, torch.exp2(x * math.log2(math.e)))
    ulps = ((y.double() - x.double().exp()) / torch.finfo(torch.float32).eps / x.double().exp()).abs()
    assert ulps[x.abs() < 1].max() < 2 and ulps[x.abs() > 40].max() > 8  # grows with |x|


def test_reshape_is_registered_for_autograd_and_its_gradients_are_right(dml):
    """torch-directml registers reshape for AutogradPrivateUse1 too; the stand-in does, and the gradient through a
    reshape that copies (a transposed input) is the CPU's."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::reshape", "AutogradPrivateUse1")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::reshape", "PrivateUse1")
    w = torch.randn(4, 6)
    grads = []
    for d in ("cpu", dml):
        p = w.to(d, copy=True).requires_grad_()
        (p.t().reshape(2, 12) * torch.arange(24.0, device=d).view(2, 12)).sum().backward()
        grads.append(p.grad.cpu())
    assert torch.equal(grads[0], grads[1])


_WITHOUT_AUTOGRAD_RESHAPE = r"""
import sys, torch
sys.path.insert(0, "tests")
from privateuse1 import device
d = device()
p = torch.randn(4, 6).to(d).requires_grad_()
try:
    (p.t().reshape(2, 12) * 2).sum().backward()
    print("grad", None if p.grad is None else p.grad.cpu().tolist())
except RuntimeError as e:
    print("raised", str(e).splitlines()[0])
"""


def test_what_losing_the_autograd_registration_breaks(dml):
    """A stand-in copying only DirectML's device registration of reshape loses the composite kernel at its autograd
    key: torch 2.13 backpropagates through reshape to nothing (the leaf's gradient stays None, with a warning),
    torch 2.4.1 raises at the call. The test above fails on either."""
    env = dict(os.environ, SHADOW_PRIVATEUSE1_NO_AUTOGRAD_RESHAPE="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_AUTOGRAD_RESHAPE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == "grad None" or last.startswith("raised Could not run 'aten::reshape'"), last


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_fused_rnn_cells_against_the_cpus_lstm_and_gru(dml, cell):
    """aten's LSTM and GRU call _thnn_fused_lstm_cell/_thnn_fused_gru_cell on a PrivateUse1 device: forward and
    backward agree with the CPU's unfused path to float32 rounding."""
    torch.manual_seed(3)
    net = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(5, 7, num_layers=2)
    x = torch.randn(6, 3, 5)
    results = []
    for d in ("cpu", dml):
        m = net.to(d)
        m.zero_grad()
        out, _ = m(x.to(d))
        out.pow(2).sum().backward()
        results.append([out.detach().cpu()] + [p.grad.cpu() for p in m.parameters()])
        net = net.cpu()
    for c, g in zip(*results):
        torch.testing.assert_close(g, c, rtol=1e-5, atol=1e-5)


def test_convolutions_run_the_cpus_kernels(dml):
    """aten picks convolution_overrideable (and its backward) on PrivateUse1, which DirectML registers: the stand-in
    runs the CPU's convolution there, so the device's bits are the CPU's, forward and backward."""
    torch.manual_seed(4)
    conv, bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
    x = torch.randn(2, 3, 6, 6)
    results = []
    for d in ("cpu", dml):
        net = torch.nn.Sequential(conv, bn).to(d)
        net.zero_grad()
        y = net(x.to(d))
        y.square().sum().backward()
        results.append([t.detach().to("cpu", copy=True) for t in (y, conv.weight.grad, conv.bias.grad, bn.running_var)])
        bn.reset_running_stats()
        net.cpu()
    assert all(torch.equal(a, b) for a, b in zip(*results))
