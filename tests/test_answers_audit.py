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
    """The modules that run in a forward, by torch's ModuleTracker names (the class name, then the dotted path)."""
    tracker = ModuleTracker()
    with tracker, torch.no_grad():
        forward(model, batch)
    return {name: m for m, name in tracker._known_modules.items()}


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

    def change(self, key: str) -> float:
        """|loss with module ``key`` alone in dtype - loss| / |loss|."""
        module = self.modules[key]
        inner = list(module.modules())
        saved: list = []

        def pre(m, args, kwargs):
            self.inside += 1
            for sub in inner:  # its parameters and floating buffers, while it runs (a tied weight stays outside)
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

        handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
                   module.register_forward_hook(post, with_kwargs=True)]
        try:
            mixed = self._loss()
        finally:
            for h in handles:
                h.remove()
        return abs(mixed - self.truth) / abs(self.truth)


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
