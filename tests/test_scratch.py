"""shadow.scratch: the pooled upcasts of the local replay's inputs are the exact copies ``.to`` makes, and a
buffer is handed out again only once nothing refers to it."""

import math

import pytest
import torch
import torch.nn.functional as F

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


def test_the_pool_holds_at_most_each_sizes_peak_and_small_tensors_never():
    pool = Scratch()
    small = torch.randn(1000)
    assert torch.equal(pool.copy(small, f64, CPU), small.double()) and pool.held == 0
    x = torch.randn(BIG)
    kept = pool.copy(x, f64, CPU)
    over = pool.copy(x, f64, CPU)  # the first is in use: a second storage
    assert pool.held == pool.peak == 2 * BIG * 8 and pool.idle == 0 and torch.equal(over, kept)
    del kept, over
    assert pool.idle == 2 * BIG * 8  # idle, kept for later calls: the pool had both in use at once
    pool.set_limit(math.inf)
    assert pool.held == 2 * BIG * 8
    big = pool.copy(torch.randn(4 * BIG), f64, CPU)  # fits neither: another size, whose idle x-sized ones stay
    assert pool.held == pool.peak == 6 * BIG * 8 and pool.idle == 2 * BIG * 8
    del big
    three = [pool.copy(x, f64, CPU) for _ in range(3)]  # two reused, a third new: only x's size grows its peak
    assert pool.held == pool.peak == 7 * BIG * 8 and pool.idle == 4 * BIG * 8
    del three
    e = pool.empty_like(torch.empty(BIG, 2, dtype=torch.float32).t(), f64)  # empty_like's layout: transposed
    assert e.shape == (2, BIG) and e.stride() == (1, 2) and e.dtype == f64 and pool.held == 7 * BIG * 8
    pool.set_limit(0)  # a limit on the idle bytes lets go of idle storages only
    assert pool.held == 4 * BIG * 8  # e's, the 4 * BIG storage
    del e
    pool.set_limit(0)
    assert pool.held == 0


def test_one_sizes_idle_buffers_are_not_let_go_to_make_room_for_anothers():
    """A step whose phases need buffers of different sizes (the LM-shaped benchmark's logits, then its
    optimizer's parameter-sized upcasts) reuses the same storages every step: with one budget for all sizes,
    each phase let the other's idle buffers go and the next step page-faulted fresh ones in."""
    pool = Scratch()
    small, large = torch.randn(BIG), torch.randn(5 * BIG)

    def phase(x: torch.Tensor, n: int) -> set[int]:
        return {t.data_ptr() for t in [pool.copy(x, f64, CPU) for _ in range(n)]}  # idle again on return

    def step() -> set[int]:
        return phase(large, 2) | phase(small, 3)

    first = step()
    assert step() == step() == first and len(first) == 5
    assert pool.held == pool.peak == 13 * BIG * 8 and pool.idle == pool.held


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
            pool = sm._engine.scratch
            assert pool.held <= pool.peak
        assert sm.memory()["scratch_bytes"] == 0  # let go on exit
        return kept, [(r.op, r.local and r.local.to_dict(), r.drift and r.drift.to_dict()) for r in sm.report.records]

    w0 = w.detach().clone()
    kept, pooled = run()
    assert kept["scratch_bytes"] >= w.numel() * 8  # Adam's upcasts of w, its gradient, its states
    monkeypatch.setattr(scratch, "MIN_BYTES", 1 << 62)
    kept, plain = run()
    assert kept["scratch_bytes"] == 0
    assert pooled == plain


