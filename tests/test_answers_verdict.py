"""The verdict's answers on real models, each checked against the truth without shadow.

- Attention masks of -inf (``masked_fill(mask, float('-inf'))``, ``log(tril(ones))``, transformers' sdpa and T5's
  relative buckets) are absorbed by softmax: a plain run's loss, gradients and parameters are finite, so the
  verdict names no NaN/Inf finding, and lists the masks as information.
- True NaN/Inf (log of a negative number, 0/0 in a user's normalization, float16's exp overflowing, an emulated
  float16 device overflowing where float64 is finite) reaches what the plain run says it reaches, and the verdict
  names the op that made it, whether float64 makes it too (the same program run in float64), and its way there,
  on a plain model and inside a masked transformer (where the masks are births too).
- A float32 program on the emulated bfloat16 device concludes in one line plus exceptions, and every result that
  device returns is a bfloat16 value.
- Gradients that overflow float16 and that a GradScaler catches (it skips the step) are information too.
- ``shadow run`` on a tutorial-style training script with a masked_fill(-inf) causal mask.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import corpus
from shadow import ShadowMode
from shadow.cli import main
from shadow.modes.emulate import BF16Mode, FP16Mode
from shadow.verdict import conclude

pytestmark = pytest.mark.usefixtures("one_thread")

MASKED = ("gpt_masked_fill", "gpt_log_tril")  # hand-written causal transformers whose masks are -inf
DTYPES = {"float32": (torch.float32, "train"), "bfloat16": (torch.bfloat16, "train"),
          "autocast": (torch.float32, "autocast_bf16")}


def truth(program: corpus.Program) -> set[str]:
    """What holds NaN/Inf after running ``program`` without shadow: "loss" (a step's loss), "gradients" (a
    parameter's .grad after the last backward), "parameters", else "state" (the optimizer's moments)."""
    losses = corpus.run(program)
    found = set()
    if any(not torch.isfinite(loss).all() for loss in losses):
        found.add("loss")
    params = list(program.model.parameters())
    if any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params):
        found.add("gradients")
    if any(not torch.isfinite(p).all() for p in params):
        found.add("parameters")
    elif any(torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()
             for state in program.optimizer.state.values() for v in state.values()):
        found.add("state")
    return found


def shadowed(program: corpus.Program, device=None):
    with (device if device is not None else _nothing()), ShadowMode() as sm:
        corpus.run(program)
    return conclude(sm.report)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


# --- masks absorbed by softmax: information, not a finding ---------------------------------------------------
def _no_finding(name: str, dtype: torch.dtype, habit: str) -> None:
    if (why := corpus.unavailable(name)) is not None:
        pytest.skip(why)
    assert truth(corpus.build(name, dtype=dtype, habit=habit)) == set()  # finite loss, gradients, parameters
    v = shadowed(corpus.build(name, dtype=dtype, habit=habit))
    assert v.nonfinite is None and not v.first_nonfinite_op
    assert "NaN" not in v.lines[0] and all(not line.startswith("  it reaches") for line in v.lines)
    return v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MASKED)
def test_masks_absorbed_by_softmax_are_information(name, dtype):
    v = _no_finding(name, *DTYPES[dtype])
    op = "aten.masked_fill" if name == "gpt_masked_fill" else "aten.log"
    (mask,) = v.absorbed
    # two layers, two steps; float64 holds the same -inf (log(0), the -inf written), and softmax reads it
    assert (mask.op, mask.cause, mask.modules, mask.calls) == (op, "math", ("GPT.h.0.attn", "GPT.h.1.attn"), 4)
    assert mask.absorbers == ("aten._softmax",)
    info = [line for line in v.lines if line.startswith("info: ")]
    assert info == [f"info: NaN/Inf made in {op} at GPT.h.0.attn, GPT.h.1.attn (4 calls; float64 makes it too), "
                    "absorbed by aten._softmax: it reaches no loss, gradient or parameter, so it is not a finding"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ("gpt2", "gpt2_eager", "bert", "t5", "mha", "encoder", "encoder_dense",
                                  "llama_gqa"))
def test_no_nonfinite_finding_on_the_corpus(name, dtype):
    _no_finding(name, *DTYPES[dtype])


# --- true NaN/Inf: found, named, with its way there --------------------------------------------------------------
class LogOfNegative(nn.Module):
    """A feature map through log: some of fc1's outputs are negative, and log of them is NaN in any precision."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.log(self.fc1(x))), y)


