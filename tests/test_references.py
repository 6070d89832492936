"""High-precision references (shadow/references/): golden values, agreement with float64, exact paths."""

from __future__ import annotations

import math
import time

import mpmath
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shadow import references as R
from shadow.references import (
    Exact,
    NoReference,
    exact_dot,
    exact_sum,
    reference,
    reference_for,
    register_reference,
    to_float64,
    working_precision,
)
from shadow.references.exact import extract_parts, float64_array, fsum_parts

aten = torch.ops.aten
f64 = torch.float64
mp = mpmath.mp


@pytest.fixture(autouse=True)
def _reset_mpmath_precision():
    """As in mpmath's own tests: whatever a test does, the global precision comes back. The tests'
    own arithmetic (expected values) runs at 300 bits."""
    prec = mp.prec
    mp.prec = 300
    yield
    mp.prec = prec


def ref(op, *args, index=(), output=0, **kwargs) -> Exact:
    return reference(op, args, kwargs, index, output=output)


def T(*v, dtype=f64) -> torch.Tensor:
    return torch.tensor(v, dtype=dtype)


def X(v: float) -> mpmath.mpf:
    """The exact binary value of a float literal (mpf(float) is exact)."""
    return mpmath.mpf(v)


def assert_close(e: Exact, expected, rel: float = 2.0**-120) -> None:
    """``e.value`` within ``rel`` of ``expected`` (evaluated at 300 bits); exact 0 / inf / nan compared as such."""
    with mpmath.workprec(300):
        want = mpmath.mpf(expected) if not isinstance(expected, mpmath.mpf) else expected
        got = e.value
        if mpmath.isnan(want):
            assert mpmath.isnan(got), (got, want)
        elif mpmath.isinf(want) or want == 0:
            assert got == want, (got, want)
        else:
            assert abs(got - want) <= rel * abs(want), (mpmath.nstr(got, 40), mpmath.nstr(want, 40))


_import_prec, mp.prec = mp.prec, 300  # golden constants and tables are built at 300 bits (restored at the end)
E = mpmath.mpf("2.71828182845904523536028747135266249775724709369995957496697")  # Euler's number
LN2 = mpmath.mpf("0.693147180559945309417232121458176568075500134360255254120680")
SQRT2 = mpmath.mpf("1.41421356237309504880168872420969807856967187537694807317668")
PHI_1 = mpmath.mpf("0.841344746068542948585232545632037922477")  # standard normal CDF at 1


# --- precision handling ---
def test_working_precision_sets_guard_bits_and_restores_after_errors():
    mp.prec = 53
    with working_precision(128) as prec:
        assert prec == mp.prec == 128 + R.GUARD_BITS
    assert mp.prec == 53
    with pytest.raises(ZeroDivisionError), working_precision(200):
        assert mp.prec == 232
        mpmath.mpf(1) / 0
    assert mp.prec == 53
    with pytest.raises(ValueError, match="at least 64 bits"), working_precision(53):
        pass


def test_reference_restores_precision_when_the_rule_raises():
    mp.prec = 77
    with pytest.raises(NoReference, match="approximate='sigmoid'"):
        ref(aten.gelu.default, T(1.0), index=(0,), approximate="sigmoid")
    assert mp.prec == 77
    with pytest.raises(IndexError):
        ref(aten.mm.default, T(1.0, 2.0).view(1, 2), T(1.0, 2.0).view(2, 1), index=(0,))
    assert mp.prec == 77


def test_bits_argument_sets_the_working_precision():
    # 1/3 at 64+32 bits differs from 1/3 at 300+32 bits by about 2**-98
    lo = reference(aten.reciprocal.default, (T(3.0),), {}, (0,), bits=64).value
    hi = reference(aten.reciprocal.default, (T(3.0),), {}, (0,), bits=300).value
    with mpmath.workprec(400):
        assert 0 < abs(lo - hi) < mpmath.mpf(2) ** -95


def test_gmpy2_is_the_mpmath_backend():
    assert mpmath.libmp.BACKEND == "gmpy"


# --- correctly rounded conversion to float64 ---
@pytest.mark.parametrize(
    "exact, expected",
    [
        # 1 + 2**-53 is halfway between 1 and 1 + 2**-52: ties go to the even significand, 1
        (mpmath.fadd(1, mpmath.ldexp(1, -53), exact=True), 1.0),
        # 1 + 3 * 2**-53 is halfway between 1 + 2**-52 (odd) and 1 + 2**-51 (even)
        (mpmath.fadd(1, mpmath.ldexp(3, -53), exact=True), 1.0 + 2.0**-51),
        # just above the tie rounds up (mpmath's default rounding would truncate)
        (
            mpmath.fadd(1, mpmath.fadd(mpmath.ldexp(1, -53), mpmath.ldexp(1, -200), exact=True), exact=True),
            1.0 + 2.0**-52,
        ),
        # subnormals: 2**-1075 is a tie between 0 and 2**-1074 -> 0; 3 * 2**-1075 -> 2 * 2**-1074
        (mpmath.ldexp(1, -1075), 0.0),
        (mpmath.ldexp(3, -1075), 2.0**-1073),
        # 0.75 * 2**-1074 rounds up to the smallest subnormal
        (mpmath.ldexp(3, -1076), 2.0**-1074),
        # just above the tie 2**-1075, with more than 53 bits: rounding to 53 bits first would make it a tie (-> 0)
        (mpmath.fadd(mpmath.ldexp(1, -1075), mpmath.ldexp(1, -1200), exact=True), 2.0**-1074),
        # (2 - 2**-53) * 2**1023 is the tie between the largest float and 2**1024: to even, i.e. inf
        (mpmath.fsub(mpmath.ldexp(1, 1024), mpmath.ldexp(1, 1023 - 53), exact=True), math.inf),
        (mpmath.ldexp(-1, 5000), -math.inf),
        (mpmath.mpf("nan"), math.nan),
    ],
)
def test_to_float64_rounds_to_nearest_even(exact, expected):
    got = to_float64(exact)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


# --- golden values, one or more per rule ---
x_pi = math.pi  # fl(pi) = pi - d with d = 1.2246467991473532e-16: sin(fl(pi)) = sin(d) = d - d**3/6
D_PI = mpmath.mpf("3.14159265358979323846264338327950288419716939937510582097494") - X(math.pi)


def erf_series(x: mpmath.mpf) -> mpmath.mpf:
    # erf(x) = 2/sqrt(pi) * sum_k (-1)^k x^(2k+1) / (k! (2k+1)); 12 terms at x = 2**-10 leave < 2**-200
    return (
        2
        / mpmath.sqrt(mpmath.pi)
        * mpmath.fsum((-1) ** k * x ** (2 * k + 1) / (mpmath.factorial(k) * (2 * k + 1)) for k in range(12))
    )


