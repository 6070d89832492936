"""BF16Mode: float32 storage, bfloat16 arithmetic. Every op that computes values sees its floating tensor
inputs rounded to bfloat16 and returns its floating outputs rounded to bfloat16, stored back in the
original dtype; data movement and partial writes pass through (``_utils.PASS_THROUGH``)."""

from __future__ import annotations

from ...rules import RuleTable
from ._mode import AuditFormat, Emulation, Rule, register
from ._utils import rounding_table
from .formats import BF16

TABLE: RuleTable[Rule] = rounding_table("bf16", BF16)


@register("bf16", TABLE, audit=AuditFormat(BF16, held=True))
class BF16Mode(Emulation):
    """float32 storage, bfloat16 arithmetic: floating inputs and outputs of every op rounded to bfloat16.

    >>> with BF16Mode():
    ...     y = torch.exp(x)       # == torch.exp(x.bfloat16()).float()   # doctest: +SKIP
    """

    def __init__(self):
        super().__init__(self.name)