class Standardize(nn.Module):
    """A user's normalization: (x - mean) / std over the features; a padding row of zeros is 0 / 0."""

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class ZeroOverZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = Standardize(), nn.Linear(16, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(self.norm(x)), y)


class HalfSoftmax(nn.Module):
    """Softmax by hand in float16, as a memory-saving script writes it: exp of logits past 11.1 is past 65504."""

    def __init__(self, dtype=torch.float16):
        super().__init__()
        self.dtype = dtype
        self.fc = nn.Linear(16, 5)

    def forward(self, x, y):
        z = (self.fc(x) * 20).to(self.dtype)
        e = z.exp()
        p = e / e.sum(-1, keepdim=True)
        return -torch.log(p.float().gather(1, y[:, None])).mean()


class Energy(nn.Module):
    """A squared activation of a few hundred: 9e4 is past float16's 65504, far inside float32's range."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, y):
        return (self.fc(x) * 300).pow(2).mean()


def _program(model: nn.Module, *, zero_row: bool = False, dtype=torch.float32) -> corpus.Program:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        x = torch.randn(8, 16, generator=g, dtype=dtype)
        if zero_row:
            x[3] = 0  # padding
        batches.append((x, torch.randint(0, 5, (8,), generator=g)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return corpus.Program(model.to(dtype), batches, lambda m, b: m(*b), optimizer=opt)


def _fresh(make, **kw):
    torch.manual_seed(0)
    return _program(make(), **kw)


CASES = {
    # name: (model, program options, the op that makes it, float64 makes it too, the module it is born in)
    "log_of_negative": (LogOfNegative, {}, "aten.log", True, "LogOfNegative"),
    "zero_over_zero": (ZeroOverZero, {"zero_row": True}, "aten.div", True, "ZeroOverZero.norm"),
    "float16_exp_overflow": (HalfSoftmax, {}, "aten.exp", False, "HalfSoftmax"),
}


@pytest.mark.parametrize("case", CASES)
def test_true_nonfinite_is_named_with_its_op_and_way(case):
    make, options, op, math_problem, module = CASES[case]
    reached = truth(_fresh(make, **options))
    assert reached == {"loss", "gradients", "parameters"}  # the plain run: NaN in the loss, then everywhere
    # float64 without shadow: NaN there too for a math problem, finite for a precision one
    in_float64 = truth(_fresh(lambda: make(torch.float64) if make is HalfSoftmax else make(), dtype=torch.float64,
                              **options))
    assert (in_float64 == reached) if math_problem else (in_float64 == set())

    v = shadowed(_fresh(make, **options))
    found = v.nonfinite
    assert v.suspicious and found is not None and v.lines[0].startswith("verdict: NaN/Inf born in ")
    assert (found.op.rsplit(".", 1)[0], found.module, found.phase) == (op, module, "forward")
    assert found.cause == ("math" if math_problem else "precision")
    assert {r.what for r in found.reaches} == reached
    assert [r.record.index for r in found.reaches] == sorted(r.record.index for r in found.reaches)
    assert found.reaches[0].what == "loss" and found.reaches[0].record.index > found.index
    assert found.path[0] == module and found.callsite.startswith("tests/test_answers_verdict.py:")
    assert v.lines[1].startswith("  it reaches the loss (") and "the gradients (first: " in v.lines[1]


def test_emulated_float16_device_overflows_where_float64_is_finite():
    torch.manual_seed(0)
    program = _program(Energy())
    with FP16Mode():
        reached = truth(program)
    # the loss overflows, and Adam's second moment (gradients squared); the parameters stay finite
    assert reached == {"loss", "state"} and truth(_fresh(Energy)) == set()  # float32 (and float64) are finite
    with FP16Mode():
        v = shadowed(_fresh(Energy))
    found = v.nonfinite
    assert found is not None and found.cause == "precision" and found.module == "Energy"
    assert found.op.rsplit(".", 1)[0] in ("aten.pow", "aten.mul")  # (x * 300) ** 2: its square overflows
    assert "a precision problem: float64 is finite there" in v.lines[0]
    assert {r.what for r in found.reaches} == reached


def _scaled_steps(steps: int = 2) -> tuple[nn.Module, list[torch.Tensor], list[float]]:
    """float16 autocast with a GradScaler whose first scale (2**24) overflows the backward: it skips the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    x, y = torch.randn(32, 16) * 30, torch.randint(0, 4, (32,))
    before = [p.detach().clone() for p in model.parameters()]
    scales = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert math.isfinite(loss.item())
    return model, before, scales


