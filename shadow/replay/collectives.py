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
from ..opsets import Family
from ..plan import OpPlan
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


def _local(r: Replay, name: str) -> tuple[list, dict, Any]:
    """The local reference's (args, kwargs) and its argument ``name``: the engine's upcast device inputs, or
    (every input exact) copies of the shadow ones, so the shadow's own results are not written twice."""
    if r.local is not None:
        return r.local.args, r.local.kwargs, r.plan.arg(r.local.args, r.local.kwargs, name)
    copy = _map(r.arg(name), torch.Tensor.clone)
    args, kwargs = r.plan.replace(r.args, r.kwargs, **{name: copy})
    return args, kwargs, copy


def _map(v: Any, fn) -> Any:
    """``fn`` on every tensor of a Tensor, Tensor[] or Tensor[][] value, its nesting kept."""
    return fn(v) if isinstance(v, torch.Tensor) else [_map(t, fn) for t in v]


def _meta(group) -> dict:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}


def _tensors(v: Any) -> list[torch.Tensor]:
    """A Tensor, Tensor[] or Tensor[][] value as one flat list."""
    return [v] if isinstance(v, torch.Tensor) else [t for inner in v for t in _tensors(inner)]


def _pair(r: Replay, out: str, inp: str) -> tuple[list, dict, Any, Any, Any, Any]:
    """The local reference's (args, kwargs), then the shadow and local values of the arguments ``out`` and
    ``inp`` (the local output a copy where every input is exact)."""
    _mirrored(r, out)
    largs, lkwargs, lout = _local(r, out)
    return largs, lkwargs, r.arg(out), lout, r.arg(inp), r.plan.arg(largs, lkwargs, inp)


def _mirrored(r: Replay, out: str) -> None:
    """Refuse an op whose output argument ``out`` the engine's plan does not give as shadows it commits: a
    Tensor[][] (``allgather_``, ``reduce_scatter_``) the plan does not walk would hand the rule the device's
    own tensors; an output written through an argument no schema marks as written (the ops that return only
    a Work: ``*_coalesced_``) would never be committed, the rule writing the mirror behind its back."""
    spec = next((a for a in r.plan.tensor_args if a.name == out), None)
    returned = any(s.is_tensor for s in r.plan.returns)
    if spec is None or not (spec.write or returned):
        raise Unsupported(r.plan.name, f"its output {out!r} is not mirrored by this version of shadow's op plan "
                                       "(shadow.plan: Tensor[][] arguments, undeclared writes of c10d ops that "
                                       "return only a Work); the device's result is adopted")


def _gathered(parts: list[torch.Tensor], group) -> list[list[torch.Tensor]]:
    """Every rank's float64 copy of ``parts`` (rank by rank, each shaped as its part): one all_gather."""
    import torch.distributed as dist

    buf = _flat(parts)
    ranks = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(ranks, buf, group=group)  # synchronous: shadow's side group, no one else's
    return [_split(g, parts) for g in ranks]


def _reduced(parts: list[torch.Tensor], op: int, group) -> list[torch.Tensor]:
    """``parts`` reduced over the ranks in float64 (each shaped as its part): one all-reduce."""
    buf = _flat(parts)
    _all_reduce(buf, op, group)
    return _split(buf, parts)


