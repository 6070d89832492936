"""BF16Mode: float32 storage, bfloat16 arithmetic. Every op that computes values sees its floating tensor
inputs rounded to bfloat16 and returns its floating outputs rounded to bfloat16, stored back in the
original dtype; data movement and partial writes pass through (``_utils.PASS_THROUGH``)."""

from __future__ import annotations

import functools

import torch

from ...rules import RuleTable
from ._mode import Emulation, Rule, register
from ._utils import computes, transform_io
from .formats import BF16, round_to

TABLE: RuleTable[Rule] = RuleTable("bf16")  # no default: unclaimed ops pass through


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.bfloat16 else round_to(t, BF16)


TABLE.register_predicate(computes)(functools.partial(transform_io, _to_bf16))


@register("bf16", TABLE)
class BF16Mode(Emulation):
    """float32 storage, bfloat16 arithmetic: floating inputs and outputs of every op rounded to bfloat16.

    >>> with BF16Mode():
    ...     y = torch.exp(x)       # == torch.exp(x.bfloat16()).float()   # doctest: +SKIP
    """

    def __init__(self):
        super().__init__(self.name)
