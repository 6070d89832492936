"""FP16AccumMode: float16 storage with float16 accumulators. sum, mean, cumsum and the matmuls (mm, bmm,
mv, dot, addmm, baddbmm, addmv and their in-place twins) on float16 tensors add their terms into a float16
accumulator rounded after every addition (or every ``block`` terms)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from ...devices import holds_dtype
from ...errors import ShadowOptionError
from ...opsets import MATMULS, Matmul
from ...plan import OpPlan
from ...rules import RuleTable
from ._mode import Emulation, Rule, register
from ._utils import overloads
from .formats import FP16, Rounding, round_f64

TABLE: RuleTable[Rule] = RuleTable("fp16_accum")  # no default: unclaimed ops pass through


@dataclasses.dataclass(frozen=True)
class FP16AccumOptions:
    block: int = 1  # terms summed in float32 before each float16 rounding

    def __post_init__(self):
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ShadowOptionError(f"block={self.block!r}: expected an int >= 1 (terms summed in float32 per "
                                    "float16 rounding)")


def _round16(s: torch.Tensor) -> torch.Tensor:
    return round_f64(s, FP16, Rounding.NEAREST_EVEN)


def _accumulate(term: Callable[[int, int], torch.Tensor], n: int, block: int) -> torch.Tensor:
    """fp16(...fp16(fp16(t_0) + t_1)... + t_last) over the blocks [j, j + block) of n terms.

    ``term`` returns a block's terms summed in float32, or a float16 tensor when the block is one
    float16 value. float16 + float16 is one torch op (computed in float32, then rounded: correctly
    rounded, as double rounding is innocuous for a sum when 24 >= 2 * 11 + 1). Other terms go
    through float64, where an accumulator plus a float32 term is exact, so each step rounds once
    (a float32 -> float16 cast would round twice). Returns float64 holding float16 values."""
    acc = None
    for j in range(0, n, block):
        t = term(j, min(j + block, n))
        if t.dtype is torch.float16:
            acc = t.clone() if acc is None else acc + t
        else:
            t = t.to(torch.float64)
            acc = _round16(t if acc is None else acc + t)
    return acc.to(torch.float64)


def _fp16_only(plan: OpPlan, args: tuple, kwargs: dict, *tensors: Any) -> bool:
    """Emulated only for float16 data with a float16 result (a dtype= argument other than float16, or
    a float32 input, is another device's arithmetic)."""
    return all(isinstance(t, torch.Tensor) and t.dtype is torch.float16 for t in tensors if t is not None) and (
        plan.arg(args, kwargs, "dtype") in (None, torch.float16))


def _matmul16(a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    """a @ b (mm, bmm, mv, dot shapes) with a float16 accumulator along the contraction."""
    a32, b32 = a.float(), b.float()  # exact: float16 -> float32
    k = a.shape[-1]
    if k == 0:
        return torch.matmul(a32, b32).double()
    if b.dim() == 1:
        return _accumulate(lambda j, e: torch.matmul(a32[..., j:e], b32[j:e]), k, block)
    return _accumulate(lambda j, e: torch.matmul(a32[..., j:e], b32[..., j:e, :]), k, block)


def _reduce_last(x: torch.Tensor, dims: Any) -> tuple[torch.Tensor, list[int], int]:
    """x with the reduced dims moved last and flattened: (x2, kept sizes, n reduced)."""
    nd = x.dim()
    red = sorted({d % nd for d in dims}) if dims else list(range(nd))
    keep = [d for d in range(nd) if d not in red]
    n = 1
    for d in red:
        n *= x.shape[d]
    return x.permute(keep + red).reshape([x.shape[d] for d in keep] + [n]), red, n


def _write_back(plan: OpPlan, args: tuple, kwargs: dict, result: torch.Tensor) -> torch.Tensor:
    """Return ``result`` as the op would: written into ``out=`` or ``self`` for those variants."""
    if not plan.writes:
        return result
    dest = plan.writes[0].get(args, kwargs)
    if plan.writes[0].index in plan.out_args and dest.shape != result.shape:
        dest.resize_(result.shape)  # out= semantics: the op resizes its output
    dest.copy_(result)
    return dest


def _fp16_rule(compute: Callable[..., torch.Tensor | None]) -> Rule:
    """Wrap a float16-accumulation computation: it returns the functional result (or None: pass
    through); in-place and out= variants get it written into their destination."""

    @functools.wraps(compute)
    def rule(plan: OpPlan, args: tuple, kwargs: dict, options: FP16AccumOptions) -> Any:
        device = next((t.device for _, t in plan.tensors(args, kwargs)), None)
        if device is None or holds_dtype(device, torch.float64):
            r = compute(plan, args, kwargs, options)
        else:  # a device without float64 (DirectML): the float64 steps on CPU copies, the float16 result back
            host_args, host_kwargs = plan.map_tensors(args, kwargs, lambda t, _: t.to("cpu"))
            r = compute(plan, host_args, host_kwargs, options)
            r = None if r is None else r.to(device)
        return NotImplemented if r is None else _write_back(plan, args, kwargs, r)

    return rule


@TABLE.register(*overloads("sum", skip=("int", "float", "complex", "bool")), *overloads("mean"))
@_fp16_rule
def _fp16_sum(plan: OpPlan, args: tuple, kwargs: dict, options: FP16AccumOptions) -> torch.Tensor | None:
    x = plan.arg(args, kwargs, "self")
    if not _fp16_only(plan, args, kwargs, x):
        return None
    dims = plan.arg(args, kwargs, "dim")
    x2, red, n = _reduce_last(x, [dims] if isinstance(dims, int) else dims)
    if n == 0:
        r = torch.zeros(x2.shape[:-1], dtype=torch.float64)
    elif options.block == 1:
        r = _accumulate(lambda j, e: x2[..., j], n, 1)
    else:
        x32 = x2.float()
        r = _accumulate(lambda j, e: x32[..., j:e].sum(-1), n, options.block)
    if plan.base == "mean":
        r = _round16(r / n)  # one rounding of the float16 quotient (0/0 -> nan, as torch's mean)
    if plan.arg(args, kwargs, "keepdim", False):
        for d in red:
            r = r.unsqueeze(d)
    return r.to(torch.float16)


@TABLE.register(*overloads("cumsum"))
@_fp16_rule
def _fp16_cumsum(plan: OpPlan, args: tuple, kwargs: dict, options: FP16AccumOptions) -> torch.Tensor | None:
    """Each partial sum is a stored float16 output: sequential, rounded at every step (no blocks)."""
    x, dim = plan.arg(args, kwargs, "self"), plan.arg(args, kwargs, "dim")
    if not _fp16_only(plan, args, kwargs, x):
        return None
    if x.dim() == 0 or x.numel() == 0:
        return x.clone()
    xt = x.movedim(dim, -1)
    acc, outs = None, []
    for j in range(xt.shape[-1]):  # float16 + float16 is correctly rounded (see _accumulate)
        acc = xt[..., j].clone() if acc is None else acc + xt[..., j]
        outs.append(acc)
    return torch.stack(outs, -1).movedim(-1, dim)


def _fp16_matmul(plan: OpPlan, args: tuple, kwargs: dict, options: FP16AccumOptions,
                 roles: Matmul) -> torch.Tensor | None:
    a, b = plan.arg(args, kwargs, roles.a), plan.arg(args, kwargs, roles.b)
    bias = plan.arg(args, kwargs, roles.bias) if roles.bias else None
    if not _fp16_only(plan, args, kwargs, a, b, bias):
        return None
    r = _matmul16(a, b, options.block)
    if bias is not None:
        # the epilogue: beta * C + alpha * acc, computed wide and rounded once to float16
        beta, alpha = plan.arg(args, kwargs, "beta"), plan.arg(args, kwargs, "alpha")
        r = _round16(alpha * r + (beta * bias.double() if beta != 0 else 0))
    return r.to(torch.float16)


for _name in ("mm", "bmm", "mv", "dot", "addmm", "baddbmm", "addmv"):
    TABLE.register(*overloads(_name))(_fp16_rule(functools.partial(_fp16_matmul, roles=MATMULS[_name])))


@register("fp16_accum", TABLE, FP16AccumOptions)
class FP16AccumMode(Emulation):
    """float16 sums, means, cumsums and matmuls accumulated in float16.

    >>> with FP16AccumMode():
    ...     torch.ones(4096, dtype=torch.float16).sum()   # 2048: 2048 + 1 rounds back to 2048  # doctest: +SKIP
    """

    def __init__(self, *, block: int = 1):  # terms summed in float32 before each float16 rounding
        super().__init__(self.name, block=block)
