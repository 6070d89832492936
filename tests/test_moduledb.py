"""Conformance on PyTorch's ModuleInfo database (``module_db``): every torch.nn module, training and eval.

Each sample runs as a small training step: the module built from the sample's constructor input (RNG seeded,
outside any mode) and cast to the dtype, its forward, the backward of the sum of its floating outputs, and
one SGD step (momentum 0.9) where it has parameters. The step runs twice from the same seed: plainly and
under ``ShadowMode(spot_checks="off")`` (the mpmath spot checks of the float64 references are off, for the
sweep's time: the references themselves are not validated here). Then:

- no crash, no interference: the shadowed step raises exactly when the plain one does (a dtype a module has
  no CPU kernel for is skipped, with torch's message); its outputs, loss, input and parameter gradients,
  parameters after the step, buffers and RNG state equal the plain run's bit for bit; no internal error;
  no unsupported call;
- float64: every float64 record's local error is exactly 0 (records of other dtypes are the module's
  explicit casts, which round: counted, not checked);
- float32: no call over budget (but torch 2.4.1's celu: ``FINDINGS``);
- bfloat16 / float16: calls over budget only for an (op, dtype) in ``FINDINGS``, a CPU kernel's documented
  loss of accuracy (docs/budgets.md: Kernel findings), and within the figure its mechanism allows.

Exclusions are computed on the sample, as in tests/test_opinfo.py: ``MODE_SENSITIVE`` (torch computes
otherwise under any dispatch mode: the shadowed result must then equal the one under a mode that only
forwards). Known bugs outside this file are strict xfails (``KNOWN_BUGS``), so a fix turns them into
failures and the entry goes. The default run takes the first sample of ``DEFAULT_MODULES`` (~7 s after the
10 s import of module_db); the ``slow`` sweep every sample of every module, 3618 samples per dtype (5 min
46 s on the shared 2-core machine, torch 2.13).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import warnings
from typing import Callable

import pytest
import torch
from torch.testing._internal.common_modules import module_db
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from shadow import ShadowMode
from shadow.plan import plan_of
from shadow.replay import defined_regions

from test_opinfo import MODE_SENSITIVE, _FillUninitialized, _Trace, same

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten
TORCH_BEFORE_2_5 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5)
MODULES = {mi.name: mi for mi in module_db}
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# one or two modules of each family, first sample: ~15 s with the import of module_db (10 s of it)
DEFAULT_MODULES = ("nn.Linear", "nn.Bilinear", "nn.Conv2d", "nn.ConvTranspose1d", "nn.LazyConv2d", "nn.MaxPool2d",
                   "nn.AvgPool2d", "nn.BatchNorm2d", "nn.InstanceNorm2d", "nn.GroupNorm", "nn.LayerNorm",
                   "nn.RMSNorm", "nn.Embedding", "nn.GELU", "nn.Softmax", "nn.PReLU", "nn.LSTM", "nn.GRUCell",
                   "nn.MultiheadAttention", "nn.TransformerEncoderLayer", "nn.CrossEntropyLoss", "nn.CTCLoss",
                   "nn.ReflectionPad2d")


@dataclasses.dataclass(frozen=True)
class Finding:
    """A CPU kernel less accurate than its dtype allows (docs/budgets.md: Kernel findings): how, the worst
    budget use the slow sweep measured (torch 2.13, CPU), and, where the mechanism bounds it, the most it can
    reach (the check's limit; None where it depends on the data's cancellation). ``when``: where that kernel is
    the one that runs (None: always); elsewhere its calls are held to their budget."""

    reason: str
    measured: float
    limit: float | None = None
    when: Callable[[], bool] | None = None

    def applies(self) -> bool:
        return self.when is None or self.when()


def thnn_convolution(dtype: torch.dtype) -> bool:
    """Whether a convolution in ``dtype`` runs PyTorch's own CPU kernels (Slow2d, SlowTranspose2d, Slow3d...) rather
    than oneDNN's: float16 on most CPUs, and bfloat16 where oneDNN has no bfloat16 convolution (its instruction set
    below AVX-512: AMD Zen 2 and 3, Intel before Skylake-SP, or capped by ONEDNN_MAX_CPU_ISA=AVX2;
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False) or is disabled (``torch.backends.mkldnn.flags``)."""
    x, w = torch.zeros(1, 1, 3, 3, dtype=dtype), torch.zeros(1, 1, 3, 3, dtype=dtype)
    backend = torch._C._select_conv_backend(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, None)
    return str(backend).rsplit(".", 1)[-1].startswith("Slow")


# (op, dtype) -> the finding that lets its calls go over budget
FINDINGS: dict[tuple[str, torch.dtype], Finding] = {
    ("aten.native_batch_norm.default", torch.bfloat16): Finding(
        "save_invstd rounded three times: the variance sum is stored to a bfloat16 tensor, divided by n in "
        "c10's BFloat16 arithmetic, and 1/sqrt of it rounded (<= 2 u relative; one rounding: <= u, the budget); "
        "test_batch_norm_invstd_finding reproduces it bit for bit (InstanceNorm2d)", 1.27, 2.0),
    ("aten.fractional_max_pool3d.default", torch.bfloat16): Finding(
        "the pooling windows' starts computed in bfloat16 arithmetic from the random samples (the 2-d kernel "
        "uses float): 7 of 480 windows move on FractionalMaxPool3d's third sample, so other elements are picked "
        "than float32 or float64 pick from the same samples", 21.5),
    ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", torch.float16): Finding(
        "the backward GEMMs read float16 copies of the probabilities and of dS (attn_reduced, grad_attn_reduced "
        "in FlashAttentionKernel.cpp): one more rounding at u per term, which cancels in the sum-loss gradients "
        "(TransformerEncoder; read from the source, not reproduced bit for bit)", 1.36),
}
# PyTorch's own convolution kernels (the thnn path, where oneDNN has no kernel for the dtype: thnn_convolution): each
# GEMM's float32 sums stored to the device dtype, col2im adding the overlapping columns in the device dtype, grad_weight
# adding one GEMM per batch element into a device-dtype accumulator (test_convolution_thnn_finding reproduces them from
# a float64 emulation). Where oneDNN runs the convolution instead, its calls are held to their budget.
for _dtype, _forward, _backward in ((torch.bfloat16, 98.8, 91.8), (torch.float16, 96.7, 5.72)):
    _thnn = functools.partial(thnn_convolution, _dtype)
    FINDINGS[("aten.convolution.default", _dtype)] = Finding(
        "transposed convolution on the thnn path: GEMM columns rounded to the device dtype, col2im adds the "
        "overlapping ones in the device dtype, the bias one more rounding (ConvTranspose2d)", _forward, when=_thnn)
    FINDINGS[("aten.convolution_backward.default", _dtype)] = Finding(
        "the thnn path: grad_input is col2im of columns rounded to the device dtype, summed in it; grad_weight one "
        "GEMM per batch element added into a device-dtype accumulator (Conv2d)", _backward, when=_thnn)
for _dtype, _bn_backward, _ln_backward, _nll, _nll2d in ((torch.bfloat16, 2810.0, 233.0, 2.30, 10.2),
                                                        (torch.float16, 296.0, 105.0, 2.55, 3.77)):
    FINDINGS[("aten.native_batch_norm_backward.default", _dtype)] = Finding(
        "with a non-contiguous grad_output (the expanded ones of sum()'s backward) the CPU kernel takes its "
        "generic path, in the device dtype's arithmetic: x - mean, the projection k and each product rounded; "
        "the sum-loss dx cancels to ~0, so the error is all rounding (bit for bit: "
        "test_batch_norm_backward_finding; BatchNorm1d)", _bn_backward)
    FINDINGS[("aten.native_layer_norm_backward.default", _dtype)] = Finding(
        "weight/bias gradients summed over rows in the device dtype (tests/test_budgets.py EXCEPTIONS; "
        "TransformerDecoderLayer)", _ln_backward)
    _total_weight = ("total_weight summed in the device dtype, one rounding per target (a sequential sum in that "
                     "dtype gives CrossEntropyLoss sample 45's 16.5 where 16.375 is correctly rounded), and the "
                     "mean divides by it")
    FINDINGS[("aten.nll_loss_forward.default", _dtype)] = Finding(_total_weight + " (LinearCrossEntropyLoss)", _nll)
    FINDINGS[("aten.nll_loss2d_forward.default", _dtype)] = Finding(_total_weight + " (LinearCrossEntropyLoss)", _nll2d)

if TORCH_BEFORE_2_5:  # seen on torch 2.4.1; torch 2.13 computes these in float32
    FINDINGS[("aten.native_batch_norm.default", torch.float16)] = Finding(
        "as bfloat16's: float16 statistics rounded three times on torch 2.4.1 (InstanceNorm2d)", 1.07, 2.0)
    for _dtype, _softmax, _log_softmax in ((torch.bfloat16, 219.0, 468.0), (torch.float16, 186.0, 62.7)):
        FINDINGS[("aten._softmax_backward_data.default", _dtype)] = Finding(
            "torch < 2.5: the CPU kernel accumulates sum(grad * y) in the device dtype (tests/test_budgets.py "
            "EXCEPTIONS); torch 2.5 accumulates in float32 (Softmax)", _softmax)
        FINDINGS[("aten._log_softmax_backward_data.default", _dtype)] = Finding(
            "torch < 2.5: the CPU kernel accumulates sum(grad) in the device dtype (CrossEntropyLoss)", _log_softmax)
    FINDINGS[("aten.celu.default", torch.float32)] = Finding(
        "torch 2.4.1: alpha * (exp(x / alpha) - 1), not expm1, so it cancels near 0 (that formula in float32 gives "
        "its values bit for bit at x = -1e-3, -1e-4, -3e-2); torch 2.13's celu stays within budget (CELU)", 1.76)

# Known bugs outside this file: (module, dtype or None for all) -> why; strict xfail where they apply, in
# both runs (KNOWN_BUGS) or in the all-samples sweep only (KNOWN_BUGS_ALL_SAMPLES: later samples meet them).
KNOWN_BUGS: dict[tuple[str, torch.dtype | None], str] = {}
KNOWN_BUGS_ALL_SAMPLES: dict[tuple[str, torch.dtype | None], str] = {}


def _bug(name: str, dtype: torch.dtype, slow: bool) -> str | None:
    tables = (KNOWN_BUGS, KNOWN_BUGS_ALL_SAMPLES) if slow else (KNOWN_BUGS,)
    return next((t[k] for t in tables for k in ((name, dtype), (name, None)) if k in t), None)


def _params(names, slow: bool) -> list:
    out = []
    for name in names:
        for dtype in DTYPES:
            for training in (True, False):
                bug = _bug(name, dtype, slow)
                marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
                if slow:
                    marks.append(pytest.mark.slow)
                out.append(pytest.param(name, dtype, training, marks=marks,
                                        id=f"{name}-{str(dtype)[6:]}-{'train' if training else 'eval'}"))
    return out


# --- one step of one sample ---
def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _fresh(tree):
    """Copies of a sample's tensors (leaves, requires_grad as given); a tensor passed twice (self-attention's
    query, key and value) is copied once, so that the module sees one tensor as before."""
    memo: dict[int, torch.Tensor] = {}

    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            memo[id(x)] = x.detach().clone().requires_grad_(x.requires_grad)
        return memo[id(x)]

    return tree_map(copy, tree)


@dataclasses.dataclass
class Run:
    results: list  # outputs, loss, input gradients, then the module's gradients, parameters and buffers
    error: Exception | None
    rng: torch.Tensor


def _step(module: torch.nn.Module, args, kwargs) -> list:
    leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    outs = _tensors(module(*args, **kwargs))
    results = list(outs)
    summed = [t for t in outs if t.requires_grad and t.is_floating_point()]
    if summed:
        loss = summed[0].sum()
        for t in summed[1:]:
            loss = loss + t.sum()
        loss.backward()
        results.append(loss)
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            torch.optim.SGD(params, lr=0.1, momentum=0.9).step()
    return results + [t.grad for t in leaves]


def _run(mi, sample, dtype: torch.dtype, training: bool, *modes) -> Run:
    cargs, ckwargs = _fresh((sample.constructor_input.args, sample.constructor_input.kwargs))
    args, kwargs = _fresh((sample.forward_input.args, sample.forward_input.kwargs))
    torch.manual_seed(1234)
    results, error = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = mi.module_cls(*cargs, **ckwargs).to(dtype).train(training)
            with contextlib.ExitStack() as stack:
                for m in modes:
                    stack.enter_context(m)
                results = _step(module, args, kwargs)
            results += [p.grad for p in module.parameters()] + list(module.parameters()) + list(module.buffers())
        except Exception as exc:  # the step failing natively is fine: shadow must fail the same way
            error = exc
    return Run(results, error, torch.get_rng_state())


def _samples(mi, dtype: torch.dtype, training: bool, n: int | None) -> list:
    torch.manual_seed(0)
    samples = mi.module_inputs_func(mi, device="cpu", dtype=dtype, requires_grad=True, training=training)
    return samples if n is None else samples[:n]


# --- one module, dtype and mode over its samples ---
_LOWER_PRECISIONS = {str(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.complex64)}  # Record.dtype


@dataclasses.dataclass
class Outcome:
    """What a (module, dtype, mode) did: the figures the sweep reports, and its failures."""

    name: str
    samples: int = 0
    native_errors: list[str] = dataclasses.field(default_factory=list)  # the plain step raised (and shadow alike)
    calls: int = 0
    casts: int = 0  # float64 runs: records of a lower precision (explicit casts)
    over_budget: dict[str, float] = dataclasses.field(default_factory=dict)  # op -> worst budget use
    exclusions: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)


def check_module(mi, dtype: torch.dtype, training: bool, n_samples: int | None) -> Outcome:
    oc = Outcome(f"{mi.name} {dtype} {'train' if training else 'eval'}")
    for i, sample in enumerate(_samples(mi, dtype, training, n_samples)):
        _check_sample(oc, f"{oc.name} sample {i} ({sample.desc})", mi, sample, dtype, training)
        oc.samples += 1
    return oc


def _check_sample(oc: Outcome, where: str, mi, sample, dtype: torch.dtype, training: bool) -> None:
    plain = _run(mi, sample, dtype, training)
    sm = ShadowMode(spot_checks="off")
    shadowed = _run(mi, sample, dtype, training, sm)
    rep = sm.report
    oc.calls += len(rep.records)
    e1, e3 = plain.error, shadowed.error
    if (e1 is None) != (e3 is None) or (e1 is not None and (type(e1), str(e1)) != (type(e3), str(e3))):
        oc.failures.append(f"{where}: plain step raised {e1!r}, shadowed step raised {e3!r}")
        return
    if rep.coverage.internal_errors:
        oc.failures.append(f"{where}: {rep.coverage.internal_errors} internal errors: {rep.coverage.unsupported}")
    elif rep.coverage.unsupported:
        oc.failures.append(f"{where}: unsupported calls: {rep.coverage.unsupported}")
    if not torch.equal(plain.rng, shadowed.rng):
        oc.failures.append(f"{where}: the RNG state moved differently under shadow")
    if e1 is not None:
        oc.native_errors.append(str(e1).splitlines()[0][:200])
        return

    traced: list[Run] = []

    def forwarding() -> Run:  # the step under a mode that only forwards (MODE_SENSITIVE's evidence)
        if not traced:
            traced.append(_run(mi, sample, dtype, training, _Trace()))
        return traced[0]

    if len(plain.results) != len(shadowed.results):
        oc.failures.append(f"{where}: {len(shadowed.results)} results under shadow, {len(plain.results)} without")
    for i, (a, c) in enumerate(zip(plain.results, shadowed.results)):
        if same(a, c):
            continue
        b = forwarding().results[i] if i < len(forwarding().results) else None
        if not same(a, b) and same(c, b):
            oc.exclusions[MODE_SENSITIVE] = oc.exclusions.get(MODE_SENSITIVE, 0) + 1
        else:
            oc.failures.append(f"{where}: result {i} differs from the plain run's (shadow changed the computation)")

    for rec in rep.records:
        if dtype == torch.float64:
            if rec.dtype in _LOWER_PRECISIONS:
                oc.casts += 1
            elif rec.local is not None and not rec.local.exact:
                oc.failures.append(f"{where}: float64 record {rec.index} {rec.op} local error not exact: {rec.local}")
        elif rec.over_budget:
            oc.over_budget[rec.op] = max(oc.over_budget.get(rec.op, 0.0), rec.budget.used)
            finding = FINDINGS.get((rec.op, dtype))
            if finding is None or not finding.applies():
                oc.failures.append(f"{where}: {rec.op} over budget ({rec.budget.used:.3g}) with no finding"
                                   + (" for the kernel that ran (its finding is another kernel's)" if finding else ""))
            elif not math.isfinite(rec.budget.used):  # a bound <= 0: no kernel's rounding explains that
                oc.failures.append(f"{where}: {rec.op} used {rec.budget.used} of its budget")
            elif finding.limit is not None and rec.budget.used > finding.limit:
                oc.failures.append(f"{where}: {rec.op} used {rec.budget.used:.3g} of its budget, more than its "
                                   f"finding's mechanism allows ({finding.limit})")


def _check(name: str, dtype: torch.dtype, training: bool, n_samples: int | None) -> None:
    mi = MODULES.get(name)
    if mi is None:
        pytest.skip(f"{name} is not in module_db of torch {torch.__version__}")
    if not training and not mi.train_and_eval_differ and n_samples is not None:
        pytest.skip(f"{name}: module_db says training and eval compute alike (the slow sweep runs eval too)")
    oc = check_module(mi, dtype, training, n_samples)
    if oc.samples and len(oc.native_errors) == oc.samples and not oc.failures:
        pytest.skip(f"{name} does not run in {dtype} on the CPU: {oc.native_errors[0]}")
    assert not oc.failures, f"{oc.name}: {len(oc.failures)} failures\n" + "\n".join(oc.failures[:10])


@pytest.mark.parametrize("name,dtype,training", _params(DEFAULT_MODULES, slow=False))
def test_module(name, dtype, training):
    """The first sample of a representative module: no crash, no interference, exact (float64), within
    budget (float32), over budget only where a kernel finding says why (bfloat16, float16)."""
    _check(name, dtype, training, 1)


@pytest.mark.parametrize("name,dtype,training", _params(sorted(MODULES), slow=True))
def test_module_all_samples(name, dtype, training):
    _check(name, dtype, training, None)


# --- undefined outputs: what the kernels leave unwritten (shadow.replay.defined) ---
def _ctc_args(targets_1d: bool, lengths_as_tensors: bool):
    """Three sequences, one of each edge: a full one, a short one, and one of input length 0 (target 0)."""
    torch.manual_seed(0)
    log_probs = torch.randn(6, 3, 5, dtype=torch.float64).log_softmax(2)
    input_lengths, target_lengths = [6, 4, 0], [3, 1, 0]
    targets = torch.randint(1, 5, (4,)) if targets_1d else torch.randint(1, 5, (3, 3))
    if lengths_as_tensors:
        return log_probs, targets, torch.tensor(input_lengths), torch.tensor(target_lengths)
    return log_probs, targets, input_lengths, target_lengths


@pytest.mark.parametrize("targets_1d", [False, True], ids=["targets2d", "targets1d"])
@pytest.mark.parametrize("lengths_as_tensors", [False, True], ids=["default", "Tensor"])
def test_ctc_defined_region(targets_1d, lengths_as_tensors):
    """The mask of _ctc_loss's log_alpha is exactly what the CPU kernel writes: with fresh memory NaN-filled,
    log_alpha is NaN where the mask is False and finite or -inf where it is True (the kernel's logsumexp
    never makes a NaN of finite log-probabilities)."""
    args = _ctc_args(targets_1d, lengths_as_tensors)
    func = aten._ctc_loss.Tensor if lengths_as_tensors else aten._ctc_loss.default
    with _FillUninitialized():
        nll, log_alpha = func(*args)
    masks = defined_regions(plan_of(func), list(args), {}, (nll, log_alpha))
    assert masks[0] is None and masks[1].shape == log_alpha.shape and masks[1].dtype == torch.bool
    assert torch.equal(masks[1], ~log_alpha.isnan())
    # (batch 3, 6 steps, 2 * 3 + 1 states): row t = 0 of each sequence (7), then t in 1..5 of the first
    # sequence (5 * 7) and t in 1..3 of the second, 2 * 1 + 1 states (3 * 3): 21 + 35 + 9 = 65 of 126
    assert int(masks[1].sum()) == 65 and log_alpha.numel() == 126


def test_defined_regions_default_is_none():
    """Ops with no rule define every element of their outputs."""
    x = torch.randn(3)
    assert defined_regions(plan_of(aten.exp.default), [x], {}, x.exp()) is None


def _masked_backward_calls() -> dict:
    torch.manual_seed(0)
    x, w = torch.randn(4, 3, 5, 5), torch.randn(3)
    g, groups, rows = torch.randn_like(x), x.reshape(4, 3, -1), x.reshape(12, -1)

    def stats(t: torch.Tensor, dims, keepdim: bool = False):
        return t.mean(dims, keepdim=keepdim), t.var(dims, unbiased=False, keepdim=keepdim).add(1e-5).rsqrt()

    return {
        "native_batch_norm_backward": lambda m: aten.native_batch_norm_backward(
            g, x, w, None, None, *stats(x, (0, 2, 3)), True, 1e-5, m),
        "native_layer_norm_backward": lambda m: aten.native_layer_norm_backward(
            g.reshape(12, -1), rows, [25], *stats(rows, 1, True), torch.ones(25), torch.zeros(25), m),
        "native_group_norm_backward": lambda m: aten.native_group_norm_backward(
            g, x, *stats(groups, -1), w, 4, 3, 25, 3, m),
        "convolution_backward": lambda m: aten.convolution_backward(
            torch.randn(4, 2, 3, 3), x, torch.randn(2, 3, 3, 3), [2], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, m),
    }


@pytest.mark.parametrize("op", ["native_batch_norm_backward", "native_layer_norm_backward",
                                "native_group_norm_backward", "convolution_backward"])
def test_output_mask_gives_no_tensor(op):
    """Outputs an ``output_mask`` switches off are undefined tensors (None), never memory left unwritten: no
    defined-region rule needed. (convolution_backward computes grad_weight for grad_bias anyway, fully.)"""
    call = _masked_backward_calls()[op]
    for mask in ([True, False, False], [False, True, False], [False, False, True]):
        with _FillUninitialized():
            out = call(mask)
        for on, t in zip(mask, out):
            assert t is None or not bool(t.isnan().any()), f"{op} {mask}: an output holds unwritten memory"
            if not on and t is not None:
                assert op == "convolution_backward" and mask == [False, False, True]


# --- the engine's wiring of defined regions: Record.skipped ---
def _ctc_step(dtype: torch.dtype, reduction: str) -> ShadowMode:
    torch.manual_seed(0)
    log_probs = torch.randn(50, 3, 15, dtype=dtype).log_softmax(2).detach().requires_grad_()
    targets = torch.randint(1, 15, (3, 30))
    sm = ShadowMode(spot_checks="off")
    with sm:
        loss = torch.nn.CTCLoss(reduction=reduction)(log_probs, targets, (50, 40, 30), (30, 25, 20))
        loss.backward()
    return sm


def test_ctc_undefined_skipped_float64():
    """float64: _ctc_loss's local error is exactly 0 on what it defines, and the elements it leaves unwritten
    are counted: per sequence (50 steps, 61 states) row 0 plus (L - 1) rows of 2 T + 1 states."""
    sm = _ctc_step(torch.float64, "sum")  # "sum": no at::tensor(target_lengths), only _ctc_loss's garbage
    rec = sm.report.find("aten._ctc_loss")[0]
    defined = 3 * 61 + 49 * 61 + 39 * 51 + 29 * 41
    assert rec.skipped == 3 * 50 * 61 - defined
    assert rec.local.exact and rec.drift.exact
    assert all(r.local is None or r.local.exact for r in sm.report.records)


def test_ctc_undefined_skipped_float32():
    """float32: the _ctc_loss row shows the kernel's rounding, not 1e77 ulp of garbage: its local error and
    drift are finite and every element it compares is finite on both sides."""
    sm = _ctc_step(torch.float32, "sum")
    rec = sm.report.find("aten._ctc_loss")[0]
    assert rec.skipped > 0 and rec.local.nonfinite == 0 and rec.drift.nonfinite == 0
    # 50 steps of the log-space recursion, each adding about one rounding of the alphas' magnitude (measured:
    # 3.9 ulp, drift 9.6e-8)
    assert rec.local.max_ulp <= 50 and rec.drift.rel_norm <= 50 * 2.0**-24
    assert not sm.report.records_over_budget()


def test_ctc_mean_reads_target_lengths():
    """reduction='mean' divides by at::tensor(target_lengths).clamp_min(1): aten.empty, then a std::copy no
    mode sees. The shadow must read the lengths the device wrote, not the bytes empty returned."""
    sm = _ctc_step(torch.float64, "mean")
    rec = sm.report.find("aten.clamp_min")[0]
    assert rec.local.exact and rec.drift.exact


# --- the bfloat16 batch-norm finding ---
class _Calls(TorchDispatchMode):
    """Keeps the arguments of every call of one op (a mode that otherwise only forwards)."""

    def __init__(self, func):
        super().__init__()
        self.func, self.calls = func, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.func:
            self.calls.append(tree_map(lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a, args))
        return func(*args, **(kwargs or {}))


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to dtype, back in float32 (one operation of c10's BFloat16/Half arithmetic)."""
    return t.to(dtype).float()


