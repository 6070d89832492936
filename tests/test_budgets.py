"""Error budgets (issue 3, item 1): golden values, no false alarms, detection.

No false alarms: every aten op that OpInfo samples (and small MLP/CNN/Transformer training steps) dispatch
runs in float32, bfloat16 and float16 on the CPU under ShadowMode; each record's local error (against the
same op in float64 on the same inputs, upcast exactly) must stay within its budget, except the cases
listed in EXCEPTIONS with their reasons. Detection: a matmul on inputs rounded to TF32's 10 mantissa bits,
and sums/matmuls that accumulate in float16, are over budget, and effective_bits reads the precision back.
"""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from shadow import ShadowMode, budgets
from shadow.budgets import (
    BUDGETS,
    KAPPA,
    Budget,
    budget_for,
    effective_bits,
    InUlps,
    fixed_budget,
    gamma,
    reads_overwritten,
    register_budget,
    register_budget_predicate,
    unit_roundoff,
)
from shadow.budgets.units import effective_bits_rel
from shadow.errors import DuplicateRuleError
from shadow.metrics import ErrorStats, compare

aten = torch.ops.aten
U32, UBF, U16 = 2.0**-24, 2.0**-8, 2.0**-11
LOW = (torch.float32, torch.bfloat16, torch.float16)
SWEPT = {str(dt) for dt in (*LOW, torch.complex64)}  # the result dtypes the no-false-alarm sweeps read
_BF16_FP16 = ("bfloat16", "float16")

# (aten op, dtype name) -> reason, for calls over budget (or with a default budget over its guess).
# True findings: CPU kernels that round partial sums to bfloat16/float16. The budget assumes float32
# accumulation for long sums (torch's opmath type, what cuBLAS/cuDNN do), so that float16 accumulation is
# caught; these kernels do less, and the budget says so.
EXCEPTIONS: dict[tuple[str, str], str] = {}
for _dt in _BF16_FP16:
    EXCEPTIONS.update({
        ("aten.convolution.default", _dt): "transposed convolution (slow_conv_transpose*: GEMM into columns, then "
                                          "col2im) adds partial sums in the device dtype",
        ("aten.convolution_backward.default", _dt): "grad_input (col2im) and grad_weight partial sums rounded to "
                                                   "the device dtype",
        ("aten.native_layer_norm_backward.default", _dt): "weight/bias gradients summed over rows in the device dtype",
        ("aten.addbmm.default", _dt): "one addmm per batch into the device-dtype result: batch partial sums rounded",
    })
if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
    for _dt in _BF16_FP16:  # seen on torch 2.4.1 only: the same samples are within budget on 2.13
        for _op in ("_softmax_backward_data", "_log_softmax_backward_data", "logsumexp", "mv", "dot"):
            EXCEPTIONS[(f"aten.{_op}.default", _dt)] = (
                "torch < 2.5: this CPU bfloat16/float16 kernel accumulates in the device dtype")


# --- golden values: bounds against a hand computation ---
def test_unit_roundoffs():
    assert unit_roundoff(torch.float32) == 2.0**-24
    assert unit_roundoff(torch.bfloat16) == 2.0**-8
    assert unit_roundoff(torch.float16) == 2.0**-11
    assert unit_roundoff(torch.float64) == 2.0**-53
    assert gamma(3, U32) == 3 * U32 / (1 - 3 * U32)
    assert gamma(256, UBF) == math.inf  # n u >= 1: the worst case says nothing


def test_golden_mm_float32():
    A = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]], dtype=torch.float64)
    B = A.T.clone()
    b = budget_for(aten.mm.default, (A, B), {}, [A @ B], torch.float32)
    # |A||B| = [[1+4+9, 0.5+0.5+3], [0.5+0.5+3, 0.25+0.0625+1]] = [[14, 4], [4, 1.3125]];
    # K = 3: bound = gamma_3(2^-24) * |A||B| + 2^-149 (float32's smallest subnormal, the floor)
    g3 = 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    want = torch.tensor([[14.0, 4.0], [4.0, 1.3125]], dtype=torch.float64) * g3 + 2.0**-149
    assert b.family == "matmul" and not b.is_default
    assert torch.equal(b.bound[0], want)


