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
    # the exact sum is 4; the float64 shadow adds 1e16 + 1 first and loses the 1: its 3 is off by 2^52
    # float64 ulps of 1 (the float32 device, summing in its own order, may lose it too)
    x = torch.tensor([1e16, 1.0, -1e16, 3.0])
    with ShadowMode() as sm:
        s = x.sum()
    rec = sm.report.records[0]
    assert rec.op == "aten.sum.default" and rec.spot.checked and not rec.spot.trusted
    assert rec.spot.device_err_abs == abs(s.item() - 4.0)
    assert sm.report.untrusted() == [rec]
    assert "1 !" in sm.report.table()  # the untrusted column flags the row
    # the error figures use the exact value, and the shadow carries it on
    assert rec.local.max_abs == rec.drift.max_abs == abs(s.item() - 4.0)
    assert sm.shadow_of(s).item() == 4.0


def test_untrusted_reference_elements_are_replaced_by_the_exact_value_in_the_error_figures():
    # the fp32 device loses the 1.0 next to 1e16 (1e16 + 1 rounds back in float32 and float64 alike);
    # the exact sum is 1: the float64 reference says the device is exact, the exact value says it is off by 1
    x = torch.tensor([1e16, 1.0, -1e16])
    with ShadowMode(spot_checks=4) as sm:
        s = x.sum()
    rec = sm.report.records[0]
    assert s.item() == 0.0 and not rec.spot.trusted
    assert rec.local.max_abs == 1.0 and rec.local.max_ulp > 1e6  # 1.0 against an exact 1: 2**23 ulps
    assert sm.shadow_of(s).item() == 1.0


def test_spot_checks_off_and_float64_devices():
    x = torch.randn(64, 64)
    with ShadowMode(spot_checks="off") as sm:
        x @ x
    assert all(r.spot is None for r in sm.report.records)
    with ShadowMode() as sm:  # float64 devices: the reference has no headroom over the device: not checked
        x.double() @ x.double()
    assert all(r.spot is None for r in sm.report.records)


def test_first_samples_go_where_the_budget_says_the_reference_cancels():
    # 4096 row sums, one of which cancels: [1e16, 1, -1e16, 3] sums to 4 exactly, float64 says 3. Two random
    # samples would miss that row almost surely; the budget's bound / |result| ranks it first
    torch.manual_seed(0)
    x = torch.rand(4096, 4)
    x[1234] = torch.tensor([1e16, 1.0, -1e16, 3.0])
    with ShadowMode() as sm:
        s = x.sum(1)
    rec = sm.report.records[0]
    assert rec.spot.checked and not rec.spot.trusted
    assert sm.shadow_of(s)[1234].item() == 4.0  # the exact value replaced float64's 3
    assert rec.local.max_abs == abs(s[1234].item() - 4.0)
