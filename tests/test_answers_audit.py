"""shadow.audit's answers on the corpus's real models, each held against its ground truth computed without shadow:
direct one-module runs. The model is deep-copied to float64; one module alone runs in bfloat16 (its parameters and
buffers cast while its forward runs, its inputs and outputs cast at its boundary by forward hooks, masks as a model
run in bfloat16 builds them); the change of the step's loss, |loss_mixed - loss_f64| / |loss_f64|, is what the
audit's row of that module estimates.

The step is one forward and backward in evaluation mode (batch norm in training mode, on its batch statistics):
dropout off, so that the float64 and the mixed runs draw no random masks.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.module_tracker import ModuleTracker

import corpus
import shadow

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ("gpt2_eager", "gpt_masked_fill")  # the default suite's models; the rest of the corpus is slow
SLOW = ("gpt2", "llama_gqa", "bert", "t5", "vit", "gpt_log_tril", "lstm_lm", "resnet")
# the modules held to 3x, by class (and ResNet's residual block, the hand-written GPT's MLP, by name)
KINDS = {
    "block": {"GPT2Block", "GPTBlock", "LlamaDecoderLayer", "BertLayer", "T5Block", "ViTLayer"},
    "attention": {"GPT2Attention", "CausalSelfAttention", "LlamaAttention", "BertAttention", "BertSelfAttention",
                  "T5LayerSelfAttention", "T5LayerCrossAttention", "T5Attention", "ViTAttention"},
    "mlp": {"GPT2MLP", "LlamaMLP", "BertIntermediate", "BertOutput", "T5LayerFF", "T5DenseActDense", "ViTMLP"},
}
BY_NAME = {"block": "block", "mlp": "mlp"}  # last component of the path -> kind


def program(name: str):
    """The corpus model ``name``, its first batch, and the step the audit runs (forward and backward: the loss)."""
    p = corpus.build(name)
    model, batch = p.model, p.batches[0]
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = p.forward(model, batch)
        loss.backward()
        return loss

    return model, batch, p.forward, step


# --- the ground truth: direct runs, without shadow ---------------------------------------------------------------
def _cast(value, dtype: torch.dtype):
    """Floating tensors in ``value`` cast to ``dtype``; the largest finite values of their dtype (the masks models
    build as finfo(dtype).min) become ``dtype``'s, as a model run in ``dtype`` builds them."""
    def cast(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            return t
        big = torch.finfo(t.dtype).max
        return torch.where(t.abs() == big, torch.finfo(dtype).max * t.sign(), t).to(dtype)

    return tree_map(cast, value)


def module_names(model: nn.Module, forward, batch) -> dict[str, nn.Module]:
    """The model's modules that run in a forward, by torch's ModuleTracker names (the class name, then the dotted
    path); not those a forward makes anew at each call (BERT's and T5's CrossEntropyLoss), which no hook reaches."""
    tracker, ran = ModuleTracker(), []
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, args: ran.append(m))
    try:
        with tracker, torch.no_grad():
            forward(model, batch)
    finally:
        handle.remove()
    own = set(model.modules())
    return {tracker._known_modules[m]: m for m in ran if m in own}


class KeepFloat64(TorchFunctionMode):
    """Outside the module in the narrow dtype, an explicit cast to float32 (``.float()``, ``.to(torch.float32)``,
    ``softmax(dtype=torch.float32)``: how models in bfloat16 compute their norms, rotary embeddings and losses) of a
    float64 or integer tensor keeps float64: the float64 model stays float64 throughout."""

    def __init__(self, direct: Direct):
        super().__init__()
        self.direct = direct

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if not self.direct.inside and source is not None and source.dtype not in NARROW:
            if func is torch.Tensor.float:
                func = torch.Tensor.double
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


NARROW = (torch.bfloat16, torch.float16, torch.float32)


class Direct:
    """The step's loss in float64, and with one module alone in ``dtype``."""

    def __init__(self, model: nn.Module, batch, forward, dtype: torch.dtype = torch.bfloat16):
        self.model = copy.deepcopy(model).double()
        self.batch = _cast(batch, torch.float64)
        self.forward = forward
        self.dtype = dtype
        self.inside = 0  # calls of the module in dtype running
        self.modules = module_names(self.model, forward, self.batch)
        self.truth = self._loss()

    def _loss(self) -> float:
        with KeepFloat64(self):  # with autograd, as the step: kernels pick their paths by it (attention's mask)
            return float(self.forward(self.model, self.batch).detach())

    def change(self, *keys: str) -> float:
        """|loss with modules ``keys`` (disjoint subtrees) in dtype - loss| / |loss|."""
        handles = []
        for key in keys:
            handles += self._narrow(self.modules[key])
        try:
            mixed = self._loss()
        finally:
            for h in handles:
                h.remove()
        return abs(mixed - self.truth) / abs(self.truth)

    def _narrow(self, module: nn.Module) -> list:
        """Hooks that run ``module`` in dtype: its parameters and floating buffers cast while it runs (a weight tied
        to a module outside stays as it is there), its inputs and outputs cast at its boundary."""
        inner = list(module.modules())
        saved: list = []

        def pre(m, args, kwargs):
            self.inside += 1
            for sub in inner:
                for store in (sub._parameters, sub._buffers):
                    for n, t in store.items():
                        if t is not None and t.is_floating_point():
                            saved.append((store, n, t))
                            store[n] = t.detach().to(self.dtype).requires_grad_(t.requires_grad)
            return _cast(args, self.dtype), _cast(kwargs, self.dtype)

        def post(m, args, kwargs, out):
            self.inside -= 1
            while saved:
                store, n, t = saved.pop()
                store[n] = t
            return _cast(out, torch.float64)

        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, with_kwargs=True)]


