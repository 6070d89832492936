"""ShadowMode on the DirectML-like device (tests/privateuse1): what the CPU-placement tests could not show.

Every answer is held against an experiment made without shadow: the same program run plainly on the device (zero
interference: bit for bit), in float64 on the CPU (the shadow's values: to 1e-12), or the backend's own record of
what it ran through its fallback and of the copies asked of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shadow
from shadow import ShadowMode
from shadow.cli import main
from shadow.engine import conclude, pieces

from corpus import build
from corpus import run as run_program
from models import train_steps
from privateuse1 import counters, device, fallback_ops, reset_counters

pytestmark = [pytest.mark.privateuse1, pytest.mark.usefixtures("one_thread")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-12  # float64 against float64: the order of a few hundred roundings apart (tests/test_training.py)


@pytest.fixture(scope="module")
def dml():
    return device()


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():  # DirectML's fallback warnings
        warnings.simplefilter("ignore")
        yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to("cpu").double(), b.detach().to("cpu").double()
    return float((a - b).norm() / b.norm()) if b.norm() else float((a - b).norm())


def to(value, d):
    """Tensors of a batch (tuples and dicts of them) moved to ``d``."""
    if isinstance(value, torch.Tensor):
        return value.to(d)
    if isinstance(value, dict):
        return {k: to(v, d) for k, v in value.items()}
    return tuple(to(v, d) for v in value)


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Dropout(dropout), nn.Linear(32, 4))


def adam_steps(model: nn.Module, d, steps: int = 2, **adam) -> list[torch.Tensor]:
    """``steps`` Adam steps of ``model`` on ``d`` (cross entropy on fixed data); the losses."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **adam)
    x, y = x.to(d, next(model.parameters()).dtype), y.to(d)
    model.opt = opt  # for the state comparison
    return train_steps(model, opt, [(x, y)] * steps, F.cross_entropy)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.detach().cpu() for n, p in model.named_parameters()}
    out |= {f"grad {n}": p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in model.opt.state.items():
        out |= {f"opt {names[id(p)]}.{k}": v.cpu() for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert not [k for k in a if not torch.equal(a[k], b[k])]


def test_zero_interference(dml):
    """Dropout (the device's generator), GELU, LayerNorm, the blocked matmuls, foreach Adam: with and without
    ShadowMode the device computes the same bits, and both generators end where they would have."""
    results = []
    for shadowed in (False, True):
        torch.manual_seed(3)
        model = mlp(dropout=0.3).to(dml)
        torch.privateuseone.manual_seed(4)
        with ShadowMode() if shadowed else torch.no_grad():
            if shadowed:
                losses = adam_steps(model, dml)
            else:
                with torch.enable_grad():
                    losses = adam_steps(model, dml)
        results.append((state(model), [lo.cpu() for lo in losses], torch.privateuseone.get_rng_state(),
                        torch.get_rng_state()))
    (s0, l0, d0, c0), (s1, l1, d1, c1) = results
    assert_same(s0, s1)
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert torch.equal(d0, d1) and torch.equal(c0, c1)


def test_two_adam_steps_against_float64(dml):
    """The done criterion: two Adam steps on the device are bit-identical with and without ShadowMode, shadow has
    no internal error, tags exactly the calls the backend ran through its CPU fallback, and its loss and
    parameters equal a CPU float64 run to 1e-12."""
    reference = mlp().double()
    ref_losses = adam_steps(reference, "cpu")
    plain = mlp().to(dml)
    reset_counters()
    plain_losses = adam_steps(plain, dml)
    fell_back = fallback_ops()
    model = mlp().to(dml)
    with ShadowMode() as sm:
        losses = adam_steps(model, dml)
        shadow_losses = [sm.shadow_of(lo) for lo in losses]
        shadow_params = [sm.shadow_of(p) for p in model.parameters()]
    assert_same(state(plain), state(model))
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(plain_losses, losses))
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported, cov
    for s, r in zip(shadow_losses, ref_losses):
        assert rel(s, r) < TOL
    for s, p in zip(shadow_params, reference.parameters()):
        assert rel(s, p) < TOL
    # the tagged calls: those whose op (or, for a foreach op, its per-tensor op) the backend ran through its fallback
    tagged = {r.op for r in sm.report.records if r.cpu_fallback}
    assert tagged and fell_back

    def base(name: str) -> str:
        return name.split("::")[-1].removeprefix("aten.").removeprefix("_foreach_").split(".")[0].rstrip("_")

    assert {base(op) for op in tagged} == {base(op) for op in fell_back}, (tagged, fell_back)


def test_views_in_place_and_out(dml):
    """Writes through strided views, an in-place chain on a transposed view, out= into a view and into a tensor it
    resizes, an index_put_, a masked_fill_: each shadow equals the same program in float64 on the CPU."""
    def program(d, dtype):
        g = torch.Generator().manual_seed(2)
        a, b = torch.randn(6, 8, generator=g).to(d, dtype), torch.randn(8, 6, generator=g).to(d, dtype)
        v = a[1:5, ::2]
        v.mul_(1.5).add_(0.25)
        t = a.t()
        t[2].copy_(b[0])
        out = torch.empty(0, device=d, dtype=dtype)
        torch.mm(a, b, out=out)  # resized: its storage moves
        torch.add(a[:, :3], 1.0, out=a[:, 5:])
        idx = torch.tensor([0, 3, 3], device=d)
        out.index_put_((idx,), torch.ones(6, device=d, dtype=dtype), accumulate=True)
        out.masked_fill_(out > 5, 2.0)
        flat = out.view(-1)[::5]
        return [a, out, flat, a.sum(1)]

    ref = program("cpu", torch.float64)
    with ShadowMode() as sm:
        dev = program(dml, torch.float32)
        shadows = [sm.shadow_of(t) for t in dev]
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and cov.unobserved_writes == 0 and not cov.unsupported, cov
    for s, r in zip(shadows, ref):
        assert rel(s, r) < TOL


def test_random_ops_are_adopted_not_replayed(dml):
    """dropout's mask, rand_like, bernoulli_ and normal_ are the device generator's: shadow adopts them and computes
    the rest in float64; the device's values are those of a plain run from the same seed."""
    def program(d):
        torch.privateuseone.manual_seed(9)
        x = torch.linspace(-1, 1, 64).to(d)
        y = F.dropout(x * 3, 0.5)
        z = torch.rand_like(x) * x
        w = torch.empty(64, device=d).bernoulli_(0.3) + torch.empty(64, device=d).normal_(2.0, 0.5)
        return [x, y, z, w]

    plain = [t.cpu() for t in program(dml)]
    with ShadowMode() as sm:
        dev = program(dml)
        shadows = [sm.shadow_of(t) for t in dev]
    assert sm.report.coverage.internal_errors == 0
    assert all(torch.equal(a, b.cpu()) for a, b in zip(plain, dev))
    x, y, z, w = plain
    x64 = torch.linspace(-1, 1, 64, dtype=torch.float64)  # linspace's shadow is made in float64
    assert torch.equal(shadows[0], x64)
    mask = (y != 0).double()  # the device's mask, read off its result: the shadow is x * 3 / (1 - p) there
    assert rel(shadows[1], x64 * 3 * mask * 2) < TOL
    assert rel(shadows[3], w.double()) < 1e-7  # adopted draws (float32), summed in float64


@pytest.mark.parametrize("impl", ["foreach", "fused", "fused-pieces", "for-loop"])
def test_optimizer_kernels_against_float64(dml, impl, monkeypatch):
    """Adam's foreach kernels (the device default: composites over DirectML's ops, lerp through the fallback), its
    fused kernel (through the CPU fallback: _fused_adam_; judged in pieces, its lists copied to the CPU before the
    op, in "fused-pieces") and the for-loop: shadows equal a CPU float64 run."""
    flags = {"foreach": {"foreach": True}, "fused": {"fused": True}, "fused-pieces": {"fused": True},
             "for-loop": {"foreach": False}}[impl]
    judged = []
    if impl == "fused-pieces":
        monkeypatch.setattr(pieces, "PIECE_BYTES", 0)
        monkeypatch.setattr(pieces, "CHUNK", 1 << 15)
        monkeypatch.setattr(conclude, "judge_pieces", lambda *a: judged.append(1) or pieces.judge_pieces(*a))
    reference = mlp().double()
    adam_steps(reference, "cpu", foreach=False)
    model = mlp().to(dml)
    with ShadowMode(**({"max_repro_bytes": 0} if impl == "fused-pieces" else {})) as sm:  # kept calls: whole
        adam_steps(model, dml, **flags)
        shadows = [sm.shadow_of(p) for p in model.parameters()]
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported, cov
    for s, p in zip(shadows, reference.parameters()):
        assert rel(s, p) < TOL
    if impl.startswith("fused"):
        (fused,) = {r.op for r in sm.report.records if "fused_adam" in r.op}
        calls = [r for r in sm.report.records if r.op == fused]
        assert all(r.cpu_fallback for r in calls)
        assert all(r.budget is not None and r.budget.used <= 1 for r in calls if r.local is not None)
        assert (len(judged) > 0) == (impl == "fused-pieces")


@pytest.mark.parametrize("name", [pytest.param("gpt_masked_fill", marks=pytest.mark.slow), "lstm_lm", "lstm",
                                  "mha", "resnet"])
def test_corpus_trains_on_the_device(dml, name):
    """A hand-written causal transformer (its mask by masked_fill(-inf)), the LSTM language model and a bidirectional
    LSTM (the fused cells), nn.MultiheadAttention with a padding mask, a ResNet with BatchNorm
    (convolution_overrideable): two AdamW steps on the device, bit for bit as without shadow, everything seen, and
    the shadow losses those of the program in float64 on the CPU (dropout off: the models in eval mode, their
    gradients and steps all the same). Left out: the corpus's log(tril) transformer builds its mask on the CPU
    whatever the device (not device-generic), and Hugging Face's models compute their loss in float32 (no float64
    program to compare with)."""
    def program(d, dtype):
        p = build(name, dtype=dtype)
        p.model.to(d).eval()
        if name == "gpt_masked_fill":  # .to(privateuseone) unties the tied embedding and head: tied again
            p.model.lm_head.weight = p.model.wte.weight
        # moved to a PrivateUse1 device, parameters are new objects (torch keeps them only for CPU, CUDA and a few
        # other backends): the optimizer (no state yet) is pointed at them, as a DirectML user must
        (group,) = p.optimizer.param_groups
        group["params"] = list(p.model.parameters())
        p.batches = [to(b, d) for b in p.batches]
        return p

    ref = run_program(program("cpu", torch.float64))
    plain = run_program(program(dml, torch.float32))
    p = program(dml, torch.float32)
    with ShadowMode() as sm:
        outs = run_program(p)
        shadows = [sm.shadow_of(o) for o in outs]
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(plain, outs))
    cov = sm.report.coverage
    assert cov.internal_errors == 0 and not cov.unsupported and cov.unobserved_writes == 0, cov
    for s, r in zip(shadows, ref):
        assert rel(s, r) < TOL


