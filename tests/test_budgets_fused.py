"""Budgets of the fused optimizers (``_fused_adam(w)_``, ``_fused_sgd_``, ``_fused_adagrad_``) and of oneDNN's LSTM
layers (``mkldnn_rnn_layer`` and its backward), held to the CPU kernels: correct kernels within budget, a fault of
known size (FaultMode) a few times the bound's relative size over it, and the layer's figures against a float64 copy
of the model run without shadow."""

from __future__ import annotations

import copy
import math
import unittest.mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shadow import ShadowMode
from shadow.budgets import budget_for, optimizer
from shadow.budgets.optimizer import adagrad_step, adam_step, sgd_step
from shadow.engine import prepare
from shadow.modes.faults import FaultMode

aten = torch.ops.aten
HAS_MKLDNN_RNN = hasattr(aten, "mkldnn_rnn_layer")


def _identity(x):
    return x


# --- the steps as written match the float64 kernels they transcribe (no shadow) ---
def _lists(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(5)]


@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_step_is_the_kernel(adamw, amsgrad):
    p, g, m, v, vmax = _lists(100, 0)
    v, vmax = v.abs(), vmax.abs()
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=amsgrad, maximize=True)
    want = adam_step(p, g, m, v, vmax, _identity, step=3.0, adamw=adamw, grad_scale=2.0, **kw)
    steps = [torch.tensor(3.0)]
    state = [t.clone() for t in (p, g, m, v, vmax)]
    op = aten._fused_adamw_ if adamw else aten._fused_adam_
    op(*([t] for t in state[:4]), state[4:] if amsgrad else [], steps, grad_scale=torch.tensor(2.0), **kw)
    for got, ref in zip(state, want):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_and_adagrad_steps_are_the_kernels(nesterov):
    p, g, buf, s, _ = _lists(100, 1)
    kw = dict(weight_decay=0.1, momentum=0.9, lr=0.1, dampening=0.0, nesterov=nesterov, maximize=False,
              is_first_step=False)
    want = sgd_step(p, g, buf, _identity, _identity, **kw)
    state = [t.clone() for t in (p, g, buf)]
    aten._fused_sgd_(*([t] for t in state), **kw)
    for got, ref in zip(state, want):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-14, atol=1e-15)
    kw = dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, eps=1e-10, maximize=False)
    want = adagrad_step(p, g, s.abs(), _identity, _identity, step=4.0, **kw)
    state = [p.clone(), g.clone(), s.abs()]
    aten._fused_adagrad_(*([t] for t in state), [torch.tensor(4.0)], **kw)
    torch.testing.assert_close(state[0], want[0], rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(state[2], want[2], rtol=1e-14, atol=1e-15)


def _adam_budgets(n, dtype, *, adamw, amsgrad, maximize, weight_decay, beta1, grad_scale, seed=0):
    """The bounds of one fused Adam(W) call by ``budget_for``: (the one-pass kernel's, the ``Rounded`` chain's)."""
    g = torch.Generator().manual_seed(seed)
    p, grad, m, v, vmax = (torch.randn(n, generator=g, dtype=torch.float64) for _ in range(5))
    v, vmax = v.abs(), vmax.abs()
    # values the chain must carry as torch does: zeros (sqrt(0), 0/0 in its bound), a subnormal, an infinity, a NaN
    for t in (p, grad, m):
        t[:5] = torch.tensor([0.0, -0.0, 5e-324, math.inf, math.nan], dtype=torch.float64)
    v[:3] = 0.0
    args = ([p], [grad], [m], [v], [vmax] if amsgrad else [], [torch.tensor(3.0)])
    kwargs = dict(lr=1e-2, beta1=beta1, beta2=0.999, weight_decay=weight_decay, eps=1e-8, amsgrad=amsgrad,
                  maximize=maximize, grad_scale=None if grad_scale is None else torch.tensor(grad_scale))
    op = aten._fused_adamw_.default if adamw else aten._fused_adam_.default
    outputs = [p, grad, m, v] + ([vmax] if amsgrad else [])

    def bounds():
        return budget_for(op, args, kwargs, outputs, dtype).bound

    fast = bounds()
    with unittest.mock.patch.object(optimizer, "fused_bounds", None):
        slow = bounds()
    return fast, slow


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adamw, amsgrad, maximize, weight_decay, beta1, grad_scale", [
    (False, False, False, 0.0, 0.9, None), (True, False, False, 0.01, 0.9, None),
    (False, True, True, 0.1, 0.9, 2.0), (True, True, False, 0.1, 0.3, None), (False, False, True, 0.0, 0.3, 0.5)])
