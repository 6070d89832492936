"""Large calls of in-place list ops judged in pieces: the fused optimizers (``_fused_adam_``, ``_fused_adamw_``,
``_fused_sgd_``, ``_fused_adagrad_``: every parameter in one call) and the ``_foreach_`` ops the foreach optimizers
are made of. The local replay, its budget and the comparisons run on one list element at a time, a large one in
runs of ``CHUNK`` elements. What such a call holds beside the shadows is then the lists it writes as they were
before the op, in their own dtypes, and one piece's float64 working set, where the whole path holds every input
upcast and every bound at once (seven float64 copies of the parameters for a fused AdamW call). Each element of
these ops depends on the same element of its lists alone, so a piece's replay and bounds are the whole call's on its
elements; an output's figures are its pieces' joined as the fused comparison joins its own chunks (sums in another
order: within rounding of the whole path's). A call the keeper may keep (``shadow repro``), a spot-checked one, one
whose whole local replay is read after (``compare_cpu``, ``shadow.attribute``'s worlds, observers) and one of a
single output take the whole path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..budgets import Budget, builds_early, left_as_read
from ..metrics import can_join, joined_stats, part_figures
from ..plan import ArgType, OpPlan, flat_returns
from ..replay import Replay
from ..rules import run_chain
from .budget import budget_of, built_early, guarded, pre_inputs, with_bounds
from .judge import bound_of, compared, figures, merged_figures
from .keep import keepable
from .values import Args, Compared, Judged, Outputs, Prepared

if TYPE_CHECKING:
    from .core import Engine

PIECE_BYTES = 64 << 20  # a call whose tensors take fewer bytes is judged whole
# elements of a piece of a large parameter: 2 MB in float64 a tensor, which glibc serves from memory it reused (no
# fresh pages to fault in) and the caches still hold for the comparison after the replay (benchmarks/RESULTS.md);
# a multiple of the fused comparison's chunk (shadow._fused.CHUNK)
CHUNK = 1 << 18


def takes_pieces(plan: OpPlan, early: bool) -> bool:
    """Whether an op's large calls may be judged in pieces, decided once per overload: an in-place op that returns
    nothing, every argument it writes a Tensor[] list, and either a fused optimizer step (its budget built from its
    inputs alone, ``Route.early``) or a ``_foreach_`` op whose other arguments are lists or numbers (no tensor of
    scalars shared by its lists)."""
    if plan.remap_args or not plan.tensor_args or plan.tensor_args[0].type is not ArgType.TENSORS:
        return False
    in_place = plan.op_name.endswith("_") and bool(plan.writes) and not plan.returns and \
        all(spec.type is ArgType.TENSORS for spec in plan.writes)
    # a _foreach_ op that returns a fresh list (_foreach_sqrt) and writes nothing
    fresh = not plan.writes and len(plan.returns) == 1 and plan.returns[0].tensors and \
        not plan.returns[0].aliases_read and not plan.returns[0].aliases_write
    return in_place and early or (in_place or fresh) and plan.op_name.startswith("_foreach_") and \
        all(spec.type is ArgType.TENSORS for spec in plan.tensor_args)


def wants_pieces(engine: Engine, plan: OpPlan, args: tuple, kwargs: dict) -> bool:
    """Whether this call of such an op is judged in pieces: its tensors take ``PIECE_BYTES`` or more, the keeper
    could not keep it, nothing reads its whole local replay, its lists are as long as its first (or empty), and
    every tensor it writes (or, for a fresh list, reads first) is a floating strided one."""
    options, hooks = engine.options, engine.hooks
    if options.compare_cpu or hooks.world is not None or hooks.observe is not None or \
            sum(t.numel() * t.element_size() for _, t in plan.tensors(args, kwargs)) < PIECE_BYTES or \
            keepable(engine, plan, args, kwargs):
        return False
    lead = plan.tensor_args[0].get(args, kwargs)
    n = len(lead)
    written = [t for _, t in plan.tensors(args, kwargs, plan.writes)]
    # one output alone is judged whole (its effective bits read off its own rel_norm: Budget.bits)
    if len(written) < 2 and (plan.writes or n < 2):
        return False
    return all(len(spec.get(args, kwargs) or ()) in (0, n) for spec in plan.tensor_args
               if spec.type is ArgType.TENSORS) and \
        all(len(spec.get(args, kwargs) or ()) == n for spec in plan.number_lists) and \
        all(t.is_floating_point() and t.layout == torch.strided and not t.is_nested and not t._is_zerotensor()
            for t in written or lead)


def before_values(engine: Engine, plan: OpPlan, args: tuple, kwargs: dict) -> Args:
    """The call's inputs as the device has them before the op, to read after it: each tensor it writes (and any
    sharing its memory) copied where its shadow lives, in its own dtype, except the lists its step leaves as it read
    them (``shadow.budgets.left_as_read``); the others as they are, or read over where their shadows live."""
    unchanged = left_as_read(plan, args, kwargs)
    written = {t.untyped_storage().data_ptr() for spec, t in plan.tensors(args, kwargs, plan.writes)
               if spec.name not in unchanged}
    place, scratch = engine.mirror.place, engine.scratch
    seen: dict[int, torch.Tensor] = {}

    def before(t: torch.Tensor, _: Any) -> torch.Tensor:
        c = seen.get(id(t))
        if c is None:
            if t.untyped_storage().data_ptr() in written:
                c = scratch.copy(t, t.dtype, place(t.device))
            else:
                c = t if place(t.device) == t.device else engine.near(t)
            seen[id(t)] = c
        return c

    return Args(*plan.map_tensors(args, kwargs, before))


def judge_pieces(engine: Engine, prepared: Prepared, outputs: Outputs) -> Judged:
    """``judge``'s answer for a call judged in pieces: per piece, its inputs upcast, its budget built from them, the
    local replay, each written tensor's part compared with its device values and its shadow; the parts' figures
    joined per output, the call's budget its pieces' (``Budget.of_pieces``)."""
    plan, before, items = prepared.plan, prepared.before, outputs.items
    item_of = _items(plan, before)
    parts: dict[int, list] = {}  # an output judged in parts: its parts' (drift, local) figures
    done: dict[int, Compared] = {}
    bounds: dict[int, tuple] = {}  # an output judged in parts: (bounded, ulps)
    like = None  # the call's budget as its pieces' (``Budget.of_pieces``), with their scales and elements summed
    scale = accumulated = 0.0
    elements = 0
    failed = False  # a piece's budget rule failed: the call has none (counted as an internal error)
    drift = engine.options.drift
    early = builds_early(plan.func)
    for i, span, piece in _pieces(plan, before):
        local = _upcast(engine, plan, piece)
        budget = pre = None
        if not failed and early:  # from the inputs before the replay overwrites them
            budget = built_early(engine, plan, local, piece.args, piece.kwargs, prepared.inputs)
        elif not failed:  # after the replay, from copies of what it overwrites where the rule reads them
            pre = pre_inputs(engine, plan, local, False)
        result = run_chain(prepared.chain, Replay(plan, local.args, local.kwargs, None, scratch=engine.scratch))[1]
        # the piece's outputs: its written tensors, or the one it returns
        keys = [(spec.index, i) for spec, _ in plan.tensors(piece.args, piece.kwargs, plan.writes)] or [(None, i)]
        references = [t for _, t in plan.tensors(local.args, local.kwargs, plan.writes)] if plan.writes else \
            [t for _, t in flat_returns(plan, result)]
        if pre is not None:
            budget = with_bounds(engine, prepared, budget_of(engine, prepared._replace(pre=pre), references,
                                                               outputs.dtype))
        # its scale read now, while its references live
        scales = guarded(engine, plan, None, budget.scales) if budget is not None else None
        if scales is None:
            failed = True
        else:
            like = like or Budget.of_pieces(budget, (0.0, 0.0), 0)
            scale, accumulated = scale + scales[0], accumulated + scales[1]
            elements += sum(r.numel() for r in references)
        for slot, (key, reference) in enumerate(zip(keys, references)):
            k = item_of[key]
            o = items[k]
            bound, ulps = bound_of(budget, slot) if budget is not None else (None, None)
            device = engine.near(o.device, (x.device for x in items))
            if span is None:
                done[k] = figures(engine, o.shadow, device, o.shadow, reference, o.device.dtype, bound, ulps)
                continue
            parts.setdefault(k, []).append(part_figures(_cut(device, span), _cut(o.shadow, span) if drift else None,
                                                        reference, o.device.dtype, bound))
            bounds[k] = (bound is not None, ulps)
    for k, figures_of in parts.items():
        o, (bounded, ulps) = items[k], bounds[k]
        n, dtype = o.device.numel(), o.device.dtype
        stats = joined_stats([d for d, _ in figures_of], n, False, dtype) if drift else None
        done[k] = compared(engine, o.shadow, stats, joined_stats([lo for _, lo in figures_of], n, bounded, dtype),
                           False, ulps)
    figures_in_order = tuple(done[k] for k in range(len(items)))
    if failed:  # as the whole path without a budget: no output's use of it
        for c in figures_in_order:
            if c.local is not None:
                c.local.budget_used = None
    return merged_figures(engine, prepared, figures_in_order, None if failed or like is None else
                          Budget.of_pieces(like, (scale, accumulated), elements), None)


def _items(plan: OpPlan, before: Args) -> dict[tuple[int | None, int], int]:
    """(written argument, list index) -> its output's place among ``Outputs.items`` (``read_outputs``' order: the
    written tensors; (None, list index) for an op that returns a fresh list instead, one output per element)."""
    if not plan.writes:
        return {(None, i): i for i in range(len(plan.tensor_args[0].get(before.args, before.kwargs)))}
    at, k = {}, 0
    for spec in plan.writes:
        for i, t in enumerate(before.get(spec) or ()):
            if isinstance(t, torch.Tensor):
                at[spec.index, i] = k
                k += 1
    return at


def _pieces(plan: OpPlan, before: Args) -> Iterator[tuple[int, slice | None, Args]]:
    """(list index, span of its elements or None for all, the piece's arguments: every list cut to that element)."""
    lead = before.get(plan.tensor_args[0])
    lists = [spec for spec in plan.tensor_args if spec.type is ArgType.TENSORS and before.get(spec)]
    for i, param in enumerate(lead):
        tensors = [before.get(spec)[i] for spec in lists]
        shape, numel = param.shape, param.numel()
        # in runs where each written tensor is the parameter's shape, and each read one too or a number (a step)
        chunked = numel > CHUNK and can_join(param) and \
            all((t.shape == shape and t.is_contiguous()) or (t.numel() == 1 and spec.index not in plan.write_args)
                for spec, t in zip(lists, tensors))
        spans = [slice(a, min(a + CHUNK, numel)) for a in range(0, numel, CHUNK)] if chunked else [None]
        for span in spans:
            args, kwargs = list(before.args), dict(before.kwargs)
            cuts: dict[int, torch.Tensor] = {}  # a tensor in two lists (addcmul_(v, g, g)) is one tensor in the piece
            for spec, t in zip(lists, tensors):
                if id(t) not in cuts:
                    cuts[id(t)] = _cut(t, span) if t.shape == shape else t
                spec.put(args, kwargs, [cuts[id(t)]])
            for spec in plan.number_lists:
                spec.put(args, kwargs, [before.get(spec)[i]])
            yield i, span, Args(args, kwargs)


def _cut(t: torch.Tensor, span: slice | None) -> torch.Tensor:
    """Elements ``span`` of a tensor, flat (None: the tensor): a view where it is contiguous (the inputs cut always
    are), a copy of the run where not (a result a kernel laid out otherwise)."""
    return t if span is None else t.reshape(-1)[span]


def _upcast(engine: Engine, plan: OpPlan, piece: Args) -> Args:
    """A piece's arguments in their shadow dtypes where the shadows live (a tensor passed twice, upcast once)."""
    mirror, scratch = engine.mirror, engine.scratch
    seen: dict[int, torch.Tensor] = {}

    def upcast(t: torch.Tensor, _: Any) -> torch.Tensor:
        c = seen.get(id(t))
        if c is None:
            c = seen[id(t)] = scratch.copy(t, mirror.shadow_dtype(t.dtype) or t.dtype, mirror.place(t.device))
        return c

    return Args(*plan.map_tensors(piece.args, piece.kwargs, upcast))
