"""The engine's contracts, one trap of mirroring PyTorch per test: aliasing, mutation, randomness, discrete results,
non-finite values, unsupported ops, unobserved writes, options and the saved report."""

import copy
import itertools
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import shadow
from shadow import ShadowMode, ShadowOptionError
from shadow.metrics import compare
from shadow.reportformat import VERSION

import unjudged

aten = torch.ops.aten
f64 = torch.float64


def same(sm, t):
    """The shadow of t equals t exactly (float64 'device': the shadow is an identity check)."""
    s = sm.shadow_of(t)
    return torch.equal(s, t.to(s.dtype)) or bool(((s == t) | (s.isnan() & t.isnan())).all())


def records(sm, op):
    return [r for r in sm.report.records if r.op == op]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- aliasing and mutation ---
def test_views_transposes_and_inplace_through_views():
    x = torch.randn(4, 4, dtype=f64)
    with ShadowMode() as sm:
        y = x.t()
        y[1].mul_(3.0)  # writes column 1 of x through a transposed view
        z = x.view(16)[3:7]
        z.add_(1.0)
        w = x.sum()
    assert same(sm, x) and same(sm, y) and same(sm, z) and same(sm, w)
    assert {r.kind for r in sm.report.records if r.op in ("aten.t.default", "aten.select.int")} == {"view"}
    assert sm.report.coverage.internal_errors == 0


def test_out_reallocates_storage():
    x = torch.randn(3, 4, dtype=f64)
    out = torch.empty(0, dtype=f64)
    with ShadowMode() as sm:
        torch.add(x, 1.5, out=out)  # out is resized from 0 elements: a new allocation
        torch.mul(out, 3.0, out=out)
    assert out.shape == (3, 4) and same(sm, out)
    # each out= op has an exact drift of 0 (float64 device) and its figures cover all 12 elements
    assert [r.drift.n for r in sm.report.records] == [12, 12]


def test_set_and_resize():
    a, b = torch.randn(5, dtype=f64), torch.randn(7, dtype=f64)
    with ShadowMode() as sm:
        c = a * 2.0
        c.set_(b)  # c now aliases b's storage
        c.mul_(2.0)
        d = torch.ones(2, dtype=f64) * 3.0
        d.resize_(10)  # grows: the first 2 values are kept, the rest is uninitialized
        d[:2].add_(1.0)
    assert same(sm, c) and same(sm, b) and torch.equal(sm.shadow_of(d)[:2], torch.tensor([4.0, 4.0], dtype=f64))
    assert same(sm, d)  # the uninitialized tail is the device's own bytes


def test_every_geometry_read_of_a_fresh_output_gets_its_shadow():
    # y covers its storage: its own, transposed, sliced, reshaped, negated and resized reads each get the shadow of
    # what they read; resizing y in place leaves the shadow of its values as they were
    x = torch.randn(3, 4)
    with ShadowMode() as sm:
        y = x * 3.0
        a, b, c, v = y * 2.0, y.t() * 2.0, y[1:] * 2.0, y.view(2, 6) * 2.0
        g = torch._neg_view(y) * 2.0  # y's geometry, read negated
        y.resize_(12)
        d = y * 2.0
        e = y.view(3, 4) * 2.0
    exact = x.double() * 3.0  # float32 times 3 is exact in float64
    for t, want in ((a, exact * 2), (b, exact.t() * 2), (c, exact[1:] * 2), (v, exact.view(2, 6) * 2), (g, -exact * 2),
                    (d, exact.reshape(12) * 2), (e, exact * 2), (y, exact.reshape(12))):
        assert torch.equal(sm.shadow_of(t), want)
    assert sm.report.coverage.internal_errors == 0 and sm.report.coverage.unobserved_writes == 0


def test_fp32_resize_keeps_the_shadow_of_existing_values():
    x = torch.tensor([1.0, 3.0])
    with ShadowMode() as sm:
        y = x / 3.0  # 1/3 is not representable in fp32: the shadow keeps the exact float64 quotient
        y.resize_(6)
    assert sm.shadow_of(y)[:2].tolist() == [1.0 / 3.0, 1.0]


def test_zero_size_tensors():
    with ShadowMode() as sm:
        e = torch.randn(0, 3, dtype=f64) * 2.0
        s = e.sum(0)
    assert sm.shadow_of(e).shape == (0, 3) and same(sm, s)
    assert sm.report.coverage.internal_errors == 0


def test_self_overlapping_output():
    g = torch.empty_strided((4, 3), (0, 1), dtype=f64)  # 4 rows on one row of memory
    with ShadowMode() as sm:
        g.fill_(2.0)
        h = g * 1.5
    assert same(sm, g) and same(sm, h)
    assert sm.shadow_of(h).sum().item() == 36.0  # 12 elements of 3.0


def test_efficientzerotensor():
    x = torch.randn(3, dtype=f64, requires_grad=True)
    with ShadowMode() as sm:
        z = torch._efficientzerotensor(3, dtype=f64)
        y = x * 2.0 + z
        y.sum().backward()
    assert same(sm, y) and same(sm, x.grad)
    assert sm.report.coverage.internal_errors == 0


def test_wrapper_subclasses_unwrap_and_their_plain_calls_are_shadowed():
    """A wrapper tensor subclass (DTensor, fully_shard's parameters; torch's TwoTensor here) has no storage of its
    own: shadow lets it unwrap, and shadows the calls on the plain tensors it holds (reading the wrapper's
    storage used to kill the process)."""
    from torch.testing._internal.two_tensor import TwoTensor

    a = TwoTensor(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0]))
    with ShadowMode() as sm:
        b = a * 3.0
    assert b.a.tolist() == [3.0, 6.0, 9.0] and b.b.tolist() == [12.0, 15.0, 18.0]
    assert [r.op for r in sm.report.records].count("aten.mul.Tensor") == 2
    assert sm.shadow_of(b.b).tolist() == [12.0, 15.0, 18.0]


