"""Spot checks (shadow/spot): verdicts where float64 is wrong, trusted ordinary ops, the sampling policy.

``check`` is called directly, as the engine calls it: the op's float64 inputs, the device's outputs, the
float64 reference's outputs and the device dtype.
"""

from __future__ import annotations

import fractions
import hashlib
import json
import math

import mpmath
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from shadow import ShadowMode
from shadow.options import ShadowOptionError
from shadow.references import estimate_cost_us, reference_for
from shadow.spot import (DEFAULT_SAMPLES, ESCALATE_CALLS, ESCALATED_SAMPLES, EVERY_CALL_FIRST, THEN_ONE_IN, SpotConfig,
                         SpotPolicy, SpotStats, drawn, next_drawn, sample_indices)

aten = torch.ops.aten
f32, f64 = torch.float32, torch.float64


@pytest.fixture(autouse=True)
def _reset_mpmath_precision():
    prec = mpmath.mp.prec
    yield
    assert mpmath.mp.prec == prec, "a spot check left mpmath's precision changed"
    mpmath.mp.prec = prec


def up(v):
    return v.to(f64, copy=True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def as_list(v) -> list:
    return list(v) if isinstance(v, (tuple, list)) else [v]


def check(op, args, kwargs=None, *, device=None, reference=None, policy=None, dtype=f32, priority=None):
    """Spot-check ``op(*args)``: the device runs it on ``args`` (fp32 unless given), the float64 reference on
    the upcast args; either result can be overridden. Returns (stats, samples)."""
    kwargs = kwargs or {}
    policy = policy if policy is not None else SpotPolicy.from_option("default")
    a64, k64 = [up(a) for a in args], {k: up(v) for k, v in kwargs.items()}
    dev = as_list(op(*args, **kwargs) if device is None else device)
    ref = as_list(op(*[up(a) for a in a64], **{k: up(v) for k, v in k64.items()}) if reference is None else reference)
    policy.wants(str(op))
    return policy.check(op, a64, k64, dev, ref, dtype, priority)


# --- float64 wrong: flagged untrusted, the exact value recovered ---
def test_sum_cancelling_inside_a_reduction_is_untrusted():
    # fp32(1e16) = 10000000272564224 = 2**53 * 1.11: float64's spacing there is 2, so 1e16 + 1 is a tie that
    # rounds to even (...224) and the row sums to 0 in float64 as in float32; the exact sum is 1.
    x = torch.tensor([[1e16, 1.0, -1e16]] * 8)
    s, samples = check(aten.sum.dim_IntList, (x, [1]))
    assert not s.trusted and s.checked
    assert s.samples == 8  # escalated (to 16 elements): every one of the 8 rows
    for smp in samples:
        assert (smp.exact, smp.reference, smp.device) == (1.0, 0.0, 0.0)
        assert smp.ref_err_ulp == 2.0**52  # |0 - 1| / spacing_f64(1) = 1 / 2**-52
        assert smp.device_err_ulp == 2.0**23  # 1 / spacing_f32(1) = 1 / 2**-23
        assert smp.cancellation == 2 * 10000000272564224.0  # sum |x| / |sum x| (the magnitude is a float64 scale)
    assert (s.ref_err_ulp, s.device_err_ulp, s.device_err_abs) == (2.0**52, 2.0**23, 1.0)


def exact_variance(row: torch.Tensor) -> float:
    """Unbiased variance, in exact rational arithmetic, correctly rounded to float64."""
    v = [fractions.Fraction(float(t)) for t in row]
    n = len(v)
    return float((n * sum(t * t for t in v) - sum(v) ** 2) / (n * (n - 1)))


def test_variance_with_a_large_mean_two_ways():
    # fp32 data 1e6 + N(0, 1) (spacing 1/16 at 1e6): var ~ 1 while E[x^2] ~ 1e12, so E[x^2] - E[x]^2 cancels
    # 12 digits and float64's ~1e-16 relative error on E[x^2] becomes ~1e-4 on the variance
    g = torch.Generator().manual_seed(1)
    x = 1e6 + torch.randn(4, 1000, generator=g)
    x64 = x.double()
    want = [exact_variance(row) for row in x64]
    # way 1: the float64 reference of aten.var (two-pass): trusted
    s, samples = check(aten.var.correction, (x,), {"dim": [1]})
    assert s.trusted and s.samples == 4  # cancellation ~1e12 escalates to all 4 rows
    assert [smp.exact for smp in sorted(samples, key=lambda t: t.index)] == want
    assert s.max_cancellation > 1e11  # (sum x^2 / (n-1)) / var
    # way 2: the same op with a reference computed as E[x^2] - E[x]^2 (what a naive decomposition replays)
    naive = ((x64 * x64).mean(1) - x64.mean(1) ** 2) * (1000 / 999)
    s2, samples2 = check(aten.var.correction, (x,), {"dim": [1]}, reference=naive)
    assert not s2.trusted
    assert s2.ref_err_ulp > 1e6  # the naive reference is off around the 4th digit: ~1e11 float64 ulps
    assert [smp.exact for smp in sorted(samples2, key=lambda t: t.index)] == want  # exact value recovered
    # the device (CPU float32 var accumulates in double) is right to about half an fp32 ulp
    assert s2.device_err_ulp == s.device_err_ulp < 2


def test_log_of_one_plus_x_versus_log1p_for_tiny_x():
    x = torch.tensor([2.0**-60, 1e-10, 3e-15, 1e-12])
    all_ = SpotPolicy.from_option("all")
    # log1p in float64: trusted, and the device's (fp32) log1p is within half an ulp
    s, _ = check(aten.log1p.default, (x,), policy=all_)
    assert s.trusted and s.samples == 4 and s.device_err_ulp <= 0.5
    # the reference computed as log(1 + x): 1 + 2**-60 rounds to 1 in float64, so log gives 0
    s2, samples2 = check(aten.log1p.default, (x,), reference=torch.log(1 + x.double()), policy=SpotPolicy.from_option("all"))
    assert not s2.trusted and s2.samples == 4
    first = next(smp for smp in samples2 if smp.index == (0,))
    # log1p(2**-60) = 2**-60 - 2**-121 + ...: in [2**-61, 2**-60) float64's spacing is 2**-113, and 2**-121 is
    # below half of it, so the exact value rounds to 2**-60 itself; the reference is 0
    assert (first.exact, first.reference) == (2.0**-60, 0.0)
    # its error in float64 ulps: (2**-60 - 2**-121 + ...) / 2**-113 = 2**53 - 2**-8 + ...
    assert first.ref_err_ulp == pytest.approx(2.0**53, rel=1e-15)
    # every x here is below 2**-40: 1 + x keeps at most 12 of x's 24 bits (an fp32 x >= 2**-29 would fit exactly)
    assert all(not smp.trusted for smp in samples2)


def test_dot_product_cancelling_to_1e12_of_its_magnitude():
    # a . b = sum u_i v_i - sum u_i v_i + t = t exactly (the pairs cancel), with t ~ 1e-12 * sum |a_i b_i|;
    # the terms are shuffled so float64's partial sums round before they cancel
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(128, generator=g), torch.randn(128, generator=g)
    mag = 2 * float((u.double() * v.double()).abs().sum())
    t = float(torch.tensor(1e-12 * mag, dtype=f32))  # an fp32 number: the exact result
    a, b = torch.cat([u, u, torch.tensor([t])]), torch.cat([v, -v, torch.tensor([1.0])])
    perm = torch.randperm(257, generator=g)
    A, B = a[perm].view(1, 257), b[perm].view(257, 1)
    ref = A.double() @ B.double()
    assert ref.item() != t  # float64 does not get it right (fixed seed: checked once, holds)
    # a device that accumulates exactly (or luckily) returns t: float64 is now the less accurate of the two
    s, samples = check(aten.mm.default, (A, B), device=torch.tensor([[t]]))
    (smp,) = samples
    assert not s.trusted and smp.exact == t and s.device_err_abs == 0.0
    assert s.max_cancellation == pytest.approx((mag + t) / t, rel=1e-6)  # ~1e12
    # a plain fp32 device errs ~1e-7 * magnitude, thousands of times float64's error: then float64 is trusted
    s2, _ = check(aten.mm.default, (A, B))
    assert s2.trusted and s2.device_err_abs > 100 * abs(ref.item() - t)


# --- ordinary fp32 data: trusted ---
def _data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


ORDINARY = [
    (aten.mm.default, lambda: (_data(16, 64), _data(64, 8, seed=1)), {}),
    (aten.addmm.default, lambda: (_data(8), _data(16, 64, seed=1), _data(64, 8, seed=2)), {}),
    (aten.add.Tensor, lambda: (_data(32, 8), _data(32, 8, seed=1)), {}),
    (aten.mul.Tensor, lambda: (_data(32, 8), _data(32, 8, seed=1)), {}),
    (aten.div.Tensor, lambda: (_data(32, 8), _data(32, 8, seed=1)), {}),
    (aten.exp.default, lambda: (_data(32, 8),), {}),
    (aten.log.default, lambda: (_data(32, 8).abs() + 0.1,), {}),
    (aten.sqrt.default, lambda: (_data(32, 8).abs(),), {}),
    (aten.tanh.default, lambda: (_data(32, 8),), {}),
    (aten.sigmoid.default, lambda: (_data(32, 8),), {}),
    (aten.gelu.default, lambda: (_data(32, 8),), {}),
    (aten.relu.default, lambda: (_data(32, 8),), {}),
    (aten._softmax.default, lambda: (_data(16, 32), -1, False), {}),
    (aten._log_softmax.default, lambda: (_data(16, 32), -1, False), {}),
    (aten.native_layer_norm.default, lambda: (_data(8, 64), [64], _data(64, seed=1), _data(64, seed=2), 1e-5), {}),
    (aten.sum.dim_IntList, lambda: (_data(16, 256), [1]), {}),
    (aten.mean.default, lambda: (_data(64, 64),), {}),
    (aten.var.correction, lambda: (_data(16, 256),), {"dim": [1]}),
]


@pytest.mark.parametrize("op, make, kwargs", ORDINARY, ids=[str(o[0]) for o in ORDINARY])
def test_random_fp32_data_gives_trusted_verdicts(op, make, kwargs):
    s, samples = check(op, make(), kwargs, policy=SpotPolicy.from_option(4))
    assert s.checked and s.trusted, s
    assert s.samples == len(samples) >= 1
    # float64 stays far inside its 29 bits of headroom, and correct fp32 kernels are within a few ulps
    assert s.ref_err_ulp < 2.0**10 and s.device_err_ulp < 2.0**6


class _SpotHarness(TorchDispatchMode):
    """What the engine hook does, minus shadows: float64 replay on the device's inputs, then check."""

    def __init__(self, policy: SpotPolicy):
        super().__init__()
        self.policy, self.stats = policy, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.policy.wants(str(func)):
            return func(*args, **kwargs)
        a64, k64 = tree_map(up, args), tree_map(up, kwargs)  # before the op: in-place ops overwrite args
        out = func(*args, **kwargs)
        ref = func(*tree_map(up, a64), **tree_map(up, k64))
        dev = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        refs = [t for t in tree_flatten(ref)[0] if isinstance(t, torch.Tensor)]
        self.stats.append((str(func), self.policy.check(func, a64, k64, dev, refs, dev[0].dtype)[0]))
        return out


def test_ordinary_training_step_gives_only_trusted_spot_checks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    h = _SpotHarness(SpotPolicy.from_option("default"))
    with h:
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x).softmax(-1).log(), y).backward()
            opt.step()
    checked = {op for op, s in h.stats if s.checked}
    assert {"aten.addmm.default", "aten.mm.default", "aten.gelu.default", "aten.native_layer_norm.default",
            "aten._softmax.default", "aten.log.default", "aten.nll_loss_forward.default",
            "aten.sqrt.default"} <= checked
    assert all(s.trusted for _, s in h.stats), [(op, s) for op, s in h.stats if not s.trusted]


