"""Issue 4 through ShadowMode: spot checks on real training steps are trusted; a float64 reference that
cancellation makes wrong is flagged on its record, with the device's error against the exact value."""

import pytest
import torch

from shadow import ShadowMode

from models import build, loss_fn, make_batches, make_optimizer, train_steps


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_training_steps_have_only_trusted_spot_checks(name):
    model = build(name)
    opt = make_optimizer("adam", model.parameters(), "foreach")
    with ShadowMode() as sm:
        train_steps(model, opt, make_batches(name, 2), loss_fn(name))
    checked = [r for r in sm.report.records if r.spot is not None and r.spot.checked]
    assert len(checked) >= 10  # default sampling reached the model's ops
    assert sm.report.untrusted() == []
    assert sum(a.spot_checked for a in sm.report.by_op.values()) == len(checked)


def test_cancelling_sum_is_flagged_untrusted_with_the_exact_error():
    # fp32 device: 1e16 and -1e16 cancel exactly, the 1.0 and 3.0 survive: the device sum is 4 (exact);
    # the float64 shadow adds 1e16 + 1 first and loses the 1: its 3 is off by 2^52 float64 ulps of 1
    x = torch.tensor([1e16, 1.0, -1e16, 3.0])
    with ShadowMode() as sm:
        s = x.sum()
    rec = sm.report.records[0]
    assert rec.op == "aten.sum.default" and rec.spot.checked and not rec.spot.trusted
    assert rec.spot.device_err_abs == abs(s.item() - 4.0)
    assert sm.report.untrusted() == [rec]
    assert "1 !" in sm.report.table()  # the untrusted column flags the row


def test_spot_checks_off_and_float64_devices():
    x = torch.randn(64, 64)
    with ShadowMode(spot_checks="off") as sm:
        x @ x
    assert all(r.spot is None for r in sm.report.records)
    with ShadowMode() as sm:  # float64 devices: the reference has no headroom over the device: not checked
        x.double() @ x.double()
    assert all(r.spot is None for r in sm.report.records)
