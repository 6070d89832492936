"""What the devices' rules share: the overloads of an op family, which ops compute values, and running an
op on transformed inputs and outputs."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch

from ...opsets import DATA_MOVEMENT, PARTIAL_WRITES, VIEW_COPIES
from ...plan import OpPlan, flat_returns
from ...rules import RuleTable
from .formats import Format, round_to

aten = torch.ops.aten

# Never rounded or flushed: moved values are bit-exact on every device, and rounding a partly written
# destination would change the elements the op does not write.
PASS_THROUGH = DATA_MOVEMENT | VIEW_COPIES | PARTIAL_WRITES


def overloads(*names: str, skip: Iterable[str] = ("dtype", "dtype_out")) -> list[torch._ops.OpOverload]:
    """Every overload of the named aten ops and of their in-place twins (``addmm_``), except ``skip``
    (mm.dtype: a float32 result of float16 inputs, not an accumulation in the input dtype)."""
    out = []
    for name in names:
        for packet in (getattr(aten, n) for n in (name, name + "_") if hasattr(aten, n)):
            out.extend(getattr(packet, overload) for overload in packet.overloads() if overload not in skip)
    return out


def computes(plan: OpPlan) -> bool:
    """An aten op that computes values: not a view or alias, not data movement, not a partial write."""
    return (plan.func.namespace == "aten" and plan.base not in PASS_THROUGH
            and torch.Tag.inplace_view not in plan.tags and not any(r.aliases_read for r in plan.returns))


def is_floating(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and not t._is_zerotensor()  # a zero tensor has no memory


def _in_place(fn: Callable[[torch.Tensor], torch.Tensor], t: Any) -> None:
    if isinstance(t, torch.Tensor) and is_floating(t) and t.numel():
        t.copy_(fn(t))


def transform_io(fn: Callable[[torch.Tensor], torch.Tensor], plan: OpPlan, args: tuple, kwargs: dict,
                 options: Any) -> Any:
    """Run the op on fn(inputs) and return fn(outputs); written arguments are transformed in place.

    An in-place op's ``self`` is transformed before the op too (it is read, then overwritten in full: ops
    that write part of their destination pass through)."""
    for _, t in plan.tensors(args, kwargs, tuple(s for s in plan.writes if s.index not in plan.out_args)):
        _in_place(fn, t)
    args, kwargs = plan.map_tensors(args, kwargs, lambda t, _: fn(t) if is_floating(t) else t, skip=plan.write_args)
    out = plan.func(*args, **kwargs)
    for _, t in plan.tensors(args, kwargs, plan.writes):
        _in_place(fn, t)
    for spec, v in flat_returns(plan, out):
        if not (spec.aliases_write or spec.aliases_read):  # a fresh result: this rule owns it
            _in_place(fn, v)
    return out


def rounding_table(name: str, fmt: Format) -> RuleTable:
    """The rule table of a device that stores in float32 but computes in ``fmt`` (bf16, fp16): every op that
    computes values gets its floating inputs and outputs rounded to ``fmt`` (``transform_io``); the rest pass."""
    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype is fmt.dtype else round_to(t, fmt)

    table = RuleTable(name)  # no default: unclaimed ops pass through
    table.register_predicate(computes)(functools.partial(transform_io, rounded))
    return table
