"""The audit's one-pass estimate: what each forward call would compute if its part alone ran in a candidate
precision, as errors ``shadow.attribution.adjoint.Adjoints`` weights by the float64 adjoint of the target.

A part's first call is emulated on the float64 inputs. Its later calls are emulated on the inputs they would
have in that part's own run: a *world* per (precision, part) holds, for every shadow storage the part's earlier
errors reached, the float64 value it would have if only that part ran in the precision (the part's calls
emulated on the world's values, every other call in float64 on them). Emulating later calls on the plain
float64 inputs instead draws every rounding again: measured on a transformer layer's two residual adds, the
estimate then ranged from 0.03x to 38x of the part's direct run over six seeds, while single-call parts agreed
within 10 %.

Worlds end at the first backward or optimizer call (a module may be called again until then: a shared activation, a
loop). They hold at most as many bytes as the shadows themselves (at least ``MIN_BYTES``); beyond that a world ends
early (``_bound``), and its part's later calls are estimated on float64 inputs (``dropped``). Calls that write their
inputs are emulated in no world (overwritten by then); where one writes a storage a world holds no value of, the
world keeps the float64 shadow's.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from ..plan import flat_returns
from ..records import Phase, Record
from ..rules import run_chain

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

    def put(self, base: torch.Tensor, region: torch.Tensor, value: torch.Tensor) -> None:
        """The world's ``value`` where device tensor ``region`` lies in the storage whose shadow is ``base``."""
        key = base.untyped_storage()._cdata
        got = self.values.get(key)
        if got is None or got[0]() is not base:
            self._drop(key)
            world = base.clone()
            me = weakref.ref(self)
            got = self.values[key] = (weakref.ref(base, lambda ref: (w := me()) is not None and w._forget(key, ref)),
                                      world)
            self.nbytes += world.numel() * world.element_size()
        got[1].as_strided(region.size(), region.stride(), region.storage_offset()).copy_(value)

    def _forget(self, key: int, ref: weakref.ref) -> None:
        got = self.values.get(key)
        if got is not None and got[0] is ref:
            self._drop(key)

    def _drop(self, key: int) -> None:
        got = self.values.pop(key, None)
        if got is not None:
            self.nbytes -= got[1].numel() * got[1].element_size()


