"""Judging, the one place that turns a call's outputs into figures (``Judged``): every output compared once per
reference (``shadow.metrics``), only where the op defines its elements, held to the op's budget, with its
effective bits and the spot check of its reference."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from .. import nested
from ..budgets import Budget
from ..errors import Unsupported
from ..metrics import ErrorStats, compare, compare_pair, count_flips, merged
from ..mirror import SHADOW_DTYPES
from ..plan import flat_returns
from ..records import BudgetInfo
from ..spot import SpotStats
from .budget import budget_of_outputs, guarded, with_bounds
from .spotcheck import apply_corrections, spot_check
from .values import Compared, Judged, Output, Outputs, Prepared

if TYPE_CHECKING:
    from .core import Engine

_INF = math.inf


def judge(engine: Engine, prepared: Prepared, outputs: Outputs, out: Any, references: Any) -> Judged:
    """Every output compared with its shadow (drift) and its local reference (``references``: the replay's outputs
    the local error is measured against), held to the op's budget (``budget_used``: max |error| / bound, or
    max_ulp / ulps for budgets in ulps), with its effective bits, after the spot check of the reference, whose
    untrusted elements are corrected first."""
    budget = budget_of_outputs(engine, prepared, outputs) \
        if prepared.budget and (prepared.inputs or _floating(outputs)) else None
    spot = None
    if prepared.spot:
        check = spot_check(engine, prepared, out, references, outputs.dtype, budget,
                           (o.device for o in outputs.items))
        budget = check.budget
        spot = apply_corrections(engine, prepared.plan, references, check) if check.corrections else check.stats
    if budget is not None:
        budget = with_bounds(engine, prepared, budget)
    items = outputs.items
    if outputs.plain and len(items) == 1:  # most calls: one floating tensor, its shadow of its shape and dtype
        o = items[0]
        device = engine.near(o.device, (x.device for x in items))
        bound, ulps = bound_of(budget, 0) if budget is not None else (None, None)
        compared = (figures(engine, o.shadow, device, o.shadow, o.local, o.device.dtype, bound, ulps),)
    elif outputs.plain:  # floating strided tensors with shadows of their shape and dtype: straight to the figures
        compared = tuple(figures(engine, o.shadow, engine.near(o.device, (x.device for x in items)), o.shadow,
                                 o.local, o.device.dtype, *bound_of(budget, o.slot)) for o in items)
    else:
        compared = tuple(_compare(engine, prepared, o, outputs, budget) for o in items)
    return merged_figures(engine, prepared, compared, budget, spot)


def _floating(outputs: Outputs) -> bool:
    """Whether a call has a floating tensor result (what a budget bounds)."""
    return any(isinstance(o.device, torch.Tensor) and (o.device.is_floating_point() or o.device.is_complex())
               for o in outputs.items)


def _compare(engine: Engine, prepared: Prepared, o: Output, outputs: Outputs, budget: Budget | None) -> Compared:
    """One output's figures: a tensor's where the op defines its elements (``outputs.defined``: elsewhere the
    shadow keeps the device's values), a number's (.item(), equal: compared as a 0-d tensor, never kept)."""
    if isinstance(o.device, torch.Tensor):
        if o.device.is_nested:
            return _compare_nested(engine, prepared, o, budget)
        defined = outputs.defined[o.slot] if outputs.defined is not None and o.slot is not None \
            and o.slot < len(outputs.defined) else None
        return _compare_tensor(engine, prepared, o, o.device.dtype, budget, defined, outputs.items)
    dtype = next((t.dtype for t in prepared.inputs), torch.float64)
    local = None if o.local is None else _scalar(o.local, dtype)
    number = Output(_scalar(o.device, dtype), _scalar(o.shadow, dtype), local, False, None)
    return _compare_tensor(engine, prepared, number, dtype, None, None, ())._replace(keep=None)


def _compare_tensor(engine: Engine, prepared: Prepared, o: Output, dtype: torch.dtype, budget: Budget | None,
                    defined: torch.Tensor | None, outputs: tuple[Output, ...]) -> Compared:
    """The figures of tensor output ``o`` in the device ``dtype``; ``defined``: the elements the op defines (None:
    all), the only ones compared; ``outputs``: the call's, read over with this one where shadows live elsewhere
    (``Engine.near``)."""
    device, shadow, local = o.device, o.shadow, o.local
    shadow_dtype = engine.mirror.shadow_dtype(device.dtype)
    if not isinstance(shadow, torch.Tensor) or device._is_zerotensor():
        return Compared()
    if device.layout != torch.strided:  # a sparse result (to_sparse): no strided storage to mirror
        raise Unsupported(prepared.plan.name, f"{device.layout} result: shadow mirrors strided tensors only")
    if outputs:  # a tensor the device holds (a number's 0-d tensor, outputs (), is made beside its shadow)
        device = engine.near(device, (x.device for x in outputs))
    if shadow.shape != device.shape:  # a data-dependent shape the shadow did not reproduce: the device's adopted
        return Compared(mismatch=1, exact=True,
                        keep=engine.mirror.upcast(device) if shadow_dtype is not None else None)
    if SHADOW_DTYPES.get(device.dtype) is None:  # discrete result
        flips = count_flips(device, shadow)
        local_flips = count_flips(device, local) if isinstance(local, torch.Tensor) and local.shape == device.shape \
            else 0
        # follow="reference": the shadow keeps its own discrete result
        return Compared(flips=flips, local_flips=local_flips, exact=flips == 0,
                        keep=shadow.to(shadow_dtype) if shadow_dtype is not None else None)
    if shadow.dtype != shadow_dtype:
        shadow = shadow.to(shadow_dtype)
    bound, ulps = bound_of(budget, o.slot)
    if defined is None or defined.shape != device.shape or bool(defined.all()):
        return figures(engine, shadow, device, shadow, local, dtype, bound, ulps)
    defined = defined.to(shadow.device)
    keep = torch.where(defined, shadow, engine.mirror.upcast(device))
    if bound is not None and not isinstance(bound, torch.Tensor):  # a formula: its tensor, to index
        bound = budget.bound[o.slot]
    device, shadow = device.detach().to(shadow.device)[defined], shadow[defined]
    local = local[defined] if isinstance(local, torch.Tensor) and local.shape == defined.shape else local
    bound = torch.broadcast_to(bound, defined.shape)[defined] if isinstance(bound, torch.Tensor) else bound
    return figures(engine, keep, device, shadow, local, dtype, bound, ulps, int((~defined).sum()))


def _compare_nested(engine: Engine, prepared: Prepared, o: Output, budget: Budget | None) -> Compared:
    """A nested result's figures: its values' (``shadow.nested.values``, as its budget bounds them), read over to
    where its shadow lives; the mirror keeps the nested shadow. Components of other shapes than the device's: the
    device's result adopted."""
    device, shadow, local = o.device, o.shadow, o.local
    shadow_dtype = engine.mirror.shadow_dtype(device.dtype)
    if not nested.alike(device, shadow):
        return Compared(mismatch=1, exact=True,
                        keep=engine.mirror.upcast(device) if shadow_dtype is not None else None)
    flat = Output(nested.values(device).to(shadow.device), nested.values(shadow),
                  nested.values(local) if nested.alike(device, local) else None, o.written, o.slot)
    c = _compare_tensor(engine, prepared, flat, device.dtype, budget, None, ())
    return c if c.keep is None else c._replace(keep=shadow.to(c.keep.dtype))


def bound_of(budget: Budget | None, slot: int | None) -> tuple[Any, float | None]:
    """(the bound, the ulps) an output at ``slot`` is held to: a tensor or formula where the budget has bounds,
    a number of ulps where it is in ulps (no tensor: budget_used = max_ulp / ulps)."""
    if budget is None or slot is None:
        return None, None
    if budget.ulps is not None:
        return None, budget.ulps
    bounds = budget.divisors  # tensors, or formulas the comparison forms where it reads the reference
    return (bounds[slot] if slot < len(bounds) else None), None


def figures(engine: Engine, keep: Any, device: torch.Tensor, shadow: torch.Tensor, local: Any, dtype: torch.dtype,
            bound: Any, ulps: float | None, skipped: int = 0) -> Compared:
    """The figures of a device result against its shadow (drift) and its local reference ``local`` (None: the
    shadow serves), where every element compared is defined; ``bound``: the budget's bound (a tensor or formula)
    or ``ulps``: a budget in ulps; ``keep``: the shadow value the mirror keeps."""
    options = engine.options
    has_local = isinstance(local, torch.Tensor)
    # with every input exact (no local replay), the shadow comparison is the local error too
    shared = options.local and not has_local
    local_stats = None
    if has_local and options.drift and local.shape == device.shape:  # both figures, from one read where it can
        stats, local_stats = compare_pair(device, shadow, local, dtype, bound)
    else:
        stats = compare(device, shadow, dtype, bound if shared else None) if options.drift or shared else None
        if options.local and has_local:
            local_stats = compare(device, local, dtype, bound) if local.shape == device.shape else ErrorStats()
    return compared(engine, keep, stats, local_stats, shared, ulps, skipped)


def compared(engine: Engine, keep: Any, stats: ErrorStats | None, local_stats: ErrorStats | None, shared: bool,
             ulps: float | None, skipped: int = 0) -> Compared:
    """One output's ``Compared`` from its comparisons with its shadow (``stats``) and its local reference
    (``local_stats``; ``shared``: there is none, the shadow's serves, under the budget)."""
    options = engine.options
    drift = stats if options.drift else None
    if shared:  # the shadow comparison, under the budget: a copy without budget_used stays the drift
        local_stats = stats
        if drift is not None and (stats.budget_used is not None or ulps is not None):
            drift = dataclasses.replace(stats, budget_used=None)
    if local_stats is not None and ulps is not None:  # local_stats is the drift's no more
        local_stats.budget_used = local_stats.max_ulp / ulps if ulps > 0 else (_INF if local_stats.max_abs else 0.0)
    seen = stats if stats is not None else local_stats
    return Compared(drift, local_stats, exact=stats is not None and stats.exact, keep=keep,
                    nonfinite=seen is not None and seen.device_nonfinite > 0, skipped=skipped)


def merged_figures(engine: Engine, prepared: Prepared, compared: tuple[Compared, ...], budget: Budget | None,
                   spot: SpotStats | None) -> Judged:
    """The call's figures merged over its outputs, its effective bits and its budget's use."""
    if len(compared) == 1:  # most calls: the one output's figures are the call's
        c = compared[0]
        drift, local = c.drift, c.local
        flips, local_flips, mismatch, skipped = c.flips, c.local_flips, c.mismatch, c.skipped
    else:
        drift, local = merged(c.drift for c in compared), merged(c.local for c in compared)
        flips = local_flips = mismatch = skipped = 0
        for c in compared:
            flips, local_flips, mismatch = flips + c.flips, local_flips + c.local_flips, mismatch + c.mismatch
            skipped += c.skipped
    info = None
    if budget is not None and local is not None:
        if local.norm > 0:
            if local is drift:  # one output's stats serving both figures: only the local error gets bits
                local = dataclasses.replace(local)
            whole = _whole(compared)
            # a fixed budget's scale is its outputs' (shadow's own code, no rule's: nothing to guard)
            local.effective_bits = budget.bits(local, whole) if prepared.fixed is not None else \
                guarded(engine, prepared.plan, None, lambda: budget.bits(local, whole))
        info = BudgetInfo(budget.family, local.budget_used or 0.0, budget.is_default)
    return Judged(local, drift, flips, local_flips, mismatch, info, spot, compared, skipped)


def cpu_error(prepared: Prepared, outputs: Outputs) -> ErrorStats | None:
    """compare_cpu: the op's CPU kernel in the device dtype, on the device's inputs, against the same float64
    reference as the local error (the verdict msprobe and dynamo's same(fp64_ref) use). Random ops never get
    here: the CPU kernel would draw from the CPU generator."""
    plan, inputs = prepared.plan, prepared.cpu
    try:
        out = plan.func(*inputs.args, **inputs.kwargs)
    except Exception:  # no CPU kernel for this dtype (a device-only kernel): no comparison
        return None
    results = [t for _, t in flat_returns(plan, out)]
    if not any(isinstance(t, torch.Tensor) for t in results):  # in-place ops that return nothing
        results = [t for _, t in plan.tensors(inputs.args, inputs.kwargs, plan.writes)]
    stats = []
    for o in outputs.items:
        device = o.device
        if o.slot is None or o.slot >= len(results) or not isinstance(device, torch.Tensor) \
                or SHADOW_DTYPES.get(device.dtype) is None:
            continue
        reference, result = o.reference, results[o.slot]
        if nested.alike(result, reference):  # judged by their values
            result, reference = nested.values(result), nested.values(reference)
        if isinstance(result, torch.Tensor) and isinstance(reference, torch.Tensor) \
                and result.shape == reference.shape:
            stats.append(compare(result, reference, device.dtype))
    return merged(stats)


def _whole(compared: tuple[Compared, ...]) -> bool:
    """Whether a call's local figures are its one output's, over every element, all finite (``Budget.bits``)."""
    if len(compared) != 1:
        return False
    c = compared[0]
    local = c.local
    return local is not None and not c.skipped and not local.nonfinite and not local.nonfinite_agreed and \
        0.0 < local.rel_norm < _INF


def _scalar(v: Any, dtype: torch.dtype) -> torch.Tensor:
    """A Python number returned by an op (.item(), equal) as a 0-d tensor: float64 for floats."""
    if isinstance(v, float) or dtype.is_floating_point and not isinstance(v, bool):
        return torch.tensor(float(v), dtype=torch.float64)
    return torch.tensor(v)