def test_batch_norm_running_stats_mutated_without_declaring_it():
    bn = torch.nn.BatchNorm1d(3).double()
    x = torch.randn(8, 3, dtype=f64) * 3 + 1
    with ShadowMode() as sm:
        bn(x)
        bn(x * 2)
    assert same(sm, bn.running_mean) and same(sm, bn.running_var)
    assert bn.running_mean.abs().sum() > 0  # the stats did move


def test_batch_norm_running_stats_drift_in_fp32():
    bn = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3) * 3 + 1
    with ShadowMode() as sm:
        bn(x)
    exact = (0.9 * torch.zeros(3, dtype=f64) + 0.1 * x.double().mean(0))
    assert torch.allclose(sm.shadow_of(bn.running_mean), exact, rtol=1e-15, atol=1e-17)
    rec = records(sm, "aten.native_batch_norm.default")[0]
    assert 0 < rec.drift.max_ulp < 8  # outputs and running stats compared: fp32 rounding, a few ulps


# --- first sight, randomness ---
def test_tensors_first_seen_are_adopted_exactly_and_counted():
    w = torch.randn(3, 3)  # created before the mode: adopted by exact upcast on first use
    with ShadowMode() as sm:
        y = w @ w
    assert torch.equal(sm.shadow_of(w), w.double())
    assert sm.report.coverage.tensors_adopted == 1


def test_a_storage_adopted_holds_a_nonfinite_value_exactly_when_an_element_is_one():
    """Adoption tests a storage by its sum, and element by element only where the sum is not finite: an
    overflowing sum of finite values (float64 near its maximum, float16) must not mark the storage."""
    from shadow.mirror import any_nonfinite

    inf, nan = math.inf, math.nan
    cases = [([1.0, 2.0], torch.float32, False), ([1.0, inf], torch.float32, True), ([-inf, inf], torch.float32, True),
             ([nan, 1.0], torch.bfloat16, True), ([1e308, 1e308], torch.float64, False),
             ([6e4] * 100, torch.float16, False), ([], torch.float32, False), ([1, 2], torch.int64, False)]
    for values, dtype, want in cases:
        assert any_nonfinite(torch.tensor(values, dtype=dtype)) is want, (values, dtype)
    assert any_nonfinite(torch.tensor([1.0, 2.0]).to(torch.float8_e5m2)) is False  # no sum for float8: the mask
    x, w = torch.tensor([1.0, inf, 3.0]), torch.tensor([1.0, 2.0, 3.0])
    with ShadowMode() as sm:
        x * 2, w * 2
    assert [r.inputs_nonfinite for r in records(sm, "aten.mul.Tensor")] == [True, False]


def test_random_ops_are_adopted_and_rng_untouched():
    def program():
        return torch.rand(3), torch.randn(2), torch.bernoulli(torch.full((5,), 0.3)), torch.nn.init.normal_(torch.empty(4))

    torch.manual_seed(1)
    expected = program() + (torch.rand(1),)
    torch.manual_seed(1)
    with ShadowMode() as sm:
        got = program()
    got += (torch.rand(1),)  # shadow consumed no random number: the stream continues where it would have
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    for b in got[:4]:
        assert torch.equal(sm.shadow_of(b), b.double())
    kinds = {r.op: r.kind for r in sm.report.records}
    assert {kinds[op] for op in ("aten.rand.default", "aten.randn.default", "aten.bernoulli.default",
                                 "aten.normal_.default")} == {"random"}


def test_dropout_mask_adopted_and_upstream_drift_survives():
    x = torch.randn(1000)
    with ShadowMode() as sm:
        y = x * 1.1  # fp32 rounding: drift starts here
        z = F.dropout(y, 0.5, training=True)
    mask = z != 0
    exact = (x.double() * 1.1) * mask * 2.0
    assert torch.equal(sm.shadow_of(z), exact)  # the shadow's y (not the device's) flows through the mask
    assert records(sm, "aten.mul.Tensor")[-1].drift.max_abs > 0


def test_sdpa_with_dropout_zero_is_replayed():
    q = torch.randn(2, 4, 8, 16, dtype=f64)
    with ShadowMode() as sm:
        o = F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    assert same(sm, o)
    kinds = {r.op: r.kind for r in sm.report.records}
    assert "random" not in kinds.values(), kinds


# --- discrete results, .item(), non-finite ---
def test_discrete_results_flips_and_follow():
    # fp32 rounding flips an argmax: a = 1 + 2^-24 rounds to 1.0 on the device, the shadow keeps it above 1
    a = torch.tensor([1.0, 2.0**-24])
    for follow, expected_idx in (("device", 0), ("reference", 1)):
        with ShadowMode(follow=follow) as sm:
            s = torch.stack([torch.ones(1), a[0:1] + a[1:2]]).squeeze(1)  # [1, 1 + 2^-24]
            i = torch.argmax(s)
            picked = torch.index_select(torch.tensor([10.0, 20.0]), 0, i.reshape(1))
        rec = records(sm, "aten.argmax.default")[0]
        assert rec.flips == 1  # device says 0 (a tie, first wins), shadow says 1
        assert i.item() == 0
        assert sm.shadow_of(picked).item() == [10.0, 20.0][expected_idx]