def test_shadows_stay_on_the_cpu_and_values_cross_once_per_version(dml):
    """shadow_device="auto" keeps a DirectML tensor's shadows on the CPU; its values cross in batches, each storage
    version once (``HostCopies``), fewer crossings than reads."""
    model = mlp().to(dml)
    with ShadowMode(shadow_device="auto") as sm:
        adam_steps(model, dml)
        s = sm.shadow_of(next(model.parameters()))
    engine = sm._engine
    assert engine.mirror.place.resolved[dml] == torch.device("cpu") and s.device.type == "cpu"
    copies = engine.copies
    assert 0 < copies.batches < copies.transfers
    calls = sm.report.coverage.calls
    assert copies.transfers < 2 * calls  # each result read once for both comparisons and again as an input


def test_shadows_own_copies_are_counted(dml):
    """shadow's own host traffic on a two-step MLP (forward, backward, foreach Adam), beyond the program's own, as
    the backend counts it: 163 copies from the device, none to it, no ``.item()``. Each is a device value crossing
    once per storage version:

    - 157 tensors read over in 72 batches (``HostCopies``): 140 results, each once, for its spot check, both its
      comparisons and the trajectory (the loss, the stepped parameters), the copy kept for the next op whose local
      replay reads it; 17 inputs of a local replay with no copy at hand (copies are kept per view geometry: the
      transposed weight ``mm`` reads crosses apart from the parameter);
    - 6 first sights of a storage: the parameters, each adopted whole at its first read (``Mirror.entry``).

    Spot checks read their sampled elements from those copies, as the comparisons and the trajectory do."""
    model = mlp().to(dml)
    reset_counters()
    adam_steps(model, dml)
    plain = counters()
    model = mlp().to(dml)
    reset_counters()
    with ShadowMode() as sm:
        adam_steps(model, dml)
    own = {k: counters()[k] - plain[k] for k in ("device_to_host", "host_to_device", "item")}
    copies = sm._engine.copies
    assert sm.report.coverage.internal_errors == 0 and len(sm.report.trajectory) == 2
    assert (copies.transfers, copies.batches) == (157, 72)
    assert own == {"device_to_host": 157 + 6, "host_to_device": 0, "item": 0}  # 6: the parameters' first sights


