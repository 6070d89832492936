"""FP8Mode: float32 matmuls whose operands are quantized to FP8 with per-tensor scaling, as Transformer Engine
runs them: activations and weights in E4M3, gradients in E5M2, each tensor scaled so that its largest magnitude
maps to the format's largest value (amax scaling, the current tensor's amax: no history), products accumulated in
float32 and unscaled. Only the matmul family is claimed (mm, bmm, addmm, baddbmm, addbmm): FP8 training keeps
every other op in higher precision. A gradient is a tensor an op made during autograd's backward (``seen``)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch

from ...devices import holds_dtype
from ...opsets import MATMULS, Matmul
from ...plan import OpPlan, flat_returns, plan_of
from ...rules import RuleTable
from ._mode import AuditFormat, Emulation, Rule, register
from ._utils import overloads
from .formats import E4M3, E5M2, Format, round_to

TABLE: RuleTable[Rule] = RuleTable("fp8")  # no default: unclaimed ops pass through

_CLAIMED = {name: MATMULS[name] for name in ("mm", "bmm", "addmm", "_addmm_activation", "baddbmm", "addbmm")}


def quantize(t: torch.Tensor, fmt: Format) -> torch.Tensor:
    """t scaled by max(fmt) / amax(t), rounded to ``fmt``, scaled back (float32 in and out; a zero tensor stays)."""
    amax = float(t.abs().max()) if t.numel() else 0.0
    if not amax or amax == float("inf") or amax != amax:
        return t.clone()
    scale = fmt.max / amax
    home = t.device if holds_dtype(t.device, torch.float64) else torch.device("cpu")  # DirectML: on the CPU
    return round_to(t.to(home).to(torch.float64) * scale, fmt).div_(scale).to(t.dtype).to(t.device)


class _Tensors:
    """A set of live tensors by identity (a WeakSet compares tensors with ==)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        if len(self._refs) > 4096:
            self._refs = {k: r for k, r in self._refs.items() if r() is not None}
        self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t


@dataclasses.dataclass(frozen=True)
class FP8State:
    """An FP8Mode's own state, which its rules read as their options: the tensors made during autograd's backward
    (gradients, quantized to E5M2). It takes no option."""

    grads: _Tensors = dataclasses.field(default_factory=_Tensors, init=False, repr=False)


def _fp8_factors(plan: OpPlan, args: tuple, kwargs: dict, state: FP8State, roles: Matmul) -> Any:
    factors = (roles.a, roles.b)

    def operand(t: torch.Tensor, spec) -> torch.Tensor:
        if spec.name not in factors or t.dtype != torch.float32:
            return t
        return quantize(t, E5M2 if t in state.grads else E4M3)

    args, kwargs = plan.map_tensors(args, kwargs, operand)
    return plan.func(*args, **kwargs)


for _name, _roles in _CLAIMED.items():
    TABLE.register(*overloads(_name))(functools.partial(_fp8_factors, roles=_roles))


@register("fp8", TABLE, FP8State, audit=AuditFormat(E4M3, scaled=True))
class FP8Mode(Emulation):
    """float32 matmuls with FP8 operands (E4M3 activations and weights, E5M2 gradients, per-tensor amax scaling),
    float32 accumulation.

    >>> with FP8Mode(), ShadowMode() as sm:      # the emulation outside   # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    """

    def __init__(self):
        super().__init__(self.name)

    def seen(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A result made during backward is a gradient, except a view of a tensor that is not one (the transpose
        of a saved activation, which backward's matmuls read)."""
        if torch._C._current_graph_task_id() == -1:
            return
        plan = plan_of(func)
        viewed = [t for _, t in plan.tensors(args, kwargs)]
        for spec, t in flat_returns(plan, out):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            grads = self.options.grads
            if spec.aliases_read and not any(v in grads for v in viewed if isinstance(v, torch.Tensor)):
                continue
            grads.add(t)
