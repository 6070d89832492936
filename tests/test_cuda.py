"""Shadowing on a real CUDA GPU: a training step, cuDNN's TF32 convolutions, the fused attention kernels, and
shadows kept on the GPU (``shadow_device``).

Every test here is marked ``cuda`` and skips without a GPU, with the reason ``shadow.devices`` finds
(``python -m pytest -m cuda tests/test_cuda.py`` on a GPU machine runs them).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shadow import ShadowMode
from shadow.devices import discover, numerics_settings
from shadow.mirror import AUTO_FREE_SHARE

pytestmark = pytest.mark.cuda
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        cuda = next(b for b in discover() if b.name == "cuda")
        pytest.skip(f"needs a CUDA GPU: {cuda.reason}")


@contextlib.contextmanager
def tf32(matmul: bool, cudnn: bool):
    """Set the legacy TF32 switches for the block, restoring them after. cuDNN's flags may be frozen
    (torch.testing._internal.common_utils, imported by the OpInfo tests, calls disable_global_flags):
    set them the way torch.backends.cudnn.flags() does inside."""
    mutable = getattr(torch.backends, "__allow_nonbracketed_mutation")
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = matmul
    with mutable():
        torch.backends.cudnn.allow_tf32 = cudnn
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        with mutable():
            torch.backends.cudnn.allow_tf32 = old[1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


# --- a training step ---
class ConvAttnMLP(nn.Module):
    """Conv -> tokens -> TransformerEncoderLayer (dropout 0: nothing random) -> MLP head."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.embed = nn.Linear(8, d)
        self.enc = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))  # (B, 8, H, W)
        tokens = self.embed(h.flatten(2).transpose(1, 2))  # (B, H*W, d)
        return self.head(self.enc(tokens).mean(1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int) -> list:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss)
    return losses


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_training_step_on_cuda_is_shadowed(impl):
    """Two Adam steps on the GPU: every op replayed (0 unsupported, 0 internal errors), and the shadow of every
    parameter equals an independent float64 run of the same program on the CPU (for-loop Adam, math attention).

    The device's own parameters are not compared with it: the attention's key bias has an exact gradient of 0
    (softmax is invariant to a shift common to all keys), so its float32 gradient is pure rounding noise, ~1e-9,
    which Adam (g / (sqrt(v) + 1e-8)) turns into steps of a sizeable fraction of lr: measured on an H100,
    in_proj_bias ends 1.7e-2 relative from its shadow after two steps. In float64 that noise is ~1e-17, a 1e-12
    step, so shadow and reference agree to ~1e-12 absolute there: 1e-8 relative bounds it with room."""
    torch.manual_seed(0)
    model = ConvAttnMLP().cuda()
    ref_model = copy.deepcopy(model).to("cpu", torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=impl == "foreach", fused=impl == "fused" or None)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(4, 3, 8, 8, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")
    with tf32(False, False), ShadowMode() as sm:
        losses = _train(model, opt, x, y, 2)
    ref_losses = _train(ref_model, ref_opt, x.to("cpu", torch.float64), y.cpu(), 2)
    rep = sm.report
    assert rep.coverage.internal_errors == 0, rep.coverage
    assert not rep.coverage.unsupported and rep.coverage.unsupported_calls == 0, rep.coverage
    assert {"forward", "backward", "optimizer"} <= {r.phase for r in rep.records}
    ops = {r.op for r in rep.records}
    assert any(op.startswith("aten.convolution") for op in ops)
    assert any("_scaled_dot_product" in op for op in ops), sorted(ops)  # the fused attention kernel, replayed
    step_op = "aten._fused_adam_.default" if impl == "fused" else "aten._foreach_"
    assert any(op.startswith(step_op) for op in ops), sorted(ops)
    # the first loss is one forward of float32 arithmetic (depth ~10 ops): 1e-5 leaves 2 orders over u = 6e-8
    assert abs(losses[0].item() / sm.shadow_of(losses[0]).item() - 1) < 1e-5
    # shadow vs float64 program: only float64 rounding apart (1e-16 per op), Adam's division included
    for lo, ref in zip(losses, ref_losses):
        assert abs(sm.shadow_of(lo).item() / ref.item() - 1) < 1e-12
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        assert rel(sm.shadow_of(p), ref) < 1e-8, name


# --- cuDNN convolutions in TF32 ---
def _conv_local_rel(allow_tf32: bool) -> dict[str, float]:
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3, padding=1).cuda()  # enough channels for cuDNN's tensor-core kernels
    x = torch.randn(8, 64, 32, 32, device="cuda", requires_grad=True)
    with tf32(False, allow_tf32):
        settings = numerics_settings()
        with ShadowMode() as sm:
            conv(x).square().sum().backward()
    assert settings["torch.backends.cudnn.allow_tf32"] is allow_tf32  # what a report records
    out = {}
    for op in ("aten.convolution.default", "aten.convolution_backward.default"):
        recs = sm.report.find(op=op)
        assert recs and all(r.kind in ("replayed", "decomposed") for r in recs), (op, [r.kind for r in recs])
        out[op] = max(r.local.rel_norm for r in recs)
    return out