def test_item_records_device_and_shadow_values():
    x = torch.full((10,), 0.1)
    with ShadowMode() as sm:
        v = x.sum().item()
    rec = records(sm, "aten._local_scalar_dense.default")[0]
    assert rec.item[0] == v and rec.item[1] == pytest.approx(10 * float(torch.tensor(0.1)), rel=1e-15)
    assert rec.drift.max_ulp > 0  # the fp32 sum of ten 0.1f is not the exact sum


def test_nonfinite_counted_and_first_one_found():
    with ShadowMode() as sm:
        big = torch.tensor([3e38, 1.0])
        y = big * 10.0  # device overflows to inf, the float64 shadow does not
        z = y * 0.0  # device inf*0 = nan, shadow 0
    first = sm.report.first_nonfinite()
    assert first.op == "aten.mul.Tensor" and first.drift.nonfinite_device == 1 and first.drift.n == 2
    assert records(sm, "aten.mul.Tensor")[1].drift.nonfinite_device == 1
    assert sm.report.by_op["aten.mul.Tensor"].nonfinite >= 2


# --- cannot replay, internal errors ---
def test_unsupported_op_adopted_and_run_goes_on(monkeypatch):
    from shadow import replay
    from shadow.errors import Unsupported

    def broken(r):
        raise Unsupported(r.plan.name, "no float64 kernel (test)")

    x = torch.randn(5)
    with replay.REPLAY.scoped():
        replay.register_rule(aten.sin.default)(broken)
        with ShadowMode() as sm:
            y = torch.sin(x)
            z = y * 2.0
    assert torch.equal(z, torch.sin(x) * 2.0)
    rec = records(sm, "aten.sin.default")[0]
    assert rec.kind == "unsupported" and "no float64 kernel" in rec.reason
    assert torch.equal(sm.shadow_of(y), y.double())  # device result adopted
    assert sm.report.coverage.unsupported == {"aten.sin.default": rec.reason}


def test_internal_error_never_reaches_the_program(monkeypatch):
    from shadow.engine import judge

    def boom(*a, **k):
        raise RuntimeError("shadow bug")

    monkeypatch.setattr(judge, "compare", boom)
    x = torch.randn(4)
    with ShadowMode() as sm:
        y = (x * 2.0).exp()
    assert torch.equal(y, (x * 2.0).exp())
    assert sm.report.coverage.internal_errors == 2
    assert all("internal error: RuntimeError: shadow bug" in r.reason for r in sm.report.records)


def test_device_errors_propagate_unchanged():
    a, b = torch.randn(2, 3), torch.randn(4, 5)
    with pytest.raises(RuntimeError) as native:
        a @ b
    with ShadowMode() as sm, pytest.raises(RuntimeError) as shadowed:
        a @ b
    assert str(shadowed.value) == str(native.value)
    assert sm.report.coverage.internal_errors == 0


def test_decomposition_replays_kernels_without_a_float64_cpu_kernel(monkeypatch):
    # a device-only kernel, as DirectML/CUDA have: its CPU kernel refuses float64, its decomposition works
    from torch._decomp import decomposition_table

    lib = torch.library.Library("shadowtest", "DEF")
    lib.define("twice(Tensor x) -> Tensor")

    def kernel(x):
        if x.dtype == torch.float64:
            raise RuntimeError("twice: no float64 kernel")
        return x * 2

    lib.impl("twice", kernel, "CPU")
    op = torch.ops.shadowtest.twice.default
    x = torch.randn(5)
    with ShadowMode() as sm:
        y = op(x)
    rec = sm.report.records[-1]
    assert rec.op == "shadowtest.twice.default" and rec.kind == "unsupported" and "no float64 kernel" in rec.reason
    assert torch.equal(sm.shadow_of(y), y.double())
    monkeypatch.setitem(decomposition_table, op, lambda x: x * 2)
    with ShadowMode() as sm:
        y = op(x)
    assert [r.kind for r in sm.report.records if r.op == "shadowtest.twice.default"] == ["decomposed"]
    assert torch.equal(sm.shadow_of(y), x.double() * 2)


# --- writes behind shadow's back ---
def test_unobserved_write_detected_and_resynced():
    sm = ShadowMode()
    t = torch.randn(4, dtype=f64)
    with sm:
        u = t * 2.0
    u.add_(1.0)  # outside the mode: shadow does not see it
    with sm:
        v = u + t
    assert same(sm, v)
    assert sm.report.coverage.unobserved_writes == 1
    ev = sm.report.events[0]
    assert ev.kind == "unobserved_write" and ev.op == "aten.add.Tensor"


def test_in_place_view_ops_are_writes_shadow_saw():
    x = torch.randn(3, 4)
    with ShadowMode() as sm:
        y = x * 2.0
        y.t_()  # bumps y's version counter: a write through the dispatcher, not behind shadow's back
        y.unsqueeze_(0)
        y.squeeze_(0)
        y.transpose_(0, 1)
        y.as_strided_((4, 3), (1, 4))
        w = y * 3.0
    assert sm.report.coverage.unobserved_writes == 0 and sm.report.events == []
    assert torch.equal(sm.shadow_of(w), (x.double() * 2.0).t() * 3.0)  # the drift chain is not cut


def test_a_write_behind_shadows_back_is_caught_through_a_view():
    sm = ShadowMode()
    t = torch.randn(4, dtype=f64)
    with sm:
        u = t * 2.0
    u.add_(1.0)  # outside the mode
    with sm:
        v = u[1:]  # a view op reads u first
        w = v * 1.0
    assert sm.report.coverage.unobserved_writes == 1 and sm.report.events[0].op == "aten.slice.Tensor"
    assert torch.equal(sm.shadow_of(w), w)


