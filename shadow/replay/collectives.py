"""Replay rules for the c10d collectives (all-reduce, broadcast, all-gather, reduce-scatter) as DDP and FSDP
issue them: on a side process group of shadow's own, never on the user's.

DDP issues its bucket all-reduces asynchronously from autograd hooks and waits later: a shadow collective on
the user's group could pair with the wrong peer collective (wrong shadows, or a gloo abort). So every user
group gets a side group (gloo, same ranks), created at the first collective shadow sees on that group: every
member issues the collectives of a group in the same order (c10d's own contract), so every member sees the
same first one and creates the side group at the same point (``use_local_synchronization``: non-members take
no part). Each shadow collective runs synchronously on the side group at the call, in program order, carrying
in one float64 buffer the shadow inputs (drift's reference) and the device's own inputs upcast (the local
error's reference: what an exact reduction of what the device sent would give). The device's outputs are
compared only when a later op touches them (``Deferred``): the user's program has waited for them by then.
docs/distributed.md has the details.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Unsupported
from ..records import Kind
from .table import Deferred, Replay, register_predicate, register_rule

c10d = torch.ops.c10d

# torch.distributed.ReduceOp.RedOpType values (the dispatcher passes the op as a ScriptObject whose ``op()``
# gives them on torch >= 2.5)
_SUM, _AVG, _PRODUCT, _MIN, _MAX = 0, 1, 2, 3, 4
_SIDE: dict[str, Any] = {}  # user group name -> shadow's side group (a group exists once per process)


def side_group(boxed: Any):
    """Shadow's gloo group for the user's group ``boxed`` (the dispatcher's ScriptObject), created on first use."""
    import torch.distributed as dist

    pg = dist.ProcessGroup.unbox(boxed) if isinstance(boxed, torch.ScriptObject) else boxed
    key = pg.group_name
    side = _SIDE.get(key)
    if side is None:
        ranks = dist.get_process_group_ranks(pg)
        side = _SIDE[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return side


def _reduce_op(r: Replay) -> int:
    boxed = r.arg("reduce_op")
    try:
        op = int(boxed.op())
    except Exception:  # torch < 2.5 exposes no method on the boxed ReduceOp: DDP and FSDP reduce with SUM
        return _SUM
    if op not in (_SUM, _AVG, _PRODUCT, _MIN, _MAX):
        raise Unsupported(r.plan.name, f"reduce op {op} (PREMUL_SUM, bitwise): shadow replays SUM, AVG, PRODUCT, "
                                       "MIN, MAX")
    return op


def _all_reduce(buf: torch.Tensor, op: int, group) -> None:
    import torch.distributed as dist

    dist_op = {_SUM: dist.ReduceOp.SUM, _AVG: dist.ReduceOp.SUM, _PRODUCT: dist.ReduceOp.PRODUCT,
               _MIN: dist.ReduceOp.MIN, _MAX: dist.ReduceOp.MAX}[op]
    dist.all_reduce(buf, op=dist_op, group=group)  # synchronous: shadow's side group, no one else's
    if op == _AVG:
        buf.div_(dist.get_world_size(group))


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1).to(torch.float64) for p in parts]) if parts else torch.zeros(0, dtype=torch.float64)


def _scatter(buf: torch.Tensor, parts: list[torch.Tensor]) -> None:
    at = 0
    for p in parts:
        n = p.numel()
        p.copy_(buf[at:at + n].view(p.shape))
        at += n


def _local(r: Replay, name: str) -> tuple[list, dict, Any]:
    """The local reference's (args, kwargs) and its argument ``name``: the engine's upcast device inputs, or
    (every input exact) copies of the shadow ones, so the shadow's own results are not written twice."""
    if r.local is not None:
        return r.local.args, r.local.kwargs, r.plan.arg(r.local.args, r.local.kwargs, name)
    v = r.arg(name)
    copy = [t.clone() for t in v] if isinstance(v, (list, tuple)) else v.clone()
    args, kwargs = r.plan.replace(r.args, r.kwargs, **{name: copy})
    return args, kwargs, copy


def _meta(group) -> dict:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}


def _tensors(v: Any) -> list[torch.Tensor]:
    return [v] if isinstance(v, torch.Tensor) else [t for t in v]


