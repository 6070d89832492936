"""After the device op: the replays (``Replayed``), the outputs read (``Outputs``), then the one conclusion path
of every replayed call: judge, commit, record, observe."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import Unsupported
from ..plan import OpPlan, flat_returns
from ..records import Kind
from ..replay import Replay
from ..replay.table import Deferred
from ..rules import run_chain
from .commit import adopt_all, commit, in_world
from .judge import cpu_error, judge
from .outputs import direct_outputs, read_outputs
from .pieces import judge_pieces
from .prepare import promoted
from .record import record
from .values import Outputs, Prepared, Replayed

if TYPE_CHECKING:
    from .core import Engine


def replay(engine: Engine, prepared: Prepared, out: Any) -> Replayed:
    """The op replayed on the shadow inputs, then, unless every input is exact or the call is random,
    uninitialized or deferred, on the device's own inputs upcast; ``Unsupported`` where it cannot be."""
    plan = prepared.plan
    inputs, local = prepared.shadow, prepared.local
    if not prepared.inputs:
        promoted(plan, inputs, out)
    kind, shadow = run_chain(prepared.chain, Replay(plan, inputs.args, inputs.kwargs, out, local, engine.scratch))
    if local is None or isinstance(shadow, Deferred) or (shadow is None and kind in (Kind.RANDOM, Kind.ADOPTED)):
        return Replayed(kind, shadow, None)
    return Replayed(kind, shadow, run_chain(prepared.chain, Replay(plan, local.args, local.kwargs, out,
                                                                   scratch=engine.scratch))[1])


def finish(engine: Engine, prepared: Prepared, args: tuple, kwargs: dict, out: Any) -> None:
    """Everything after the device op of a prepared call."""
    plan = prepared.plan
    try:
        replayed = replay(engine, prepared, out)
    except Unsupported as exc:
        adopt_all(engine, plan, args, kwargs, out)
        record(engine, plan, Kind.UNSUPPORTED, args, kwargs, out, reason=exc.reason, inputs=prepared.inputs)
        return
    kind, shadow = replayed.kind, replayed.shadow
    # random or uninitialized: the device's values are adopted (by kind: a replayed in-place op that returns
    # nothing, such as _foreach_add_ or _fused_adam_, also gives None and its shadow writes must be kept).
    # Uninitialized memory (empty) is adopted at its first read, not now: C++ code may fill it without
    # dispatching (at::tensor(list) is empty + std::copy), and its first reader must see what was written.
    if shadow is None and kind in (Kind.RANDOM, Kind.ADOPTED):
        if kind is Kind.RANDOM:
            adopt_all(engine, plan, args, kwargs, out)
        else:
            for _, t in flat_returns(plan, out):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    engine.mirror.seen_empty(t)
        record(engine, plan, kind, args, kwargs, out, inputs=prepared.inputs)
        return
    if isinstance(shadow, Deferred):  # written asynchronously (collectives): judged once a later op touches them
        at = engine.attribution.where(plan.func, args, kwargs, out, engine.index)
        # the CPU kernel is never rerun for it
        engine.deferred.add(prepared._replace(cpu=None), args, kwargs, out, kind, shadow, at)
        return
    outputs = direct_outputs(prepared, args, kwargs, out, replayed) if prepared.direct else None
    conclude(engine, prepared, args, kwargs, out, replayed,
             outputs if outputs is not None else read_outputs(prepared, args, kwargs, out, replayed))


def conclude(engine: Engine, prepared: Prepared, args: tuple, kwargs: dict, out: Any, replayed: Replayed,
             outputs: Outputs, at: tuple | None = None) -> None:
    """Judge, commit, record and observe a replayed call (``at``: where a deferred call was made)."""
    plan, hooks = prepared.plan, engine.hooks
    deferred = at is not None
    judged = judge_pieces(engine, prepared, outputs) if prepared.before is not None else \
        judge(engine, prepared, outputs, out, replayed.local if prepared.local is not None else replayed.shadow)
    if at is None:
        at = engine.attribution.where(plan.func, args, kwargs, out, engine.index, prepared.inputs)
    compared = judged.compared
    if hooks.world is not None and replayed.kind is not Kind.RANDOM:
        how = hooks.world(plan.name, *at)
        if how is not None:
            compared = in_world(engine, how, outputs, compared)
    for o, c in zip(outputs.items, compared):
        commit(engine, prepared, o.device, o.written, c)
    cpu = cpu_error(prepared, outputs) if prepared.cpu is not None and replayed.kind is not Kind.RANDOM else None
    result = outputs.items[0].device if outputs.plain else \
        next((o.device for o in outputs.items if isinstance(o.device, torch.Tensor)), None)
    rec = record(engine, plan, replayed.kind, args, kwargs, out, judged=judged, item=outputs.item,
                 inputs=prepared.inputs, cpu=cpu, result=result, nonfinite_in=prepared.nonfinite_in,
                 inputs_drift=prepared.inputs_drift,
                 at=at)
    if rec.over_budget and engine.keeper is not None and not deferred:  # decided after judging: within budget, free
        engine.keeper.consider(engine, prepared, rec, outputs, args, kwargs)
    if hooks.observe is not None:
        hooks.observe(rec, outputs.items, prepared)


def internal_error(engine: Engine, plan: OpPlan, args: tuple, kwargs: dict, out: Any, exc: Exception) -> None:
    """An exception in shadow's own work on a call: the device's results adopted, the call recorded unsupported,
    and, unless it is a limit of shadow's (``Unsupported``: sparse layouts), counted as an internal error."""
    if isinstance(exc, Unsupported):
        adopt_all(engine, plan, args, kwargs, out)
        record(engine, plan, Kind.UNSUPPORTED, args, kwargs, out, reason=exc.reason)
        return
    reason = f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    engine.report.internal_error(plan.name, reason)
    try:
        adopt_all(engine, plan, args, kwargs, out)
    except Exception:  # adoption failed too: the next read re-adopts from the device
        pass
    record(engine, plan, Kind.UNSUPPORTED, args, kwargs, out, reason=reason)
