"""High-precision references: one output element of an aten op, recomputed exactly or with mpmath.

Spot checks validate the float64 reference itself: float64 has only ~29 bits of headroom over float32,
and under cancellation (a sum whose terms cancel, a variance with a large mean, ``gelu`` far in its
negative tail) the float64 replay can be wrong by more than the device. A reference rule computes ONE
output element from the op's inputs, far more accurately than float64:

>>> import torch
>>> x = torch.tensor([1e16, 1.0, -1e16], dtype=torch.float64)
>>> float(reference(torch.ops.aten.sum.default, (x,), {}, ()).value)      # float64's own sum gives 0.0
1.0

Rules sit in one table (``REFERENCES``) filled by ``@register_reference(*ops, terms=..., per_term=...)``
with the cost of checking an element; ``reference_for(func)`` gives None for an op without a rule: it is
not spot-checkable, never guessed, and a rule that meets arguments it does not cover raises
``NoReference``. Sums and dot products are exact (``shadow.references.exact``), the rest runs in mpmath
at ``bits + GUARD_BITS``: see docs/references.md. For in-place and ``out=`` overloads, pass the inputs
as they were before the call. Modules: ``exact`` (arithmetic), ``_table`` (the table, ``Call``, cost),
and the rules by family: ``elementwise``, ``linalg``, ``reductions`` (softmax too), ``normalization``,
``losses``.
"""

from ..errors import NoReference
from . import elementwise, linalg, losses, normalization, reductions  # the rule modules register on import
from ._table import REFERENCES, Call, Cost, Reference, estimate_cost_us, reference, reference_for, register_reference
from ._table import READ_WHOLE  # noqa: F401  (how spot checks read a tensor: shadow.spot.verdict)
from .exact import DEFAULT_BITS, GUARD_BITS, Exact, exact_dot, exact_sum, to_float64, working_precision

__all__ = [
    "DEFAULT_BITS",
    "GUARD_BITS",
    "REFERENCES",
    "Call",
    "Cost",
    "Exact",
    "NoReference",
    "Reference",
    "estimate_cost_us",
    "exact_dot",
    "exact_sum",
    "reference",
    "reference_for",
    "register_reference",
    "to_float64",
    "working_precision",
]