def test_gradients_a_grad_scaler_catches_are_information():
    model, before, scales = _scaled_steps()  # the truth: inf gradients, every step skipped, parameters unchanged
    assert scales == [2.0**23, 2.0**22] and any(not torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with ShadowMode() as sm:
        _scaled_steps()
    v = conclude(sm.report)
    assert v.nonfinite is None and v.lines[0].endswith("nothing suspicious")
    (caught,) = v.absorbed
    assert caught.caught and caught.cause == "precision" and caught.absorbers == (
        "aten._amp_foreach_non_finite_check_and_unscale_",)
    assert "(GradScaler skips those optimizer steps): it reaches no loss or parameter" in v.text


def _hook_log(module: nn.Module) -> None:
    module.register_forward_hook(lambda mod, args, out: torch.log(out))  # some outputs are negative: NaN


@pytest.mark.parametrize("where", ("h.0.mlp", "wte"))
@pytest.mark.parametrize("name", MASKED)
def test_a_nan_among_masks_is_traced_to_its_own_op(name, where):
    """log of a negative number after layer 0's attention (its mask absorbed, layer 1's still to come) or in the
    embedding (before every mask): the NaN is traced to the log, not to a mask."""
    def program():
        p = corpus.build(name)
        _hook_log(p.model.get_submodule(where))
        return p

    assert truth(program()) == {"loss", "gradients", "parameters"}
    v = shadowed(program())
    found = v.nonfinite
    assert found is not None and found.cause == "math" and found.op == "aten.log.default"
    assert found.module == ("GPT.h.0" if where == "h.0.mlp" else "GPT")  # a hook's ops count in the parent
    assert {r.what for r in found.reaches} == {"loss", "gradients", "parameters"}
    assert found.path[0] == found.module and "GPT.lm_head" in found.path
    # the masks before it were absorbed: information still; those after it are NaN themselves
    assert [a.modules for a in v.absorbed] == ([("GPT.h.0.attn",)] if where == "h.0.mlp" else [])


class PrebuiltMask(nn.Module):
    """nn.Transformer's habit: a causal mask of -inf built once per forward (torch.full, then triu) before the
    embedding, added to every layer's scores; a log of a negative number in the embedding's scaling."""

    def __init__(self, width: int = 16, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(32, width)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.head = nn.Linear(width, 32)

    def forward(self, idx, targets):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.emb(idx)
        x = x * torch.log(x)  # NaN where x < 0
        for qkv in self.qkv:
            q, k, v = qkv(x).chunk(3, dim=-1)
            x = x + F.softmax(q @ k.transpose(-2, -1) + mask, dim=-1) @ v
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_a_nan_after_a_prebuilt_mask_is_traced_to_its_own_op():
    def program():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        model = PrebuiltMask()
        batches = [(torch.randint(0, 32, (2, 6), generator=g), torch.randint(0, 32, (2, 6), generator=g))
                   for _ in range(2)]
        return corpus.Program(model, batches, lambda m, b: m(*b),
                              optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True))

    assert truth(program()) == {"loss", "gradients", "parameters"}
    found = shadowed(program()).nonfinite
    # the mask (full(-inf)) is born first and is still live when the NaN reaches the loss: a value placed on
    # purpose ranks after one an op computed
    assert found is not None and found.op == "aten.log.default" and found.others == 1


# --- the emulated bfloat16 device: one cause, then the exceptions ---------------------------------------------
def test_bfloat16_device_concludes_in_one_line_and_exceptions():
    program = corpus.build("gpt_masked_fill")
    with BF16Mode():  # the truth of the claim, without shadow: every result that device returns is a bfloat16
        x, w = torch.randn(8, 32), torch.randn(32, 32)
        for y in (x @ w, F.gelu(x), F.layer_norm(x, (32,)), x.softmax(-1), x.sum(0)):
            assert torch.equal(y, y.to(torch.bfloat16).float())
    v = shadowed(program, BF16Mode())
    cause = v.arithmetic
    assert cause is not None and cause.like == "bfloat16-like" and cause.bits == 7 and cause.throughout
    assert all(5.5 <= c.effective_bits <= 8.5 and c.over_calls for c in cause.classes)
    assert len(cause.classes) >= 20 and v.nonfinite is None
    assert v.lines[0].startswith(f"verdict: bfloat16-like arithmetic throughout: {len(cause.classes)} op classes "
                                 "read ~7 bits, ")
    others = [c for c in v.over_budget if c not in cause.classes]
    if others:
        assert v.lines[1] == f"exceptions: {len(others)} op class{'es' if len(others) > 1 else ''} over budget " \
                             f"read{'s' if len(others) == 1 else ''} otherwise:"
        assert v.lines[2:2 + len(others)] == [f"  {c.describe(like=False)}" for c in others]
        assert all("-like" not in line for line in v.lines[2:2 + len(others)])
    assert len(v.lines) <= 3 + len(others)  # a line, the exceptions, the mask's info line: not one per op class


# --- a kernel property the verdict knows: the CPU's own bfloat16 convolutions ------------------------------------
@pytest.mark.parametrize("onednn", (False, True))
def test_cpu_bfloat16_convolution_without_onednn_is_named(onednn):
    """Without oneDNN's bfloat16 convolution (an AVX2 CPU; here oneDNN disabled), PyTorch's own kernels compute the
    backward: its grad_input is not the correctly rounded gradient of the same bfloat16 values (float64 without
    shadow), the call is over budget, and the verdict says which kernel property explains it. With oneDNN (where
    this CPU has it) the verdict names nothing known."""
    thnn = not onednn or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=g).bfloat16() for shape in ((4, 4, 8, 8), (8, 4, 3, 3), (4, 8, 8, 8)))

    def grad_input(*tensors):
        return torch.ops.aten.convolution_backward(*tensors, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [True, False, False])[0]

    with torch.backends.mkldnn.flags(enabled=onednn):
        device, exact = grad_input(dy, x, w).double(), grad_input(dy.double(), x.double(), w.double())
        with ShadowMode() as sm:
            grad_input(dy, x, w)
    v = conclude(sm.report)
    rounded_once = (device - exact).abs() <= 2.0 ** -8 * exact.abs()  # within half an ulp: one rounding
    if thnn:
        assert not rounded_once.all()
        assert "aten.convolution_backward" in {c.op for c in v.over_budget}
        (known,) = v.known
        assert known[0] == "aten.convolution_backward" and "PyTorch's own kernels" in known[1]
        assert any(line.startswith("known: aten.convolution_backward") for line in v.lines)
    else:
        assert not v.known


