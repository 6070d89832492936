"""A part of a model held in bfloat16 or float16, on the device's own kernels: what the audit's "bf16" and "fp16"
mean, for its estimates, its verification runs and the plan alike.

Each op that computes values runs on its floating inputs cast to the format's dtype, by the kernel the device has
for that dtype, and its results are cast back to the storage dtype: the kernels round inside as they do in a model
cast to that dtype (the CPU's bfloat16 batch norm normalizes with its batch statistics rounded to bfloat16, oneDNN's
LSTM layer rounds its hidden state at every step), where rounding only each op's inputs and results (``BF16Mode``,
``FP16Mode``) draws other roundings, whose change of the loss is another draw: docs/audit.md. The results of the
part's data movement (an embedding's lookup, a concatenation, a copy) are rounded to the format: the part holds its
tensors in it. Inputs are cast as a model in the format builds them: float32's masks (``finfo(float32).min``)
become the format's (``round_stored``).

What the model holds in float32 on purpose (its *wide* tensors: ``shadow.precision.upcasts``) stays float32: an op
on wide inputs only runs as the program runs it (on the narrow values among them rounded, as the model holds them);
one that mixes them rounds its other inputs and its results. Where the device has no kernel in the format, inputs
and results are rounded likewise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.utils._pytree import tree_map

from torch.utils._python_dispatch import TorchDispatchMode

from ..devices import holds_dtype
from ..modes.emulate import Emulation
from ..modes.emulate import Rule, computes, transform_io
from ..modes.emulate.formats import BF16, FP16, Format, round_to
from ..plan import OpPlan, flat_returns
from ..rules import RuleTable


@dataclasses.dataclass(frozen=True)
class HeldOptions:
    upcasts: Any = None  # shadow.precision.upcasts.Upcasts: the tensors the model holds in float32 (None: none)


def round_stored(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``x`` rounded to ``fmt`` (to nearest even) as a model held in ``fmt`` has it: the largest finite values of
    ``x``'s dtype, the masks models build as ``finfo(dtype).min``, become ``fmt``'s largest, the mask that model
    builds (rounded, float32's would overflow bfloat16 and float16 to -inf); a new tensor in ``x``'s dtype.

    >>> round_stored(torch.tensor([torch.finfo(torch.float32).min, 1 + 2**-9]), BF16)
    tensor([-3.3895e+38,  1.0000e+00])
    """
    r = round_to(x, fmt)
    if not x.is_floating_point() or not x.numel() or torch.finfo(x.dtype).max <= fmt.max:
        return r
    big = torch.finfo(x.dtype).max
    low, high = torch.aminmax(x)
    if low == -big or high == big:
        r = torch.where(x.abs() == big, torch.copysign(torch.full_like(r, fmt.max), x), r)
    return r


def stores(plan: OpPlan) -> bool:
    """A call whose fresh results hold moved values (an embedding's lookup, a concatenation, a copy)."""
    return plan.func.namespace == "aten" and plan.fresh_returns and not plan.writes and not plan.is_view \
        and not computes(plan)


def _floats(plan: OpPlan, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for _, t in plan.tensors(args, kwargs) if t.is_floating_point()]


def _wide(fmt: Format, plan: OpPlan, args: tuple, kwargs: dict, options: HeldOptions) -> Any:
    """An op on wide inputs only: in float32, as the program runs it (on narrow values rounded to ``fmt``: the
    model holds them so)."""
    up = options.upcasts
    floats = _floats(plan, args, kwargs) if up is not None and len(up) else ()
    if not floats or not all(up.wide(t) for t in floats):
        return NotImplemented
    a, kw = plan.map_tensors(args, kwargs, lambda t, _: round_stored(t, fmt) if up.narrow_values(t) else t,
                             skip=plan.write_args)
    out = plan.func(*a, **kw)
    up.spread(plan.func, args, kwargs, out)  # the rule runs where the device's dispatch does not see it
    return out