GOLDEN = [
    # (id, op, args, kwargs, index, expected, hand arithmetic)
    ("exp(1)", aten.exp.default, (T(1.0),), {}, (0,), E),  # e to 60 digits
    ("exp(0)", aten.exp.default, (T(0.0),), {}, (0,), 1),
    ("expm1(1e-10)", aten.expm1.default, (T(1e-10),), {}, (0,), None),  # Taylor below: x + x^2/2 + x^3/6 + x^4/24
    ("log(2)", aten.log.default, (T(2.0),), {}, (0,), LN2),
    ("log(0)", aten.log.default, (T(0.0),), {}, (0,), "-inf"),
    ("log(-1)", aten.log.default, (T(-1.0),), {}, (0,), "nan"),
    ("log1p(1e-20)", aten.log1p.default, (T(1e-20),), {}, (0,), None),  # x - x^2/2 + x^3/3 ~ 1e-20 - 5e-41
    ("log1p(-1)", aten.log1p.default, (T(-1.0),), {}, (0,), "-inf"),
    ("log2(1024)", aten.log2.default, (T(1024.0),), {}, (0,), 10),
    ("log2(0.125)", aten.log2.default, (T(0.125),), {}, (0,), -3),
    ("sin(fl(pi))", aten.sin.default, (T(x_pi),), {}, (0,), D_PI - D_PI**3 / 6),
    # Ng's argument-reduction example: sin(1e22) = -0.852200849767188801772705893753029368...; libm-grade
    # reduction needs 1e22 mod 2 pi to ~90 bits
    ("sin(1e22)", aten.sin.default, (T(1e22),), {}, (0,), mpmath.mpf("-0.852200849767188801772705893753")),
    ("cos(fl(pi))", aten.cos.default, (T(x_pi),), {}, (0,), -(1 - D_PI**2 / 2)),  # -cos(d), d^4 term < 2**-200
    ("tanh(1)", aten.tanh.default, (T(1.0),), {}, (0,), (E**2 - 1) / (E**2 + 1)),
    ("sigmoid(1)", aten.sigmoid.default, (T(1.0),), {}, (0,), E / (1 + E)),
    ("sigmoid(0)", aten.sigmoid.default, (T(0.0),), {}, (0,), mpmath.mpf("0.5")),
    ("erf(2**-10)", aten.erf.default, (T(2.0**-10),), {}, (0,), erf_series(mpmath.ldexp(1, -10))),
    ("gelu(1)", aten.gelu.default, (T(1.0),), {}, (0,), PHI_1),  # x * Phi(x) = Phi(1), 39 digits
    # 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3), tanh(y) = (e^2y - 1)/(e^2y + 1)
    ("gelu_tanh(1)", aten.gelu.default, (T(1.0),), {"approximate": "tanh"}, (0,), None),
    ("silu(1)", aten.silu.default, (T(1.0),), {}, (0,), E / (1 + E)),  # 1 * sigmoid(1)
    # ln(1 + e) = 1.3132616875182228340489954949678556...
    ("softplus(1)", aten.softplus.default, (T(1.0),), {}, (0,), mpmath.log(1 + E)),
    ("softplus(1,beta=2)", aten.softplus.default, (T(1.0), 2, 20), {}, (0,), None),  # ln(1 + e^2) / 2
    ("softplus(30) above threshold", aten.softplus.default, (T(30.0),), {}, (0,), 30),
    ("sqrt(2)", aten.sqrt.default, (T(2.0),), {}, (0,), SQRT2),
    ("sqrt(-1)", aten.sqrt.default, (T(-1.0),), {}, (0,), "nan"),
    ("rsqrt(2)", aten.rsqrt.default, (T(2.0),), {}, (0,), SQRT2 / 2),
    ("rsqrt(-0.0)", aten.rsqrt.default, (T(-0.0),), {}, (0,), "-inf"),
    ("reciprocal(3)", aten.reciprocal.default, (T(3.0),), {}, (0,), mpmath.mpf(1) / 3),
    ("reciprocal(-0.0)", aten.reciprocal.default, (T(-0.0),), {}, (0,), "-inf"),
    ("neg", aten.neg.default, (T(2.5),), {}, (0,), -2.5),
    ("abs", aten.abs.default, (T(-2.5),), {}, (0,), 2.5),
    ("relu", aten.relu.default, (T(-2.5, 3.0),), {}, (1,), 3),
    # fl(0.1) + fl(0.2) exactly (float64 rounds it up to 0.30000000000000004)
    (
        "add 0.1+0.2",
        aten.add.Tensor,
        (T(0.1), T(0.2)),
        {},
        (0,),
        mpmath.mpf("0.3000000000000000166533453693773481063544750213623046875"),
    ),
    ("add alpha", aten.add.Tensor, (T(1.0), 0.25), {"alpha": 3}, (0,), 1.75),  # 1 + 3 * 0.25
    ("sub alpha", aten.sub.Tensor, (T(1.0), T(0.25)), {"alpha": 2}, (0,), 0.5),  # 1 - 2 * 0.25
    ("rsub", aten.rsub.Scalar, (T(0.25), 1), {"alpha": 2}, (0,), 0.5),  # 1 - 2 * 0.25
    ("add broadcast", aten.add.Tensor, (T(1.0, 2.0).view(2, 1), T(10.0, 20.0, 30.0)), {}, (1, 2), 32),
    (
        "mul 3*fl(0.1)",
        aten.mul.Tensor,
        (T(0.1), 3),
        {},
        (0,),
        mpmath.mpf("0.3000000000000000166533453693773481063544750213623046875"),
    ),
    ("div 1/3", aten.div.Tensor, (T(1.0), T(3.0)), {}, (0,), mpmath.mpf(1) / 3),
    ("div 1/-0.0", aten.div.Tensor, (T(1.0), T(-0.0)), {}, (0,), "-inf"),
    ("div 0/0", aten.div.Tensor, (T(0.0), T(0.0)), {}, (0,), "nan"),
    ("div floor -7/2", aten.div.Tensor_mode, (T(-7.0), T(2.0)), {"rounding_mode": "floor"}, (0,), -4),
    ("div trunc -7/2", aten.div.Tensor_mode, (T(-7.0), T(2.0)), {"rounding_mode": "trunc"}, (0,), -3),
    ("pow 2**0.5", aten.pow.Tensor_Scalar, (T(2.0), 0.5), {}, (0,), SQRT2),
    ("pow 2**100", aten.pow.Tensor_Scalar, (T(2.0), 100), {}, (0,), mpmath.ldexp(1, 100)),
    ("pow (-2)**3", aten.pow.Tensor_Tensor, (T(-2.0), T(3.0)), {}, (0,), -8),
    ("pow (-8)**(1/3)", aten.pow.Tensor_Scalar, (T(-8.0), 1 / 3), {}, (0,), "nan"),
    ("pow (-0.0)**-1", aten.pow.Tensor_Scalar, (T(-0.0), -1), {}, (0,), "-inf"),
    ("pow 10**-1", aten.pow.Tensor_Scalar, (T(10.0), -1), {}, (0,), mpmath.mpf(1) / 10),
    ("pow.Scalar 2**t", aten.pow.Scalar, (2, T(10.0)), {}, (0,), 1024),
    # reductions
    ("sum cancel", aten.sum.default, (T(1e16, 1.0, -1e16),), {}, (), 1),  # float64 gives 0
    ("sum dim keepdim", aten.sum.dim_IntList, (T(1.0, 2.0, 3.0, 4.0).view(2, 2), [1], True), {}, (1, 0), 7),
    ("mean", aten.mean.default, (T(1.0, 2.0, 3.0, 4.0),), {}, (), 2.5),
    ("mean dim", aten.mean.dim, (T(1.0, 2.0, 3.0, 4.0).view(2, 2), [0]), {}, (1,), 3),
    # deviations from the mean 1e8+2 are -1, 0, 1: sum of squares 2, / (3 - 1) = 1
    ("var large mean", aten.var.correction, (T(1e8 + 1, 1e8 + 2, 1e8 + 3),), {}, (), 1),
    # population std of 2,4,4,4,5,5,7,9: mean 5, squared deviations sum 32, / 8 = 4, sqrt 2
    ("std correction=0", aten.std.correction, (T(2.0, 4, 4, 4, 5, 5, 7, 9),), {"correction": 0}, (), 2),
    ("var.default unbiased", aten.var.default, (T(1.0, 2.0, 3.0, 4.0),), {}, (), mpmath.mpf(5) / 3),  # 5 / 3
    ("var_mean var", aten.var_mean.correction, (T(1.0, 2.0, 3.0, 4.0),), {}, (), mpmath.mpf(5) / 3),  # 5 / 3
    ("var 1 sample", aten.var.correction, (T(3.0),), {}, (), "nan"),  # 0 / (1 - 1)
    ("norm 2 [3,4]", aten.linalg_vector_norm.default, (T(3.0, 4.0),), {}, (), 5),
    ("norm 1", aten.linalg_vector_norm.default, (T(3.0, -4.0), 1), {}, (), 7),
    ("norm inf", aten.linalg_vector_norm.default, (T(3.0, -4.0), math.inf), {}, (), 4),
    ("norm 0", aten.linalg_vector_norm.default, (T(3.0, 0.0, -4.0), 0), {}, (), 2),
    ("norm 3", aten.linalg_vector_norm.default, (T(3.0, -4.0), 3), {}, (), mpmath.cbrt(91)),  # (27 + 64)^(1/3)
    ("norm.ScalarOpt_dim", aten.norm.ScalarOpt_dim, (T(3.0, 4.0, 6.0, 8.0).view(2, 2), 2, [1]), {}, (1,), 10),
    ("cumsum cancel", aten.cumsum.default, (T(1e16, 1.0, -1e16, 1.0), 0), {}, (2,), 1),  # prefix 1e16 + 1 - 1e16
    # e^3 / (e + e^2 + e^3)
    ("softmax", aten._softmax.default, (T(1.0, 2.0, 3.0), 0, False), {}, (2,), E**2 / (1 + E + E**2)),
    ("softmax -inf", aten._softmax.default, (T(0.0, -math.inf), 0, False), {}, (0,), 1),
    ("softmax all -inf", aten._softmax.default, (T(-math.inf, -math.inf), 0, False), {}, (0,), "nan"),
    ("log_softmax", aten._log_softmax.default, (T(0.0, 0.0, 0.0, 0.0), 0, False), {}, (1,), -2 * LN2),  # -log 4
    ("logsumexp", aten.logsumexp.default, (T(1000.0, 1000.0), [0]), {}, (), 1000 + LN2),  # exp(1000) overflows float64
    ("logsumexp all -inf", aten.logsumexp.default, (T(-math.inf, -math.inf), [0]), {}, (), "-inf"),
    # layer norm of 1,2,3,4: mean 2.5, biased var 1.25, rstd 2/sqrt(5); x0 - mean = -1.5 -> -3/sqrt(5)
    (
        "layer_norm out",
        aten.native_layer_norm.default,
        (T(1.0, 2, 3, 4), [4], None, None, 0.0),
        {},
        (0,),
        -3 / mpmath.sqrt(5),
    ),
    (
        "layer_norm affine",
        aten.native_layer_norm.default,
        (T(1.0, 2, 3, 4), [4], T(2.0, 2, 2, 2), T(0.5, 0, 0, 0), 0.0),
        {},
        (0,),
        0.5 - 6 / mpmath.sqrt(5),
    ),
    # 1.5 / sqrt(1.25 + 0.75)
    (
        "layer_norm eps",
        aten.native_layer_norm.default,
        (T(1.0, 2, 3, 4), [4], None, None, 0.75),
        {},
        (3,),
        mpmath.mpf("0.75") * mpmath.sqrt(2),
    ),
    # batch norm inference: (3 - 1) / sqrt(3 + 1) * 2 + 0.5 = 2.5
    (
        "batch_norm eval",
        aten.native_batch_norm.default,
        (T(3.0).view(1, 1), T(2.0), T(0.5), T(1.0), T(3.0), False, 0.1, 1.0),
        {},
        (0, 0),
        2.5,
    ),
    # training: channel 0 holds 1,2,3,4 (over N=2, L=2): as the layer norm above
    (
        "batch_norm train",
        aten.native_batch_norm.default,
        (T(1.0, 2, 0, 0, 3, 4, 0, 0).view(2, 2, 2), None, None, None, None, True, 0.1, 0.0),
        {},
        (0, 0, 0),
        -3 / mpmath.sqrt(5),
    ),
    ("mse none", aten.mse_loss.default, (T(3.0, 1.0), T(1.0, 1.0), 0), {}, (0,), 4),
    ("mse mean", aten.mse_loss.default, (T(3.0, 4.0), T(1.0, 1.0)), {}, (), 6.5),  # (4 + 9) / 2
    ("mse sum", aten.mse_loss.default, (T(3.0, 4.0), T(1.0, 1.0), 2), {}, (), 13),
    ("mse cancel", aten.mse_loss.default, (T(1e8 + 0.5), T(1e8), 2), {}, (), 0.25),
    # nll: x = [[-1, -2], [-3, -4]], t = [0, 1]: per sample 1, 4
    (
        "nll none",
        aten.nll_loss_forward.default,
        (T(-1.0, -2, -3, -4).view(2, 2), torch.tensor([0, 1]), None, 0, -100),
        {},
        (1,),
        4,
    ),
    (
        "nll sum",
        aten.nll_loss_forward.default,
        (T(-1.0, -2, -3, -4).view(2, 2), torch.tensor([0, 1]), None, 2, -100),
        {},
        (),
        5,
    ),
    # weights [1, 3]: (1 * 1 + 3 * 4) / (1 + 3) = 3.25
    (
        "nll weighted mean",
        aten.nll_loss_forward.default,
        (T(-1.0, -2, -3, -4).view(2, 2), torch.tensor([0, 1]), T(1.0, 3.0), 1, -100),
        {},
        (),
        3.25,
    ),
    (
        "nll ignore_index",
        aten.nll_loss_forward.default,
        (T(-1.0, -2, -3, -4).view(2, 2), torch.tensor([0, 1]), None, 1, 1),
        {},
        (),
        1,
    ),
    ("nll 1-d", aten.nll_loss_forward.default, (T(-1.0, -2, -3), torch.tensor(2), None, 1, -100), {}, (), 3),
    # matrix products: [[1,2],[3,4]] @ [[5,6],[7,8]] = [[19,22],[43,50]]
    ("mm", aten.mm.default, (T(1.0, 2, 3, 4).view(2, 2), T(5.0, 6, 7, 8).view(2, 2)), {}, (1, 0), 43),
    (
        "addmm beta alpha",
        aten.addmm.default,
        (T(1.0, 1, 1, 1).view(2, 2), T(1.0, 2, 3, 4).view(2, 2), T(5.0, 6, 7, 8).view(2, 2)),
        {"beta": 0.5, "alpha": 2},
        (0, 0),
        38.5,
    ),
    (
        "addmm beta=0 ignores nan",
        aten.addmm.default,
        (T(math.nan), T(1.0, 2, 3, 4).view(2, 2), T(5.0, 6, 7, 8).view(2, 2)),
        {"beta": 0},
        (1, 1),
        50,
    ),
    ("bmm", aten.bmm.default, (T(1.0, 2, 3, 4).view(1, 2, 2), T(5.0, 6, 7, 8).view(1, 2, 2)), {}, (0, 0, 1), 22),
    ("mv", aten.mv.default, (T(1.0, 2, 3, 4).view(2, 2), T(5.0, 7.0)), {}, (1,), 43),
    # float64: 1.00000761449337e-06
    ("dot cancel", aten.dot.default, (T(1e6, 1e-6, -1e6), T(1.0, 1.0, 1.0)), {}, (), X(1e-6)),
    ("linear", aten.linear.default, (T(1.0, 2.0), T(3.0, 4.0).view(1, 2), T(0.5)), {}, (0,), 11.5),  # 3 + 8 + 0.5
    ("matmul vec-mat", aten.matmul.default, (T(1.0, 2.0), T(5.0, 6, 7, 8).view(2, 2)), {}, (1,), 22),
    # conv1d: x = 1..5, w = [1, 0, -1], padding 1: out[0] = 0*1 + 1*0 + 2*(-1) = -2; out[4] = 4*1 + 5*0 + 0*(-1) = 4
    (
        "conv1d pad",
        aten.convolution.default,
        (T(1.0, 2, 3, 4, 5).view(1, 1, 5), T(1.0, 0, -1).view(1, 1, 3), None, [1], [1], [1], False, [0], 1),
        {},
        (0, 0, 4),
        4,
    ),
    (
        "conv1d bias",
        aten.convolution.default,
        (T(1.0, 2, 3, 4, 5).view(1, 1, 5), T(1.0, 0, -1).view(1, 1, 3), T(0.5), [1], [1], [1], False, [0], 1),
        {},
        (0, 0, 0),
        -1.5,
    ),
]