def test_adam_pass_is_the_rounded_chain(dtype, adamw, amsgrad, maximize, weight_decay, beta1, grad_scale):
    """The fused Adam(W) bounds from one pass equal the ``Rounded`` chain's (NaN where it is NaN), on every branch of
    the step (beta1 = 0.3: the lerp from its far end) and in both the serial and parallel loops: to the bit but for
    the square root, which the pass rounds correctly and torch's float64 CPU kernel (vectorized) to within an ulp
    (1.4 % of random inputs an ulp off, measured on torch 2.13 AVX-512; the chain after it carries that ulp, 2**-48
    relative at one of 196,615 elements on an Intel Xeon with AVX512-FP16): within a few float64 roundings."""
    for n in (1000, 3 * 2 ** 16 + 7):
        fast, slow = _adam_budgets(n, dtype, adamw=adamw, amsgrad=amsgrad, maximize=maximize,
                                   weight_decay=weight_decay, beta1=beta1, grad_scale=grad_scale)
        assert len(fast) == len(slow) == 4 + amsgrad
        for a, b in zip(fast, slow):
            torch.testing.assert_close(a, b, rtol=2.0 ** -46, atol=0, equal_nan=True)
        assert slow[0][5:].gt(0).all() and slow[0][3].isnan()  # real bounds, and the infinity's NaN kept


# --- the optimizers under ShadowMode ---
OPTIMIZERS = {
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, fused=True), "_fused_adam_"),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), "_fused_adamw_"),
    "adamw-amsgrad": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True), "_fused_adamw_"),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, fused=True),
                     "_fused_sgd_"),
    "sgd-nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, fused=True),
                     "_fused_sgd_"),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=1e-3, fused=True), "_fused_adagrad_"),
}


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)


def _train(model, make, steps=2, fault=None):
    opt = make(list(model.parameters()))
    x, y = torch.randn(32, 16, dtype=next(model.parameters()).dtype), torch.randn(32, 8)
    with FaultMode(rel=fault[1], op=fault[0]) if fault else _nothing(), ShadowMode() as sm:
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
    return sm.report


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _calls(report, op):
    return [r for r in report.records if r.op.startswith(f"aten.{op}.")]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_optimizer_float32_within_budget_and_fault_over(name):
    make, op = OPTIMIZERS[name]
    calls = _calls(_train(_mlp(torch.float32), make), op)
    assert len(calls) == 2
    for r in calls:
        assert not r.budget.is_default and r.budget.family == "elementwise"
        assert r.budget.used <= 1, (name, r.budget.used)
        assert r.local.effective_bits is None or r.local.effective_bits > 20, r.local
    # a relative fault of 1e-4, some 100x the budget's relative size of a few float32 roundings
    faulted = _calls(_train(_mlp(torch.float32), make, fault=(op, 1e-4)), op)
    assert all(r.over_budget for r in faulted), [r.budget.used for r in faulted]
    # finite where every value the kernel writes is computed: the fault is in the parameters and their state, not in
    # the gradients it declares written but leaves alone without grad_scale (bound 0); SGD's first step copies the
    # gradient into the momentum buffer (exact: bound 0, so a fault there reads inf)
    if op != "_fused_sgd_":
        assert all(math.isfinite(r.budget.used) for r in faulted), [r.budget.used for r in faulted]
    assert all(r.local.effective_bits < 16 for r in faulted)


