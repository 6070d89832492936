"""Which elements of an op's outputs the op defines: the rest is memory its kernel never writes.

A few kernels return tensors they fill only in part (``_ctc_loss``'s ``log_alpha``): the elements left out
hold whatever the allocator handed back, on the device and in the float64 replay alike, so comparing them
measures two pieces of garbage. A rule of ``DEFINED`` gives, per output slot (the op's flattened returns,
as ``shadow.plan.flat_returns`` lists them), a bool tensor on the CPU shaped like that output, True where
the op defines the element, or None where it defines all of it; ``NotImplemented`` falls through. Ops with
no rule define every element of their outputs (``defined_regions`` returns None).

>>> from shadow.plan import plan_of
>>> lp, target = torch.randn(3, 1, 4, dtype=torch.float64).log_softmax(2), torch.tensor([[1]])
>>> args = [lp, target, [2], [1]]   # input length 2 of 3 steps, target length 1
>>> out = list(torch.ops.aten._ctc_loss(*args))
>>> defined_regions(plan_of(torch.ops.aten._ctc_loss.default), args, {}, out)[1][0].int().tolist()
[[1, 1, 1], [1, 1, 1], [0, 0, 0]]

(t = 0 is filled whole; t = 1 holds its 2 * 1 + 1 states; t = 2 lies past the input.)

Outputs that an ``output_mask`` argument switches off (the norm and convolution backward ops) are
undefined tensors (None), not memory left unwritten: they need no rule (measured on CPU, torch 2.13;
``tests/test_moduledb.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..opsets import Family
from ..plan import OpPlan, flat_returns
from ..rules import RuleTable

aten = torch.ops.aten

# (plan, device args, device kwargs, flattened device outputs) -> [bool mask | None per output] | NotImplemented
DefinedRule = Callable[[OpPlan, Any, Any, list], Any]

DEFINED: RuleTable[DefinedRule] = RuleTable("defined region")
register_defined = DEFINED.register


def defined_regions(plan: OpPlan, args: Any, kwargs: Any, out: Any) -> list | None:
    """Per output slot, a CPU bool mask of the elements the op defines (None: all of them); None when the
    op defines every element of every output (no rule, or every rule fell through). ``out``: what the op
    returned (a tuple for several returns)."""
    if not DEFINED.chain(plan.func):  # most ops: no rule, nothing to build (asked on every op call)
        return None
    masks = DEFINED.run(plan.func, plan, args, kwargs, [t for _, t in flat_returns(plan, out)])
    if masks is NotImplemented or all(m is None for m in masks):
        return None
    return masks


def _lengths(v: Any) -> torch.Tensor:
    """Sequence lengths given as a list of ints or as a tensor (on any device), as a CPU int64 tensor."""
    return torch.as_tensor(v).to(device="cpu", dtype=torch.int64).reshape(-1)


@register_defined(aten._ctc_loss.default, aten._ctc_loss.Tensor, family=Family.LOSS)
def ctc_loss_defined(plan: OpPlan, args: Any, kwargs: Any, outputs: list) -> Any:
    """(neg_log_likelihood, log_alpha [batch, T, 2 * max_target_length + 1]). The CPU kernel fills row t = 0
    with -inf, then writes sequence b's alphas for t < input_lengths[b] and s < 2 * target_lengths[b] + 1
    only; the rest is the allocation's (``ctc_loss_cpu_template``, aten/src/ATen/native/LossCTC.cpp). Other
    devices' kernels write at least that region, so comparing it alone is safe there too."""
    log_alpha = outputs[1] if len(outputs) > 1 else None
    if not isinstance(log_alpha, torch.Tensor) or log_alpha.dim() != 3:
        return NotImplemented
    input_lengths, target_lengths = _lengths(plan.arg(args, kwargs, "input_lengths")), \
        _lengths(plan.arg(args, kwargs, "target_lengths"))
    batch, steps, states = log_alpha.shape
    if input_lengths.numel() != batch or target_lengths.numel() != batch:
        return NotImplemented
    t = torch.arange(steps).view(1, steps, 1)
    s = torch.arange(states).view(1, 1, states)
    written = (t < input_lengths.view(batch, 1, 1)) & (s < 2 * target_lengths.view(batch, 1, 1) + 1)
    return [None, written | (t == 0)]


__all__ = ["DEFINED", "DefinedRule", "defined_regions", "register_defined"]