def test_golden_addmm_float16():
    C = torch.tensor([1.0, 2.0], dtype=torch.float64)
    A = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    B = torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    r = C + A @ B  # [[2, 0]]
    b = budget_for(aten.addmm.default, (C, A, B), {}, [r], torch.float16)
    # float16 accumulates in float32 (ua = 2^-24), K = 2 plus the bias term: gamma_4(2^-24);
    # |C| + |A||B| = [1 + 3, 2 + 4] = [4, 6]; one final rounding to float16: 2^-11 * |r| = [2^-10, 0];
    # floor: float16's smallest subnormal 2^-24.
    g4 = 4 * 2.0**-24 / (1 - 4 * 2.0**-24)
    want = torch.tensor([[4 * g4 + 2.0**-24 + 2.0**-10, 6 * g4 + 2.0**-24]], dtype=torch.float64)
    assert torch.allclose(b.bound[0], want, rtol=1e-15, atol=0)


def test_golden_sum_bfloat16():
    x = torch.tensor([1.0, -2.0, 3.0, 4.0], dtype=torch.float64)
    b = budget_for(aten.sum.default, (x,), {}, [x.sum()], torch.bfloat16)
    # n = 4, float32 accumulation: gamma_4(2^-24) * sum|x| = gamma_4 * 10; the result 6 rounded once to
    # bfloat16: 2^-8 * 6; floor 2^-133 (bfloat16's smallest subnormal)
    g4 = 4 * 2.0**-24 / (1 - 4 * 2.0**-24)
    assert b.family == "reduction"
    assert math.isclose(float(b.bound[0]), g4 * 10 + 6 * 2.0**-8 + 2.0**-133, rel_tol=1e-15)


def test_golden_conv1d():
    x = torch.tensor([[[1.0, -1.0, 2.0]]], dtype=torch.float64)
    w = torch.tensor([[[0.5, 0.25]]], dtype=torch.float64)
    args = (x, w, None, [1], [0], [1], False, [0], 1)
    r = aten.convolution.default(*args)  # [0.5 - 0.25, -0.5 + 0.5] = [0.25, 0]
    b = budget_for(aten.convolution.default, args, {}, [r], torch.float32)
    # K = C_in * kernel = 2; |x| conv |w| = [1*0.5 + 1*0.25, 1*0.5 + 2*0.25] = [0.75, 1.0]
    g2 = 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
    assert b.family == "conv"
    assert torch.equal(b.bound[0], torch.tensor([[[0.75 * g2 + 2.0**-149, 1.0 * g2 + 2.0**-149]]], dtype=torch.float64))


def test_golden_elementwise_ulps():
    x = torch.tensor([1.0], dtype=torch.float64)
    b = budget_for(aten.exp.default, (x,), {}, [x.exp()], torch.float32)
    # exp(1) = 2.718 in [2, 4): float32 spacing 2^-22; transcendental family: 4 ulps = 2^-20
    assert b.ulps == 4.0 and b.bound[0].item() == 2.0**-20
    # an error of 2^-21 uses half of it
    assert compare(x.exp() + 2.0**-21, x.exp(), torch.float32, b.bound[0]).budget_used == 0.5


def test_golden_softmax():
    x = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    y = torch.softmax(x, 0)  # [0.25, 0.75]
    b = budget_for(aten._softmax.default, (x, 0, False), {}, [y], torch.float32)
    # per element: 2 roundings of y (2u|y| + 2 * 2^-149) + u * y * (-log y) + y * (u (log 2 + 4 + 2) + gamma_2(u))
    u = 2.0**-24
    g2 = 2 * u / (1 - 2 * u)
    want = [2 * u * v + 2 * 2.0**-149 + u * (-v * math.log(v)) + v * (u * (math.log(2) + 6) + g2) for v in (0.25, 0.75)]
    assert torch.allclose(b.bound[0], torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)


def test_budget_used_edge_cases():
    # judged by shadow.metrics.compare, as the engine does: errors [0, 2^-24, NaN, inf] against bounds
    # [0, 2^-23, 1, 1]; 0/0 counts 0, non-finite results are counted apart: 2^-24 / 2^-23 = 0.5
    r = torch.ones(4, dtype=torch.float64)
    y = torch.tensor([1.0, 1.0 + 2.0**-24, math.nan, math.inf], dtype=torch.float64)
    bound = torch.tensor([0.0, 2.0**-23, 1.0, 1.0], dtype=torch.float64)
    assert compare(y, r, torch.float32, bound).budget_used == 0.5
    zero = torch.zeros(1, dtype=torch.float64)  # x/0 counts inf
    assert compare(torch.tensor([1e-30], dtype=torch.float64), zero, torch.float32, zero).budget_used == math.inf


def _local(y: torch.Tensor, r: torch.Tensor) -> ErrorStats:
    """A device result's local error figures against its float64 reference (what Budget.bits reads)."""
    return compare(y, r, y.dtype)