# --- units and the verdict rule, on hand-made values ---
def test_errors_in_ulps_and_the_one_percent_rule():
    one, tiny = torch.tensor([1.0], dtype=f64), torch.tensor([2.0**-30], dtype=f64)
    # exact 1 + 2**-30; device fp32 1.0: |err| = 2**-30 = 2**-7 fp32 ulps at 1 (spacing 2**-23);
    # reference 1.0 too: |err| = 2**-30 = 2**22 float64 ulps (spacing 2**-52). Half an fp32 ulp (2**-24) is
    # above the device's error, so tol = 0.01 * 2**-24 = 5.96e-10 < 2**-30 = 9.31e-10: untrusted
    s, _ = check(aten.add.Tensor, (one, tiny), device=torch.tensor([1.0]), reference=torch.tensor([1.0], dtype=f64))
    assert (s.device_err_ulp, s.device_err_abs, s.ref_err_ulp, s.trusted) == (2.0**-7, 2.0**-30, 2.0**22, False)
    # the exact reference (1 + 2**-30 is a float64 number): trusted, error 0
    s, _ = check(aten.add.Tensor, (one, tiny), device=torch.tensor([1.0]), reference=one + tiny)
    assert (s.ref_err_ulp, s.trusted) == (0.0, True)
    # an exactly rounded device with error 2**-60 and a correctly rounded reference with the same error:
    # against the device's error alone float64 would be "untrusted" (100%), but the floor of half an fp32
    # ulp (2**-24) makes the tolerance 0.01 * 2**-24 >> 2**-60: trusted
    s, _ = check(aten.add.Tensor, (one, torch.tensor([2.0**-60], dtype=f64)), device=torch.tensor([1.0]),
                 reference=one.clone())
    assert s.trusted and s.ref_err_ulp == 2.0**-8 and s.device_err_abs == 2.0**-60


