"""Keeping the inputs of the worst calls over budget, for ``shadow repro`` (docs/repro.md): decided after judging,
so a call within its budget costs one test. Per op class the worst ``PER_CLASS`` calls are kept, within the byte cap
(``ShadowMode(max_repro_bytes=)``), in a ``shadow.sidecar.KeptInputs`` the report holds; report.meta["repro"] says
what was kept and what was left out, and why."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..mirror import CPU
from ..plan import ArgSpec, OpPlan
from ..records import Record, op_class
from ..reproscript import checksum, is_plain
from ..sidecar import PER_CLASS, KeptCall, KeptInputs, TensorSlot, encode
from .values import Outputs, Prepared

if TYPE_CHECKING:
    from .core import Engine


class NotKeepable(Exception):
    """Why a call's inputs cannot be kept (the reason report.meta["repro"] gives)."""


class Keeper:
    """The engine's side of keeping: which calls, and their inputs as the device had them before the call."""

    def __init__(self, kept: KeptInputs, meta: dict):
        self.kept, self.meta = kept, meta
        kept.numerics = meta.get("numerics") or {}

    def entered(self) -> None:
        """ShadowMode is entered: the emulations and fault modes of shadow's (entered outside it) the device
        computes under, outermost first, each as ``recorded`` has it."""
        self.kept.emulation = [recorded(m) for m in _get_current_dispatch_mode_stack()
                               if type(m).__module__.startswith("shadow.modes.")]

    def consider(self, engine: Engine, prepared: Prepared, rec: Record, outputs: Outputs, args: tuple,
                 kwargs: dict) -> None:
        """Keep the inputs of call ``rec`` (over budget) if it is among the worst of its op class, within the cap."""
        kept, op, used = self.kept, op_class(rec.op), rec.budget.used
        same = [c for c in kept.calls.values() if op_class(c.op) == op]
        worst = f"not among the worst {PER_CLASS} of its op class"
        if len(same) >= PER_CLASS and used <= min(c.budget_used for c in same):
            return self._left_out(op, worst)
        try:
            call = capture(engine, prepared, rec, outputs, args, kwargs, kept.cap)
        except NotKeepable as exc:
            return self._left_out(op, str(exc))
        except Exception as exc:  # never raise into the user's program: a bug of shadow's, counted
            engine.report.internal_error(f"keeping the inputs of {rec.op}",
                                         f"internal error: {type(exc).__name__}: {exc}"[:240])
            return self._left_out(op, "an internal error of shadow's (see the coverage)")
        cap = f"left out by the cap of max_repro_bytes={kept.cap}"
        if len(same) >= PER_CLASS:
            least = min(same, key=lambda c: c.budget_used)
            del kept.calls[least.index]
            kept.leave_out(op, worst)
        while kept.calls and kept.nbytes + call.nbytes > kept.cap:
            least = min(kept.calls.values(), key=lambda c: c.budget_used)
            if least.budget_used >= used:
                return self._left_out(op, cap)
            del kept.calls[least.index]
            kept.leave_out(op_class(least.op), cap)
        kept.calls[rec.index] = call
        self.meta["repro"] = kept.summary()

    def _left_out(self, op: str, why: str) -> None:
        self.kept.leave_out(op, why)
        self.meta["repro"] = self.kept.summary()


def recorded(mode: Any) -> dict:
    """A device-side mode as the sidecar keeps it: its repr and its ``spec()`` (how repro.py builds it again where
    shadow is installed: plain values only), or why it cannot be built again ("reason")."""
    entry = {"repr": repr(mode)}
    if not callable(getattr(mode, "spec", None)):
        return {**entry, "reason": f"shadow does not re-create a {type(mode).__name__}"}
    try:
        spec = mode.spec()
    except ValueError as exc:
        return {**entry, "reason": str(exc)}
    if not is_plain(spec["kwargs"]):
        return {**entry, "reason": "its arguments are not plain values"}
    return {**entry, **spec}


