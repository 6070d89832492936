"""Device values read over to where their shadows live elsewhere (``shadow.transfer``): each storage version
crosses once, the tensors one call needs cross together, and nothing read over outlives a write.

No GPU here: a placement fixed at ``cpu:0`` (a device that is not ``cpu`` to torch's comparison, and where CPU
tensors land) makes every CPU tensor's shadow live "elsewhere", so the engine takes the path a GPU's or DirectML's
tensors take under CPU shadows, and its figures must be the default path's, bit for bit. tests/test_cuda.py runs the
path on a GPU (pinned, non-blocking copies).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shadow import ShadowMode
from shadow.mirror import Placement
from shadow.transfer import HostCopies, transfer

ELSEWHERE = torch.device("cpu", 0)


def _run(step, far: bool, limit: float | None = None, **options) -> ShadowMode:
    """``step`` shadowed, with every shadow elsewhere when ``far``, and at most ``limit`` bytes of copies kept."""
    torch.manual_seed(0)
    sm = ShadowMode(**options)
    with sm:
        if far:
            sm._engine.mirror.place = Placement(ELSEWHERE)
        if limit is not None:
            sm._engine.copies.limit = lambda: limit
        step()
    assert sm.report.coverage.internal_errors == 0, sm.report.coverage.unsupported
    return sm


def _figures(sm: ShadowMode) -> list:
    return [(r.op, r.kind, r.local, r.drift, r.budget, r.flips, r.spot) for r in sm.report.records]


def _both(step, limit: float | None = None, **options) -> tuple[ShadowMode, ShadowMode]:
    """The step shadowed as usual and with every shadow elsewhere: the same figures."""
    near, far = _run(step, False, limit, **options), _run(step, True, limit, **options)
    assert _figures(far) == _figures(near)
    assert near._engine.copies.transfers == 0
    return near, far


def _chains(n: int, ops: int):
    """Two chains of ``ops`` multiplications each, their calls alternating: an op reads the result of the call before
    the last."""
    def step():
        a, b = torch.randn(n), torch.randn(n)
        for _ in range(ops):
            a = a * 1.0001
            b = b * 1.0002
    return step


@pytest.mark.parametrize("n", [4, 4096])  # the comparison's Python loop, and its fused pass
def test_each_result_crosses_once(n):
    """Each result crosses once, for its comparisons (drift and local), and its copy serves the next op's local
    replay: one crossing per op, and one per chain's first input (randn's draw, read over to be adopted). With no
    copy kept beyond the last batch, each op's input crosses again (but the first: exact, no local replay reads
    it)."""
    ops = 6
    _, far = _both(_chains(n, ops))
    copies = far._engine.copies
    assert copies.transfers == 2 * ops + 2 and copies.batches == 2 * ops + 2
    assert copies.held == 0  # freed when the block ends
    _, far = _both(_chains(n, ops), limit=0.0)
    assert far._engine.copies.transfers == 2 * ops + 2 + 2 * (ops - 1)


def _training_steps(discrete: bool = False):
    """Two Adam steps of a small MLP from the same start each time it is called; ``discrete``: each loss's argmax
    too (a discrete result, compared by its flips)."""
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def step():
        model.load_state_dict(state)
        opt.state.clear()
        x, y = torch.randn(5, 6), torch.tensor([0, 2, 1, 1, 0])
        for _ in range(2):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if discrete:
                loss.argmax()
    return step


def test_a_training_step_gives_the_default_figures():
    """Forward, backward and Adam's foreach ops (in place, on lists) with every shadow elsewhere: the figures of the
    default path, with fewer crossings than reads."""
    near, far = _both(_training_steps())
    records = len(far.report.records)
    assert records > 50
    assert 0 < far._engine.copies.transfers < 2 * records


def test_spot_checks_comparisons_and_the_trajectory_read_the_copies():
    """With every shadow elsewhere, the device results a spot check samples, those the comparisons read (floating
    and discrete) and the parameters and loss the trajectory reads are the copies brought over for them, each
    storage version once: no reader of a device value goes around ``HostCopies`` (on DirectML each would be a copy
    of its own, tests/test_privateuse1_engine.py counts them). The loss's copy is its comparison's."""
    step = _training_steps(discrete=True)
    made, read = [], {}
    real = transfer

    def brought(tensors, to):
        out = real(tensors, to)
        made.extend(out)  # held: no storage address is reused by another tensor
        return out

    def reader(name, where, position):
        original = getattr(*where)

        def wrapped(*args, **kwargs):
            values = args[position]
            # float64: the numbers ops return (Adam's step.item()), compared as tensors made beside their shadows
            read.setdefault(name, []).extend(v for v in (values if isinstance(values, list) else [values])
                                             if isinstance(v, torch.Tensor) and v.dtype != torch.float64)
            return original(*args, **kwargs)
        return wrapped

    import shadow.engine.judge as judge
    import shadow.spot.policy as policy
    import shadow.trajectory as trajectory
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("shadow.transfer.transfer", brought)
        for name, where, position in (("spot check", (policy, "spot_check"), 3), ("figures", (judge, "figures"), 2),
                                      ("flips", (judge, "count_flips"), 0), ("trajectory", (trajectory, "compare"), 0)):
            mp.setattr(*where, reader(name, where, position))
        sm = _run(step, True, spot_checks="all")
    assert len(sm.report.trajectory) == 2 and sm.report.trajectory[0].loss is not None
    copies = {c.untyped_storage().data_ptr() for c in made}
    assert read.keys() == {"spot check", "figures", "flips", "trajectory"}
    for name, tensors in read.items():
        assert all(t.untyped_storage().data_ptr() in copies for t in tensors), name
    assert sm._engine.copies.transfers == len(made)


def test_a_call_s_inputs_cross_in_one_batch():
    """addcmul's inputs, results of earlier ops (inexact: its local replay reads them), none kept but the last
    batch: those without a copy cross in one batch. Kept, they do not cross again."""
    def step():
        x = torch.randn(8)
        a, b, c = x * 1.0001, x * 1.0002, x * 1.0003
        torch.addcmul(a, b, c, value=0.5)

    _, far = _both(step, limit=0.0)
    copies = far._engine.copies
    # x's draw (adopted); the three results one by one; a and b together (c's copy, the last batch's, is at hand);
    # addcmul's result
    assert (copies.transfers, copies.batches) == (1 + 3 + 2 + 1, 1 + 3 + 1 + 1)
    _, far = _both(step)
    assert (far._engine.copies.transfers, far._engine.copies.batches) == (5, 5)


def test_a_write_between_reads_is_read_again():
    """y's copy is kept after y = x * 2; y.add_(1) writes it (its version moves, and shadow drops the copy): the
    next read brings the written values over. A stale copy would make z's local reference (2x) * 3 instead of
    (2x + 1) * 3: a local error of 3 where the default path reads at most half an ulp."""
    def step():
        x = torch.randn(16)
        y = x * 2
        y.add_(1)
        z = y * 3
        z.sum()

    near, far = _both(step)
    z = [r for r in far.report.records if r.op == "aten.mul.Tensor"][-1]
    assert z.local.max_ulp <= 0.5


def test_a_write_no_version_shows_is_read_again():
    """native_batch_norm writes its running statistics without moving their version counters: the copies taken
    before the call are dropped, so the second call's update reads the first call's result."""
    bn = nn.BatchNorm1d(4)
    state = {k: v.clone() for k, v in bn.state_dict().items()}

    def step():
        bn.load_state_dict(state)
        x = torch.randn(8, 4)
        for _ in range(3):
            bn(x * 1.5)

    for limit in (None, 0.0):  # copies kept, and only the last batch's (counted in no bytes kept)
        near, far = _both(step, limit)
        calls = [r for r in far.report.records if "batch_norm" in r.op]
        assert len(calls) == 3 and all(r.budget.used <= 1 for r in calls)


def test_a_write_shadow_did_not_see_is_read_again():
    """A write no op shows (dispatch disabled) moves the version counter: the copy is not handed out again, and the
    mirror resyncs (an unobserved write)."""
    def step():
        x = torch.randn(16)
        y = x * 2
        with torch._C._DisableTorchDispatch():
            y.add_(1)
        (y * 3).sum()

    near, far = _both(step)
    assert far.report.coverage.unobserved_writes == 1
    assert [r for r in far.report.records if r.op == "aten.mul.Tensor"][-1].local.max_ulp <= 0.5


def test_discrete_inputs_cross_once():
    """The indices of an embedding, read by the forward and by the backward: one crossing."""
    emb = nn.Embedding(10, 4)
    idx = torch.tensor([1, 3, 3, 7])

    def step():
        emb.zero_grad()
        emb(idx).sum().backward()

    counted = {}
    real = transfer

    def counting(tensors, to):
        for t in tensors:
            counted[t.dtype] = counted.get(t.dtype, 0) + 1
        return real(tensors, to)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("shadow.transfer.transfer", counting)
        _both(step)
    assert counted[torch.int64] == 1


def test_copies_kept_stay_within_their_limit():
    """400-byte results under a 1000-byte limit: two kept at most, enough for two chains; under 100 bytes, none
    beyond the last batch. Each chain's first input, randn's draw, crosses to be adopted."""
    for limit, transfers in ((1000.0, 2 + 10), (100.0, 2 + 18)):
        held = []
        sm = ShadowMode()
        with sm:
            sm._engine.mirror.place = Placement(ELSEWHERE)
            copies = sm._engine.copies
            copies.limit = lambda: limit
            a, b = torch.randn(100), torch.randn(100)
            for _ in range(5):
                a = a * 1.0001
                b = b * 1.0002
                held.append(copies.held)
        assert max(held) <= limit and copies.transfers == transfers, (limit, held, copies.transfers)


def test_transfer_keeps_values_dtype_and_layout():
    t = torch.randn(3, 5, dtype=torch.bfloat16).t()
    (c,) = transfer([t], ELSEWHERE)
    assert c.dtype == t.dtype and c.stride() == t.to(ELSEWHERE, copy=True).stride() and torch.equal(c, t)
    assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    (z,) = transfer([torch._efficientzerotensor(3)], ELSEWHERE)
    assert torch.equal(z, torch.zeros(3))


def test_a_copy_is_forgotten_when_its_storage_dies_or_is_written():
    copies = HostCopies(lambda d: ELSEWHERE, lambda: 1e9)
    x = torch.randn(6)
    a = copies.read(x)
    assert copies.read(x) is a and copies.transfers == 1  # kept
    assert copies.read(x[1:]) is not a and copies.transfers == 2  # another geometry: its own copy
    copies.drop([(None, x)])  # a write shadow saw: every copy of the storage goes
    assert copies.held == 0
    b = copies.read(x)
    x.mul_(2)  # the version moves
    c = copies.read(x)
    assert c is not b and torch.equal(c, x)
    with torch.inference_mode():
        i = torch.randn(3)
    copies.read(i)
    assert copies.read(i) is not None and copies.transfers == 6  # no version counter: never kept


def test_adopted_values_replace_the_copies_read_over():
    """Values shadow adopts (computed where it could not see: a compiled module's outputs) replace the copies read
    over before, even where no version counter moved (a write through numpy). x * z reads both over (z is inexact):
    a stale copy of x would give the local reference 1.5 x_old z instead of 2 z."""
    sm = ShadowMode()
    with sm:
        sm._engine.mirror.place = Placement(ELSEWHERE)
        x = torch.randn(8) * 1.5  # a result: its copy kept
        z = torch.randn(8) * 1.0001
        x.numpy()[:] = 2.0  # no version moves
        sm._engine.adopt([x])
        (x * z).sum()
    mul = [r for r in sm.report.records if r.op == "aten.mul.Tensor"][-1]
    assert sm.report.coverage.internal_errors == 0 and mul.local.max_ulp == 0  # 2 z is exact
