"""Training steps under ShadowMode: after k optimizer steps the shadow of every parameter is the float64 run.

The reference is a separate float64 run of the same program: the float32 model deep-copied and converted to
float64 after its (float32-rounded) initialization, the same batches upcast exactly, the same optimizer
kernels, and the same dropout masks. The masks are the one thing float64 cannot recompute (it would draw
other random numbers), so the device run records the output of every random op through a small dispatch
mode and the float64 run replays them through another (``RandomRecorder`` / ``RandomReplayer``); the
replayer checks op and shape at each call, so a desynchronized replay fails instead of passing silently.

The shadow replays each op's own CPU kernel in float64 on shadow inputs, so it should equal the float64
program up to the few places where they differ on purpose (kernels chosen per dtype, e.g. oneDNN LSTM on
float32 vs the native one on float64): 1e-12 relative leaves ~4 decimal digits of room over float64
rounding (2**-53 ~ 1.1e-16) accumulated over a few hundred ops, and is 5 orders below float32's
(2**-24 ~ 6e-8), so a shadow that followed the device anywhere would fail.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shadow import ShadowMode

from models import IMPLS, MODELS, OPTIMIZERS, build, dtype_unsupported, loss_fn, make_batches, \
    make_optimizer, to_dtype, train_steps
from skips import skip_unsupported

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten
STEPS = 3
TOL = 1e-12
CLIP = 0.2  # max_norm below every model's gradient norm (0.41-9.5 here), so clip_grad_norm_ really scales


# Random ops the models' dropout reaches on CPU: at::dropout is `empty_like(x).bernoulli_(1 - p)` there
# (native_dropout is the fused kernel of CUDA/XPU/privateuse1 devices; kept for them).
RANDOM_OPS = frozenset({aten.bernoulli_.float, aten.native_dropout.default})


class RandomRecorder(TorchDispatchMode):
    """Keeps a copy of what every random op call produced on the device, in call order."""

    def __init__(self):
        super().__init__()
        self.draws: list[tuple[torch._ops.OpOverload, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.bernoulli_.float:
            self.draws.append((func, out.detach().clone()))
        elif func is aten.native_dropout.default:
            self.draws.append((func, out[1].detach().clone()))  # the mask
        return out


class RandomReplayer(TorchDispatchMode):
    """Substitutes the recorded draws for the random ops of a second run of the same program."""

    def __init__(self, draws: list[tuple[torch._ops.OpOverload, torch.Tensor]]):
        super().__init__()
        self.draws = list(draws)
        self.used = 0

    def _next(self, func, shape) -> torch.Tensor:
        assert self.used < len(self.draws), f"{func}: the reference run draws more than the {len(self.draws)} recorded"
        rfunc, value = self.draws[self.used]
        assert rfunc is func and value.shape == shape, (
            f"draw {self.used}: the reference runs {func} {tuple(shape)}, the device ran {rfunc} {tuple(value.shape)}")
        self.used += 1
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.bernoulli_.float:
            self_ = args[0]
            return self_.copy_(self._next(func, self_.shape))
        if func is aten.native_dropout.default:
            x, p = args[0], args[1]
            mask = self._next(func, x.shape)
            # as native_dropout's CPU kernel: input * mask * (1 / (1 - p))
            return x * mask * (0.0 if p >= 1 else 1.0 / (1.0 - p)), mask
        assert func not in RANDOM_OPS
        return func(*args, **kwargs)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0)."""
    a, b = a.detach().double(), b.detach().double()
    nb = torch.linalg.vector_norm(b).item()
    nd = torch.linalg.vector_norm(a - b).item()
    return nd / nb if nb else (0.0 if nd == 0 else math.inf)