def _inv_std(x: torch.Tensor, eps: float, rounds_statistics: bool) -> torch.Tensor:
    """save_invstd as the CPU kernel computes it for x's dtype (batch_norm_cpu_update_stats_template and
    collect_stats): the variance sum accumulated in float32 (float64 here: the same float32 value but where
    the order of the sum decides); if ``rounds_statistics``, stored to a ``_var_sum`` tensor of x's dtype and
    divided by n in c10's BFloat16/Half operator/, which rounds; 1/sqrt in double (InvStd); stored to x's dtype."""
    dims = [0, *range(2, x.dim())]
    x64 = x.double()
    var_sum = (x64 - x64.mean(dims, keepdim=True)).square().sum(dims).float()
    n = torch.tensor(float(x.numel() // x.shape[1]))
    if rounds_statistics:
        var = _rounded(_rounded(var_sum, x.dtype) / _rounded(n, x.dtype), x.dtype)
    else:
        var = var_sum / n
    return (1 / torch.sqrt(var.double() + eps)).float().to(x.dtype)


# Which kernels round the statistics (test_batch_norm_invstd_finding checks both ways, bit for bit)
ROUNDS_STATISTICS = {torch.bfloat16: True, torch.float16: TORCH_BEFORE_2_5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_batch_norm_invstd_finding(dtype):
    """The reduced-precision batch-norm forward over budget is the kernel's: its save_invstd is, bit for bit on
    every training sample of the batch and instance norms, the three-rounding computation above (bfloat16;
    float16 on torch 2.4.1) or the one-rounding one (float16 on torch 2.13). Rounded once from float32
    statistics it stays within u relative of the exact value (the budget's bound); with three roundings the
    kernel exceeds that in bfloat16 (1.27 u), and stays within their 2 u."""
    u = torch.finfo(dtype).eps / 2  # unit roundoff: 2**-8 (bfloat16), 2**-11 (float16)
    worst_kernel = worst_correct = 0.0
    for name in ("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.InstanceNorm1d", "nn.InstanceNorm2d"):
        mi = MODULES[name]
        for sample in _samples(mi, dtype, True, None):
            calls = _Calls(aten.native_batch_norm.default)
            assert _run(mi, sample, dtype, True, calls).error is None
            for x, _, _, _, _, training, _, eps in calls.calls:
                _, _, inv_std = aten.native_batch_norm(x, None, None, None, None, True, 0.1, eps)
                assert torch.equal(inv_std, _inv_std(x, eps, ROUNDS_STATISTICS[dtype])), f"{name} {sample.desc}"
                dims = [0, *range(2, x.dim())]
                exact = x.double().var(dims, unbiased=False).add(eps).rsqrt()
                correct = x.float().var(dims, unbiased=False).add(eps).rsqrt().to(dtype).double()
                worst_kernel = max(worst_kernel, float(((inv_std.double() - exact).abs() / exact).max()) / u)
                worst_correct = max(worst_correct, float(((correct - exact).abs() / exact).max()) / u)
    # one rounding: <= u, plus float32's statistics (~2**-16 u); three: <= u/2 + u/2 (through the sqrt) + u
    assert worst_correct <= 1.0 + 1e-3 and worst_kernel <= (2.0 if ROUNDS_STATISTICS[dtype] else 1.0) + 1e-3
    if dtype == torch.bfloat16:
        assert worst_kernel > 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_batch_norm_backward_finding(dtype):
    """native_batch_norm_backward with an expanded grad_output (what sum()'s backward passes) is the CPU
    kernel's generic path in the device dtype's arithmetic, bit for bit: dotp = sum(r(x - mean) * dy) in float,
    k = r(r(r(dotp) * invstd) * invstd) / n, dx = r(r(r(dy - r(sum(dy) / n)) - r(r(x - mean) * k)) * invstd) * w,
    each r a rounding; with a contiguous grad_output it stays within its budget."""
    torch.manual_seed(0)
    x = (torch.randn(4, 10) * 2 + 1).to(dtype)
    w = torch.randn(10).to(dtype)
    _, mean, inv_std = aten.native_batch_norm(x, w, None, None, None, True, 0.1, 1e-5)
    dy = torch.ones((), dtype=dtype).expand(4, 10)
    dx = aten.native_batch_norm_backward(dy, x, w, None, None, mean, inv_std, True, 1e-5, [True, False, False])[0]

    def r(t):
        return _rounded(t, dtype)

    xm, inv, go = r(x.float() - mean.float()), inv_std.float(), dy.float()
    k = r(r(r(r((xm * go).sum(0)) * inv) * inv) / 4)
    emulated = r(r(r(go - r(r(go.sum(0)) / 4)) - r(xm * k)) * inv) * w.float()
    assert torch.equal(emulated.to(dtype), dx)
    contiguous = aten.native_batch_norm_backward(dy.contiguous(), x, w, None, None, mean, inv_std, True, 1e-5,
                                                 [True, False, False])[0]
    assert not torch.equal(contiguous, dx)  # the fast path computes in float32: other (better) values


# --- the thnn convolution finding: a float64 emulation of what its kernels round ---
def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A GEMM's float32 sum (exact here, in float64) stored to ``dtype``: its one rounding. The order of that sum is
    the BLAS kernel's (four interleaved partial sums or one sequential sum, by torch version and CPU) and is not
    emulated: where the exact and the float32 sums round to two neighbours in ``dtype``, the emulation is one ulp
    off (``gemm_ties``)."""
    return t.float().to(dtype).double()


def gemm_ties(k: int, numel: int, dtype: torch.dtype) -> int:
    """How many of ``numel`` results of k-term float32 sums may round otherwise than their exact values do: the
    share whose exact value lies within the float32 sum's error (~k u32 of it) of a rounding boundary of ``dtype``
    (spacing eps), 2 k u32 / eps, four times over. Measured: 0 or 1 in 2,300 (bfloat16), 2 in 672 (float16)."""
    return max(1, math.ceil(8 * k * 2.0**-24 / torch.finfo(dtype).eps * numel))


def _offsets(kernel: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(k) for k in kernel)))


def _window(at: tuple[int, ...], kernel_offset: tuple[int, ...], stride, dilation) -> tuple:
    """The padded positions one kernel offset reads (writes) for the ``at`` window positions, as a slice per dim."""
    return (..., *(slice(k * d, k * d + s * (n - 1) + 1, s) for n, k, s, d in zip(at, kernel_offset, stride, dilation)))


def _columns(x: torch.Tensor, kernel, stride, padding, dilation, at) -> torch.Tensor:
    """im2col (unfold, vol2col): (N, C, prod(kernel), *at), exact copies of the zero-padded input."""
    padded = torch.nn.functional.pad(x, [p for pad in reversed(padding) for p in (pad, pad)])
    return torch.stack([padded[_window(at, o, stride, dilation)] for o in _offsets(kernel)], 2)


def _col2im(cols: torch.Tensor, size, kernel, stride, padding, dilation, at, dtype: torch.dtype) -> torch.Tensor:
    """The columns (N, C, prod(kernel), *at) added into an image of ``size``, one kernel offset after the other,
    each add rounded to ``dtype`` (c10's BFloat16/Half ``+=``: in float, then stored): col2im, col2vol."""
    acc = cols.new_zeros(*cols.shape[:2], *(n + 2 * p for n, p in zip(size, padding)))
    for i, offset in enumerate(_offsets(kernel)):
        window = _window(at, offset, stride, dilation)
        acc[window] = (acc[window] + cols[:, :, i]).to(dtype).double()
    return acc[(..., *(slice(p, p + n) for p, n in zip(padding, size)))]


def _thnn(x, w, b, dy, y_size, stride, padding, dilation, groups, transposed, per_sample_bias, dtype, once=False):
    """What the thnn kernels compute for y, dx, dw, db (float64 arguments holding ``dtype`` values), with their
    roundings: every GEMM's result stored (``_stored``); col2im's adds in ``dtype`` (transposed y, dx); dw one GEMM
    per batch element added into a ``dtype`` accumulator; a transposed y's bias one more rounding; db a float sum
    (per batch element added in ``dtype`` on the dilated path). ``once``: every result rounded once from its exact
    value instead (what the error budget allows)."""
    n, kernel, nd = x.shape[0], w.shape[2:], x.dim() - 2
    k = math.prod(kernel)
    size, at = x.shape[2:], y_size  # input and output sizes (a transposed convolution writes its windows to y)
    c_in = x.shape[1]
    if transposed:  # y = col2im(W^T x); dx = W cols(dy); dw = x cols(dy)^T
        c_out = w.shape[1] * groups
        wg, xg = w.reshape(groups, c_in // groups, -1), x.reshape(n, groups, c_in // groups, -1)
        cols = torch.einsum("gck,ngcl->ngkl", wg, xg).reshape(n, c_out, k, *size)
        dcols = _columns(dy, kernel, stride, padding, dilation, size).reshape(n, groups, -1, math.prod(size))
        dx = torch.einsum("gck,ngkl->ngcl", wg, dcols).reshape(x.shape)
        per_sample = torch.einsum("ngcl,ngkl->ngck", xg, dcols)
        bias = b.reshape(c_out, *[1] * nd)
        if once:
            y = _col2im(cols, at, kernel, stride, padding, dilation, size, torch.float64) + bias
        else:
            y = _col2im(_stored(cols, dtype), at, kernel, stride, padding, dilation, size, dtype)
            y = _stored(y + bias, dtype)
    else:  # y = W cols(x) + b; dx = col2im(W^T dy); dw = dy cols(x)^T
        c_out = w.shape[0]
        wg, dyg = w.reshape(groups, c_out // groups, -1), dy.reshape(n, groups, c_out // groups, -1)
        cols = _columns(x, kernel, stride, padding, dilation, at).reshape(n, groups, -1, math.prod(at))
        y = (torch.einsum("gok,ngkl->ngol", wg, cols).reshape(n, c_out, *at) + b.reshape(c_out, *[1] * nd))
        dcols = torch.einsum("gok,ngol->ngkl", wg, dyg).reshape(n, c_in, k, *at)
        if not once:
            dcols = _stored(dcols, dtype)
        dx = _col2im(dcols, size, kernel, stride, padding, dilation, at, torch.float64 if once else dtype)
        per_sample = torch.einsum("ngol,ngkl->ngok", dyg, cols)
    sums = dy.reshape(n, dy.shape[1], -1).sum(2)  # per batch element, per channel
    if once:
        return [_stored(t, dtype) for t in (y, dx, per_sample.sum(0).reshape(w.shape), sums.sum(0))]
    dw, db = per_sample[0] * 0, sums[0] * 0
    for i in range(n):
        dw = _stored(dw + per_sample[i], dtype)
        db = _stored(db + _stored(sums[i], dtype), dtype) if per_sample_bias else db + sums[i]
    return [_stored(y, dtype), _stored(dx, dtype), dw.reshape(w.shape), _stored(db, dtype)]


# batch, channels in and out, input size, kernel, stride, padding, dilation, groups, transposed, output padding
_CONVOLUTIONS = {
    "conv1d": (2, 4, 5, (12,), (3,), (1,), (1,), (1,), 1, False, (0,)),
    "conv2d": (2, 3, 8, (6, 7), (3, 3), (1, 1), (1, 1), (1, 1), 1, False, (0, 0)),
    "conv2d_strided_dilated_grouped": (3, 4, 6, (9, 8), (3, 2), (2, 1), (1, 0), (1, 2), 2, False, (0, 0)),
    "conv3d": (2, 3, 4, (5, 6, 5), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1, False, (0, 0, 0)),
    "conv2d_wide": (2, 16, 16, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1), 1, False, (0, 0)),
    "conv_transpose1d_grouped": (2, 4, 6, (10,), (3,), (2,), (1,), (1,), 2, True, (1,)),
    "conv_transpose2d": (2, 4, 6, (6, 5), (3, 3), (2, 2), (1, 1), (1, 1), 1, True, (1, 0)),
    "conv_transpose3d": (2, 3, 4, (4, 3, 4), (3, 3, 3), (2, 1, 1), (1, 1, 0), (1, 1, 1), 1, True, (0, 0, 0)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("case", list(_CONVOLUTIONS))
def test_convolution_thnn_finding(case, dtype):
    """On the thnn path (forced here with ``torch.backends.mkldnn.flags(enabled=False)``, the path a CPU without
    oneDNN bfloat16 takes by itself), every output of convolution and convolution_backward is the float64
    emulation ``_thnn`` of its roundings, to the ulp but for ``gemm_ties``; rounding each result once (what the budget
    allows) gives other values in many elements: dx and dw (and a transposed y) carry the extra roundings."""
    n, c_in, c_out, size, kernel, stride, padding, dilation, groups, transposed, output_padding = _CONVOLUTIONS[case]
    torch.manual_seed(0)
    x = torch.randn(n, c_in, *size).to(dtype)
    w = torch.randn(*((c_in, c_out // groups) if transposed else (c_out, c_in // groups)), *kernel).to(dtype)
    b = torch.randn(c_out).to(dtype)
    conv = (stride, padding, dilation, transposed, output_padding, groups)
    with torch.backends.mkldnn.flags(enabled=False):
        backend = str(torch._C._select_conv_backend(x, w, b, *conv[:4], list(output_padding), groups, None))
        y = aten.convolution(x, w, b, *conv)
        dy = torch.randn(y.shape).to(dtype)
        results = [y, *aten.convolution_backward(dy, x, w, [c_out], *conv, [True, True, True])]
    assert backend.rsplit(".", 1)[-1].startswith("Slow"), backend
    args = (x.double(), w.double(), b.double(), dy.double(), y.shape[2:], stride, padding, dilation, groups,
            transposed, "Dilated" in backend, dtype)
    emulated, once = _thnn(*args), _thnn(*args, once=True)
    k = {"y": c_in // groups * math.prod(kernel), "dx": c_out // groups, "dw": math.prod(y.shape[2:]), "db": 1}
    if transposed:
        k.update(y=c_in // groups, dx=c_out // groups * math.prod(kernel), dw=math.prod(size))
    for name, got, want, rounded_once in zip(("y", "dx", "dw", "db"), results, emulated, once):
        off = int((got.double() != want).sum())
        assert off <= gemm_ties(k[name], got.numel(), dtype), (name, off, got.numel())
        if name == "dw" or name == ("y" if transposed else "dx"):  # the extra roundings show
            assert int((got.double() != rounded_once).sum()) >= got.numel() // 20, name


@pytest.mark.parametrize("enabled", [True, False], ids=["onednn_enabled", "onednn_disabled"])
def test_a_reports_numerics_say_which_bfloat16_convolution_ran(enabled):
    """A report's meta["numerics"] (shadow.devices.numerics_settings) holds what tells the two paths apart: oneDNN
    enabled and with bfloat16, or PyTorch's own kernels (the finding above)."""
    from shadow.devices import numerics_settings

    with torch.backends.mkldnn.flags(enabled=enabled):
        s = numerics_settings()
        onednn = s["torch.backends.mkldnn.enabled"] is True and \
            s["torch.ops.mkldnn._is_mkldnn_bf16_supported()"] is True
        assert onednn != thnn_convolution(torch.bfloat16)


@pytest.mark.parametrize("name", [n for n in DEFAULT_MODULES if "Conv" in n])
def test_module_convolution_thnn_path(name):
    """The bfloat16 convolutions of test_module on the thnn path, on any CPU (oneDNN disabled): over budget only
    as its finding says. On a CPU with oneDNN bfloat16, test_module holds the oneDNN path to the budget."""
    with torch.backends.mkldnn.flags(enabled=False):
        assert thnn_convolution(torch.bfloat16)
        _check(name, torch.bfloat16, True, 1)


def test_fractional_max_pool3d_bfloat16_finding():
    """fractional_max_pool3d in bfloat16 picks other windows than in float32 from the very same inputs and
    random samples (its window starts are computed in bfloat16), on one of FractionalMaxPool3d's samples;
    the 2-d kernel picks the same ones in every sample."""
    moved = {}
    for name, op in (("nn.FractionalMaxPool2d", aten.fractional_max_pool2d.default),
                     ("nn.FractionalMaxPool3d", aten.fractional_max_pool3d.default)):
        moved[name] = 0
        for sample in _samples(MODULES[name], torch.bfloat16, True, None):
            calls = _Calls(op)
            assert _run(MODULES[name], sample, torch.bfloat16, True, calls).error is None
            for args in calls.calls:
                as_float = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
                moved[name] += int((op(*args)[1] != op(*as_float)[1]).sum())
    assert moved["nn.FractionalMaxPool2d"] == 0 and moved["nn.FractionalMaxPool3d"] > 0