GOLDEN_REL = {"sin(1e22)": 1e-29}  # a 30-digit published value


def _expected_computed(name: str):
    """Goldens whose hand formula needs the exact binary input (written out here)."""
    if name == "expm1(1e-10)":
        x = X(1e-10)
        return x + x**2 / 2 + x**3 / 6 + x**4 / 24  # next term x^5/120 ~ 1e-52: below 2**-120 relative
    if name == "log1p(1e-20)":
        x = X(1e-20)
        return x - x**2 / 2 + x**3 / 3  # next term x^4/4 ~ 2.5e-81
    if name == "gelu_tanh(1)":
        y = mpmath.sqrt(2 / mpmath.pi) * (1 + mpmath.mpf("0.044715"))
        return (1 + (E ** (2 * y) - 1) / (E ** (2 * y) + 1)) / 2
    if name == "softplus(1,beta=2)":
        return mpmath.log(1 + E**2) / 2
    raise KeyError(name)


@pytest.mark.parametrize("name, op, args, kwargs, index, expected", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden(name, op, args, kwargs, index, expected):
    with mpmath.workprec(300):
        want = _expected_computed(name) if expected is None else expected
    assert_close(reference(op, args, kwargs, index), want, rel=GOLDEN_REL.get(name, 2.0**-120))


def test_gelu_far_tail_uses_no_cancelling_formula():
    # gelu(-20) = -20 Phi(-20): 1 + erf(-14.1) = 5.5e-89 would cancel away even 160 bits. Asymptotic
    # series Phi(-x) = phi(x)/x * sum_k (-1)^k (2k-1)!! / x^(2k); after k = 10 the next term is 3e-19
    x = mpmath.mpf(20)
    series = mpmath.fsum((-1) ** k * mpmath.fac2(2 * k - 1) / x ** (2 * k) for k in range(11))
    phi = mpmath.exp(-(x**2) / 2) / mpmath.sqrt(2 * mpmath.pi)
    assert_close(ref(aten.gelu.default, T(-20.0), index=(0,)), -x * phi / x * series, rel=1e-18)


def test_log1p_tiny_matches_the_series_digits():
    # log1p(1e-20) = 1e-20 - 5e-41 (+ 3.3e-61): log(1 + x) in float64 gives exactly 0
    e = ref(aten.log1p.default, T(1e-20), index=(0,))
    assert float(e) == 1e-20
    x = X(1e-20)  # 1e-20 * (1 - 5.5e-17): the binary value
    assert abs((e.value - x) / (-(x**2) / 2) - 1) < 1e-18  # the x^3/3 term is 6.7e-21 of x^2/2


def test_a_rule_reads_a_tensor_argument_at_the_broadcast_element():
    """``Call.scalar`` reads a small tensor argument whole once (its values by name, row-major) and a large one
    element by element: the same numbers as indexing it, broadcast, transposed or 0-d alike."""
    from shadow.references._table import READ_WHOLE, Call, bcast

    torch.manual_seed(0)
    small = torch.randn(4, 3, dtype=torch.float64).t()  # (3, 4), not contiguous
    column = torch.randn(3, 1, dtype=torch.float64)  # broadcast along the last dim
    large = torch.randn(READ_WHOLE + 1, dtype=torch.float64)
    call = Call(torch.ops.aten.add.Tensor, (small, column), {})
    for index in [(i, j) for i in range(3) for j in range(4)]:
        assert call.scalar("self", index) == small[index].item()
        assert call.scalar("other", index) == column[bcast(column, index)].item()
    assert set(call._values) == {"self", "other"}  # each read once, whole
    scalar = Call(torch.ops.aten.mul.Tensor, (large, torch.tensor(2.5, dtype=torch.float64)), {})
    assert [scalar.scalar("self", (i,)) for i in (0, READ_WHOLE)] == [large[0].item(), large[READ_WHOLE].item()]
    assert scalar.scalar("other", (7,)) == 2.5 and set(scalar._values) == {"other"}  # the large one read by element


def test_multi_output_rules():
    x = T(1.0, 2.0, 3.0, 4.0).view(1, 4)
    # layer norm: mean 2.5 and rstd 1/sqrt(1.25 + 0) at index (0, 0) of the (1, 1) outputs
    assert_close(ref(aten.native_layer_norm.default, x, [4], None, None, 0.0, index=(0, 0), output=1), 2.5)
    assert_close(
        ref(aten.native_layer_norm.default, x, [4], None, None, 0.0, index=(0, 0), output=2), 2 / mpmath.sqrt(5)
    )
    # batch norm training statistics of channel 1, holding 5, 7 (mean 6, biased var 1): invstd 1/sqrt(1 + 1)
    bx = T(0.0, 5, 0, 7).view(2, 2)
    assert_close(
        ref(aten.native_batch_norm.default, bx, None, None, None, None, True, 0.1, 1.0, index=(1,), output=1), 6
    )
    assert_close(
        ref(aten.native_batch_norm.default, bx, None, None, None, None, True, 0.1, 1.0, index=(1,), output=2), SQRT2 / 2
    )
    # var_mean: variance output and mean output
    assert_close(ref(aten.var_mean.correction, T(1.0, 2.0, 3.0, 4.0), index=(), output=1), 2.5)
    # nll total_weight: 1 + 3
    nll = (T(-1.0, -2, -3, -4).view(2, 2), torch.tensor([0, 1]), T(1.0, 3.0), 1, -100)
    assert_close(ref(aten.nll_loss_forward.default, *nll, output=1), 4)
    with pytest.raises(NoReference, match="output 3"):
        ref(aten.native_layer_norm.default, x, [4], None, None, 0.0, index=(0, 0), output=3)
    with pytest.raises(NoReference, match="output 1"):
        ref(aten.exp.default, T(1.0), index=(0,), output=1)
    with pytest.raises(NoReference, match="inference"):
        ref(
            aten.native_batch_norm.default,
            bx,
            None,
            None,
            T(0.0, 0.0),
            T(1.0, 1.0),
            False,
            0.1,
            1e-5,
            index=(0,),
            output=1,
        )


def test_not_spot_checkable_inputs_raise_no_reference():
    with pytest.raises(NoReference, match="non-finite"):
        ref(aten.exp.default, T(math.inf), index=(0,))
    with pytest.raises(NoReference, match="non-finite"):
        ref(aten.sum.default, T(1.0, math.nan))
    with pytest.raises(NoReference, match="complex"):
        ref(aten.exp.default, torch.tensor([1j]), index=(0,))
    with pytest.raises(NoReference, match="no reference rule"):
        ref(aten.index_add.default, T(1.0), 0, torch.tensor([0]), T(1.0), index=(0,))


# --- cancellation is visible in the magnitude ---
def test_cancellation_flags_where_float64_is_wrong():
    # each of these: the float64 kernel is off by more than float64 rounding, and cancellation >> 1
    s = ref(aten.sum.default, T(1e16, 1.0, -1e16))
    assert float(s) == 1.0 and s.cancellation > 1e15
    d = ref(aten.dot.default, T(1e6, 1e-6, -1e6), T(1.0, 1.0, 1.0))  # terms cancel to 1e-12 of their size
    assert float(d) == 1e-6 and 1e11 < d.cancellation < 1e13
    assert (1e6 + 1e-6) - 1e6 != 1e-6  # summed left to right in float64: 1.00000761449337e-06
    x = T(1e8 + 1, 1e8 + 2, 1e8 + 3)
    v = ref(aten.var.correction, x)
    one_pass = ((x * x).mean() - x.mean() ** 2) * 3 / 2  # E[x^2] - E[x]^2 in float64: 0, not 1
    assert float(v) == 1.0 and one_pass.item() != 1.0 and v.cancellation > 1e15
    g = ref(aten.gelu.default, T(-10.0), index=(0,))  # -10 Phi(-10) = -7.6e-23; float64 1 + erf(-7.07) = 0
    assert abs(float(g) / -7.61985302416e-23 - 1) < 1e-10 and F.gelu(T(-10.0)).item() == 0.0
    assert g.cancellation > 1e20
    # and elementwise ops on exact inputs, or sums of one sign, do not flag
    assert ref(aten.exp.default, T(3.0), index=(0,)).cancellation == 1.0
    assert ref(aten.sum.default, T(1.0, 2.0, 3.0)).cancellation == 1.0


# --- exact fast paths against mpmath ---
def _rand_fp32(n: int, spread: float, gen: torch.Generator) -> torch.Tensor:
    # float32 values spanning about 2**(+-3 spread), exponents clamped inside float32's range
    return (
        torch.randn(n, generator=gen) * torch.exp2((torch.randn(n, generator=gen) * spread).clamp(-100, 100))
    ).float()


@pytest.mark.parametrize("n", [1, 7, 128, 1024])
@pytest.mark.parametrize("spread", [0.0, 8.0, 30.0])
def test_fast_dot_equals_mpmath_on_fp32(n, spread):
    gen = torch.Generator().manual_seed(n * 100 + int(spread))
    for _ in range(3):
        a, b = _rand_fp32(n, spread, gen), _rand_fp32(n, spread, gen)
        fast, slow = exact_dot(a, b), exact_dot(a, b, method="mpmath")
        assert fast.value == slow.value  # both exact: equal as numbers, hence bit-identical in float64
        assert to_float64(fast.value) == to_float64(slow.value)
        assert exact_dot(a, b, method="fsum").value == slow.value
        assert abs(float(fast.magnitude) - float(slow.magnitude)) <= 1e-12 * float(slow.magnitude)


def test_fast_dot_equals_mpmath_under_cancellation():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=gen)
    b = torch.randn(1000, generator=gen)
    # append -a.b split into fp32 pieces: the exact sum is tiny next to its terms
    s = (a.double() * b.double()).sum()
    hi = s.float()
    lo = (s - hi.double()).float()
    a2, b2 = torch.cat([a, torch.stack([hi, lo])]), torch.cat([b, torch.tensor([-1.0, -1.0])])
    fast, slow = exact_dot(a2, b2), exact_dot(a2, b2, method="mpmath")
    assert fast.value == slow.value and fast.cancellation > 1e8
    assert exact_dot(a2, b2, method="fsum").value == slow.value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_dot_equals_mpmath_low_precision(dtype):
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(512, generator=gen).to(dtype), torch.randn(512, generator=gen).to(dtype)
    want = exact_dot(a, b, method="mpmath").value
    assert exact_dot(a, b).value == want and exact_dot(a, b, method="fsum").value == want