def run_case(model_name: str, opt_name: str, impl: str, *, steps: int = STEPS, accumulate: int = 1,
             clip: float | None = None, clip_foreach: bool | None = None, seed: int = 0) -> dict:
    """The device run under ShadowMode and the float64 reference run of the same program."""
    model = build(model_name, seed=seed)
    ref_model = copy.deepcopy(model).double()  # float32-rounded initialization, upcast exactly
    batches = make_batches(model_name, steps * accumulate, seed=seed + 1)
    loss = loss_fn(model_name)
    opt = make_optimizer(opt_name, model.parameters(), impl)
    ref_opt = make_optimizer(opt_name, ref_model.parameters(), impl)

    norms: list = []
    torch.manual_seed(seed + 2)
    with RandomRecorder() as rec, ShadowMode() as sm:  # the recorder sits below: it sees the device's ops only
        losses = train_steps(model, opt, batches, loss, accumulate=accumulate, clip=clip, clip_foreach=clip_foreach,
                             norms=norms)
    torch.manual_seed(seed + 3)  # other random numbers: only the replayed draws may reach the reference
    with RandomReplayer(rec.draws) as rep:
        ref_losses = train_steps(ref_model, ref_opt, to_dtype(batches, torch.float64), loss, accumulate=accumulate,
                                 clip=clip, clip_foreach=clip_foreach)
    assert rep.used == len(rec.draws), f"the reference used {rep.used} of {len(rec.draws)} recorded draws"
    return dict(model=model, ref_model=ref_model, sm=sm, losses=losses, ref_losses=ref_losses, draws=len(rec.draws),
                norms=norms)


