"""The emulation mode and the registry of emulated devices: each device registers its mode class, rule
table, options and, where ``shadow.audit`` offers it as a precision, its format (``AuditFormat``) by name with
``@register``: one registration, read by ``emulate()``, the audit's ``PRECISIONS`` and ``shadow.explain``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ...errors import EmulationOrderError, ShadowOptionError
from ...plan import OpPlan, plan_of
from ...rules import RuleTable, run_chain
from .formats import Format

_no_dispatch = torch._C._DisableTorchDispatch  # an emulation's own work must reach no mode and no kernel twice

# A rule computes a claimed op as the device would (in-place and out= variants write their destination),
# or returns NotImplemented to fall through; it runs with dispatch disabled.
Rule = Callable[[OpPlan, tuple, dict, Any], Any]  # (plan, args, kwargs, the mode's options)
E = TypeVar("E", bound="Emulation")

EMULATIONS: dict[str, type[Emulation]] = {}  # name -> the device's mode class, filled by @register


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a device that takes none."""


@dataclasses.dataclass(frozen=True)
class AuditFormat:
    """A device ``shadow.audit`` offers as a candidate precision under its name: the number format a part runs
    in (its range risks), whether tensors are scaled into it per tensor (FP8's amax scaling: no overflow), and
    whether the audit holds a part in the format on the device's own kernels (``shadow.precision.held``: bf16,
    fp16) rather than running this device's mode."""

    format: Format
    scaled: bool = False
    held: bool = False

    @property
    def bits(self) -> int:
        """The stored mantissa bits: the plan tries fewer first."""
        return self.format.precision - 1


def register(name: str, table: RuleTable[Rule], options: type = NoOptions, *,
             audit: AuditFormat | None = None) -> Callable[[type[E]], type[E]]:
    """Class decorator: the Emulation subclass is the device ``name``, computing the ops ``table`` claims.
    ``options`` is a frozen dataclass: its fields are the device's options (``init=False`` fields are the mode's
    own state), its ``__post_init__`` checks their values. ``audit``: the device is also the audit's precision
    ``name`` (``shadow.precision.PRECISIONS``)."""

    def deco(mode: type[E]) -> type[E]:
        if name in EMULATIONS:
            raise ValueError(f"an emulation called {name!r} is already registered ({EMULATIONS[name].__name__})")
        mode.name, mode.table, mode.Options, mode.audit = name, table, options, audit
        EMULATIONS[name] = mode
        return mode

    return deco


class Emulation(TorchDispatchMode):
    """A dispatch mode that computes the ops its device's table claims with that device's numerics and
    passes every other op through. Enter it OUTSIDE ShadowMode (see ``shadow.modes.emulate``).

    >>> with Emulation("tf32", rounding="rz"), ShadowMode() as sm:   # doctest: +SKIP
    ...     y = a @ b
    """

    name: ClassVar[str]  # set on each device's class by @register
    table: ClassVar[RuleTable[Rule]]
    Options: ClassVar[type]
    audit: ClassVar[AuditFormat | None]

    def __init__(self, name: str, **options: Any):
        super().__init__()
        device = EMULATIONS.get(name)
        if device is None:
            raise ShadowOptionError(f"Emulation({name!r}): expected one of {sorted(EMULATIONS)}")
        fields = [f.name for f in dataclasses.fields(device.Options) if f.init]
        unknown = set(options) - set(fields)
        if unknown:
            raise TypeError(f"emulation {name!r} takes options {fields or 'none'}, got {sorted(unknown)}")
        self.name = name
        self.table = device.table
        self.options = device.Options(**options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.options})"

    def spec(self) -> dict:
        """How ``shadow repro`` builds this device again: its name as ``emulate()`` (``shadow run --emulate``)
        takes it, and its options (an enum's by value)."""
        return {"emulate": self.name, "kwargs": {f.name: getattr(getattr(self.options, f.name), "value",
                                                                 getattr(self.options, f.name))
                                                 for f in dataclasses.fields(self.options) if f.init}}

    def __enter__(self):
        require_outside_shadow(f"emulate({self.name!r})" if type(self) is Emulation else f"{type(self).__name__}()")
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        chain = self.table.chain(func)
        out = NotImplemented
        if chain:
            with _no_dispatch():
                out = run_chain(chain, plan_of(func), args, kwargs, self.options)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        self.seen(func, args, kwargs, out)
        return out

    def seen(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Every call and its result, claimed or not (a device that tells gradients from activations learns them
        here)."""


def require_outside_shadow(built: str) -> None:
    """A device-side mode (an emulation, a fault) is being entered: refuse if a ShadowMode is active, since the
    mode would then sit above ShadowMode, which would see its internal ops. ``built``: how the mode was built."""
    from ..shadow import ShadowDispatch

    if any(isinstance(m, ShadowDispatch) for m in _get_current_dispatch_mode_stack()):
        raise EmulationOrderError(built)


def emulate(name: str, **options: Any) -> Emulation:
    """The emulation mode called ``name`` (a key of ``EMULATIONS``: "tf32", "bf16", "fp16", "fp8", "fp16_accum",
    "ftz"), with its options.

    >>> with emulate("tf32", rounding="rne"), ShadowMode() as sm:   # doctest: +SKIP
    ...     y = a @ b
    """
    if name not in EMULATIONS:
        raise ShadowOptionError(f"emulate({name!r}): expected one of {sorted(EMULATIONS)}")
    return EMULATIONS[name](**options)