# in-place ops that read what they write: the version counter moves once, after the op, for a write shadow saw
SELF_ALIASING = {
    "sub_": lambda t: t.sub_(t),  # the Hugging Face Trainer's tr_loss -= tr_loss
    "add_": lambda t: t.add_(t),
    "add_ alpha": lambda t: t.add_(t, alpha=2),
    "mul_": lambda t: t.mul_(t),
    "div_": lambda t: t.div_(t),
    "addcmul_": lambda t: t.addcmul_(t, t, value=0.5),
    "add out=": lambda t: torch.add(t, t, out=t),
    "mul out=": lambda t: torch.mul(t, t, out=t),
    "through a view": lambda t: t[...].add_(t),  # the view shares t's storage and version counter
}


def _aliasing_program(x, op):
    t, u = x * 1.1, x * 0.7  # round in float32: their shadows hold values the device does not
    op(t)
    t.add_(u)  # a write after it: where the version was read wrongly, t was resynced here
    t.mul_(1.3)
    return t * 2.0


@pytest.mark.parametrize("shape", [(), (5,)], ids=["0-dim", "vector"])
@pytest.mark.parametrize("name", list(SELF_ALIASING))
def test_in_place_ops_reading_their_own_output_are_writes_shadow_saw(name, shape):
    x = torch.randn(shape) + 2.0  # away from 0: div_
    with ShadowMode() as sm:
        y = _aliasing_program(x, SELF_ALIASING[name])
    assert sm.report.coverage.unobserved_writes == 0 and sm.report.events == []
    # the same program in float64 without shadow: every op an elementwise IEEE one, so bit for bit
    expected = _aliasing_program(x.double(), SELF_ALIASING[name])
    assert torch.equal(sm.shadow_of(y), expected)
    assert not torch.equal(y.double(), expected)  # the drift was kept, not resynced from the device


def test_a_write_behind_shadows_back_after_a_self_aliasing_op_is_still_caught():
    """Outside the block, with dispatch disabled, on another thread: each moves the counter through no op shadow
    saw, and is counted and resynced (numpy and DLPack writes move no counter: unseen, README)."""
    import threading

    def outside(t):
        with torch._C._DisableTorchDispatch():
            t.add_(1.0)

    def other_thread(t):  # the dispatch mode is the calling thread's
        th = threading.Thread(target=t.add_, args=(1.0,))
        th.start()
        th.join()

    for write in (outside, other_thread):
        x = torch.randn(4)
        with ShadowMode() as sm:
            t = x * 1.1
            t.sub_(t)
            t.add_(x)
            write(t)
            y = t * 3.0
        assert sm.report.coverage.unobserved_writes == 1, write
        (ev,) = sm.report.events
        assert ev.op == "aten.mul.Tensor" and "another thread" in ev.detail
        assert torch.equal(sm.shadow_of(t), t.double())  # resynced: the device's values
        assert torch.equal(sm.shadow_of(y), t.double() * 3.0)  # float32 times 3: exact in float64
        assert "outside the ShadowMode block" in sm.report.summary()


def test_no_false_unobserved_writes_in_a_training_step():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with ShadowMode() as sm:
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(5, 4)).square().mean().backward()
            opt.step()
    assert sm.report.coverage.unobserved_writes == 0


# --- attribution ---
def test_modules_and_phases():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(m.parameters(), foreach=False)
    with ShadowMode() as sm:
        m(torch.randn(5, 4)).sum().backward()
        opt.step()
    addmm = records(sm, "aten.addmm.default")
    assert [(r.module, r.phase) for r in addmm] == [("Sequential.0", "forward"), ("Sequential.2", "forward")]
    assert {r.phase for r in records(sm, "aten.mm.default")} == {"backward"}
    opt_mods = {r.module for r in sm.report.find(phase="optimizer")}
    assert {"Sequential.0.weight", "Sequential.2.bias"} <= opt_mods


# --- options and report ---
def test_options_are_validated_with_the_valid_values():
    with pytest.raises(ShadowOptionError, match="follow='dev'.*'device', 'reference'"):
        ShadowMode(follow="dev")
    with pytest.raises(ShadowOptionError, match="max_records"):
        ShadowMode(max_records=-1)
    with pytest.raises(ShadowOptionError, match="local"):
        ShadowMode(local="yes")
    with pytest.raises(TypeError):
        ShadowMode(True)  # keyword-only


def test_local_and_drift_switches():
    x = torch.randn(64)
    with ShadowMode(local=False) as sm:
        y = (x * 1.1).exp()
    assert all(r.local is None and r.drift is not None for r in sm.report.records)
    with ShadowMode(drift=False) as sm:
        y = (x * 1.1).exp()
    assert all(r.drift is None and r.local is not None for r in sm.report.records)
    # without drift shadow cannot know inputs are exact, so exp's local error comes from its own replay
    assert records(sm, "aten.exp.default")[0].local.max_ulp <= 1.0


def test_local_error_is_the_ops_own_not_the_drift():
    x = torch.arange(1.0, 101.0)
    with ShadowMode() as sm:
        s = x / 3.0  # fp32 rounds most quotients; the shadow keeps them to float64
        t = s * 2.0  # doubling is exact on the device's own input: local 0, drift inherited
    rec = records(sm, "aten.mul.Tensor")[0]
    div = records(sm, "aten.div.Tensor")[0]
    assert rec.local.max_abs == 0.0 and rec.drift.max_ulp == div.drift.max_ulp > 0.25


def test_max_records_caps_records_not_aggregates():
    with ShadowMode(max_records=3) as sm:
        x = torch.ones(3)
        for _ in range(10):
            x = x * 1.5
    assert len(sm.report.records) == 3 and sm.report.dropped_records == 8
    assert sm.report.by_op["aten.mul.Tensor"].calls == 10


