"""shadow.attribute's answers on the real-model corpus (tests/corpus.py), each held against runs made without shadow.

Every model in float32, in bfloat16 and under CPU autocast to bfloat16, one forward and backward step whose target
is the loss:

- the attribution is finite (masks of -inf in the float64 world too carry no error) and leaves no call out;
- its drift is the one a float64 run of the same step gives (the model and batch upcast from the device's values,
  every dtype an op names made float64, so that the run has no cast: what the shadow computes);
- linear and ablation agree on at least 2 of their top 3 keys, ranked by the total share of a key (its share
  beyond a correct rounding plus its rounding share: on a correct step the rounding shares are nearly all of it);
- a fault of known size (``FaultMode``) is found: its key ranks first, and its share of the drift is the change
  the fault makes to the loss of a float64 run.

Run as a script (``python tests/test_answers_attribution.py [model ...]``) it prints the figures of
docs/attribution.md's table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import shadow
from shadow.modes import FaultMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script: corpus and models beside it
import corpus  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 0  # torch's generator at the step's start: the dropout masks of every run, with or without shadow
MODELS = ("gpt2", "gpt2_eager", "llama_gqa", "bert", "t5", "vit", "gpt_masked_fill", "gpt_log_tril", "lstm_lm",
          "resnet")
CASES = {"float32": (torch.float32, "train"), "bfloat16": (torch.bfloat16, "train"),
         "autocast": (torch.float32, "autocast_bf16")}
# the module of each model whose fault moves the loss most (a float64 run with a 1 % fault in each leaf module);
# before a training-mode BatchNorm a fault is normalized away, hence ResNet's BatchNorm. The LSTM's own fault is
# found too, but the float64 run computes nn.LSTM by its decomposition (each gate at each step, every op
# perturbed) where the device runs one mkldnn_rnn_layer per layer: not the same fault, hence its head
FAULT_MODULES = {
    "gpt2": "GPT2LMHeadModel.transformer.h.1.mlp.act",
    "gpt2_eager": "GPT2LMHeadModel.transformer.h.1.mlp.act",
    "llama_gqa": "LlamaForCausalLM.model.layers.0.self_attn.o_proj",
    "bert": "BertForSequenceClassification.bert.pooler.dense",
    "t5": "T5ForConditionalGeneration.decoder.block.0.layer.2.DenseReluDense.wi",
    "vit": "ViTForImageClassification.vit.layers.0.mlp.fc1",
    "gpt_masked_fill": "GPT.h.0.attn.proj",
    "gpt_log_tril": "GPT.h.0.attn.proj",
    "lstm_lm": "LSTMLanguageModel.head",
    "resnet": "ResNet.block.4",
}
# the default suite's cases: GPT-2 with its default (sdpa) attention, whose mask made NaN shares, and a
# hand-written transformer under autocast; the rest are slow
DEFAULT = {("gpt2", "float32"), ("gpt_masked_fill", "autocast")}


@dataclasses.dataclass(frozen=True)
class Fault:
    """A relative error ``rel`` put into the device's calls of ``op`` or inside ``module``: attribution by ``by``
    must name ``key``."""

    by: str
    key: str
    rel: float
    op: str | None = None
    module: str | None = None

    def mode(self) -> FaultMode:
        return FaultMode(rel=self.rel, op=self.op, module=self.module)


def fault_of(name: str, case: str) -> Fault:
    if case == "bfloat16":
        # bfloat16's rounding of the loss (~1e-3 of it) outweighs what a fault in a tiny random model's hidden
        # layers passes on to the loss (2e-5 to 4e-3 of it for a 1 % fault): the fault goes where the loss is made
        return Fault("op", "aten._log_softmax.default", 0.05, op="_log_softmax")
    module = FAULT_MODULES[name]
    return Fault("module", module, 1e-3 if case == "float32" else 0.1, module=module)


class Float64(TorchDispatchMode):
    """Every floating dtype an op names made float64 (``.float()``, ``to(bfloat16)``, factories): a step without
    casts, as the shadow computes it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_float64_dtype, (args, kwargs or {}))
        return func(*args, **kwargs)


def _float64_dtype(x: Any) -> Any:
    return torch.float64 if isinstance(x, torch.dtype) and x.is_floating_point else x


def _float64_tensor(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _program(name: str, case: str) -> corpus.Program:
    if (why := corpus.unavailable(name)) is not None:
        pytest.skip(why)
    dtype, habit = CASES[case]
    return corpus.build(name, dtype=dtype, habit=habit, steps=1)


def _step(program: corpus.Program):
    """One forward and backward of the program's first batch, returning the loss (no optimizer step: the loss is
    computed before it)."""
    def step() -> torch.Tensor:
        program.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=program.autocast is not None):
            loss = program.forward(program.model, program.batches[0])
        loss.backward()
        return loss
    return step


