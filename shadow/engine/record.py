"""The record of one call (``shadow.records.Record``, built by keyword), added to the report and told to the hooks."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ..devices import cpu_fallback
from ..metrics import ErrorStats
from ..plan import OpPlan, flat_returns
from ..records import Kind, Record
from .values import Judged

if TYPE_CHECKING:
    from .core import Engine


def record(engine: Engine, plan: OpPlan, kind: Kind, args: tuple, kwargs: dict, out: Any, *,
           judged: Judged | None = None, item: tuple | None = None, reason: str = "", inputs: list = (),
           cpu: ErrorStats | None = None, result: Any = False, nonfinite_in: bool = False, inputs_drift: float = 0.0,
           at: tuple | None = None) -> Record:
    """Record the call ``engine.index``. ``result``: the call's first tensor result, when the caller knows it
    (False: look it up); ``at``: (module, phase, call site) when the caller asked for them already."""
    module, phase, site = at if at is not None else engine.attribution.where(plan.func, args, kwargs, out,
                                                                             engine.index)
    fallback = bool(inputs) and not inputs[0].is_cpu and inputs[0].device.type == torch._C._get_privateuse1_backend_name() \
        and cpu_fallback(plan.func, inputs[0].device)
    if result is False:
        result = first_tensor(plan, args, kwargs, out)
    dtype, shape = ("", ()) if result is None else \
        (dtype_name(result.dtype), () if result.is_nested else tuple(result.shape))  # nested: no one shape
    rec = _new_record()
    _init_record(rec, index=engine.index, op=plan.name, module=module, phase=phase, kind=kind, item=item,
                 reason=reason, cpu_fallback=fallback, cpu=cpu, dtype=dtype, shape=shape, callsite=site,
                 inputs_nonfinite=nonfinite_in, inputs_drift=inputs_drift)
    if judged is not None:  # its figures, by name: a call of more than 15 keywords would build a dict and unpack it
        rec.local, rec.drift, rec.budget, rec.spot = judged.local, judged.drift, judged.budget, judged.spot
        rec.flips, rec.local_flips, rec.shape_mismatch, rec.skipped = \
            judged.flips, judged.local_flips, judged.mismatch, judged.skipped
    engine.index += 1
    engine.report.add(rec)
    recorded = engine.hooks.recorded
    if recorded is not None:
        recorded(rec, result)
    return rec


# Record's __init__ called as a function takes its keywords as they are; a class called with keywords packs them
# into a dict for __init__ first
_new_record, _init_record = functools.partial(object.__new__, Record), Record.__init__
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """str(dtype) ("torch.bfloat16"), cached: it is asked once per call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def first_tensor(plan: OpPlan, args: tuple, kwargs: dict, out: Any) -> torch.Tensor | None:
    """The call's result: its first returned tensor, else its first written argument (in-place foreach)."""
    for _, t in flat_returns(plan, out):
        if isinstance(t, torch.Tensor):
            return t
    return next((t for _, t in plan.tensors(args, kwargs, plan.writes)), None)