@pytest.mark.parametrize("spread", [0.0, 30.0, 250.0])
def test_dekker_dot_equals_mpmath_on_float64(spread):
    gen = torch.Generator().manual_seed(3)
    a = (
        torch.randn(300, generator=gen, dtype=f64)
        * torch.exp2(torch.randn(300, generator=gen, dtype=f64) * spread / 3).round()
    )
    b = torch.randn(300, generator=gen, dtype=f64)
    want = exact_dot(a, b, method="mpmath").value
    assert exact_dot(a, b).value == want and exact_dot(a, b, method="fsum").value == want


def test_dot_outside_the_safe_range_falls_back_to_mpmath():
    a, b = T(1e300, 3.0, -1e300), T(1e10, 1.0, 1e10)  # products overflow float64
    with pytest.raises(ValueError, match="not provably exact"):
        exact_dot(a, b, method="fsum")
    assert exact_dot(a, b).value == 3  # 1e310 + 3 - 1e310, exactly
    tiny = T(1e-200, 1e-200)
    assert exact_dot(tiny, tiny).value == 2 * X(1e-200) ** 2  # underflows in float64, exact here


def test_float32_valued_float64_tensors_take_the_product_path():
    # the engine hands float64 shadows: values that fit float32 still have exact float64 products
    a = _rand_fp32(64, 4.0, torch.Generator().manual_seed(4))
    assert float64_array(a.double())[1] is True
    assert float64_array(a.double() + 2.0**-40)[1] is False
    assert exact_dot(a.double(), a.double()).value == exact_dot(a, a, method="mpmath").value