def test_the_devices_own_kernels_are_judged(dml):
    """The stand-in's GPU arithmetic, found by shadow: its blocked float32 matmul differs from the CPU's and stays
    within the float32 budget; its float16 matmul, accumulating in float16, is over budget and reads about the bits
    a float16 accumulator keeps over K = 256 terms; exp as exp2(x log2 e) is over budget for |x| up to 80."""
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(16, 256, generator=g), torch.randn(256, 8, generator=g)
    x = torch.linspace(-80, 80, 257)
    with ShadowMode() as sm:
        a.to(dml) @ b.to(dml)
        a.half().to(dml) @ b.half().to(dml)
        torch.exp(x.to(dml))
    rep = sm.report
    assert rep.coverage.internal_errors == 0, rep.coverage
    mm32, mm16 = rep.find(op="mm")
    assert mm32.local.max_abs > 0 and mm32.budget.used <= 1.0
    assert mm16.over_budget and mm16.dtype == "torch.float16"
    float16_sum = (a.half().float() @ b.half().float()).half()  # the CPU's: float32 accumulation, one rounding
    assert mm16.local.max_abs > 4 * (float16_sum.double() - a.half().double() @ b.half().double()).abs().max()
    (exp,) = rep.find(op="exp")
    assert exp.over_budget and 4 < exp.local.max_ulp < 64


