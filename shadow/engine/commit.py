"""Committing: the shadows the mirror keeps of a call's outputs (exact or not, holding NaN/Inf or not, their
drift), the ablation worlds of ``shadow.attribute`` applied first, and the device values adopted where shadow has
no replay of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import nested
from ..attribution.adjoint import split_error
from ..mirror import SHADOW_DTYPES, any_nonfinite
from ..plan import OpPlan, flat_returns
from .values import Compared, Outputs, Prepared

if TYPE_CHECKING:
    from .core import Engine


def commit(engine: Engine, prepared: Prepared, device: Any, written: bool, c: Compared) -> None:
    """Keep the shadow of one output ``device``: a ``written`` argument's (in-place, out=) or a fresh return's."""
    if c.keep is None:
        return
    mirror = engine.mirror
    if c.mismatch:  # the device's value, adopted
        mirror.assign(device, c.keep, exact=True, fresh=True, nonfinite=any_nonfinite(c.keep))  # exact: the same
        return
    drift = c.drift.rel_norm if c.drift is not None and not c.exact else 0.0
    if written:
        mirror.commit_write(device, c.keep, c.exact, c.nonfinite, drift)
    else:
        fresh = c.keep.untyped_storage()._cdata not in prepared.storages  # no input's shadow aliases it
        entry = mirror.assign(device, c.keep, c.exact, fresh=fresh, nonfinite=c.nonfinite, drift=drift)
        if SHADOW_DTYPES.get(device.dtype) is not None:
            mirror.track(device, entry)


def in_world(engine: Engine, how: str, outputs: Outputs, compared: tuple[Compared, ...]) -> tuple[Compared, ...]:
    """``shadow.attribute``'s ablation worlds, before the mirror keeps a call's shadows: "device" gives each
    shadow the error the device made on this call (shadow + device - reference: the device's own trajectory
    when the inputs agree), "exact" only the error of rounding the reference to the device dtype (shadow +
    round(reference) - reference: the call made exact, its correctly rounded result where the inputs agree).
    Both errors are the ones measured on the device's inputs, held fixed in the world: a rounding drawn again
    at the world's slightly different values would be noise as large as what is measured. The shadows to keep
    (the replay's own outputs) take the error; the device's tensors are never touched."""
    rewritten = []
    for o, c in zip(outputs.items, compared):
        device, reference, keep = o.device, o.reference, c.keep
        if not isinstance(device, torch.Tensor) or not isinstance(reference, torch.Tensor) or keep is None \
                or c.mismatch or not device.is_floating_point():
            rewritten.append(c)
            continue
        values = keep
        if device.is_nested:  # its values take the error, in the kept shadow made contiguous (values: a view)
            if not nested.alike(device, reference) or not nested.alike(device, keep):
                rewritten.append(c)
                continue
            keep = keep.contiguous()
            device, reference, values = nested.values(device), nested.values(reference), nested.values(keep)
        elif reference.shape != device.shape or keep.shape != device.shape:
            rewritten.append(c)
            continue
        else:
            device = engine.near(device)  # the copy its comparisons read, where it crossed
        # the error first: the reference may be the shadow to keep itself; equal non-finite values carry none
        removable, rounding = split_error(engine.mirror.upcast(device), reference, device.dtype)
        values.add_(rounding if how == "exact" else removable.add_(rounding))
        rewritten.append(c._replace(exact=False, keep=keep))
    return tuple(rewritten)


def adopt_all(engine: Engine, plan: OpPlan, args: tuple, kwargs: dict, out: Any) -> None:
    """Make the device's values the shadow of every output and written argument."""
    adopt(engine, [t for _, t in plan.tensors(args, kwargs, plan.writes)] + [t for _, t in flat_returns(plan, out)])


def adopt(engine: Engine, tensors: Any) -> None:
    """Make the device's values the shadow of ``tensors`` (read over together where shadows live elsewhere)."""
    mirror = engine.mirror
    adopted = [t for t in tensors if isinstance(t, torch.Tensor) and not t._is_zerotensor()
               and mirror.shadow_dtype(t.dtype) is not None and t.layout == torch.strided]  # sparse: not mirrored
    for t in adopted:
        value = mirror.upcast(engine.near(t, adopted))  # exact: non-finite where t is, read where it arrived
        mirror.assign(t, value, exact=True, fresh=True, nonfinite=any_nonfinite(value))


def resync_written(engine: Engine, plan: OpPlan, args: tuple, kwargs: dict) -> None:
    """A call outside the scope ran: no shadow, no record. A storage it wrote that has a shadow (a scoped op
    read it before) takes the device's values again, as a write shadow saw."""
    engine.report.out_of_scope()
    mirror = engine.mirror
    if engine.copies:  # device values read over before this write are out of date
        engine.copies.drop(plan.tensors(args, kwargs, plan.writes))
    for _, t in plan.tensors(args, kwargs, plan.writes):
        if t.layout == torch.strided and t.device.type != "meta" \
                and mirror.shadow_dtype(t.dtype) is not None and mirror.known(t) is not None:
            mirror.resync(t)
            mirror.note_write(mirror.entry(t))