def test_effective_bits_definition():
    # errors of rms sqrt(KAPPA) * u against a unit scale: p = -log2(u) - 1 exactly
    for p in (10, 23, 52):
        u = 2.0 ** -(p + 1)
        assert math.isclose(effective_bits(KAPPA * u * u * 100, 100.0), p, abs_tol=1e-12)
    assert effective_bits(0.0, 1.0) == math.inf
    assert effective_bits(1.0, 0.0) == -math.inf
    assert math.isnan(effective_bits(1.0, math.inf))
    # correctly rounded float32 results of random data read ~23 bits
    torch.manual_seed(0)
    r = torch.randn(100_000, dtype=torch.float64).exp()
    st = _local(r.float(), r)
    b = Budget.in_ulps("elementwise", 1.0, [r], torch.float32)
    assert 22.7 < b.bits(st) <= 23.0  # at most the 23 bits float32 stores
    # read from the figures' rel_norm where the scale is the one output's own: the same figure
    assert math.isclose(b.bits(st, whole=True), b.bits(st), rel_tol=1e-13)
    assert effective_bits_rel(st.rel_norm, torch.float32) == b.bits(st, whole=True)


def test_effective_bits_accumulation_term():
    # the accumulation of a correct float32 kernel is subtracted before solving for the inputs' bits:
    # errors of rms sqrt(KAPPA) * u * sqrt(ACC) with ACC = 100 are all accumulation -> float32's own p
    u = 2.0 ** -24
    assert effective_bits(KAPPA * u * u * 100, 1.0, 100.0, torch.float32) == 23.0
    # what is subtracted is the expectation plus three deviations of a chi-square over n_out outputs:
    # 1 + 3 sqrt(2 / n_out), 4 for two outputs; float32 accumulation and TF32-rounded inputs: 10 bits back
    ut = 2.0 ** -11
    assert math.isclose(effective_bits(KAPPA * (u * u * 400 + ut * ut * 5), 5.0, 100.0, torch.float32, 2), 10.0,
                        abs_tol=1e-12)
    # one output erring by twice the accumulation's rms is within its scatter: still float32's own 23
    assert effective_bits(KAPPA * u * u * 400, 1.0, 100.0, torch.float32, 1) == 23.0
    # bf16 results accumulate in float32: ua = 2**-24, not bf16's u
    assert math.isclose(effective_bits(KAPPA * (u * u * 400 + 2.0 ** -16 * 3), 3.0, 100.0, torch.bfloat16, 2), 7.0,
                        abs_tol=1e-12)


@pytest.mark.parametrize("K", [16, 256, 4096])
def test_correct_fp32_and_bf16_matmuls_read_their_own_precision(K):
    # random normal and uniform [0, 1) data: float32 ~23 bits and bf16 ~7-8 (p = 23 and 7 stored bits)
    g = torch.Generator().manual_seed(K)
    for A, B in ((torch.randn(64, K, generator=g), torch.randn(K, 48, generator=g)),
                 (torch.rand(64, K, generator=g), torch.rand(K, 48, generator=g))):
        A64, B64 = A.double(), B.double()
        r = A64 @ B64
        b = budget_for(aten.mm.default, (A64, B64), {}, [r], torch.float32)
        assert 21.9 <= b.bits(_local(A @ B, r)) <= 23.0
        Ah, Bh = A.bfloat16(), B.bfloat16()
        rh = Ah.double() @ Bh.double()
        bh = budget_for(aten.mm.default, (Ah.double(), Bh.double()), {}, [rh], torch.bfloat16)
        assert 6.5 <= bh.bits(_local(Ah @ Bh, rh)) <= 7.0


# --- the registry ---
@pytest.fixture
def registry():
    """Undo what a test registers into the rule table."""
    with BUDGETS.scoped():
        yield


def test_duplicate_registration_names_the_op(registry):
    with pytest.raises(DuplicateRuleError, match=r"aten\.mm\.default"):
        register_budget(aten.mm.default, family="x")(lambda c: c.ulps(1.0))
    with pytest.raises(TypeError, match="OpOverload"):
        register_budget(aten.mm, family="x")(lambda c: c.ulps(1.0))


def test_lookup_order_exact_then_predicate_then_default(registry):
    op = aten.bitwise_not.default  # no float rule: tagged pointwise
    x = torch.tensor([1.0], dtype=torch.float64)
    assert budget_for(aten.nonzero_static.default, (x,), {"size": 1}, [x], torch.float32).is_default
    assert budget_for(op, (x,), {}, [x], torch.float32).family == "elementwise"  # the pointwise-tag predicate
    register_budget_predicate(lambda plan: plan.func is op, family="x")(lambda c: NotImplemented)  # to the tag
    assert budget_for(op, (x,), {}, [x], torch.float32).family == "elementwise"
    register_budget(op, family="mine")(lambda c: c.ulps(8.0))
    assert budget_for(op, (x,), {}, [x], torch.float32).family == "mine"