@pytest.mark.parametrize("dtype", [f64, torch.float32, torch.float16])
def test_exact_sums_leave_their_inputs_resizable(dtype):
    """float64_array reads float32 and float64 tensors through numpy without Tensor.numpy(), which would
    mark the storage non-resizable: a later resize_ of the caller's tensor would fail."""
    a, b = torch.randn(6, dtype=dtype), torch.randn(6, dtype=dtype)
    want = exact_sum(a, method="mpmath").value
    assert exact_sum(a).value == want and exact_dot(a, b).value == exact_dot(a, b, method="mpmath").value
    a.resize_(100), b.resize_(100)


@pytest.mark.parametrize("spread", [0.0, 100.0, 1000.0])
def test_fast_sum_equals_mpmath(spread):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(500, generator=gen, dtype=f64) * torch.exp2(
        (torch.randn(500, generator=gen, dtype=f64) * spread / 3).round().clamp(-1070, 1000)
    )
    x = torch.cat([x, torch.tensor([5e-324, -1e-310], dtype=f64)])  # subnormals too
    want = exact_sum(x, method="mpmath").value
    assert exact_sum(x).value == want and exact_sum(x, method="fsum").value == want


def test_sum_overflowing_float64_falls_back_to_mpmath():
    x = T(1e308, 1e308, -1e308, 1.0)
    with pytest.raises(OverflowError):
        exact_sum(x, method="fsum")
    assert exact_sum(x).value == mpmath.fadd(X(1e308), 1, exact=True)  # 1024 bits: more than 300