def test_the_pool_stays_within_max_shadow_bytes():
    """With a cap on the shadows, the pool only takes what the cap leaves beside them."""
    torch.manual_seed(0)
    x = torch.randn(BIG)
    for room in (BIG * 8 // 2, 4 * BIG * 8):
        # the shadows of x, y, y + x (dead, counted until the mirror's next sweep) and z, and the room
        cap = 4 * BIG * 8 + room
        with ShadowMode(spot_checks="off", max_shadow_bytes=cap) as sm:
            y = x * 1.5
            z = (y + x).exp()  # the local replays' upcasts of y and x, then of y + x (a buffer reused)
            x[:4] * 2  # an op call: the pool trims its idle storages to the room left
            idle = sm._engine.scratch.idle
            mem = sm.memory()  # the sweep lets y + x's shadow go: its pooled storage is idle, the room larger
        assert idle <= room and mem["scratch_bytes"] <= cap - mem["shadow_bytes"]
        assert (idle > 0) == (room >= BIG * 8)
        exp = next(r for r in sm.report.records if r.op == "aten.exp.default")
        assert exp.local.max_ulp <= 4  # exp's local error, measured from pooled inputs


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


N = MIN_BYTES // 8 // 512 + 8  # rows of 512 float64: a result just above the pool's threshold
aten = torch.ops.aten


V = MIN_BYTES // 8 // 64 + 8  # rows of an embedding of width 64: a float64 gradient just above the threshold


@pytest.mark.parametrize("func, make", [
    (aten.mm.default, lambda: (torch.randn(N, 64, dtype=f64), torch.randn(512, 64, dtype=f64).t())),
    (aten.add.Tensor, lambda: (torch.randn(N, 512, dtype=f64), torch.randn(512, dtype=f64))),
    (aten.mul.Tensor, lambda: (torch.randn(512, N, dtype=f64).t(), torch.randn(N, 1, dtype=f64))),  # transposed
    (aten.div.Tensor, lambda: (torch.randn(N, 512, dtype=f64), torch.rand(N, 512, dtype=f64) + 0.5)),
    (aten.sqrt.default, lambda: (torch.rand(N, 512, dtype=f64),)),
    (aten._log_softmax.default, lambda: (torch.randn(N, 512, dtype=f64), 1, False)),
    (aten.cat.default, lambda: ([torch.randn(N // 2, 512, dtype=f64), torch.randn(N - N // 2, 512, dtype=f64)],)),
    (aten.where.self, lambda: (torch.rand(N, 512) > 0.5, torch.randn(N, 512, dtype=f64), torch.zeros((), dtype=f64))),
    # out= arguments named grad_input
    (aten.threshold_backward.default, lambda: (torch.randn(N, 512, dtype=f64), torch.randn(N, 512, dtype=f64), 0.0)),
    (aten.nll_loss_backward.default, lambda: (torch.tensor(0.5, dtype=f64), torch.randn(N, 512, dtype=f64),
                                              torch.randint(0, 512, (N,)), None, 1, -100,
                                              torch.tensor(3.0, dtype=f64))),
    (aten._softmax_backward_data.default, lambda: (torch.randn(N, 512, dtype=f64), torch.rand(N, 512, dtype=f64),
                                                   1, f64)),
    # no out= kernel of its own: written by a composition (table.WRITERS)
    (aten.embedding_dense_backward.default, lambda: (torch.randn(2, 96, 64, dtype=f64), _indices(), V, -1, False)),
    (aten.embedding_dense_backward.default, lambda: (torch.randn(2, 96, 64, dtype=f64), _indices(), V, 7, False)),
], ids=["mm", "add", "mul-transposed", "div", "sqrt", "log_softmax", "cat", "where", "threshold_backward",
        "nll_loss_backward", "softmax_backward", "embedding_backward", "embedding_backward-padding"])
def test_a_large_replay_result_in_pooled_memory_is_the_kernels_own(func, make):
    """default_rule writes a large CPU result into pooled memory through the op's out= overload, or a composition
    for an op without one: the values, bit for bit, and the strides of the result the kernel allocates itself."""
    from shadow.plan import plan_of
    from shadow.replay.table import Replay, default_rule

    args = make()
    expected = func(*args)
    pool = Scratch()
    kind, got = default_rule(Replay(plan_of(func), list(args), {}, expected.float(), scratch=pool))
    assert torch.equal(got, expected) and got.stride() == expected.stride() and got.dtype == expected.dtype
    assert pool.held >= expected.numel() * expected.element_size()  # from the pool
    del got
    assert pool.idle == pool.held  # idle once the result is gone: the next large result reuses it


def _indices() -> torch.Tensor:
    """Indices of a batch of 2 x 96 tokens: repeated ones (their rows sum in index order), the padding index 7
    among them, and the last row."""
    idx = torch.randint(0, V, (2, 96))
    idx[0, :8] = 3
    idx[1, :4] = 7
    idx[1, -1] = V - 1
    return idx


def test_embedding_gradients_scaled_by_frequency_allocate_as_before():
    """embedding_dense_backward's composition leaves scale_grad_by_freq to the kernel (1 / count per row)."""
    from shadow.plan import plan_of
    from shadow.replay.table import Replay, default_rule

    func = aten.embedding_dense_backward.default
    args = (torch.randn(2, 96, 64, dtype=f64), _indices(), V, -1, True)
    pool = Scratch()
    expected = func(*args)
    kind, got = default_rule(Replay(plan_of(func), list(args), {}, expected.float(), scratch=pool))
    assert torch.equal(got, expected) and pool.idle == pool.held  # the buffer taken is let go unused


def test_replays_without_an_out_kernel_of_their_own_allocate_as_before():
    """roll's out= overload is torchgen's (allocate, then copy): not worth a pooled result."""
    from shadow.plan import plan_of
    from shadow.replay.table import Replay, default_rule

    func = aten.roll.default
    args = (torch.randn(N, 512, dtype=f64), [3], [0])
    pool = Scratch()
    expected = func(*args)
    kind, got = default_rule(Replay(plan_of(func), list(args), {}, expected.float(), scratch=pool))
    assert torch.equal(got, expected) and pool.held == 0


def test_an_out_kernel_that_refuses_leaves_the_replay_to_the_kernels_own_result(monkeypatch):
    from shadow.plan import plan_of
    from shadow.replay import table
    from shadow.replay.table import Replay, default_rule

    def refusing(*args, **kwargs):
        raise RuntimeError("out= refused")

    a, b = torch.randn(N, 512, dtype=f64), torch.randn(512, dtype=f64)
    with table.WRITERS.scoped():
        table.WRITERS.register(aten.add.Tensor)(refusing)
        kind, got = default_rule(Replay(plan_of(aten.add.Tensor), [a, b], {}, (a + b).float(), scratch=Scratch()))
    assert kind is table.Kind.REPLAYED and torch.equal(got, a + b)


def _written(monkeypatch) -> list:
    """(op, result) of each call whose result a rule of ``table.WRITERS`` wrote into pooled memory."""
    from shadow.replay import table

    written = []
    run_chain = table.run_chain

    def spy(chain, plan, out, args, kwargs):
        result = run_chain(chain, plan, out, args, kwargs)
        if result is not NotImplemented:
            written.append((plan.func, result))
        return result

    monkeypatch.setattr(table, "run_chain", spy)
    return written


def test_a_bound_that_runs_the_op_on_magnitudes_takes_its_result_from_the_pool(monkeypatch):
    """The embedding gradient's bound runs the op on |grad| (``BudgetCall.call_with``): the same bound with and
    without a pool, and the op's result in pooled memory."""
    from shadow.budgets import budget_for

    func = aten.embedding_dense_backward.default
    args = (torch.randn(2, 96, 64, dtype=f64), _indices(), V, -1, False)
    r = func(*args)
    plain = budget_for(func, args, {}, [r], torch.float32).bound[0]
    written = _written(monkeypatch)
    pooled = budget_for(func, args, {}, [r], torch.float32, scratch=Scratch()).bound[0]
    calls = [result for op, result in written if op is func]
    assert torch.equal(pooled, plain) and len(calls) == 1 and torch.equal(calls[0], func(args[0].abs(), *args[1:]))


BACKWARDS = {  # a function of a large float64 x whose backward runs kernels that write into out= grad_input
    "gelu": lambda x: F.gelu(x), "gelu-tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": F.relu, "hardtanh": F.hardtanh,
    "leaky_relu": F.leaky_relu, "elu": F.elu, "softplus": F.softplus, "logsigmoid": F.logsigmoid,
    "hardsigmoid": F.hardsigmoid, "glu": lambda x: F.glu(x, -1), "logit": lambda x: torch.logit(x.sigmoid(), 1e-6),
    "softmax": lambda x: x.softmax(-1), "mse": lambda x: F.mse_loss(x, x.detach().flip(0)),
    "smooth_l1": lambda x: F.smooth_l1_loss(x, x.detach().flip(0)),
    "huber": lambda x: F.huber_loss(x, x.detach() * 0.5),
    "bce": lambda x: F.binary_cross_entropy(x.sigmoid(), x.detach().sigmoid().flip(0)),
    "nll": lambda x: F.nll_loss(x.log_softmax(-1), torch.arange(x.shape[0]) % x.shape[-1]),
    "avg_pool2d": lambda x: F.avg_pool2d(x.view(4, 1, -1, 64), 3, 2, 1),
    "max_pool2d": lambda x: F.max_pool2d(x.view(4, 1, -1, 64), 3, 2, 1),
    "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x.view(4, 1, -1, 64), (33, 17)),
    "upsample_nearest2d": lambda x: F.interpolate(x.view(4, 1, -1, 64), scale_factor=(1.0, 2.0)),
    "reflection_pad2d": lambda x: F.pad(x.view(4, 1, -1, 64), (2, 3, 1, 1), mode="reflect"),
    "replication_pad2d": lambda x: F.pad(x.view(4, 1, -1, 64), (2, 3, 1, 1), mode="replicate"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BACKWARDS))
def test_backward_kernels_writing_into_pooled_memory_give_the_devices_bits(name, monkeypatch):
    """A float64 CPU device: the shadow replays each backward kernel on the device's own values, into pooled memory
    through its out= grad_input overload; the result is the device's, bit for bit (drift 0)."""
    written = _written(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(MIN_BYTES // 8 // 64 + 64, 64, dtype=f64, requires_grad=True)  # just above the threshold
    with ShadowMode(spot_checks="off") as sm:
        y = BACKWARDS[name](x)
        y.backward(torch.randn_like(y))
    pooled = {str(op) for op, _ in written}  # the ops whose result a writer wrote into pooled memory
    backward = [r for r in sm.report.records if r.op in pooled and "backward" in r.op]
    assert backward, (name, pooled)
    assert all(r.drift.max_abs == 0 and r.drift.n > 0 for r in backward), backward


@pytest.mark.parametrize("func, temporaries", [
    (aten._softmax.default, 2), (aten._log_softmax.default, 1), (aten._log_softmax_backward_data.default, 2),
], ids=["softmax", "log_softmax", "log_softmax_backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_softmax_bounds_take_their_logits_sized_temporaries_from_the_pool(func, temporaries, dtype):
    """A language model's logits make softmax's bounds the size of the vocabulary times the tokens: their
    temporaries come from the pool (``temporaries`` of them in use at once at least), and the bound is the one
    computed in fresh memory, bit for bit."""
    from shadow.budgets import budget_for

    torch.manual_seed(0)
    x = torch.randn(MIN_BYTES // 8 // 4096 + 8, 4096, dtype=f64) * 3  # just above the threshold
    z = torch.log_softmax(x, -1)
    g = torch.randn_like(x)
    args, out = {
        aten._softmax.default: ((x, -1, False), torch.softmax(x, -1)),
        aten._log_softmax.default: ((x, -1, False), z),
        aten._log_softmax_backward_data.default: ((g, z, -1, dtype), aten._log_softmax_backward_data(g, z, -1, f64)),
    }[func]
    pool = Scratch()
    pooled = budget_for(func, args, {}, [out], dtype, scratch=pool).bound[0]
    assert torch.equal(pooled, budget_for(func, args, {}, [out], dtype).bound[0])
    assert pool.peak >= temporaries * x.numel() * 8