class Emulated:
    """One error channel per candidate precision (``__call__``, for ``Adjoints``): a forward call's result in that
    precision, computed on its inputs in its part's world, minus the float64 result on the same inputs.
    ``observe`` (every judged call, before ``Adjoints`` asks) computes them and carries the worlds forward.
    ``claimed``: per precision, the record indices its device computes differently; ``dropped``: the
    (precision, part) worlds ended early to bound memory."""

    def __init__(self, precisions: tuple[str, ...], modes: list, key: Callable[[Record], str], by: str) -> None:
        self.precisions = precisions
        self.modes = modes
        self.claimed: dict[str, set[int]] = {p: set() for p in precisions}
        self.dropped: set[tuple[str, str]] = set()
        self._key = key
        self._modules = by == "module"
        self._mirror = None
        self._worlds: dict[tuple[str, str], _World] = {}
        self._errors: dict[int, tuple[torch.Tensor, ...]] = {}  # id(output) -> channels, for the call observed last

    def attach(self, sm: Any) -> None:
        self._mirror = sm._engine.mirror

    def __call__(self, rec: Record, o: Any, p: Any) -> tuple[torch.Tensor, ...] | None:
        return self._errors.get(id(o.device))

    def observe(self, rec: Record, outputs: list, p: Any) -> None:
        self._errors = {}
        if rec.phase in (Phase.BACKWARD, Phase.OPTIMIZER):
            self._worlds.clear()
            return
        part = self._key(rec)
        outs = [o for o in outputs if o.slot is not None and _real(o.device) and _real(o.shadow)]
        if not outs:
            return
        with _no_dispatch():
            self._call(rec, outs, p, part)
            self._bound(part)

    def _call(self, rec: Record, outs: list, p: Any, part: str) -> None:
        plan = p.plan
        dtype = p.inputs[0].dtype if p.inputs else None
        emulable = dtype is not None and dtype != torch.float64 and dtype.is_floating_point and not plan.writes
        channels: dict[int, list[torch.Tensor]] = {id(o.device): [] for o in outs}
        for name, mode in zip(self.precisions, self.modes):
            chain = mode.table.chain(plan.func) if emulable else None
            own = (name, part)
            for w in [w for w in self._worlds if w[0] == name and (w != own or not chain)]:
                args = self._inputs(self._worlds[w], p)
                if args is not None:  # some input differs in this world: the call in float64 on its values
                    self._keep(w, outs, plan, plan.func(*args[0], **args[1]), p)
            if not chain:
                if emulable:  # an op this precision's device leaves as it is: no error
                    for o in outs:
                        channels[id(o.device)].append(torch.zeros_like(o.shadow))
                continue
            world = self._worlds.get(own)
            args = self._inputs(world, p) if world is not None else None
            a, kw = args if args is not None else (p.shadow.args, p.shadow.kwargs)
            cast = plan.map_tensors(a, kw, lambda t, _: t.to(dtype) if t.is_floating_point() else t)
            y = run_chain(chain, plan, *cast, mode.options)
            if y is NotImplemented:  # unclaimed (data movement, or not a matmul for tf32 and fp8): no error
                for o in outs:
                    channels[id(o.device)].append(torch.zeros_like(o.shadow))
                if args is not None:
                    self._keep(own, outs, plan, plan.func(*a, **kw), p)
                continue
            self.claimed[name].add(rec.index)
            ys = [t for _, t in flat_returns(plan, y)]
            refs = [t for _, t in flat_returns(plan, plan.func(*a, **kw))] if args is not None else None
            for o in outs:
                v = ys[o.slot] if o.slot < len(ys) else None
                if not isinstance(v, torch.Tensor) or v.shape != o.shadow.shape or not v.is_floating_point():
                    channels.pop(id(o.device), None)
                    continue
                if id(o.device) in channels:
                    channels[id(o.device)].append(v.to(torch.float64) - (o.shadow if refs is None else refs[o.slot]))
            self._keep(own, outs, plan, y, p)
        self._errors = {k: tuple(v) for k, v in channels.items() if len(v) == len(self.precisions)}

    def _inputs(self, world: _World, p: Any) -> tuple[list, dict] | None:
        """The call's inputs in ``world`` (None: all as the shadow's, or it writes a storage the world holds no
        copy of: the shadow's must not be written). A call that writes an input runs on the world's copy of it,
        which it updates."""
        plan = p.plan
        written = {id(t) for _, t in plan.tensors(p.shadow.args, p.shadow.kwargs, plan.writes)} if plan.writes else ()
        differs, safe = False, True

        def value(t: torch.Tensor, _: Any) -> torch.Tensor:
            nonlocal differs, safe
            v = world.view(t) if t.dtype == torch.float64 else None
            differs = differs or v is not None
            safe = safe and (v is not None or id(t) not in written)
            return t if v is None else v

        a, kw = plan.map_tensors(p.shadow.args, p.shadow.kwargs, value)
        return (a, kw) if differs and safe else None

    def _keep(self, w: tuple[str, str], outs: list, plan: Any, result: Any, p: Any) -> None:
        """The call's ``result`` in world ``w``: its outputs' world values."""
        if plan.writes:  # it ran on the world's copies of what it writes
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

    def _bound(self, part: str) -> None:
        """At most as many bytes in worlds as in the shadows (at least MIN_BYTES). Beyond, worlds end largest
        first, and by module, those of modules the current call is outside of (called again less often than
        those it is inside of) before the others."""
        cap = max(self._mirror.held, MIN_BYTES)
        while self._worlds and sum(w.nbytes for w in self._worlds.values()) > cap:
            inside = self._modules and (lambda k: k[1] == part or part.startswith(k[1] + "."))
            w = max(self._worlds, key=lambda k: (not inside(k) if inside else True, self._worlds[k].nbytes))
            del self._worlds[w]
            self.dropped.add(w)


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()
