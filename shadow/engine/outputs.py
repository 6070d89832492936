"""A call's outputs to compare, read once after its replays (``Outputs``), by one of two builders of the same
values: ``read_outputs`` for every call, and ``direct_outputs`` for the calls of an op that may take the direct
path (``takes_direct_path``), which reads them without walking every kind of output."""

from __future__ import annotations

from typing import Any

import torch

from ..mirror import SHADOW_DTYPES
from ..plan import ArgType, OpPlan, flat_returns
from ..replay import DEFINED, defined_regions, view_rule
from .values import Output, Outputs, Prepared, Replayed


def takes_direct_path(plan: OpPlan, chain: tuple) -> bool:
    """Whether an op's calls may have their outputs read by ``direct_outputs``, decided once per overload: it reads
    single tensors (no lists), is replayed rather than viewed, defines every element of its outputs, and either
    writes no argument and returns fresh tensors only (no views, lists or numbers), or writes one argument in
    place, declared (its version moves), and returns it (``mul_``, ``addcdiv_``: not out= ops)."""
    if not plan.returns or chain[0] is view_rule or DEFINED.chain(plan.func) \
            or any(a.type is not ArgType.TENSOR for a in plan.tensor_args) or any(r.tensors for r in plan.returns):
        return False
    if plan.writes:
        return len(plan.writes) == 1 and not plan.out_args and plan.declared_writes == {plan.writes[0].index} \
            and len(plan.returns) == 1 and plan.returns[0].aliases_write
    return all(r.is_tensor and not r.aliases_read and not r.aliases_write for r in plan.returns)


def direct_outputs(prepared: Prepared, args: tuple, kwargs: dict, out: Any, replayed: Replayed) -> Outputs | None:
    """``read_outputs``' answer for a call of an op that takes the direct path, where every output is a floating
    strided tensor whose shadow the replay reproduced in shape and dtype (``Outputs.plain``); None for any other
    call."""
    plan = prepared.plan
    if len(plan.returns) == 1:  # one output: a fresh return, or the argument written in place
        if plan.writes:
            spec = plan.writes[0]
            device, shadow = spec.get(args, kwargs), prepared.shadow.get(spec)
            local = prepared.local.get(spec) if prepared.local is not None else None
        else:
            device, shadow, local = out, replayed.shadow, replayed.local
        if not _plain(device, shadow):
            return None
        return Outputs((Output(device, shadow, local, bool(plan.writes), 0),), 1, None, device.dtype, None, True)
    shadows = replayed.shadow
    locals_ = replayed.local if replayed.local is not None else (None,) * len(out)
    if not all(_plain(device, shadow) for device, shadow in zip(out, shadows)):
        return None
    items = tuple(Output(device, shadow, local, False, slot)
                  for slot, (device, shadow, local) in enumerate(zip(out, shadows, locals_)))
    return Outputs(items, len(items), None, items[0].device.dtype, None, True)


def _plain(device: Any, shadow: Any) -> bool:
    """Whether ``device`` is a floating strided tensor whose ``shadow`` has its shape and shadow dtype."""
    return isinstance(device, torch.Tensor) and isinstance(shadow, torch.Tensor) and device.layout == torch.strided \
        and not device.is_nested and shadow.dtype == SHADOW_DTYPES.get(device.dtype) \
        and shadow.shape == device.shape and not device._is_zerotensor()


def read_outputs(prepared: Prepared, args: tuple, kwargs: dict, out: Any, replayed: Replayed) -> Outputs:
    """Written arguments (in-place, out=), then fresh returns, then an .item()-like number, with their slots:
    an output's position among the op's flattened returns (a written argument: the return aliasing it), or
    among its written arguments where the op returns nothing."""
    plan = prepared.plan
    returned = flat_returns(plan, out)
    has_returns = any(isinstance(t, torch.Tensor) for _, t in returned)
    # a written argument's slot is the return aliasing it: only ops that write look it up
    slot_of_return = {id(t): i for i, (_, t) in enumerate(returned) if isinstance(t, torch.Tensor)} \
        if plan.writes and has_returns else {}
    items: list[Output] = []
    written = 0  # written tensors so far: the slot of the next where the op returns nothing
    for spec in plan.writes:
        device = spec.get(args, kwargs)
        if device is None:
            continue
        # the local replay ran where local args exist (replayed.local is None too for in-place ops returning nothing)
        shadow, local = prepared.shadow.get(spec), (prepared.local.get(spec) if prepared.local is not None else None)
        if isinstance(device, torch.Tensor):
            device, shadow, local = [device], [shadow], [local]
        elif local is None:
            local = [None] * len(device)
        for one, its_shadow, its_local in zip(device, shadow, local):
            if isinstance(one, torch.Tensor):
                items.append(Output(one, its_shadow, its_local, True,
                                    slot_of_return.get(id(one)) if has_returns else written))
                written += 1
    item = None
    if plan.fresh_returns:
        shadows = flat_returns(plan, replayed.shadow)
        locals_ = flat_returns(plan, replayed.local) if prepared.local is not None else [(None, None)] * len(returned)
        for slot, ((spec, device), (_, shadow), (_, local)) in enumerate(zip(returned, shadows, locals_)):
            if spec.aliases_write or spec.aliases_read:
                continue
            if isinstance(device, torch.Tensor):
                items.append(Output(device, shadow, local, False, slot))
            elif isinstance(device, (int, float, bool)) and isinstance(shadow, (int, float, bool)):  # .item(), equal
                item = (device, shadow)
                items.append(Output(device, shadow, local, False, None))
    dtype = next((o.device.dtype for o in items if isinstance(o.device, torch.Tensor)
                  and (o.device.is_floating_point() or o.device.is_complex())), None)
    if dtype is None:
        dtype = prepared.inputs[0].dtype if prepared.inputs else torch.float64
    return Outputs(tuple(items), len(returned) if has_returns else written, item, dtype,
                   defined_regions(plan, args, kwargs, out), False)
