"""shadow.scratch: the pooled upcasts of the local replay's inputs are the exact copies ``.to`` makes, and a
buffer is handed out again only once nothing refers to it."""

import pytest
import torch

import shadow.engine as engine
import shadow.scratch as scratch
from shadow import ShadowMode
from shadow.scratch import MIN_BYTES, Scratch

f64 = torch.float64
CPU = torch.device("cpu")
BIG = MIN_BYTES // 8 + 1000  # float64 elements: just above the pool's threshold


@pytest.mark.parametrize("make", [
    lambda: torch.randn(BIG),
    lambda: torch.randn(BIG // 100, 100).t(),  # a transpose: .to keeps its strides, and so must the copy
    lambda: torch.randn(BIG // 50, 100)[:, ::2],  # not dense: .to makes it contiguous
    lambda: torch.randn(BIG, dtype=torch.bfloat16),
    lambda: torch.randn(BIG // 2, dtype=torch.complex64).conj(),
], ids=["flat", "transposed", "strided", "bfloat16", "complex-conj"])
def test_a_pooled_upcast_is_the_copy_to_makes(make):
    t = make()
    dtype = torch.complex128 if t.is_complex() else f64
    expected = t.to(dtype, copy=True)
    pool = Scratch()
    pool.set_limit(1 << 40)
    got = pool.copy(t, dtype, CPU)
    assert torch.equal(got, expected)
    assert got.stride() == expected.stride() and got.dtype == dtype and not got.is_conj()
    assert pool.held == got.untyped_storage().nbytes()  # pooled, not a plain allocation


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
    pool = Scratch()
    pool.set_limit(1 << 40)
    x = torch.randn(BIG)
    a = pool.copy(x, f64, CPU)
    b = pool.copy(x, f64, CPU)
    assert a.data_ptr() != b.data_ptr()  # a is alive: its memory is not handed out twice
    view = a[10:20]  # a view keeps the storage in use after the tensor itself is gone
    ptr = a.data_ptr()
    del a
    c = pool.copy(x * 2, f64, CPU)
    assert c.data_ptr() not in (ptr, b.data_ptr())
    assert torch.equal(view, x[10:20].double())  # the view's values survived the later upcasts
    del view
    d = pool.copy(x * 3, f64, CPU)
    assert d.data_ptr() == ptr and torch.equal(d, (x * 3).double())
    assert pool.held == 3 * BIG * 8


def test_the_pool_holds_at_most_its_limit_and_small_tensors_never():
    pool = Scratch()
    pool.set_limit(BIG * 8)
    small = torch.randn(1000)
    assert torch.equal(pool.copy(small, f64, CPU), small.double()) and pool.held == 0
    x = torch.randn(BIG)
    kept = pool.copy(x, f64, CPU)
    assert pool.held == BIG * 8
    over = pool.copy(x, f64, CPU)  # the pool is full and its buffer in use: a plain allocation
    assert pool.held == BIG * 8 and torch.equal(over, kept)
    del kept, over
    pool.set_limit(2 * BIG * 8)
    pool.copy(torch.randn(2 * BIG), f64, CPU)  # a larger one evicts the free smaller one
    assert pool.held == 2 * BIG * 8
    e = pool.empty_like(torch.empty(BIG, 2, dtype=torch.float32).t(), f64)  # empty_like's layout: transposed
    assert e.shape == (2, BIG) and e.stride() == (1, 2) and e.dtype == f64 and pool.held == 2 * BIG * 8
    pool.set_limit(0)  # a lower limit lets go of free storages only
    assert pool.held == 2 * BIG * 8
    del e
    pool.set_limit(0)
    assert pool.held == 0


def test_pooled_inputs_give_the_figures_of_plain_ones(monkeypatch):
    """A training step whose tensors are above the threshold: the same records with and without the pool."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(BIG // 1000 + 1, 1000))
    x = torch.randn(64, 1000)
    opt = torch.optim.Adam([w], lr=1e-3)

    def step():
        opt.zero_grad()
        (x @ w.t()).square().mean().backward()
        opt.step()

    def run():
        w.data.copy_(w0)
        opt.state.clear()
        with ShadowMode(spot_checks="off") as sm:
            for _ in range(2):
                step()
            kept = sm.memory()
            (w * 2).sum()  # an op call: the pool trims to the share of the shadows now alive
            trimmed = sm.memory()
        assert sm.memory()["scratch_bytes"] == 0  # let go on exit
        return kept, trimmed, [(r.op, r.local and r.local.to_dict(), r.drift and r.drift.to_dict())
                               for r in sm.report.records]

    w0 = w.detach().clone()
    kept, trimmed, pooled = run()
    assert kept["scratch_bytes"] >= w.numel() * 8  # Adam's upcasts of w, its gradient, its states
    assert trimmed["scratch_bytes"] <= scratch.SHARE * trimmed["shadow_bytes"]
    monkeypatch.setattr(scratch, "MIN_BYTES", 1 << 62)
    kept, _, plain = run()
    assert kept["scratch_bytes"] == 0
    assert pooled == plain


def test_the_pool_stays_within_max_shadow_bytes(monkeypatch):
    """With a cap on the shadows, the pool only takes what the cap leaves beside them."""
    monkeypatch.setattr(engine, "SCRATCH_SHARE", 100.0)  # the share alone would let the pool take any temporary
    torch.manual_seed(0)
    x = torch.randn(BIG)
    for room in (BIG * 8 // 2, 4 * BIG * 8):
        with ShadowMode(spot_checks="off", max_shadow_bytes=3 * BIG * 8 + room) as sm:  # x, y, z's shadows + room
            y = x * 1.5
            z = (y + x).exp()  # the local replays' upcasts of y and x, then of y + x (a buffer reused)
            kept = sm.memory()["scratch_bytes"]
        assert kept == 0 if room < BIG * 8 else 0 < kept <= room
        assert sm.report.records[-1].local.max_ulp <= 4  # exp's local error, measured from pooled inputs


def test_without_use_counts_nothing_is_pooled(monkeypatch):
    """A torch without storage use counts cannot tell a free buffer: plain copies, the same values."""
    monkeypatch.setattr(scratch, "_use_count", None)
    pool = Scratch()
    pool.set_limit(1 << 40)
    x = torch.randn(BIG)
    assert torch.equal(pool.copy(x, f64, CPU), x.double()) and pool.empty_like(x, f64).dtype == f64
    assert pool.held == 0


def test_a_buffer_a_replay_resizes_is_counted_at_its_new_size():
    """An out= replay may grow its (pooled) output: the pool counts what its storages hold now."""
    pool = Scratch()
    pool.set_limit(1 << 40)
    a = pool.copy(torch.randn(BIG), f64, CPU)
    a.resize_(2 * BIG)
    assert pool.held == 2 * BIG * 8
    del a
    pool.set_limit(0)
    assert pool.held == 0