def test_attribute_on_the_device(dml):
    """shadow.attribute of an MLP's loss by module on the device: the drift it explains is the device loss against
    the same loss in float64 on the CPU, its shares and the rounding share account for it to first order (residual
    under 10 %), over the modules the CPU's attribution lists."""
    losses, results = {}, {}
    for d, dtype in (("cpu", torch.float32), (dml, torch.float32), ("cpu", torch.float64)):
        model = mlp().to(d, dtype)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(6, 8, generator=g).to(d, dtype), torch.randint(0, 4, (6,), generator=g).to(d)
        losses[str(d), dtype] = F.cross_entropy(model(x), y).item()
        if dtype == torch.float32:
            results[str(d)] = shadow.attribute(lambda: F.cross_entropy(model(x), y), by="module")
    res = results[str(dml)]
    exact = losses["cpu", torch.float64]
    assert res.drift == pytest.approx(abs(losses[str(dml), torch.float32] - exact) / abs(exact), rel=1e-3)
    assert abs(res.residual) < 0.1 and res.report.coverage.internal_errors == 0
    assert {r.key for r in res.rows} == {r.key for r in results["cpu"].rows}


_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from privateuse1 import device
d = device()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(d)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(4, 8).to(d), torch.randn(4, 2).to(d)
for _ in range(2):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


def test_shadow_run_of_a_script_that_moves_its_model_to_the_device(dml, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    out = tmp_path / "report.json"
    assert main(["run", "-o", str(out), str(script)]) == 0
    rep = shadow.load_report(str(out))
    assert rep.coverage.internal_errors == 0 and rep.meta["run"]["optimizer_steps"] == 2
    assert rep.find(op="mse_loss") and rep.find(op="addmm")


_RENAMED = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from privateuse1 import device
from shadow import ShadowMode, ShadowOptionError
d = device("npu")
found = {}
for value in ("npu", "npu:0", torch.device("npu", 0)):
    try:
        ShadowMode(shadow_device=value)
        found[str(value)] = "accepted"
    except ShadowOptionError as e:
        found[str(value)] = str(e)
x = torch.linspace(-1, 1, 8).to(d)
try:
    with ShadowMode() as sm:  # "auto": the shadows of npu tensors on the CPU
        y = torch.erfinv(x * 0.5) * 2
        s = sm.shadow_of(y)
    found["errors"] = sm.report.coverage.internal_errors
    found["tagged"] = [r.op for r in sm.report.records if r.cpu_fallback]
    found["exact"] = float((s - torch.erfinv(torch.linspace(-1, 1, 8).double() * 0.5) * 2).abs().max())
except Exception as e:
    found["failed"] = repr(e)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def renamed(dml):
    """What a process with the stand-in renamed to "npu" (as Ascend's backend is) finds."""
    proc = subprocess.run([sys.executable, "-c", _RENAMED], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_renamed_backend_is_refused_as_a_shadow_device(renamed):
    """shadow_device="npu:0" names a PrivateUse1 backend: refused up front, saying why and what to use."""
    for value in ("npu", "npu:0"):
        assert "PrivateUse1 backend 'npu'" in renamed[value] and "use 'auto'" in renamed[value], renamed[value]


def test_a_renamed_backend_is_shadowed_and_tagged(renamed):
    assert "failed" not in renamed and renamed["errors"] == 0 and renamed["exact"] < 1e-15
    assert "aten.erfinv.default" in renamed["tagged"]
