"""The budgets derived for issue 53, held to PyTorch's CPU kernels: each correct call within budget (used <= 1),
a fault of known size (``FaultMode``) over it; ops that only move values exact (local error 0, movement family);
``shadow explain`` names the new families and still says "a guess" for an op left on the default.

Each case runs twice: under ShadowMode (the engine's figures), and as a direct experiment without shadow: the op
on the device's inputs against the same op in float64 on those inputs upcast, held to ``budget_for``'s bound.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from shadow import ShadowMode, explain
from shadow.budgets import budget_for
from shadow.modes.faults import FaultMode
from shadow.plan import plan_of
from shadow.replay import defined_regions

import unjudged

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # the aten overload judged
    run: Callable[[torch.dtype], None]  # the computation, in a dtype
    dtypes: tuple = (torch.float32,)
    rel: float = 1e-4  # the fault injected in float32: outputs times (1 + rel)
    rel_bf16: float = 0.5  # ... in bfloat16 (u = 2**-8: a few ulps are percents)


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).requires_grad_()


def _ctc(dtype, tensors: bool = False):
    g = _g(1)
    T, N, C = 40, 3, 7
    lp = _leaf(torch.randn(T, N, C, generator=g) * 2, dtype)
    targets = torch.randint(1, C, (N, 12), generator=g)
    il, tl = [40, 33, 25], [12, 9, 6]
    if tensors:
        il, tl = torch.tensor(il), torch.tensor(tl)
    F.ctc_loss(lp.log_softmax(2), targets, il, tl, reduction="sum").backward()


def _multi_margin(dtype, p=1):
    g = _g(2)
    x = _leaf(torch.randn(16, 6, generator=g), dtype)
    F.multi_margin_loss(x, torch.randint(0, 6, (16,), generator=g), p=p, margin=0.7,
                        weight=torch.rand(6, generator=g).to(dtype) + 0.5).backward()


def _multilabel_margin(dtype):
    g = _g(3)
    x = _leaf(torch.randn(10, 6, generator=g), dtype)
    t = torch.randint(0, 6, (10, 6), generator=g)
    t[:, 3:] = -1
    F.multilabel_margin_loss(x, t).backward()


def _glu(dtype):
    x = _leaf(torch.randn(8, 12, generator=_g(4)) * 6, dtype)
    F.glu(x, -1).backward(torch.randn(8, 6, generator=_g(5)).to(dtype))


def _pdist(dtype, p=2.0):
    F.pdist(torch.randn(12, 9, generator=_g(6)).to(dtype), p=p)


def _grid(dtype, mode="bilinear", padding="zeros", dims=2, align=False):
    g = _g(7)
    x = torch.randn(2, 3, *(9,) * dims, generator=g).to(dtype)
    grid = (torch.rand(2, *(5,) * dims, dims, generator=g) * 2.4 - 1.2).to(dtype)
    F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=align)


def _affine_grid(dtype, size=(2, 3, 7, 9), align=False):
    theta = _leaf(torch.randn(2, len(size) - 2, len(size) - 1, generator=_g(15)) * 2, dtype)
    F.affine_grid(theta, size, align_corners=align).sum().backward()


def _renorm(dtype):
    torch.renorm(torch.randn(6, 5, generator=_g(8)).to(dtype) * 2, p=2, dim=0, maxnorm=1.5)


def _histc(dtype):
    torch.histc(torch.randn(2000, generator=_g(9)).to(dtype), bins=25, min=-3, max=3)


def _segment(dtype, reduce="sum"):
    data = _leaf(torch.randn(12, 4, generator=_g(10)) + 0.5, dtype)
    out = torch.segment_reduce(data, reduce, lengths=torch.tensor([3, 0, 5, 4]), unsafe=True, initial=0.5)
    out.backward(torch.randn(out.shape, generator=_g(11)).to(dtype))


def _logspace(dtype, base=10.0):
    torch.logspace(torch.tensor(-2.5), torch.tensor(3.0), 60, base=base, dtype=dtype)


def _default_dtype(dtype):
    """float32 asked for by giving no dtype (the default dtype), as programs do: its replay is still in float64."""
    return None if dtype == torch.float32 else dtype


def _pad_backward(dtype):
    x = _leaf(torch.randn(2, 3, 6, 7, generator=_g(12)), dtype)
    F.pad(x, (3, 2, 2, 3), mode="reflect").backward(torch.randn(2, 3, 11, 12, generator=_g(13)).to(dtype))


def _linear_ce(dtype, reduction="mean", weighted=False):
    """torch 2.13's chunked linear + cross entropy: a vocabulary of 300, rows ignored, class weights."""
    g = _g(14)
    x = _leaf(torch.randn(24, 16, generator=g), dtype)
    w = _leaf(torch.randn(300, 16, generator=g) / 4, dtype)
    b = _leaf(torch.randn(300, generator=g), dtype)
    target = torch.randint(0, 300, (24,), generator=g)
    target[[3, 17]] = -100
    weight = (torch.rand(300, generator=g) + 0.5).to(dtype) if weighted else None
    loss = F.linear_cross_entropy(x, w, target, linear_bias=b, weight=weight, reduction=reduction,
                                  options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=5))
    loss.sum().backward()