def test_report_table_and_save_load_roundtrip(tmp_path):
    with ShadowMode() as sm:
        y = torch.tensor([3e38]) * 10.0  # an inf in the report survives the JSON round trip
        z = torch.randn(8, 8) @ torch.randn(8, 8)
    text = sm.report.table()
    assert text.splitlines()[0].split()[:4] == ["op", "calls", "local", "ulp"]
    assert "aten.mm.default" in text
    with pytest.raises(ValueError, match="expected one of"):
        sm.report.table(by="colour")
    path = tmp_path / "run.json"
    sm.report.save(path)
    back = shadow.load_report(path)
    assert [r.to_dict() for r in back.records] == [r.to_dict() for r in sm.report.records]
    assert back.coverage == sm.report.coverage
    assert back.table() == text
    data = path.read_text()
    from shadow.reportformat import VERSION

    assert f'"version": {VERSION}' in data
    path.write_text(data.replace(f'"version": {VERSION}', '"version": 99'))
    with pytest.raises(shadow.ReportFormatError, match="version 99"):
        shadow.load_report(path)
    path.write_text('{"format": "other"}')
    with pytest.raises(shadow.ReportFormatError, match="not a shadow report"):
        shadow.load_report(path)


def test_shadow_of_errors_are_clear():
    with ShadowMode() as sm:
        y = torch.ones(2) * 2
    with pytest.raises(KeyError, match="never seen"):
        sm.shadow_of(torch.ones(2))
    with pytest.raises(TypeError, match="not shadowed"):
        sm.shadow_of(torch.ones(2, dtype=torch.int64))
    s = sm.shadow_of(y)
    s.add_(1)  # a copy: the user cannot corrupt the mirror
    assert sm.shadow_of(y).tolist() == [2.0, 2.0]


def test_float64_device_identity_on_a_mixed_program():
    x = torch.randn(16, 8, dtype=f64, requires_grad=True)
    w = torch.randn(8, 4, dtype=f64, requires_grad=True)
    with ShadowMode() as sm:
        h = torch.tanh(x @ w)
        loss = F.log_softmax(h, -1).mean() + h.var() + torch.linalg.vector_norm(h)
        loss.backward()
    for t in (h, loss, x.grad, w.grad):
        assert same(sm, t)
    for r in sm.report.records:
        assert r.drift is None or r.drift.exact, r
    assert math.isfinite(loss.item())


def test_budget_reads_inputs_aliasing_a_written_argument_as_they_were():
    # x.add_(x, alpha=...): `other` is the written `self`; the budget's operand term must see x before the op
    from shadow.budgets import budget_for

    torch.manual_seed(0)
    x = torch.randn(1000)
    x0 = x.double()
    with ShadowMode(spot_checks="off") as sm:
        x.add_(x, alpha=1 / 3)
    r = x0 + x0 / 3
    expected = budget_for(torch.ops.aten.add_.Tensor, (x0.clone(), x0.clone()), {"alpha": 1 / 3}, [r], torch.float32)
    rec = sm.report.records[0]
    assert rec.budget.used == compare(x, sm.shadow_of(x), torch.float32, expected.bound[0]).budget_used > 0


def test_budget_reads_an_input_its_out_buffer_overwrites_as_it_was():
    from shadow.budgets import budget_for

    torch.manual_seed(0)
    x, y = torch.randn(1000), torch.randn(1000)
    x0, y0 = x.double(), y.double()
    with ShadowMode(spot_checks="off") as sm:
        torch.add(y, x, alpha=1 / 3, out=x)  # the operand term reads x, which out= overwrites
    r = y0 + x0 / 3
    expected = budget_for(torch.ops.aten.add.out, (y0, x0.clone()), {"alpha": 1 / 3, "out": x0.clone()}, [r],
                          torch.float32)
    rec = sm.report.records[0]
    assert rec.budget.used == compare(x, sm.shadow_of(x), torch.float32, expected.bound[0]).budget_used > 0


# --- records say what ran ---
def test_records_carry_the_result_dtype_and_shape_and_the_table_shows_mixed_dtypes():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with ShadowMode() as sm:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        z = y.float().softmax(-1)
    (mm,) = records(sm, "aten.addmm.default")
    (soft,) = records(sm, "aten._softmax.default")
    assert (mm.dtype, mm.shape, soft.dtype, soft.shape) == ("torch.bfloat16", (3, 4), "torch.float32", (3, 4))
    assert str(mm.phase) == "forward" and mm.kind is shadow.Kind.REPLAYED
    head = sm.report.table().splitlines()[0].split()
    assert head[:3] == ["op", "calls", "dtype"]
    row = next(line.split() for line in sm.report.table().splitlines() if line.startswith("aten._to_copy"))
    assert row[2] == "bfloat16/float32"  # the casts into and out of autocast
    with ShadowMode() as sm1:
        torch.randn(4) * 2.0
    assert "dtype" not in sm1.report.table().splitlines()[0]  # one dtype: no column


def test_reports_of_format_version_3_still_load(tmp_path):
    with ShadowMode() as sm:
        torch.randn(8, 8) @ torch.randn(8, 8)
    d = sm.report.to_dict()
    rec = d["records"][-1]
    assert rec["dtype"] == "torch.float32" and rec["budget"]["family"] == "matmul"
    # version 3: no dtype and shape, the budget family under "kind", over_budget_calls as "over_budget"
    d["version"] = 3
    for r in d["records"]:
        del r["dtype"], r["shape"]
        if r["budget"] is not None:
            r["budget"]["kind"] = r["budget"].pop("family")
    for table in (d["by_op"], d["by_module"]):
        for agg in table.values():
            agg["over_budget"] = agg.pop("over_budget_calls")
            del agg["dtypes"]
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(d))
    back = shadow.load_report(path)
    assert back.records[-1].budget.family == "matmul" and back.records[-1].budget.used == sm.report.records[-1].budget.used
    assert back.records[-1].dtype == "" and back.by_op["aten.mm.default"].over_budget_calls == 0