def test_extraction_splits_exactly():
    # 1 + 2**-60 + 2**-120: one extraction pass keeps 1 (sigma = 2**3, eps * sigma = 2**-50), the
    # next ones the rest; parts add up exactly
    t = torch.tensor([1.0, 2.0**-60, 2.0**-120], dtype=f64).numpy()
    assert extract_parts(t) == [1.0, 2.0**-60, 2.0**-120]
    # terms whose sigma would be subnormal go to fsum: still exact
    tiny = torch.tensor([3e-310, 5e-324, -1e-320], dtype=f64).numpy()
    assert mpmath.fsum(map(mpmath.mpf, extract_parts(tiny))) == mpmath.fsum(map(mpmath.mpf, tiny.tolist()))


def test_fsum_parts_stop_early_only_when_exact():
    # 1 + 2**-60 needs two parts; the granularity argument must not stop after the first
    parts = fsum_parts(torch.tensor([1.0, 2.0**-60], dtype=f64).numpy())
    assert parts == [1.0, 2.0**-60]
    assert fsum_parts(torch.tensor([3.0, -3.0], dtype=f64).numpy()) == []


def test_fast_path_is_much_faster_than_mpmath():
    """1024-term fp32 dot, ms per element. Generous bound: the machine is shared."""
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(1024, generator=gen), torch.randn(1024, generator=gen)

    def per_call(method: str, n: int) -> float:
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                exact_dot(a, b, method=method)
            best = min(best, (time.perf_counter() - t0) / n)
        return best

    fast, slow = per_call("auto", 20), per_call("mpmath", 3)
    assert slow > 5 * fast, (fast * 1e3, slow * 1e3)


# --- agreement with torch float64 on well-conditioned random inputs ---
def _ulps(ref_value: float, y: float) -> float:
    if ref_value == y:
        return 0.0
    return abs(ref_value - y) / math.ulp(abs(y) or 2.0**-1074)


def _units(e: Exact, y: float) -> float:
    """|y - reference| in units of 2**-53 * magnitude: a few ulps where the element is well
    conditioned (magnitude = |value|), more room where its terms cancel, as float64 needs."""
    err = abs(mpmath.mpf(y) - e.value)
    return 0.0 if err == 0 else float(err / (mpmath.ldexp(e.magnitude, -53)))


def _all_indices(shape):
    return (
        [
            tuple(int(i) for i in idx)
            for idx in torch.cartesian_prod(*[torch.arange(s) for s in shape]).reshape(-1, len(shape)).tolist()
        ]
        if shape
        else [()]
    )


def _check_all(op, args, kwargs, out: torch.Tensor, max_units: float, output: int = 0):
    worst = 0.0
    for idx in _all_indices(tuple(out.shape)):
        e = reference(op, args, kwargs, idx, output=output)
        worst = max(worst, _units(e, out[idx].item()))
    assert worst <= max_units, worst


g = torch.Generator().manual_seed(7)
P = torch.rand(3, 4, generator=g, dtype=f64) + 0.5  # positive, away from zero
S = torch.randn(3, 4, generator=g, dtype=f64)
Q = torch.randn(3, 4, generator=g, dtype=f64)

