"""The error units (shadow.metrics), golden values by hand, and agreement of the comparison paths (Python
loop for tiny results, the fused numba pass above; without numba, numpy for small results and torch with
scratch buffers for large ones) with each other and with the definitions computed in plain numpy."""

import math
import random

import numpy as np
import pytest
import torch

from shadow import metrics
from shadow.metrics import ErrorStats, compare, compare_pair, count_flips, spacing

f64 = torch.float64


def test_golden_ulp_abs_rel():
    # y = [1 + 2^-23, 3], r = [1, 3 + 2^-22]: errors 2^-23 (1 ulp of fp32 at 1) and 2^-22 (1 ulp at 3,
    # whose spacing is 2^-22); rel_norm = sqrt(2^-46 + 2^-44) / sqrt(1 + (3 + 2^-22)^2)
    y = torch.tensor([1 + 2**-23, 3.0])
    r = torch.tensor([1.0, 3 + 2**-22], dtype=f64)
    s = compare(y, r, torch.float32)
    assert s.max_abs == 2**-22 and s.max_ulp == 1.0 and s.n == 2
    assert s.rel_norm == pytest.approx(math.sqrt(2**-46 + 2**-44) / math.sqrt(1 + (3 + 2**-22) ** 2), rel=1e-15)


def test_golden_subnormal_and_zero_reference():
    # below the smallest normal the spacing is the subnormal spacing: 2^-149 for fp32, 2^-24 for fp16
    s = compare(torch.tensor([2**-148]), torch.tensor([0.0], dtype=f64), torch.float32)
    assert s.max_ulp == 2.0 and s.rel_norm == math.inf
    s = compare(torch.tensor([2**-24], dtype=torch.float16), torch.tensor([2**-23], dtype=f64), torch.float16)
    assert s.max_ulp == 1.0
    # bf16 at 1.0: p = 7 stored bits, an error of 2^-8 is half an ulp
    s = compare(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1 + 2**-8], dtype=f64), torch.bfloat16)
    assert s.max_ulp == 0.5


def test_nonfinite_counted_apart():
    y = torch.tensor([math.inf, 1.0, math.nan, 2.0, math.inf, -math.inf])
    r = torch.tensor([1.0, math.inf, math.nan, 2.5, math.inf, math.inf], dtype=f64)
    s = compare(y, r, torch.float32)
    assert (s.nonfinite_device, s.nonfinite_reference, s.nonfinite_mismatch) == (1, 1, 1)
    assert s.max_abs == 0.5 and s.max_ulp == 0.5 / 2**-22  # only element 3 is finite in both


@pytest.mark.parametrize("n", [1, 7, 64, 65, 5000, metrics._SMALL + 1, 100_000])
def test_three_paths_agree(n):
    torch.manual_seed(n)
    r = torch.randn(n, dtype=f64) * torch.exp2(torch.randint(-160, 20, (n,)).double())
    r[:: max(1, n // 5)] = 0.0
    y = (r * (1 + 1e-7 * torch.randn(n, dtype=f64))).float()
    got = compare(y, r, torch.float32)
    ref = metrics._compare_numpy(metrics.host(y), metrics.host(r), torch.float32, n)
    assert (got.max_abs, got.max_ulp) == (ref.max_abs, ref.max_ulp)
    assert got.rel_norm == pytest.approx(ref.rel_norm, rel=1e-12)


def test_large_nonfinite_path():
    n = metrics._SMALL + 10
    r = torch.ones(n, dtype=f64)
    y = torch.ones(n)
    y[0], y[1], r[2] = math.inf, 1.5, math.inf
    s = compare(y, r, torch.float32)
    assert (s.nonfinite_device, s.nonfinite_reference, s.max_abs, s.max_ulp) == (1, 1, 0.5, 0.5 / 2**-23)


def test_merge_keeps_worst_and_sums_counts():
    a, b = ErrorStats(1.0, 2.0, 0.1, 3, 1, 0, 0), ErrorStats(0.5, 4.0, 0.2, 5, 0, 2, 1)
    a.merge(b)
    assert (a.max_abs, a.max_ulp, a.rel_norm, a.n, a.nonfinite) == (1.0, 4.0, 0.2, 8, 4)


def test_count_flips():
    assert count_flips(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 3])) == 1
    assert count_flips(torch.tensor([True, False]), torch.tensor([False, True])) == 2


