"""Deferred calls: a replay rule's outputs written asynchronously (collectives, ``shadow.replay.table.Deferred``)
are judged when a later op first touches them (the user's program has waited for them by then), or when the
mode exits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..plan import OpPlan, flat_returns
from ..records import Kind
from ..replay.table import Deferred
from .conclude import conclude, internal_error
from .outputs import read_outputs
from .values import Args, Prepared, Replayed

if TYPE_CHECKING:
    from .core import Engine

_COPY = torch.ops.aten.copy_.default


class Pending(NamedTuple):
    """A call whose replay returned ``Deferred``, waiting for a later op to touch its outputs."""

    prepared: Prepared
    args: Any
    kwargs: dict
    out: Any
    kind: Kind
    result: Deferred
    at: tuple  # (module, phase, call site) where it was called
    storages: set[int]
    adopted: int  # Mirror.adopted at the call: storages adopted later are not the user's (``completing``)


class Deferrals:
    """The deferred calls of one engine, in the order they were made."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: list[Pending] = []

    def add(self, prepared: Prepared, args: Any, kwargs: dict, out: Any, kind: Kind, result: Deferred, at: tuple
            ) -> None:
        plan = prepared.plan
        written = [t for _, t in plan.tensors(args, kwargs, plan.writes)] + [t for _, t in flat_returns(plan, out)]
        self.pending.append(Pending(prepared, args, kwargs, out, kind, result, at, storages(written),
                                    self.engine.mirror.adopted))

    def before(self, plan: OpPlan, args: tuple, kwargs: dict) -> bool:
        """Before an op that may touch deferred outputs: judge the calls whose outputs it reads; True where the op
        completes a deferred call rather than reads it (``completing``)."""
        completing = self.completing(plan, args)
        self.settle((t for _, t in plan.tensors(args, kwargs)), spare=completing)
        return bool(completing)

    def settle(self, tensors: Any = None, spare: tuple = ()) -> None:
        """Judge the deferred calls whose outputs share a storage with ``tensors`` (every one when None), but
        those in ``spare``."""
        engine = self.engine
        with torch._C._DisableTorchDispatch():
            touched = None if tensors is None else storages(tensors)
            due = [d for d in self.pending if (touched is None or not touched.isdisjoint(d.storages))
                   and all(d is not s for s in spare)]
            if not due:
                return
            self.pending = [d for d in self.pending if all(d is not x for x in due)]
            for d in due:
                result = d.result
                plan = d.prepared.plan
                try:
                    engine.report.meta.update(result.meta)
                    prepared = d.prepared._replace(local=Args(*result.local))
                    written = [t for _, t in plan.tensors(d.args, d.kwargs)]
                    written += [t for _, t in flat_returns(plan, d.out)]
                    for t in written:  # the backend wrote them since the call, outside any op (gloo on torch 2.4)
                        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t._is_zerotensor():
                            engine.mirror.absorb(t)
                    replayed = Replayed(d.kind, result.shadow, result.local_out)
                    conclude(engine, prepared, d.args, d.kwargs, d.out, replayed,
                             read_outputs(prepared, d.args, d.kwargs, d.out, replayed), d.at)
                except Exception as exc:
                    internal_error(engine, plan, d.args, d.kwargs, d.out, exc)

    def completing(self, plan: OpPlan, args: tuple) -> tuple:
        """The deferred calls this op completes rather than reads: a backend finishing a collective at ``wait()``
        copies its result into the output from a temporary of its own, in the caller's thread (gloo's
        reduce_scatter_tensor: ``aten.copy_`` from a split of a storage first seen after the call). The copy is
        part of those calls: not replayed (their shadows already hold the float64 result), judged with them at
        the next op that touches their outputs."""
        if plan.func is not _COPY:
            return ()
        dst, src = args[0], args[1]
        e = self.engine.mirror.known(src) if isinstance(src, torch.Tensor) and src.layout == torch.strided else None
        if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor) \
                or (e is not None and not e.adopted):
            return ()
        into = storages([dst])
        return tuple(d for d in self.pending if not into.isdisjoint(d.storages)
                     and (e is None or e.adopted > d.adopted))


def storages(tensors: Any) -> set[int]:
    """The data pointers of the strided tensors' storages."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)
            and t.layout == torch.strided and not t.is_nested and t.device.type != "meta" and not t._is_zerotensor()}
