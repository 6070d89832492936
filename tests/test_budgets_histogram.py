"""The histogram family's budgets (histogram, histogramdd; histc beside them), held to PyTorch's CPU kernels: every
call of OpInfo's samples and of hand-made cases (elements on and within an ulp of edges, weights, density, given
edges, a range) judged by a derived bound and within it, the same bound held against float64 without shadow, and
faults of known size over it: a relative error of the weighted sums, one element counted in the wrong bin.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shadow import ShadowMode
from shadow.modes.faults import FaultMode
from test_budgets import Worst, _run_opinfo
from test_budgets_ops import Calls, holds_against_float64, used_by

pytestmark = pytest.mark.usefixtures("one_thread")

HISTOGRAM_OPS = {"aten.histogram.bin_ct", "aten.histogram.bins_tensor", "aten._histogramdd_from_bin_cts.default",
                 "aten._histogramdd_from_bin_tensors.default"}


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _around(edges: torch.Tensor) -> torch.Tensor:
    """Each float32 edge, and the float32 values one ulp below and above it."""
    e = edges.float()
    return torch.cat([e, e.nextafter(torch.tensor(-torch.inf)), e.nextafter(torch.tensor(torch.inf))])


def _data(n: int = 400, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=_g(seed)) * 1.5


def _weights(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, generator=_g(seed)) + 0.5  # both signs


def _on_edges_range(dtype, weight=False, density=False):
    # range (0, 0.3), 3 bins: edges 0.1, 0.2 are not floats, linspace rounds them; the elements sit on the float32
    # edges and one ulp either side, and at the range's ends
    x = torch.cat([_around(torch.linspace(0, 0.3, 4)), torch.rand(200, generator=_g(2)) * 0.4 - 0.05]).to(dtype)
    w = _weights(len(x)).to(dtype) if weight else None
    torch.histogram(x, bins=3, range=(0.0, 0.3), weight=w, density=density)


def _on_edges_data(dtype, weight=False, density=False):
    # no range: lo and hi are x's extremes, 10 bins between -2.5 and 3.5 (edges of 0.6, not floats)
    x = torch.cat([_around(torch.linspace(-2.5, 3.5, 11)), _data()]).clamp(-2.5, 3.5).to(dtype)
    w = _weights(len(x)).to(dtype) if weight else None
    torch.histogram(x, bins=10, weight=w, density=density)


def _given_edges(dtype, weight=False, density=False):
    edges = torch.tensor([-3.0, -1.1, -0.3, 0.0, 0.2, 0.7, 2.9]).to(dtype)  # uneven widths
    x = torch.cat([_around(edges), _data()]).to(dtype)
    w = _weights(len(x)).to(dtype) if weight else None
    torch.histogram(x, bins=edges, weight=w, density=density)


def _constant(dtype):
    torch.histogram(torch.full((7,), 0.3, dtype=dtype), bins=4)  # lo == hi: widened to [-0.2, 0.8]


def _dd_counts(dtype, weight=False, density=False, span=None):
    x = torch.cat([torch.stack([_around(torch.linspace(-1, 2, 4)), _around(torch.linspace(0, 1, 4))], 1),
                   torch.randn(300, 2, generator=_g(3))]).to(dtype)
    w = _weights(len(x)).to(dtype) if weight else None
    torch.histogramdd(x, bins=[3, 3], range=span, weight=w, density=density)


def _dd_edges(dtype, weight=False, density=False):
    e0, e1 = torch.tensor([-2.0, -0.5, 0.1, 1.5]), torch.tensor([-1.0, 0.3, 0.35, 2.0])
    x = torch.cat([torch.stack([_around(e0), _around(e1)], 1), torch.randn(300, 2, generator=_g(4))]).to(dtype)
    w = _weights(len(x)).to(dtype) if weight else None
    torch.histogramdd(x, bins=[e0.to(dtype), e1.to(dtype)], weight=w, density=density)


def _random(dtype, weight=False, density=False):
    x = _data().to(dtype)
    w = _weights(len(x)).to(dtype) if weight else None
    torch.histogram(x, bins=12, weight=w, density=density)


def _dd_random(dtype, weight=False, density=False, span=None):
    x = torch.randn(500, 3, generator=_g(6)).to(dtype)
    w = _weights(len(x)).to(dtype) if weight else None
    torch.histogramdd(x, bins=[4, 3, 5], range=span, weight=w, density=density)


def _many_counts(dtype):
    # 4000 elements in 4 bins: bfloat16 counts pass 256, where adding 1 no longer changes them
    torch.histogram(torch.rand(4000, generator=_g(5)).to(dtype), bins=4, range=(0.0, 1.0))


CASES: dict[str, tuple[str, Callable]] = {
    "range_on_edges": ("aten.histogram.bin_ct", _on_edges_range),
    "range_on_edges_weight": ("aten.histogram.bin_ct", lambda dt: _on_edges_range(dt, weight=True)),
    "range_on_edges_density": ("aten.histogram.bin_ct", lambda dt: _on_edges_range(dt, density=True)),
    "range_on_edges_weight_density": ("aten.histogram.bin_ct", lambda dt: _on_edges_range(dt, True, True)),
    "data_on_edges": ("aten.histogram.bin_ct", _on_edges_data),
    "data_on_edges_weight_density": ("aten.histogram.bin_ct", lambda dt: _on_edges_data(dt, True, True)),
    "constant": ("aten.histogram.bin_ct", _constant),
    "given_edges": ("aten.histogram.bins_tensor", _given_edges),
    "given_edges_weight": ("aten.histogram.bins_tensor", lambda dt: _given_edges(dt, weight=True)),
    "given_edges_density": ("aten.histogram.bins_tensor", lambda dt: _given_edges(dt, density=True)),
    "given_edges_weight_density": ("aten.histogram.bins_tensor", lambda dt: _given_edges(dt, True, True)),
    "dd_counts": ("aten._histogramdd_from_bin_cts.default", _dd_counts),
    "dd_counts_range_weight_density": ("aten._histogramdd_from_bin_cts.default",
                                       lambda dt: _dd_counts(dt, True, True, span=[-1.0, 2.0, 0.0, 1.0])),
    "dd_edges_weight": ("aten._histogramdd_from_bin_tensors.default", lambda dt: _dd_edges(dt, weight=True)),
    "dd_edges_density": ("aten._histogramdd_from_bin_tensors.default", lambda dt: _dd_edges(dt, density=True)),
    "random": ("aten.histogram.bin_ct", _random),
    "random_weight": ("aten.histogram.bin_ct", lambda dt: _random(dt, weight=True)),
    "random_weight_density": ("aten.histogram.bin_ct", lambda dt: _random(dt, True, True)),
    "dd_random_range_weight_density": ("aten._histogramdd_from_bin_cts.default",
                                       lambda dt: _dd_random(dt, True, True, span=[-2.0, 2.0, -1.0, 1.5, -3.0, 3.0])),
    "many_counts": ("aten.histogram.bin_ct", _many_counts),
}
PARAMS = [pytest.param(name, torch.float32, id=f"{name}-float32") for name in CASES] + \
    [pytest.param(name, torch.bfloat16, id=f"{name}-bfloat16")  # the kernels that run in bfloat16 (given a range)
     for name in ("range_on_edges_weight_density", "given_edges_weight", "given_edges_density", "dd_edges_density",
                  "dd_random_range_weight_density")]


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_correct_kernel_within_budget(name, dtype):
    op, run = CASES[name]
    assert max(used_by(lambda: run(dtype), op)) <= 1.0


def test_opinfo_samples_within_budget():
    """Every sample OpInfo has for histogram and histogramdd in float32 (histc in float32, bfloat16 and float16
    beside them), each call judged by a derived budget and within it."""
    from torch.testing._internal.common_methods_invocations import op_db

    worst = Worst()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in op_db:
            if op.name in ("histogram", "histogramdd"):
                _run_opinfo(op, torch.float32, worst, max_samples=1000)
            elif op.name == "histc":
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    _run_opinfo(op, dtype, worst, max_samples=1000)
    assert not worst.errors, worst.errors
    assert not set(worst.defaults) & (HISTOGRAM_OPS | {"aten.histc.default"}), worst.defaults
    seen = {op for op, _ in worst.worst}
    assert HISTOGRAM_OPS | {"aten.histc.default"} <= seen, seen
    assert not worst.over(), worst.over()


@pytest.mark.parametrize("name", list(CASES))
def test_bound_holds_against_float64_without_shadow(name):
    """The op on float32 inputs against the op in float64 on them upcast, no shadow involved: every finite
    element (counts, density and bin edges) within ``budget_for``'s bound."""
    calls = Calls(*HISTOGRAM_OPS)
    with calls:
        CASES[name][1](torch.float32)
    holds_against_float64(calls, torch.float32)


