"""The replay table: how an aten op is recomputed on float64 CPU shadows.

A rule is a pure function of a ``Replay`` (the replay arguments, already float64 CPU shadows, and for
random ops the device's outputs) and returns ``(Kind, outputs)``, or ``NotImplemented`` to fall through.
Lookup (``shadow.rules.RuleTable``): the exact op, then predicates on its plan, then ``default_rule``:
the op's own CPU kernel, else its decomposition. ``WRITERS``, a second table, says how an op writes a large
result into reused memory (``pooled_call``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from ..errors import Unsupported
from ..plan import OpPlan
from ..records import Kind
from ..rules import RuleTable, run_chain


@dataclasses.dataclass(slots=True)
class Replay:
    """A rule's normalized input."""

    plan: OpPlan
    args: list
    kwargs: dict
    device_out: Any  # the device's outputs, for rules that adopt a random part
    local: Any = None  # the device's own inputs upcast (an engine ``Args``; None: the shadow args are the device's)
    scratch: Any = None  # a shadow.scratch.Scratch for a large CPU result (None: the kernel allocates it)

    def arg(self, name: str, default: Any = None) -> Any:
        return self.plan.arg(self.args, self.kwargs, name, default)


ReplayRule = Callable[[Replay], Any]


@dataclasses.dataclass(slots=True)
class Deferred:
    """A rule's outputs whose device values are written asynchronously (collectives): the engine judges and
    commits the call when a later op first touches one of its outputs (the user's program has waited for them
    by then), never before. The rule computed both references at the call, in program order: ``shadow`` its
    outputs as a rule returns them, ``local`` the (args, kwargs) of the local reference after its replay
    (in-place ops write there), ``local_out`` its outputs; ``meta`` goes to the report's meta."""

    shadow: Any
    local: tuple[list, dict]
    local_out: Any = None
    meta: dict = dataclasses.field(default_factory=dict)


def _decomposition(func: torch._ops.OpOverload) -> Callable | None:
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)


def default_rule(r: Replay) -> tuple[Kind, Any]:
    """The op's own CPU kernel in float64, else its decomposition; ``Unsupported`` with both reasons."""
    func = r.plan.func
    try:
        d = r.device_out
        return Kind.REPLAYED, pooled_call(r.plan, r.args, r.kwargs, r.scratch,
                                          d.numel() * 8 if isinstance(d, torch.Tensor) else 0)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError) as exc:
        first = exc
    decomp = _decomposition(func)
    try:
        if decomp is not None:
            return Kind.DECOMPOSED, decomp(*r.args, **r.kwargs)
        out = func.decompose(*r.args, **r.kwargs)
        if out is not NotImplemented:
            return Kind.DECOMPOSED, out
    except Exception as exc:  # the decomposition failed too: report both reasons
        raise Unsupported(r.plan.name, f"{_short(first)}; decomposition: {_short(exc)}") from exc
    raise Unsupported(r.plan.name, f"{_short(first)}; no decomposition")


def pooled_call(plan: OpPlan, args: list, kwargs: dict, scratch: Any, nbytes: int) -> Any:
    """``plan.func(*args, **kwargs)``; a large CPU result (``nbytes``: its size in float64) written into memory
    from ``scratch`` (a ``shadow.scratch.Scratch``; a fresh result of tens of MB costs more in page faults than
    most kernels take to fill it), where the op writes no argument, returns one tensor and has a rule in
    ``WRITERS``. The result is the one the kernel would allocate: its shape, strides and dtype are read from
    the op's meta kernel. Replays (``default_rule``) and the bounds that run the op on magnitudes call it."""
    chain = () if scratch is None or nbytes < scratch.smallest or plan.writes or len(plan.returns) != 1 \
        else WRITERS.chain(plan.func)
    if not chain or any(not t.is_cpu for _, t in plan.tensors(args, kwargs)):
        return plan.call(*args, **kwargs)
    try:
        a, kw = plan.map_tensors(args, kwargs, lambda t, _: torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device="meta"))
        meta = plan.func(*a, **kw)
        out = run_chain(chain, plan, scratch.empty_strided(meta.shape, meta.stride(), meta.dtype), args, kwargs)
    except Exception:  # noqa: BLE001 -- no meta kernel, or a writer that refuses: the kernel allocates
        out = NotImplemented
    return plan.call(*args, **kwargs) if out is NotImplemented else out


WriteRule = Callable[[OpPlan, torch.Tensor, list, dict], Any]  # (plan, out, args, kwargs) -> out, or NotImplemented
# how an op writes its one result into given memory, bit for bit as its kernel allocates it (``pooled_call``)
WRITERS: RuleTable[WriteRule] = RuleTable("writer")  # no default: an op without a rule allocates


@functools.cache
def _out_overload(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of ``func`` that takes its arguments and writes its one result into an out= argument (``out``;
    ``grad_input`` for most backward ops), where it has a CPU kernel of its own: torchgen's generated out= kernels
    (CompositeExplicitAutograd) allocate the result and copy it, which would add a copy and save nothing."""
    schema = func._schema
    names = [a.name for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        o = getattr(packet, name)
        args = o._schema.arguments
        if [a.name for a in args[:-1]] == names and args[-1].is_out \
                and torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), "CPU"):
            return o
    return None


@WRITERS.register_predicate(lambda plan: _out_overload(plan.func) is not None)
def write_through_out_overload(plan: OpPlan, out: torch.Tensor, args: list, kwargs: dict) -> Any:
    o = _out_overload(plan.func)
    return o(*args, **kwargs, **{o._schema.arguments[-1].name: out})


@WRITERS.register(torch.ops.aten.embedding_dense_backward.default)
def write_embedding_dense_backward(plan: OpPlan, out: torch.Tensor, args: list, kwargs: dict) -> Any:
    """embedding_dense_backward's CPU kernel (ATen's Embedding.cpp): zeros, then each index's gradient row added
    to its row in index order, the padding row left zero; the same bits. Its out= overload is torchgen's, and the
    LM-shaped benchmark's embedding gradient (309 MB in float64) is replayed twice and bounded once per step.
    scale_grad_by_freq is left to the kernel."""
    if plan.arg(args, kwargs, "scale_grad_by_freq"):
        return NotImplemented
    grad, indices = plan.arg(args, kwargs, "grad_output"), plan.arg(args, kwargs, "indices")
    padding_idx, num_weights = plan.arg(args, kwargs, "padding_idx"), plan.arg(args, kwargs, "num_weights")
    out.zero_().index_add_(0, indices.reshape(-1), grad.reshape(-1, out.shape[-1]))
    if 0 <= padding_idx < num_weights:
        out[padding_idx].zero_()
    return out


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


REPLAY: RuleTable[ReplayRule] = RuleTable("replay", default=default_rule)
register_rule = REPLAY.register
register_predicate = REPLAY.register_predicate
