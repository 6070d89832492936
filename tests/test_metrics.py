"""The error units (shadow.metrics), golden values by hand, and agreement of the three comparison paths
(Python loop for tiny results, numpy for small ones, torch with scratch buffers for large ones)."""

import math

import pytest
import torch

from shadow import metrics
from shadow.metrics import ErrorStats, compare, count_flips

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