def test_default_is_flagged():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    b = budget_for(aten.fix.default, (x,), {}, [x], torch.float32)
    assert b.family == "default" and b.is_default and b.ulps == budgets.DEFAULT_ULPS


@pytest.mark.parametrize("op,reads", [
    (aten.exp_.default, False), (aten.add_.Tensor, False), (aten.addcmul_.default, False),  # ulps, operand terms
    (aten.copy_.default, False), (aten._foreach_addcdiv_.Scalar, False),  # movement; foreach answers as addcdiv
    (aten.gelu_.default, True), (aten.lerp_.Scalar, True), (aten._foreach_lerp_.Scalar, True),  # read self
    (aten.index_put_.default, True),
])
def test_reads_overwritten_is_given_at_registration(op, reads):
    # the engine copies what an in-place op overwrites only for rules that may read it
    assert reads_overwritten(op) is reads


def test_reads_overwritten_of_a_new_rule(registry):
    op = aten.fix.default
    register_budget(op, family="mine", reads_overwritten=False)(lambda c: c.ulps(8.0))
    assert not reads_overwritten(op)  # the default promises not to read either
    register_budget_predicate(lambda plan: plan.func is op, family="mine")(lambda c: NotImplemented)
    assert reads_overwritten(op)  # a rule that may answer and made no promise


_X = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)


@pytest.mark.parametrize("op,args,reads", [
    (aten.mul.Tensor, (_X, _X), False), (aten.exp.default, (_X,), False), (aten.copy.default, (_X, _X), False),
    (aten.fix.default, (_X,), False),  # ulps of the class; movement; the default
    (aten.gelu.default, (_X,), True), (aten.add.Tensor, (_X, _X), True), (aten.sum.default, (_X,), True),
])
def test_budgets_that_read_no_argument_are_built_without_them(op, args, reads):
    # the engine keeps no inputs before the op for an InUlps rule: it builds the same budget without them
    r = op(*args)
    rule = fixed_budget(op)
    assert (rule is None) is reads
    given = budget_for(op, args, {}, [r], torch.float32)
    if reads:
        with pytest.raises(TypeError, match="fixed_budget"):
            budget_for(op, None, None, [r], torch.float32)
        return
    for alone in (budget_for(op, None, None, [r], torch.float32), rule.budget([r], torch.float32)):
        assert (alone.family, alone.ulps, alone.is_default) == (given.family, given.ulps, given.is_default)
        assert torch.equal(alone.bound[0], given.bound[0]) and alone.bound[0].gt(0).all()
    empty = rule.budget([r[:0]], torch.float32)  # nothing to bound: as budget_for says
    assert (empty.family, empty.ulps) == (budget_for(op, args, {}, [r[:0]], torch.float32).family, 0.0) == ("empty", 0.0)


def test_fixed_budget_follows_the_rule_that_answers(registry):
    op = aten.fix.default
    register_budget(op, reads_overwritten=False)(InUlps("mine", 8.0))
    assert fixed_budget(op) == InUlps("mine", 8.0)
    b = budget_for(op, None, None, [_X], torch.bfloat16)  # bfloat16's spacing: 2**-8 at 0.5, 2**-6 at 2 and 3
    assert (b.family, b.ulps) == ("mine", 8.0) and b.bound[0].tolist() == [8 * 2.0**-8, 8 * 2.0**-6, 8 * 2.0**-6]
    other = aten.fix.out
    register_budget(other, family="mine")(lambda c: c.ulps(8.0))
    assert fixed_budget(other) is None  # a function of the call may read anything