class _HistogramFault(TorchDispatchMode):
    """A histogram kernel whose hist (its first output) ``fault`` changes in place; bin_edges as computed."""

    def __init__(self, fault: Callable[[torch.Tensor], None]):
        super().__init__()
        self.fault = fault

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in HISTOGRAM_OPS:
            self.fault(out[0] if isinstance(out, tuple) else out)
        return out


def _times(rel: float) -> Callable[[torch.Tensor], None]:
    """Every bin times 1 + rel, rounded once to its dtype."""
    return lambda hist: hist.copy_(hist.double() * (1 + rel))


def _one_in_the_wrong_bin(hist: torch.Tensor) -> None:
    """One element of the fullest bin counted in the next bin (the one before, for the last)."""
    flat = hist.view(-1)
    k = int(flat.argmax())
    flat[k] -= 1
    flat[k + 1 if k + 1 < flat.numel() else k - 1] += 1


FAULTED = ["random_weight", "random_weight_density", "given_edges_weight", "given_edges_density",
           "dd_random_range_weight_density", "dd_edges_weight", "dd_edges_density"]


@pytest.mark.parametrize("name", FAULTED)
def test_relative_fault_over_budget(name):
    """Weighted sums and densities times 1 + 1e-3 (bin_edges left as computed): over budget."""
    op, run = CASES[name]
    assert max(used_by(lambda: run(torch.float32), op, _HistogramFault(_times(1e-3)))) > 1.0


