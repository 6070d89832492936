"""Preparation, before the device runs an op: the shadow inputs, the device's own inputs upcast (for a large call
judged in pieces, those it writes as they are, in their dtypes: ``shadow.engine.pieces``), the inputs as they were
before an in-place op (or, for a budget that reads only them, the budget itself: ``shadow.budgets.builds_early``),
and the CPU copies of ``compare_cpu`` (one ``Prepared``). Views only get their input storages' shadows (``see``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import ShadowMemoryError, Unsupported
from ..mirror import SHADOW_DTYPES, Placement
from ..plan import ArgSpec, OpPlan, flat_returns
from ..records import Event
from .budget import built_early, pre_inputs
from .keep import keepable
from .pieces import before_values, wants_pieces
from .values import Args, Prepared

if TYPE_CHECKING:
    from .core import Engine, Route

class NoValues(Exception):
    """The call runs on meta tensors: shapes only, no values to shadow."""


def prepare(engine: Engine, route: Route, args: tuple, kwargs: dict) -> Prepared:
    """Everything the replays, the budget, the spot check and ``compare_cpu`` read of the call's inputs, built before
    the device op runs (it may write them)."""
    plan, options, place = route.plan, engine.options, engine.mirror.place
    cap = options.max_shadow_bytes
    if cap is not None:
        engine.trim_scratch()
    inputs = InputShadows(engine, plan)
    try:
        shadow = Args(*plan.map_tensors(args, kwargs, inputs))
    finally:  # an argument shadow cannot read (sparse) still leaves the writes before it noted
        inputs.note_writes()
    if plan.remap_args:
        remap_args(plan, place, shadow)
    dtype = inputs.tensors[0].dtype if inputs.tensors else None
    # float64 devices have no headroom over the float64 reference: nothing to validate; the elements of nested
    # inputs have no indices a reference could read
    spot = engine.spotting and dtype is not None and dtype != torch.float64 and not inputs.nested \
        and engine.spot.wants(plan.name)
    # a floating result of no floating input (a factory op, an integer division) is held to its budget too: the
    # judge asks for it only where an output is floating
    budget = options.budgets and options.local
    local = before = None
    if options.local and not inputs.exact:
        if route.pieces and budget and not spot and wants_pieces(engine, plan, args, kwargs):
            before = before_values(engine, plan, args, kwargs)
        else:
            local = Args(*plan.map_tensors(args, kwargs, Upcasts(engine, inputs.tensors)))
            if plan.remap_args:
                remap_args(plan, place, local)
    if plan.writes and engine.copies:  # the op writes these: copies read over before it are out of date
        engine.copies.drop(plan.tensors(args, kwargs, plan.writes))
    fixed = route.fixed if budget else None
    pre = early = None
    if before is None and (spot or (budget and fixed is None)):
        reference = local if local is not None else shadow
        if not spot and route.early and not keepable(engine, plan, args, kwargs):
            early = (built_early(engine, plan, reference, args, kwargs, inputs.tensors),)
        else:
            pre = pre_inputs(engine, plan, reference, spot)
    if cap is not None and engine.mirror.held > cap:
        raise ShadowMemoryError(
            f"shadow holds {engine.mirror.held} bytes of float64 shadows at {plan.name} (call {engine.index}), "
            f"over max_shadow_bytes={cap}: raise max_shadow_bytes, or shadow part of the model with "
            "ShadowMode(scope=[module, ...]) (those modules' calls, their backward and their parameters' "
            "optimizer calls)")
    cpu = None
    if options.compare_cpu and options.local and dtype is not None:
        a, kw = plan.map_tensors(args, kwargs, lambda t, _: t.detach().to("cpu", copy=True))  # the kernel may write
        for spec in plan.remap_args:
            if isinstance(spec.get(a, kw), torch.device):
                spec.put(a, kw, torch.device("cpu"))
        cpu = Args(a, kw)
    return Prepared(plan, route.chain, shadow, local, pre, cpu, inputs.exact, inputs.nonfinite, inputs.drift,
                    inputs.tensors, inputs.storages, spot, budget, fixed, route.direct, early, before)


class InputShadows:
    """The shadows of one call's tensor arguments (``plan.map_tensors``' function), and what they say of the call:
    whether every one is exact, holds a NaN or an infinity, the largest drift, whether one is nested. Declared
    writes are noted after every argument's version check (``note_writes``): the counter moves only after the op
    returns, so a check after the note (``t.sub_(t)`` reads ``t`` again as ``other``) would rebase on the noted
    write and take the counter's move for one shadow did not see."""

    __slots__ = ("engine", "plan", "exact", "nonfinite", "drift", "tensors", "storages", "read", "nested",
                 "written")

    def __init__(self, engine: Engine, plan: OpPlan):
        self.engine, self.plan = engine, plan
        self.exact = True  # every shadow input equals the device's
        self.nonfinite = False
        self.drift = 0.0
        self.tensors: list[torch.Tensor] = []  # the floating device tensors read
        self.storages: set[int] = set()  # their shadows' storages
        # a tensor read twice (mha(x, x, x)) has one shadow: kernels test identity
        self.read: dict[int, torch.Tensor] = {}
        self.nested = False
        self.written: list = []  # the entries of the arguments the op declares it writes

    def __call__(self, t: torch.Tensor, spec: ArgSpec) -> torch.Tensor:
        if spec.write:
            return self.shadow(t, True, spec.index in self.plan.declared_writes)
        v = self.read.get(id(t))
        if v is None:
            v = self.read[id(t)] = self.shadow(t, False, False)
        return v

    def shadow(self, t: torch.Tensor, write: bool, declared: bool) -> torch.Tensor:
        """The shadow of argument ``t`` (``write``: the op writes it; ``declared``: its version counter moves)."""
        if t.is_meta:
            raise NoValues
        if t.layout != torch.strided:  # sparse (COO, CSR...) and mkldnn tensors have no strided storage to mirror
            raise Unsupported(self.plan.name, f"{t.layout} argument: shadow mirrors strided tensors only")
        engine = self.engine
        mirror = engine.mirror
        shadow_dtype = mirror.shadow_dtype(t.dtype)
        if shadow_dtype is None:  # discrete, following the device: its values, never written back
            device = t.device
            if mirror.place(device) != device:  # read over once per storage version (a kept copy is never written)
                return engine.copies.read(t, keep=not write)
            return t.clone() if write else t
        if t._is_zerotensor():  # _efficientzerotensor has no memory to read
            return torch.zeros(t.shape, dtype=shadow_dtype, device=mirror.place(t.device))
        entry = entry_of(engine, self.plan, t)
        self.nested = self.nested or t.is_nested
        self.nonfinite = self.nonfinite or entry.nonfinite
        if entry.drift > self.drift:
            self.drift = entry.drift
        if declared:
            self.written.append(entry)
        self.exact = self.exact and entry.exact
        self.tensors.append(t)
        self.storages.add(entry.shadow_storage)
        return mirror.view(t, entry)

    def note_writes(self) -> None:
        """Note the declared writes as writes shadow saw, after every argument's version check."""
        for entry in self.written:
            self.engine.mirror.note_write(entry)


