"""Which kernel runs an op on a device, read from the dispatcher's registrations: ``cpu_fallback(func,
device)`` tells whether an op runs through the backend's CPU fallback (torch-directml 0.2.5 registers
kernels for ~300 aten ops; 489 other overloads run that way, so their "device" numerics are the CPU's)."""

from __future__ import annotations

import enum
import functools

import torch

from .. import _compat
from ..plan import plan_of


class KernelSource(str, enum.Enum):
    """Where an op's kernel comes from on a device, read from the dispatcher's registrations."""

    DEVICE = "device"  # a kernel registered for the device's dispatch key (structured ops: for their out= form)
    COMPOSITE = "composite"  # a composite kernel: the ops it calls (not seen by a dispatch mode) decide
    FALLBACK = "fallback"  # no kernel of the device's own: the backend's fallback runs it (on the CPU)


def kernel_source(func: torch._ops.OpOverload, device: torch.device | str) -> KernelSource:
    """How ``func`` runs on ``device``'s type; cached per op and device type.

    Read the way the dispatcher fills its table for the device's key: a kernel registered for the key
    itself, else a CompositeExplicitAutogradNonFunctional kernel (what structured ops such as
    ``add.Tensor`` get: it allocates and calls ``add.out``, so the answer is the out= form's), else a
    CompositeExplicitAutograd or CompositeImplicitAutograd kernel (composite: it runs other ops),
    else the backend's fallback (DirectML and MPS: on the CPU). A few composites known to end in one op
    the backend may register are followed (``convolution`` -> ``convolution_overrideable`` on PrivateUse1).
    The CPU and meta devices are their own.
    The cache assumes registrations are complete, as they are once a tensor exists on the device.

    >>> kernel_source(torch.ops.aten.linear.default, "privateuseone")
    <KernelSource.COMPOSITE: 'composite'>
    """
    device_type = torch.device(device).type
    if device_type in ("cpu", "meta"):
        return KernelSource.DEVICE
    return _kernel_source(func, _compat.dispatch_key_for_device(device_type))


# Composite ops whose kernel, on a backend without one of its own, ends in a single op that the backend may
# register (at::_convolution picks the "overrideable" convolution for PrivateUse1 devices): follow it.
aten = torch.ops.aten
_COMPOSITE_ROUTES = {
    ("PrivateUse1", aten.convolution.default): aten.convolution_overrideable.default,
    ("PrivateUse1", aten.convolution_backward.default): aten.convolution_backward_overrideable.default,
}


@functools.lru_cache(maxsize=None)
def _kernel_source(func: torch._ops.OpOverload, key: str) -> KernelSource:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    name = func.name()
    try:
        if has(name, key):
            return KernelSource.DEVICE
    except RuntimeError:  # a TorchScript-only overload (aten::__and__.bool): the dispatcher never runs it
        return KernelSource.DEVICE
    if (key, func) in _COMPOSITE_ROUTES:
        return _kernel_source(_COMPOSITE_ROUTES[key, func], key)
    if has(name, "CompositeExplicitAutogradNonFunctional"):
        out = _out_variant(func)
        return _kernel_source(out, key) if out is not None else KernelSource.COMPOSITE
    if has(name, "CompositeExplicitAutograd") or has(name, "CompositeImplicitAutograd"):
        each = _per_tensor(func)  # a foreach op's default kernel loops over the per-tensor op
        return _kernel_source(each, key) if each is not None else KernelSource.COMPOSITE
    return KernelSource.FALLBACK


# how a foreach overload's arguments name the per-tensor overload its default kernel calls
_PER_TENSOR_OVERLOADS = {"List": ("Tensor",), "ScalarList": ("Scalar", "default"), "Scalar": ("Scalar", "default"),
                         "Tensor": ("Tensor", "default"), "default": ("default",)}


def _per_tensor(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The op a foreach op's CompositeExplicitAutograd kernel calls on each tensor (``_foreach_lerp_.Scalar`` ->
    ``lerp_.Scalar``, ``_foreach_add_.List`` -> ``add_.Tensor``), or None (not a foreach op, or no such op): on a
    backend without the foreach kernel, that op's kernel source is the foreach op's (Adam's ``_foreach_lerp_``
    on DirectML runs the CPU fallback's ``lerp``)."""
    packet_name = func.name().split("::")[-1].split(".")[0]
    if not packet_name.startswith("_foreach_"):
        return None
    packet = getattr(torch.ops.aten, packet_name.removeprefix("_foreach_"), None)
    if packet is None:
        return None
    for overload in _PER_TENSOR_OVERLOADS.get(func._overloadname, ()):
        if overload in packet.overloads():
            return getattr(packet, overload)
    return None


def _out_variant(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The out= overload that a structured op's default kernel calls: same inputs, plus written out tensors
    (``add.Tensor`` and ``add_.Tensor`` -> ``add.out``)."""
    ins = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = getattr(torch.ops, func.namespace, None)
    packet = getattr(packet, plan_of(func).base, None) if packet is not None else None  # add_ -> add
    if packet is None:
        return None
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if op is func or not op._schema.is_mutable:
            continue
        args = op._schema.arguments
        is_out = [a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in args]
        rest = [(a.name, str(a.type)) for a, o in zip(args, is_out) if not o]
        if any(is_out) and rest == ins:
            return op
    return None


def cpu_fallback(func: torch._ops.OpOverload, device: torch.device | str) -> bool:
    """Whether ``func`` on ``device`` runs through the backend's CPU fallback rather than a device kernel
    (so its "device" result is the CPU's arithmetic). Composite ops count as not falling back: the ops
    they call are the ones that do or not.

    >>> cpu_fallback(torch.ops.aten.mm.default, "cpu")
    False
    """
    return kernel_source(func, device) is KernelSource.FALLBACK