# --- running ops under ShadowMode: each record's local error against its budget, as the engine judged it ---
class Worst:
    """The worst budget used per (op, dtype) over the records of the runs it reads, with the sample that
    produced it; the ops that fell to the default budget; and the budget rules that raised (the engine
    catches them and reports "budget of <op>" as unsupported: they are bugs)."""

    def __init__(self):
        self.worst: dict[tuple[str, str], tuple[float, str, str]] = {}
        self.defaults: collections.Counter = collections.Counter()
        self.errors: dict[str, str] = {}

    def read(self, sm: ShadowMode, where: str) -> None:
        for key, reason in sm.report.coverage.unsupported.items():
            if key.startswith("budget of "):
                self.errors.setdefault(key, f"{reason} (at {where})")
        for rec in sm.report.records:
            b = rec.budget
            # aten ops only: budgets are rules for aten kernels; other namespaces (torch_nn's chunked
            # linear_cross_entropy, a composite) hold only the default guess, which is no evidence
            if b is None or rec.dtype not in SWEPT or not rec.op.startswith("aten."):
                continue
            if b.is_default:
                self.defaults[rec.op] += 1
            key = (rec.op, rec.dtype.replace("torch.", ""))
            if math.isnan(b.used) or b.used > self.worst.get(key, (-1.0,))[0]:
                self.worst[key] = (b.used, where, b.family + (" (default)" if b.is_default else ""))

    def over(self) -> dict:
        return {k: v for k, v in self.worst.items() if not v[0] <= 1.0}

    def unexplained(self) -> dict:
        return {k: v for k, v in self.over().items() if k not in EXCEPTIONS}


def _shadowed() -> ShadowMode:
    """Local errors and budgets only: drift and spot checks are not what these sweeps judge."""
    return ShadowMode(spot_checks="off", drift=False)


def _run_opinfo(op, dtype, worst: Worst, max_samples: int = 12) -> None:
    grad = op.supports_autograd
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=grad))[:max_samples]
    except Exception:
        return
    for i, s in enumerate(samples):
        where = f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}[{i}]"
        try:
            with _shadowed() as sm:
                torch.manual_seed(0)
                res = op(s.input, *s.args, **s.kwargs)
                if grad:  # the backward ops too
                    res = s.output_process_fn_grad(res)
                    outs = [t for t in tree_flatten(res)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                    leaves = [t for t in tree_flatten((s.input, s.args, s.kwargs))[0]
                              if isinstance(t, torch.Tensor) and t.requires_grad]
                    if outs and leaves:
                        loss = sum((torch.view_as_real(t) if t.is_complex() else t).float().sum() for t in outs)
                        torch.autograd.grad(loss, leaves, allow_unused=True)
        except Exception:  # the sample itself fails (unsupported dtype path): not a budget question
            continue
        worst.read(sm, where)


def _opinfo_sweep(names: set[str] | None) -> tuple[Worst, int]:
    from torch.testing._internal.common_methods_invocations import op_db

    worst = Worst()
    n = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in op_db:
            full = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
            if names is not None and full not in names:
                continue
            for dtype in LOW:
                if dtype in op.supported_dtypes("cpu"):
                    _run_opinfo(op, dtype, worst)
                    n += 1
    return worst, n


# One or two OpInfo entries per family: the default run stays well under a minute.
REPRESENTATIVE = {
    "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "addcmul", "addcdiv", "lerp", "exp", "log",
    "sin", "tanh", "sigmoid", "pow", "sqrt", "rsqrt", "nn.functional.gelu", "nn.functional.silu", "clamp", "where",
    "cat", "sum", "mean", "var", "std", "prod", "cumsum", "logsumexp", "softmax", "log_softmax",
    "linalg.vector_norm", "mm", "bmm", "addmm", "baddbmm", "matmul", "mv", "dot", "nn.functional.linear",
    "nn.functional.conv2d", "nn.functional.layer_norm", "nn.functional.batch_norm", "nn.functional.group_norm",
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.mse_loss",
    "nn.functional.binary_cross_entropy", "nn.functional.scaled_dot_product_attention", "nn.functional.avg_pool2d",
    "nn.functional.max_pool2d", "nn.functional.embedding", "nn.functional.adaptive_avg_pool2d", "fft.fft",
}


def _report(worst: Worst) -> str:
    return "\n".join(f"{u:.3g} {op} {dt} at {where} ({family})" for (op, dt), (u, where, family) in
                     sorted(worst.unexplained().items(), key=lambda kv: -kv[1][0] if kv[1][0] == kv[1][0] else 0))


def test_no_false_alarms_opinfo_representative():
    worst, n = _opinfo_sweep(REPRESENTATIVE)
    assert n >= 100, n  # entries x dtypes actually run
    assert not worst.errors, list(worst.errors.items())[:5]
    assert not worst.unexplained(), _report(worst)
    # the families are really exercised, in all three dtypes
    ops = {op for op, _ in worst.worst}
    for must in ("aten.mm.default", "aten.addmm.default", "aten.convolution.default", "aten.sum.dim_IntList",
                 "aten._softmax.default", "aten.native_layer_norm.default", "aten.native_layer_norm_backward.default",
                 "aten.nll_loss_forward.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"):
        assert must in ops, must


@pytest.mark.slow
def test_no_false_alarms_opinfo_all():
    """Every op_db entry with a float32/bfloat16/float16 CPU kernel, forward and backward (~8 min on 2 cores)."""
    worst, n = _opinfo_sweep(None)
    assert n > 1000, n
    assert not worst.errors, list(worst.errors.items())[:10]
    assert not worst.unexplained(), _report(worst)


# --- training steps: MLP, CNN, Transformer; Adam (for-loop and foreach), SGD with momentum ---
class _Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.enc = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(32, 50)

    def forward(self, x):
        return self.out(self.enc(self.emb(x)))


def _training_steps(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32),
                        nn.Linear(32, 4)).to(dtype)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 8, 3, groups=2), nn.GroupNorm(2, 8), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 4)).to(dtype)
    tr = _Transformer().to(dtype)
    tok = torch.randint(0, 50, (2, 7))
    steps = [
        (mlp, torch.randn(8, 16).to(dtype), torch.randint(0, 4, (8,)), F.cross_entropy,
         torch.optim.Adam(mlp.parameters(), foreach=False)),
        (mlp, torch.randn(8, 16).to(dtype), torch.randint(0, 4, (8,)), F.cross_entropy,
         torch.optim.Adam(mlp.parameters(), foreach=True)),
        (cnn, torch.randn(4, 3, 8, 8).to(dtype), torch.randn(4, 4).to(dtype), _mse_loss(dtype),
         torch.optim.SGD(cnn.parameters(), lr=0.1, momentum=0.9)),
        (tr, tok, tok, lambda o, y: F.cross_entropy(o.reshape(-1, 50), y.reshape(-1)),
         torch.optim.AdamW(tr.parameters())),
    ]
    for model, x, y, loss_fn, opt in steps:
        for _ in range(2):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()