def capture(engine: Engine, prepared: Prepared, rec: Record, outputs: Outputs, args: tuple, kwargs: dict,
            cap: int) -> KeptCall:
    """The call's inputs as the device had them before it, copied to the CPU in their own dtypes: an argument the
    op does not write from the device (now, after the op, unchanged; read over once where its shadow lives
    elsewhere, ``Engine.near``), one it writes from preparation's copy of its value before the op (``Prepared.pre``,
    upcast exactly: back to its dtype exactly), an out= buffer not at all (the op never reads it)."""
    plan = prepared.plan
    if not isinstance(plan.func, torch._ops.OpOverload):
        raise NotKeepable("a compiled graph's call (no aten op to run)")
    written = {t.untyped_storage().data_ptr() for _, t in plan.tensors(args, kwargs, plan.writes)}
    before = [t for _, t in plan.tensors(*prepared.pre)] if prepared.pre is not None else []
    reference = [t for _, t in plan.tensors(*prepared.reference)]
    if _input_bytes(plan, args, kwargs) > cap:
        raise NotKeepable(f"left out by the cap of max_repro_bytes={cap}")
    tensors: list[dict] = []
    seen: dict[int, int] = {}
    writes: list[int] = []
    position = 0

    def keep(t: torch.Tensor, spec: ArgSpec) -> TensorSlot:
        nonlocal position
        k, position = position, position + 1
        if spec.index in plan.write_args:
            writes.append(seen.get(id(t), len(tensors)))
        if id(t) in seen:  # passed twice: one tensor
            return TensorSlot(seen[id(t)])
        if t.is_nested or t.layout != torch.strided:
            raise NotKeepable(f"a {'nested' if t.is_nested else str(t.layout)} input")
        if spec.index in plan.out_args:
            values = None
        elif t._is_zerotensor():
            values = torch.zeros(t.shape, dtype=t.dtype, device=CPU)  # kept inputs live on the CPU
        elif t.untyped_storage().data_ptr() in written:  # overwritten by the op: its value before it
            if not before or before[k] is reference[k]:
                raise NotKeepable("an in-place call whose inputs before it were not kept (its budget does not "
                                  "read them)")
            values = torch.empty(t.shape, dtype=t.dtype, device=CPU).copy_(before[k])
        else:
            values = torch.empty(t.shape, dtype=t.dtype, device=CPU).copy_(engine.near(t))
        seen[id(t)] = len(tensors)
        tensors.append({"name": spec.name, "values": values, "size": list(t.size()), "stride": list(t.stride()),
                        "offset": t.storage_offset(), "dtype": str(t.dtype).removeprefix("torch.")})
        return TensorSlot(seen[id(t)])

    a, kw = plan.map_tensors(args, kwargs, keep)
    try:
        a, kw = encode(a), encode(kw)
    except TypeError as exc:
        raise NotKeepable(str(exc)) from None
    checksums = {o.slot: checksum(engine.near(o.device)) for o in outputs.items
                 if isinstance(o.device, torch.Tensor) and o.slot is not None and not o.device.is_nested}
    device = prepared.inputs[0].device if prepared.inputs else next(
        (o.device.device for o in outputs.items if isinstance(o.device, torch.Tensor)), CPU)
    return KeptCall(rec.index, rec.op, str(device), str(outputs.dtype).removeprefix("torch."), tensors, a, kw,
                    writes, checksums, rec.to_dict())


def _input_bytes(plan: OpPlan, args: tuple, kwargs: dict) -> int:
    return sum(t.numel() * t.element_size() for _, t in plan.tensors(args, kwargs))


def keepable(engine: Engine, plan: OpPlan, args: tuple, kwargs: dict) -> bool:
    """Whether the keeper could keep this call's inputs, were it over budget: its tensors within the cap of
    ``max_repro_bytes`` (a call of more is never kept, so nothing need be copied for it before the op)."""
    return engine.keeper is not None and _input_bytes(plan, args, kwargs) <= engine.keeper.kept.cap


def keeper_of(options: Any, meta: dict) -> Keeper | None:
    """The keeper of a run whose options cap the kept inputs at ``options.max_repro_bytes`` (0: none)."""
    cap = options.max_repro_bytes
    return Keeper(KeptInputs(cap), meta) if cap else None
