"""FTZMode: flush-to-zero. Every op that computes values sees subnormal inputs as zero and returns
subnormal results as zero, the sign kept (-1e-40 becomes -0.0); data movement and partial writes pass
through (``_utils.PASS_THROUGH``)."""

from __future__ import annotations

import functools

from ...rules import RuleTable
from ._mode import Emulation, Rule, register
from ._utils import computes, transform_io
from .formats import flush_subnormals

TABLE: RuleTable[Rule] = RuleTable("ftz")  # no default: unclaimed ops pass through
TABLE.register_predicate(computes)(functools.partial(transform_io, flush_subnormals))


@register("ftz", TABLE)
class FTZMode(Emulation):
    """Flush-to-zero: subnormal inputs and outputs of every floating op become signed zeros.

    >>> with FTZMode():
    ...     torch.tensor([1e-40]) * 1.0     # tensor([0.])   # doctest: +SKIP
    """

    def __init__(self):
        super().__init__(self.name)