def test_fault_mode_on_weighted_sums_over_budget():
    """FaultMode's 1e-3 on histogramdd's weighted sums (its only output)."""
    op, run = CASES["dd_edges_weight"]
    assert max(used_by(lambda: run(torch.float32), op, FaultMode(rel=1e-3, op=op))) > 1.0


@pytest.mark.parametrize("name", ["random", "constant", "given_edges", "dd_counts", "many_counts"])
def test_an_element_in_the_wrong_bin_is_over_budget(name):
    op, run = CASES[name]
    assert max(used_by(lambda: run(torch.float32), op, _HistogramFault(_one_in_the_wrong_bin))) > 1.0


def test_bincount_of_weights_within_its_sum_bound_and_a_fault_over_it():
    """bincount with weights sums each bin's weights in the result's dtype: within gamma_n(u) sum |w| of float64,
    a 1e-3 fault over it; counts without weights are integers (no budget)."""
    x = torch.randint(0, 20, (5000,), generator=_g(30))
    w = torch.randn(5000, generator=_g(31))

    def used(*outer) -> list:
        with contextlib.ExitStack() as stack:
            for m in outer:
                stack.enter_context(m)
            with ShadowMode(spot_checks="off") as sm:
                torch.bincount(x, weights=w, minlength=25)
                torch.bincount(x)
        weighted, counts = [r for r in sm.report.records if r.op == "aten.bincount.default"]
        assert counts.budget is None and counts.dtype == "torch.int64"
        return [weighted.budget]

    (correct,) = used()
    assert not correct.is_default and correct.used <= 1
    (faulty,) = used(FaultMode(rel=1e-3, op="bincount"))
    assert faulty.used > 1