# --- shadow run on a tutorial's training script ------------------------------------------------------------------
TUTORIAL = textwrap.dedent('''\
    """A character-level GPT as tutorials write it: the causal mask by masked_fill(-inf)."""
    import math
    import sys

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    text = "to be or not to be that is the question " * 8
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    block, width, heads = 16, 32, 4


    class Head(nn.Module):
        def __init__(self, size):
            super().__init__()
            self.key = nn.Linear(width, size, bias=False)
            self.query = nn.Linear(width, size, bias=False)
            self.value = nn.Linear(width, size, bias=False)
            self.register_buffer("tril", torch.tril(torch.ones(block, block)))

        def forward(self, x):
            B, T, C = x.shape
            k, q = self.key(x), self.query(x)
            wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
            wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
            wei = F.softmax(wei, dim=-1)
            return wei @ self.value(x)


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(len(chars), width)
            self.pos = nn.Embedding(block, width)
            self.heads = nn.ModuleList(Head(width // heads) for _ in range(heads))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, len(chars))

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            x = x + torch.cat([h(x) for h in self.heads], dim=-1)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        ix = torch.randint(len(data) - block, (4,))
        x = torch.stack([data[i:i + block] for i in ix])
        y = torch.stack([data[i + 1:i + block + 1] for i in ix])
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    finite = math.isfinite(loss.item()) and all(torch.isfinite(p).all() and torch.isfinite(p.grad).all()
                                                 for p in model.parameters())
    print("finite", finite)
''')


def test_shadow_run_on_a_tutorial_script_with_a_masked_fill_mask(tmp_path, capsys):
    script = tmp_path / "tutorial.py"
    script.write_text(TUTORIAL)
    exec(compile(TUTORIAL, str(script), "exec"), {"__name__": "__main__"})  # the truth, without shadow
    assert capsys.readouterr().out == "finite True\n"
    assert main(["run", "-o", str(tmp_path / "r.json"), str(script)]) == 0
    out, err = capsys.readouterr()
    assert out == "finite True\n"
    lines = [line.removeprefix("shadow: ") for line in err.splitlines() if line.startswith("shadow: ")]
    verdict = [line for line in lines if not line.startswith("report written")]
    assert verdict[0].startswith("verdict: all ") and verdict[0].endswith("budgets: nothing suspicious")
    assert any(line.startswith("info: NaN/Inf made in aten.masked_fill at Model.heads.0, ") and
               "absorbed by aten._softmax" in line for line in verdict)
