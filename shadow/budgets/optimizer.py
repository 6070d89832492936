"""Optimizer budgets: add and sub with alpha, rsub, addcmul, addcdiv, lerp (ulps of the result plus the
rounding of the scaled operand before the add, added in place by one fused op: they run for every
parameter, every step) and the ``_foreach_X`` ops, whose elements go to X's rule.

>>> from shadow.budgets import budget_for
>>> p, g = torch.ones(3, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64)
>>> budget_for(torch.ops.aten._foreach_add_.List, ([p], [g]), {"alpha": -0.1}, [p - 0.1 * g], torch.float32).family
'elementwise'
"""

from __future__ import annotations

from typing import Any

import torch

from ..opsets import Family
from ..plan import OpPlan
from .core import (Budget, BudgetCall, budget_for, coefficient, foreach_base, magnitude, overloads,
                   register_budget, register_budget_predicate)
from .elementwise import ULPS, with_operand_term

ARITH_ULPS = ULPS["arith"]


def _same(a: Any, b: Any) -> bool:
    """a and b are the same values: one tensor, or two views of the same memory with one layout."""
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                      and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


@register_budget(*overloads("add", "sub"), family=Family.ELEMENTWISE, reads_overwritten=False)
def add_budget(c: BudgetCall) -> Budget:
    """a + alpha*b: ulps of the result, plus the rounding of alpha*b (or of a Python scalar b) before the add."""
    other, alpha = c.a.get("other"), coefficient(c.a.get("alpha"))
    if isinstance(other, torch.Tensor) and alpha == 1:
        return c.ulps(ARITH_ULPS)
    k = 2 * c.u * abs(alpha)
    return with_operand_term(c, ARITH_ULPS, lambda: other, k, "abs")


@register_budget(*overloads("rsub"), family=Family.ELEMENTWISE)
def rsub_budget(c: BudgetCall) -> Budget:
    """other - alpha*self: as add, with the roles of the operands swapped."""
    self_, other, alpha = c.a["self"], c.a.get("other"), coefficient(c.a.get("alpha"))
    return with_operand_term(c, ARITH_ULPS, lambda: 2 * c.u * (magnitude(alpha) * magnitude(self_) + magnitude(other)))


@register_budget(*overloads("addcmul"), family=Family.ELEMENTWISE, reads_overwritten=False)
def addcmul_budget(c: BudgetCall) -> Budget:
    """self + value*t1*t2: the product is rounded (twice, value included) before the add."""
    t1, t2 = c.a["tensor1"], c.a["tensor2"]
    k = 3 * c.u * abs(coefficient(c.a["value"]))
    if _same(t1, t2) and not t1.is_complex():  # Adam's g * g: non-negative, no |.| temporaries
        return with_operand_term(c, ARITH_ULPS, lambda: t1, k, "square")
    return with_operand_term(c, ARITH_ULPS, lambda: t1, k, "mul", t2)


@register_budget(*overloads("addcdiv"), family=Family.ELEMENTWISE, reads_overwritten=False)
def addcdiv_budget(c: BudgetCall) -> Budget:
    """self + value*t1/t2: the quotient is rounded (twice, value included) before the add."""
    a = c.a
    k = 3 * c.u * abs(coefficient(a["value"]))
    return with_operand_term(c, ARITH_ULPS, lambda: a["tensor1"], k, "div", a["tensor2"])


@register_budget(*overloads("lerp"), family=Family.ELEMENTWISE)
def lerp_budget(c: BudgetCall) -> Budget:
    """start + w*(end - start) (or end - (1-w)*(end - start)): the difference and its product are rounded."""
    a = c.a
    w = a["weight"]
    if isinstance(w, torch.Tensor):
        return with_operand_term(
            c, ARITH_ULPS, lambda: 3 * c.u * (w.abs() + (1 - w).abs()) * (a["end"] - a["self"]).abs())
    k = 3 * c.u * (abs(w) + abs(1 - w))
    return with_operand_term(c, ARITH_ULPS, lambda: a["end"], k, "sub", a["self"])


# --- foreach ops: each list element under the rule of the op the name says ---
def foreach_ops(plan: OpPlan) -> bool:
    return foreach_base(plan.func) is not None


@register_budget_predicate(foreach_ops, family=Family.FOREACH)
def foreach_budget(c: BudgetCall) -> Budget:
    """``_foreach_X``: element i of every list argument (tensor or scalar list) goes to X's rule; the budget is
    of X's family where every element's is the same."""
    base = foreach_base(c.func)
    schema = c.func._schema.arguments
    args = [c.a[arg.name] for arg in schema if not arg.kwarg_only]
    # keyword-only arguments (alpha of _foreach_add_.List) go by name: positions would drop them
    base_kw = {a.name for a in base._schema.arguments if a.kwarg_only}
    kwargs = {arg.name: c.a[arg.name] for arg in schema if arg.kwarg_only and arg.name in base_kw}
    n = len(c.outputs)
    subs = []
    for i in range(n):
        elems = [v[i] if isinstance(v, (list, tuple)) and len(v) == n else v for v in args]
        if c.plan.base == "_foreach_norm":  # (self[], ord, dtype) -> linalg_vector_norm(self, ord)
            elems = elems[:2]
        kw = {k: (v[i] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in kwargs.items()}
        subs.append(budget_for(base, elems[: len(base._schema.arguments)], kw, [c.outputs[i]], c.dtype,
                               scratch=c.scratch))
    families = {b.family for b in subs}
    ulps = {b.ulps for b in subs}
    return Budget(families.pop() if len(families) == 1 else c.family, lambda: [b.bound[0] for b in subs],
                  outputs=c.outputs, dtype=c.dtype, is_default=any(b.is_default for b in subs),
                  ulps=ulps.pop() if len(ulps) == 1 else None,
                  scale_sq=lambda: tuple(map(sum, zip(*(b.scales() for b in subs)))),
                  formulas=lambda: [b.divisors[0] for b in subs])
