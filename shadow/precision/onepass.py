"""The audit's one-pass estimate: what each forward call would compute if one part containing it ran in a candidate
precision, as errors ``shadow.attribution.adjoint.Adjoints`` weights by the float64 adjoint of the target.

A call belongs to several parts: with the module tree, to every module whose forward is running (the block, its
attention, the attention's projection); with a module's own calls or with op classes, to one. Each (precision,
part) has a *world*: for every shadow storage the part's errors reached, the float64 value it would have if only
that part ran in the precision, the part's calls emulated on the world's values and every other call in float64 on
them. A part's calls are emulated on its world's inputs (on the float64 inputs while the world holds none of them),
so a block's attention sees the errors of the block's first LayerNorm, and a part's later calls see its earlier
ones, as in the part's own run. Emulating every call on the plain float64 inputs instead draws each rounding
anew: measured on a transformer layer's two residual adds, the estimate then ranged from 0.03x to 38x of the
part's direct run over six seeds, and a block's estimate is not the sum of its children's.

Worlds end at the first backward or optimizer call (a module may be called again until then: a shared activation, a
loop). They hold at most as many bytes as the shadows themselves (at least ``MIN_BYTES``); beyond that a world ends
early (``_bound``), as it does where a call cannot be recomputed in it, and its part's later calls are estimated on
float64 inputs (``dropped``), its change by the first-order sum. Calls whose result is a written argument
(in-place, out=) are emulated in no world, but run in the worlds that hold their inputs, on the world's copy of what
they write (taken before they run: ``before``). Calls with fresh results that also write arguments (batch norm's
running statistics) are emulated, their writes going to copies.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ..plan import flat_returns, plan_of
from ..records import Phase, Record
from ..replay import Replay
from ..rules import run_chain
from .upcasts import Upcasts, Watch

_no_dispatch = torch._C._DisableTorchDispatch
MIN_BYTES = 64 << 20


class _World:
    """One part's values under one precision, where they differ from the float64 shadows: a copy of each such
    shadow storage, kept as long as that shadow exists."""

    __slots__ = ("values", "nbytes", "__weakref__")

    def __init__(self) -> None:
        self.values: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # shadow storage -> (its shadow, world copy)
        self.nbytes = 0

    def view(self, s: torch.Tensor) -> torch.Tensor | None:
        """The world's value of shadow tensor s (None: the shadow's own)."""
        got = self.values.get(s.untyped_storage()._cdata)
        if got is None or got[0]() is None:
            return None
        return got[1].as_strided(s.size(), s.stride(), s.storage_offset())

    def at(self, base: torch.Tensor, region: torch.Tensor) -> torch.Tensor | None:
        """The world's value where device tensor ``region`` lies in the storage whose shadow is ``base`` (None:
        the shadow's own)."""
        got = self.values.get(base.untyped_storage()._cdata)
        if got is None or got[0]() is not base:
            return None
        return got[1].as_strided(region.size(), region.stride(), region.storage_offset())

    def put(self, base: torch.Tensor, region: torch.Tensor, value: torch.Tensor) -> None:
        """The world's ``value`` where device tensor ``region`` lies in the storage whose shadow is ``base``."""
        self.hold(base).as_strided(region.size(), region.stride(), region.storage_offset()).copy_(value)

    def hold(self, base: torch.Tensor) -> torch.Tensor:
        """The world's copy of the storage whose shadow is ``base`` (made from the shadow's values if none)."""
        key = base.untyped_storage()._cdata
        got = self.values.get(key)
        if got is None or got[0]() is not base:
            self._drop(key)
            world = base.clone()
            me = weakref.ref(self)
            got = self.values[key] = (weakref.ref(base, lambda ref: (w := me()) is not None and w._forget(key, ref)),
                                      world)
            self.nbytes += world.numel() * world.element_size()
        return got[1]

    def holds(self, base: torch.Tensor) -> bool:
        got = self.values.get(base.untyped_storage()._cdata)
        return got is not None and got[0]() is base

    def _forget(self, key: int, ref: weakref.ref) -> None:
        got = self.values.get(key)
        if got is not None and got[0] is ref:
            self._drop(key)

    def _drop(self, key: int) -> None:
        got = self.values.pop(key, None)
        if got is not None:
            self.nbytes -= got[1].numel() * got[1].element_size()