def test_cudnn_tf32_convolutions_show_tf32_error():
    """``torch.backends.cudnn.allow_tf32`` is True by default: convolutions round their inputs to TF32 (10 stored
    mantissa bits). Each product then carries ~2 operand roundings of rms 2**-11/sqrt(3): rel_norm ~ 4e-4 (about
    11 bits), against ~1e-7 (23 bits) for float32 arithmetic over 576 (forward) to 8192 (weight gradient) terms.
    Bounds: TF32 within [2**-14, 2**-8]; float32 below 2**-16 (room for Winograd-style algorithms)."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"TF32 needs compute capability 8.0 (Ampere) or newer; this GPU is "
                    f"{'.'.join(map(str, torch.cuda.get_device_capability()))}")
    on, off = _conv_local_rel(True), _conv_local_rel(False)
    bits = {op: (round(-math.log2(on[op]), 1), round(-math.log2(off[op]), 1)) for op in on}  # (TF32, float32)
    for op in on:
        assert 2**-14 <= on[op] <= 2**-8, bits
        assert off[op] <= 2**-16, bits
        assert on[op] >= 64 * off[op], bits


# --- the fused attention kernels ---
_SDPA_CASES = {  # backend -> (dtype, forward op, backward op)
    "FLASH_ATTENTION": (torch.bfloat16, "aten._scaled_dot_product_flash_attention.default",
                        "aten._scaled_dot_product_flash_attention_backward.default"),
    "EFFICIENT_ATTENTION": (torch.float32, "aten._scaled_dot_product_efficient_attention.default",
                            "aten._scaled_dot_product_efficient_attention_backward.default"),
    "CUDNN_ATTENTION": (torch.bfloat16, "aten._scaled_dot_product_cudnn_attention.default",
                        "aten._scaled_dot_product_cudnn_attention_backward.default"),
}


def _sdpa_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(2, 4, 128, 64, device="cuda", generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _sdpa_step(q, k, v, grad, causal: bool) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(grad)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", sorted(_SDPA_CASES))
def test_fused_attention_kernels_are_replayed(backend, causal):
    """The flash / memory-efficient / cuDNN kernels have no CPU float64 kernel: shadow replays them through the
    attention formula (kind "replayed", not "unsupported"). Their error is a few units of the dtype's eps:
    16-bit outputs are rounded once from float32 arithmetic; float32 (efficient: 3xTF32 products) stays near
    float32. Bounds for 16-bit: 4 eps forward, 8 eps for the gradients (dS = P * (dP - rowsum(dO * O)) reads the
    rounded O); float32: 16 and 32 eps (measured on an H100: efficient forward 4.6 eps)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not hasattr(SDPBackend, backend):
        pytest.skip(f"torch {torch.__version__} has no SDPBackend.{backend}")
    dtype, fwd_op, bwd_op = _SDPA_CASES[backend]
    if not hasattr(aten, fwd_op.split(".")[1]):
        pytest.skip(f"torch {torch.__version__} has no {fwd_op}")
    q, k, v = _sdpa_inputs(dtype)
    grad = torch.randn_like(q)
    try:  # without shadow first: a kernel this GPU or torch cannot run is skipped with torch's own reason
        with sdpa_kernel(getattr(SDPBackend, backend)):
            _sdpa_step(q, k, v, grad, causal)
    except RuntimeError as exc:
        pytest.skip(f"{backend} cannot run here: {' '.join(str(exc).split())[:300]}")
    for t in (q, k, v):
        t.grad = None
    with sdpa_kernel(getattr(SDPBackend, backend)), ShadowMode() as sm:
        out = _sdpa_step(q, k, v, grad, causal)
    rep = sm.report
    assert rep.coverage.internal_errors == 0 and not rep.coverage.unsupported, rep.coverage
    (f,) = rep.find(op=fwd_op)
    (b,) = rep.find(op=bwd_op)
    assert f.kind == "replayed" and b.kind == "replayed", (f.kind, f.reason, b.kind, b.reason)
    eps = torch.finfo(dtype).eps
    fb, bb = (16, 32) if dtype == torch.float32 else (4, 8)
    seen = {"forward": f.local.rel_norm / eps, "backward": b.local.rel_norm / eps}  # in eps
    assert f.local.rel_norm <= fb * eps and f.drift.rel_norm <= fb * eps, seen
    assert b.local.rel_norm <= bb * eps and b.drift.rel_norm <= bb * eps, seen
    assert 0 < f.local.rel_norm or dtype == torch.float32  # 16-bit outputs cannot all be exact
    # the float64 attention of the same inputs, computed independently: the shadow of the output equals it
    q64, k64, v64 = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    assert rel(sm.shadow_of(out), ref) < 1e-12


# --- shadows on the GPU: ShadowMode(shadow_device="cuda" | "auto") ---
def _close(a: float | None, b: float | None, rel_tol: float, abs_tol: float) -> bool:
    return a == b or (a is not None and b is not None and abs(a - b) <= rel_tol * max(abs(a), abs(b)) + abs_tol)