# --- figures ------------------------------------------------------------------------------------------------------
def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def kind(key: str, module: nn.Module) -> str | None:
    """"block", "attention", "mlp" or None."""
    found = [k for k, classes in KINDS.items() if type(module).__name__ in classes]
    return found[0] if found else BY_NAME.get(key.rsplit(".", 1)[-1])


@dataclasses.dataclass
class Answer:
    """One corpus model's bf16 audit by module tree, and the direct run of every module it has a row for."""

    program: tuple  # (model, batch, forward, step)
    truth: Direct
    audit: shadow.AuditReport
    estimates: dict[str, float]
    direct: dict[str, float]
    kinds: dict[str, str]  # key -> block, attention or mlp

    def factor(self, key: str) -> float:
        """max(estimate, direct) / min(estimate, direct): 1 where they agree."""
        a, b = self.estimates[key], self.direct[key]
        return max(a, b) / min(a, b) if min(a, b) > 0 else math.inf

    def spearman(self) -> float:
        keys = sorted(self.direct)
        return spearman([self.estimates[k] for k in keys], [self.direct[k] for k in keys])


_ANSWERS: dict[str, Answer] = {}


def answer(name: str) -> Answer:
    if name not in _ANSWERS:
        run = model, batch, forward, step = program(name)
        aud = shadow.audit(step, precisions=("bf16",), verify=0)
        truth = Direct(model, batch, forward)
        keys = [r.key for r in aud.rows if r.key in truth.modules]
        _ANSWERS[name] = Answer(run, truth, aud, {r.key: r.estimate for r in aud.rows},
                                {k: truth.change(k) for k in keys},
                                {k: kd for k in keys if (kd := kind(k, truth.modules[k])) is not None})
    return _ANSWERS[name]


def _check(name: str) -> None:
    if (why := corpus.unavailable(name)) is not None:
        pytest.skip(why)
    a = answer(name)
    # every module with calls has a row, those whose work is all in their children too (GPT-2's mlp)
    computing = {k for k, m in a.truth.modules.items() if not isinstance(m, (nn.ModuleList, nn.Dropout))}
    assert computing <= set(a.estimates), sorted(computing - set(a.estimates))
    assert a.kinds or name == "lstm_lm"
    for key, k in a.kinds.items():  # each block, attention and MLP within 3x of its direct run
        assert a.factor(key) <= 3, (key, k, a.estimates[key], a.direct[key])
    assert a.spearman() >= 0.8
    # no infinite estimate, no overflow (a float32 mask is no bfloat16 overflow)
    assert all(math.isfinite(r.estimate) and not r.overflow for r in a.audit.rows)


@pytest.mark.parametrize("name", FAST)
def test_estimates_match_direct_one_module_runs(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_estimates_match_direct_one_module_runs_on_the_rest_of_the_corpus(name):
    _check(name)


def test_a_plan_names_subtrees_and_runs_exactly_what_it_prints():
    """The hand-written GPT computes its loss in its own forward: the plan never prints the model for it."""
    a = answer("gpt_masked_fill")
    model, _, _, step = a.program
    plan = a.audit.plan(tolerance=1e-4)
    text = str(plan)
    lines = [ln.strip().rsplit(": ", 1) for ln in text.splitlines()[1:] if ln.strip().endswith(": bf16")]
    assert {k: p for k, p in lines} == plan.parts and len(lines) >= 3
    assert all(not b.startswith(c + ".") for b in plan.parts for c in plan.parts)  # disjoint subtrees
    assert "GPT" not in plan.parts and a.audit.target_at == "GPT" and "the loss (in GPT's own calls)" in text
    assert plan.estimate <= 1e-4 / 2
    expected = a.truth.change(*plan.parts)  # those subtrees in bfloat16, everything else in float64
    plan.apply(model)
    measured = plan.check(step)
    assert expected / 1.5 <= measured <= 1.5 * expected and measured <= 1e-4, (measured, expected)
