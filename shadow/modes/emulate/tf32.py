"""TF32Mode: float32 matmul and convolution with operands rounded to TF32 (10 stored mantissa bits, 8
exponent bits), products accumulated in float32, as tensor cores do. The accumulator input (addmm's
self), bias, alpha and beta stay float32, as in cuBLAS/cuDNN epilogues. Which rounding rule real
hardware uses: docs/hardware-numerics.md."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ...opsets import CONVOLUTIONS, MATMULS, Matmul
from ...plan import OpPlan
from ...rules import RuleTable
from ._mode import AuditFormat, Emulation, Rule, register
from ._utils import overloads
from .formats import TF32, Rounding, to_tf32

aten = torch.ops.aten

TABLE: RuleTable[Rule] = RuleTable("tf32")  # no default: unclaimed ops pass through


@dataclasses.dataclass(frozen=True)
class TF32Options:
    rounding: Rounding = Rounding.NEAREST_EVEN  # of the operands: "rne" (cuBLAS, measured), "rna", "rz"

    def __post_init__(self):
        object.__setattr__(self, "rounding", Rounding.parse(self.rounding))


# GEMMs and convolutions; not the matrix-vector products (mv, addmv, dot), nor composites (matmul, linear)
# whose GEMMs are claimed anyway
_CLAIMED: dict[str, Matmul] = {
    **{name: MATMULS[name] for name in ("mm", "bmm", "addmm", "_addmm_activation", "baddbmm", "addbmm")},
    **CONVOLUTIONS,
}
_TF32_DTYPES = frozenset({torch.float32, torch.complex64})  # TF32 applies to float32 data only


def _operand(t: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    return to_tf32(t, rounding) if t.dtype in _TF32_DTYPES else t


def _tf32_factors(plan: OpPlan, args: tuple, kwargs: dict, options: TF32Options, roles: Matmul) -> Any:
    """Round the two factors; the op itself then multiplies exactly and accumulates in float32 (and
    writes in-place / out= results where it always does)."""
    factors = (roles.a, roles.b)
    args, kwargs = plan.map_tensors(args, kwargs, lambda t, spec: _operand(t, options.rounding)
                                    if spec.name in factors else t)
    return plan.func(*args, **kwargs)


for _name, _roles in _CLAIMED.items():
    TABLE.register(*overloads(_name))(functools.partial(_tf32_factors, roles=_roles))


@TABLE.register(aten.convolution_backward.default)
def _tf32_convolution_backward(plan: OpPlan, args: tuple, kwargs: dict, options: TF32Options) -> Any:
    """grad_input (grad_output x weight) and grad_weight (input x grad_output) are TF32 convolutions;
    grad_bias is a float32 sum of the unrounded grad_output."""
    mask = list(plan.arg(args, kwargs, "output_mask"))
    rounded = {name: _operand(plan.arg(args, kwargs, name), options.rounding)
               for name in ("grad_output", "input", "weight")}
    new_args, new_kwargs = plan.replace(args, kwargs, **rounded, output_mask=[mask[0], mask[1], False])
    grad_input, grad_weight, _ = plan.func(*new_args, **new_kwargs)
    grad_bias = None
    if mask[2]:
        new_args, new_kwargs = plan.replace(args, kwargs, output_mask=[False, False, True])
        grad_bias = plan.func(*new_args, **new_kwargs)[2]
    return grad_input, grad_weight, grad_bias


@register("tf32", TABLE, TF32Options, audit=AuditFormat(TF32))
class TF32Mode(Emulation):
    """float32 matmul and convolution with TF32 operands (10 mantissa bits), float32 accumulation.

    >>> with TF32Mode(), ShadowMode() as sm:      # the emulation outside   # doctest: +SKIP
    ...     y = a @ b
    """

    def __init__(self, *, rounding: str = "rne"):  # "rne" (cuBLAS), "rna" (CUTLASS, cvt.rna), "rz" (raw mma)
        super().__init__(self.name, rounding=rounding)
