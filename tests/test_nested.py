"""Nested tensors under shadow: nn.TransformerEncoder's fast path for padded batches.

In eval mode with a ``src_key_padding_mask``, nn.TransformerEncoder packs the batch into a nested tensor
(``aten._nested_tensor_from_mask``), runs each layer's fused kernel on it (``aten._transformer_encoder_layer_fwd``)
and pads the result back (``aten.to_padded_tensor``). A nested tensor has a shape per component and no strides,
so the mirror cannot hold its shadow: these calls are recorded as unsupported, with a reason that says how to
shadow the model; the device's results are adopted and what follows the padded output is shadowed again. The
ways the reason names (``enable_nested_tensor=False``, training mode, no mask) are replayed and match a float64
run of the same model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shadow import ShadowMode

pytestmark = pytest.mark.usefixtures("one_thread")

f64 = torch.float64
TOL = 1e-12  # float64 roundings only (2**-53 ~ 1.1e-16 each, a few hundred of them), far below float32's 6e-8
NESTED_OPS = {"aten._nested_tensor_from_mask.default", "aten._transformer_encoder_layer_fwd.default",
              "aten.to_padded_tensor.default"}


def _encoder(dtype: torch.dtype, *, enable_nested_tensor: bool = True) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=enable_nested_tensor).to(dtype)


def _batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """3 sequences of 6, 4 and 2 tokens, padded to 6 (True: padding)."""
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(1), dtype=f64).to(dtype)
    mask = torch.arange(6).expand(3, 6) >= torch.tensor([[6], [4], [2]])
    return x, mask


def _run(model: nn.Module, head: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The PyTorch API of nested tensors is in prototype stage"
        y = model(x, src_key_padding_mask=mask)
        return y, head(y)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(f64), b.detach().to(f64)
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, f64], ids=str)
def test_nested_fast_path_is_unsupported_with_its_reason_and_what_follows_is_shadowed(dtype):
    """The encoder's nested calls: unsupported, each with the reason and its remedy, none an internal error;
    the device's output bit-identical with and without shadow. The padded output's shadow is the device's
    value (adopted), and the linear head after it is replayed from there: its shadow is float64 arithmetic on
    that value, equal to the device's own result on a float64 device."""
    model, head = _encoder(dtype).eval(), nn.Linear(16, 5).to(dtype)
    x, mask = _batch(dtype)
    plain_y, plain_z = _run(model, head, x, mask)
    with ShadowMode() as sm:
        y, z = _run(model, head, x, mask)
    assert torch.equal(y, plain_y) and torch.equal(z, plain_z)
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and set(cov.unsupported) == NESTED_OPS, cov
    for op, reason in cov.unsupported.items():
        assert reason.startswith("nested tensor ") and "enable_nested_tensor=False" in reason, (op, reason)
    assert [r.kind for r in sm.report.records if r.op in NESTED_OPS] == ["unsupported"] * 4  # 2 layers
    assert torch.equal(sm.shadow_of(y), y.to(f64))
    z64 = F.linear(y.to(f64), head.weight.to(f64), head.bias.to(f64))
    assert rel(sm.shadow_of(z), z64) < TOL
    after = [r for r in sm.report.records if r.index > max(r.index for r in sm.report.find(op="aten.to_padded_tensor"))]
    assert after and all(r.kind in ("replayed", "view") for r in after), [(r.op, r.kind) for r in after]
    if dtype == f64:
        assert torch.equal(sm.shadow_of(z), z)
    else:
        assert not sm.report.records_over_budget()
        assert 0 < rel(z, z64) < 4 * torch.finfo(dtype).eps  # measured 0.53 eps


@pytest.mark.parametrize("way", ["enable_nested_tensor=False", "training mode", "no padding mask"])
def test_the_ways_the_reason_names_are_replayed_and_match_float64(way):
    """Without nested tensors every call is replayed, and the shadow of the float32 encoder's output equals
    the float64 run of the same model (same weights upcast, same inputs, same mode and path)."""
    model = _encoder(torch.float32, enable_nested_tensor=way != "enable_nested_tensor=False")
    model.train(way == "training mode")  # dropout=0: training mode is deterministic
    model64, head = copy.deepcopy(model).to(f64), nn.Identity()
    x, mask = _batch(torch.float32)
    mask = None if way == "no padding mask" else mask
    plain_y, _ = _run(model, head, x, mask)
    with ShadowMode() as sm:
        y, _ = _run(model, head, x, mask)
    assert torch.equal(y, plain_y)
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported, cov
    y64, _ = _run(model64, head, x.to(f64), mask)
    assert rel(sm.shadow_of(y), y64) < TOL
    assert 0 < rel(y, y64) < 4 * torch.finfo(torch.float32).eps  # measured 0.87-0.90 eps
    fused = sm.report.find(op="aten._transformer_encoder_layer_fwd")
    assert len(fused) == (0 if way == "training mode" else 2)  # eval: the fused layer kernel on dense tensors
