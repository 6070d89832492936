"""Correct implementations with random rounding: every floating op computes its result in float64 on the device's
inputs and rounds it to the device dtype stochastically (up or down, with probability given by the distance to
each neighbour), so that several runs of a program span what correct implementations of it may compute
(``shadow.envelope``).

Two devices share the machinery:

- ``"stochastic"``: one stochastic rounding of the exact result per op: a correctly rounded kernel whose last bit
  is random. Real elementwise kernels are close to it; real matmuls and reductions are not (a GEMM of K terms
  rounds K times, in an order each library chooses), so its spread is too narrow for them.
- ``"stochastic_budget"`` (``shadow.envelope``'s default): the same, and each element of an op whose budget is a
  sum's (matmuls, convolutions, reductions, norms: ``Budget.of_sum``) first gets an error drawn uniformly within
  ``fraction`` of its budget (``shadow.budgets``: gamma_K(u) |A||B| for a matmul), the accumulation that one
  rounding does not model.

The draws come from a private ``torch.Generator`` seeded with ``seed`` when the mode is built: torch's generators are
never touched, and ops that draw random numbers themselves (dropout, ``normal_``: ``Tag.nondeterministic_seeded``)
run once, as the device runs them, so the program's own randomness is unchanged. Complex results, and results of a
dtype other than the device's floating ones, are the device's. Figures: docs/envelope.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ...budgets import budget_for
from ...devices import holds_dtype
from ...errors import ShadowOptionError
from ...plan import OpPlan, flat_returns
from ...rules import RuleTable
from ._mode import Emulation, Rule, register
from ._utils import computes

ROUNDED = frozenset({torch.float32, torch.float16, torch.bfloat16})  # the device dtypes whose results are rounded
DEFAULT_FRACTION = 0.05  # of a sum's budget: the spread of the errors drawn (docs/envelope.md: how it was chosen)


@dataclasses.dataclass(frozen=True)
class StochasticOptions:
    seed: int = 0  # of the private generator: one run's random roundings
    generator: torch.Generator = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ShadowOptionError(f"seed={self.seed!r}: expected an int (the private generator's seed)")
        object.__setattr__(self, "generator", torch.Generator().manual_seed(self.seed))


@dataclasses.dataclass(frozen=True)
class StochasticBudgetOptions(StochasticOptions):
    fraction: float = DEFAULT_FRACTION  # of a sum's budget: errors drawn uniformly in [-fraction, fraction] x budget

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or \
                not 0.0 <= self.fraction <= 1.0:
            raise ShadowOptionError(f"fraction={self.fraction!r}: expected a number in [0, 1] (the share of a "
                                    "sum's error budget its drawn errors span)")


def _uniform(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Uniform [0, 1) draws of ``like``'s shape, float64, from ``generator`` (on the CPU), on ``like``'s device."""
    return torch.rand(like.shape, generator=generator, dtype=torch.float64).to(like.device)


