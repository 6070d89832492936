"""Nested tensors under shadow: nn.TransformerEncoder's fast path for padded batches, and torch.nested's ops.

In eval mode with a ``src_key_padding_mask``, nn.TransformerEncoder packs the batch into a nested tensor
(``aten._nested_tensor_from_mask``), runs each layer's fused kernel on it (``aten._transformer_encoder_layer_fwd``)
and pads the result back (``aten.to_padded_tensor``). A nested tensor's shadow is a float64 nested tensor over its
storage's shadow (``shadow.nested``): the three ops replay on their float64 CPU kernels, and a nested result is
judged by its values. Every answer is checked against runs without shadow: the float64 model (which takes the same
fast path), and the same math on dense tensors (the training-mode path, dropout 0).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shadow import ShadowMode, nested
from shadow.budgets import budget_for
from shadow.engine import EngineHooks

pytestmark = pytest.mark.usefixtures("one_thread")

f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
aten = torch.ops.aten
TOL = 1e-12  # float64 roundings only (2**-53 ~ 1.1e-16 each, a few hundred of them), far below float32's 6e-8
LAYER = "aten._transformer_encoder_layer_fwd.default"
NESTED_OPS = {"aten._nested_tensor_from_mask.default", LAYER, "aten.to_padded_tensor.default"}
LENGTHS = (6, 4, 2)


def _encoder(dtype: torch.dtype, *, enable_nested_tensor: bool = True) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=enable_nested_tensor).to(dtype)


def _batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """3 sequences of 6, 4 and 2 tokens, padded to 6 (True: padding)."""
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(1), dtype=f64).to(dtype)
    mask = torch.arange(6).expand(3, 6) >= torch.tensor(LENGTHS).unsqueeze(1)
    return x, mask


def _run(model: nn.Module, head: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The PyTorch API of nested tensors is in prototype stage"
        y = model(x, src_key_padding_mask=mask)
        return y, head(y)


class _Ops(TorchDispatchMode):
    """The names of the aten ops a program runs (no shadow)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(f64), b.detach().to(f64)
    return float((a - b).norm() / b.norm())


def _tokens(y: torch.Tensor) -> torch.Tensor:
    """The rows of the padded output that hold tokens (the padding's are the fast path's zeros)."""
    return torch.cat([y[b, :n] for b, n in enumerate(LENGTHS)])


@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=str)
def test_encoder_fast_path_is_shadowed(dtype):
    """The encoder's nested calls are replayed (none unsupported, no internal error), the device's results
    bit-identical with and without shadow. The shadow of the output equals the float64 model's output (the float64
    run takes the same fast path) and, on the tokens, the same math on dense tensors; a float64 program is its own
    reference, a float32 or bfloat16 one is within its budgets."""
    model, head = _encoder(dtype).eval(), nn.Linear(16, 5).to(dtype)
    x, mask = _batch(dtype)
    plain_y, plain_z = _run(model, head, x, mask)
    with ShadowMode() as sm:
        y, z = _run(model, head, x, mask)
    assert torch.equal(y, plain_y) and torch.equal(z, plain_z)
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported and cov.unobserved_writes == 0, cov
    assert [(r.op, r.kind) for r in sm.report.records if r.op in NESTED_OPS] == [
        ("aten._nested_tensor_from_mask.default", "replayed"), (LAYER, "replayed"), (LAYER, "replayed"),
        ("aten.to_padded_tensor.default", "replayed")]

    model64 = copy.deepcopy(model).to(f64)
    ops = _Ops()
    with ops:
        y64, _ = _run(model64, nn.Identity(), x.to(f64), mask)
    assert NESTED_OPS <= ops.names  # float64 takes the fast path too
    assert rel(sm.shadow_of(y), y64) < TOL  # measured 0: the same kernels on the same values
    dense64, _ = _run(model64.train(), nn.Identity(), x.to(f64), mask)  # the same math, op by op (dropout 0)
    assert rel(_tokens(sm.shadow_of(y)), _tokens(dense64)) < TOL
    z64 = F.linear(sm.shadow_of(y), head.weight.to(f64), head.bias.to(f64))
    assert rel(sm.shadow_of(z), z64) < TOL
    layers = sm.report.find(op="aten._transformer_encoder_layer_fwd")
    assert all(r.budget is not None and not r.budget.is_default for r in layers)
    if dtype == f64:
        assert torch.equal(sm.shadow_of(y), y)
        assert all(r.local.max_abs == 0 for r in sm.report.records if r.local is not None)
    else:
        assert not sm.report.records_over_budget()
        eps = torch.finfo(dtype).eps
        assert 0 < rel(y, y64) < 4 * eps  # measured 0.92 eps (float32), 0.48 eps (bfloat16)
        bits = -math.log2(eps)  # stored mantissa bits
        # each layer rounds at every stage: measured 21.3 bits of float32's 23, 6.2 of bfloat16's 7
        assert all(bits - 3 < r.local.effective_bits <= bits for r in layers)


