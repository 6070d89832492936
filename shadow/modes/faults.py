"""FaultMode: a relative error of known size injected into chosen ops on the device side, so that a test (or a
user checking shadow itself) can see whether the report finds it where it was put, and only there.

Like the emulated devices, it is entered OUTSIDE ShadowMode, so that ShadowMode sees each op first and the fault
acts as the device: ``with FaultMode(rel=1e-3, op="gelu"), ShadowMode() as sm:``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..devices import holds_dtype
from ..errors import ShadowOptionError
from ..plan import OpPlan, flat_returns, plan_of
from .emulate import is_floating
from .select import Selecting, Selection

_no_dispatch = torch._C._DisableTorchDispatch  # the fault's own arithmetic must reach no mode


class FaultMode(Selecting):
    """Multiply the floating outputs of the chosen ops by ``1 + rel`` (each element rounded once to its dtype):
    the ops ``op`` names, or those run inside ``module`` (forward and backward, its submodules' too), or both
    (the op inside the module). Only ops that compute values are touched, never views, data movement or partial
    writes; in-place and out= variants get their written argument perturbed, as the op writes it (of several declared
    written, those it changed: the fused optimizers' gradients, unscaled only with grad_scale, are left alone).

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
        if not isinstance(random_sign, bool):
            raise ShadowOptionError(f"FaultMode(random_sign={random_sign!r}): expected True or False")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ShadowOptionError(f"FaultMode(seed={seed!r}): expected an int")
        self.rel = float(rel)
        self.selection = Selection("FaultMode", op=op, module=module, verb="perturb")
        self.random_sign = random_sign
        self.seed = seed
        self._op, self._module_arg = op, module  # as given, for repr
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

    def spec(self) -> dict:
        """How ``shadow repro`` builds this fault again: its class and keyword arguments as plain values (an op as
        its name); ValueError where one is not (a module given as an nn.Module)."""
        op = self._op if self._op is None or isinstance(self._op, str) else \
            getattr(self._op, "_qualified_op_name", str(self._op)).replace("::", ".")  # a packet's name, or str(op)
        if self._module_arg is not None and not isinstance(self._module_arg, str):
            raise ValueError("module= is an nn.Module, not its dotted path")
        return {"class": f"{__name__}:{type(self).__qualname__}",
                "kwargs": {"rel": self.rel, "op": op, "module": self._module_arg, "random_sign": self.random_sign,
                           "seed": self.seed}}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.selection.claims(func):
            return func(*args, **kwargs)
        plan = plan_of(func)
        with _no_dispatch():
            written = [t for _, t in plan.tensors(args, kwargs, plan.writes) if _floating(t)]
            if len(written) > 1:  # several written arguments: which the op really writes is known after it ran
                before = [t.clone() for t in written]
        out = func(*args, **kwargs)
        with _no_dispatch():
            if len(written) > 1:
                # an argument declared written that the op left as it was is not perturbed: the fused optimizers
                # declare their gradients written and change them only to unscale them (grad_scale)
                written = [t for t, b in zip(written, before) if not torch.equal(t, b)]
            self._perturb(plan, written, out)
        return out

    def _perturb(self, plan: OpPlan, written: list, out: Any) -> None:
        """The written arguments and the fresh results times (1 + rel), in place (a result aliasing an argument is
        that argument)."""
        targets = written + [t for spec, t in flat_returns(plan, out)
                             if not (spec.aliases_write or spec.aliases_read) and _floating(t)]
        for t in targets:
            # the product in float64 where float64 exists (a DirectML tensor's on the CPU), rounded once to t's dtype
            home = t.device if holds_dtype(t.device, torch.float64) else torch.device("cpu")
            wide = t.to(home).to(torch.complex128 if t.is_complex() else torch.float64)
            t.copy_((wide * self._factor(t, home)).to(t.dtype))
        if targets:
            self.injected[plan.name] = self.injected.get(plan.name, 0) + 1

    def _factor(self, t: torch.Tensor, home: torch.device) -> Any:
        if not self.random_sign:
            return 1.0 + self.rel
        self._generator.manual_seed(self.seed)
        sign = torch.randint(0, 2, t.shape, generator=self._generator, dtype=torch.float64).mul_(2).sub_(1)
        return sign.mul_(self.rel).add_(1.0).to(home)


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and is_floating(t) and t.numel() > 0