def test_ulps_below_the_smallest_normal_use_the_subnormal_spacing():
    # exact 2**-141 + 2**-141 = 2**-140 (fp32 subnormal: spacing 2**-149); device one step above
    h = torch.tensor([2.0**-141], dtype=f64)
    dev = torch.tensor([2.0**-140 + 2.0**-149])
    s, _ = check(aten.add.Tensor, (h, h), device=dev)
    assert s.device_err_ulp == 1.0 and s.device_err_abs == 2.0**-149 and s.ref_err_ulp == 0.0 and s.trusted
    # bfloat16 (7 stored bits): exact 3.0, device 3.015625 = 3 + 2**-6 -> one ulp (spacing at [2, 4) is 2**-6)
    three = torch.tensor([1.5], dtype=f64)
    s, _ = check(aten.add.Tensor, (three, three), device=torch.tensor([3.015625], dtype=torch.bfloat16),
                 dtype=torch.bfloat16)
    assert s.device_err_ulp == 1.0 and s.device_err_abs == 2.0**-6


def test_an_exact_value_that_is_a_float64_number_is_judged_as_mpmath_judges_it():
    """Where the exact value is itself a normal float64 number (products and sums of narrow values, data
    movement), the judge takes its differences in float64 arithmetic: the same numbers as mpmath's exact
    difference rounded once to nearest, exponent gaps and ties to even included."""
    from shadow.references import Exact
    from shadow.spot.verdict import _abs_diff, judge_sample

    gen = torch.Generator().manual_seed(0)
    mant = torch.randint(1, 2**53, (3000,), generator=gen, dtype=torch.int64).tolist()
    exps = torch.randint(-1100, 880, (3000,), generator=gen).tolist()
    gaps = torch.randint(-80, 80, (3000,), generator=gen).tolist()
    pairs = [(math.ldexp(m, e), math.ldexp(m2, e + g)) for m, m2, e, g in zip(mant, mant[1:] + mant[:1], exps, gaps)]
    pairs += [(2.0**54, 1.0), (2.0**54 + 4, 1.0), (2.0**54, 3.0), (1.0, 2.0**-53), (1.5, 2.0**-1022),
              (2.0**-1022, 2.0**-1021)]  # ties to even, the edge of the normal range
    judged = 0
    for x, a in pairs:
        if abs(x) < 2.0**-1022:
            continue
        for r, y in ((a, x), (x, a), (-a, x)):
            s = judge_sample(Exact.plain(mpmath.mpf(x)), r, y, f32, 0, (0,))
            assert s.exact == x
            assert s.ref_err_ulp * 2.0 ** (math.frexp(x)[1] - 53) == _abs_diff(r, mpmath.mpf(x)), (x, r)
            if math.isfinite(y):
                assert s.device_err_abs == _abs_diff(y, mpmath.mpf(x)), (x, y)
            judged += 1
    assert judged > 8000


