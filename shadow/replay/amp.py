"""Replay rules for automatic mixed precision's scale bookkeeping (``torch.amp.GradScaler``) and the fused
optimizers' ``grad_scale``/``found_inf``: their CPU kernels take those scalars in float32 only, while their shadows
are float64.

The scalars are powers of two, 0 or 1 in every real use, so each is passed to the kernel in float32 where that is
exact (a value float32 cannot hold is refused, never rounded). Whether the gradients hold NaN/Inf is the device's
decision, and the program follows it (the step is skipped, the scale backs off): the unscale rule sets ``found_inf``
from the device's own gradients, so the shadows take the step the device took.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Unsupported
from ..records import Kind
from .table import Replay, register_rule

aten = torch.ops.aten

# op base name -> its arguments the kernel takes in float32 only
_FLOAT32_SCALARS = {
    "_fused_adam": ("grad_scale", "found_inf"),
    "_fused_adamw": ("grad_scale", "found_inf"),
    "_fused_sgd": ("grad_scale", "found_inf"),
    "_fused_adagrad": ("grad_scale", "found_inf"),
    "_amp_update_scale": ("self", "found_inf"),
}


def _overloads(name: str) -> list:
    packet = getattr(aten, name, None)
    return [] if packet is None else [getattr(packet, o) for o in packet.overloads()]


def _narrowed(r: Replay, names: tuple[str, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The named float64 scalars replaced by exact float32 copies in the replay's arguments: (shadow, copy) pairs
    of those the op writes."""
    pairs = []
    for spec in r.plan.tensor_args:
        t = spec.get(r.args, r.kwargs)
        if spec.name in names and isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            narrow = t.to(torch.float32)
            if not torch.equal(narrow.double(), t):  # nan == nan is False: a NaN scale is refused too
                raise Unsupported(r.plan.name, f"its {spec.name} ({t.flatten()[:4].tolist()}) is not exact in "
                                               "float32, the only dtype its CPU kernel takes")
            spec.put(r.args, r.kwargs, narrow)
            if spec.write:
                pairs.append((t, narrow))
    return pairs


def float32_scalars_rule(r: Replay) -> Any:
    """The op's CPU kernel on the float64 shadows with its scale-like scalars in float32; those it writes
    (``_amp_update_scale_``'s scale) copied back into their shadows."""
    written = _narrowed(r, _FLOAT32_SCALARS[r.plan.base])
    out = r.plan.call(*r.args, **r.kwargs)
    for shadow, narrow in written:
        shadow.copy_(narrow)
    return Kind.REPLAYED, out


for _name in _FLOAT32_SCALARS:
    for _op in _overloads(_name + "_"):
        register_rule(_op)(float32_scalars_rule)


def unscale_rule(r: Replay) -> Any:
    """``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: every gradient times inv_scale
    in float64; found_inf set to 1 where the device's gradients hold NaN/Inf (the device's decision: ``r.local``
    holds its gradients upcast, exactly, NaN and Inf kept; without it the shadows are the device's values)."""
    grads, found_inf, inv_scale = r.arg("self"), r.arg("found_inf"), r.arg("inv_scale")
    source = grads if r.local is None else r.plan.arg(r.local.args, r.local.kwargs, "self")
    if any(not bool(torch.isfinite(g).all()) for g in source):
        found_inf.fill_(1.0)
    for g in grads:
        g.mul_(inv_scale)
    return Kind.REPLAYED, None


for _op in _overloads("_amp_foreach_non_finite_check_and_unscale_"):
    register_rule(_op)(unscale_rule)