@pytest.mark.parametrize("world", ["device", "exact"])
def test_ablation_worlds_reach_nested_results(world):
    """``shadow.attribute``'s worlds (``EngineHooks.world``) give a nested result's shadow its error too. In the
    "device" world every call's shadow takes the error the device made on it: the float32 encoder's output shadow
    is then the device's output (measured equal to the last bit) where the plain shadow is 0.92 eps from it. In
    the "exact" world every call is made exact, its result correctly rounded: the shadow moves 0.28 eps off the
    plain one."""
    model, head = _encoder(f32).eval(), nn.Identity()
    x, mask = _batch(f32)
    with ShadowMode() as plain:
        y, _ = _run(model, head, x, mask)
    with ShadowMode(hooks=EngineHooks(world=lambda *call: world)) as sm:
        y_world, _ = _run(model, head, x, mask)
    assert torch.equal(y_world, y)
    assert sm.report.coverage.internal_errors == 0 and not sm.report.coverage.unsupported
    shadow, before = sm.shadow_of(y_world), plain.shadow_of(y)
    assert rel(y, before) > 0.1 * torch.finfo(f32).eps
    if world == "device":
        assert rel(shadow, y) < TOL
    else:  # each call's result correctly rounded to float32, carried on in float64
        assert 0 < rel(shadow, before) < 4 * torch.finfo(f32).eps and rel(shadow, y) > TOL


def _layer_args(model: nn.TransformerEncoder, src: torch.Tensor, dtype: torch.dtype, mask=None) -> tuple:
    """The arguments of _transformer_encoder_layer_fwd for the first layer, its weights in ``dtype``."""
    m = model.layers[0]
    w = [t.detach().to(dtype) for t in (m.self_attn.in_proj_weight, m.self_attn.in_proj_bias,
                                         m.self_attn.out_proj.weight, m.self_attn.out_proj.bias)]
    rest = [t.detach().to(dtype) for t in (m.norm1.weight, m.norm1.bias, m.norm2.weight, m.norm2.bias,
                                            m.linear1.weight, m.linear1.bias, m.linear2.weight, m.linear2.bias)]
    return (src, 16, 4, *w, False, False, m.norm1.eps, *rest, mask, None if mask is None else 1)


def test_nested_budget_is_the_padded_batch_budget_at_the_tokens():
    """The budget of a nested call bounds its values (the components' rows, in order): the same numbers as the
    budget of the dense call on the padded batch with its padding keys masked, at the tokens' rows."""
    model = _encoder(f32).eval()
    x, mask = _batch(f64)
    x = x.masked_fill(mask.unsqueeze(-1), 0.0)  # the padded form of the nested batch
    nt = torch._nested_tensor_from_mask(x, ~mask, mask_check=False)
    op = aten._transformer_encoder_layer_fwd.default
    args_nested, args_dense = _layer_args(model, nt, f64), _layer_args(model, x, f64, mask)
    with torch.no_grad():
        y_nested, y_dense = op(*args_nested), op(*args_dense)
    values = nested.values(y_nested)
    assert torch.allclose(values, _tokens(y_dense).reshape(-1), rtol=0, atol=1e-14)
    b_nested = budget_for(op, args_nested, {}, [values], f32).bound[0]
    b_dense = budget_for(op, args_dense, {}, [y_dense], f32).bound[0]
    assert torch.equal(b_nested, _tokens(b_dense).reshape(-1))


def test_encoder_layer_budget_holds_float32_and_catches_bfloat16():
    """The layer's budget in float32 holds the float32 kernel (used 1.9e-4 here: a worst case composed over six
    matmuls, two layer norms and the softmax, docs/budgets.md) and not the bfloat16 kernel, which rounds every
    stage to 8 bits (used 5.9 against the float32 budget, 7.2e-4 against its own), each on the inputs it was
    given: a fault of known size."""
    model = _encoder(f32).eval()
    x, mask = _batch(f32)
    op = aten._transformer_encoder_layer_fwd.default
    used = {}
    for dtype in (f32, bf16):
        nt = torch._nested_tensor_from_mask(x.to(dtype), ~mask, mask_check=False)
        args = _layer_args(model, nt, dtype)
        upcast = tuple(a.to(f64) if isinstance(a, torch.Tensor) else a for a in args)
        with torch.no_grad():
            error = (nested.values(op(*args)).to(f64) - nested.values(op(*upcast))).abs()
        reference = [nested.values(op(*upcast))]
        for held in (f32, dtype):
            used[dtype, held] = float((error / budget_for(op, upcast, {}, reference, held).bound[0]).max())
    assert 0 < used[f32, f32] < 0.01
    assert used[bf16, f32] > 2
    assert 0 < used[bf16, bf16] < 0.01