def test_non_finite_values():
    a, b = torch.tensor([0.0, 1.0], dtype=f64), torch.tensor([0.0, 3.0], dtype=f64)
    ref = a / b  # [nan, 1/3]

    def all_():
        return SpotPolicy.from_option("all")

    # exact 0/0 = nan, matched by the reference; device inf where the exact value is 1/3: left out of the
    # device figures (counted apart by shadow.metrics), and any finite reference is within 1% of infinity
    s, samples = check(aten.div.Tensor, (a, b), device=torch.tensor([math.nan, math.inf]), reference=ref, policy=all_())
    assert s.trusted and s.samples == 2 and s.device_err_ulp == 0.0 and s.device_err_abs == 0.0
    assert math.isnan(next(smp for smp in samples if smp.index == (0,)).exact)
    # a reference that overflowed where the exact value is finite: untrusted, infinitely wrong
    s, _ = check(aten.div.Tensor, (a, b), reference=torch.tensor([math.nan, math.inf], dtype=f64), policy=all_())
    assert not s.trusted and s.ref_err_ulp == math.inf


def test_multi_output_ops_check_every_covered_output():
    x = _data(4, 16)
    s, samples = check(aten.native_layer_norm.default, (x, [16], None, None, 1e-5), policy=SpotPolicy.from_option(2))
    assert s.trusted and sorted({smp.output for smp in samples}) == [0, 1, 2]
    assert s.samples == 6  # 2 per output
    s, samples = check(aten.var_mean.correction, (x,), {"dim": [1]}, policy=SpotPolicy.from_option(1))
    assert s.trusted and sorted(smp.output for smp in samples) == [0, 1]


def test_in_place_ops_read_the_inputs_from_before_the_call():
    x, y = _data(8, 8), _data(8, 8, seed=1)
    before = x.double()
    dev = x.add_(y)  # the device op: x now holds x + y
    pol = SpotPolicy.from_option(3)
    assert pol.wants("aten.add_.Tensor")
    s, _ = pol.check(aten.add_.Tensor, (before, y.double()), {}, [dev], [before + y.double()], f32)
    assert s.trusted and s.samples == 3 and s.device_err_ulp <= 0.5  # fp32 addition is correctly rounded