def test_comparisons_never_call_blas(monkeypatch):
    """numpy's BLAS calls (vdot, dot, matmul, inner) run on a thread pool of every core: on a loaded machine
    a 64k-element vdot took ms instead of us. Shadow's comparisons use plain reductions only."""
    import numpy as np

    def blas(*a, **k):
        raise AssertionError("a BLAS call in shadow's comparisons")

    for name in ("vdot", "dot", "matmul", "inner", "einsum"):
        monkeypatch.setattr(np, name, blas)
    for n in (3, 1000, 20000):  # the Python, numpy and torch paths
        y = torch.randn(n)
        r = y.double() + 1e-9
        st = compare(y, r, torch.float32)
        assert st.norm == pytest.approx(float(torch.linalg.vector_norm(y.double() - r)), rel=1e-12)
        assert st.rel_norm == pytest.approx(st.norm / float(torch.linalg.vector_norm(r)), rel=1e-12)


@pytest.mark.parametrize("n", [4, 1000, metrics._SMALL + 1])
def test_budget_over_a_zero_bound_is_infinite_on_every_path(n):
    # element 0: error 0 over bound 0 (0/0, exact: reads 0); element 1: error 2^-23 over bound 0 (x/0: inf,
    # never the largest finite float64 that nan_to_num would make of it); the rest: error 0 over bound 1
    r = torch.ones(n, dtype=f64)
    y = torch.ones(n)
    y[1] = 1 + 2**-23
    bound = torch.ones(n, dtype=f64)
    bound[:2] = 0.0
    assert compare(y, r, torch.float32, bound).budget_used == math.inf


# --- the fused pass (shadow._fused) against the definitions and against the paths it replaced ---

fused = pytest.mark.skipif(metrics.fused is None, reason=f"numba unavailable: {metrics.FUSED_UNAVAILABLE}")
EXACT = ("n", "max_abs", "max_ulp", "budget_used", "nonfinite_device", "nonfinite_reference", "nonfinite_mismatch",
         "nonfinite_agreed", "zero_reference", "max_ulp_nonzero")


def _by_definition(y: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, bound: torch.Tensor | None) -> ErrorStats:
    """ErrorStats by docs/error-units.md, in plain float64 numpy, one figure at a time."""
    yn = y.double().reshape(-1).numpy()
    rn = r.reshape(-1).numpy()
    bn = None if bound is None else torch.broadcast_to(bound, r.shape).reshape(-1).numpy()
    fy, fr = np.isfinite(yn), np.isfinite(rn)
    same = (yn == rn) | (np.isnan(yn) & np.isnan(rn))
    st = ErrorStats(n=yn.size, budget_used=None if bn is None else 0.0,
                    nonfinite_device=int((~fy & fr).sum()), nonfinite_reference=int((fy & ~fr).sum()),
                    nonfinite_mismatch=int((~fy & ~fr & ~same).sum()), nonfinite_agreed=int((~fy & ~fr & same).sum()))
    both = fy & fr
    with np.errstate(all="ignore"):
        d, rb = np.abs(yn[both] - rn[both]), rn[both]
        if not d.size or d.max() == 0:
            return st
        tiny, scale = torch.finfo(dtype).tiny, 2.0 ** metrics.precision_bits(dtype)
        exponent = np.frexp(np.abs(rb))[1]  # |r| = m 2^e, m in [0.5, 1): the spacing unit is 2^(e-1)
        unit = np.where(rb == 0, tiny, np.maximum(np.ldexp(1.0, exponent - 1), tiny))
        st.max_abs, st.max_ulp = float(d.max()), float((d / unit).max()) * scale
        st.norm = math.sqrt(float(np.sum(d * d)))
        norm_r = math.sqrt(float(np.sum(rb * rb)))
        st.rel_norm = st.norm / norm_r if norm_r > 0 else math.inf
        if bn is not None:
            q = np.abs(d / bn[both])
            st.budget_used = float(q[~np.isnan(q)].max(initial=0.0))
        zero = (rb == 0) & (d != 0) & np.isfinite(d)
        rest = ~zero & np.isfinite(d)
        if st.max_ulp >= scale and zero.any():  # compare reports zero references when errors reach 1/eps ulp
            st.zero_reference = int(zero.sum())
            st.max_ulp_nonzero = float((d[rest] / unit[rest]).max(initial=0.0)) * scale
    return st