def test_a_compiled_module_is_judged_and_never_leaves_a_wrong_shadow(request):
    """torch.compile(model) under ShadowMode: where this torch shows shadow its compiled graphs (2.4 and 2.13:
    shadow.compiled), each call of the model's graph is one record and no warning is raised; elsewhere dynamo
    skips compiled frames under the mode, and one ShadowWarning says the model ran eagerly. Either way the shadow
    downstream is the float64 value."""
    from shadow import _compat

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    x = torch.randn(5, 4)
    want = m(x)
    compiled = torch.compile(m)
    shown = _compat.compiled_graph_operator() is not None or not _compat.compile_skips_dispatch_modes()
    flushing = math.ldexp(1.0, -1074) == 0.0
    request.addfinalizer(lambda: torch.set_flush_denormal(flushing))  # torch 2.4's compile leaves it on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ShadowMode() as sm:
            y = compiled(x)
            y = compiled(x)
            z = y * 2.0
    warned = [w for w in caught if w.category is shadow.ShadowWarning]
    if shown:
        assert not warned and sm.report.coverage.compiled == {}
        assert len([r for r in sm.report.records if r.op.startswith("compiled.graph")]) == 2
    else:  # the eager kernels: the same bits as the uncompiled module, every op shadowed
        assert len(warned) == 1 and sm.report.coverage.compiled == {"Sequential": 2}
        assert torch.equal(y, want) and len(records(sm, "aten.tanh.default")) == 2
    expected = (x.double() @ m[0].weight.double().T + m[0].bias.double()).tanh()
    assert torch.allclose(sm.shadow_of(y), expected, rtol=0, atol=1e-15)
    assert torch.equal(sm.shadow_of(z), sm.shadow_of(y) * 2.0)
    assert not any(h for h in (m._forward_hooks, compiled._forward_hooks))  # hooks removed at exit


def test_malformed_reports_say_what_is_wrong_and_where(tmp_path):
    with ShadowMode() as sm:
        torch.randn(4, 4) @ torch.randn(4, 4)
    good = sm.report.to_dict()
    path = tmp_path / "r.json"

    def load(d):
        path.write_text(json.dumps(d))
        return shadow.load_report(path)

    cases = []
    bad = copy.deepcopy(good)
    del bad["records"][0]["op"]
    cases.append((bad, r"records\[0\]: .*'op'"))
    bad = copy.deepcopy(good)
    last = len(bad["records"]) - 1  # the matmul's record: it has a local error
    bad["records"][last]["local"]["colour"] = 1
    cases.append((bad, rf"records\[{last}\]\.local: unknown field 'colour'"))
    bad = copy.deepcopy(good)
    bad["records"][0]["kind"] = "teleported"
    cases.append((bad, r"records\[0\]\.kind: the string 'teleported' is not a valid Kind"))
    bad = copy.deepcopy(good)
    bad["by_op"]["aten.mm.default"]["calls"] = {"x": 1}
    bad["by_op"]["aten.mm.default"]["colour"] = 1
    cases.append((bad, r"by_op\['aten.mm.default'\]: .*colour"))
    bad = copy.deepcopy(good)
    bad["records"] = {}
    cases.append((bad, "records: expected a list"))
    bad = copy.deepcopy(good)
    del bad["coverage"]["calls"], bad["meta"]
    cases.append((bad, "the report: missing field 'meta'"))
    bad = copy.deepcopy(good)
    del bad["cells"][0]["callsite"]
    cases.append((bad, r"cells\[0\]: missing field 'callsite'"))
    cases.append((dict(good, version=VERSION + 1), "written by a newer shadow"))
    cases.append(([1, 2], "expected a JSON object"))
    for d, says in cases:
        with pytest.raises(shadow.ReportFormatError, match=says):
            load(d)
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(shadow.ReportFormatError, match="not UTF-8"):
        shadow.load_report(path)


def test_an_aggregate_keeps_the_worst_figures_and_leaves_nans_out():
    """Aggregate.add folds each call's figures as max() and min() would, a NaN figure (a call whose scale is not
    finite: effective bits nan) left out, and default budgets counted apart."""
    from shadow.metrics import ErrorStats
    from shadow.records import BudgetInfo, Kind, Phase, Record
    nan = math.nan
    calls = [  # (local max_ulp, max_ulp_nonzero, max_abs, effective_bits, drift rel_norm, drift max_ulp, used, default)
        (0.5, None, 1e-7, 23.0, 1e-8, 0.5, 0.25, False),
        (nan, None, nan, nan, nan, nan, nan, False),
        (3.0, 1.5, 2e-6, 21.5, 4e-7, 7.0, 1.5, False),
        (9.0, None, 5e-6, 12.0, 1e-6, 2.0, 9.0, True),  # a default budget: no evidence
        (1.0, None, 1e-7, 22.0, 2e-8, 1.0, 0.5, False),
    ]
    agg = shadow.Aggregate()
    for i, (ulp, nonzero, mabs, bits, rel, dulp, used, default) in enumerate(calls):
        local = ErrorStats(max_abs=mabs, max_ulp=ulp, n=4, effective_bits=bits, max_ulp_nonzero=nonzero,
                           zero_reference=int(nonzero is not None))
        agg.add(Record(i, "aten.mul.Tensor", "", Phase.OTHER, Kind.REPLAYED, local=local,
                       drift=ErrorStats(max_ulp=dulp, rel_norm=rel, n=4), budget=BudgetInfo("elementwise", used, default),
                       dtype="torch.float32"))
    assert (agg.calls, agg.budgeted_calls, agg.over_budget_calls, agg.zero_reference_calls) == (5, 4, 1, 1)
    assert (agg.max_local_ulp, agg.max_local_ulp_nonzero, agg.max_local_abs) == (9.0, 9.0, 5e-6)
    assert (agg.max_drift_rel, agg.max_drift_ulp, agg.max_budget_used) == (1e-6, 7.0, 1.5)
    assert agg.min_effective_bits == 21.5  # the default budget's 12 bits are no evidence; nan is left out
    assert agg.dtypes == {"torch.float32": 5} and agg.kinds == {Kind.REPLAYED: 5}