# --- what cannot be checked ---
def test_ops_without_a_reference_are_reported_never_guessed():
    pol = SpotPolicy.from_option("default")
    assert not pol.wants("aten.index_add.default")  # nothing to snapshot
    x = torch.zeros(4, 3, dtype=f64)
    s, _ = pol.check(aten.index_add.default, (x, 0, torch.tensor([0, 2]), torch.ones(2, 3, dtype=f64)), {},
                  [torch.zeros(4, 3)], [x], f32)
    assert s == SpotStats(samples=0, reason="no mpmath reference for aten.index_add.default")
    assert s.trusted and not s.checked  # no evidence against the reference; samples == 0 says nothing was checked


def test_elements_too_costly_are_skipped_with_the_reason():
    # a softmax element evaluates one exp per term of its row in mpmath (~10 us each): 20000 terms ~ 0.2 s
    x = torch.zeros(1, 20000)
    s, _ = check(aten._softmax.default, (x, -1, False))
    assert not s.checked and "20000 terms" in s.reason and "per-element cap" in s.reason
    # an exact sum is ~0.04 us per term: a mean of 4M elements is over the cap too
    s, _ = check(aten.mean.default, (torch.zeros(2048, 2048),))
    assert not s.checked and "4194304 terms" in s.reason


def test_all_checks_every_element_of_small_outputs_only():
    s, _ = check(aten.exp.default, (_data(5, 7),), policy=SpotPolicy.from_option("all"))
    assert s.samples == 35 and s.trusted
    s, _ = check(aten.exp.default, (_data(100, 100),), policy=SpotPolicy.from_option("all"))
    assert not s.checked and "at most 4096 elements" in s.reason and "10000" in s.reason


# --- sampling: determinism, priority, escalation, budget ---
def test_samples_are_deterministic_for_a_seed():
    def run(seed):
        pol = SpotPolicy(SpotConfig(seed=seed))
        picks = []
        for i in range(3):
            for op, args in ((aten.exp.default, (_data(64, 64, seed=i),)), (aten.mm.default, (_data(32, 16), _data(16, 32)))):
                _, samples = check(op, args, policy=pol)
                picks.append([(smp.output, smp.index) for smp in samples])
        return picks

    a, b, c = run(0), run(0), run(1)
    assert a == b
    assert a != c
    assert len({tuple(p) for p in a[0::2]}) == 3  # successive calls of one op get different elements
    assert sample_indices(7, "aten.exp.default", 3, 0, 10**6, 5) == sample_indices(7, "aten.exp.default", 3, 0, 10**6, 5)