def test_linear_ce_of_ignored_rows_only_is_judged_without_an_error():
    """The mean over no counted row is 0/0 on the device and in float64: the budget gives no figure an internal error
    (it divided by the total weight before)."""
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        pytest.skip(f"torch {torch.__version__} has no chunked linear_cross_entropy")
    x, w = _leaf(torch.randn(4, 8, generator=_g(16)), torch.float32), _leaf(torch.randn(10, 8), torch.float32)
    with ShadowMode(spot_checks="off") as sm:
        F.linear_cross_entropy(x, w, torch.full((4,), -100), options=torch.nn.LinearCrossEntropyOptions(
            batch_chunk_size=2)).backward()
    (rec,) = [r for r in sm.report.records if r.op == "torch_nn._linear_cross_entropy_batch_chunked.default"]
    assert sm.report.coverage.internal_errors == 0 and not rec.budget.is_default and rec.budget.used == 0


HALVES = (torch.float32, torch.bfloat16)
CHUNKED_CE = {  # torch >= 2.13
    "linear_ce_mean": Case("torch_nn._linear_cross_entropy_batch_chunked.default", _linear_ce, HALVES),
    "linear_ce_sum_weighted": Case("torch_nn._linear_cross_entropy_batch_chunked.default",
                                   lambda dt: _linear_ce(dt, "sum", True), HALVES),
    "linear_ce_none": Case("torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default",
                           lambda dt: _linear_ce(dt, "none", True), HALVES),
} if hasattr(torch.nn, "LinearCrossEntropyOptions") else {}
CASES = CHUNKED_CE | {
    "ctc": Case("aten._ctc_loss.default", _ctc),
    "ctc_tensor": Case("aten._ctc_loss.Tensor", lambda dt: _ctc(dt, True)),
    "ctc_backward": Case("aten._ctc_loss_backward.default", _ctc),
    "ctc_backward_tensor": Case("aten._ctc_loss_backward.Tensor", lambda dt: _ctc(dt, True)),
    "multi_margin_backward_p1": Case("aten.multi_margin_loss_backward.default", _multi_margin),
    "multi_margin_backward_p2": Case("aten.multi_margin_loss_backward.default", lambda dt: _multi_margin(dt, 2)),
    "multilabel_margin_backward": Case("aten.multilabel_margin_loss_backward.default", _multilabel_margin),
    "glu_backward": Case("aten.glu_backward.default", _glu, HALVES, 1e-2),
    "pdist_2": Case("aten._pdist_forward.default", _pdist),
    "pdist_1.5": Case("aten._pdist_forward.default", lambda dt: _pdist(dt, 1.5)),
    "grid_bilinear": Case("aten.grid_sampler_2d.default", _grid, HALVES, 1e-1, 4.0),
    "grid_nearest_reflection": Case("aten.grid_sampler_2d.default",
                                    lambda dt: _grid(dt, "nearest", "reflection"), HALVES, 1e-1),
    "grid_bicubic_border": Case("aten.grid_sampler_2d.default", lambda dt: _grid(dt, "bicubic", "border", align=True),
                                HALVES, 1e-1, 4.0),
    "grid_3d": Case("aten.grid_sampler_3d.default", lambda dt: _grid(dt, dims=3), HALVES, 1e-1, 4.0),
    "affine_grid": Case("aten.affine_grid_generator.default", _affine_grid, HALVES),
    "affine_grid_3d_align": Case("aten.affine_grid_generator.default",
                                 lambda dt: _affine_grid(dt, (2, 3, 4, 5, 6), True), HALVES),
    "renorm": Case("aten.renorm.default", _renorm, HALVES, 1e-2),
    "histc": Case("aten.histc.default", _histc, (torch.float32,), 0.5),
    "segment_sum": Case("aten.segment_reduce.default", _segment, HALVES, 1e-1),
    "segment_prod": Case("aten.segment_reduce.default", lambda dt: _segment(dt, "prod"), HALVES, 1e-1),
    "segment_mean_backward": Case("aten._segment_reduce_backward.default", lambda dt: _segment(dt, "mean"),
                                  HALVES, 1e-1),
    "logspace": Case("aten.logspace.Tensor_Tensor", _logspace, HALVES, 1e-1),
    "logspace_base2": Case("aten.logspace.Tensor_Tensor", lambda dt: _logspace(dt, 2.0), HALVES, 1e-1),
    "logspace_default": Case("aten.logspace.default",
                             lambda dt: torch.logspace(-2.5, 3.0, 60, dtype=_default_dtype(dt)), HALVES, 1e-1),
    "linspace_default": Case("aten.linspace.default",
                             lambda dt: torch.linspace(-1.0, 3.0, 61, dtype=_default_dtype(dt)), HALVES, 1e-2),
    "arange_float": Case("aten.arange.start_step",
                         lambda dt: torch.arange(-1.0, 3.0, 0.1, dtype=_default_dtype(dt)), HALVES, 1e-2),
    "reflection_pad2d_backward": Case("aten.reflection_pad2d_backward.default", _pad_backward, HALVES, 1e-1),
}
PARAMS = [pytest.param(name, dt, id=f"{name}-{str(dt)[6:]}") for name, case in CASES.items() for dt in case.dtypes]