class Upcasts:
    """The device's own inputs in their shadow dtype where the shadows live (``plan.map_tensors``' function): a
    tensor passed twice (Adam's ``addcmul_(g, g)``) is upcast once; one whose shadow lives on another device is
    read over once per storage version, with the call's other inputs."""

    __slots__ = ("engine", "batch", "seen")

    def __init__(self, engine: Engine, batch: list[torch.Tensor]):
        self.engine, self.batch = engine, batch
        self.seen: dict[int, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor, _: ArgSpec) -> torch.Tensor:
        c = self.seen.get(id(t))
        if c is None:
            engine = self.engine
            mirror = engine.mirror
            if t.is_nested:  # copied as it is (never read over in batches, nor into pooled memory)
                c = self.seen[id(t)] = mirror.upcast(t)
            else:
                to = mirror.place(t.device)
                values = t if to == t.device else engine.copies.read(t, self.batch)
                c = self.seen[id(t)] = engine.scratch.copy(values, mirror.shadow_dtype(t.dtype) or t.dtype, to)
        return c


def entry_of(engine: Engine, plan: OpPlan, t: torch.Tensor) -> Any:
    """The mirror entry of a floating input's storage, resynced (and reported) after an unobserved write."""
    mirror = engine.mirror
    entry = mirror.entry(t)
    if mirror.unobserved_write(t, entry):
        mirror.resync(t)
        if engine.copies:
            engine.copies.drop([(None, t)])
        entry = mirror.entry(t)
        engine.report.unobserved_write(Event(
            engine.index, plan.name, "unobserved_write",
            f"{tuple(t.shape)} {t.dtype} on {t.device}: version moved without an op shadow saw (one run outside the "
            "ShadowMode block, with torch dispatch disabled, or on another thread); resynced"))
    return entry


