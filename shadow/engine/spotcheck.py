"""A call's spot check (``shadow.spot``): sampled elements of its float64 reference recomputed at high precision,
before any comparison. The check returns the corrections of the elements it found untrusted; judging applies them.
A check that fails costs the call its spot check, never its figures: counted in ``coverage.internal_errors``
under "spot check of OP"."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..budgets import Budget
from ..metrics import fused_bounds  # the numba kernels (None without numba)
from ..plan import OpPlan, flat_returns
from ..scratch import Scratch
from ..spot import SpotStats
from ..spot.sampling import top_positions
from .budget import guarded
from .values import Correction, Prepared, SpotCheck

if TYPE_CHECKING:
    from .core import Engine


def spot_check(engine: Engine, prepared: Prepared, out: Any, references: Any, dtype: torch.dtype,
               budget: Budget | None, batch: Iterable[Any]) -> SpotCheck:
    """The spot check of the reference the local error is measured against (``references``: the replay's outputs
    as the op returns them). With the budget of a sum (``Budget.of_sum``), bound / |reference| is the condition
    estimate that picks the first samples (where the reference cancels); elementwise ops round once from exact
    inputs and are sampled at random. The budget comes back None where building the bound of a sum failed.
    The device's results are read where their shadows live (``Engine.near``, with the call's outputs ``batch``):
    the copies the comparisons read after."""
    if budget is not None and budget.of_sum:  # its bound ranks the samples: built from the reference as it is
        budget = guarded(engine, prepared.plan, budget, lambda: budget.bound)
    plan = prepared.plan
    try:
        batch = list(batch)
        devices = [engine.near(t, batch) if t is not None and t.layout == torch.strided else t
                   for t in _tensors(plan, out)]
        tensors = _tensors(plan, references)
        priority = None
        if budget is not None and budget.of_sum:
            priority = [Condition.of(bound, reference, engine.scratch)
                        for bound, reference in zip(budget.bound, tensors)]
        pre = prepared.pre
        stats, samples = engine.spot.check(plan.func, pre.args, pre.kwargs, devices, tensors, dtype, priority)
    except Exception as exc:
        _failed(engine, plan, exc)
        return SpotCheck(None, (), budget)
    corrections = tuple(Correction(sample.output, sample.index, sample.exact) for sample in samples
                        if not sample.trusted and tensors[sample.output] is not None)
    return SpotCheck(stats, corrections, budget)


def apply_corrections(engine: Engine, plan: OpPlan, references: Any, check: SpotCheck) -> SpotStats | None:
    """Write the exact values of the elements ``check`` found untrusted into the float64 references (the replay's
    own outputs); the check's figures, or None where writing them failed."""
    try:
        tensors = _tensors(plan, references)
        for correction in check.corrections:
            tensors[correction.slot][correction.index] = correction.value
    except Exception as exc:
        _failed(engine, plan, exc)
        return None
    return check.stats


def _failed(engine: Engine, plan: OpPlan, exc: Exception) -> None:
    engine.report.internal_error(f"spot check of {plan.name}", f"internal error: {type(exc).__name__}: {exc}"[:240])


def _tensors(plan: OpPlan, out: Any) -> list[torch.Tensor | None]:
    """The op's flattened returns in ``out``, None where one is not a tensor."""
    return [t if isinstance(t, torch.Tensor) else None for _, t in flat_returns(plan, out)]


class Condition:
    """bound / |r| elementwise (a budget's error bound relative to the result: large where r cancels), the
    spot checks' priority (``shadow.spot.sampling.Ranked``), computed when asked: its largest element alone
    in one pass where ``shadow._fused.largest_ratio`` reads the tensors."""

    __slots__ = ("bound", "r", "scratch")

    def __init__(self, bound: torch.Tensor, r: torch.Tensor, scratch: Scratch):
        self.bound, self.r, self.scratch = bound, r, scratch

    @staticmethod
    def of(bound: Any, r: Any, scratch: Scratch) -> Condition | None:
        """The condition estimate of a real floating result and its bound tensor, else None."""
        if not isinstance(bound, torch.Tensor) or not isinstance(r, torch.Tensor) or r.is_complex() \
                or not r.is_floating_point():
            return None
        return Condition(bound, r, scratch)

    def numel(self) -> int:
        return self.r.numel()

    def top(self, n: int) -> list[int]:
        i = fused_bounds.largest_ratio(self.bound, self.r) if n == 1 and fused_bounds is not None else None
        if i is not None:
            return [] if i < 0 else [i]
        return top_positions(self.tensor(), n)

    def tensor(self) -> torch.Tensor:
        b, r = self.bound, self.r
        a = torch.abs(r, out=self.scratch.empty_like(r, r.dtype))
        return torch.div(b, a, out=a) if b.shape == r.shape else torch.broadcast_to(b, r.shape) / a