def _mse_loss(dtype: torch.dtype):
    """F.mse_loss, or its formula where this torch has no CPU kernel for the dtype (torch 2.4.1: no bfloat16
    mse_loss, no float16 mse_loss_backward)."""
    try:
        F.mse_loss(torch.ones(2, dtype=dtype, requires_grad=True), torch.zeros(2, dtype=dtype)).backward()
        return F.mse_loss
    except RuntimeError:
        return lambda o, y: (o - y).square().mean()


@pytest.mark.parametrize("dtype", LOW, ids=lambda d: str(d).replace("torch.", ""))
def test_no_false_alarms_training_steps(dtype):
    worst = Worst()
    with _shadowed() as sm:
        _training_steps(dtype)
    worst.read(sm, "training steps")
    assert not worst.errors, list(worst.errors.items())[:5]
    assert not worst.unexplained(), _report(worst)
    assert len(worst.worst) >= 40  # ops with a float result actually checked
    # every op with a float result in these steps has a rule of its own
    assert not worst.defaults, worst.defaults


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bounds_formed_in_the_comparison_give_the_figures_of_their_tensors(dtype, monkeypatch):
    """The optimizer's bounds of ulps plus an operand term (add with alpha, addcmul, addcdiv, lerp) reach the
    comparison as formulas (``Budget.divisors``) that its numba pass forms where it reads the result: every
    call's budget use equals that of the same steps with the bounds written as tensors first (``Budget.bound``)
    to the last bit (a maximum of quotients), and its effective bits to 1e-12 (they read the error's sum of
    squares, which the two compiled passes may add in another order), for Adam (for-loop and foreach), SGD and
    AdamW."""
    from shadow import _fused, metrics

    if metrics.fused is None:
        pytest.skip(f"numba unavailable: {metrics.FUSED_UNAVAILABLE}")

    def figures() -> list[tuple]:
        with _shadowed() as sm:
            _training_steps(dtype)
        return [(r.op, r.local.budget_used, r.local.effective_bits) for r in sm.report.records if r.local is not None]

    formed = collections.Counter()
    run = _fused.figures

    def spy(y, r, bound, tiny, scale=0.0, alpha=1.0, op="", other=None):
        formed[op] += scale != 0.0
        return run(y, r, bound, tiny, scale, alpha, op, other)

    monkeypatch.setattr(_fused, "figures", spy)
    got = figures()
    with monkeypatch.context() as m:
        m.setattr(budgets.core.Budget, "divisors", property(lambda b: b.bound))
        want = figures()
    assert len(got) == len(want) > 100
    def same(a, b, rel: float = 0.0) -> bool:  # equal, NaN included (None where a call has no budget)
        return a == b or (isinstance(a, float) and isinstance(b, float) and
                          (math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=rel)))

    for (op, used, bits), (op2, used2, bits2) in zip(got, want):
        assert op == op2 and same(used, used2) and same(bits, bits2, 1e-12), ((op, used, bits), (used2, bits2))
    assert formed["square"] and formed["sub"] and formed["div"], formed  # Adam's addcmul, lerp and addcdiv


