"""Scaled-dot-product attention under shadow: grouped-query attention (key/value with fewer heads than the
query, as Llama-family models call it), causal attention, boolean and additive masks, an explicit scale;
forward and backward.

Every path is held to the attention formula computed here in float64 (``_formula``: key/value heads
repeated over their groups, softmax, autograd for the gradients), apart from shadow's own code:
- on the CPU, ``F.scaled_dot_product_attention`` runs the CPU flash kernel in every dtype (shadow replays
  it with its float64 CPU kernel) or, forced, its math path (composite: matmuls and softmax, each replayed);
- the device-only kernels (CUDA flash, memory-efficient, cuDNN, the PrivateUse1 backends' overrideable one,
  MPS's math kernel) are replayed through the formula by shadow's rules, called here on CPU tensors.

Tolerances: float64 results that differ from the formula only by float64 rounding (a few hundred roundings
at 2**-53 ~ 1.1e-16 on these sizes) are held to 1e-12 relative, far below float32's 2**-24 ~ 6e-8.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shadow import ShadowMode
from shadow.budgets import budget_for
from shadow.metrics import compare
from shadow.plan import plan_of
from shadow.records import Kind
from shadow.replay import Replay
from shadow.replay.attention import sdpa_backward_rule, sdpa_forward_rule, sdpa_math_rule

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten
f64 = torch.float64
TOL = 1e-12
B, H, L, S, E = 2, 4, 5, 7, 8  # L != S: the causal mask is not square (top-left aligned)

# F.scaled_dot_product_attention(..., enable_gqa=True) exists from torch 2.5 on
GQA_MISSING = None if any(a.name == "enable_gqa" for a in aten.scaled_dot_product_attention.default._schema.arguments) \
    else f"torch {torch.__version__}: F.scaled_dot_product_attention has no enable_gqa argument"


@dataclasses.dataclass(frozen=True)
class Case:
    kv_heads: int  # H: plain multi-head attention; fewer: grouped-query attention
    causal: bool = False
    mask: str | None = None  # "bool" (True: attend) or "float" (added to the logits)
    scale: float | None = None  # None: 1 / sqrt(E)

    def __str__(self) -> str:
        return f"kv{self.kv_heads}-{'causal' if self.causal else self.mask or 'nomask'}-scale{self.scale}"

    @property
    def gqa(self) -> bool:
        return self.kv_heads != H


# F.scaled_dot_product_attention refuses a mask together with is_causal
CASES = [Case(kv, causal, mask, scale) for kv in (H, 2) for causal, mask in ((False, None), (True, None),
                                                                            (False, "bool"), (False, "float"))
         for scale in (None, 0.3)]


def _inputs(case: Case, dtype: torch.dtype) -> tuple:
    """q, k, v and the mask (None, bool (L, S) with no fully masked row, or float (B, 1, L, S)), in dtype."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g, dtype=f64).to(dtype)
    k, v = (torch.randn(B, case.kv_heads, S, E, generator=g, dtype=f64).to(dtype) for _ in range(2))
    mask = None
    if case.mask == "bool":
        mask = torch.rand(L, S, generator=g) < 0.6
        mask[:, 0] = True
    elif case.mask == "float":
        mask = torch.randn(B, 1, L, S, generator=g, dtype=f64).to(dtype)
    return q, k, v, mask


def _formula(case: Case, q, k, v, mask, grad_out=None) -> tuple:
    """The float64 attention of these values: (out, logsumexp) and, given grad_out, the gradients of q, k, v
    (and of a float mask) by autograd through the repeated key/value heads."""
    leaves = [t.detach().to(f64).requires_grad_() for t in (q, k, v)]
    m = None if mask is None else mask.to(f64).requires_grad_() if mask.is_floating_point() else mask
    qq, kk, vv = leaves
    group = H // case.kv_heads
    kk, vv = kk.repeat_interleave(group, -3), vv.repeat_interleave(group, -3)
    s = qq @ kk.transpose(-2, -1) * (1 / math.sqrt(E) if case.scale is None else case.scale)
    if case.causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    if m is not None:
        s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m
    out = torch.softmax(s, -1) @ vv
    lse = s.logsumexp(-1).detach()
    if grad_out is None:
        return out.detach(), lse
    grads = torch.autograd.grad(out, leaves + ([m] if m is not None and m.requires_grad else []), grad_out.to(f64))
    return out.detach(), lse, grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(f64), b.to(f64)
    return float((a - b).norm() / b.norm())


# --- the CPU: F.scaled_dot_product_attention under ShadowMode ---
FLASH_CPU = ("aten._scaled_dot_product_flash_attention_for_cpu.default",
             "aten._scaled_dot_product_flash_attention_for_cpu_backward.default")


def _excused(dtype: torch.dtype) -> set[str]:
    """Ops whose CPU kernel really is less accurate than its budget allows (tests/test_detection.py)."""
    if dtype != torch.float32 and tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
        return {"aten._softmax_backward_data.default"}  # torch < 2.5: bf16 rows summed in bf16 (the math path)
    return set()