def test_kept_records_are_out_of_the_collectors_lists_and_freed_with_their_report():
    """Kept records and their figures are untracked by the garbage collector (their pile set off its full
    collections: benchmarks/records_gc.py), and still freed with their report."""
    import gc
    import tracemalloc

    x = torch.randn(4)

    def run() -> ShadowMode:
        with ShadowMode(spot_checks="off") as sm:
            y = x
            for _ in range(3000):
                y = y * 1.0001
        return sm

    sm = run()
    rec = sm.report.records[-1]
    assert rec.local is not None and rec.drift is not None and rec.budget is not None
    assert not any(gc.is_tracked(o) for o in (rec, rec.local, rec.drift, rec.budget))
    del sm, rec
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        sm = run()
        assert len(sm.report.records) == 3000
        held = tracemalloc.get_traced_memory()[0] - base
        del sm
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held > 3000 * 300  # a record and its figures: several hundred bytes
    assert left < held / 20, (held, left)


def test_reports_of_format_versions_1_and_2_load():
    with ShadowMode() as sm:
        torch.randn(4, 4) @ torch.randn(4, 4)
    d = sm.report.to_dict()
    for r in d["records"]:  # version 1: records without spot checks, budgets, CPU comparisons, dtype, shape
        for name in ("spot", "budget", "cpu_fallback", "cpu", "dtype", "shape"):
            del r[name]
    for agg in (*d["by_op"].values(), *d["by_module"].values()):
        for name in ("max_budget_used", "over_budget_calls", "min_effective_bits", "spot_checked", "spot_untrusted",
                     "dtypes"):
            del agg[name]
    for version in (1, 2):
        back = shadow.Report.from_dict(dict(d, version=version))
        assert back.records[-1].op == "aten.mm.default" and back.records[-1].budget is None
        assert back.by_op["aten.mm.default"].calls == 1


def test_report_queries_validate_and_accept_short_names():
    with ShadowMode() as sm:
        a = torch.randn(4, 4)
        b = a @ a
        unjudged.unjudged(b)  # no budget rule: a default budget, no evidence
    rep = sm.report
    assert [r.op for r in rep.find(op="mm")] == [r.op for r in rep.find(op="aten.mm")] == ["aten.mm.default"]
    assert rep.find(op="m") == [] and len(rep.find(op="aten.mm.default", phase="other")) == 1
    with pytest.raises(ValueError, match="'forward', 'backward', 'optimizer', 'other'"):
        rep.find(phase="fwd")
    for top in (-1, 1.5, True):
        with pytest.raises(ValueError, match="int >= 0"):
            rep.table(top=top)
    assert len(rep.table(top=0).splitlines()) == 2  # the header and its rule
    rows = {line.split()[0]: line.split() for line in rep.table().splitlines()[2:]}
    assert rows[unjudged.NAME][3] == "?"  # only a default budget (a guess): not a perfect 0, not "none"
    assert rows["aten.mm.default"][3] not in "-?" and rep.by_op[unjudged.NAME].budgeted_calls == 0
    assert rep.by_op[unjudged.NAME].guessed_calls == 1


def test_exact_zero_references_are_flagged_not_read_as_1e44_ulp():
    # float32 sums 1e8 + 1 - 1e8 - 1 to -1 in this order (1e8 + 1 rounds to 1e8), to 0 where 1e8 - 1e8 comes
    # first; the exact value, and float64's in any order, is 0. The BLAS kernel's order decides (an AMD EPYC gave
    # -1, an AVX-512 Xeon 0): the terms go in the first order this machine's kernel does not sum to 0
    w = torch.ones(4, 1)
    orders = [torch.tensor([list(p)] * 3) for p in itertools.permutations([1e8, 1.0, -1e8, -1.0])]
    x = next((x for x in orders if bool((x @ w != 0).all())), None)
    if x is None:
        pytest.skip("this BLAS sums 1e8, 1, -1e8, -1 to 0 in every order: no float32 result with an error")
    with ShadowMode() as sm:
        y = x @ w
    err = float(y.abs().max())
    assert err >= 1.0 and bool((y != 0).all())
    (rec,) = records(sm, "aten.mm.default")
    # the ulp at an exact 0 is float32's subnormal spacing 2**-149: 1 / 2**-149 = 7.1e44, by definition
    assert rec.local.max_ulp == err * 2.0**149 and rec.local.max_abs == err
    assert rec.local.zero_reference == 3 and rec.local.max_ulp_nonzero == 0.0  # every element: reference 0
    assert 0 < rec.budget.used < 0.05 * err  # gamma_4 * sum|terms| = 4 * 2**-24 * 2e8 / (1 - ...) ~ 48: 1.0 is 2 %
    row = next(line for line in sm.report.table().splitlines() if line.startswith("aten.mm.default"))
    assert row.split()[2:4] == ["0", "z"] and "e+44" not in row
    back = shadow.Report.from_dict(json.loads(json.dumps(sm.report.to_dict())))
    assert back.records[-1].local.zero_reference == 3 and back.by_op["aten.mm.default"].zero_reference_calls == 1