def used_by(run: Callable[[], None], op: str, *outer) -> list[float]:
    """The budget used by every call of ``op`` in ``run()`` under ShadowMode (``outer`` modes entered first: the
    faulty device), each judged by a derived budget; tests/test_budgets_histogram.py and test_budgets_backward.py
    hold their ops so too."""
    sm = ShadowMode(spot_checks="off", drift=False)
    for m in outer:
        m.__enter__()
    try:
        with sm:
            run()
    finally:
        for m in reversed(outer):
            m.__exit__(None, None, None)
    assert not sm.report.coverage.unsupported, sm.report.coverage.unsupported
    recs = [r for r in sm.report.records if r.op == op]
    assert recs, f"{op} not called"
    for r in recs:
        assert r.budget is not None and not r.budget.is_default, (op, r.budget)
    return [r.budget.used for r in recs]


def kernel_here(run: Callable[[torch.dtype], None], dtype: torch.dtype, op: str) -> None:
    """Skip where this torch's CPU kernel lacks the dtype (torch 2.4's grid samplers have no bfloat16)."""
    try:
        run(dtype)
    except RuntimeError as exc:
        if "not implemented for" not in str(exc):
            raise
        pytest.skip(f"{op} in {dtype} on this torch ({torch.__version__}): {exc}")


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_correct_kernel_within_budget_and_a_fault_over_it(name, dtype):
    case = CASES[name]
    kernel_here(case.run, dtype, case.op)
    used = used_by(lambda: case.run(dtype), case.op)
    assert max(used) <= 1.0, used
    rel = case.rel if dtype == torch.float32 else case.rel_bf16
    fault = FaultMode(rel=rel, op=case.op) if case.op.startswith("aten.") else _Perturbed(case.op, rel)
    faulty = used_by(lambda: case.run(dtype), case.op, fault)
    assert max(faulty) > 1.0, faulty