@pytest.mark.parametrize("way", ["enable_nested_tensor=False", "training mode", "no padding mask"])
def test_the_dense_ways_are_replayed_and_match_float64(way):
    """Without nested tensors every call is replayed too, and the shadow of the float32 encoder's output equals
    the float64 run of the same model (same weights upcast, same inputs, same mode and path)."""
    model = _encoder(f32, enable_nested_tensor=way != "enable_nested_tensor=False")
    model.train(way == "training mode")  # dropout=0: training mode is deterministic
    model64, head = copy.deepcopy(model).to(f64), nn.Identity()
    x, mask = _batch(f32)
    mask = None if way == "no padding mask" else mask
    plain_y, _ = _run(model, head, x, mask)
    with ShadowMode() as sm:
        y, _ = _run(model, head, x, mask)
    assert torch.equal(y, plain_y)
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported, cov
    y64, _ = _run(model64, head, x.to(f64), mask)
    assert rel(sm.shadow_of(y), y64) < TOL
    assert 0 < rel(y, y64) < 4 * torch.finfo(f32).eps  # measured 0.87-0.90 eps
    fused = sm.report.find(op="aten._transformer_encoder_layer_fwd")
    assert len(fused) == (0 if way == "training mode" else 2)  # eval: the fused layer kernel on dense tensors
    assert not sm.report.records_over_budget() and all(not r.budget.is_default for r in fused)


def _nested_program(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.nested's ops: a list packed, linear, sin, add, a transposed view made contiguous, an in-place mul,
    padding."""
    nt = torch.nested.nested_tensor([a, b])
    h = F.linear(nt, w)
    s = h.sin() + h * 2
    y = torch.nested.to_padded_tensor(s.transpose(1, 2).contiguous(), 0.0)
    s.mul_(3)
    return y, torch.nested.to_padded_tensor(s, -1.0)


def test_torch_nested_ops_are_shadowed():
    """Nested tensors made with torch.nested: every call replayed, the results bit-identical, the shadows those
    of the float64 program (measured equal to the last bit: the same kernels on the same values)."""
    g = torch.Generator().manual_seed(0)
    a, b, w = (torch.randn(*shape, generator=g) for shape in ((3, 4), (2, 4), (5, 4)))
    plain = _nested_program(a, b, w)
    with ShadowMode() as sm:
        out = _nested_program(a, b, w)
    assert all(torch.equal(p, o) for p, o in zip(plain, out))
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported and cov.unobserved_writes == 0, cov
    assert sm.report.find(op="aten.mul_")[0].kind == "replayed"  # a nested tensor written in place
    for shadow, expected in zip(out, _nested_program(a.to(f64), b.to(f64), w.to(f64))):
        assert rel(sm.shadow_of(shadow), expected) < TOL


def test_nested_views_of_part_of_a_storage():
    """``nt.chunk(2, -1)``: nested views over part of nt's storage, read before and after a write of nt. Their
    shadows are views of the storage's shadow where torch makes them (2.13), copies of their components where it
    does not (2.4.1's ``_nested_view_from_buffer`` views only a buffer of the components' size), made again at each
    read; either way every call is replayed, and the shadows are the float64 program's."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g)

    def program(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        nt = torch.nested.nested_tensor([a, b])
        left, right = nt.chunk(2, -1)
        s = left * 3 + right
        nt.mul_(1.5)  # the views read it: their shadows follow, copies or not
        return s, torch.nested.to_padded_tensor(left * 2 + right, 0.0), right

    plain = program(a, b)
    with ShadowMode() as sm:
        out = program(a, b)
    assert torch.equal(out[1], plain[1])
    assert all(torch.equal(c, p) for t, u in zip(out[::2], plain[::2]) for c, p in zip(t.unbind(), u.unbind()))
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported and cov.unobserved_writes == 0, cov
    s64, y64, right64 = program(a.to(f64), b.to(f64))
    assert rel(sm.shadow_of(out[1]), y64) < TOL
    for t, t64 in ((out[0], s64), (out[2], right64)):  # a nested tensor's shadow: a nested float64 tensor
        assert all(torch.equal(c, c64) for c, c64 in zip(sm.shadow_of(t).unbind(), t64.unbind()))