def _sample(dtype: torch.dtype, n: int, seed: int, sprinkled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A result a few ulps off its reference, over many binades; sprinkled: zero references with a nonzero
    device value, subnormal references, and NaN/Inf on either side, alike and not."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    r = torch.randn(n, dtype=f64, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).double())
    r[::13] = 0.0
    r[5::31] *= fi.tiny  # references below the dtype's smallest normal: the subnormal spacing
    y = (r * (1 + 4 * fi.eps * torch.randn(n, dtype=f64, generator=g))).to(dtype)
    if sprinkled:
        y[::26] = 4 * fi.tiny  # where r is 0: 4 spacings / 2^-p (the zero-reference report)
        y[3::97] = math.nan
        r[7::89] = math.inf
        y[7::178] = math.inf  # agreed
        y[96::178] = -math.inf  # mismatch
        r[11::211] = math.nan
        y[11::422] = math.nan  # agreed
    return y, r


def _bound(kind: str, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    eps = torch.finfo(dtype).eps
    if kind == "none":
        return None
    if kind == "scalar":
        return torch.tensor(eps, dtype=f64)
    if kind == "row":  # one bound per column, broadcast over the rows
        return (r.nan_to_num(0.0, 0.0, 0.0).abs().amax(0, keepdim=True) * eps).clamp_min(eps * 2.0**-20)
    b = r.nan_to_num(0.0, 0.0, 0.0).abs() * eps + torch.finfo(dtype).tiny * eps
    if kind == "zeros":  # 0/0 reads 0, x/0 inf
        b[::50] = 0.0
    return b


def _assert_same(got: ErrorStats, want: ErrorStats) -> None:
    for name in EXACT:
        assert getattr(got, name) == getattr(want, name), (name, getattr(got, name), getattr(want, name))
    for name in ("norm", "rel_norm"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-12, abs=0, nan_ok=True), name


@fused
@pytest.mark.parametrize("bound_kind", ["none", "tensor", "zeros", "scalar", "row"])
@pytest.mark.parametrize("layout", ["flat", "strided"])
@pytest.mark.parametrize("n", [1000, 2 * 2**15 + 777])  # one chunk on the calling thread; three in parallel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_fused_pass_equals_the_definitions(dtype, n, layout, bound_kind):
    for sprinkled in (False, True):
        y, r = _sample(dtype, n, seed=n + 7 * sprinkled, sprinkled=sprinkled)
        if layout == "strided":  # a transposed reference, a result every other element of a wider one
            cols = 25
            rows = n // cols
            r = r[: rows * cols].reshape(cols, rows).t()
            wide = torch.zeros(rows, 2 * cols, dtype=dtype)
            wide[:, ::2] = y[: rows * cols].reshape(cols, rows).t()
            y = wide[:, ::2]
            assert not (y.is_contiguous() or r.is_contiguous())
        elif bound_kind == "row":
            continue  # a row bound needs two dimensions
        bound = _bound(bound_kind, r, dtype)
        got = compare(y, r, dtype, bound)
        _assert_same(got, _by_definition(y, r, dtype, bound))
        assert (got.zero_reference > 0) == sprinkled
        kinds = (got.nonfinite_device, got.nonfinite_reference, got.nonfinite_mismatch, got.nonfinite_agreed)
        assert min(kinds) > 0 if sprinkled else max(kinds) == 0  # the sample meets every kind


def _rounded_up_products(count: int, seed: int) -> list[tuple[float, float]]:
    """(q, b) in [1, 2) whose product rounds up: d = fl(q * b) exceeds q * b, and d / b rounds above q. A test of
    d against fl(q * b) would pass over such a d; fma(q, b, -d) < 0 does not."""
    from fractions import Fraction

    rnd, pairs = random.Random(seed), []
    while len(pairs) < count:
        q, b = rnd.uniform(1, 2), rnd.uniform(1, 2)
        d = q * b
        if Fraction(d) > Fraction(q) * Fraction(b) and d / b > q:
            pairs.append((q, b))
    return pairs


@fused
@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled", "near"])
def test_the_budget_use_skips_only_quotients_below_the_largest(order):
    """The pass divides d / bound only in blocks where some quotient may exceed the largest so far
    (``_fused._finite_chunk``): the budget use equals the largest quotient however the quotients are ordered
    (every block a new largest, only the first, at random), where a later quotient exceeds the largest by its
    last bit only, and with one-element bounds and operand terms."""
    from shadow import _fused
    from shadow.budgets.core import UlpsPlus

    n = 5 * _fused.BLOCK + 17
    g = torch.Generator().manual_seed(11)
    bound = torch.rand(n, dtype=f64, generator=g) + 0.5
    q = torch.rand(n, dtype=f64, generator=g) * 3
    if order == "ascending":
        q = q.sort().values
    elif order == "descending":
        q = q.sort(descending=True).values
    y = q * bound  # against r = 0: d = |y| exactly, a float64 device
    if order == "near":  # the largest in block 0, then quotients 1 ulp above it in later blocks
        y.fill_(0.0)
        pairs = _rounded_up_products(4, seed=3)
        for j, (qj, bj) in enumerate(pairs):
            at = (j + 1) * _fused.BLOCK + 5 * j
            y[j], bound[j] = qj, 1.0  # the first quotient of block 0 is qj itself
            y[at], bound[at] = qj * bj, bj
        y[:4] = torch.tensor([qj for qj, _ in pairs], dtype=f64).max()  # block 0's largest: the largest q
        bound[:4] = 1.0
    r = torch.zeros(n, dtype=f64)
    want = float((y.abs() / bound).max())
    assert compare(y, r, f64, bound).budget_used == want
    if order == "near":
        assert want > float(y[:4].max())  # a later block's quotient is the largest, by its last bit
    # one element: a scalar bound, and a formula whose term and other operand are one element each
    assert compare(y, r, f64, bound[:1].clone()).budget_used == float((y.abs() / bound[0]).max())
    tiny = torch.finfo(f64).tiny
    formula = UlpsPlus(2.0, bound[:1].clone(), 1.0, f64, op="div", other=torch.tensor([3.0], dtype=f64))
    assert compare(y, r, f64, formula).budget_used == float((y.abs() / formula.tensor(r)).max())
    assert float(formula.tensor(r).max()) > tiny  # the formula's bound is its term over 3, not the floor


@pytest.mark.parametrize("size", ["loop", "tiny"])
@pytest.mark.parametrize("bound_kind", ["none", "tensor", "zeros", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_small_outputs_equal_the_definitions(dtype, bound_kind, size):
    """Outputs of at most _LOOP_FUSED elements (scalars, a small layer's biases) take a Python loop, and so do
    those of at most _TINY without numba; with it, those above _LOOP_FUSED take the fused pass: the figures are the
    definitions' on every kind of element, chunk by chunk of a sprinkled sample."""
    y, r = _sample(dtype, 2000, seed=11, sprinkled=True)
    bound = _bound(bound_kind, r, dtype)
    seen = set()
    chunk = metrics._LOOP_FUSED if size == "loop" else metrics._TINY
    for i in range(0, 2000 - chunk + 1, chunk):
        part = slice(i, i + chunk)
        b = bound[part] if bound is not None and bound.dim() else bound
        got = compare(y[part], r[part], dtype, b)
        _assert_same(got, _by_definition(y[part], r[part], dtype, b))
        seen |= {k for k in ("nonfinite_device", "nonfinite_reference", "nonfinite_mismatch", "nonfinite_agreed",
                             "zero_reference") if getattr(got, k)}
        if b is not None and got.max_abs:
            seen.add("budget")
    assert len(seen) == 5 + (bound is not None)  # every kind of element met the loop


@pytest.mark.parametrize("bound_kind", ["none", "tensor", "scalar", "formula"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_compare_pair_gives_the_two_comparisons(dtype, bound_kind):
    """A result's drift and local figures from one read of its values (compare_pair): the figures of two
    compare calls, at every size of the loop and above it (where it makes the two calls), for every kind of
    element, and with a formula bound (compared in the fused pass)."""
    from shadow.budgets.core import UlpsPlus

    y, r = _sample(dtype, 500, seed=5, sprinkled=True)
    lo = r.clone()
    lo[1::3] = (r[1::3] * (1 + 3 * torch.finfo(dtype).eps)).nan_to_num(0.0)  # another reference, finite where r is not
    lo[::7] = 0.0
    bound = _bound("tensor" if bound_kind == "formula" else bound_kind, r, dtype)
    seen = set()
    for k in (1, 4, metrics._LOOP_FUSED, metrics._LOOP_FUSED + 1, 40):
        for i in range(0, 500 - k + 1, k):
            part = slice(i, i + k)
            b = bound[part] if bound is not None and bound.dim() else bound
            if bound_kind == "formula":
                b = UlpsPlus(2.0, b, 1.0, dtype)
            got = compare_pair(y[part], r[part], lo[part], dtype, b)
            want = compare(y[part], r[part], dtype), compare(y[part], lo[part], dtype, b)
            for g, w in zip(got, want):
                _assert_same(g, w)
                assert g.budget_used == w.budget_used
            seen |= {n for n in ("nonfinite_device", "nonfinite_reference", "nonfinite_mismatch", "zero_reference")
                     if getattr(got[0], n) or getattr(got[1], n)}
    assert len(seen) == 4


@fused
@pytest.mark.parametrize("bound_kind", ["none", "tensor", "scalar", "formula"])
@pytest.mark.parametrize("n", [1000, 2 * 2**15 + 777])  # one chunk on the calling thread; three in parallel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_the_paired_pass_gives_the_two_passes_figures(dtype, n, bound_kind):
    """compare_pair above the loop's size reads y once for both references (shadow._fused.pair): the figures of
    the two passes, maxima and counts to the last bit and sums to rounding, where both references are finite and
    where either holds NaNs and infinities (the full loop then runs for each), whatever the thread count."""
    from shadow import _fused
    from shadow.budgets.core import UlpsPlus

    for sprinkled in (False, True):
        y, r = _sample(dtype, n, seed=n + sprinkled, sprinkled=sprinkled)
        lo = (r * (1 + 3 * torch.finfo(dtype).eps)).nan_to_num(0.0) if sprinkled else r * (1 - 2**-30)
        bound = _bound("tensor" if bound_kind == "formula" else bound_kind, lo, dtype)
        if bound_kind == "formula":
            bound = UlpsPlus(2.0, bound, 1.0, dtype)
        want = compare(y, r, dtype), compare(y, lo, dtype, bound)
        threads = torch.get_num_threads()
        try:
            for t in (1, 2):
                torch.set_num_threads(t)  # the parallel pass follows torch's thread count
                got = compare_pair(y, r, lo, dtype, bound)
                for g, w in zip(got, want):
                    _assert_same(g, w)
        finally:
            torch.set_num_threads(threads)
        assert got[0].max_abs > 0 and got[1].max_abs > 0 and (got[0].nonfinite > 0) == sprinkled
        assert (got[1].budget_used is None) == (bound is None) and got[0].budget_used is None
    tiny = torch.finfo(dtype).tiny
    assert _fused.pair(y, r, lo, None, tiny)[0] == _fused.figures(y, r, None, tiny)


@fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_fused_pass_equals_the_torch_passes_it_replaced(dtype, monkeypatch):
    n = metrics._SMALL + 1000
    y, r = _sample(dtype, n, seed=3, sprinkled=True)
    for kind in ("none", "tensor", "zeros", "scalar"):
        bound = _bound(kind, r, dtype)
        got = compare(y, r, dtype, bound)
        with monkeypatch.context() as m:
            m.setattr(metrics, "fused", None)  # as without numba
            _assert_same(got, compare(y, r, dtype, bound))


@fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_a_formula_bound_formed_in_the_pass_equals_its_tensor(dtype, monkeypatch):
    """An ``UlpsPlus`` bound (ulps of the dtype at r plus alpha times an operand term, or its square) formed
    element by element in the fused pass gives the figures of the same bound written as a tensor first
    (``UlpsPlus.tensor``), to the last bit: over zero and subnormal references, NaN and infinities on either
    side, terms of 0, of one element and of r's shape, every way of forming the term (|t|, t * t, |t - o|,
    |t / o| with division by 0, |t| * |o|), alpha 1 or not, on one thread and two, and on the paths without
    numba. The tensor is ulps * spacing(r) + (alpha * term), each rounded once."""
    from shadow.budgets.core import UlpsPlus

    n = 3 * 2**15 + 777
    y, r = _sample(dtype, n, seed=11, sprinkled=True)
    g = torch.Generator().manual_seed(2)
    term = torch.randn(n, dtype=f64, generator=g).abs() * torch.exp2(torch.randint(-30, 4, (n,), generator=g).double())
    term[::19] = 0.0
    rd = torch.float32 if dtype == f64 else dtype  # a float64 "device": its own units
    signed = torch.randn(n, dtype=f64, generator=g)
    signed[5::23] = 0.0  # |t / 0|: inf, and 0 / 0: NaN (a bound no quotient can exceed)
    formulas = [UlpsPlus(2.0, term, 1.0, dtype), UlpsPlus(1.0, term, 3 * 2.0**-24, dtype),
                UlpsPlus(1.5, signed, 0.1, dtype, "square"), UlpsPlus(4.0, torch.tensor(0.25, dtype=f64), 2.0**-8, dtype),
                UlpsPlus(1.0, torch.zeros(n, dtype=f64), 1.0, dtype), UlpsPlus(2.0, term, 1.0, rd),
                UlpsPlus(1.0, signed, 2.0**-22, dtype, "abs"), UlpsPlus(1.0, signed, 2.0**-22, dtype, "sub", term),
                UlpsPlus(1.0, term, 2.0**-22, dtype, "div", signed), UlpsPlus(1.0, signed, 3.0, dtype, "mul", term),
                UlpsPlus(1.0, signed, 3.0, dtype, "sub", torch.tensor(-0.5, dtype=f64))]
    by_torch = {"": lambda t, o: t, "abs": lambda t, o: t.abs(), "square": lambda t, o: t * t,
                "sub": lambda t, o: (t - o).abs(), "div": lambda t, o: (t / o).abs(), "mul": lambda t, o: t.abs() * o.abs()}
    threads = torch.get_num_threads()
    for f in formulas:
        b = f.tensor(r)
        t = by_torch[f.op](f.term, f.other)
        want = torch.broadcast_to(spacing(r, f.dtype, f.ulps) + (t if f.alpha == 1.0 else t * f.alpha), r.shape)
        assert torch.equal(b.view(torch.int64), want.contiguous().view(torch.int64))
        expected = compare(y, r, dtype, b)
        assert expected.budget_used > 0
        try:
            for k in (1, 2):
                torch.set_num_threads(k)
                _assert_same(compare(y, r, dtype, f), expected)
        finally:
            torch.set_num_threads(threads)
        with monkeypatch.context() as m:
            m.setattr(metrics, "fused", None)  # as without numba
            _assert_same(compare(y, r, dtype, f), expected)
        for k in (40, 16, 5, 1):  # small outputs: the formula in the fused pass, its tensor in the Python loop
            def head(t):
                return t if t is None or t.numel() == 1 else t[:k]

            _assert_same(compare(y[:k], r[:k], dtype, UlpsPlus(f.ulps, head(f.term), f.alpha, f.dtype, f.op,
                                                               head(f.other))),
                         compare(y[:k], r[:k], dtype, b[:k]))


@fused
def test_fused_figures_do_not_depend_on_the_thread_count():
    from shadow import _fused

    y, r = _sample(torch.float32, 5 * _fused.CHUNK + 3, seed=1, sprinkled=True)
    bound = _bound("tensor", r, torch.float32)
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2):
            torch.set_num_threads(t)  # the parallel pass follows torch's thread count
            runs.append(_fused.figures(y, r, bound, torch.finfo(torch.float32).tiny))
    finally:
        torch.set_num_threads(threads)
    serial, parallel = _fused._passes.compiled[0]
    args = (y.data_ptr(), *_fused._READ[torch.float32], r.data_ptr(), bound.data_ptr(), r.numel(), bound.numel(),
            _fused._exponent_field(torch.finfo(torch.float32).tiny), 0.0, 1.0, 0, bound.data_ptr(), bound.numel())
    assert runs[0] == runs[1] == serial(*args).tolist() == parallel(*args).tolist()


@fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_the_spacing_unit_from_the_exponent_bits_is_the_definitions(dtype):
    """The pass writes 1 / unit as a float's bits from r's exponent field; every field, the dtype's subnormal
    floor and the fields whose inverse is itself subnormal (|r| >= 2**1023) included, gives 2**-e exactly."""
    from shadow import _fused

    tiny = torch.finfo(dtype).tiny
    floor = math.frexp(tiny)[1] - 1  # tiny = 2**floor
    for field in range(2048):
        want = math.ldexp(1.0, -max(field - 1023, floor))
        for sign in (0, 1):  # r's sign and mantissa play no part
            bits = np.array([sign << 63 | field << 52 | 12345], np.uint64).view(np.int64)[0]
            got = _fused._inverse_unit(bits, _fused._exponent_field(tiny))
            assert got == want, (field, sign, got, want)
            if field < 2046:  # the finite chunk's unit: |r| < 2**1023
                assert _fused._inverse_unit_finite(bits, _fused._exponent_field(tiny)) == want, (field, sign)


@fused
def test_references_near_overflow_take_the_full_loop_and_its_units(monkeypatch):
    """The finite chunk's unit is wrong for |r| >= 2**1023 (``_inverse_unit_finite``), where r * r overflows
    its sum and the full loop runs instead: finite references in the top binade (and the one below), among
    ordinary ones, give the definitions' figures, as without numba."""
    n = 3 * 2**15
    g = torch.Generator().manual_seed(5)
    r = torch.randn(n, dtype=f64, generator=g)
    at = [17, 40000, 70001, 90000]
    r[at] = torch.tensor([2.0**1023 * 1.25, -1.5 * 2.0**1023, torch.finfo(f64).max, 2.0**1022 * 1.75], dtype=f64)
    zero = torch.zeros_like(r)
    y = r.nextafter(zero)  # a float64 device one ulp off, three in the top binade (none a power of two)
    top = at[:3]
    for _ in range(2):
        y[top] = y[top].nextafter(zero[top])
    got = compare(y, r, f64, None)
    _assert_same(got, _by_definition(y, r, f64, None))
    assert got.max_ulp == 3.0  # the top binade's own (a unit of 2**971; 2**-1023 as its inverse)
    with monkeypatch.context() as m:
        m.setattr(metrics, "fused", None)
        _assert_same(got, compare(y, r, f64, None))


@fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_spacing_in_one_pass_equals_the_torch_passes(dtype, monkeypatch):
    """spacing() of a large contiguous reference is one numba pass: the same values, bit for bit, as torch's
    three (the exponent bits, the floor at tiny, the scale), over every binade, zeros, subnormals, infinities
    and NaN, on one thread and two; into a given buffer or a new one."""
    from shadow import _fused

    n = 3 * _fused.CHUNK + 11
    g = torch.Generator().manual_seed(4)
    r = torch.randn(n, dtype=f64, generator=g) * torch.exp2(torch.randint(-1074, 1023, (n,), generator=g).double())
    r[::17] = 0.0
    r[1::19] = -0.0
    r[2::23] = math.inf
    r[3::29] = -math.inf
    r[4::31] = math.nan
    r[5::37] = 5e-324
    threads = torch.get_num_threads()
    for times in (1.0, 3.0, 0.5):
        with monkeypatch.context() as m:
            m.setattr(metrics, "fused", None)  # as without numba
            want = metrics.spacing(r, dtype, times)
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                for got in (metrics.spacing(r, dtype, times), metrics.spacing(r, dtype, times, out=torch.empty_like(r))):
                    assert torch.equal(got.view(torch.int64), want.view(torch.int64)), (dtype, times, t)
        finally:
            torch.set_num_threads(threads)


@fused
def test_a_bounds_magnitude_in_one_pass_equals_the_torch_passes(monkeypatch):
    """|r| * c*u + floor (shadow.budgets.core.magnitude_of, where the final rounding's bounds start) is one numba
    pass for contiguous float64 CPU tensors: the same values, bit for bit, as torch's three passes, over every
    binade, zeros of both signs, subnormals, infinities and NaN, on one thread and two. Tensors the pass cannot
    read (strided, complex, tiny) take torch's passes."""
    from shadow import _fused, _fused_bounds
    from shadow.budgets import core

    n = 3 * _fused.CHUNK + 11
    g = torch.Generator().manual_seed(5)
    a = torch.randn(n, dtype=f64, generator=g) * torch.exp2(torch.randint(-1074, 1023, (n,), generator=g).double())
    for k, x in enumerate((0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324)):
        a[k::17 + 2 * k] = x
    threads = torch.get_num_threads()
    for scale, offset in ((3 * 2.0**-24, 2.0**-149), (2.0**-53, 0.0)):
        with monkeypatch.context() as m:
            m.setattr(core, "fused_bounds", None)  # as without numba
            want = core.magnitude_of(a, torch.empty_like(a), scale, offset)
        try:
            for t in (1, 2):
                torch.set_num_threads(t)
                got = core.magnitude_of(a, torch.empty_like(a), scale, offset)
                assert torch.equal(got.view(torch.int64), want.view(torch.int64)), (scale, t)
        finally:
            torch.set_num_threads(threads)
    for x in (a[:128].view(2, 64).t(), a[:2]):
        out = torch.empty(x.shape, dtype=f64)
        assert not _fused_bounds.magnitude(x, out)
        torch.testing.assert_close(core.magnitude_of(x, out, 0.5, 1.0), x.abs().to(f64) * 0.5 + 1.0,
                                   rtol=0, atol=0, equal_nan=True)
    z = torch.complex(a[:100], a[100:200])
    torch.testing.assert_close(core.magnitude_of(z, torch.empty(100, dtype=f64), 0.5, 1.0),
                               z.abs() * 0.5 + 1.0, rtol=0, atol=0, equal_nan=True)


@fused
@pytest.mark.parametrize("shape,by_rows", [((300, 500), True), ((300, 500), False), ((70, 5000), True),
                                           ((5000, 70), False), ((3, 40), True)])
def test_sums_of_squares_in_one_pass_are_torchs_to_rounding(shape, by_rows):
    """A matrix's squares summed along its rows and down its columns in one read (``_fused_bounds.squares``, a
    matmul's bound and scale): torch's sums to the rounding of sums of positive terms, n * 2**-53 relative
    for n terms; the same bits on one thread and two (fixed row blocks, combined in order); an infinity or a
    NaN reaches its row's and its column's sums as in torch. Tensors it cannot read give None."""
    from shadow import _fused_bounds

    g = torch.Generator().manual_seed(11)
    t = torch.randn(shape, dtype=f64, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).double())
    t[1, 2], t[2, 4] = math.inf, math.nan
    if not by_rows:
        t = t.T.contiguous().T
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(_fused_bounds.squares(t))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for dim, s in zip((-1, -2), got[0]):
        want = t.square().sum(dim, keepdim=True)
        assert s.shape == want.shape
        torch.testing.assert_close(s, want, rtol=t.shape[dim] * 2.0**-53, atol=0, equal_nan=True)
    assert math.isinf(got[0][0][1, 0]) and math.isinf(got[0][1][0, 2]) and math.isnan(got[0][0][2, 0])
    big = torch.randn(64, 64, dtype=f64, generator=g)
    for x in (big[:, ::2], big.float(), big.reshape(4, 16, 64), torch.randn(8, 8, dtype=f64)):
        assert _fused_bounds.squares(x) is None


@fused
@pytest.mark.parametrize("case", ["nan", "overflow", "zero-small", "zero-large"])
@pytest.mark.parametrize("threads", [1, 2])
def test_finite_chunks_and_the_others_give_the_definitions_figures(case, threads):
    """Chunks of finite values take the branch-free loop, a chunk holding a NaN or a square that overflows the
    full one; zero references are counted where the max ulp reaches 1 unit (compare then reports them)."""
    from shadow import _fused

    y, r = _sample(torch.float32, 4 * _fused.CHUNK + 5, seed=5, sprinkled=False)
    bound = _bound("tensor", r, torch.float32)
    k = 2 * _fused.CHUNK + 17  # in the third chunk only
    if case == "nan":
        y[k] = math.nan
    elif case == "overflow":  # |y - r| ** 2 overflows float64: the sum is infinite, an error
        r = r.clone()
        r[k] = 1e200
    elif case == "zero-small":  # below 1 unit: not reported
        r[k], y[k] = 0.0, torch.finfo(torch.float32).tiny / 4
    else:
        r[k], y[k] = 0.0, 1e-30
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = compare(y, r, torch.float32, bound)
    finally:
        torch.set_num_threads(old)
    _assert_same(got, _by_definition(y, r, torch.float32, bound))
    assert (got.zero_reference == 1) == (case == "zero-large")
    assert (got.nonfinite_device == 1) == (case == "nan")


@fused
def test_fused_pass_without_a_writable_cache(monkeypatch, tmp_path):
    """No cache directory numba can write (a read-only install and home): compiled each process, no error.
    A cache that cannot be saved at the first call (disk full): compiled again without it, no error."""
    import numba.core.caching
    from shadow import _fused

    def unwritable(self):
        raise PermissionError(13, "read-only", self.get_cache_path())

    y = torch.randn(300)
    r = y.double() + 2.0**-30
    want = compare(y, r, torch.float32)
    with monkeypatch.context() as m:
        m.setattr(numba.core.caching._CacheLocator, "ensure_cache_path", unwritable)
        m.setattr(_fused, "_passes", _fused.Passes(*_fused._passes.pairs))  # numba: "no locator available" -> no cache
        _assert_same(compare(y, r, torch.float32), want)
    with monkeypatch.context() as m:
        m.setattr(numba.config, "CACHE_DIR", str(tmp_path))  # an empty cache: the first call compiles and saves
        m.setattr(_fused, "_passes", _fused.Passes(*_fused._passes.pairs))
        m.setattr(numba.core.caching._CacheLocator, "ensure_cache_path", unwritable)  # fails at the save
        _assert_same(compare(y, r, torch.float32), want)


def test_without_numba_compare_takes_the_torch_passes_and_says_why():
    import subprocess
    import sys

    code = ("import sys; sys.modules['numba'] = None; import torch; from shadow import metrics; "
            "y = torch.randn(100_000); s = metrics.compare(y, y.double() + 2.0**-30, torch.float32); "
            "print(metrics.fused is None, metrics.FUSED_UNAVAILABLE, s.max_abs == 2.0**-30)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("True ModuleNotFoundError: import of numba") and out.strip().endswith("True")