def stochastic_round(exact: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """float64 ``exact`` rounded to ``dtype``: to the neighbour on the far side with probability (distance to the
    nearest) / (distance between the two), else to the nearest; values ``dtype`` holds, inf and NaN are kept.

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.full((10000,), 1 + 2.0**-25, dtype=torch.float64)      # a quarter ulp above 1 in float32
    >>> round(float((stochastic_round(x, torch.float32, g) > 1).double().mean()), 1)
    0.2
    """
    near = exact.to(dtype)
    gap = exact - near.to(torch.float64)  # exact in float64: what rounding to nearest dropped
    toward = torch.where(gap > 0, float("inf"), float("-inf")).to(dtype)
    far = torch.nextafter(near, toward)
    chance = gap / (far.to(torch.float64) - near.to(torch.float64))  # in [0, 1/2]; NaN where exact is not finite
    return torch.where(_uniform(exact, generator) < chance, far, near)


def _rounds(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in ROUNDED and t.numel() > 0 and not t._is_zerotensor()


def _widen(t: torch.Tensor, host: bool) -> torch.Tensor:
    """A float64 copy of a rounded tensor (the others as they are), on the CPU where the device holds no float64."""
    device = "cpu" if host else t.device
    return t.to(device).to(torch.float64, copy=True) if _rounds(t) else t.to(device)


def _claimed(plan: OpPlan) -> bool:
    """Ops that compute values from their inputs alone: not those drawing random numbers of the program's."""
    return computes(plan) and torch.Tag.nondeterministic_seeded not in plan.tags


def _random_rounding(plan: OpPlan, args: tuple, kwargs: dict, options: StochasticOptions, *,
                     budgeted: bool) -> Any:
    """Run the op as the device does (its result's dtype, shape and writes), then overwrite each rounded floating
    result with its float64 value (computed on the inputs as they were before the op), perturbed within
    ``options.fraction`` of its budget where ``budgeted`` and the budget is a sum's, and rounded stochastically."""
    rounded = [t for _, t in plan.tensors(args, kwargs) if _rounds(t)]
    if not rounded:
        return NotImplemented
    host = not holds_dtype(rounded[0].device, torch.float64)  # DirectML: the float64 work on the CPU
    # copies: the op may overwrite its inputs
    wide_args, wide_kwargs = plan.map_tensors(args, kwargs, lambda t, _: _widen(t, host))
    out = plan.func(*args, **kwargs)
    results = [(t, w) for (_, t), (_, w) in zip(plan.tensors(args, kwargs, plan.writes),
                                                 plan.tensors(wide_args, wide_kwargs, plan.writes))]
    inputs = None if plan.writes or not budgeted else (list(wide_args), dict(wide_kwargs))
    wide = plan.func(*wide_args, **wide_kwargs)
    results += [(t, w) for (spec, t), (_, w) in zip(flat_returns(plan, out), flat_returns(plan, wide))
                if not (spec.aliases_write or spec.aliases_read)]
    results = [(t, w) for t, w in results if _rounds(t) and isinstance(w, torch.Tensor)
               and w.dtype is torch.float64 and w.shape == t.shape]
    if inputs is not None:
        _perturb(plan, inputs, results, options)
    for t, w in results:
        t.copy_(stochastic_round(w, t.dtype, options.generator).to(t.device))
    return out


def _perturb(plan: OpPlan, inputs: tuple[list, dict], results: list[tuple[torch.Tensor, torch.Tensor]],
             options: StochasticBudgetOptions) -> None:
    """Add to each float64 result an error drawn uniformly within ``options.fraction`` of its budget, where the op's
    budget is a sum's (the accumulation a single rounding does not model)."""
    if not results or options.fraction == 0.0:
        return
    dtype = results[0][0].dtype
    budget = budget_for(plan.func, *inputs, [w for _, w in results], dtype)
    if not budget.of_sum:
        return
    for (_, w), bound in zip(results, budget.bound):
        if bound is not None:
            w.add_(torch.broadcast_to(bound.to(w.device), w.shape) * (2.0 * _uniform(w, options.generator) - 1.0)
                   * options.fraction)


def _table(name: str, budgeted: bool) -> RuleTable[Rule]:
    table = RuleTable(name)  # no default: unclaimed ops pass through
    table.register_predicate(_claimed)(functools.partial(_random_rounding, budgeted=budgeted))
    return table


@register("stochastic", _table("stochastic", False), StochasticOptions)
class StochasticMode(Emulation):
    """Every floating op computed in float64 and rounded stochastically to its dtype: a correctly rounded
    implementation whose last bit is random (``seed``: the private generator's).

    >>> with StochasticMode(seed=1):
    ...     y = x @ w           # the exact product, each element rounded up or down at random   # doctest: +SKIP
    """

    def __init__(self, *, seed: int = 0):
        super().__init__(self.name, seed=seed)


@register("stochastic_budget", _table("stochastic_budget", True), StochasticBudgetOptions)
class StochasticBudgetMode(Emulation):
    """As ``StochasticMode``, and the results of ops whose budget is a sum's (matmuls, reductions) first moved by an
    error drawn uniformly within ``fraction`` of their budget: what real kernels' own accumulation adds.

    >>> with StochasticBudgetMode(seed=1, fraction=0.25):
    ...     y = x @ w                                                                   # doctest: +SKIP
    """

    def __init__(self, *, seed: int = 0, fraction: float = DEFAULT_FRACTION):
        super().__init__(self.name, seed=seed, fraction=fraction)
