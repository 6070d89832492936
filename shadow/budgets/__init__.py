"""Error budgets: an a-priori bound on the local error a *correct* implementation of an op may make.

A budget answers "is this kernel broken, or is this normal rounding?". For one op call it is a bound per
output element, a pure function of the op's inputs (the device's own, upcast exactly to float64), its
float64 reference outputs, its shapes and the unit roundoff u of the device dtype (``ua``: of the dtype
torch accumulates in, float32 for the halves). Families, one module each:

- ``elementwise``: a few ulps of the result (movement 1, arithmetic 2, transcendental 4, special
  functions 64), plus an operand term where PyTorch's formula cancels;
- ``reductions``: gamma_n(ua) * sum|terms| plus one rounding at u (sums, var/std, norms, softmax);
  short sums (pooling, scatter, interpolation) at u;
- ``linalg``: gamma_K(ua) * |A||B| for matmuls and convolutions, FFTs, and ``unbounded`` (inf) for
  solves and factorizations; ``normalization``, ``losses``, ``attention``, ``optimizer`` (add with
  alpha, addcmul, addcdiv, lerp, foreach, the fused optimizers); ``recurrent``: the fused LSTM and GRU cells and
  oneDNN's LSTM layers;
- ``histograms``: histc, histogram, histogramdd, bincount: the weight of the elements that may land in a bin but need not
  (an edge flip), plus the weight sums' rounding; density through the total and the widths;
- ``sampling``: grid_sample, bounded by how far its rounded sample coordinates move the weights or the pick;
- ``transformer``: nn.TransformerEncoderLayer's fused kernel, composed to first order from its stages' budgets;
- ``default``: an op no rule knows: ``DEFAULT_ULPS`` ulps of the result, ``is_default=True``.

Rules live in one table (``BUDGETS``, lookup: exact op, predicates on the op plan, default) filled by
:func:`register_budget`. The derivations, the error model of :func:`effective_bits` and the measured
cost: docs/budgets.md.

>>> import torch
>>> a = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]], dtype=torch.float64)
>>> b = budget_for(torch.ops.aten.mm.default, (a, a.T), {}, [a @ a.T], torch.float32)
>>> b.family, b.is_default
('matmul', False)
"""

from . import (attention, elementwise, histograms, linalg, losses, normalization, optimizer,  # noqa: F401 (register)
               recurrent, reductions, sampling, transformer)
from .core import (BUDGETS, DEFAULT_ULPS, Budget, BudgetCall, InUlps, budget_for, builds_early, fixed_budget,
                   reads_overwritten, register_budget, register_budget_predicate)
from .optimizer import left_as_read
from .units import KAPPA, effective_bits, gamma, unit_roundoff

__all__ = [
    "BUDGETS",
    "DEFAULT_ULPS",
    "KAPPA",
    "Budget",
    "BudgetCall",
    "InUlps",
    "budget_for",
    "builds_early",
    "effective_bits",
    "fixed_budget",
    "gamma",
    "left_as_read",
    "reads_overwritten",
    "register_budget",
    "register_budget_predicate",
    "unit_roundoff",
]