# --- detection ---
def _round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 rounded to ``bits`` stored mantissa bits, ties away from zero: what NVIDIA's cvt.rna.tf32.f32
    does for TF32 (bits=10). Exponent range unchanged."""
    i = x.view(torch.int32)
    drop = 23 - bits
    half = 1 << (drop - 1)
    mag = (i & 0x7FFFFFFF) + half  # add half an ulp of the target to the magnitude: ties go away from zero
    mag = mag & ~((1 << drop) - 1)
    return ((i & ~0x7FFFFFFF) | mag).view(torch.float32)


def test_round_mantissa_tf32():
    x = torch.tensor([1.0 + 2.0**-11, 1.0 + 2.0**-12, -(1.0 + 3 * 2.0**-11), 3.0], dtype=torch.float32)
    # 1 + 2^-11 is a tie between 1 and 1 + 2^-10: away from zero; 1 + 2^-12 rounds down; 3 is exact
    assert _round_mantissa(x, 10).tolist() == [1.0 + 2.0**-10, 1.0, -(1.0 + 2 * 2.0**-10), 3.0]


def _mm_case(M: int, K: int, N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(M, K, generator=g)
    B = torch.randn(K, N, generator=g)
    return A, B


@pytest.mark.parametrize("K", [64, 256])
def test_tf32_matmul_detected(K):
    A, B = _mm_case(128, K, 96)
    A64, B64 = A.double(), B.double()
    r = A64 @ B64
    b = budget_for(aten.mm.default, (A64, B64), {}, [r], torch.float32)
    tf32 = (_round_mantissa(A, 10).double() @ _round_mantissa(B, 10).double()).float()  # exact products, one rounding
    assert compare(tf32, r, torch.float32, b.bound[0]).budget_used > 1.0
    assert abs(b.bits(_local(tf32, r)) - 10) <= 1.5
    y32 = A @ B  # the CPU's own float32 matmul
    assert compare(y32, r, torch.float32, b.bound[0]).budget_used <= 1.0
    # the float32 accumulation over K terms is in the model (as a correct kernel's): float32's own 23 bits
    assert 22.5 <= b.bits(_local(y32, r)) <= 23.0


def test_tf32_conv_detected():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 16, 12, 12, generator=g), torch.randn(24, 16, 3, 3, generator=g)  # K = 144
    args = lambda x, w: (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    r = aten.convolution.default(*args(x.double(), w.double()))
    b = budget_for(aten.convolution.default, args(x.double(), w.double()), {}, [r], torch.float32)
    tf32 = aten.convolution.default(*args(_round_mantissa(x, 10).double(), _round_mantissa(w, 10).double())).float()
    assert compare(tf32, r, torch.float32, b.bound[0]).budget_used > 1.0 and abs(b.bits(_local(tf32, r)) - 10) <= 1.5
    y32 = aten.convolution.default(*args(x, w))
    assert compare(y32, r, torch.float32, b.bound[0]).budget_used <= 1.0 and 22.5 <= b.bits(_local(y32, r)) <= 23.0


def _fp16_sequential(products: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, accumulating in float16 left to right (products rounded to float16 first)."""
    acc = torch.zeros(products.shape[:-1], dtype=torch.float16)
    p = products.half()
    for k in range(p.shape[-1]):
        acc = acc + p[..., k]
    return acc


@pytest.mark.parametrize("K", [512, 2048])
def test_fp16_accumulation_detected(K):
    g = torch.Generator().manual_seed(2)
    A, B = torch.randn(16, K, generator=g).half(), torch.randn(K, 12, generator=g).half()
    A64, B64 = A.double(), B.double()
    r = A64 @ B64
    b = budget_for(aten.mm.default, (A64, B64), {}, [r], torch.float16)
    acc16 = _fp16_sequential(A64.unsqueeze(1) * B64.T.unsqueeze(0))
    assert compare(acc16, r, torch.float16, b.bound[0]).budget_used > 1.0
    assert compare(A @ B, r, torch.float16, b.bound[0]).budget_used <= 1.0  # the CPU kernel: float32 accumulation
    x = torch.randn(8, K, generator=g).half()
    rs = x.double().sum(-1)
    bs = budget_for(aten.sum.dim_IntList, (x.double(), [-1]), {}, [rs], torch.float16)
    assert compare(_fp16_sequential(x.double()), rs, torch.float16, bs.bound[0]).budget_used > 1.0
    assert compare(x.sum(-1), rs, torch.float16, bs.bound[0]).budget_used <= 1.0