@register_rule(c10d.allreduce_.default)
def allreduce_rule(r: Replay) -> tuple[Kind, Deferred]:
    """Shadow and device inputs reduced in one float64 all-reduce on the side group."""
    if r.arg("sparse_indices") is not None:
        raise Unsupported(r.plan.name, "sparse all-reduce: shadow replays dense tensors only")
    op, side = _reduce_op(r), side_group(r.arg("process_group"))
    shadows = _tensors(r.arg("tensors"))
    largs, lkwargs, local = _local(r, "tensors")
    parts = shadows + _tensors(local)
    buf = _flat(parts)
    _all_reduce(buf, op, side)
    _scatter(buf, parts)
    return Kind.REPLAYED, Deferred((shadows, None), (largs, lkwargs), (local, None), _meta(side))


@register_rule(c10d.broadcast_.default)
def broadcast_rule(r: Replay) -> tuple[Kind, Deferred]:
    """The root's shadow and device inputs, broadcast together on the side group."""
    import torch.distributed as dist

    side = side_group(r.arg("process_group"))
    if r.arg("root_tensor", 0) != 0:
        raise Unsupported(r.plan.name, "root_tensor != 0 (several tensors per rank): not replayed")
    shadows = _tensors(r.arg("tensors"))
    largs, lkwargs, local = _local(r, "tensors")
    parts = shadows + _tensors(local)
    buf = _flat(parts)
    dist.broadcast(buf, src=dist.get_global_rank(side, r.arg("root_rank")), group=side)
    _scatter(buf, parts)
    return Kind.REPLAYED, Deferred((shadows, None), (largs, lkwargs), (local, None), _meta(side))


@register_rule(c10d._allgather_base_.default)
def allgather_base_rule(r: Replay) -> tuple[Kind, Deferred]:
    """all_gather_into_tensor: every rank's (shadow, device) input pair gathered on the side group."""
    import torch.distributed as dist

    side = side_group(r.arg("process_group"))
    out, inp = r.arg("output_tensor"), r.arg("input_tensor")
    largs, lkwargs, lout = _local(r, "output_tensor")
    linp = r.plan.arg(largs, lkwargs, "input_tensor")
    pair = _flat([inp, linp])
    n = dist.get_world_size(side)
    gathered = [torch.empty_like(pair) for _ in range(n)]
    dist.all_gather(gathered, pair, group=side)
    k = inp.numel()
    out.copy_(torch.cat([g[:k] for g in gathered]).view(out.shape))
    lout.copy_(torch.cat([g[k:] for g in gathered]).view(lout.shape))
    return Kind.REPLAYED, Deferred((out, None), (largs, lkwargs), (lout, None), _meta(side))


@register_rule(c10d._reduce_scatter_base_.default)
def reduce_scatter_base_rule(r: Replay) -> tuple[Kind, Deferred]:
    """reduce_scatter_tensor: an all-reduce of both inputs on the side group, each rank keeping its chunk (the
    same float64 sums; gloo has no reduce-scatter on every torch version)."""
    import torch.distributed as dist

    op, side = _reduce_op(r), side_group(r.arg("process_group"))
    out, inp = r.arg("output_tensor"), r.arg("input_tensor")
    largs, lkwargs, lout = _local(r, "output_tensor")
    linp = r.plan.arg(largs, lkwargs, "input_tensor")
    k = inp.numel()
    buf = _flat([inp, linp])
    _all_reduce(buf, op, side)
    me, m = dist.get_rank(side), out.numel()
    out.copy_(buf[me * m:(me + 1) * m].view(out.shape))
    lout.copy_(buf[k + me * m:k + (me + 1) * m].view(lout.shape))
    return Kind.REPLAYED, Deferred((out, None), (largs, lkwargs), (lout, None), _meta(side))


_REPLAYED = {c10d.allreduce_.default, c10d.broadcast_.default, c10d._allgather_base_.default,
             c10d._reduce_scatter_base_.default}


@register_predicate(lambda p: p.func.namespace == "c10d" and p.func not in _REPLAYED)
def other_collective_rule(r: Replay) -> Any:
    """Any other c10d op is never run on the user's group by shadow: its device results are adopted."""
    raise Unsupported(r.plan.name, "collective not replayed by shadow (replayed: all-reduce, broadcast, "
                                   "all_gather_into_tensor, reduce_scatter_tensor); the device's result is adopted")