def _sdpa_step(case: Case, q, k, v, mask, grad_out) -> tuple:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=case.causal, scale=case.scale,
                                         **({"enable_gqa": True} if case.gqa else {}))
    out.backward(grad_out)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, f64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_attention_is_replayed_and_matches_the_formula(case, dtype, backend):
    """The device's results stay bit-identical; every op is replayed (the flash kernel and its backward as
    one op each; the math path op by op), the shadows of the output and the gradients are the float64 formula,
    equal to the device's own results on a float64 device, and the local error of float32/bfloat16 kernels is
    within their budgets."""
    if case.gqa and GQA_MISSING:
        pytest.skip(GQA_MISSING)
    q, k, v, mask = _inputs(case, dtype)
    grad_out = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(1), dtype=f64).to(dtype)
    with sdpa_kernel(SDPBackend.MATH if backend == "math" else SDPBackend.FLASH_ATTENTION):
        plain_out, plain_grads = _sdpa_step(case, q, k, v, mask, grad_out)
        with ShadowMode() as sm:
            out, grads = _sdpa_step(case, q, k, v, mask, grad_out)
    assert torch.equal(out, plain_out) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported, cov
    ops = {r.op for r in sm.report.records}
    assert (set(FLASH_CPU) <= ops) == (backend == "flash"), ops
    for r in sm.report.find(op="aten._scaled_dot_product_flash_attention_for_cpu"):
        assert r.kind == Kind.REPLAYED and r.budget.family == "attention", r
    ref_out, _, ref_grads = _formula(case, q, k, v, mask, grad_out)
    assert rel(sm.shadow_of(out), ref_out) < TOL
    for t, ref in zip(grads, ref_grads):
        assert rel(sm.shadow_of(t), ref) < TOL
    if dtype == f64:  # the replay runs the device's own float64 kernels: the shadow is the device's result
        assert torch.equal(sm.shadow_of(out), out) and all(torch.equal(sm.shadow_of(t), t) for t in grads)
    else:  # correct kernels: within budget (measured <= 0.56 used), a few eps off the formula (<= 0.95, 2.3 eps)
        over = [(r.op, r.budget.used) for r in sm.report.records_over_budget() if r.op not in _excused(dtype)]
        assert over == []
        eps = torch.finfo(dtype).eps
        assert rel(out, ref_out) < 4 * eps
        assert all(rel(t, ref) < 8 * eps for t, ref in zip(grads, ref_grads))


def test_gqa_budget_use_of_float32_flash_kernel():
    """Llama-like shapes (8 query heads sharing 2 key/value heads, 128 tokens, head dim 64): the float32 CPU
    flash kernel's local error uses a small part of its budget (measured 0.028 forward, 0.0011 backward; its
    error 1.9 float32 eps relative); a false over-budget on grouped-query attention would read > 1."""
    if GQA_MISSING:
        pytest.skip(GQA_MISSING)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 128, 64, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 128, 64, generator=g).requires_grad_() for _ in range(2))
    with ShadowMode() as sm:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    (fwd,) = sm.report.find(op=FLASH_CPU[0])
    (bwd,) = sm.report.find(op=FLASH_CPU[1])
    assert 0 < fwd.budget.used < 0.25 and 0 < bwd.budget.used < 0.25, (fwd.budget, bwd.budget)
    assert fwd.local.rel_norm < 4 * torch.finfo(torch.float32).eps


# --- the device-only kernels: their replay rules called on CPU tensors ---
@dataclasses.dataclass(frozen=True)
class Kernel:
    forward: str
    backward: str | None
    lse_shape: tuple[int, ...] | None  # the device's logsumexp layout (None: no logsumexp output)

    @property
    def ops(self) -> tuple:
        return getattr(aten, self.forward).default, getattr(aten, self.backward).default if self.backward else None

    @property
    def missing(self) -> str | None:
        for name in (self.forward, self.backward):
            if name is not None and not hasattr(aten, name):
                return f"torch {torch.__version__} has no aten.{name}"
        return None

    @property
    def takes_mask(self) -> bool:
        plan = plan_of(self.ops[0])
        return plan.has("attn_bias") or plan.has("attn_mask")