def check_against_reference(case: dict) -> dict:
    """Every parameter's and buffer's shadow, and every loss's, equals the float64 run to TOL; returns the figures."""
    sm, model, ref_model = case["sm"], case["model"], case["ref_model"]
    ref_tensors = dict(ref_model.named_parameters()) | dict(ref_model.named_buffers())
    shadow_err, device_err = {}, {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():  # num_batches_tracked
            assert torch.equal(t, ref_tensors[name]), name
            continue
        shadow_err[name] = rel(sm.shadow_of(t), ref_tensors[name])
        device_err[name] = rel(t, ref_tensors[name])
    for i, (lo, ref) in enumerate(zip(case["losses"], case["ref_losses"])):
        shadow_err[f"loss[{i}]"] = rel(sm.shadow_of(lo), ref)
        device_err[f"loss[{i}]"] = rel(lo, ref)
    worst = max(shadow_err, key=shadow_err.get)
    assert shadow_err[worst] <= TOL, f"{worst}: shadow vs float64 run rel {shadow_err[worst]:.3g} > {TOL}"
    # the device itself is float32: if the shadow had followed it, the check above would have failed
    assert max(device_err.values()) > 1e3 * TOL, device_err
    cov = sm.report.coverage
    assert cov.internal_errors == 0, str(cov)
    return {"shadow": shadow_err[worst], "device": max(device_err.values())}



@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
def test_shadow_equals_float64_run(model_name, opt_name, impl):
    skip_unsupported(opt_name, impl, torch.float32, torch.float64)
    case = run_case(model_name, opt_name, impl)
    check_against_reference(case)
    if model_name != "mlp":  # every model but the MLP has dropout: the masks were really replayed
        assert case["draws"] >= STEPS


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_name", MODELS)
def test_accumulation_and_clipping(model_name, impl):
    """Two backward passes per step, then clip_grad_norm_ (its foreach and for-loop kernels) and AdamW."""
    skip_unsupported("adamw", impl, torch.float32, torch.float64)
    case = run_case(model_name, "adamw", impl, accumulate=2, clip=CLIP, clip_foreach=impl != "forloop")
    check_against_reference(case)
    ops = set(case["sm"].report.by_op)
    # the clip ran through the kernels asked for, and really clipped (total norm above max_norm every step)
    assert ("aten._foreach_norm.Scalar" if impl != "forloop" else "aten.linalg_vector_norm.default") in ops
    assert len(case["norms"]) == STEPS and min(n.item() for n in case["norms"]) > CLIP, case["norms"]


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
def test_shadow_equals_float64_run_long(model_name, opt_name, impl):
    """More steps and other seeds: drift grows, the shadow still tracks float64."""
    skip_unsupported(opt_name, impl, torch.float32, torch.float64)
    for seed in (1, 2):
        check_against_reference(run_case(model_name, opt_name, impl, steps=8, accumulate=2, clip=1.0, seed=seed))


# --- records: phases and modules -----------------------------------------------------------------------------
# (op, phase) -> the exact set of modules its records are charged to, from ModuleTracker's dotted paths.
# the attention's softmax: _safe_softmax (rows fully masked give 0, not NaN) from torch 2.5; _softmax before
SOFTMAX = "aten._safe_softmax.default" if hasattr(aten, "_safe_softmax") else "aten._softmax.default"
EXPECTED_MODULES = {
    "mlp": {
        ("aten.addmm.default", "forward"): {"MLP.fc1", "MLP.fc2", "MLP.fc3"},
        ("aten.gelu.default", "forward"): {"MLP.act"},
        ("aten.mm.default", "backward"): {"MLP.fc1", "MLP.fc2", "MLP.fc3"},
        ("aten.gelu_backward.default", "backward"): {"MLP.act"},
    },
    "cnn": {
        ("aten.convolution.default", "forward"): {"CNN.conv"},
        ("aten.native_batch_norm.default", "forward"): {"CNN.bn"},
        ("aten.max_pool2d_with_indices.default", "forward"): {"CNN.pool"},
        ("aten.bernoulli_.float", "forward"): {"CNN.drop"},
        ("aten.convolution_backward.default", "backward"): {"CNN.conv"},
        ("aten.native_batch_norm_backward.default", "backward"): {"CNN.bn"},
        ("aten.max_pool2d_with_indices_backward.default", "backward"): {"CNN.pool"},
    },
    "transformer": {
        # the attention's output projection runs inside F.multi_head_attention_forward: charged to self_attn
        ("aten.addmm.default", "forward"): {"Transformer.enc.self_attn", "Transformer.enc.linear1",
                                            "Transformer.enc.linear2", "Transformer.head"},
        (SOFTMAX, "forward"): {"Transformer.enc.self_attn"},
        ("aten.native_layer_norm.default", "forward"): {"Transformer.enc.norm1", "Transformer.enc.norm2"},
        ("aten.bernoulli_.float", "forward"): {"Transformer.enc.self_attn", "Transformer.enc.dropout",
                                               "Transformer.enc.dropout1", "Transformer.enc.dropout2"},
        ("aten._softmax_backward_data.default", "backward"): {"Transformer.enc.self_attn"},
        ("aten.native_layer_norm_backward.default", "backward"): {"Transformer.enc.norm1", "Transformer.enc.norm2"},
    },
    "lstm": {
        ("aten.embedding.default", "forward"): {"LSTMClassifier.emb"},
        ("aten.embedding_dense_backward.default", "backward"): {"LSTMClassifier.emb"},
        ("aten.addmm.default", "forward"): {"LSTMClassifier.fc"},
    },
}
if torch.backends.mkldnn.is_available():  # nn.LSTM's float32 CPU kernel: oneDNN, replayed as the LSTM math
    EXPECTED_MODULES["lstm"] |= {("aten.mkldnn_rnn_layer.default", "forward"): {"LSTMClassifier.lstm"},
                                 ("aten.mkldnn_rnn_layer_backward.default", "backward"): {"LSTMClassifier.lstm"}}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_name", MODELS)
def test_records_phases_and_modules(model_name, impl):
    skip_unsupported("adam", impl, torch.float32, torch.float64)
    steps = 2
    model = build(model_name)
    opt = make_optimizer("adam", model.parameters(), impl)
    root = type(model).__name__
    with ShadowMode() as sm:
        train_steps(model, opt, make_batches(model_name, steps), loss_fn(model_name))
    rep = sm.report
    assert {r.phase for r in rep.records} <= {"forward", "backward", "optimizer", "other"}
    # each step: the forward's ops, then the backward's, then the optimizer's (loss ops sit outside modules)
    runs = [k for k, _ in itertools.groupby(r.phase for r in rep.records if r.phase != "other")]
    assert runs == ["forward", "backward", "optimizer"] * steps
    for (op, phase), modules in EXPECTED_MODULES[model_name].items():
        recs = rep.find(op=op, phase=phase)
        assert {r.module for r in recs} == modules, (op, phase)
        assert len(recs) >= steps * len(modules)
    # the loss is computed outside any module; its backward is in the backward phase
    assert {r.module for r in rep.find(op="aten.nll_loss_forward.default")} == {""}
    assert {r.phase for r in rep.find(op="aten.nll_loss_forward.default")} <= {"forward", "other"}
    assert {r.phase for r in rep.find(op="aten.nll_loss_backward.default")} == {"backward"}
    # the optimizer's updates are charged to the parameters they update; one kernel over all of them to the model
    names = [f"{root}.{n}" for n, _ in model.named_parameters()]
    if impl == "forloop":
        assert [r.module for r in rep.find(op="aten.addcdiv_.default")] == names * steps
    else:
        op = "aten._foreach_addcdiv_.ScalarList" if impl == "foreach" else "aten._fused_adam_.default"
        recs = rep.find(op=op)
        assert len(recs) == steps and {(r.module, r.phase) for r in recs} == {(root, "optimizer")}
    assert {r.phase for r in rep.records if r.module in names} == {"optimizer"}
    # the per-module aggregates cover every module seen
    assert set().union(*EXPECTED_MODULES[model_name].values()) | set(names) <= set(rep.by_module)


# --- the oneDNN LSTM replay rule, on its own ------------------------------------------------------------------
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_layers_replay_as_float64(bias, bidirectional):
    """nn.LSTM variants (no bias: the kernel gets the weights again in the bias slots; reverse direction;
    gradients into h_n and c_n too): output and every gradient's shadow is the float64 nn.LSTM to 1e-12."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, num_layers=2, bias=bias, bidirectional=bidirectional, batch_first=True)
    ref = copy.deepcopy(lstm).double()
    x = torch.randn(3, 5, 4)
    with ShadowMode() as sm:
        out, (h, c) = lstm(x)
        (out.pow(2).sum() + h.sum() + 2 * c.sum()).backward()
    rout, (rh, rc) = ref(x.double())
    (rout.pow(2).sum() + rh.sum() + 2 * rc.sum()).backward()
    pairs = [(out, rout), (h, rh), (c, rc)] + [(p.grad, q.grad) for p, q in zip(lstm.parameters(), ref.parameters())]
    assert max(rel(sm.shadow_of(a), b) for a, b in pairs) <= TOL
    assert max(rel(a, b) for a, b in pairs) > 1e3 * TOL  # the float32 device is not the reference
    assert not sm.report.coverage.unsupported and sm.report.coverage.internal_errors == 0
    if torch.backends.mkldnn.is_available():
        recs = sm.report.find(op="aten.mkldnn_rnn_layer") + sm.report.find(op="aten.mkldnn_rnn_layer_backward")
        assert len(recs) == 2 * 2 * (2 if bidirectional else 1)  # forward and backward, per layer and direction
        assert {r.kind for r in recs} == {"decomposed"}
        # the kernel's own error: float32-sized (the unit roundoff u = 2**-24 ~ 6e-8), not zero and not large
        assert all(0 < r.local.rel_norm < 1e3 * 2.0**-24 for r in recs)


# --- low-precision "devices" ---------------------------------------------------------------------------------
U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff (round to nearest)


def _gamma(n: int, u: float) -> float:
    """gamma_n = n u / (1 - n u): the worst-case relative error of an n-term sum (Higham, Accuracy and Stability)."""
    return n * u / (1 - n * u)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matmul_drift_scales_with_unit_roundoff(dtype):
    """F.linear in bf16/fp16 against fp32 on the same (exactly representable) inputs.

    Inputs are exact in every dtype, so each record's drift is the kernel's own error. Bounds:
      upper (deterministic): rel <= u_d + gamma_n(u_d) * cond, cond = || |x| |W|^T + |b| || / || x W^T + b ||
        (output rounding plus an n-term accumulation, even one done in the dtype itself);
      lower: >= u_d / 8; the result's rounding to the dtype alone has an RMS relative error ~u/sqrt(3)
        for random mantissas (measured 0.41-0.45 u here), and a correct kernel cannot undo it.
    The ratio to float32 then lies within (u_d / u_32) / (8 sqrt(n)) and 8 (u_d / u_32): the sqrt(n) is the
    probabilistic growth of float32's accumulation error (Higham & Mary 2019), measured 1.3-1.8 u_32 here.
    bf16: u ratio 2**16, so >= 2**16 / (8 sqrt(32)) ~ 1448, i.e. three orders of magnitude; fp16: >= 181."""
    g = torch.Generator().manual_seed(0)
    n = 32
    x = torch.randn(64, n, generator=g)
    w = torch.randn(48, n, generator=g) / math.sqrt(n)
    b = torch.randn(48, generator=g)
    rels = {}
    for dt in (torch.float32, dtype):
        xd, wd, bd = x.to(dt), w.to(dt), b.to(dt)
        with ShadowMode() as sm:
            torch.nn.functional.linear(xd, wd, bd)
        (rec,) = sm.report.find(op="aten.addmm.default")
        x64, w64, b64 = xd.double(), wd.double(), bd.double()
        cond = ((x64.abs() @ w64.abs().T + b64.abs()).norm() / (x64 @ w64.T + b64).norm()).item()
        u = U[dt]
        assert rec.drift.rel_norm == rec.local.rel_norm  # exact inputs: drift is the op's own error
        assert u / 8 <= rec.drift.rel_norm <= u + _gamma(n, u) * cond, (dt, rec.drift.rel_norm / u, cond)
        rels[dt] = rec.drift.rel_norm
    ratio, u_ratio = rels[dtype] / rels[torch.float32], U[dtype] / U[torch.float32]
    assert u_ratio / (8 * math.sqrt(n)) <= ratio <= 8 * u_ratio, (ratio, u_ratio)


@pytest.mark.parametrize("model_name", MODELS)
def test_low_precision_training_drift_scales_with_unit_roundoff(model_name):
    """A whole training step (forward, backward, SGD) in float32, bfloat16 and float16.

    Per matmul (addmm/mm/bmm) record, the median over the run of ``local / u_d`` and ``drift / u_d`` is O(1) in
    every dtype (measured: local 0.41-1.1, drift 0.9-2.5): errors are in units of each dtype's roundoff.
    Bounds [1/8, 8] for local (one rounding per output, a sqrt(n) accumulation at most, n <= 256 here,
    sqrt = 16 but float32's median stays near 1) and [1/8, 32] for drift (a few ops of amplification).
    So bf16's median matmul error is >= 2**16 / 64 = 1024 times float32's, fp16's >= 2**13 / 64 = 128."""
    for dt in (torch.bfloat16, torch.float16):
        reason = dtype_unsupported(model_name, dt)
        if reason:
            pytest.skip(reason)
    medians = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        model = build(model_name, dtype=dt)
        opt = make_optimizer("sgd", model.parameters(), "forloop")
        torch.manual_seed(0)
        with ShadowMode() as sm:
            losses = train_steps(model, opt, make_batches(model_name, 2, dtype=dt), loss_fn(model_name))
        assert sm.report.coverage.internal_errors == 0 and not sm.report.coverage.unsupported
        recs = [r for r in sm.report.records
                if r.op in ("aten.addmm.default", "aten.mm.default", "aten.bmm.default") and r.local.n]
        u = U[dt]
        local = statistics.median(r.local.rel_norm for r in recs) / u
        drift = statistics.median(r.drift.rel_norm for r in recs) / u
        assert 1 / 8 <= local <= 8 and 1 / 8 <= drift <= 32, (dt, local, drift)
        assert all(r.drift.nonfinite == 0 for r in sm.report.records if r.drift is not None)
        # the loss: device against shadow, a handful of u after two steps
        loss_rel = max(abs(lo.double().item() / sm.shadow_of(lo).item() - 1) for lo in losses)
        assert loss_rel <= 64 * u, (dt, loss_rel / u)
        medians[dt] = local * u
    for dt in (torch.bfloat16, torch.float16):
        assert medians[dt] / medians[torch.float32] >= (U[dt] / U[torch.float32]) / 64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
def test_float64_device_has_zero_drift(model_name, opt_name, impl):
    """A float64 program's shadow is the program itself: every op's local error and drift are exactly 0.
    (Casts would differ: an explicit cast rounds, the float64 shadow does not; these programs have none, and the test below has one.)"""
    skip_unsupported(opt_name, impl, torch.float32, torch.float64)
    model = build(model_name, dtype=torch.float64)
    opt = make_optimizer(opt_name, model.parameters(), impl)
    torch.manual_seed(0)
    with ShadowMode() as sm:
        losses = train_steps(model, opt, make_batches(model_name, 2, dtype=torch.float64), loss_fn(model_name),
                             clip=1.0)
    compared = [r for r in sm.report.records if r.drift is not None]
    assert len(compared) > 50
    nonzero = [(r.index, r.op, r.drift, r.local) for r in compared
               if not (r.drift.exact and r.local is not None and r.local.exact)]
    assert not nonzero
    assert sm.report.coverage.internal_errors == 0 and not sm.report.coverage.unsupported
    for t in list(model.parameters()) + losses:
        assert torch.equal(sm.shadow_of(t), t)


def test_float64_device_cast_is_the_one_place_it_differs():
    """``.float()`` in a float64 program rounds on the device, not in the shadow: the cast's local error is
    the float32 rounding (0 < max ulp <= 0.5), and the drift flows on into the ops after it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, dtype=torch.float64, generator=g)
    with ShadowMode() as sm:
        y = x.float().double() * 3
    cast = sm.report.find(op="aten._to_copy.default")[0]  # to float32; the second, back to float64, is exact
    assert 0 < cast.local.max_ulp <= 0.5
    after = sm.report.find(op="aten.mul.Tensor")
    assert after and after[0].drift.max_abs > 0 and after[0].local.exact  # drift from upstream, no error of its own
    assert torch.equal(sm.shadow_of(y), x * 3)


# --- nothing of shadow's stays hooked on the program ---------------------------------------------------------
_HOOK_CENSUS = """
import gc, sys
import torch
import torch.nn.modules.module as modules
import torch.optim.optimizer as optimizers
sys.path.insert(0, {tests!r})
from torch.utils.hooks import RemovableHandle
import shadow
from corpus import build

program = build("mha", steps=1)
model, opt = program.model, program.optimizer


def step():
    opt.zero_grad(set_to_none=True)
    loss = program.forward(model, program.batches[0])
    loss.backward()
    opt.step()
    return loss


def hooks():
    gc.collect()
    handles = sum(isinstance(o, RemovableHandle) for o in gc.get_objects())
    per_module = sum(len(d) for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks,
                                                               m._backward_hooks, m._backward_pre_hooks))
    held = sum(len(v) for mod in (modules, optimizers) for k, v in vars(mod).items() if k.startswith("_global") and
               isinstance(v, dict))  # global module hooks (ModuleTracker's), global optimizer step hooks
    return handles, per_module, held, len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def shadowed():
    with shadow.ShadowMode(max_records=10):
        step()


calls = {{"attribute": lambda: shadow.attribute(step),
          "ablation": lambda: shadow.attribute(step, method="ablation", by="module"),
          "audit": lambda: shadow.audit(step, precisions=("bf16",), by="module"),
          "mode": shadowed}}
before = hooks()
for name, call in calls.items():
    call()
    print(name, *[a - b for a, b in zip(hooks(), before)])
"""


def test_attribute_audit_and_shadowmode_leave_no_hook_behind():
    """shadow.attribute (linear and ablation), shadow.audit and ShadowMode hook modules, optimizers and autograd while
    they run (ModuleTracker's global module hooks, optimizer step hooks): after each has returned, on a corpus
    model (MultiheadAttention) in a fresh process, no RemovableHandle, module hook, global hook or optimizer hook
    more than before. (A long run under one ShadowMode: tests/test_corpus.py::test_long_run_keeps_no_hook_handles.)"""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _HOOK_CENSUS.format(tests=tests)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines == {name: "0 0 0 0" for name in ("attribute", "ablation", "audit", "mode")}, proc.stdout