class Calls(TorchDispatchMode):
    """Notes the arguments of every call of the ops named (detached copies)."""

    def __init__(self, *ops: str):
        super().__init__()
        self.ops, self.calls = frozenset(ops), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) in self.ops:
            copy = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls.append((func, tree_map(copy, args), tree_map(copy, kwargs)))
        return func(*args, **kwargs)


class _Perturbed(TorchDispatchMode):
    """FaultMode's fault on a custom op, which FaultMode does not select (it perturbs aten ops only): floating
    outputs times (1 + rel), rounded once to their dtype."""

    def __init__(self, op: str, rel: float):
        super().__init__()
        self.op, self.rel = op, rel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) != self.op:
            return out
        perturb = lambda t: (t.double() * (1 + self.rel)).to(t.dtype) if t.is_floating_point() else t  # noqa: E731
        return tree_map(lambda t: perturb(t) if isinstance(t, torch.Tensor) else t, out)


def _upcast(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    return x


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_bound_holds_against_float64_without_shadow(name, dtype):
    """The op on the device's inputs against itself in float64 on them upcast, no shadow involved: every element
    the op defines within ``budget_for``'s bound."""
    case = CASES[name]
    kernel_here(case.run, dtype, case.op)
    calls = Calls(case.op)
    with calls:
        case.run(dtype)
    holds_against_float64(calls, dtype)


def holds_against_float64(calls: Calls, dtype: torch.dtype) -> None:
    """Every call ``calls`` noted, run again on its inputs and in float64 on them upcast, without shadow: every
    finite element the op defines within ``budget_for``'s bound, one bound per output."""
    assert calls.calls
    for func, args, kwargs in calls.calls:
        outs = func(*args, **kwargs)
        a64, k64 = tree_map(_upcast, args), tree_map(_upcast, kwargs)
        if k64.get("dtype") is None and not any(isinstance(a, torch.Tensor) for a in args) \
                and any(a.name == "dtype" for a in func._schema.arguments):  # a factory of the default dtype
            k64["dtype"] = torch.float64
        refs = func(*a64, **k64)
        outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
        bounds = budget_for(func, a64, k64, list(refs), dtype).bound
        assert len(bounds) == len(refs), (func, len(bounds), len(refs))
        defined = defined_regions(plan_of(func), a64, k64, refs)
        for i, (y, r, b) in enumerate(zip(outs, refs, bounds)):
            if b is None or not y.is_floating_point():
                continue
            keep = torch.isfinite(r) & torch.isfinite(y.double())
            if defined is not None and defined[i] is not None:
                keep &= defined[i]
            err = (y.double() - r).abs()[keep]
            assert err.numel() and bool((err <= b.expand(r.shape)[keep]).all()), \
                (func, i, float((err / b.expand(r.shape)[keep]).max()))


MOVEMENT = {
    "aten.scatter.src": lambda: torch.zeros(4, 6).scatter(1, torch.tensor([[0, 2], [1, 5], [3, 4], [2, 0]]),
                                                          torch.randn(4, 2, generator=_g(20))),
    "aten.block_diag.default": lambda: torch.block_diag(torch.randn(2, 3, generator=_g(21)),
                                                        torch.randn(3, 1, generator=_g(22))),
    "aten._chunk_cat.default": lambda: aten._chunk_cat([torch.randn(4, 6, generator=_g(23)),
                                                        torch.randn(4, 2, generator=_g(24))], 1, 2),
}


@pytest.mark.parametrize("op", list(MOVEMENT))
def test_movement_is_exact(op):
    with ShadowMode(spot_checks="off") as sm:
        MOVEMENT[op]()
    (rec,) = [r for r in sm.report.records if r.op == op]
    assert rec.budget.family == "movement" and not rec.budget.is_default
    assert rec.local.max_abs == 0.0 and rec.budget.used == 0.0


FACTORIES = {
    "linspace": lambda **kw: torch.linspace(-1, 3, 7, **kw),
    "logspace": lambda **kw: torch.logspace(-2.5, 3.0, 9, **kw),
    "arange": lambda **kw: torch.arange(0, 1, 0.1, **kw),
    "full": lambda **kw: torch.full((3,), 0.1, **kw),
    "eye": lambda **kw: torch.eye(3, **kw),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_factory_of_the_default_dtype_is_shadowed_in_float64_and_judged(name):
    """A factory op given no dtype makes float32; its shadow is the same op made in float64 without shadow (not
    its float32 values upcast), and the call is held to a derived budget, within it."""
    with ShadowMode(spot_checks="off") as sm:
        t = FACTORIES[name]()
    assert t.dtype == torch.float32
    assert torch.equal(sm.shadow_of(t), FACTORIES[name](dtype=torch.float64))
    (rec,) = sm.report.records
    assert rec.budget is not None and not rec.budget.is_default and rec.budget.used <= 1.0, rec.budget
    assert not sm.report.coverage.internal_errors


def test_a_floating_result_of_integer_inputs_is_judged():
    n = torch.tensor([768, 5])
    with ShadowMode(spot_checks="off") as sm:
        y = n / 7
    (rec,) = [r for r in sm.report.records if r.op == "aten.div.Tensor"]
    assert rec.budget is not None and not rec.budget.is_default and rec.budget.used <= 1.0
    assert torch.equal(sm.shadow_of(y), n.double() / 7)  # 768 / 7 in float64, not float32's quotient upcast


def test_explain_names_the_new_families_and_the_guess():
    for op, family in ((aten._ctc_loss.default, "loss"), (aten._ctc_loss_backward.Tensor, "loss"),
                       (aten.multi_margin_loss_backward.default, "loss"), (aten.glu_backward.default, "elementwise"),
                       (aten._pdist_forward.default, "reduction"), (aten.grid_sampler_3d.default, "elementwise"),
                       (aten.histc.default, "reduction"), (aten.histogram.bin_ct, "reduction"),
                       (aten.bincount.default, "reduction"),
                       (aten.block_diag.default, "movement")):
        e = explain(op)
        assert e.budget[0].family == family, (op, e.budget[0])
        first = e.render().split("then default")[0]
        assert "a guess" not in first, op
    guess = explain(unjudged.OP)  # no rule: the default guess
    assert guess.budget[0].family == "default" and "a guess: no rule knows this op" in guess.render()


def test_ctc_bound_grows_with_the_sequence():
    """The recursion's error accumulates over time steps: the bound of the loss grows with T (as T**2 at
    worst: each step rounds a log_alpha that itself grows with t)."""
    def bound(T: int) -> float:
        lp = torch.randn(T, 1, 5, generator=_g(30)).log_softmax(2).double()
        args = (lp, torch.tensor([[1, 2, 3]]), [T], [3])
        return float(budget_for(aten._ctc_loss.default, args, {}, list(aten._ctc_loss(*args)), torch.float32).bound[0])

    b10, b40, b160 = bound(10), bound(40), bound(160)
    assert 4 * b10 < b40 < 16 * 4 * b10 and 4 * b40 < b160
    assert math.isfinite(b160)