class Emulated:
    """One error channel per (candidate precision, part of the call) (``__call__``, for ``Adjoints``): a forward
    call's result in that precision, computed on its inputs in that part's world, minus the float64 result on the
    same inputs. ``observe`` (every judged call, before ``Adjoints`` asks) computes them and carries the worlds
    forward. ``parts``: record index -> the call's parts (``channels`` labels its channels); ``claimed``: per
    precision, the record indices its device computes differently; ``dropped``: the (precision, part) worlds ended
    early to bound memory."""

    def __init__(self, precisions: tuple[str, ...], modes: list, upcasts: Upcasts) -> None:
        self.precisions = precisions
        self.modes = modes
        self.upcasts = upcasts  # the tensors a narrow model holds in float32: their copies here are marked too
        self.parts: dict[int, tuple[str, ...]] = {}
        self.claimed: dict[str, set[int]] = {p: set() for p in precisions}
        self.dropped: set[tuple[str, str]] = set()
        self._mirror = None
        self._worlds: dict[tuple[str, str], _World] = {}
        self._errors: dict[int, tuple[torch.Tensor, ...]] = {}  # id(output) -> channels, for the call observed last
        # id of a one-element forward result -> (it, its call's parts, its value in each world holding one)
        self._scalars: dict[int, tuple[weakref.ref, tuple[str, ...], dict[tuple[str, str], float]]] = {}

    def attach(self, sm: Any) -> None:
        self._mirror = sm._engine.mirror

    def __call__(self, rec: Record, o: Any, p: Any) -> tuple[torch.Tensor, ...] | None:
        return self._errors.get(id(o.device))

    def channels(self, index: int) -> list[tuple[str, str]]:
        """(precision, part) of each error channel of record ``index``, in the order ``__call__`` gave them."""
        return [(name, part) for name in self.precisions for part in self.parts.get(index, ())]

    def computed_in(self, t: torch.Tensor) -> tuple[str, ...] | None:
        """The parts of the forward call whose one-element result ``t`` is (the loss: where it is computed)."""
        got = self._scalars.get(id(t))
        return got[1] if got is not None and got[0]() is t else None

    def in_worlds(self, t: torch.Tensor) -> dict[tuple[str, str], float]:
        """The value of the one-element forward result ``t`` (the loss) in each (precision, part) world that reached
        it: the target of the part's own run, every other call in float64."""
        got = self._scalars.get(id(t))
        return got[2] if got is not None and got[0]() is t else {}

    def before(self) -> Watch:
        """A mode to enter outside ShadowMode for the run: it sees each call before the device runs it (and shadow
        replays it), when the shadows of what an in-place call writes still hold the values it reads: a world that
        holds another of its inputs takes its copy of them then, so that the call can run in it (``_inputs``)."""
        return Watch(before=self._before)

    def _before(self, func: Any, args: tuple, kwargs: dict) -> None:
        plan = plan_of(func)
        if not self._worlds or not plan.writes or not any(r.aliases_write for r in plan.returns):
            return
        bases = self._mirror._entries
        written = {t.untyped_storage()._cdata for _, t in plan.tensors(args, kwargs, plan.writes)}
        read = [e.base for _, t in plan.tensors(args, kwargs) if t.untyped_storage()._cdata not in written
                and (e := bases.get(t.untyped_storage()._cdata)) is not None]
        if not read:
            return
        with _no_dispatch():
            for world in self._worlds.values():
                if any(world.holds(b) for b in read):
                    for key in written:
                        e = bases.get(key)
                        if e is not None and e.base.dtype == torch.float64:
                            world.hold(e.base)

    def observe(self, rec: Record, outputs: list, p: Any, parts: tuple[str, ...]) -> None:
        self._errors = {}
        if rec.phase in (Phase.BACKWARD, Phase.OPTIMIZER):
            self._worlds.clear()
            return
        outs = [o for o in outputs if o.slot is not None and _real(o.device) and _real(o.shadow)]
        if not outs:
            return
        self.parts[rec.index] = parts
        with _no_dispatch():
            self._call(rec, outs, p, parts, _device_out(p.plan, outputs))
            self._bound(parts)
            for o in outs:
                if o.device.numel() == 1:
                    self._scalars[id(o.device)] = (weakref.ref(o.device), parts, self._values(o.device))

    def _values(self, t: torch.Tensor) -> dict[tuple[str, str], float]:
        """Device tensor t's value in each world that holds one."""
        e = self._mirror._entries.get(t.untyped_storage()._cdata)
        if e is None:
            return {}
        found = {w: world.at(e.base, t) for w, world in self._worlds.items()}
        return {w: float(v.reshape(-1)[0]) for w, v in found.items() if v is not None}

    def _call(self, rec: Record, outs: list, p: Any, parts: tuple[str, ...], device_out: Any) -> None:
        plan = p.plan

        def float64(args: tuple[list, dict]) -> Any:  # the call in float64 on a world's inputs, as shadow replays it
            return run_chain(p.chain, Replay(plan, args[0], args[1], device_out))[1]

        dtype = p.inputs[0].dtype if p.inputs else None
        emulable = dtype is not None and dtype != torch.float64 and dtype.is_floating_point \
            and not any(r.aliases_write for r in plan.returns)
        wide = _wide_inputs(p, self.upcasts)  # id of a shadow input of a wide device tensor -> narrow values
        channels: dict[int, list[torch.Tensor]] = {id(o.device): [] for o in outs}
        zeros = {id(o.device): torch.zeros((), dtype=torch.float64, device=o.shadow.device).expand(o.shadow.shape)
                 for o in outs}  # no error, without memory

        def add(errors: dict[int, torch.Tensor] | None) -> None:
            for k in list(channels):
                e = zeros[k] if errors is None else errors.get(k)
                if e is None:  # a result the emulation gives in another shape: no channel for this output
                    del channels[k]
                else:
                    channels[k].append(e)

        for name, mode in zip(self.precisions, self.modes):
            chain = mode.table.chain(plan.func) if emulable else None
            mine = {(name, part) for part in parts} if chain else set()
            for w in [w for w in self._worlds if w[0] == name and w not in mine]:
                args = self._inputs(self._worlds[w], p, wide)
                if args is not None:  # some input differs in this world: the call in float64 on its values
                    try:
                        self._keep(w, outs, plan, float64(args))
                    except Exception:  # never into the engine (it would adopt the device's values): the world ends
                        self._end(w)
            if not chain:
                if emulable:  # an op this precision's device leaves as it is: no error
                    for _ in parts:
                        add(None)
                continue
            on_shadow: tuple | None = None  # the emulation on the float64 inputs, for every part with no values here
            for part in parts:
                w = (name, part)
                world = self._worlds.get(w)
                args = self._inputs(world, p, wide) if world is not None else None
                ref = None  # the float64 result on the world's inputs (None: the shadow's)
                try:
                    if args is None:
                        if on_shadow is None:
                            on_shadow = self._emulate(mode, chain, plan, p.shadow.args, p.shadow.kwargs, dtype, outs,
                                                      None, wide)
                        y, errors = on_shadow
                    else:
                        ref = float64(args)
                        y, errors = self._emulate(mode, chain, plan, *args, dtype, outs, ref, wide)
                except Exception:  # never into the engine: no error counted for this call, the world ends
                    add(None)
                    self._end(w)
                    continue
                if y is NotImplemented:  # unclaimed (data movement, or not a matmul for tf32 and fp8): no error
                    add(None)
                    if ref is not None:
                        self._keep(w, outs, plan, ref)
                    continue
                self.claimed[name].add(rec.index)
                add(errors)
                self._keep(w, outs, plan, y)
        n = len(self.precisions) * len(parts)
        self._errors = {k: tuple(v) for k, v in channels.items() if len(v) == n}

    def _emulate(self, mode: Any, chain: tuple, plan: Any, a: list, kw: dict, dtype: torch.dtype, outs: list,
                 ref: Any, wide: dict[int, bool]) -> tuple[Any, Any]:
        """The call in ``mode``'s precision on inputs (a, kw) (float64, cast to the device's ``dtype`` first, those
        in ``wide`` marked wide), and per output its difference from ``ref`` (the float64 result on the same inputs;
        None: the shadow's). (NotImplemented, None) where the device leaves the call as it is."""

        def cast(t: torch.Tensor, _: Any) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            c = t.to(dtype)
            if id(t) in wide:
                self.upcasts.mark(c, narrow_values=wide[id(t)])
            return c

        cast = plan.map_tensors(a, kw, cast)
        y = run_chain(chain, plan, *cast, mode.options)
        if y is NotImplemented:
            return y, None
        ys = [t for _, t in flat_returns(plan, y)]
        refs = [t for _, t in flat_returns(plan, ref)] if ref is not None else None
        errors = {}
        for o in outs:
            v = ys[o.slot] if o.slot < len(ys) else None
            if isinstance(v, torch.Tensor) and v.shape == o.shadow.shape and v.is_floating_point():
                errors[id(o.device)] = _difference(v.to(torch.float64), o.shadow if refs is None else refs[o.slot])
        return y, errors

    def _inputs(self, world: _World, p: Any, wide: dict[int, bool]) -> tuple[list, dict] | None:
        """The call's inputs in ``world`` (None: all as the shadow's, or it writes in place a storage the world holds
        no copy of: the shadow's must not be written). A call whose result is a written argument runs on the world's
        copy of it, which it updates; the other arguments a call writes (running statistics) are copies. The world's
        values of ``wide`` inputs join ``wide``."""
        plan = p.plan
        written = {id(t) for _, t in plan.tensors(p.shadow.args, p.shadow.kwargs, plan.writes)} if plan.writes else ()
        in_place = any(r.aliases_write for r in plan.returns)
        differs, safe = False, True

        def value(t: torch.Tensor, _: Any) -> torch.Tensor:
            nonlocal differs, safe
            v = world.view(t) if t.dtype == torch.float64 else None
            differs = differs or v is not None
            if id(t) in written and not in_place:
                v = (t if v is None else v).clone()
            safe = safe and (v is not None or id(t) not in written)
            if v is not None and id(t) in wide:
                wide[id(v)] = wide[id(t)]
            return t if v is None else v

        a, kw = plan.map_tensors(p.shadow.args, p.shadow.kwargs, value)
        return (a, kw) if differs and safe else None

    def _keep(self, w: tuple[str, str], outs: list, plan: Any, result: Any) -> None:
        """The call's ``result`` in world ``w``: its outputs' world values (none in a world ended early)."""
        if any(r.aliases_write for r in plan.returns) or w in self.dropped:  # in place: ran on the world's copies
            return
        world = self._worlds.get(w)
        if world is None:
            world = self._worlds[w] = _World()
        flat = [t for _, t in flat_returns(plan, result)]
        for o in outs:
            v = flat[o.slot] if o.slot < len(flat) else None
            e = self._mirror._entries.get(o.device.untyped_storage()._cdata)
            if isinstance(v, torch.Tensor) and e is not None and e.itemsize == o.device.element_size() \
                    and e.base.dtype == torch.float64 and v.shape == o.device.shape:
                world.put(e.base, o.device, v.to(torch.float64))

    def _bound(self, parts: tuple[str, ...]) -> None:
        """At most as many bytes in worlds as in the shadows (at least MIN_BYTES). Beyond, worlds end largest
        first, those of parts the current call is outside of (called again less often than those it is inside
        of) before the others."""
        cap = max(self._mirror.held, MIN_BYTES)
        while self._worlds and sum(w.nbytes for w in self._worlds.values()) > cap:
            self._end(max(self._worlds, key=lambda k: (k[1] not in parts, self._worlds[k].nbytes)))

    def _end(self, w: tuple[str, str]) -> None:
        """World ``w`` ends early: its part's later calls are estimated on float64 inputs (``dropped``)."""
        self._worlds.pop(w, None)
        self.dropped.add(w)