# (id, op, args, kwargs, max error in units of 2**-53 * magnitude, i.e. about ulps where nothing cancels):
# float64 kernels are within 1-2 ulps on these inputs (libm accuracy, a few roundings in a formula);
# reductions and normalizations get a few more for their roundings.
AGREE = [
    ("exp", aten.exp.default, (S,), {}, 2),
    ("expm1", aten.expm1.default, (S,), {}, 2),
    ("log", aten.log.default, (P,), {}, 2),
    ("log1p", aten.log1p.default, (P,), {}, 2),
    ("log2", aten.log2.default, (P,), {}, 2),
    ("sin", aten.sin.default, (S,), {}, 2),
    ("cos", aten.cos.default, (S,), {}, 2),
    ("tanh", aten.tanh.default, (S,), {}, 2),
    ("sigmoid", aten.sigmoid.default, (S,), {}, 2),
    ("erf", aten.erf.default, (S,), {}, 2),
    ("gelu", aten.gelu.default, (S,), {}, 4),
    ("gelu tanh", aten.gelu.default, (S,), {"approximate": "tanh"}, 4),
    ("silu", aten.silu.default, (S,), {}, 4),
    ("softplus", aten.softplus.default, (S, 2.0, 1.5), {}, 4),
    ("sqrt", aten.sqrt.default, (P,), {}, 1),
    ("rsqrt", aten.rsqrt.default, (P,), {}, 2),
    ("reciprocal", aten.reciprocal.default, (P,), {}, 1),
    ("pow tensor", aten.pow.Tensor_Tensor, (P, S), {}, 2),
    ("pow scalar", aten.pow.Tensor_Scalar, (P, 2.5), {}, 2),
    ("add", aten.add.Tensor, (P, P[0]), {"alpha": 0.5}, 1),
    ("sub", aten.sub.Tensor, (P, 0.25), {}, 1),
    ("mul", aten.mul.Tensor, (S, Q), {}, 1),
    ("div", aten.div.Tensor, (S, P), {}, 1),
    ("mm", aten.mm.default, (P, P.T.contiguous()), {}, 4),
    ("addmm", aten.addmm.default, (P[0, :3], P, P.T.contiguous()), {"beta": 0.5, "alpha": 2.0}, 4),
    ("bmm", aten.bmm.default, (P.view(1, 3, 4), P.T.contiguous().view(1, 4, 3)), {}, 4),
    ("matmul batched", aten.matmul.default, (P.view(3, 1, 4), P.T.contiguous()), {}, 4),
    ("linear", aten.linear.default, (P, P[:2], P[0, :2]), {}, 4),
    ("sum dim", aten.sum.dim_IntList, (P, [1]), {}, 2),
    ("mean", aten.mean.dim, (P, [0], True), {}, 2),
    ("var", aten.var.correction, (S, [1]), {}, 4),
    ("std", aten.std.correction, (S, [0]), {"correction": 0}, 4),
    ("norm", aten.linalg_vector_norm.default, (S, 2, [1]), {}, 2),
    ("norm 3", aten.linalg_vector_norm.default, (S, 3.0, [1]), {}, 4),
    ("cumsum", aten.cumsum.default, (P, 1), {}, 2),
    ("softmax", aten._softmax.default, (S, 1, False), {}, 4),
    ("log_softmax", aten._log_softmax.default, (S, 0, False), {}, 4),
    ("logsumexp", aten.logsumexp.default, (S, [1]), {}, 2),
    ("layer_norm", aten.native_layer_norm.default, (S, [4], P[0], Q[0], 1e-5), {}, 8),
    ("batch_norm eval", aten.native_batch_norm.default, (S, P[0], Q[0], Q[1], P[1], False, 0.1, 1e-5), {}, 4),
    ("batch_norm train", aten.native_batch_norm.default, (S, P[0], Q[0], None, None, True, 0.1, 1e-5), {}, 8),
    ("mse none", aten.mse_loss.default, (S, Q, 0), {}, 2),
    ("mse mean", aten.mse_loss.default, (P, S), {}, 2),
]


@pytest.mark.parametrize("name, op, args, kwargs, max_units", AGREE, ids=[a[0] for a in AGREE])
def test_agrees_with_torch_float64(name, op, args, kwargs, max_units):
    out = op(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    _check_all(op, args, kwargs, out, max_units)


def test_layer_norm_and_batch_norm_statistics_agree_with_torch():
    _out, mean, rstd = aten.native_layer_norm.default(S, [4], None, None, 1e-5)
    _check_all(aten.native_layer_norm.default, (S, [4], None, None, 1e-5), {}, mean, 4, output=1)
    _check_all(aten.native_layer_norm.default, (S, [4], None, None, 1e-5), {}, rstd, 4, output=2)
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(8), dtype=f64)
    _, smean, sinv = aten.native_batch_norm.default(x, None, None, None, None, True, 0.1, 1e-5)
    _check_all(aten.native_batch_norm.default, (x, None, None, None, None, True, 0.1, 1e-5), {}, smean, 4, output=1)
    _check_all(aten.native_batch_norm.default, (x, None, None, None, None, True, 0.1, 1e-5), {}, sinv, 4, output=2)


@pytest.mark.parametrize(
    "xshape, wshape, kw",
    [
        (
            (2, 4, 9),
            (6, 2, 3),
            {"stride": [2], "padding": [1], "dilation": [2], "transposed": False, "output_padding": [0], "groups": 2},
        ),
        (
            (1, 3, 6, 5),
            (4, 3, 3, 2),
            {
                "stride": [1, 2],
                "padding": [1, 0],
                "dilation": [1, 1],
                "transposed": False,
                "output_padding": [0, 0],
                "groups": 1,
            },
        ),
        (
            (1, 4, 5),
            (4, 3, 3),
            {"stride": [2], "padding": [1], "dilation": [1], "transposed": True, "output_padding": [1], "groups": 2},
        ),
        (
            (1, 2, 3, 3),
            (2, 2, 2, 3),
            {
                "stride": [2, 1],
                "padding": [0, 1],
                "dilation": [1, 2],
                "transposed": True,
                "output_padding": [1, 0],
                "groups": 1,
            },
        ),
    ],
    ids=["conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d"],
)
def test_convolution_agrees_with_torch(xshape, wshape, kw):
    gen = torch.Generator().manual_seed(9)
    x, w = torch.rand(xshape, generator=gen, dtype=f64), torch.rand(wshape, generator=gen, dtype=f64)
    cout = wshape[1] * kw["groups"] if kw["transposed"] else wshape[0]
    b = torch.rand(cout, generator=gen, dtype=f64)
    args = (x, w, b, kw["stride"], kw["padding"], kw["dilation"], kw["transposed"], kw["output_padding"], kw["groups"])
    out = aten.convolution.default(*args)
    _check_all(aten.convolution.default, args, {}, out, 4)
    with pytest.raises(IndexError):
        reference(aten.convolution.default, args, {}, (0, 0, *[s for s in out.shape[2:]]))