def test_flush_to_zero_detected():
    # subnormal float32 results flushed to 0: the elementwise floor (a few subnormal spacings) catches them
    x = torch.tensor([2.0**-130, 3 * 2.0**-140, 1.0], dtype=torch.float64)
    r = x * 0.5
    b = budget_for(aten.mul.Tensor, (x, torch.tensor(0.5, dtype=torch.float64)), {}, [r], torch.float32)
    ftz = torch.where(r < 2.0**-126, torch.zeros_like(r), r)
    assert compare(ftz, r, torch.float32, b.bound[0]).budget_used > 1.0
    assert compare(r.float(), r, torch.float32, b.bound[0]).budget_used <= 1.0


# --- cost: the large-matmul bound avoids a second matmul ---
def test_large_matmul_bound_is_cheap_and_valid():
    A, B = _mm_case(300, 400, 200, seed=3)
    A64, B64 = A.double(), B.double()
    r = A64 @ B64
    b = budget_for(aten.mm.default, (A64, B64), {}, [r], torch.float32)
    exact = gamma(400, U32) * (A64.abs() @ B64.abs())
    ratio = b.bound[0] / exact
    assert bool((ratio >= 1 - 1e-12).all())  # Cauchy-Schwarz: never below the exact magnitude
    assert 1.2 < float(ratio.median()) < 2.0  # about pi/2 looser on Gaussian data


@pytest.mark.parametrize("layout", ["A @ B", "A @ W.T", "A.T @ B"])
def test_large_matmul_bound_and_scale_read_each_operand_once(layout, monkeypatch):
    """The bound reads each operand's squares summed one way (||a_i||, ||b_j||) and the scale the other (over
    K): one pass per operand gives both (``_fused_bounds.squares``), for operands stored by rows or by columns (W.T
    in a linear layer's forward), with the bound and the effective bits of torch's four reductions to
    rounding."""
    from shadow import _fused_bounds, metrics
    from shadow.budgets import linalg

    if metrics.fused is None:
        pytest.skip(f"numba unavailable: {metrics.FUSED_UNAVAILABLE}")
    A, B = (t.double() for t in _mm_case(200, 300, 250, seed=6))
    if layout == "A @ W.T":
        B = B.T.contiguous().T
    elif layout == "A.T @ B":
        A = A.T.contiguous().T
    r = A @ B
    y = (A.float() @ B.float()).double()
    reads = collections.Counter()
    run = _fused_bounds.squares

    def spy(t):
        reads[t.data_ptr()] += 1
        return run(t)

    def bound_and_bits():
        b = budget_for(aten.mm.default, (A, B), {}, [r], torch.float32)
        return b.bound[0], b.bits(_local(y, r))

    monkeypatch.setattr(_fused_bounds, "squares", spy)
    bound, bits = bound_and_bits()
    assert dict(reads) == {A.data_ptr(): 1, B.data_ptr(): 1}
    with monkeypatch.context() as m:
        m.setattr(linalg, "fused_bounds", None)  # as without numba: vector_norm, square + sum
        want_bound, want_bits = bound_and_bits()
    torch.testing.assert_close(bound, want_bound, rtol=1e-13, atol=0)
    assert 22.0 < bits <= 23.0 and bits == pytest.approx(want_bits, abs=1e-9)


@pytest.mark.parametrize("transposed,groups", [(False, 1), (False, 4), (True, 1), (True, 4)])
def test_large_conv_bound_is_valid(transposed, groups):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 32, 20, 20, generator=g, dtype=torch.float64)
    w = torch.randn(32, 32 // groups, 3, 3, generator=g, dtype=torch.float64)
    args = (x, w, None, [2, 2], [1, 1], [2, 2], transposed, [1, 1] if transposed else [0, 0], groups)
    r = aten.convolution.default(*args)
    b = budget_for(aten.convolution.default, args, {}, [r], torch.float32).bound[0]
    exact = gamma(32 // groups * 9, U32) * aten.convolution.default(x.abs(), w.abs(), None, *args[3:])
    assert b.shape == r.shape
    assert bool((b >= exact).all())  # the window-norm bound never undercuts |x| conv |w|
    q = (b / exact)[exact > 0]
    assert 1.2 < float(q.median()) < 2.0