@pytest.mark.parametrize("name", ["adam", "adamw-amsgrad", "sgd-momentum", "adagrad"])
def test_fused_budget_built_before_the_replays_as_from_copies(name):
    """A fused optimizer's budget reads only the step's inputs (``builds_early``): where the keeper could not keep
    the call (``max_repro_bytes=0``) it is built before the replays overwrite them, with no copy of the inputs; the
    records equal those of the path that copies them first (every figure, the budget's use to the bit)."""
    make, op = OPTIMIZERS[name]

    def records(cap):
        model = _mlp(torch.float32)
        opt = make(list(model.parameters()))
        torch.manual_seed(1)
        x, y = torch.randn(32, 16), torch.randn(32, 8)
        with ShadowMode(spot_checks="off", max_repro_bytes=cap) as sm, \
                unittest.mock.patch.object(prepare, "built_early", wraps=prepare.built_early) as built:
            for _ in range(3):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        return [r.to_dict() for r in _calls(sm.report, op)], built.call_count

    early, built_early = records(0)
    copied, built_copied = records(1 << 30)
    assert (built_early, built_copied) == (3, 0)
    if op == "_fused_sgd_":  # its first step reads momentum buffers torch makes with empty_like: whatever bits
        for first in (early[0], copied[0]):  # the memory held, NaN or not
            first.pop("inputs_nonfinite")
    assert len(early) == 3 and early == copied
    assert all(0 < r["budget"]["used"] <= 1 for r in early), [r["budget"]["used"] for r in early]


def _drops_bf16_update(make):
    """Whether the fused CPU kernel leaves a bfloat16 parameter of 64 elements unmoved by an update of ~6 ulps
    (torch 2.13's vectorized bfloat16 SGD loop never writes the parameter): no shadow involved."""
    p = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    p.grad = torch.full_like(p, 0.5)
    make([p]).step()
    return bool((p == 1).all())


@pytest.mark.parametrize("name", ["adam", "adamw-amsgrad", "sgd-momentum", "adagrad"])
def test_fused_optimizer_bfloat16(name):
    make, op = OPTIMIZERS[name]
    calls = _calls(_train(_mlp(torch.bfloat16), make), op)
    assert len(calls) == 2 and not any(r.budget.is_default for r in calls)
    if _drops_bf16_update(make):  # a broken kernel: the budget finds it
        assert all(r.over_budget for r in calls), [r.budget.used for r in calls]
    else:
        assert all(r.budget.used <= 1 for r in calls), [r.budget.used for r in calls]


# --- nn.LSTM (oneDNN layers) and nn.GRU (decomposed) training steps ---
class LM(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(40, 16), rnn, nn.Linear(24, 40)

    def forward(self, tokens):
        return self.head(self.rnn(self.emb(tokens))[0])


def _lm_step(rnn, fault=None):
    """One fused AdamW step of a small LM under ShadowMode: (the mode, an untouched copy of the model, the tokens,
    the recurrent layer's output)."""
    torch.manual_seed(0)
    model = LM(rnn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    tokens = torch.randint(0, 40, (3, 6))
    reference = copy.deepcopy(model)
    seen = []
    model.rnn.register_forward_hook(lambda m, inputs, out: seen.append(out[0]))
    with FaultMode(rel=fault[1], op=fault[0]) if fault else _nothing(), ShadowMode() as sm:
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, 40), tokens.reshape(-1)).backward()
        opt.step()
    return sm, reference, tokens, seen[0]


def _rel(pairs):
    """||device - reference|| / ||reference||, the largest over (device, reference) pairs, as a record merges its
    outputs' figures."""
    return max(float((d.detach().double() - r).norm() / r.norm()) for d, r in pairs)


def _judged(report):
    return [r for r in report.records if r.budget is not None and r.budget.family not in ("empty",)]


