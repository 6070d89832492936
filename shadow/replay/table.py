"""The replay table: how an aten op is recomputed on float64 CPU shadows.

A rule is a pure function of a ``Replay`` (the replay arguments, already float64 CPU shadows, and for
random ops the device's outputs) and returns ``(Kind, outputs)``, or ``NotImplemented`` to fall through.
Lookup (``shadow.rules.RuleTable``): the exact op, then predicates on its plan, then ``default_rule``:
the op's own CPU kernel, else its decomposition.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from ..errors import Unsupported
from ..plan import OpPlan
from ..records import Kind
from ..rules import RuleTable


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
        return Kind.REPLAYED, _call(r)
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


def _call(r: Replay) -> Any:
    """``func(*args, **kwargs)``; a large CPU result written by the op's out= overload into memory from
    ``r.scratch`` (a fresh result of tens of MB costs more in page faults than most kernels take to fill it:
    ``shadow.scratch``), where the op writes no argument, returns one tensor and has an out= overload with a CPU
    kernel of its own. The result is the one the kernel would allocate: its shape, strides and dtype are read from
    the op's meta kernel."""
    plan, d = r.plan, r.device_out
    if r.scratch is None or plan.writes or len(plan.returns) != 1 or not isinstance(d, torch.Tensor) \
            or not r.scratch.pools(d.numel() * 8) or _out_overload(plan.func) is None \
            or any(t.device.type != "cpu" for _, t in plan.tensors(r.args, r.kwargs)):
        return plan.func(*r.args, **r.kwargs)
    try:
        a, kw = plan.map_tensors(r.args, r.kwargs, lambda t, _: torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device="meta"))
        meta = plan.func(*a, **kw)
        buffer = r.scratch.empty_strided(meta.shape, meta.stride(), meta.dtype)
        return _out_overload(plan.func)(*r.args, **r.kwargs, out=buffer)
    except Exception:  # noqa: BLE001 -- no meta kernel, or an out= kernel that refuses: the kernel allocates
        return plan.func(*r.args, **r.kwargs)


@functools.cache
def _out_overload(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of ``func`` that takes its arguments and writes its one result into ``out=``, where it has a
    CPU kernel of its own: torchgen's generated out= kernels (CompositeExplicitAutograd) allocate the result and
    copy it, which would add a copy and save nothing."""
    schema = func._schema
    names = [a.name for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        o = getattr(packet, name)
        args = o._schema.arguments
        if [a.name for a in args] == names + ["out"] and args[-1].is_out \
                and torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), "CPU"):
            return o
    return None


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


REPLAY: RuleTable[ReplayRule] = RuleTable("replay", default=default_rule)
register_rule = REPLAY.register
register_predicate = REPLAY.register_predicate
