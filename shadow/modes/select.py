"""Which op calls a device-side mode acts on (FaultMode, a scoped emulation): the ops ``op`` names, or those run
inside ``module`` (forward and backward, its submodules' too), or both (the op inside the module). A fault claims
only ops that compute values, never views, data movement or partial writes; a scoped emulation gets every selected
call, and its own table says which it computes differently (a part held in bfloat16 rounds its data movement too:
``shadow.precision.held``)."""

from __future__ import annotations

from typing import Any

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from ..attribution.tracking import Tracker
from ..errors import ShadowOptionError
from ..plan import plan_of
from .emulate import Emulation, computes, overloads, require_outside_shadow

OP_FORMS = ("an OpOverload (torch.ops.aten.gelu.default), an OpOverloadPacket (torch.ops.aten.gelu) or an aten op "
            "name ('aten.gelu', 'gelu', 'aten.gelu.default'; a name or packet takes every overload and the "
            "in-place twin gelu_)")
MODULE_FORMS = "a dotted module path as shadow's records name it ('Net.fc1', 'Sequential.0') or an nn.Module"


class Selection:
    """The op calls chosen by ``op`` and/or ``module``; ``owner`` names the mode in error messages. Enter it (with
    the mode) while the calls run: the module stack is tracked as ShadowMode tracks it.

    >>> sel = Selection("FaultMode", op="gelu", module="Net.fc1")
    >>> with sel:
    ...     ...                  # sel.claims(func) for each op call   # doctest: +SKIP
    """

    def __init__(self, owner: str, *, op: Any = None, module: Any = None, verb: str = "act on",
                 innermost: bool = False):
        if op is None and module is None:
            raise ShadowOptionError(f"{owner}(): choose what to {verb}: op= ({OP_FORMS}) and/or module= "
                                    f"({MODULE_FORMS})")
        self.ops = None if op is None else _resolve_ops(owner, op)  # None: any op that computes
        # with innermost, "" is the calls outside any module (the loss, the optimizer), as records name them
        self.module = None if module is None else module if innermost and module == "" else _check_module(owner,
                                                                                                         module)
        self._tracker = Tracker() if module is not None else None
        self._innermost = innermost  # the module's own calls only, not its submodules'

    def __enter__(self) -> Selection:
        if self._tracker is not None:
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)

    def claims(self, func: torch._ops.OpOverload) -> bool:
        """A call of ``func`` now is selected and computes values."""
        return self.selects(func) and computes(plan_of(func))

    def selects(self, func: torch._ops.OpOverload) -> bool:
        """A call of ``func`` now is one of the chosen op's, inside the chosen module."""
        if self.ops is not None and func not in self.ops:
            return False
        if self.module is None:
            return True
        tracker = self._tracker
        name = self.module if isinstance(self.module, str) else tracker.name_of(self.module)
        return tracker.innermost == name if self._innermost else name in tracker.parents


class Selecting(TorchDispatchMode):
    """A device-side mode that acts on a ``selection`` of calls (FaultMode, Scoped): entered outside ShadowMode,
    the selection's module tracking entered and left with it. Subclasses set ``self.selection``."""

    selection: Selection

    def __enter__(self):
        require_outside_shadow(repr(self))
        self.selection.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.selection.__exit__(*exc)


class Scoped(Selecting):
    """An emulated device on part of the program: the calls ``op`` and/or ``module`` choose run with the
    emulation's numerics, every other call as the device computes it (what-if: "only this layer in bf16").
    Enter it outside ShadowMode, as the emulation itself.

    >>> with Scoped(BF16Mode(), module="Net.fc2"), ShadowMode() as sm:   # doctest: +SKIP
    ...     loss = net(x).sum()
    """

    def __init__(self, emulation: Emulation, *, op: Any = None, module: Any = None, innermost: bool = False):
        super().__init__()
        self.emulation = emulation
        # innermost: the module's own calls only (the audit's parts), not its submodules'
        self.selection = Selection(f"Scoped({emulation.name!r})", op=op, module=module, verb="emulate",
                                   innermost=innermost)

    def __repr__(self) -> str:
        return f"Scoped({self.emulation!r})"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.selection.selects(func):
            return self.emulation.__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        self.emulation.seen(func, args, kwargs or {}, out)
        return out


def _resolve_ops(owner: str, op: Any) -> frozenset[torch._ops.OpOverload]:
    """The overloads ``op`` names that compute values (views and data movement have no error of their own)."""
    if isinstance(op, torch._ops.OpOverload):
        found = [op]
    elif isinstance(op, torch._ops.OpOverloadPacket):
        found = _named(owner, op._qualified_op_name.replace("::", "."), op)
    elif isinstance(op, str):
        found = _named(owner, op, op)
    else:
        raise ShadowOptionError(f"{owner}(op={op!r}): expected {OP_FORMS}")
    computing = frozenset(o for o in found if computes(plan_of(o)))
    if not computing:
        raise ShadowOptionError(f"{owner}(op={op!r}): {', '.join(map(str, found))} computes no values (a view, "
                                "data movement or a partial write): choose an op that computes, such as 'gelu'")
    return computing


def _named(owner: str, name: str, given: Any) -> list[torch._ops.OpOverload]:
    parts = name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    packet = getattr(torch.ops.aten, parts[0], None) if len(parts) in (1, 2) and parts[0] else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise ShadowOptionError(f"{owner}(op={given!r}): no aten op {name!r}; expected {OP_FORMS}")
    if len(parts) == 1:
        return overloads(parts[0], skip=())
    if parts[1] not in packet.overloads():
        raise ShadowOptionError(f"{owner}(op={given!r}): aten.{parts[0]} has no overload {parts[1]!r}; its "
                                f"overloads: {', '.join(packet.overloads())}")
    return [getattr(packet, parts[1])]


def _check_module(owner: str, module: Any) -> str | torch.nn.Module:
    if isinstance(module, torch.nn.Module) or (isinstance(module, str) and module):
        return module
    raise ShadowOptionError(f"{owner}(module={module!r}): expected {MODULE_FORMS}")