def _split(buf: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for p in parts:
        out.append(buf[at:at + p.numel()].view(p.shape))
        at += p.numel()
    return out


def _chunk(t: torch.Tensor, rank: int, like: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s chunk of the flat ``t``, shaped as ``like`` (reduce_scatter_tensor's output)."""
    m = like.numel()
    return t.reshape(-1)[rank * m:(rank + 1) * m].view(like.shape)


def _all_reduced(r: Replay) -> tuple[list, tuple[list, dict], list, dict]:
    """allreduce_ and allreduce_coalesced_: the shadow and device inputs ``tensors`` reduced in one float64
    all-reduce on the side group, in place; the shadow outputs, the local (args, kwargs), the local outputs."""
    if r.arg("sparse_indices") is not None:
        raise Unsupported(r.plan.name, "sparse all-reduce: shadow replays dense tensors only")
    _mirrored(r, "tensors")
    op, side = _reduce_op(r), side_group(r.arg("process_group"))
    shadows = _tensors(r.arg("tensors"))
    largs, lkwargs, local = _local(r, "tensors")
    parts = shadows + _tensors(local)
    _scatter(_reduced(parts, op, side), parts)
    return shadows, (largs, lkwargs), local, _meta(side)


def _scatter(values: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
    for p, v in zip(parts, values):
        p.copy_(v)


@register_rule(c10d.allreduce_.default, family=Family.COLLECTIVE)
def allreduce_rule(r: Replay) -> tuple[Kind, Deferred]:
    """Shadow and device inputs reduced in one float64 all-reduce on the side group."""
    shadows, local_args, local, meta = _all_reduced(r)
    return Kind.REPLAYED, Deferred((shadows, None), local_args, (local, None), meta)


@register_rule(c10d.allreduce_coalesced_.default, family=Family.COLLECTIVE)
def allreduce_coalesced_rule(r: Replay) -> tuple[Kind, Deferred]:
    """dist.all_reduce_coalesced and the coalescing manager's all-reduces: as allreduce_; the op returns only
    its Work, the reduced ``tensors`` are its (undeclared) written argument."""
    _, local_args, _, meta = _all_reduced(r)
    return Kind.REPLAYED, Deferred(None, local_args, None, meta)


@register_rule(c10d.broadcast_.default, family=Family.COLLECTIVE)
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
    _scatter(_split(buf, parts), parts)
    return Kind.REPLAYED, Deferred((shadows, None), (largs, lkwargs), (local, None), _meta(side))


@register_rule(c10d._allgather_base_.default, family=Family.COLLECTIVE)
def allgather_base_rule(r: Replay) -> tuple[Kind, Deferred]:
    """all_gather_into_tensor: every rank's (shadow, device) input pair gathered on the side group."""
    side = side_group(r.arg("process_group"))
    largs, lkwargs, out, lout, inp, linp = _pair(r, "output_tensor", "input_tensor")
    ranks = _gathered([inp, linp], side)
    for k, o in enumerate((out, lout)):
        o.copy_(torch.cat([g[k].reshape(-1) for g in ranks]).view(o.shape))
    return Kind.REPLAYED, Deferred((out, None), (largs, lkwargs), (lout, None), _meta(side))


@register_rule(c10d.allgather_into_tensor_coalesced_.default, family=Family.COLLECTIVE)
def allgather_into_tensor_coalesced_rule(r: Replay) -> tuple[Kind, Deferred]:
    """The coalescing manager's all_gather_into_tensor calls: every rank's shadow and device inputs gathered
    in one all_gather on the side group; ``outputs`` is the op's (undeclared) written argument."""
    side = side_group(r.arg("process_group"))
    largs, lkwargs, outs, louts, ins, lins = _pair(r, "outputs", "inputs")
    ranks = _gathered(list(ins) + list(lins), side)
    for k, o in enumerate(list(outs) + list(louts)):
        o.copy_(torch.cat([g[k].reshape(-1) for g in ranks]).view(o.shape))
    return Kind.REPLAYED, Deferred(None, (largs, lkwargs), None, _meta(side))


@register_rule(c10d.allgather_.default, family=Family.COLLECTIVE)
def allgather_rule(r: Replay) -> tuple[Kind, Deferred]:
    """dist.all_gather (list output; FSDP1 on gloo): ``output_tensors[i][j]`` is rank j's ``input_tensors[i]``;
    every rank's shadow and device inputs gathered in one all_gather on the side group."""
    import torch.distributed as dist

    side = side_group(r.arg("process_group"))
    largs, lkwargs, outs, louts, ins, lins = _pair(r, "output_tensors", "input_tensors")
    n = dist.get_world_size(side)
    if any(len(per_rank) != n for per_rank in outs):
        raise Unsupported(r.plan.name, f"output lists of {[len(o) for o in outs]} tensors for {n} ranks")
    ranks = _gathered(list(ins) + list(lins), side)
    for k, per_rank in enumerate(list(outs) + list(louts)):
        for j, o in enumerate(per_rank):
            o.copy_(ranks[j][k].view(o.shape))
    return Kind.REPLAYED, Deferred((outs, None), (largs, lkwargs), (louts, None), _meta(side))


@register_rule(c10d._reduce_scatter_base_.default, family=Family.COLLECTIVE)
def reduce_scatter_base_rule(r: Replay) -> tuple[Kind, Deferred]:
    """reduce_scatter_tensor: an all-reduce of both inputs on the side group, each rank keeping its chunk (the
    same float64 sums; gloo has no reduce-scatter on every torch version)."""
    import torch.distributed as dist

    op, side = _reduce_op(r), side_group(r.arg("process_group"))
    largs, lkwargs, out, lout, inp, linp = _pair(r, "output_tensor", "input_tensor")
    me = dist.get_rank(side)
    for o, v in zip((out, lout), _reduced([inp, linp], op, side)):
        o.copy_(_chunk(v, me, o))
    return Kind.REPLAYED, Deferred((out, None), (largs, lkwargs), (lout, None), _meta(side))


@register_rule(c10d.reduce_scatter_tensor_coalesced_.default, family=Family.COLLECTIVE)
def reduce_scatter_tensor_coalesced_rule(r: Replay) -> tuple[Kind, Deferred]:
    """The coalescing manager's reduce_scatter_tensor calls: every input reduced in one all-reduce on the side
    group, each rank keeping its chunk; ``outputs`` is the op's (undeclared) written argument."""
    import torch.distributed as dist

    op, side = _reduce_op(r), side_group(r.arg("process_group"))
    largs, lkwargs, outs, louts, ins, lins = _pair(r, "outputs", "inputs")
    me = dist.get_rank(side)
    for o, v in zip(list(outs) + list(louts), _reduced(list(ins) + list(lins), op, side)):
        o.copy_(_chunk(v, me, o))
    return Kind.REPLAYED, Deferred(None, (largs, lkwargs), None, _meta(side))


@register_rule(c10d.reduce_scatter_.default, family=Family.COLLECTIVE)
def reduce_scatter_rule(r: Replay) -> tuple[Kind, Deferred]:
    """dist.reduce_scatter (list input; gloo has it from torch 2.5 on): ``output_tensors[i]`` is the reduction
    over the ranks of their ``input_tensors[i][me]``: every input reduced in one all-reduce on the side group."""
    import torch.distributed as dist

    op, side = _reduce_op(r), side_group(r.arg("process_group"))
    largs, lkwargs, outs, louts, ins, lins = _pair(r, "output_tensors", "input_tensors")
    me, n = dist.get_rank(side), dist.get_world_size(side)
    if any(len(per_rank) != n for per_rank in ins):
        raise Unsupported(r.plan.name, f"input lists of {[len(i) for i in ins]} tensors for {n} ranks")
    reduced = _reduced(_tensors(ins) + _tensors(lins), op, side)
    for i, o in enumerate(list(outs) + list(louts)):
        o.copy_(reduced[i * n + me].view(o.shape))
    return Kind.REPLAYED, Deferred((outs, None), (largs, lkwargs), (louts, None), _meta(side))


_REPLAYED = {c10d.allreduce_.default, c10d.allreduce_coalesced_.default, c10d.broadcast_.default,
             c10d._allgather_base_.default, c10d.allgather_.default, c10d.allgather_into_tensor_coalesced_.default,
             c10d._reduce_scatter_base_.default, c10d.reduce_scatter_.default,
             c10d.reduce_scatter_tensor_coalesced_.default}


def other_collectives(plan: OpPlan) -> bool:
    return plan.func.namespace == "c10d" and plan.func not in _REPLAYED


@register_predicate(other_collectives, family=Family.COLLECTIVE)
def other_collective_rule(r: Replay) -> Any:
    """Any other c10d op is never run on the user's group by shadow: its device results are adopted."""
    raise Unsupported(r.plan.name, "collective not replayed by shadow (replayed: all-reduce, broadcast, "
                                   "all-gather, reduce-scatter, in their tensor, list and coalesced forms); the "
                                   "device's result is adopted")
