"""FP16Mode: float32 storage, float16 arithmetic. Every op that computes values sees its floating tensor
inputs rounded to float16 and returns its floating outputs rounded to float16 (values beyond 65504 become
infinite, tiny ones subnormal or zero, as float16 hardware gives them), stored back in the original dtype;
data movement and partial writes pass through (``_utils.PASS_THROUGH``)."""

from __future__ import annotations

from ...rules import RuleTable
from ._mode import AuditFormat, Emulation, Rule, register
from ._utils import rounding_table
from .formats import FP16

TABLE: RuleTable[Rule] = rounding_table("fp16", FP16)


@register("fp16", TABLE, audit=AuditFormat(FP16, held=True))
class FP16Mode(Emulation):
    """float32 storage, float16 arithmetic: floating inputs and outputs of every op rounded to float16.

    >>> with FP16Mode():
    ...     y = torch.exp(x)       # == torch.exp(x.half()).float(): inf above 65504   # doctest: +SKIP
    """

    def __init__(self):
        super().__init__(self.name)