def _wide_inputs(p: Any, upcasts: Upcasts) -> dict[int, bool]:
    """id of each of the call's shadow inputs whose device tensor is wide -> whether it holds narrow values. The
    engine prepared a shadow for each floating device input (``p.inputs``, in argument order; a tensor read twice
    once, a written one each time)."""
    found: dict[int, bool] = {}
    if not len(upcasts):
        return found
    devices, seen = iter(p.inputs), set()
    for spec, s in p.plan.tensors(p.shadow.args, p.shadow.kwargs):
        if s.dtype not in (torch.float64, torch.complex128) or (id(s) in seen and not spec.write):
            continue
        seen.add(id(s))
        d = next(devices, None)
        if d is not None and upcasts.wide(d):
            found[id(s)] = upcasts.narrow_values(d)
    return found


def _device_out(plan: Any, outputs: list) -> Any:
    """The call's device results as the op returned them (for replay rules that adopt a part of them)."""
    flat = [None] * max((o.slot + 1 for o in outputs if o.slot is not None), default=0)
    for o in outputs:
        if o.slot is not None:
            flat[o.slot] = o.device
    return flat[0] if len(plan.returns) == 1 and not plan.returns[0].tensors and flat else tuple(flat)


def _difference(v: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """v - ref, 0 where both hold the same infinity (a -inf mask, log(0)): the emulation keeps it as it is."""
    return torch.where(v == ref, 0.0, v - ref)


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()