# --- where NaN/Inf is born ---
def test_nonfinite_origin_tells_a_math_nan_from_a_precision_one():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.log(self.fc(x)).sum()  # some outputs of fc are negative: log gives NaN in any precision

    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    with ShadowMode() as sm:
        loss = net(x)
        loss.backward()
    assert math.isnan(loss.item()) and math.isnan(sm.shadow_of(loss).item())
    assert sm.report.first_nonfinite() is None  # device and shadow agree: no disagreement to report...
    origin = sm.report.nonfinite_origin()  # ...but the NaN was born somewhere
    assert (origin.op, origin.module, origin.nonfinite_cause) == ("aten.log.default", "Net", "math")
    assert records(sm, "aten.sum.default")[0].nonfinite_cause == "propagated"

    logits = torch.tensor([[100.0, 1.0], [1.0, 2.0]])  # exp(100) overflows float32, not float64
    with ShadowMode() as sm:
        e = torch.exp(logits)
        p = e / e.sum(-1, keepdim=True)
    origin = sm.report.nonfinite_origin()
    assert (origin.op, origin.nonfinite_cause, origin.local.nonfinite_device) == ("aten.exp.default", "precision", 1)
    assert [r.nonfinite_cause for r in records(sm, "aten.div.Tensor")] == ["propagated"]
    assert torch.isfinite(sm.shadow_of(p)).all() and p.isnan().sum() == 1


def test_nonfinite_inputs_from_outside_are_not_an_origin():
    x = torch.tensor([1.0, float("nan"), 3.0])  # the user's data holds a NaN before shadow sees it
    with ShadowMode() as sm:
        y = x * 2.0
        z = y.sum()
    assert [r.nonfinite_cause for r in sm.report.records] == ["propagated", "propagated"]
    assert sm.report.nonfinite_origin() is None


def test_a_budget_rule_that_fails_lazily_costs_the_budget_not_the_op():
    from shadow import budgets

    def broken(c):
        return c.budget(lambda: 1 / 0)  # the bound is built lazily, when first read

    x = torch.randn(64)
    with budgets.BUDGETS.scoped():
        # no rule of its own: the default budget otherwise
        budgets.register_budget(unjudged.OP, family="elementwise")(broken)
        with ShadowMode() as sm:
            y = unjudged.unjudged(x)
    (rec,) = records(sm, unjudged.NAME)
    assert rec.kind == "replayed" and rec.local is not None and rec.budget is None
    assert torch.equal(sm.shadow_of(y), unjudged.unjudged(x.double()))  # judged no further: shadowed still
    assert "ZeroDivisionError" in sm.report.coverage.unsupported[f"budget of {unjudged.NAME}"]
    assert sm.report.coverage.internal_errors == 1


# --- the direct path (shadow.engine.outputs.direct_outputs) ---
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"local": False, "budgets": False, "spot_checks": "off"}])
def test_direct_path_concludes_as_the_general_path(dtype, options, monkeypatch):
    """A training step whose outputs are read by the direct builder where it may, and by the general one for
    every call (the direct builder turned off), gives the same records to the last bit and the same shadows: both
    builders make the same ``Outputs``, which one conclusion path judges and commits."""
    from shadow.engine import conclude

    direct_outputs = conclude.direct_outputs

    def run(general: bool, concluded: list | None = None):
        def builder(*a):
            outputs = None if general else direct_outputs(*a)
            if concluded is not None:
                concluded.append(outputs is not None)
            return outputs

        monkeypatch.setattr(conclude, "direct_outputs", builder)
        torch.manual_seed(0)
        model = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True).to(dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(2, 8, 16, dtype=dtype)
        with ShadowMode(**options) as sm:
            for _ in range(3):
                loss = model(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        return sm, loss, [p for p in model.parameters()]

    concluded = []
    counted, _, _ = run(False, concluded)
    assert sum(concluded) > len(counted.report.records) / 3  # views, .item() and spot-checked calls take the other
    concluded.clear()
    run(True, concluded)
    assert not any(concluded)
    direct, loss_d, params_d = run(False)
    general, loss_g, params_g = run(True)
    assert torch.equal(loss_d, loss_g)
    rd, rg = direct.report.records, general.report.records
    assert len(rd) == len(rg) > 600
    assert [r.to_dict() for r in rd] == [r.to_dict() for r in rg]
    assert sum(r.drift is not None and r.drift.max_abs > 0 for r in rd) > 50  # real figures, not zeros alike
    assert torch.equal(direct.shadow_of(loss_d), general.shadow_of(loss_g))
    for a, b in zip(params_d, params_g):
        assert torch.equal(direct.shadow_of(a), general.shadow_of(b))


def test_engine_hooks_see_each_judged_call_and_are_checked():
    from shadow.engine import EngineHooks

    seen = []
    x = torch.randn(3)
    with ShadowMode(hooks=EngineHooks(observe=lambda rec, outputs, p: seen.append((rec.op, len(outputs))))) as sm:
        y = x * 3.0
        torch.randn(2)  # random: adopted, not judged
    assert seen == [("aten.mul.Tensor", 1)] and len(sm.report.records) == 2
    assert torch.equal(sm.shadow_of(y), x.double() * 3.0)
    with pytest.raises(TypeError, match="expected a shadow.engine.EngineHooks"):
        ShadowMode(hooks=lambda rec: None)
    with pytest.raises(ValueError, match="ShadowMode's own"):
        ShadowMode(hooks=EngineHooks(recorded=lambda rec, result: None))
    with pytest.raises(ValueError, match="world given twice"):
        EngineHooks(world=lambda *at: None).merged(EngineHooks(world=lambda *at: "exact"))