@pytest.mark.skipif(not HAS_MKLDNN_RNN, reason="this torch has no aten.mkldnn_rnn_layer")
def test_lstm_lm_step_judged_and_within_budget():
    sm, reference, tokens, _ = _lm_step(nn.LSTM(16, 24, num_layers=2, batch_first=True))
    report = sm.report
    layers = _calls(report, "mkldnn_rnn_layer")
    if not layers:
        pytest.skip("nn.LSTM did not take oneDNN's layer kernel here")
    assert len(layers) == 2 and len(_calls(report, "mkldnn_rnn_layer_backward")) == 2
    judged = _judged(report)
    assert not [r.op for r in judged if r.budget.is_default]
    assert max(r.budget.used for r in judged) <= 1
    # layer 0 reads the embedding's output exactly: its local error is what a float32 layer errs against a float64
    # copy of it, both run without shadow
    emb = reference.emb(tokens)
    layer0 = nn.LSTM(16, 24, batch_first=True)
    layer0.load_state_dict({k: v for k, v in reference.rnn.state_dict().items() if k.endswith("_l0")})
    out32, (h32, c32) = layer0(emb)
    out64, (h64, c64) = copy.deepcopy(layer0).double()(emb.double())
    want = _rel([(out32, out64), (h32, h64), (c32, c64)])
    assert 1e-8 < want < 1e-5
    assert layers[0].local.rel_norm == pytest.approx(want, rel=1e-3)


@pytest.mark.skipif(not HAS_MKLDNN_RNN, reason="this torch has no aten.mkldnn_rnn_layer")
@pytest.mark.parametrize("op", ["mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"])
def test_lstm_layer_fault_over_budget(op):
    sm, _, _, _ = _lm_step(nn.LSTM(16, 24, num_layers=2, batch_first=True), fault=(op, 1e-3))
    calls = _calls(sm.report, op)
    if not calls:
        pytest.skip("nn.LSTM did not take oneDNN's layer kernel here")
    assert all(r.over_budget and not r.budget.is_default for r in calls), [r.budget.used for r in calls]


@pytest.mark.skipif(not HAS_MKLDNN_RNN, reason="this torch has no aten.mkldnn_rnn_layer")
def test_bidirectional_lstm_within_budget():
    torch.manual_seed(1)
    lstm = nn.LSTM(8, 12, bidirectional=True)  # (T, B, I): batch_first=False
    x = torch.randn(7, 3, 8)
    with ShadowMode() as sm:
        out, _ = lstm(x)
        out.square().sum().backward()
    calls = _calls(sm.report, "mkldnn_rnn_layer") + _calls(sm.report, "mkldnn_rnn_layer_backward")
    if not calls:
        pytest.skip("nn.LSTM did not take oneDNN's layer kernel here")
    assert len(calls) == 4
    assert all(not r.budget.is_default and r.budget.used <= 1 for r in calls), [r.budget for r in calls]


@pytest.mark.skipif(not HAS_MKLDNN_RNN, reason="this torch has no aten.mkldnn_rnn_layer")
def test_bfloat16_lstm_layer_judged_as_a_bfloat16_kernel():
    """oneDNN's bfloat16 LSTM backward returns float32 gradients of values it keeps in bfloat16: held to what a
    correct bfloat16 layer errs. Without shadow, PyTorch's own bfloat16 LSTM (oneDNN off: every op rounds to
    bfloat16) errs as much against float64 as oneDNN's does, so neither is a faulty kernel."""
    torch.manual_seed(0)
    lstm64 = nn.LSTM(8, 12).double()
    x = torch.randn(7, 4, 8, dtype=torch.float64).bfloat16()
    g = torch.randn(7, 4, 12, dtype=torch.float64).bfloat16()

    def grads(dtype, onednn=True):
        lstm, xs = copy.deepcopy(lstm64).bfloat16().to(dtype), x.to(dtype, copy=True).requires_grad_()
        with torch.backends.mkldnn.flags(enabled=onednn):
            out, _ = lstm(xs)
            out.backward(g.to(dtype))
        return [t.double() for t in (out, xs.grad, *(p.grad for p in lstm.parameters()))]

    want = grads(torch.float64)
    rel = lambda got: max(float((a - b).norm() / b.norm()) for a, b in zip(got, want))  # noqa: E731
    onednn, native = rel(grads(torch.bfloat16)), rel(grads(torch.bfloat16, onednn=False))
    assert onednn < 2 * native and native < 2 ** -6  # both a few bfloat16 units (u = 2**-8)
    lstm, xs = copy.deepcopy(lstm64).bfloat16(), x.clone().requires_grad_()
    with ShadowMode(spot_checks="off") as sm:
        out, _ = lstm(xs)
        out.backward(g)
    calls = _calls(sm.report, "mkldnn_rnn_layer") + _calls(sm.report, "mkldnn_rnn_layer_backward")
    if not calls:
        pytest.skip("nn.LSTM did not take oneDNN's layer kernel here")
    assert all(not r.budget.is_default and r.budget.used <= 1 for r in calls), [r.budget for r in calls]


