"""A call's error budget (``shadow.budgets``), from its inputs before the op (``pre_inputs``: the copies of those an
in-place op overwrites) and its float64 references (built when the call is judged, or before the replays for a rule
that reads the inputs alone: ``built_early``). A budget rule
that fails costs the call its budget, never its figures: counted in ``coverage.internal_errors`` under "budget of
OP"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import nested
from ..budgets import Budget, budget_for, reads_overwritten
from ..plan import ArgSpec, OpPlan
from .values import Args, Outputs, Prepared

if TYPE_CHECKING:
    from .core import Engine


def budget_of_outputs(engine: Engine, prepared: Prepared, outputs: Outputs) -> Budget | None:
    """The budget of the call's outputs, each at its slot (a nested one: its values, ``shadow.nested.values``); None
    (no budget) where there is nothing to bound or no tensor output."""
    slots: list = [None] * outputs.slots  # None where an output is absent
    found = False
    for o in outputs.items:
        if o.slot is not None and isinstance(o.device, torch.Tensor):
            if o.slot >= len(slots):
                slots += [None] * (o.slot + 1 - len(slots))
            reference = o.reference
            slots[o.slot] = nested.values(reference) if reference.is_nested else reference
            found = True
    return budget_of(engine, prepared, slots, outputs.dtype) if found else None


def budget_of(engine: Engine, prepared: Prepared, references: list, dtype: torch.dtype) -> Budget | None:
    """The budget of the references by output slot (None where an output is absent) in the device ``dtype``;
    None when its rule failed."""
    if prepared.fixed is not None:  # no argument read, no rule's code run: nothing to guard
        return prepared.fixed.budget(references, dtype)
    if prepared.early is not None:
        return prepared.early[0]
    pre = prepared.pre
    inputs_dtype = prepared.inputs[0].dtype if prepared.inputs else None
    return guarded(engine, prepared.plan, None, lambda: budget_for(prepared.plan.func, pre.args, pre.kwargs,
                                                                    references, dtype, scratch=engine.scratch,
                                                                    inputs_dtype=inputs_dtype))


def built_early(engine: Engine, plan: OpPlan, reference: Args, args: tuple, kwargs: dict,
                inputs: list[torch.Tensor]) -> Budget | None:
    """The budget of an in-place call that returns nothing, built with its bounds before the device op and the
    replays overwrite the inputs it reads (``shadow.budgets.builds_early``; None where its rule failed). Its
    references are the reference inputs the op writes, in the order of the outputs' slots (``read_outputs``): the
    local replay writes its results there, which the budget reads when judged (``scale_sq``'s sums)."""
    references = [t for _, t in plan.tensors(reference.args, reference.kwargs, plan.writes)]
    dtype = next((t.dtype for _, t in plan.tensors(args, kwargs, plan.writes)
                  if t.is_floating_point() or t.is_complex()), inputs[0].dtype if inputs else torch.float64)
    built = guarded(engine, plan, None, lambda: budget_for(plan.func, reference.args, reference.kwargs, references,
                                                          dtype, scratch=engine.scratch,
                                                          inputs_dtype=inputs[0].dtype if inputs else None))
    return None if built is None else guarded(engine, plan, built, lambda: built.divisors)


def pre_inputs(engine: Engine, plan: OpPlan, reference: Args, spot: bool) -> Args:
    """The reference's inputs as they are before the op: every input that shares memory with a written argument
    is copied (the replays write them; ``x.add_(x, alpha=2)``, ``add(x, y, out=x)``), except out= buffers
    themselves (nothing reads them) and the op's in-place ``self`` when no spot check is planned and the op's
    budget rules do not read it (``shadow.budgets.reads_overwritten``)."""
    written = {t.untyped_storage().data_ptr() for _, t in plan.tensors(reference.args, reference.kwargs, plan.writes)}
    if not written:
        return Args(list(reference.args), dict(reference.kwargs))
    skip = plan.out_args if spot or reads_overwritten(plan.func) else plan.write_args
    scratch = engine.scratch

    def snapshot(t: torch.Tensor, _: ArgSpec) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in written:
            return t
        return scratch.copy(t, t.dtype, t.device)

    return Args(*plan.map_tensors(reference.args, reference.kwargs, snapshot, skip))


def with_bounds(engine: Engine, prepared: Prepared, budget: Budget | None) -> Budget | None:
    """``budget`` once the bounds the comparisons read are built (bounds are built lazily: None when the rule
    fails there, which costs the call its budget only); budgets in ulps need no bounds."""
    if budget is not None and budget.ulps is None:
        return guarded(engine, prepared.plan, budget, lambda: budget.divisors)
    return budget


def guarded(engine: Engine, plan: OpPlan, value: Any, build: Callable[[], Any]) -> Any:
    """``value`` once ``build()`` succeeded (``build()``'s result when value is None); None when a budget rule
    failed in it: its bug must not cost the op its error figures (counted, visible in the coverage)."""
    try:
        built = build()
    except Exception as exc:
        engine.report.internal_error(f"budget of {plan.name}",
                                     f"internal error: {type(exc).__name__}: {exc}"[:240])
        return None
    return built if value is None else value