def see(engine: Engine, plan: OpPlan, args: tuple, kwargs: dict) -> None:
    """A view's input storages get their shadows now (adopted if new, resynced if written behind shadow's back), so
    the view's shadow exists; an in-place view op (``t_``, ``unsqueeze_``) bumps its input's version counter, which
    is noted as a write shadow saw."""
    mirror = engine.mirror
    written = []  # noted after every check, as InputShadows does
    for spec, t in plan.tensors(args, kwargs):
        if t.device.type != "meta" and mirror.shadow_dtype(t.dtype) is not None and not t._is_zerotensor() \
                and t.layout == torch.strided:
            entry = entry_of(engine, plan, t)
            if spec.index in plan.declared_writes:
                written.append(entry)
    for entry in written:
        mirror.note_write(entry)


def remap_args(plan: OpPlan, place: Placement, a: Args) -> None:
    """dtype and device arguments rewritten for the float64 replay on the shadow device (in place in these
    copies): a device names where the device op puts its result, so the replay puts the shadow where that
    device's shadows live (``place``)."""
    for spec in plan.remap_args:
        v = spec.get(a.args, a.kwargs)
        new = remap(plan, spec.name, v, place)
        if new is not v:
            spec.put(a.args, a.kwargs, new)


def promoted(plan: OpPlan, a: Args, out: Any) -> None:
    """A floating result of no floating input (a factory op given no dtype, ``n / 7``, ``arange(n) * 0.1``) is
    made in the default dtype or the one the scalars imply: the replay makes it in the result's shadow dtype
    instead (in place in these copies): a ``dtype`` left to its default names it, and integer tensor inputs are
    upcast to it (exactly, below 2**53); bool ones stay, as masks."""
    result = next((t for _, t in flat_returns(plan, out) if isinstance(t, torch.Tensor)), None)
    target = SHADOW_DTYPES.get(result.dtype) if result is not None else None
    if target is None:
        return
    for spec in plan.remap_args:
        if spec.name == "dtype" and spec.get(a.args, a.kwargs) is None:
            spec.put(a.args, a.kwargs, target)
    for spec in plan.tensor_args:
        t = spec.get(a.args, a.kwargs)
        if isinstance(t, torch.Tensor) and t.dtype != torch.bool and not t.is_floating_point() \
                and not t.is_complex():
            spec.put(a.args, a.kwargs, t.to(target))


def remap(plan: OpPlan, name: str, v: Any, place: Placement) -> Any:
    """One dtype or device argument ``name`` of value ``v`` as the float64 replay on the shadow device takes it."""
    if isinstance(v, torch.dtype):
        return SHADOW_DTYPES.get(v) or v
    if isinstance(v, torch.device):
        return place(v)
    # a factory op's default device is the CPU: its shadow goes to the device chosen for every shadow
    if v is None and name == "device" and not plan.tensor_args and place.fixed is not None \
            and place.fixed.type != "cpu":
        return place.fixed
    if name in ("pin_memory", "half_to_float") and v:
        return False
    return v