def test_gru_lm_step_judged_and_within_budget():
    sm, reference, tokens, out = _lm_step(nn.GRU(16, 24, num_layers=2, batch_first=True))
    report = sm.report
    judged = _judged(report)
    assert not [r.op for r in judged if r.budget.is_default]
    assert max(r.budget.used for r in judged) <= 1
    # the GRU's float32 output against its shadow (float64 all along) is what the float32 model errs against a
    # float64 copy of it run without shadow
    ref64 = copy.deepcopy(reference).double()
    out64 = ref64.rnn(ref64.emb(tokens))[0]
    want = _rel([(out, out64)])
    assert 1e-8 < want < 1e-5
    assert _rel([(out, sm.shadow_of(out))]) == pytest.approx(want, rel=1e-3)
    torch.testing.assert_close(sm.shadow_of(out), out64.detach(), rtol=1e-12, atol=1e-14)


def test_lstm_layer_bias_sum_rounded_in_the_inputs_dtype():
    """oneDNN takes one bias per gate, b_ih + b_hh added by PyTorch in the layer's dtype: where the input projection
    cancels b_ih (x @ w = -256, b_ih = 256, b_hh = 0.5), the bfloat16 sum 256.5 rounds to 256 and every gate's
    pre-activation reads 0 instead of 0.5. A correct bfloat16 kernel: the float64 layer with only that sum rounded
    gives what the device gives, and the budget allows it (it read 50x before the sum's rounding was in it; torch
    2.4.1's bfloat16 layer met such a gate in tests/test_detection.py's LSTM)."""
    lstm = nn.LSTM(1, 1).bfloat16()
    with torch.no_grad():
        lstm.weight_ih_l0.fill_(-256.0), lstm.weight_hh_l0.zero_()
        lstm.bias_ih_l0.fill_(256.0), lstm.bias_hh_l0.fill_(0.5)
    x = torch.ones(1, 1, 1, dtype=torch.bfloat16)
    lstm64 = copy.deepcopy(lstm).double()
    want, _ = lstm64(x.double())
    with torch.no_grad():
        lstm64.bias_ih_l0.copy_((lstm.bias_ih_l0 + lstm.bias_hh_l0).double()), lstm64.bias_hh_l0.zero_()
    rounded_sum, _ = lstm64(x.double())
    with ShadowMode(spot_checks="off") as sm:
        out, _ = lstm(x)
    calls = _calls(sm.report, "mkldnn_rnn_layer")
    if not calls:
        pytest.skip("nn.LSTM did not take oneDNN's layer kernel here")
    assert float(want) == pytest.approx(0.1743, abs=1e-4) and float(rounded_sum) == 0.0 == float(out)
    assert float(sm.shadow_of(out)) == float(want)
    assert all(not r.budget.is_default and 0.1 < r.budget.used <= 1 for r in calls), [r.budget for r in calls]