def loss_without_shadow(name: str, case: str, *, float64: bool = False, fault: Fault | None = None) -> float:
    """The step's loss on the device, or (``float64``) in float64 from the device's parameters and batch."""
    program = _program(name, case)
    model, batch = program.model, program.batches[0]
    if float64:
        model.double()
        batch = tree_map(_float64_tensor, batch)
    torch.manual_seed(SEED)
    with fault.mode() if fault is not None else contextlib.nullcontext(), \
            Float64() if float64 else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=program.autocast is not None and not float64):
        return float(program.forward(model, batch).detach())


def attribute(name: str, case: str, method: str, by: str, fault: Fault | None = None) -> shadow.AttributionResult:
    """``shadow.attribute`` of a fresh program's step (every run starts from the same parameters and generator)."""
    program = _program(name, case)
    torch.manual_seed(SEED)
    with fault.mode() if fault is not None else contextlib.nullcontext():
        return shadow.attribute(_step(program), by=by, method=method)


def top(res: shadow.AttributionResult, n: int = 3) -> list[str]:
    """The keys of the ``n`` largest total shares (share + rounding_share, by magnitude): the rows' order."""
    return [r.key for r in res.rows[:n]]


def both_methods(name: str, case: str, by: str, fault: Fault | None = None) -> list[shadow.AttributionResult]:
    return [attribute(name, case, method, by, fault) for method in ("linear", "ablation")]


@dataclasses.dataclass
class Found:
    """A fault's attributions (linear, ablation), the device's drift with the fault in it (D, signed) and the
    fault's effect on the loss of a float64 run: what D * share of the fault's key should be."""

    fault: Fault
    results: list[shadow.AttributionResult]
    drift: float
    effect: float


def find_fault(name: str, case: str) -> Found:
    fault = fault_of(name, case)
    loss_64 = loss_without_shadow(name, case, float64=True)
    return Found(fault, both_methods(name, case, fault.by, fault),
                 loss_without_shadow(name, case, fault=fault) - loss_64,
                 loss_without_shadow(name, case, float64=True, fault=fault) - loss_64)


def _cases() -> list:
    return [pytest.param(name, case, id=f"{name}-{case}", marks=() if (name, case) in DEFAULT else pytest.mark.slow)
            for name in MODELS for case in CASES]


@pytest.mark.parametrize("name, case", _cases())
def test_attribution_is_finite_and_its_methods_agree(name, case):
    loss, loss_64 = loss_without_shadow(name, case), loss_without_shadow(name, case, float64=True)
    linear, ablation = both_methods(name, case, "op")
    for res in (linear, ablation):
        assert res.left_out == {}
        figures = [x for r in res.rows for x in (r.share, r.rounding_share)] + [res.rounding, res.residual]
        assert all(math.isfinite(x) for x in figures)
        assert sum(r.total for r in res.rows) + res.residual == pytest.approx(1.0)
        # the shadow's loss is the float64 run's: the drift is |loss - loss_64| / |loss_64|, up to float64 noise
        assert res.drift == pytest.approx(abs(loss - loss_64) / abs(loss_64), rel=1e-3)
    assert len(set(top(linear)) & set(top(ablation))) >= 2, (top(linear), top(ablation))
    assert abs(ablation.residual) < 0.1


@pytest.mark.parametrize("name, case", _cases())
def test_a_fault_of_known_size_is_found(name, case):
    found = find_fault(name, case)
    for res in found.results:
        assert res.rows[0].key == found.fault.key, res.table(top=5)
        # its share of the drift is the fault's effect: to first order (linear), or as propagated (ablation)
        assert res.rows[0].share * found.drift == pytest.approx(found.effect, rel=0.1), (res.method, res.rows[0])


def figures(name: str, case: str) -> dict[str, Any]:
    """The figures of docs/attribution.md's table for one model and case."""
    linear, ablation = both_methods(name, case, "op")
    loss, loss_64 = loss_without_shadow(name, case), loss_without_shadow(name, case, float64=True)
    found = find_fault(name, case)
    return dict(
        drift=linear.drift, drift_vs_float64_run=linear.drift * abs(loss_64) / abs(loss - loss_64),
        agree=len(set(top(linear)) & set(top(ablation))), top=top(ablation),
        residual=(linear.residual, ablation.residual), fault=(found.fault.key, found.fault.rel),
        found=tuple(res.rows[0].key == found.fault.key for res in found.results),
        share_vs_effect=tuple(res.rows[0].share * found.drift / found.effect for res in found.results),
        finite=all(not res.left_out for res in (linear, ablation, *found.results)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    for model in sys.argv[1:] or MODELS:
        for case in CASES:
            print(model, case, figures(model, case), flush=True)