def test_the_sample_stream_is_splitmix64_so_positions_are_the_same_everywhere():
    """The draws are SplitMix64's (its published outputs from state 0), seeded by a hash that does not depend on
    the process (str hashes do), so a report's sampled positions can be recomputed on any machine; shuffles are
    permutations and draws cover their range evenly."""
    from shadow.spot.sampling import _Stream

    s = _Stream.__new__(_Stream)
    s._x = 0
    assert [s.below(2**64) for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    key = b"0:aten.mm.default:1:0"
    assert _Stream(key.decode())._x == int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    items = list(range(10))
    _Stream("k").shuffle(items)
    assert sorted(items) == list(range(10)) and items != list(range(10))
    counts = [0] * 8
    rng = _Stream("uniform")
    for _ in range(8000):
        counts[rng.below(8)] += 1
    assert all(850 <= c <= 1150 for c in counts)  # 1000 each; 4.7 standard deviations either side
    assert sample_indices(0, "op", 1, 0, 5, 5) != list(range(5)) and sorted(sample_indices(0, "op", 1, 0, 5, 5)) == list(range(5))
    # the calls drawn: call n is drawn when the n-th draw of a stream seeded by the op's key is 0 modulo 16
    stream = _Stream("0:aten.mm.default")
    want = [stream.below(16) == 0 for _ in range(400)]
    assert [drawn(0, "aten.mm.default", n, 16) for n in range(1, 401)] == want and 10 <= sum(want) <= 40
    # the policy asks for the next call drawn once per call drawn
    last = max(n for n in range(1, 401) if want[n - 1])
    assert [next_drawn(0, "aten.mm.default", n, 16) for n in range(last)] == \
        [next(m for m in range(n + 1, last + 1) if want[m - 1]) for n in range(last)]


def test_highest_priority_elements_are_checked_first():
    prio = torch.zeros(8, 8, dtype=f64)
    prio[5, 2], prio[1, 7] = 10.0, 5.0
    _, samples = check(aten.mm.default, (_data(8, 4), _data(4, 8)), priority=[prio], policy=SpotPolicy.from_option(4))
    assert [smp.index for smp in samples[:2]] == [(5, 2), (1, 7)]  # ceil(4/2) by priority, then 2 at random
    assert len({smp.index for smp in samples}) == 4
    assert sample_indices(0, "op", 1, 0, 64, 3, prio)[:2] == [5 * 8 + 2, 1 * 8 + 7]


@pytest.mark.parametrize("n", [1000, 3 * 2**15 + 7])  # one chunk; chunks on both threads
def test_the_condition_estimates_largest_element_in_one_pass_is_the_ranked_ones(n):
    """The engine's spot-check priority, bound / |r|, computed when asked: its largest element alone by one
    pass (shadow._fused) where both tensors are contiguous CPU float64, the first of equal ones, never a NaN
    (0/0); the same position as ranking the materialized quotient, bound tensor or one-element bound; more
    positions than one rank the quotient."""
    from shadow.engine.spotcheck import Condition
    from shadow.scratch import Scratch
    from shadow.spot.sampling import top_positions

    g = torch.Generator().manual_seed(n)
    r = torch.randn(n, dtype=f64, generator=g)
    bound = r.abs() * (1 + torch.rand(n, dtype=f64, generator=g))
    r[::7], bound[::14] = 0.0, 0.0  # 0/0 (NaN) and x/0 (inf)
    for b in (bound, bound[1:2].clone(), bound.clone().fill_(1.0)):
        for rr in (r, r.clone().fill_(2.0)):  # all equal quotients: the first position
            c = Condition(b, rr, Scratch())
            want = top_positions(c.tensor(), 1)
            assert c.top(1) == want, (b.numel(), c.top(1), want)
            assert c.top(3) == top_positions(c.tensor(), 3)
    nan = Condition(torch.zeros(n, dtype=f64), torch.zeros(n, dtype=f64), Scratch())
    assert nan.top(1) == []  # every quotient NaN: no position by priority (random ones fill in)
    if n > 2**15:  # the largest quotient in the third chunk, past the first thread's
        r2, b2 = torch.ones(n, dtype=f64), torch.ones(n, dtype=f64)
        b2[2 * 2**15 + 5] = 9.0
        assert Condition(b2, r2, Scratch()).top(1) == [2 * 2**15 + 5]


def test_a_cancelling_call_gets_more_samples_than_a_benign_one():
    benign = (_data(64, 3), [1])
    cancelling = (torch.tensor([[1e16, 1.0, -1e16]] * 64), [1])
    pol = SpotPolicy.from_option("default")
    s, _ = check(aten.sum.dim_IntList, benign, policy=pol)
    assert s.samples == DEFAULT_SAMPLES and s.trusted
    s, _ = check(aten.sum.dim_IntList, cancelling, policy=pol)
    assert s.samples == ESCALATED_SAMPLES and not s.trusted
    # the op's next calls stay escalated for ESCALATE_CALLS calls, then fall back to the default
    counts = [check(aten.sum.dim_IntList, benign, policy=pol)[0].samples for _ in range(ESCALATE_CALLS + 2)]
    assert counts == [ESCALATED_SAMPLES] * ESCALATE_CALLS + [DEFAULT_SAMPLES] * 2
    # other ops are not escalated by it
    assert check(aten.exp.default, (_data(64, 3),), policy=pol)[0].samples == DEFAULT_SAMPLES


def test_escalation_is_bounded_by_its_budget():
    cancelling = (torch.tensor([[1e16, 1.0, -1e16]] * 64), [1])
    # no budget: a risky call keeps its default samples
    pol = SpotPolicy(SpotConfig(escalation_budget_us=0.0, escalation_refill_us=0.0))
    assert check(aten.sum.dim_IntList, cancelling, policy=pol)[0].samples == DEFAULT_SAMPLES
    # a budget for 10 extra elements (each estimated at 100 us + 3 terms * 0.04 us), earned 1 per call
    cost = estimate_cost_us(aten.sum.dim_IntList, (cancelling[0].double(), [1]), {}, 64)[0]
    pol = SpotPolicy(SpotConfig(escalation_budget_us=10 * cost, escalation_refill_us=0.0))
    counts = [check(aten.sum.dim_IntList, cancelling, policy=pol)[0].samples for _ in range(3)]
    assert counts == [DEFAULT_SAMPLES + 10, DEFAULT_SAMPLES, DEFAULT_SAMPLES]
    # refilled by one element per op call seen, any op's: the calls between two risky ones pay for their extras
    pol = SpotPolicy(SpotConfig(escalation_budget_us=10 * cost, escalation_refill_us=cost))
    counts = [check(aten.sum.dim_IntList, cancelling, policy=pol)[0].samples for _ in range(2)]
    for _ in range(3):
        check(aten.exp.default, (_data(8, 3),), policy=pol)
    counts.append(check(aten.sum.dim_IntList, cancelling, policy=pol)[0].samples)
    assert counts == [DEFAULT_SAMPLES + 10, DEFAULT_SAMPLES + 1, DEFAULT_SAMPLES + 4]


def _spot_checked_calls(option, calls=400):
    """The call numbers (1-based, per op) of aten.exp that ShadowMode spot-checked in a chain of ``calls``."""
    x = torch.linspace(-1, 1, 8)
    with ShadowMode(spot_checks=option) as mode:
        for _ in range(calls):
            x = torch.exp(x).neg()
    exps = [r for r in mode.report.records if r.op == "aten.exp.default"]
    assert len(exps) == calls and mode.report.by_op["aten.exp.default"].spot_checked == \
        sum(r.spot is not None for r in exps)
    return [n for n, r in enumerate(exps, 1) if r.spot is not None]


def test_default_checks_an_ops_first_calls_then_one_in_sixteen_the_same_in_every_run():
    checked = _spot_checked_calls("default")
    assert checked[:EVERY_CALL_FIRST] == list(range(1, EVERY_CALL_FIRST + 1))
    later = checked[EVERY_CALL_FIRST:]
    # 384 later calls, each drawn with probability 1/16: 24 expected, 12..40 at over 4 standard deviations
    assert 12 <= len(later) <= 40, later
    assert later == [n for n in range(EVERY_CALL_FIRST + 1, 401) if drawn(0, "aten.exp.default", n, THEN_ONE_IN)]
    assert _spot_checked_calls("default") == checked  # the same calls in every run
    # a count asks for every call
    assert _spot_checked_calls(DEFAULT_SAMPLES) == list(range(1, 401))
    assert _spot_checked_calls({"aten.exp": 1}) == list(range(1, 401))


def test_default_stops_after_the_first_calls_of_an_op_that_rounds_once():
    # neg and mul round once in float64 (neg not at all): their first calls are checked, later ones are not drawn
    x = torch.linspace(-1, 1, 8)
    with ShadowMode() as mode:
        for _ in range(200):
            x = torch.exp(x).neg() * 1.0001
    for op, later in (("aten.exp.default", True), ("aten.neg.default", False), ("aten.mul.Tensor", False)):
        checked = [n for n, r in enumerate((r for r in mode.report.records if r.op == op), 1) if r.spot is not None]
        assert checked[:EVERY_CALL_FIRST] == list(range(1, EVERY_CALL_FIRST + 1)), op
        assert checked[EVERY_CALL_FIRST:] == ([n for n in range(EVERY_CALL_FIRST + 1, 201)
                                               if drawn(0, op, n, THEN_ONE_IN)] if later else []), op
        assert mode.report.by_op[op].spot_checked == len(checked)


def _wide(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n values of ``dtype`` over its whole range, subnormals and zeros of both signs included."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    exps = torch.randint(int(math.log2(info.smallest_normal)) - 10, int(math.log2(info.max)), (n,), generator=g)
    x = (torch.rand(n, generator=g, dtype=f64) + 1) * torch.pow(2.0, exps.to(f64))
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, 1.0, 0.5])
    return x