KERNELS = {
    "flash": Kernel("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward", (B, H, L)),
    # memory-efficient attention pads its logsumexp to a multiple of 32 queries
    "efficient": Kernel("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                        (B, H, 32)),
    "cudnn": Kernel("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
                    (B, H, L, 1)),
    "overrideable": Kernel("_scaled_dot_product_fused_attention_overrideable",
                           "_scaled_dot_product_fused_attention_overrideable_backward", (B, H, L)),
    "mps_math": Kernel("_scaled_dot_product_attention_math_for_mps", None, None),
}
LSE_PADDING = 7.0  # the device's padding value: the replay must keep it


def _replay(op, device_out, **named) -> Replay:
    """A Replay of op with arguments by schema name (the rest: schema defaults, else None)."""
    args, kwargs = [], {}
    for a in op._schema.arguments:
        value = named.get(a.name, a.default_value if a.has_default_value() else None)
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return Replay(plan_of(op), args, kwargs, device_out)


def _device_outputs(op, first: list) -> tuple:
    """Stand-ins for the device's outputs: ``first``, then a distinct integer tensor per remaining output."""
    n = len(op._schema.returns)
    return tuple(first) + tuple(torch.tensor(100 + i) for i in range(len(first), n))


def _kernel_case(name: str, case: Case) -> Kernel:
    kernel = KERNELS[name]
    if kernel.missing:
        pytest.skip(kernel.missing)
    if case.mask and not kernel.takes_mask:
        pytest.skip(f"torch {torch.__version__}: aten.{kernel.forward} takes no mask")
    return kernel


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_device_kernel_replay_is_the_formula(name, case):
    """Forward: the output and logsumexp are the formula's (the device's logsumexp padding and auxiliary
    outputs kept); backward: dq, dk, dv (and the gradient of a float mask) are autograd's of the formula."""
    kernel = _kernel_case(name, case)
    fwd_op, bwd_op = kernel.ops
    q, k, v, mask = _inputs(case, f64)
    grad_out = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(1), dtype=f64)
    ref_out, ref_lse, ref_grads = _formula(case, q, k, v, mask, grad_out)
    named = dict(query=q, key=k, value=v, attn_bias=mask, attn_mask=mask, is_causal=case.causal, scale=case.scale,
                 dropout_p=0.0, compute_log_sumexp=True)
    if kernel.lse_shape is None:  # MPS's math kernel: (output, attention weights)
        kind, (out, weights) = sdpa_math_rule(_replay(fwd_op, None, **named))
        assert kind is Kind.REPLAYED and rel(out, ref_out) < TOL
        assert torch.allclose(weights.sum(-1), torch.ones((), dtype=f64), rtol=0, atol=1e-14)
        assert rel(weights @ v.repeat_interleave(H // case.kv_heads, -3), ref_out) < TOL
        return
    lse_dev = torch.full(kernel.lse_shape, LSE_PADDING)
    kind, out = sdpa_forward_rule(_replay(fwd_op, _device_outputs(fwd_op, [ref_out.float(), lse_dev]), **named))
    assert kind is Kind.REPLAYED and rel(out[0], ref_out) < TOL
    lse = out[1].reshape(B, H, -1)
    assert out[1].shape == kernel.lse_shape and rel(lse[..., :L], ref_lse) < TOL
    assert (lse[..., L:] == LSE_PADDING).all()
    assert [int(t) for t in out[2:]] == [100 + i for i in range(2, len(out))]  # adopted as the device's
    float_mask = mask is not None and mask.is_floating_point()
    device_grads = [q, k, v] + ([mask if float_mask else None] if len(bwd_op._schema.returns) > 3 else [])
    named.update(grad_out=grad_out, grad_out_=grad_out, out=out[0], logsumexp=out[1],
                 grad_input_mask=[True, True, True, float_mask])
    kind, grads = sdpa_backward_rule(_replay(bwd_op, tuple(device_grads), **named))
    assert kind is Kind.REPLAYED
    for got, ref in zip(grads, ref_grads):  # (dq, dk, dv) and, for a float mask, its gradient
        assert got.shape == ref.shape and rel(got, ref) < TOL
    if len(grads) > 3 and not float_mask:
        assert grads[3] is None


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_device_kernel_with_dropout_is_adopted_not_replayed(name):
    kernel = KERNELS[name]
    if kernel.missing:
        pytest.skip(kernel.missing)
    q = torch.randn(1, 1, 4, 8, dtype=f64)
    for op, rule in zip(kernel.ops, (sdpa_math_rule if kernel.lse_shape is None else sdpa_forward_rule,
                                     sdpa_backward_rule)):
        if op is not None:
            assert rule(_replay(op, None, query=q, key=q, value=q, dropout_p=0.1)) == (Kind.RANDOM, None)


def test_efficient_attention_budget_with_padded_logsumexp_and_gqa():
    """Memory-efficient attention's logsumexp is padded to 32 queries (here 5 real ones) and its keys/values
    have fewer heads: the budget bounds the real entries (0 on the padding, which the replay keeps as the
    device's) and a correctly rounded float32 result is within it."""
    case = Case(2, causal=True)
    _kernel_case("efficient", case)
    op = KERNELS["efficient"].ops[0]
    q, k, v, _ = (t.float().double() if t is not None else None for t in _inputs(case, torch.float32))
    r = _replay(op, _device_outputs(op, [torch.zeros(B, H, L, E), torch.full((B, H, 32), LSE_PADDING)]),
                query=q, key=k, value=v, is_causal=True, compute_log_sumexp=True, dropout_p=0.0)
    _, outs = sdpa_forward_rule(r)
    budget = budget_for(op, r.args, r.kwargs, list(outs), torch.float32)
    out_bound, lse_bound = budget.bound[:2]
    assert budget.family == "attention" and lse_bound.shape == (B, H, 32) and (lse_bound[..., L:] == 0).all()
    assert (lse_bound[..., :L] > 0).all() and (out_bound > 0).all()
    for ref, bound in ((outs[0], out_bound), (outs[1], lse_bound)):
        assert compare(ref.float(), ref, torch.float32, bound).budget_used <= 0.5  # one rounding: <= u |r|