def test_gpu_shadows_give_the_cpu_shadows_figures():
    """One device run watched by two ShadowModes at once (nested: both see the same device results), one keeping
    its shadows on the CPU, one on the GPU. The shadows agree to float64 reassociation (1e-12: different kernels
    sum in different orders); so do the figures: drift and local error are ~1e-7 relative, so a 1e-16 change of
    the reference moves them by ~1e-9 of themselves (1e-6 leaves room), max ulp by ~1e-9 ulp."""
    torch.manual_seed(0)
    model = ConvAttnMLP().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(4, 3, 8, 8, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")
    on_cpu, on_gpu = ShadowMode(shadow_device="cpu"), ShadowMode(shadow_device="cuda")
    with tf32(False, False), on_cpu, on_gpu:
        losses = _train(model, opt, x, y, 2)
    for sm in (on_cpu, on_gpu):
        cov = sm.report.coverage
        assert cov.internal_errors == 0 and not cov.unsupported, cov
    for p in model.parameters():  # where the shadows live
        assert on_gpu._engine.mirror.known(p).base.device.type == "cuda"
        assert on_cpu._engine.mirror.known(p).base.device.type == "cpu"
        assert on_gpu.shadow_of(p).device.type == "cpu"  # shadow_of: a CPU copy wherever they live
        assert rel(on_gpu.shadow_of(p), on_cpu.shadow_of(p)) < 1e-12
    for lo in losses:
        assert abs(on_gpu.shadow_of(lo).item() / on_cpu.shadow_of(lo).item() - 1) < 1e-12
    a, b = on_cpu.report.records, on_gpu.report.records
    assert [r.op for r in a] == [r.op for r in b]
    for ra, rb in zip(a, b):
        assert ra.kind == rb.kind and ra.flips == rb.flips, (ra.op, ra.kind, rb.kind)
        for name in ("drift", "local"):
            sa, sb = getattr(ra, name), getattr(rb, name)
            assert (sa is None) == (sb is None), (ra.op, name)
            if sa is None:
                continue
            assert sa.nonfinite == sb.nonfinite, (ra.op, name)
            assert _close(sa.rel_norm, sb.rel_norm, 1e-6, 1e-15), (ra.op, name, sa.rel_norm, sb.rel_norm)
            assert _close(sa.max_abs, sb.max_abs, 1e-6, 1e-15 * max(sa.max_abs, 1.0)), (ra.op, name)
            assert _close(sa.max_ulp, sb.max_ulp, 1e-6, 1e-6), (ra.op, name, sa.max_ulp, sb.max_ulp)
        if ra.budget is not None and rb.budget is not None:
            assert _close(ra.budget.used, rb.budget.used, 1e-6, 1e-9), (ra.op, ra.budget, rb.budget)


def test_gpu_shadows_leave_the_device_results_unchanged():
    """The device computes the same bits with shadows beside it on the GPU as without shadow (an MLP whose CUDA
    kernels are deterministic: cuBLAS on one stream, elementwise ops, SGD)."""
    def run(mode) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, t = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
        with mode if mode is not None else contextlib.nullcontext():
            for _ in range(3):
                opt.zero_grad()
                F.mse_loss(model(x), t).backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()]

    plain = run(None)
    sm = ShadowMode(shadow_device="cuda")
    shadowed = run(sm)
    assert all(torch.equal(a, b) for a, b in zip(plain, shadowed))
    assert sm.report.coverage.internal_errors == 0


def test_cpu_shadows_read_each_result_over_once():
    """shadow_device="cpu" on a GPU (shadow.transfer): each result crosses once (pinned, non-blocking, one
    synchronization per batch) for its comparisons, and the copy serves the next op's local replay; the device
    computes the same bits, and CUDA's float32 multiplication rounds correctly (at most half an ulp)."""
    torch.manual_seed(0)
    x = torch.randn(4096, device="cuda")

    def chain() -> torch.Tensor:
        y = x
        for _ in range(8):
            y = y * 1.0001
        return y

    plain = chain()
    with ShadowMode(shadow_device="cpu") as sm:
        shadowed = chain()
    copies = sm._engine.copies
    assert torch.equal(plain, shadowed) and sm.report.coverage.internal_errors == 0
    assert (copies.transfers, copies.batches) == (8, 8)  # x is adopted exactly: no local replay reads it
    assert all(r.local.max_ulp <= 0.5 for r in sm.report.records)


def test_auto_keeps_shadows_on_a_gpu_with_room():
    """"auto" (the default) decides once per device, at the first tensor it sees there: the GPU when at least
    AUTO_FREE_SHARE of its memory is free."""
    free, total = torch.cuda.mem_get_info()
    expected = "cuda" if free >= AUTO_FREE_SHARE * total else "cpu"
    x = torch.randn(64, device="cuda")
    with ShadowMode() as sm:
        y = (x * 3).sum()
    assert sm._engine.mirror.known(x).base.device.type == expected, (free, total)
    assert sm._engine.mirror.place.resolved == {x.device: x.device if expected == "cuda" else torch.device("cpu")}
    assert sm.shadow_of(y).item() == pytest.approx((x.double() * 3).sum().item(), rel=1e-15)