@pytest.mark.parametrize("dtype", [f32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op, operand", [(aten.mul.Tensor, "tensor"), (aten.mul.Tensor, "scalar"),
                                         (aten.neg.default, None), (aten.abs.default, None), (aten.relu.default, None),
                                         (aten.sqrt.default, None), (aten.reciprocal.default, None)], ids=str)
def test_an_op_that_rounds_once_has_a_trusted_reference_everywhere(op, operand, dtype):
    # the claim behind Reference.rounds_once (docs/spot-checks.md): float64 rounds each element once from the
    # inputs, so its error is at most 2**-53 of the value, 2**-21 of the trust tolerance on a device of <= 24 bits.
    # Checked on every element over the device dtype's whole range (mul also by a float64 Python scalar)
    assert reference_for(op).rounds_once and not reference_for(aten.exp.default).rounds_once
    x = _wide(4096, dtype, 1)
    args = {"tensor": (x, _wide(4096, dtype, 2)), "scalar": (x, 1.0001), None: (x,)}[operand]
    if op is aten.sqrt.default:
        args = (x.abs(),)
    s, samples = check(op, args, policy=SpotPolicy.from_option("all"), dtype=dtype)
    assert s.samples == 4096 and s.trusted and not any(smp.risky for smp in samples), s


def test_a_risky_call_escalates_the_next_calls_whether_drawn_or_not():
    name, op = "aten.sum.dim_IntList", aten.sum.dim_IntList
    benign, cancelling = _data(64, 3), torch.tensor([[1e16, 1.0, -1e16]] * 64)
    # a drawn call past the every-call ones, followed by an undrawn one: that call cancels
    risky = next(n for n in range(EVERY_CALL_FIRST + 1, 10_000)
                 if drawn(0, name, n, THEN_ONE_IN) and not drawn(0, name, n + 1, THEN_ONE_IN))
    pol = SpotPolicy.from_option("default")
    wanted, samples = [], []
    for n in range(1, risky + ESCALATE_CALLS + 41):
        wanted.append(pol.wants(name))
        if wanted[-1]:
            x = cancelling if n == risky else benign
            s, _ = pol.check(op, [up(x), [1]], {}, [op(x, [1])], [op(up(x), [1])], f32)
            assert s.trusted == (n != risky)
            samples.append(s.samples)
    assert wanted[:EVERY_CALL_FIRST] == [True] * EVERY_CALL_FIRST
    after = wanted[risky:]  # the calls after the risky one: escalated, then drawn again
    assert after[:ESCALATE_CALLS] == [True] * ESCALATE_CALLS
    assert after[ESCALATE_CALLS:] == [drawn(0, name, n, THEN_ONE_IN)
                                      for n in range(risky + ESCALATE_CALLS + 1, risky + ESCALATE_CALLS + 41)]
    assert samples[-(ESCALATE_CALLS + 1 + sum(after[ESCALATE_CALLS:])):][:ESCALATE_CALLS + 1] == \
        [ESCALATED_SAMPLES] * (ESCALATE_CALLS + 1)


