"""Replay rules for fused device kernels with no float64 CPU kernel (shadow.replay.recurrent: oneDNN's LSTM
layer), tested by calling the rules on float64 inputs and comparing with PyTorch's own float64 LSTM and
autograd. The attention kernels' rules are tested in test_attention.py."""

import pytest
import torch
import torch.nn as nn

from shadow.plan import plan_of
from shadow.records import Kind
from shadow.replay import Replay
from shadow.replay.recurrent import mkldnn_lstm_layer_backward_rule, mkldnn_lstm_layer_rule

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not hasattr(aten, "mkldnn_rnn_layer"),
                                reason=f"torch {torch.__version__} has no aten.mkldnn_rnn_layer")
f64 = torch.float64
T, N, I, HID = 4, 3, 5, 6  # steps, batch, input size, hidden size
LSTM_MODE = 2  # mkldnn_rnn_layer's mode argument for an LSTM


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("reverse", [False, True])
def test_mkldnn_lstm_layer_forward_and_backward_match_torch(reverse):
    """One layer, one direction (reverse: the backward half of a bidirectional LSTM), against nn.LSTM in
    float64 on the time-reversed input; float64 roundings only, so 1e-12 relative."""
    g = torch.Generator().manual_seed(0)
    lstm = nn.LSTM(I, HID).to(f64)
    x, h0, c0 = torch.randn(T, N, I, generator=g, dtype=f64), *torch.randn(2, 1, N, HID, generator=g, dtype=f64)
    gy, ghy, gcy = torch.randn(T, N, HID, generator=g, dtype=f64), *torch.randn(2, 1, N, HID, generator=g, dtype=f64)
    leaves = [t.clone().requires_grad_() for t in (x, h0, c0)]
    weights = [lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0]
    y, (hy, cy) = lstm(leaves[0].flip(0) if reverse else leaves[0], tuple(leaves[1:]))
    y = y.flip(0) if reverse else y
    ref_grads = torch.autograd.grad((y, hy, cy), leaves + weights, (gy, ghy, gcy))
    w = [t.detach() for t in weights]
    workspace = torch.tensor([1.0, 2.0])  # oneDNN's opaque bytes: kept as the device's
    fwd_args = [x, *w, h0, c0, reverse, [], LSTM_MODE, HID, 1, True, False, False, True]
    kind, (out, h, c, ws) = mkldnn_lstm_layer_rule(Replay(plan_of(aten.mkldnn_rnn_layer.default), fwd_args, {},
                                                          (None, None, None, workspace)))
    assert kind is Kind.DECOMPOSED and torch.equal(ws, workspace) and ws is not workspace
    for got, ref in ((out, y), (h, hy), (c, cy)):
        assert got.shape == ref.shape and rel(got, ref.detach()) < 1e-12
    bwd_args = [x, *w, h0, c0, out, h, c, gy, ghy, gcy, reverse, LSTM_MODE, HID, 1, True, True, False, [], False,
                workspace]
    kind, grads = mkldnn_lstm_layer_backward_rule(Replay(plan_of(aten.mkldnn_rnn_layer_backward.default), bwd_args,
                                                         {}, None))
    dx, dw_ih, dw_hh, db_ih, db_hh, dh0, dc0 = grads
    assert kind is Kind.DECOMPOSED
    for got, ref in zip((dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh), ref_grads):
        assert got.shape == ref.shape and rel(got, ref) < 1e-12


def test_gru_mode_falls_through():
    """Modes other than LSTM (GRU, RNN) are not this rule's: NotImplemented, so the next rule answers."""
    x = torch.randn(T, N, I, dtype=f64)
    args = [x, *(torch.zeros(4 * HID, I, dtype=f64),) * 4, torch.zeros(1, N, HID, dtype=f64),
            torch.zeros(1, N, HID, dtype=f64), False, [], 3, HID, 1, True, False, False, True]
    assert mkldnn_lstm_layer_rule(Replay(plan_of(aten.mkldnn_rnn_layer.default), args, {}, None)) is NotImplemented
