"""FaultMode: a relative error of known size injected into chosen ops on the device side, so that a test (or a
user checking shadow itself) can see whether the report finds it where it was put, and only there.

Like the emulated devices, it is entered OUTSIDE ShadowMode, so that ShadowMode sees each op first and the fault
acts as the device: ``with FaultMode(rel=1e-3, op="gelu"), ShadowMode() as sm:``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..attribution.tracking import _Tracker
from ..errors import ShadowOptionError
from ..plan import OpPlan, flat_returns, plan_of
from .emulate._mode import require_outside_shadow
from .emulate._utils import _floating, computes, overloads

_no_dispatch = torch._C._DisableTorchDispatch  # the fault's own arithmetic must reach no mode

_OP_FORMS = ("an OpOverload (torch.ops.aten.gelu.default), an OpOverloadPacket (torch.ops.aten.gelu) or an aten op "
             "name ('aten.gelu', 'gelu', 'aten.gelu.default'; a name or packet takes every overload and the "
             "in-place twin gelu_)")
_MODULE_FORMS = "a dotted module path as shadow's records name it ('Net.fc1', 'Sequential.0') or an nn.Module"


class FaultMode(TorchDispatchMode):
    """Multiply the floating outputs of the chosen ops by ``1 + rel`` (each element rounded once to its dtype):
    the ops ``op`` names, or those run inside ``module`` (forward and backward, its submodules' too), or both
    (the op inside the module). Only ops that compute values are touched, never views, data movement or partial
    writes; in-place and out= variants get their written argument perturbed, as the op writes it.

    It is a pure function of each call's inputs: ``random_sign=True`` draws a sign per element from a private
    generator seeded with ``seed`` at each call (the same pattern for every call of a shape), and torch's own
    generators are never touched. ``injected`` counts the calls perturbed, by op.

    >>> with FaultMode(rel=1e-3, op="gelu") as fault, ShadowMode() as sm:
    ...     y = torch.nn.functional.gelu(x)                        # doctest: +SKIP
    >>> fault.injected, sm.report.find(op="gelu")[0].local.rel_norm  # doctest: +SKIP
    ({'aten.gelu.default': 1}, 0.001)
    """

    def __init__(
        self,
        *,
        rel: float,  # the relative error: outputs times (1 + rel)
        op: Any = None,  # which ops: an OpOverload, an OpOverloadPacket or a name ("aten.gelu", "gelu")
        module: Any = None,  # ... run inside which module: a dotted path ("Net.fc1") or the nn.Module itself
        random_sign: bool = False,  # times (1 + rel) or (1 - rel), a sign drawn per element
        seed: int = 0,  # the signs' seed
    ):
        super().__init__()
        if isinstance(rel, bool) or not isinstance(rel, (int, float)) or not math.isfinite(rel):
            raise ShadowOptionError(f"FaultMode(rel={rel!r}): expected a finite real number, the relative error "
                                    "to inject (rel=1e-3: outputs times 1.001)")
        if op is None and module is None:
            raise ShadowOptionError(f"FaultMode(): choose what to perturb: op= ({_OP_FORMS}) and/or module= "
                                    f"({_MODULE_FORMS})")
        if not isinstance(random_sign, bool):
            raise ShadowOptionError(f"FaultMode(random_sign={random_sign!r}): expected True or False")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ShadowOptionError(f"FaultMode(seed={seed!r}): expected an int")
        self.rel = float(rel)
        self.ops = None if op is None else _resolve_ops(op)  # None: any op that computes
        self.module = None if module is None else _check_module(module)
        self.random_sign = random_sign
        self.seed = seed
        self._op, self._module_arg = op, module  # as given, for repr
        self._tracker = _Tracker() if module is not None else None  # the module stack, as ShadowMode tracks it
        self._generator = torch.Generator()  # private: torch's default generators are never drawn from
        self.reset()

    def reset(self) -> None:
        """Forget the counts of ``injected``."""
        self.injected: dict[str, int] = {}  # op name ("aten.gelu.default") -> calls perturbed

    def __repr__(self) -> str:
        parts = [f"rel={self.rel!r}"]
        if self._op is not None:
            parts.append(f"op={self._op!r}" if isinstance(self._op, str) else f"op={self._op}")
        if self._module_arg is not None:
            m = self._module_arg
            parts.append(f"module={m!r}" if isinstance(m, str) else f"module=<{type(m).__name__}>")
        if self.random_sign:
            parts.append(f"random_sign=True, seed={self.seed}")
        return f"FaultMode({', '.join(parts)})"

    def __enter__(self):
        require_outside_shadow(repr(self))
        if self._tracker is not None:
            self._tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._tracker is not None:
                self._tracker.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._claims(func):
            with _no_dispatch():
                self._perturb(plan_of(func), args, kwargs, out)
        return out

    def _claims(self, func: torch._ops.OpOverload) -> bool:
        if self.ops is not None and func not in self.ops:
            return False
        if self.module is None:
            return True
        name = self.module if isinstance(self.module, str) else self._tracker._known_modules.get(self.module)
        return name in self._tracker.parents and computes(plan_of(func))

    def _perturb(self, plan: OpPlan, args: tuple, kwargs: dict, out: Any) -> None:
        """Written arguments and fresh results times (1 + rel), in place (a result aliasing an argument is that
        argument)."""
        targets = [t for _, t in plan.tensors(args, kwargs, plan.writes)]
        targets += [t for spec, t in flat_returns(plan, out) if not (spec.aliases_write or spec.aliases_read)]
        targets = [t for t in targets if isinstance(t, torch.Tensor) and _floating(t) and t.numel()]
        for t in targets:
            t.copy_(t.to(torch.complex128 if t.is_complex() else torch.float64) * self._factor(t))
        if targets:
            self.injected[plan.name] = self.injected.get(plan.name, 0) + 1

    def _factor(self, t: torch.Tensor) -> Any:
        if not self.random_sign:
            return 1.0 + self.rel
        self._generator.manual_seed(self.seed)
        sign = torch.randint(0, 2, t.shape, generator=self._generator, dtype=torch.float64).mul_(2).sub_(1)
        return sign.mul_(self.rel).add_(1.0).to(t.device)


def _resolve_ops(op: Any) -> frozenset[torch._ops.OpOverload]:
    """The overloads ``op`` names that compute values (views and data movement have no error of their own)."""
    if isinstance(op, torch._ops.OpOverload):
        found = [op]
    elif isinstance(op, torch._ops.OpOverloadPacket):
        found = _named(op._qualified_op_name.replace("::", "."), op)
    elif isinstance(op, str):
        found = _named(op, op)
    else:
        raise ShadowOptionError(f"FaultMode(op={op!r}): expected {_OP_FORMS}")
    computing = frozenset(o for o in found if computes(plan_of(o)))
    if not computing:
        raise ShadowOptionError(f"FaultMode(op={op!r}): {', '.join(map(str, found))} computes no values (a view, "
                                "data movement or a partial write): choose an op that computes, such as 'gelu'")
    return computing


def _named(name: str, given: Any) -> list[torch._ops.OpOverload]:
    parts = name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    packet = getattr(torch.ops.aten, parts[0], None) if len(parts) in (1, 2) and parts[0] else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise ShadowOptionError(f"FaultMode(op={given!r}): no aten op {name!r}; expected {_OP_FORMS}")
    if len(parts) == 1:
        return overloads(parts[0], skip=())
    if parts[1] not in packet.overloads():
        raise ShadowOptionError(f"FaultMode(op={given!r}): aten.{parts[0]} has no overload {parts[1]!r}; its "
                                f"overloads: {', '.join(packet.overloads())}")
    return [getattr(packet, parts[1])]


def _check_module(module: Any) -> str | torch.nn.Module:
    if isinstance(module, torch.nn.Module) or (isinstance(module, str) and module):
        return module
    raise ShadowOptionError(f"FaultMode(module={module!r}): expected {_MODULE_FORMS}")