def test_estimated_costs_follow_the_reduction_length():
    mm = estimate_cost_us(aten.mm.default, (torch.ones(4, 1024), torch.ones(1024, 4)), {}, 16)
    sm = estimate_cost_us(aten._softmax.default, (torch.ones(4, 128), -1, False), {}, 512)
    ex = estimate_cost_us(aten.exp.default, (torch.ones(4, 128),), {}, 512)
    mean = estimate_cost_us(aten.mean.default, (torch.ones(64, 64),), {}, 1)
    assert (mm[1], sm[1], ex[1], mean[1]) == (1024, 128, 1, 4096)
    assert ex[0] < mm[0] < sm[0]  # exact sums are cheap per term, mpmath exps are not


# --- options ---
@pytest.mark.parametrize(
    "value, mode, counts",
    [
        ("off", "off", {"aten.mm.default": 0}),
        (0, "off", {"aten.mm.default": 0}),
        ("default", "default", {"aten.mm.default": DEFAULT_SAMPLES, "aten.exp.default": DEFAULT_SAMPLES}),
        (5, "count", {"aten.mm.default": 5}),
        ("all", "all", {"aten.mm.default": "all"}),
        ({"aten.mm": 8}, "per_op", {"aten.mm.default": 8, "aten.exp.default": 0}),
        ({"aten.mm.default": "all", "default": 1}, "per_op", {"aten.mm.default": "all", "aten.mm.out": 1,
                                                               "aten.exp.default": 1}),
        ({aten.exp: 3}, "per_op", {"aten.exp.default": 3, "aten.exp.out": 3, "aten.mm.default": 0}),
    ],
)
def test_valid_options(value, mode, counts):
    pol = SpotPolicy.from_option(value)
    assert pol.config.mode == mode
    for op, n in counts.items():
        assert pol.config.count_for(op) == n
        assert pol.wants(op) == (n != 0)
    assert SpotPolicy.from_option(pol) is pol


@pytest.mark.parametrize(
    "value, says",
    [
        ("sometimes", "unknown mode"),
        (-1, "must be >= 0"),
        (True, "(bool)"),
        (2.5, "(float)"),
        (None, "(NoneType)"),
        (["aten.mm"], "(list)"),
        ({"aten.mmm": 1}, "names no op"),
        ({"mm": 1}, "names no op"),
        ({"aten.mm": -2}, "is not a count"),
        ({"aten.mm": "some"}, "is not a count"),
        ({"aten.index_add": 1}, "no mpmath reference"),
        ({3: 1}, "is not an op name"),
    ],
)
def test_invalid_options_list_the_valid_forms(value, says):
    with pytest.raises(ShadowOptionError) as exc:
        SpotPolicy.from_option(value)
    msg = str(exc.value)
    assert says in msg
    if "no mpmath reference" not in msg:
        assert "'off', 'default', 'all'" in msg and "int >= 0" in msg and "aten.mm.default" in msg


def test_off_checks_nothing():
    pol = SpotPolicy.from_option("off")
    assert not pol.wants("aten.exp.default")
    assert pol.check(aten.exp.default, (torch.ones(2, dtype=f64),), {}, [torch.ones(2)], [torch.ones(2, dtype=f64)],
                     f32) == (None, [])


# --- records ---
def test_stats_round_trip_through_json():
    s = SpotStats(samples=3, ref_err_ulp=2.0**52, device_err_ulp=0.5, device_err_abs=1e-8,
                  max_cancellation=math.inf, trusted=False)
    d = s.to_dict()
    assert set(d) == {"samples", "ref_err_ulp", "device_err_ulp", "device_err_abs", "max_cancellation", "trusted",
                      "reason"}
    assert SpotStats.from_dict(json.loads(json.dumps(d))) == s
    saved = dict(d, max_cancellation="inf")  # how shadow.report writes non-finite numbers
    assert SpotStats.from_dict(saved) == s
    assert SpotStats.from_dict(SpotStats(reason="no mpmath reference for aten.foo.default").to_dict()).reason == \
        "no mpmath reference for aten.foo.default"