def test_nll_on_log_softmax_reproduces_cross_entropy():
    gen = torch.Generator().manual_seed(10)
    logits, target = torch.randn(5, 7, generator=gen, dtype=f64), torch.randint(0, 7, (5,), generator=gen)
    weight = torch.rand(7, generator=gen, dtype=f64) + 0.5
    want = F.cross_entropy(logits, target, weight=weight).item()
    # what F.cross_entropy dispatches: _log_softmax, then nll_loss_forward on its output
    lsm = aten._log_softmax.default(logits, 1, False)
    assert _ulps(float(ref(aten.nll_loss_forward.default, lsm, target, weight, 1, -100)), want) <= 4
    # the log_softmax elements themselves
    _check_all(aten._log_softmax.default, (logits, 1, False), {}, lsm, 4)
    # nll_loss2d_forward, per pixel
    x4, t3 = torch.randn(2, 3, 2, 2, generator=gen, dtype=f64), torch.randint(0, 3, (2, 2, 2), generator=gen)
    out, _ = aten.nll_loss2d_forward.default(x4, t3, None, 0, -100)
    _check_all(aten.nll_loss2d_forward.default, (x4, t3, None, 0, -100), {}, out, 0)


def test_fp32_inputs_are_read_exactly():
    # inputs keep their own dtype: the reference is the exact math on the float32 values
    a = torch.tensor([0.1], dtype=torch.float32)  # 0.100000001490116119384765625 exactly
    assert_close(ref(aten.mul.Tensor, a, a, index=(0,)), X(0.100000001490116119384765625) ** 2, rel=0)
    h = torch.tensor([0.1], dtype=torch.bfloat16)  # 0.10009765625
    assert_close(ref(aten.exp.default, h, index=(0,)), mpmath.exp(mpmath.mpf("0.10009765625")))


VARIANTS = [
    # (op, args, kwargs, index, expected): out= and in-place overloads read the same arguments by name
    (aten.exp.out, (T(0.0),), {"out": T(5.0)}, (0,), 1),
    (aten.add_.Tensor, (T(1.0), T(0.25)), {"alpha": 2}, (0,), 1.5),  # 1 + 2 * 0.25
    (aten.sum.IntList_out, (T(1.0, 2.0, 3.0, 4.0).view(2, 2), [0], True), {"out": T(0.0, 0.0)}, (0, 1), 6),
    (
        aten.mm.out,
        (T(1.0, 2, 3, 4).view(2, 2), T(5.0, 6, 7, 8).view(2, 2)),
        {"out": T(0.0, 0, 0, 0).view(2, 2)},
        (0, 0),
        19,
    ),
    (aten.cumsum_.default, (T(1.0, 2.0, 3.0), 0), {}, (2,), 6),
    (aten.div_.Tensor_mode, (T(7.0), T(2.0)), {"rounding_mode": "floor"}, (0,), 3),
    (aten.pow_.Scalar, (T(3.0), 2), {}, (0,), 9),
    (aten.softmax.int, (T(0.0, 0.0), 0), {"dtype": torch.float32}, (1,), 0.5),
    # unbiased=False: (3-3.5)^2 + (4-3.5)^2 = 0.5, / 2
    (aten.var.dim, (T(1.0, 2.0, 3.0, 4.0).view(2, 2), [1], False), {}, (1,), 0.25),
    (
        aten._native_batch_norm_legit.no_stats,
        (T(1.0, 2, 3, 4).view(4, 1), None, None, True, 0.1, 0.0),
        {},
        (0, 0),
        -3 / mpmath.sqrt(5),
    ),
]


@pytest.mark.parametrize("op, args, kwargs, index, expected", VARIANTS, ids=[str(v[0]) for v in VARIANTS])
def test_out_and_inplace_variants_share_the_math(op, args, kwargs, index, expected):
    assert_close(reference(op, args, kwargs, index), expected)


# --- the table ---
def test_lookup_exact_then_family_then_none():
    assert reference_for(aten.exp.default).rule is reference_for(aten.exp.out).rule  # family aten.exp
    assert reference_for(aten.exp_.default) is not None  # in-place variants share the math
    assert reference_for(aten.add.t) is None  # list concatenation: not a tensor op of the family
    assert reference_for(aten.index_add.default) is None
    assert reference_for("aten::exp") is None


def test_exact_entries_win_over_families():
    def special(call, index):
        return Exact(mpmath.mpf(42), mpmath.mpf(42))

    with R.REFERENCES.scoped():  # the registration is undone at the end of the block
        register_reference(aten.exp.out)(special)
        assert reference_for(aten.exp.out).rule is special
        assert reference_for(aten.exp.default).rule is not special
        assert float(ref(aten.exp.out, T(0.0), index=(0,), out=T(0.0))) == 42.0


def test_duplicate_registration_is_an_error_naming_the_op():
    with pytest.raises(ValueError, match=r"aten\.exp.*already registered"):
        register_reference(aten.exp)(lambda call, index: None)
    with pytest.raises(ValueError, match=r"aten\.mm.*already registered"):
        register_reference(aten.mm)(lambda call, index: None)
    with pytest.raises(TypeError, match="OpOverloads or packets"):
        register_reference("aten::exp")(lambda call, index: None)


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


# ops of this forward pass that carry no arithmetic (views, copies, creation), each with its reason
NO_ARITHMETIC = {
    aten.t.default: "transpose view",
    aten.view.default: "view",
    aten._unsafe_view.default: "view",
    aten.expand.default: "view",
    aten.detach.default: "view",
    aten.transpose.int: "view",
    aten.lift_fresh.default: "wraps a constant",
}


def test_every_arithmetic_op_of_a_small_model_has_a_reference_that_agrees():
    """The ops a small float64 model really dispatches (forward): each has a rule, and sampled
    elements of each call agree with the float64 result."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(2, 4, 3, padding=1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 16),
        torch.nn.LayerNorm(16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 5),
    ).double()
    x, y = torch.randn(3, 2, 8, dtype=f64), torch.tensor([0, 4, 2])
    with _Calls() as rec, torch.no_grad():
        F.cross_entropy(model(x), y)
    checked = set()
    for func, args, kwargs, out in rec.calls:
        if func in NO_ARITHMETIC:
            continue
        r = reference_for(func)
        assert r is not None, f"{func} has no reference"
        y0 = out[0] if isinstance(out, tuple) else out
        for idx in _all_indices(tuple(y0.shape))[:: max(1, y0.numel() // 5)]:
            assert _units(r(args, kwargs, idx), y0[idx].item()) <= 16, (func, idx)
        checked.add(func)
    assert {
        aten.convolution.default,
        aten.addmm.default,
        aten.native_layer_norm.default,
        aten.gelu.default,
        aten._log_softmax.default,
        aten.nll_loss_forward.default,
    } <= checked


mp.prec = _import_prec