def _native(fmt: Format, plan: OpPlan, args: tuple, kwargs: dict, options: HeldOptions) -> Any:
    """The op on its floating inputs cast to ``fmt``'s dtype, by the device's kernel for it; results cast back to
    the inputs' dtype, written arguments written back. NotImplemented where the device has no such kernel, or
    where an input is wide."""
    dtype, up = fmt.dtype, options.upcasts
    floats = _floats(plan, args, kwargs)
    if not floats or floats[0].dtype.itemsize <= dtype.itemsize or (up is not None and any(map(up.wide, floats))) \
            or not holds_dtype(floats[0].device, dtype):  # DirectML has no bfloat16: rounded instead (_rounded)
        return NotImplemented
    back = floats[0].dtype
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(narrow copy) -> (it, the argument)

    def narrow(t: torch.Tensor, spec: Any) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        c = round_stored(t, fmt).to(dtype)
        if spec.write:
            written[id(c)] = (c, t)
        return c

    a, kw = plan.map_tensors(args, kwargs, narrow)
    try:
        out = plan.func(*a, **kw)
    except (RuntimeError, NotImplementedError):  # no kernel in that dtype on this device
        return NotImplemented
    for c, t in written.values():
        t.copy_(c)

    def wide(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        got = written.get(id(v))
        if got is not None:  # a written argument returned (in-place, out=): the caller's own tensor
            return got[1]
        return v.to(back) if v.dtype == dtype else v

    return tree_map(wide, out)


def _rounded(fmt: Format, plan: OpPlan, args: tuple, kwargs: dict, options: HeldOptions) -> Any:
    """The op on its inputs rounded to ``fmt`` (wide ones kept), its results rounded."""
    up = options.upcasts
    return transform_io(lambda t: t if t.dtype is fmt.dtype or (up is not None and up.wide(t)
                                                                and not up.narrow_values(t))
                        else round_stored(t, fmt), plan, args, kwargs, options)


def _stored(fmt: Format, plan: OpPlan, args: tuple, kwargs: dict, options: HeldOptions) -> Any:
    """A ``stores`` call, its fresh floating results rounded to ``fmt`` (in place: they are its own)."""
    out = plan.func(*args, **kwargs)
    for spec, t in flat_returns(plan, out):
        if not spec.aliases_read and isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() \
                and t.dtype != fmt.dtype:
            t.copy_(round_stored(t, fmt))
    return out


def held_table(name: str, fmt: Format) -> RuleTable[Rule]:
    """What a part held in ``fmt`` computes differently: ops that compute values (on wide inputs only, on the
    native kernels, else rounded), data movement (rounded); everything else passes."""
    table: RuleTable[Rule] = RuleTable(name)  # no default: views and the rest pass through
    table.register_predicate(lambda plan: computes(plan) or stores(plan))(functools.partial(_wide, fmt))
    table.register_predicate(computes)(functools.partial(_native, fmt))
    table.register_predicate(computes)(functools.partial(_rounded, fmt))
    table.register_predicate(stores)(functools.partial(_stored, fmt))
    return table


_TABLES = {fmt.name: held_table(f"{fmt.name} held", fmt) for fmt in (BF16, FP16)}


class Held(Emulation):
    """A part held in ``fmt`` (BF16, FP16): ops on the device's kernels for it, data movement rounded to it, what the
    model holds in float32 (``upcasts``) kept there. The audit's own device: not among ``emulate()``'s names.

    >>> with Scoped(Held(BF16), module="Net.fc1"), ShadowMode() as sm:   # doctest: +SKIP
    ...     loss = net(x).sum()
    """

    def __init__(self, fmt: Format, upcasts: Any = None):
        TorchDispatchMode.__init__(self)  # not Emulation's: that one looks the device up among the registered
        self.name, self.table, self.options = f"{fmt.name} held", _TABLES[fmt.name], HeldOptions(upcasts)
